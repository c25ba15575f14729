//! Where a batch's keys go: [`Shard`]s (the keys one server holds) and
//! their [`Target`]s, shared by the single-server and cluster connections.

use std::sync::Arc;

use redis::RedisError;

use crate::lean::LeanPool;

/// Why a connection-level call failed; the tier names the operation.
#[derive(Debug)]
pub(crate) enum ConnError {
    /// The client's error (from the server or the connection).
    Client(RedisError),
    /// A reply of the wrong shape.
    Reply(String),
}

impl From<RedisError> for ConnError {
    fn from(e: RedisError) -> Self {
        Self::Client(e)
    }
}

/// The keys of one batch that one server holds.
#[derive(Debug)]
pub(crate) struct Shard {
    /// The keys, in batch order.
    pub(crate) keys: Vec<Placed>,
    /// Where they go.
    pub(crate) target: Target,
}

/// A key of a batch, placed on a server.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Placed {
    /// Its position in the batch.
    pub(crate) pos: usize,
    /// Its slot (0 on a single server).
    pub(crate) slot: u16,
    /// On a cluster, the CRC its name's tag is made of, when placing it
    /// computed one (the tagged layout, a prefix without `{`; see
    /// [`Names::slot_and_tag`](crate::names::Names::slot_and_tag)); `None`
    /// otherwise, and the name's writer computes what it needs.
    pub(crate) tag: Option<u16>,
}

impl Placed {
    /// At `pos` on a single server: slot 0, no tag computed.
    pub(crate) fn single(pos: usize) -> Self {
        Self {
            pos,
            slot: 0,
            tag: None,
        }
    }
}

/// The server of a [`Shard`]: where its pipelines go.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    /// The lean path's connections to this server, if it is on.
    pub(crate) lean: Option<Arc<LeanPool>>,
    /// On a cluster, the slot whose master gets the pipelines; a key whose
    /// slot moved answers MOVED, and the shard is then asked again key by
    /// key. `None` on a single server, which holds every slot.
    pub(crate) route: Option<u16>,
}

impl Target {
    /// Whether a failed pipeline is asked again one command per key, with
    /// the cluster client following MOVED / ASK.
    pub(crate) fn follows_redirects(&self) -> bool {
        self.route.is_some()
    }

    /// Whether one multi-key command (MGET) may span the shard's keys: a
    /// single server holds every slot, a cluster master answers CROSSSLOT.
    pub(crate) fn spans_slots(&self) -> bool {
        self.route.is_none()
    }
}
