//! The run's summary: the figures `Sim::finish` hands over, as one JSON
//! line (`--json`) or as text with the per-tier table, and the plot.

use std::path::PathBuf;
use std::time::Duration;

use examples::{percentile, plot};
use kvtier_core::ManagerStats;
use serde_json::{Value, json};

use crate::sim::Record;

/// Everything the summary shows.
pub(crate) struct Report {
    pub(crate) steps: usize,
    /// Requests the run was asked to serve.
    pub(crate) requests: usize,
    /// Every tier's call deadline (`--call-timeout-ms`).
    pub(crate) call_timeout_ms: u64,
    pub(crate) wall: Duration,
    pub(crate) tier_names: Vec<String>,
    pub(crate) disk_dir: PathBuf,
    pub(crate) stats: Vec<ManagerStats>,
    pub(crate) disk_evicted_segments: u64,
    /// Whether the stack held no state after every request's cleanup.
    pub(crate) state_empty: bool,
    pub(crate) failed_stores: usize,
    pub(crate) record: Record,
}

impl Report {
    /// Time to answer as plotted: "all requests", then one group per
    /// deepest serving tier, then the requests that found no block.
    pub(crate) fn groups(&self) -> Vec<plot::Series> {
        let mut groups = vec![plot::Series {
            name: "all requests".to_owned(),
            samples_ms: self.record.answer_ms.clone(),
        }];
        for (i, samples) in self.record.answer_ms_by_tier.iter().enumerate() {
            if samples.is_empty() {
                continue;
            }
            groups.push(plot::Series {
                name: match self.tier_names.get(i) {
                    Some(name) => format!("deepest tier {name}"),
                    None => "no block found".to_owned(),
                },
                samples_ms: samples.clone(),
            });
        }
        groups
    }

    fn hit_rate(&self) -> f64 {
        self.record.served.iter().sum::<usize>() as f64 / self.record.blocks_asked.max(1) as f64
    }

    /// The summary as one JSON value.
    pub(crate) fn json(&self) -> Value {
        let rec = &self.record;
        let tier_json = |t: &ManagerStats, blocks: usize| {
            json!({
                "tier": t.tier, "blocks_served": blocks, "lookups": t.lookups, "hits": t.hits, "misses": t.misses,
                "errors": t.errors, "timeouts": t.timeouts, "forced_misses": t.forced_misses,
                "ttv_p50_us": t.time_to_verdict.p50_us, "ttv_p99_us": t.time_to_verdict.p99_us,
                "tier_call_p50_us": t.tier_call_latency.p50_us, "tier_call_p99_us": t.tier_call_latency.p99_us,
                "first_error": t.first_error,
            })
        };
        let group_json = |g: &plot::Series| {
            let [p50, p90, p99] = [0.5, 0.9, 0.99].map(|q| percentile(&g.samples_ms, q));
            json!({
                "group": g.name, "requests": g.samples_ms.len(),
                "p50_ms": (p50 * 100.0).round() / 100.0,
                "p90_ms": (p90 * 100.0).round() / 100.0,
                "p99_ms": (p99 * 100.0).round() / 100.0,
            })
        };
        json!({
            "steps": self.steps,
            "requests_finished": rec.finished,
            "prefix_hit_rate": (self.hit_rate() * 1000.0).round() / 1000.0,
            "failed_loads_marked_miss": rec.failed_loads,
            "failed_background_stores": self.failed_stores,
            "verdict_errors": rec.verdict_errors,
            "disk_evicted_segments": self.disk_evicted_segments,
            "scheduler_us_per_step_note": "lookups and flushes; block loads and stores excluded",
            "scheduler_us_per_step_p50": percentile(&rec.sched_us, 0.5).round(),
            "scheduler_us_per_step_p99": percentile(&rec.sched_us, 0.99).round(),
            "wait_steps_p50": percentile(&rec.wait_steps, 0.5),
            "wait_steps_p99": percentile(&rec.wait_steps, 0.99),
            "answer_ms_p50": (percentile(&rec.answer_ms, 0.5) * 100.0).round() / 100.0,
            "answer_ms_p99": (percentile(&rec.answer_ms, 0.99) * 100.0).round() / 100.0,
            "state_empty_after_cleanup": self.state_empty,
            "wall_s": (self.wall.as_secs_f64() * 100.0).round() / 100.0,
            "tiers": self.stats.iter().zip(&rec.served).map(|(t, &n)| tier_json(t, n)).collect::<Vec<_>>(),
            "answer_ms_by_deepest_tier": self.groups().iter().map(group_json).collect::<Vec<_>>(),
        })
    }

    /// The summary as text: the header lines, the per-tier table, each
    /// failing tier's first error, and time to answer by group.
    pub(crate) fn print_text(&self, summary: &Value) {
        let rec = &self.record;
        println!(
            "scheduler_sim: {} steps, {} requests in {:.2} s; tiers: {} (disk in {})",
            self.steps,
            rec.finished,
            self.wall.as_secs_f64(),
            self.tier_names.join(" > "),
            self.disk_dir.display()
        );
        println!(
            "prefix hit rate {:.1}%; {} failed loads marked missing; {} verdict errors; disk evicted {} segments",
            self.hit_rate() * 100.0,
            rec.failed_loads,
            rec.verdict_errors,
            self.disk_evicted_segments
        );
        println!(
            "scheduler per step p50 / p99: {} / {} µs; time to answer p50 / p99: {} / {} ms; state empty after cleanup: {}",
            summary["scheduler_us_per_step_p50"],
            summary["scheduler_us_per_step_p99"],
            summary["answer_ms_p50"],
            summary["answer_ms_p99"],
            self.state_empty
        );
        println!();
        println!(
            "{:<14} {:>8} {:>9} {:>8} {:>8} {:>7} {:>9} {:>7} {:>16} {:>16}",
            "tier",
            "served",
            "lookups",
            "hits",
            "misses",
            "errors",
            "timeouts",
            "forced",
            "ttv p50/p99 µs",
            "call p50/p99 µs"
        );
        for (t, n) in self.stats.iter().zip(&rec.served) {
            println!(
                "{:<14} {:>8} {:>9} {:>8} {:>8} {:>7} {:>9} {:>7} {:>16} {:>16}",
                t.tier,
                n,
                t.lookups,
                t.hits,
                t.misses,
                t.errors,
                t.timeouts,
                t.forced_misses,
                format!("{}/{}", t.time_to_verdict.p50_us, t.time_to_verdict.p99_us),
                format!(
                    "{}/{}",
                    t.tier_call_latency.p50_us, t.tier_call_latency.p99_us
                ),
            );
        }
        let with_errors: Vec<&ManagerStats> = self
            .stats
            .iter()
            .filter(|t| t.first_error.is_some())
            .collect();
        if !with_errors.is_empty() {
            println!("\nfirst error of each tier that had errors or timeouts:");
            for t in with_errors {
                println!(
                    "  {}: {}",
                    t.tier,
                    t.first_error.as_deref().unwrap_or_default()
                );
            }
        }
        println!(
            "\n{:<32} {:>8} {:>10} {:>10} {:>10}",
            "time to answer (ms)", "requests", "p50", "p90", "p99"
        );
        for g in &self.groups() {
            let [p50, p90, p99] = [0.5, 0.9, 0.99].map(|q| percentile(&g.samples_ms, q));
            println!(
                "{:<32} {:>8} {:>10.2} {:>10.2} {:>10.2}",
                g.name,
                g.samples_ms.len(),
                p50,
                p90,
                p99
            );
        }
    }

    /// What went wrong in the run, one line each; empty when it was right.
    /// Wrong: a wrong answer, leaked state, an unfinished request, or a tier
    /// that missed its call deadline for most of the keys it probed (the
    /// run then measured the deadline, not the tier). A tier that is merely
    /// slow, or a failed background store, is not a failure.
    pub(crate) fn failures(&self) -> Vec<String> {
        let rec = &self.record;
        let mut failures = Vec::new();
        if rec.verdict_errors > 0 {
            failures.push(format!(
                "{} verdict errors: hits for blocks never stored in that tier",
                rec.verdict_errors
            ));
        }
        if !self.state_empty {
            failures.push("the stack still held state after every request's cleanup".to_owned());
        }
        if rec.finished != self.requests {
            failures.push(format!(
                "{} of {} requests finished",
                rec.finished, self.requests
            ));
        }
        for t in &self.stats {
            let probed = t.hits + t.misses + t.errors + t.timeouts;
            if t.timeouts > 0 && t.timeouts.saturating_mul(2) > probed {
                failures.push(format!(
                    "{} tier: {} of {} probed keys missed the {} ms call deadline \
                     (--call-timeout-ms), so they answered miss: the run measured the deadline",
                    t.tier, t.timeouts, probed, self.call_timeout_ms
                ));
            }
        }
        failures
    }
}
