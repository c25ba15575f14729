//! The scheduler loop: `Sim::set_up` builds the tiers and the traffic,
//! `Sim::step` runs one scheduler step, `Sim::finish` waits for the
//! background stores and the stack, and hands the figures to the report.

use std::collections::VecDeque;
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
    /// Background stores to the remote tiers; each answers whether it worked.
    pending_stores: Vec<JoinHandle<bool>>,
    /// Requests arriving per step: evenly over the first 80% of the run.
    per_step: usize,
    step: usize,
    started: Instant,
    progress: indicatif::ProgressBar,
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
        if self.step > self.cli.steps * 4 + 10_000 {
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
            for tier in &mut self.tiers.tiers {
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
                    self.pending_stores.push(
                        self.rt
                            .spawn(async move { store.store_many_dyn(&blocks).await.is_ok() }),
                    );
                }
            }
        }
        Ok(())
    }

    /// After the last step: waits for the background stores (a slow tier
    /// shows here, not as a silent pause) and for the stack to go idle,
    /// shuts it down, and returns the run's figures.
    pub(crate) fn finish(mut self) -> Report {
        self.progress.finish_and_clear();
        let wall = self.started.elapsed();
        let unfinished = self
            .pending_stores
            .iter()
            .filter(|h| !h.is_finished())
            .count();
        let store_bar = indicatif::ProgressBar::new(unfinished as u64);
        if unfinished > 0 {
            store_bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "{elapsed_precise} [{bar:40}] {pos}/{len} background store batches to Redis / S3 still finishing",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
        }
        let pending = std::mem::take(&mut self.pending_stores);
        let failed_stores = self.rt.block_on(async {
            let mut failed = 0;
            for store in pending {
                let was_finished = store.is_finished();
                if !store.await.unwrap_or(false) {
                    failed += 1;
                }
                if !was_finished {
                    store_bar.inc(1);
                }
            }
            failed
        });
        store_bar.finish_and_clear();
        let stack = &mut self.tiers.stack;
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
}
