//! The simulated traffic: requests whose prompts share system-prompt
//! prefixes (and follow-up turns that extend earlier prompts), and the
//! bytes stored for each block.

use std::time::Instant;

use examples::{Rng, key_from_id};
use kvtier_core::{OffloadKey, ReqContext};

use crate::cli::Cli;

/// A request: its context, its prompt's block keys, and when it arrived.
pub(crate) struct Request {
    pub(crate) ctx: ReqContext,
    pub(crate) keys: Vec<OffloadKey>,
    pub(crate) arrived: Instant,
    pub(crate) arrived_step: usize,
}

/// A scheduled request, computing until `done_step`.
pub(crate) struct Running {
    pub(crate) request: Request,
    pub(crate) done_step: usize,
}

fn system_block(prompt: u64, i: usize) -> OffloadKey {
    // A chained content hash in vLLM; here a stable id per (prompt, position).
    key_from_id((prompt << 32) | i as u64, 36)
}

/// The bytes stored for `key`: `len` bytes derived from it, so a load can
/// be checked.
pub(crate) fn block_payload(key: &OffloadKey, len: usize) -> Vec<u8> {
    let seed = key.as_bytes();
    (0..len).map(|i| seed[i % seed.len()] ^ (i as u8)).collect()
}

/// Every request of the run, in arrival order, numbered `req-0`, `req-1`, ...
pub(crate) fn requests(cli: &Cli, rng: &mut Rng) -> Vec<Request> {
    prompts(cli, rng)
        .into_iter()
        .enumerate()
        .map(|(i, keys)| Request {
            ctx: ReqContext::new(format!("req-{i}")),
            keys,
            arrived: Instant::now(),
            arrived_step: 0,
        })
        .collect()
}

fn prompts(cli: &Cli, rng: &mut Rng) -> Vec<Vec<OffloadKey>> {
    let mut next_user_block = 1u64 << 48;
    let mut prompts: Vec<Vec<OffloadKey>> = Vec::with_capacity(cli.requests);
    for i in 0..cli.requests {
        // A follow-up turn extends an earlier conversation, which by then
        // may have been evicted from the small disk tier.
        let mut keys: Vec<OffloadKey> = if i > 100 && rng.chance(cli.follow_ups) {
            let earlier = i - 50 - rng.below((i - 50).min(400) as u64) as usize;
            prompts[earlier].clone()
        } else {
            let prompt = rng.below(cli.system_prompts);
            (0..cli.system_blocks)
                .map(|b| system_block(prompt, b))
                .collect()
        };
        for _ in 0..1 + rng.below(u64::try_from(cli.user_blocks).unwrap_or(u64::MAX)) {
            next_user_block += 1;
            keys.push(key_from_id(next_user_block, 36));
        }
        prompts.push(keys);
    }
    prompts
}
