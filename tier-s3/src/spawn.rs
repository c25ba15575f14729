//! The runtime the tier's requests run on, whatever runtime calls the tier.
//!
//! aws-sdk's hyper pool spawns each connection's task on the runtime of the
//! request that opened the connection, and hands the pooled connection to
//! later requests from any runtime. A connection opened from a runtime that
//! the caller stops driving (a `block_on` that returned on a current-thread
//! runtime) then freezes every request sent on it until its attempt times
//! out. So every SDK request of a tier runs as a task on one runtime: one
//! the tier starts and owns, or one the caller hands in and keeps alive
//! (object_store's spawned connector, foyer's `Spawner`).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::runtime::{Handle, Runtime};
use tokio::task::{JoinError, JoinHandle};

/// Where the tier's requests run.
pub(crate) struct IoRuntime {
    handle: Handle,
    /// The runtime the tier started, if it did; shut down without blocking
    /// when the tier drops (a tier may drop inside another runtime).
    owned: Option<Runtime>,
}

impl IoRuntime {
    /// Starts a runtime of `threads` worker threads, owned by the tier.
    pub(crate) fn start(threads: usize) -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("kvtier-s3-io")
            .enable_all()
            .build()?;
        Ok(Self {
            handle: runtime.handle().clone(),
            owned: Some(runtime),
        })
    }

    /// Runs on the caller's runtime, which must outlive the tier's requests.
    pub(crate) fn on(handle: Handle) -> Self {
        Self {
            handle,
            owned: None,
        }
    }

    /// Runs `task` on this runtime; dropping the returned future aborts it.
    pub(crate) fn run<T: Send + 'static>(
        &self,
        task: impl Future<Output = T> + Send + 'static,
    ) -> AbortOnDrop<T> {
        AbortOnDrop(self.handle.spawn(task))
    }
}

impl Drop for IoRuntime {
    fn drop(&mut self) {
        if let Some(runtime) = self.owned.take() {
            // Never blocks: tasks still running are dropped at their next
            // yield point, and `Runtime`'s own drop would panic inside an
            // async context.
            runtime.shutdown_background();
        }
    }
}

/// A spawned task's handle that aborts the task when dropped, so that a
/// cancelled tier call cancels its request too.
pub(crate) struct AbortOnDrop<T>(JoinHandle<T>);

impl<T> Future for AbortOnDrop<T> {
    type Output = Result<T, JoinError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.0).poll(cx)
    }
}

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}
