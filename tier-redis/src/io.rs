//! [`Io`]: the runtime every connection of a tier is made and driven on, a
//! [`Spawner`] the tier keeps (its own, or the caller's).
//!
//! redis-rs drives each connection from a task spawned on the runtime that
//! made it, and its `ConnectionManager` reconnects from the runtime of the
//! call that saw the connection drop; the lean path's sockets are
//! registered with the reactor of the runtime that opened them. A tier first
//! used from a short-lived runtime (a store from a request handler's
//! `block_on`) would keep its connections there after that runtime is gone,
//! and the lookup manager's worker would be left on a connection whose
//! driver is dead: every lookup an error. So every connection is made on
//! [`Io`], and callers on any runtime use those connections through
//! channels and wakers. Commands on the single server's `ConnectionManager`
//! run on [`Io`] too, so its reconnections do; a cluster connection
//! reconnects inside its own driver task, already there.

use std::future::Future;

use kvtier_core::Spawner;
use redis::{RedisError, RedisResult};

/// The runtime every connection is made and driven on: by default one
/// the tier starts (a [`Spawner::dedicated`] thread, stopped without
/// blocking when the tier drops), or the caller's
/// ([`RedisTier::with_spawner`](crate::RedisTier::with_spawner)). The tier
/// keeps the spawner, so a dedicated runtime lives as long as the tier.
pub(crate) struct Io {
    spawner: Spawner,
}

impl Io {
    /// On `spawner`'s runtime.
    pub(crate) fn new(spawner: Spawner) -> Self {
        Self { spawner }
    }

    /// Runs `fut` on the I/O runtime; dropping the returned future aborts
    /// it. If that runtime has shut down (a caller's runtime dropped
    /// before the tier), the call fails as a dropped connection.
    pub(crate) async fn run<T: Send + 'static>(
        &self,
        fut: impl Future<Output = RedisResult<T>> + Send + 'static,
    ) -> RedisResult<T> {
        match self.spawner.spawn(fut).await {
            Ok(result) => result,
            Err(e) => Err(RedisError::from(std::io::Error::new(
                std::io::ErrorKind::BrokenPipe,
                format!("the tier's I/O runtime ended the task: {e}"),
            ))),
        }
    }

    /// The spawner itself, for the lean path's connections.
    pub(crate) fn spawner(&self) -> &Spawner {
        &self.spawner
    }
}
