//! `step-cycle` and `step-cycle-slow` (aliases and JSON `workload` `w2`,
//! `w2-slow`), the scheduler's step cycle on the zero-latency mock tier,
//! next to the minimal step loop any correct ledger must run.

use std::collections::HashMap;
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use examples::{Rng, key_from_id, micros, percentile};
use kvtier_core::{AsyncLookupManager, LookupVerdict, ManagerConfig, OffloadKey, ReqContext};
use kvtier_mock::RequestFault;
use serde_json::{Value, json};

use crate::common::{paired_ratio, quiet_mock, round3};
use crate::{Cli, Failure};

struct Request {
    ctx: ReqContext,
    keys: Vec<OffloadKey>,
    present: Vec<bool>,
    verdicts: Vec<Option<LookupVerdict>>,
}

struct Cohort {
    arrival_step: usize,
    flushed_at: Option<Instant>,
    /// Per request: context, keys, whether each key exists, verdicts so far.
    requests: Vec<Request>,
    remaining: usize,
}

/// The 1 ms between two scheduler steps, slept or (`--spin-poll`) spun;
/// the manager's step loop and its baseline are paced by this one function.
fn pace_step(cli: &Cli) {
    if cli.spin_poll {
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(1) {
            std::hint::spin_loop();
        }
    } else {
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// step-cycle and step-cycle-slow: a cohort of 64 requests × 32 keys arrives every step;
/// each step looks up every (request, key) without a verdict, flushes, and
/// sleeps 1 ms. Half of each request's keys are shared by 4 requests, half
/// of all keys exist in the tier.
///
/// Five rounds (three with `--quick`), each the manager's step loop and the
/// minimal step loop over the same cohorts, taking turns going first (each
/// side keeps its tables from round to round); the per-step figures are
/// the medians of the rounds' medians, and `ratio` the median of the rounds'
/// paired ratios, so the machine's drift between rounds cancels out. One
/// manager serves every round: after a round's cleanup its state is empty,
/// and the next round's keys are new to it again.
pub(crate) fn step_cycle(cli: &Cli, slow: bool) -> Result<Value, Failure> {
    const REQUESTS: usize = 64;
    const KEYS: usize = 32;
    const SLOW: Duration = Duration::from_millis(200);
    let cohorts = if cli.quick { 30 } else { 200 };
    let rounds = if cli.quick { 3 } else { 5 };
    let workload = if slow { "w2-slow" } else { "w2" };

    let tier = quiet_mock();
    let mut rng = Rng::new(cli.seed);
    let mut next_id = 1u64 << 40;
    let mut make_key = || {
        next_id += 1;
        let key = key_from_id(next_id, 32);
        let present = rng.chance(0.5);
        if present {
            tier.insert([key.clone()]);
        }
        (key, present)
    };
    // Per cohort, per request: its keys and whether each exists.
    let plan: Vec<Vec<(Vec<OffloadKey>, Vec<bool>)>> = (0..cohorts)
        .map(|_| {
            let shared: Vec<Vec<(OffloadKey, bool)>> = (0..REQUESTS / SHARERS)
                .map(|_| (0..KEYS / 2).map(|_| make_key()).collect())
                .collect();
            (0..REQUESTS)
                .map(|r| {
                    let mut keys = shared[r / SHARERS].clone();
                    keys.extend((0..KEYS / 2).map(|_| make_key()));
                    keys.into_iter().unzip()
                })
                .collect()
        })
        .collect();
    if slow {
        tier.set_request_fault("c0-r0", RequestFault::Delay(SLOW));
    }

    let mut m = AsyncLookupManager::from_arc(Arc::clone(&tier), ManagerConfig::named("mock"))?;
    // The baseline's map lives across rounds as the manager's tables do
    // (emptied, its capacity kept), and the two sides take turns going
    // first.
    let mut base_state = HashMap::default();
    let mut runs = Vec::new();
    let (mut sched_p50, mut base_p50, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    let (mut calls, mut errors) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        let before = m.stats();
        let (run, base_us) = if round % 2 == 0 {
            let run = manager_step_loop(cli, &mut m, &plan, slow)?;
            (run, minimal_step_loop(cli, &plan, &mut base_state)?)
        } else {
            let base_us = minimal_step_loop(cli, &plan, &mut base_state)?;
            (manager_step_loop(cli, &mut m, &plan, slow)?, base_us)
        };
        let after = m.stats();
        calls.push((after.calls_started - before.calls_started) as f64);
        errors.push(((after.errors + after.timeouts) - (before.errors + before.timeouts)) as f64);
        let (ours, base) = (percentile(&run.sched_us, 0.5), percentile(&base_us, 0.5));
        sched_p50.push(ours);
        base_p50.push(base);
        ratios.push(ours / base);
        runs.push(run);
    }
    m.shutdown();
    let ratio = paired_ratio(&sched_p50, &base_p50);
    let mut per_round = |f: &dyn Fn(&mut StepRun) -> f64| -> f64 {
        let values: Vec<f64> = runs.iter_mut().map(f).collect();
        percentile(&values, 0.5)
    };
    let sched_p99 = per_round(&|r| percentile(&r.sched_us, 0.99));
    let flush = per_round(&|r| percentile(&r.flush_us, 0.5));
    let steps_to_resolve = per_round(&|r| percentile(&r.steps_to_resolve, 0.5));
    let ttv_p50 = per_round(&|r| percentile(&r.ttv_us, 0.5));
    let ttv_p99 = per_round(&|r| percentile(&r.ttv_us, 0.99));
    let slow_ttv = per_round(&|r| percentile(&r.slow_ttv_us, 0.5));
    let verdict_errors: u64 = runs.iter().map(|r| r.verdict_errors).sum();
    let state_empty = runs.iter().all(|r| r.state_empty);
    let mut line = json!({
        "workload": workload,
        "tier": "mock",
        "params": { "cohorts": cohorts, "requests_per_step": REQUESTS, "keys_per_request": KEYS,
                    "key_len": 32, "shared_fraction": 0.5, "sharers_per_key": SHARERS,
                    "present_fraction": 0.5, "poll_ms": 1, "spin_poll": cli.spin_poll,
                    "rounds": rounds,
                    "slow_request_ms": if slow { SLOW.as_millis() as u64 } else { 0 },
                    "ttv_scope": if slow { "cohorts after the slow one" } else { "all keys" } },
        "scheduler_us_per_step": round3(percentile(&sched_p50, 0.5)),
        "baseline_us_per_step": round3(percentile(&base_p50, 0.5)),
        "ratio": round3(ratio),
        "ratio_rounds": ratios.iter().map(|r| round3(*r)).collect::<Vec<_>>(),
        "baseline": "minimal step loop: HashMap<OffloadKey, u8> get-or-insert and a push per new key, one get per resolved key, answers applied with one get_mut per key, flush moves each request's Vec",
        "scheduler_us_per_step_p99": round3(sched_p99),
        "flush_us_per_step": round3(flush),
        "steps_to_resolve": steps_to_resolve,
        "ttv_p50_us": round3(ttv_p50),
        "ttv_p99_us": round3(ttv_p99),
        "verdict_errors": verdict_errors,
        "state_empty_after_cleanup": state_empty,
        // Per round (the median of the rounds), as when step-cycle ran one round.
        "tier_calls": percentile(&calls, 0.5) as u64,
        "errors": percentile(&errors, 0.5) as u64,
    });
    if slow {
        line["slow_request_ttv_p50_us"] = json!(round3(slow_ttv));
    }
    Ok(line)
}

const SHARERS: usize = 4;

/// What one round of the manager's step loop measured.
#[derive(Default)]
struct StepRun {
    /// Scheduler time of each step: lookups and flush.
    sched_us: Vec<f64>,
    flush_us: Vec<f64>,
    steps_to_resolve: Vec<f64>,
    ttv_us: Vec<f64>,
    /// step-cycle-slow: time to verdict of the slow request's shared keys.
    slow_ttv_us: Vec<f64>,
    verdict_errors: u64,
    /// Whether the manager held nothing once every request was cleaned up
    /// and its in-flight probes had landed.
    state_empty: bool,
}

/// One round of the manager's step loop over `plan`, cohort `c`'s request
/// `r` named `c{c}-r{r}` (step-cycle-slow's fault is on `c0-r0`).
fn manager_step_loop(
    cli: &Cli,
    m: &mut AsyncLookupManager<kvtier_mock::MockTier>,
    plan: &[Vec<(Vec<OffloadKey>, Vec<bool>)>],
    slow: bool,
) -> Result<StepRun, Failure> {
    let mut pending_cohorts: Vec<Cohort> = plan
        .iter()
        .enumerate()
        .map(|(c, requests)| Cohort {
            arrival_step: 0,
            flushed_at: None,
            remaining: requests.iter().map(|(keys, _)| keys.len()).sum(),
            requests: requests
                .iter()
                .enumerate()
                .map(|(r, (keys, present))| Request {
                    ctx: ReqContext::new(format!("c{c}-r{r}")),
                    keys: keys.clone(),
                    present: present.clone(),
                    verdicts: vec![None; keys.len()],
                })
                .collect(),
        })
        .collect();
    pending_cohorts.reverse(); // pop() yields cohort 0 first
    let mut run = StepRun::default();
    let mut active: Vec<(usize, Cohort)> = Vec::new();
    let mut step = 0usize;
    let mut next_cohort = 0usize;
    // (time to verdict, keys, whether of the slow request's sharers) of
    // each request answered in the step, recorded after the step's window.
    let mut waited: Vec<(f64, usize, bool)> = Vec::new();
    let started = Instant::now();
    while !(pending_cohorts.is_empty() && active.is_empty()) {
        if started.elapsed() > Duration::from_secs(120) {
            return Err("step cycle did not finish within 120 s".into());
        }
        if let Some(mut cohort) = pending_cohorts.pop() {
            cohort.arrival_step = step;
            active.push((next_cohort, cohort));
            next_cohort += 1;
        }
        let t0 = Instant::now();
        for (c, cohort) in &mut active {
            // Every key of the cohort answered this step waited as long:
            // one time per cohort, and the samples are recorded after the
            // step's timed window (the baseline has no such bookkeeping).
            let ttv = cohort
                .flushed_at
                .map(|flushed_at| micros(t0.saturating_duration_since(flushed_at)));
            for (r, req) in cohort.requests.iter_mut().enumerate() {
                let mut answered = 0usize;
                for ((key, verdict), &present) in req
                    .keys
                    .iter()
                    .zip(req.verdicts.iter_mut())
                    .zip(&req.present)
                {
                    if verdict.is_some() {
                        continue;
                    }
                    let v = m.lookup(key, &req.ctx)?;
                    if v == LookupVerdict::Pending {
                        continue;
                    }
                    *verdict = Some(v);
                    cohort.remaining -= 1;
                    if (v == LookupVerdict::Hit) != present {
                        run.verdict_errors += 1;
                    }
                    answered += 1;
                }
                if let Some(ttv) = ttv
                    && answered > 0
                {
                    let slow_sharer = slow && *c == 0 && r < SHARERS;
                    if slow_sharer || !slow || *c > 0 {
                        waited.push((ttv, answered, slow_sharer));
                    }
                }
            }
        }
        let t_flush = Instant::now();
        m.flush();
        let t1 = Instant::now();
        run.sched_us.push(micros(t1 - t0));
        run.flush_us.push(micros(t1 - t_flush));
        for (ttv, n, slow_sharer) in waited.drain(..) {
            let samples = if slow_sharer {
                &mut run.slow_ttv_us
            } else {
                &mut run.ttv_us
            };
            samples.extend(std::iter::repeat_n(ttv, n));
        }
        for (_, cohort) in &mut active {
            cohort.flushed_at.get_or_insert(t1);
        }
        active.retain(|(_, cohort)| {
            if cohort.remaining > 0 {
                return true;
            }
            run.steps_to_resolve
                .push((step - cohort.arrival_step) as f64);
            for req in &cohort.requests {
                m.cleanup(req.ctx.req_id());
            }
            false
        });
        step += 1;
        pace_step(cli);
    }
    // Let any retained in-flight probe land, then check nothing is left.
    let wait = Instant::now();
    while !m.is_idle() && wait.elapsed() < Duration::from_secs(5) {
        m.drain_results();
        std::thread::sleep(Duration::from_millis(1));
    }
    run.state_empty = m.is_idle();
    Ok(run)
}

/// step-cycle's baseline: the step loop any correct ledger must run, over the same
/// cohorts with the same schedule (a cohort arrives each step, its keys are
/// answered by the next step), timed over the same window (answers applied,
/// lookups, flush). A new key is a get-or-insert into a
/// `HashMap<OffloadKey, u8>` plus a push onto its request's batch; a
/// resolved key one `get`; flush moves each request's `Vec` out whole. The
/// tier's answers are computed outside the timed window (the manager's come
/// from its worker thread), and applied inside it with one `get_mut` per key.
/// `state` is the map, empty on entry and on return (its capacity is kept
/// from round to round, as the manager keeps its tables). Returns the
/// microseconds of each step.
fn minimal_step_loop(
    cli: &Cli,
    plan: &[Vec<(Vec<OffloadKey>, Vec<bool>)>],
    state: &mut HashMap<OffloadKey, u8, kvtier_core::BuildPrehashed>,
) -> Result<Vec<f64>, Failure> {
    const PENDING: u8 = 0;
    const HIT: u8 = 1;
    const MISS: u8 = 2;
    struct Req<'a> {
        keys: &'a [OffloadKey],
        present: &'a [bool],
        verdicts: Vec<u8>,
    }
    let truth: HashMap<&OffloadKey, bool> = plan
        .iter()
        .flatten()
        .flat_map(|(keys, present)| keys.iter().zip(present.iter().copied()))
        .collect();
    let mut upcoming = plan.iter();
    let mut active: Vec<(Vec<Req<'_>>, usize)> = Vec::new();
    let mut answers: Vec<(Vec<OffloadKey>, Vec<bool>)> = Vec::new();
    let mut step_us = Vec::new();
    let mut verdict_errors = 0u64;
    let started = Instant::now();
    while upcoming.len() > 0 || !active.is_empty() {
        if started.elapsed() > Duration::from_secs(120) {
            return Err("minimal step loop did not finish within 120 s".into());
        }
        if let Some(cohort) = upcoming.next() {
            let reqs: Vec<Req<'_>> = cohort
                .iter()
                .map(|(keys, present)| Req {
                    keys,
                    present,
                    verdicts: vec![PENDING; keys.len()],
                })
                .collect();
            let remaining = reqs.iter().map(|r| r.keys.len()).sum();
            active.push((reqs, remaining));
        }
        let t0 = Instant::now();
        for (keys, found) in answers.drain(..) {
            for (key, present) in keys.iter().zip(found) {
                if let Some(s) = state.get_mut(key) {
                    *s = if present { HIT } else { MISS };
                }
            }
        }
        let mut batch: Vec<Vec<OffloadKey>> = Vec::new();
        for (reqs, remaining) in &mut active {
            for req in reqs.iter_mut() {
                let mut new_keys = Vec::new();
                for ((key, verdict), &present) in req
                    .keys
                    .iter()
                    .zip(req.verdicts.iter_mut())
                    .zip(req.present)
                {
                    if *verdict != PENDING {
                        continue;
                    }
                    match state.get(black_box(key)) {
                        Some(&PENDING) => continue,
                        Some(&v) => {
                            *verdict = v;
                            *remaining -= 1;
                            if (v == HIT) != present {
                                verdict_errors += 1;
                            }
                        }
                        None => {
                            state.insert(key.clone(), PENDING);
                            new_keys.push(key.clone());
                        }
                    }
                }
                if !new_keys.is_empty() {
                    batch.push(new_keys);
                }
            }
        }
        // flush: each request's keys move out whole.
        let flushed = black_box(std::mem::take(&mut batch));
        step_us.push(micros(t0.elapsed()));
        // The tier's side, outside the scheduler's time.
        for keys in flushed {
            let found = keys
                .iter()
                .map(|k| truth.get(k).copied().unwrap_or(false))
                .collect();
            answers.push((keys, found));
        }
        active.retain(|(reqs, remaining)| {
            if *remaining > 0 {
                return true;
            }
            for req in reqs {
                for key in req.keys {
                    state.remove(key);
                }
            }
            false
        });
        pace_step(cli);
    }
    if verdict_errors > 0 || !state.is_empty() {
        return Err(format!(
            "minimal step loop: {verdict_errors} wrong verdicts, {} keys left",
            state.len()
        )
        .into());
    }
    Ok(step_us)
}
