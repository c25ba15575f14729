//! What a lookup answers: the verdicts the scheduler acts on.
//!
//! A tier's answer never reaches the scheduler directly: the [`Ledger`](crate::ledger::Ledger)
//! turns it into a verdict per key ([`LookupVerdict`]) or per prompt
//! ([`PrefixVerdict`]), and [`TierStack`](crate::TierStack) into a
//! [`StackVerdict`](crate::StackVerdict) across tiers.

/// The answer to one key's lookup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LookupVerdict {
    /// The block exists in the tier.
    Hit,
    /// The block does not exist, its probe failed, or the scheduler marked it missing.
    Miss,
    /// No answer yet; ask again next step.
    Pending,
}

/// The answer to a prefix lookup: how many leading blocks exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PrefixVerdict {
    /// Every key up to the first miss is resolved; this many leading keys are hits.
    Ready(usize),
    /// A key before the first known miss has no answer yet.
    Pending,
}
