//! The values that cross between the ledger and a transport: the tier
//! calls it wants made, how they ended, and the clock it is handed.

use std::time::Instant;

use crate::error::TierError;
use crate::key::{OffloadKey, ReqContext};

/// Identifies one tier call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CallId(pub u64);

/// One tier call the ledger wants made: one request's keys.
#[derive(Debug, Clone)]
pub struct TierCall {
    /// Pass this back to [`Ledger::complete`](super::Ledger::complete).
    pub id: CallId,
    /// The keys to probe, each once.
    pub keys: Vec<OffloadKey>,
    /// The context of the request that first asked for these keys.
    pub ctx: ReqContext,
    /// When the ledger will resolve the keys as timeouts if no answer came.
    pub deadline: Instant,
}

/// How a tier call ended.
#[derive(Debug)]
pub enum CallOutcome {
    /// The tier answered (possibly with the wrong number of results).
    Answered(Vec<bool>),
    /// The tier failed or its future panicked.
    Failed(TierError),
    /// The deadline passed first.
    TimedOut,
}

/// A clock read at most once, only when an answer needs the time.
#[derive(Debug, Clone, Copy)]
pub struct LazyNow(Option<Instant>);

impl LazyNow {
    /// Reads the system clock the first time it is needed.
    #[inline]
    pub fn new() -> Self {
        Self(None)
    }

    /// A fixed time, for tests and simulations.
    #[inline]
    pub fn at(now: Instant) -> Self {
        Self(Some(now))
    }

    /// The time.
    #[inline]
    pub fn get(&mut self) -> Instant {
        *self.0.get_or_insert_with(Instant::now)
    }
}

impl Default for LazyNow {
    fn default() -> Self {
        Self::new()
    }
}
