//! The scheduler loop: `Sim::set_up` builds the tiers and the traffic,
//! `Sim::step` runs one scheduler step, `Sim::finish` waits for the
//! background stores and the stack, and hands the figures to the report.

use std::collections::VecDeque;
use std::io::IsTerminal as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use examples::{Rng, micros};
use kvtier_core::{OffloadKey, StackVerdict};
use tokio::runtime::Runtime;
use tokio::task::JoinHandle;

use crate::Failure;
use crate::cli::Cli;
use crate::report::Report;
use crate::tiers::Tiers;
use crate::workload::{Request, Running, block_payload, requests};

/// What the steps record, for the report.
#[derive(Default)]
pub(crate) struct Record {
    /// Scheduler time per step (lookups and flush), µs.
    pub(crate) sched_us: Vec<f64>,
    /// Steps from arrival to answer, per request.
    pub(crate) wait_steps: Vec<f64>,
    /// Time from arrival to answer, per request, ms.
    pub(crate) answer_ms: Vec<f64>,
    /// Time to answer by the deepest tier that served one of the request's
    /// blocks (the answer waited for that tier and every one before it);
    /// the last group holds requests with no block found anywhere.
    pub(crate) answer_ms_by_tier: Vec<Vec<f64>>,
    /// Blocks served by each tier.
    pub(crate) served: Vec<usize>,
    pub(crate) finished: usize,
    pub(crate) blocks_asked: usize,
    pub(crate) failed_loads: usize,
    pub(crate) verdict_errors: usize,
}

/// The simulation: the tiers, the requests in every state, and what the
/// steps recorded.
pub(crate) struct Sim<'a> {
    cli: &'a Cli,
    tiers: Tiers,
    rng: Rng,
    incoming: VecDeque<Request>,
    waiting: Vec<Request>,
    running: Vec<Running>,
    /// Background stores to the remote tiers, by tier index; each answers
    /// whether it worked.
    pending_stores: Vec<(usize, JoinHandle<bool>)>,
    /// Requests arriving per step: evenly over the first 80% of the run.
    per_step: usize,
    step: usize,
    started: Instant,
    progress: indicatif::ProgressBar,
    /// Whether stderr is a terminal: a progress bar there, else a line
    /// every [`REPORT_EVERY`].
    terminal: bool,
    last_report: Instant,
    record: Record,
    /// Runs block loads and stores; dropped last.
    rt: Runtime,
}

impl<'a> Sim<'a> {
    /// Opens and checks every tier and builds the run's requests.
    pub(crate) fn set_up(cli: &'a Cli) -> Result<Self, Failure> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?;
        let tiers = Tiers::open(cli, &rt)?;
        let mut rng = Rng::new(cli.seed);
        let incoming: VecDeque<Request> = requests(cli, &mut rng).into();
        let progress = indicatif::ProgressBar::new(cli.requests as u64);
        progress.set_style(
            indicatif::ProgressStyle::with_template(
                "{elapsed_precise} [{bar:40}] {pos}/{len} requests {msg}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        let n = tiers.tiers.len();
        Ok(Self {
            cli,
            per_step: cli.requests.div_ceil((cli.steps * 4 / 5).max(1)),
            tiers,
            rng,
            incoming,
            waiting: Vec::new(),
            running: Vec::new(),
            pending_stores: Vec::new(),
            step: 0,
            started: Instant::now(),
            progress,
            terminal: std::io::stderr().is_terminal(),
            last_report: Instant::now(),
            record: Record {
                served: vec![0; n],
                answer_ms_by_tier: vec![Vec::new(); n + 1],
                ..Record::default()
            },
            rt,
        })
    }

    /// Whether every step ran and every request finished.
    pub(crate) fn is_done(&self) -> bool {
        self.step >= self.cli.steps
            && self.waiting.is_empty()
            && self.running.is_empty()
            && self.incoming.is_empty()
    }

    /// One scheduler step: arrivals, a lookup of every waiting request (and
    /// the loads of those answered), the flush, then the requests done
    /// computing store their blocks and leave; then the model's compute time.
    pub(crate) fn step(&mut self) -> Result<(), Failure> {
        // At most 10^6 each: no overflow.
        if self.step > self.cli.steps * 4 + self.cli.compute_steps + 10_000 {
            return Err("requests still unfinished long after the last step".into());
        }
        for _ in 0..self.per_step {
            if let Some(mut r) = self.incoming.pop_front() {
                r.arrived = Instant::now();
                r.arrived_step = self.step;
                self.waiting.push(r);
            }
        }
        let t0 = Instant::now();
        let load_time = self.schedule()?;
        self.tiers.stack.flush();
        self.record
            .sched_us
            .push(micros(t0.elapsed().saturating_sub(load_time)));
        self.complete()?;
        tracing::trace!(
            step = self.step,
            waiting = self.waiting.len(),
            running = self.running.len(),
            "step done"
        );
        if !self.terminal && self.last_report.elapsed() >= REPORT_EVERY {
            self.last_report = Instant::now();
            eprintln!(
                "scheduler_sim: step {} of {}, {} of {} requests finished",
                self.step + 1,
                self.cli.steps,
                self.record.finished,
                self.cli.requests
            );
        }
        self.step += 1;
        std::thread::sleep(Duration::from_micros(self.cli.step_us));
        Ok(())
    }

    /// Asks the stack for every waiting request; a request whose answer is
    /// ready has its blocks loaded and starts computing. Returns the time
    /// spent loading (an engine runs loads off the scheduler thread).
    fn schedule(&mut self) -> Result<Duration, Failure> {
        let mut load_time = Duration::ZERO;
        let mut still_waiting = Vec::with_capacity(self.waiting.len());
        let waiting = std::mem::take(&mut self.waiting);
        for request in waiting {
            let StackVerdict::Ready { locations } = self
                .tiers
                .stack
                .lookup_prefix(&request.keys, &request.ctx)?
            else {
                still_waiting.push(request);
                continue;
            };
            let load_start = Instant::now();
            let loaded = self.load_all(&request, &locations);
            load_time += load_start.elapsed();
            if !loaded? {
                still_waiting.push(request);
                continue;
            }
            let rec = &mut self.record;
            rec.blocks_asked += request.keys.len();
            for &t in &locations {
                rec.served[t] += 1;
            }
            rec.wait_steps
                .push((self.step - request.arrived_step) as f64);
            let answered_ms = request.arrived.elapsed().as_secs_f64() * 1e3;
            rec.answer_ms.push(answered_ms);
            let deepest = locations
                .iter()
                .copied()
                .max()
                .unwrap_or(self.tiers.tiers.len());
            rec.answer_ms_by_tier[deepest].push(answered_ms);
            tracing::debug!(
                req_id = request.ctx.req_id(),
                blocks_found = locations.len(),
                deepest,
                answer_ms = answered_ms,
                "request answered"
            );
            self.running.push(Running {
                request,
                done_step: self.step + self.cli.compute_steps,
            });
        }
        self.waiting = still_waiting;
        Ok(load_time)
    }

    /// Loads every found block of `request` from the tier that has it. A
    /// failed load marks the block missing in its tier and answers false:
    /// the request asks again next step.
    fn load_all(&mut self, request: &Request, locations: &[usize]) -> Result<bool, Failure> {
        for (key, &t) in request.keys.iter().zip(locations) {
            let tier = &self.tiers.tiers[t];
            if !tier.stored.contains(key) {
                self.record.verdict_errors += 1; // a hit for a block never written there
            }
            let loaded = if tier.verify_loads {
                self.rt
                    .block_on(tier.store.load_dyn(key))?
                    .is_some_and(|b| b == block_payload(key, tier.block_bytes))
            } else {
                !self.rng.chance(self.cli.load_failure)
            };
            if !loaded {
                self.record.failed_loads += 1;
                self.tiers.stack.mark_miss(t, std::slice::from_ref(key));
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Requests done computing write their blocks to every tier (the disk
    /// now, remote tiers in the background, as an engine would) and leave.
    fn complete(&mut self) -> Result<(), Failure> {
        let mut done = Vec::new();
        let (step, stack) = (self.step, &mut self.tiers.stack);
        self.running.retain_mut(|r| {
            if r.done_step > step {
                return true;
            }
            done.push(std::mem::take(&mut r.request.keys));
            stack.cleanup(r.request.ctx.req_id());
            false
        });
        for keys in done {
            self.record.finished += 1;
            self.progress.inc(1);
            for (t, tier) in self.tiers.tiers.iter_mut().enumerate() {
                tier.stored.extend(keys.iter().cloned());
                let blocks: Vec<(OffloadKey, Vec<u8>)> = keys
                    .iter()
                    .map(|k| (k.clone(), block_payload(k, tier.block_bytes)))
                    .collect();
                if tier.verify_loads {
                    // The local disk: stored now, so a failure stops the run.
                    self.rt.block_on(tier.store.store_many_dyn(&blocks))?;
                } else {
                    let store = Arc::clone(&tier.store);
                    let handle = self
                        .rt
                        .spawn(async move { store.store_many_dyn(&blocks).await.is_ok() });
                    self.pending_stores.push((t, handle));
                }
            }
        }
        Ok(())
    }

    /// After the last step: waits for the background stores (saying what
    /// it waits for, and how much is left) and for the stack to go idle,
    /// shuts it down, and returns the run's figures.
    pub(crate) fn finish(mut self) -> Report {
        self.progress.finish_and_clear();
        let wall = self.started.elapsed();
        let failed_stores = self.drain_stores();
        let stack = &mut self.tiers.stack;
        if !stack.is_idle() {
            tracing::debug!("waiting up to 5 s for the tiers' last lookups");
        }
        let idle_deadline = Instant::now() + Duration::from_secs(5);
        while !stack.is_idle() && Instant::now() < idle_deadline {
            stack.drain_results();
            std::thread::sleep(Duration::from_millis(1));
        }
        let state_empty = stack.is_idle();
        let stats = stack.stats();
        let disk_evicted_segments = self.tiers.disk.stats().evicted_segments;
        stack.shutdown();
        Report {
            steps: self.step,
            requests: self.cli.requests,
            call_timeout_ms: self.cli.call_timeout_ms,
            wall,
            tier_names: stack.tier_names(),
            disk_dir: self.tiers.disk_dir.clone(),
            stats,
            disk_evicted_segments,
            state_empty,
            failed_stores,
            record: self.record,
        }
    }

    /// Waits for the background stores to the remote tiers (a request's
    /// blocks are written after its compute, so a slow tier still has work
    /// after the last step). On a terminal a bar shows what is left;
    /// otherwise a line says so every [`REPORT_EVERY`]; either way one line
    /// says when they are done. Returns how many store batches failed.
    fn drain_stores(&mut self) -> usize {
        let pending = std::mem::take(&mut self.pending_stores);
        let total = pending.len();
        let left = |pending: &[(usize, JoinHandle<bool>)]| -> Vec<usize> {
            let mut per_tier = vec![0; self.tiers.tiers.len()];
            for (t, h) in pending {
                if !h.is_finished() {
                    per_tier[*t] += 1;
                }
            }
            per_tier
        };
        let names = self.tiers.stack.tier_names();
        let describe = |per_tier: &[usize]| -> String {
            per_tier
                .iter()
                .zip(&names)
                .filter(|(n, _)| **n > 0)
                .map(|(n, name)| format!("{name} {n}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let at_start = left(&pending);
        let unfinished: usize = at_start.iter().sum();
        let started = Instant::now();
        if unfinished > 0 {
            let bar = indicatif::ProgressBar::new(unfinished as u64);
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "{elapsed_precise} [{bar:40}] {pos}/{len} background store batches done; left: {msg}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            if !self.terminal {
                eprintln!(
                    "scheduler_sim: the steps are done; waiting for {unfinished} of {total} \
                     background store batches (by tier: {})",
                    describe(&at_start)
                );
            }
            let mut last_report = Instant::now();
            loop {
                let now_left = left(&pending);
                let still: usize = now_left.iter().sum();
                bar.set_position((unfinished - still.min(unfinished)) as u64);
                bar.set_message(describe(&now_left));
                if still == 0 {
                    break;
                }
                if !self.terminal && last_report.elapsed() >= REPORT_EVERY {
                    last_report = Instant::now();
                    eprintln!(
                        "scheduler_sim: {still} of {unfinished} background store batches left after {:.0} s (by tier: {})",
                        started.elapsed().as_secs_f64(),
                        describe(&now_left)
                    );
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            bar.finish_and_clear();
        }
        let failed = pending
            .into_iter()
            .map(|(_, h)| self.rt.block_on(h).unwrap_or(false))
            .filter(|&ok| !ok)
            .count();
        if unfinished > 0 {
            eprintln!(
                "scheduler_sim: background stores done after {:.1} s more ({failed} of {total} batches failed)",
                started.elapsed().as_secs_f64()
            );
        }
        failed
    }
}

/// How often a line reports progress when stderr is not a terminal.
const REPORT_EVERY: Duration = Duration::from_secs(5);
