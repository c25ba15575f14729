//! Step admission: the flushed steps whose groups still wait for or run a
//! call, and whether a step that has not started a call yet may start one.

use std::collections::BTreeMap;

#[derive(Debug, Clone, Copy, Default)]
struct StepState {
    /// Groups of the step not yet finished (queued or in a call).
    groups: usize,
    /// Whether one of its calls has been handed out.
    started: bool,
}

/// The steps with unfinished groups, and the limit on how many of them may
/// have started a call.
///
/// Invariant: `started` is the number of steps in `steps` that have started
/// a call, and a step stays in `steps` exactly while one of its groups is
/// unfinished; so at most `max_started` steps have calls out at once,
/// whatever the number of groups each has.
#[derive(Debug)]
pub(super) struct Steps {
    steps: BTreeMap<u64, StepState>,
    started: usize,
    /// The number the next flush's step gets.
    next: u64,
    max_started: usize,
}

impl Steps {
    pub(super) fn new(max_started: usize) -> Self {
        Self {
            steps: BTreeMap::new(),
            started: 0,
            next: 0,
            max_started: max_started.max(1),
        }
    }

    /// The number of the step the next flush opens.
    #[inline]
    pub(super) fn next(&self) -> u64 {
        self.next
    }

    /// Whether a call of a step that has (`step_started`) or has not
    /// started a call yet may be handed out.
    #[inline]
    pub(super) fn admits(&self, step_started: bool) -> bool {
        step_started || self.started < self.max_started
    }

    /// Whether step `step` has started a call.
    #[inline]
    pub(super) fn is_started(&self, step: u64) -> bool {
        self.steps.get(&step).is_some_and(|s| s.started)
    }

    /// Notes that step `step` hands out a call.
    #[inline]
    pub(super) fn start(&mut self, step: u64) {
        if let Some(state) = self.steps.get_mut(&step)
            && !state.started
        {
            state.started = true;
            self.started += 1;
        }
    }

    /// Opens the step a flush made of `groups` groups (queued or in a
    /// call), `started` if it handed out a call already; a flush that made
    /// no group opens no step.
    #[inline]
    pub(super) fn open(&mut self, groups: usize, started: bool) {
        if groups == 0 {
            return;
        }
        let step = self.next;
        self.next += 1;
        self.started += usize::from(started);
        self.steps.insert(step, StepState { groups, started });
    }

    /// One group of step `step` finished (its call ended, or it had no key
    /// left to send): the step closes with its last group.
    pub(super) fn finish_group(&mut self, step: u64) {
        if let Some(state) = self.steps.get_mut(&step) {
            state.groups = state.groups.saturating_sub(1);
            if state.groups == 0 {
                if state.started {
                    self.started -= 1;
                }
                self.steps.remove(&step);
            }
        }
    }
}
