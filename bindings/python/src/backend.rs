//! [`Backend`]: the lookup manager inside a Python manager object, held by
//! its tier's concrete type.

use kvtier_core::{
    AsyncLookupManager, BoxFuture, DynLookupManager, LookupError, LookupVerdict, ManagerStats,
    OffloadKey, PrefixVerdict, ReqContext, ShutdownReport,
};
use kvtier_disk::DiskTier;
use kvtier_redis::RedisTier;
use kvtier_s3::S3Tier;

use crate::native::Closable;
use crate::pytier::PyTierTask;

/// The lookup manager of each kind of tier, by its concrete type: a lookup
/// loop (see [`each_backend!`]) then calls that manager's own `lookup`,
/// which the compiler inlines into the loop, instead of one virtual call
/// per key. Everything else goes through its [`DynLookupManager`] impl.
pub(crate) enum Backend {
    /// A Python subclass's `batch_lookup`.
    Python(AsyncLookupManager<PyTierTask>),
    Redis(AsyncLookupManager<Closable<RedisTier>>),
    S3(AsyncLookupManager<Closable<S3Tier>>),
    Disk(AsyncLookupManager<Closable<DiskTier>>),
}

/// Runs `$body` with `$m` bound to the concrete manager inside `$backend`.
macro_rules! each_backend {
    ($backend:expr, $m:ident => $body:expr) => {
        match $backend {
            $crate::backend::Backend::Python($m) => $body,
            $crate::backend::Backend::Redis($m) => $body,
            $crate::backend::Backend::S3($m) => $body,
            $crate::backend::Backend::Disk($m) => $body,
        }
    };
}
pub(crate) use each_backend;

impl Backend {
    /// Lets go of a native tier (after shutdown: see [`Closable`]).
    pub(crate) fn close_tier(&self) {
        match self {
            Self::Python(_) => {}
            Self::Redis(m) => m.tier().close(),
            Self::S3(m) => m.tier().close(),
            Self::Disk(m) => m.tier().close(),
        }
    }
}

impl DynLookupManager for Backend {
    fn tier_name(&self) -> &str {
        each_backend!(self, m => m.tier_name())
    }
    fn lookup(&mut self, key: &OffloadKey, ctx: &ReqContext) -> Result<LookupVerdict, LookupError> {
        each_backend!(self, m => m.lookup(key, ctx))
    }
    fn lookup_prefix(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
    ) -> Result<PrefixVerdict, LookupError> {
        each_backend!(self, m => m.lookup_prefix(keys, ctx))
    }
    fn flush(&mut self) {
        each_backend!(self, m => m.flush());
    }
    fn drain_results(&mut self) {
        each_backend!(self, m => m.drain_results());
    }
    fn mark_miss(&mut self, keys: &[OffloadKey]) {
        each_backend!(self, m => m.mark_miss(keys));
    }
    fn mark_present(&mut self, keys: &[OffloadKey]) {
        each_backend!(self, m => m.mark_present(keys));
    }
    fn cleanup(&mut self, req_id: &str) {
        each_backend!(self, m => m.cleanup(req_id));
    }
    fn stats(&self) -> ManagerStats {
        each_backend!(self, m => m.stats())
    }
    fn is_idle(&self) -> bool {
        each_backend!(self, m => m.is_idle())
    }
    fn shutdown(&mut self) -> ShutdownReport {
        each_backend!(self, m => m.shutdown())
    }
    fn shutdown_async(&mut self) -> BoxFuture<'_, ShutdownReport> {
        each_backend!(self, m => DynLookupManager::shutdown_async(m))
    }
}
