//! `redis` (alias `w3`; JSON `"workload": "w3"`), the Redis tier (single
//! server and cluster) through the manager, next to redis-benchmark and to a
//! raw redis-rs pipeline loop.

mod baselines;
mod coupled;
mod cpu;
mod pinning;

use std::sync::Arc;
use std::time::Duration;

use examples::{Rng, key_from_id, percentile};
use kvtier_core::{AsyncLookupManager, ManagerConfig, OffloadKey, ReqContext, Spawner};
use serde_json::{Value, json};

use self::baselines::{BenchKeys, host_port, matched_bench_keys, raw_redis_loop, redis_benchmark};
use self::coupled::coupled_floor;
use self::cpu::{CpuSample, CpuTally};
use self::pinning::{Pinning, redis_server_pids};
use crate::common::{
    Step, back_to_back_then, paired_ratio, polled_with_sleeps, round3, ttv_split, unpark_me,
};
use crate::{Cli, Failure};

/// redis: the Redis tier through the manager. Preload 50,000 keys; steps of
/// 1,024 new keys (half present) from one request each: keys/s with steps
/// issued back to back, and time-to-verdict p50/p99 over 200 steps polled
/// every 0.1 ms. Next to redis-benchmark -P 1000 EXISTS on the same server
/// (`-c 1`; on a cluster `--cluster`, one connection per master, and the
/// literal `-c 1`), both on its usual keys (short, absent) and on keys that
/// cost the server what the tier's cost (as long, half present); each also
/// with the servers pinned to a CPU of their own (see [`Pinning`]).
pub(crate) fn redis_tier(cli: &Cli) -> Result<Vec<Value>, Failure> {
    let single = std::env::var("KVTIER_REDIS_URL").ok();
    let cluster = std::env::var("KVTIER_REDIS_CLUSTER_URLS").ok();
    if single.is_none() && cluster.is_none() {
        return Err("redis (w3) needs KVTIER_REDIS_URL and/or KVTIER_REDIS_CLUSTER_URLS: run `scripts/services.sh start` and `source .services/env`".into());
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let mut lines = Vec::new();
    for (label, config) in [
        ("redis", single.map(kvtier_redis::RedisConfig::from_url)),
        (
            "redis-cluster",
            cluster.map(|urls| kvtier_redis::RedisConfig::cluster(urls.split(','))),
        ),
    ] {
        let Some(config) = config else { continue };
        let urls: Vec<String> = if config.is_cluster() {
            config.cluster_urls.clone()
        } else {
            vec![config.url.clone()]
        };
        lines.push(w3_one(cli, &rt, label, config, &urls)?);
    }
    Ok(lines)
}

fn w3_one(
    cli: &Cli,
    rt: &tokio::runtime::Runtime,
    label: &str,
    config: kvtier_redis::RedisConfig,
    urls: &[String],
) -> Result<Value, Failure> {
    const STEP: usize = 1024;
    const PRELOAD: u64 = 50_000;
    const KEY_LEN: usize = 36;
    // The wide row's steps in flight (`KVBENCH_W3_WIDE_STEPS`, default 32;
    // up to the 96 steps of a round: every step at once), and twice as
    // many call slots.
    let wide_steps = match std::env::var("KVBENCH_W3_WIDE_STEPS").ok() {
        None => 32,
        Some(v) => v
            .parse::<usize>()
            .ok()
            .filter(|&n| (1..=96).contains(&n))
            .ok_or_else(|| format!("KVBENCH_W3_WIDE_STEPS is 1 to 96, not {v:?}"))?,
    };
    let wide_calls = 2 * wide_steps;
    let throughput_steps = if cli.quick { 10 } else { 96 }; // 96 × 512 distinct present keys < 50,000
    let ttv_steps = if cli.quick { 20 } else { 200 };
    // The tier's default prefix plus a run id (the run's keys are removed at
    // the end): names of 52 bytes (58 tagged), not much longer than the default's 43 (49).
    let run = (Rng::new(cli.seed).next_u64() ^ u64::from(std::process::id())) as u32;
    let prefix = format!("kvtier:{run:08x}:");
    // Where the managers' workers run (`KVBENCH_W3_RUNTIME`):
    // - `tier` (the default): on the tier's own I/O runtime, as
    //   `RedisTier::manager` puts them: one thread for the lookups and their
    //   connections;
    // - `separate`: each manager on a runtime of its own
    //   (`AsyncLookupManager::new`), beside the tier's I/O thread;
    // - `shared`: the tier and every manager on one `Spawner` made here, as
    //   the README's embedding example sets them up.
    // On a 2-core machine with 3 masters, `shared` (the same thread layout
    // as `tier`) read 0.76 to 0.86 of the matched baseline where `separate`
    // read 0.72 to 0.83 (2026-12-08, five alternating pairs).
    let runtime = std::env::var("KVBENCH_W3_RUNTIME").unwrap_or_else(|_| "tier".to_owned());
    let shared = match runtime.as_str() {
        "tier" | "separate" => None,
        "shared" => Some(Spawner::dedicated("kvbench-w3", 1)?),
        other => {
            return Err(
                format!("KVBENCH_W3_RUNTIME is tier, separate or shared, not {other:?}").into(),
            );
        }
    };
    // `KVBENCH_W3_KEY_LAYOUT=plain` or `tagged` overrides the layout of the
    // names (default: the tier's, tagged on a cluster), for an A/B of the
    // servers' cost per key.
    let key_layout = match std::env::var("KVBENCH_W3_KEY_LAYOUT").ok() {
        None => config.key_layout,
        Some(v) if v.is_empty() => config.key_layout,
        // The configuration's own spelling (serde): "plain" or "tagged".
        Some(v) => Some(
            serde_json::from_value(Value::String(v.clone()))
                .map_err(|_| format!("KVBENCH_W3_KEY_LAYOUT is plain or tagged, not {v:?}"))?,
        ),
    };
    let tier_config = kvtier_redis::RedisConfig {
        key_prefix: prefix,
        key_layout,
        ..config
    };
    let tier = Arc::new(match &shared {
        Some(spawner) => kvtier_redis::RedisTier::with_spawner(tier_config, spawner)?,
        None => kvtier_redis::RedisTier::new(tier_config)?,
    });
    let manager = |config: &ManagerConfig| {
        if runtime == "separate" {
            AsyncLookupManager::with_wake_hook(Arc::clone(&tier), config.clone(), unpark_me())
        } else {
            // `shared`: the spawner the tier was built on; `tier`: the tier's own.
            AsyncLookupManager::with_spawner_and_wake_hook(
                Arc::clone(&tier),
                config.clone(),
                tier.spawner(),
                unpark_me(),
            )
        }
    };
    let preload: Vec<OffloadKey> = (0..PRELOAD).map(|i| key_from_id(i, KEY_LEN)).collect();
    let blocks: Vec<(OffloadKey, Vec<u8>)> =
        preload.iter().map(|k| (k.clone(), b"x".to_vec())).collect();
    rt.block_on(kvtier_core::BlockStore::store_many(tier.as_ref(), &blocks))?;
    let config = ManagerConfig {
        call_timeout_ms: 5_000,
        // The throughput run issues every step at once: room for all of
        // them, instead of the default backlog bound deferring some.
        max_queued_keys: throughput_steps * STEP,
        ..ManagerConfig::named(label)
    };
    let mut m = manager(&config)?;
    // The time-to-verdict run's own manager: its stats hold that run only.
    let mut ttv_m = manager(&config)?;
    // The same with wider in-flight limits (by default 32 steps, 64 calls
    // instead of 8 and 32): more pipelines per server at once, which a
    // cluster on 2 cores needs to keep its servers busy (a step holds its
    // place until its slowest master answers, so a master the OS scheduler
    // favours runs dry once it is that many steps ahead).
    let mut wide = manager(&ManagerConfig {
        max_steps_in_flight: wide_steps,
        max_calls_in_flight: wide_calls,
        ..config
    })?;
    let mut rng = Rng::new(cli.seed);
    let mut absent_id = 1u64 << 50;
    let mut step_keys =
        |present: &mut dyn FnMut(usize) -> OffloadKey| -> (Vec<OffloadKey>, Vec<bool>) {
            let mut keys = Vec::with_capacity(STEP);
            let mut truth = Vec::with_capacity(STEP);
            for j in 0..STEP {
                if j % 2 == 0 {
                    keys.push(present(j));
                    truth.push(true);
                } else {
                    absent_id += 1;
                    keys.push(key_from_id(absent_id, KEY_LEN));
                    truth.push(false);
                }
            }
            (keys, truth)
        };

    // Throughput: every step issued at once, then wait for the last answer;
    // five rounds, each followed by the baselines; the medians of the rates
    // and of the rounds' paired ratios are kept. After a round's cleanup its
    // keys are new to the manager again.
    let rounds = if cli.quick { 1 } else { 5 };
    // Each round times the tier over its steps this many times back to back
    // (the verdict check and the cleanup between them untimed): 96 steps
    // alone are about 40 ms, too short beside redis-benchmark's 5 s runs
    // (the first pipelines after a baseline run meet cold caches, and the
    // CPU of so short a span is counted in 10 ms ticks).
    let repeats = if cli.quick { 1 } else { 10 };
    let cluster = urls.len() > 1;
    // redis-benchmark in cluster mode exits on a 250 ms tick after its last
    // reply (measured: 1M requests took 0.52 or 0.77 s by the wall clock,
    // never in between), so its rate is understated by up to a tick. On the
    // 2026-12-07 machine 6M requests took about 1.75 s, and the matched
    // rate read 2.66, 2.99 or 3.42 M/s (6M over 2.25, 2.0 or 1.75 s): the
    // same work up to 22% apart, the low readings flattering the tier's
    // ratio. Runs of 4.5 to 5 s keep one tick near 5%; against a single
    // server it is exact.
    let (n, n_one_connection, n_pinned) = match (cli.quick, cluster) {
        (true, _) => (100_000, 100_000, 100_000),
        (false, false) => (1_000_000, 0, 1_000_000),
        // Pinned, the servers share one CPU: about half the rate.
        (false, true) => (18_000_000, 3_000_000, 9_000_000),
    };
    let usual_keys = BenchKeys::short_absent(cluster);
    let matched_keys = rt.block_on(matched_bench_keys(
        urls,
        tier.key_name(&preload[0]).len(),
        PRELOAD / urls.len() as u64,
    ))?;
    let server_pids = redis_server_pids(cluster);
    let mut matched = Vec::new();
    let mut pinned_rates = Vec::new();
    let mut pinned_baselines = Vec::new();
    let mut pinned_matched = Vec::new();
    let mut pinned_skipped = None;
    let (host, port) = host_port(&urls[0]).ok_or("cannot read host:port from the Redis URL")?;
    let mut rates = Vec::new();
    let mut baselines = Vec::new();
    // On a cluster, also the literal `-c 1`: one connection, which
    // then talks to a single master.
    let mut one_connection = Vec::new();
    // The client library alone: the same keys as EXISTS pipelines over
    // redis-rs, without the manager or the tier.
    let mut raw_client = Vec::new();
    let mut wide_rates = Vec::new();
    // The coupled floor (see `coupled`): the same steps with nothing but
    // the I/O, 8 steps in flight and every step at once.
    let mut floor8 = Vec::new();
    let mut floor_all = Vec::new();
    let mut cpu_floor8 = CpuTally::default();
    let mut cpu_floor_all = CpuTally::default();
    let mut verdict_errors = 0;
    // CPU time per key of the servers and of the client, ours (unpinned)
    // and the matched baseline's.
    let mut cpu_ours = CpuTally::default();
    let mut cpu_wide = CpuTally::default();
    let mut cpu_matched = CpuTally::default();
    for round in 0..rounds {
        let steps: Vec<Step> = (0..throughput_steps)
            .map(|s| {
                let (keys, truth) = step_keys(&mut |j| preload[s * STEP / 2 + j / 2].clone());
                (ReqContext::new(format!("w3-{round}-{s}")), keys, truth)
            })
            .collect();
        let (keys_per_s, errors) =
            repeated_back_to_back(&mut m, &steps, repeats, &server_pids, Some(&mut cpu_ours))?;
        rates.push(keys_per_s);
        verdict_errors += errors;
        let (keys_per_s, errors) = repeated_back_to_back(
            &mut wide,
            &steps,
            repeats,
            &server_pids,
            Some(&mut cpu_wide),
        )?;
        wide_rates.push(keys_per_s);
        verdict_errors += errors;
        raw_client.push(rt.block_on(raw_redis_loop(urls, &tier, &steps))?);
        floor8.push(coupled_floor(
            urls,
            &tier,
            &steps,
            8,
            repeats,
            &server_pids,
            &mut cpu_floor8,
        )?);
        floor_all.push(coupled_floor(
            urls,
            &tier,
            &steps,
            steps.len(),
            repeats,
            &server_pids,
            &mut cpu_floor_all,
        )?);
        baselines.push(redis_benchmark(
            &host,
            port,
            cluster,
            urls.len(),
            n,
            &usual_keys,
            None,
        )?);
        let before = CpuSample::now(&server_pids);
        matched.push(redis_benchmark(
            &host,
            port,
            cluster,
            urls.len(),
            n,
            &matched_keys,
            None,
        )?);
        cpu_matched.add(before, &server_pids, n as f64, true);
        if cluster {
            one_connection.push(redis_benchmark(
                &host,
                port,
                true,
                1,
                n_one_connection,
                &usual_keys,
                None,
            )?);
        }
        // The same with the servers on a CPU of their own.
        match Pinning::new(&server_pids) {
            Ok(pinning) => {
                let cpus = Some(pinning.client_cpus.as_str());
                let (keys_per_s, errors) =
                    repeated_back_to_back(&mut m, &steps, repeats, &server_pids, None)?;
                pinned_rates.push(keys_per_s);
                verdict_errors += errors;
                pinned_baselines.push(redis_benchmark(
                    &host,
                    port,
                    cluster,
                    urls.len(),
                    n_pinned,
                    &usual_keys,
                    cpus,
                )?);
                pinned_matched.push(redis_benchmark(
                    &host,
                    port,
                    cluster,
                    urls.len(),
                    n_pinned,
                    &matched_keys,
                    cpus,
                )?);
            }
            Err(why) => pinned_skipped = Some(why),
        }
    }
    let ratio = paired_ratio(&rates, &baselines);
    let matched_ratio = paired_ratio(&rates, &matched);
    let matched_rate = percentile(&matched, 0.5);
    let wide_ratio = paired_ratio(&wide_rates, &baselines);
    let wide_matched_ratio = paired_ratio(&wide_rates, &matched);
    let wide_rate = percentile(&wide_rates, 0.5);
    let raw_ratio = paired_ratio(&rates, &raw_client);
    let raw_vs_benchmark = paired_ratio(&raw_client, &baselines);
    let raw_rate = percentile(&raw_client, 0.5);
    let one_connection_ratio = cluster.then(|| paired_ratio(&rates, &one_connection));
    let one_connection_rate = cluster.then(|| percentile(&one_connection, 0.5).round());
    let keys_per_s = percentile(&rates, 0.5);
    let baseline = percentile(&baselines, 0.5);

    // Time to verdict: one step at a time, polled every 0.1 ms.
    let ttv_work: Vec<Step> = (0..ttv_steps)
        .map(|s| {
            let (keys, truth) = step_keys(&mut |_| preload[rng.below(PRELOAD) as usize].clone());
            (ReqContext::new(format!("w3-ttv-{s}")), keys, truth)
        })
        .collect();
    let mut sleeps = Vec::new();
    let (ttv, errors) =
        polled_with_sleeps(&mut ttv_m, ttv_work, Duration::from_secs(30), &mut sleeps)?;
    verdict_errors += errors;
    let ttv_stats = ttv_m.stats();
    ttv_m.shutdown();
    // Leave the server as it was (the run's names are unique to it).
    rt.block_on(kvtier_core::BlockStore::remove_many(
        tier.as_ref(),
        &preload,
    ))?;
    let stats = m.stats();
    let wide_stats = wide.stats();
    m.shutdown();
    wide.shutdown();

    let mut line = json!({
        "workload": "w3",
        "tier": label,
        "params": { "runtime": runtime, "preload": PRELOAD, "keys_per_step": STEP, "present_fraction": 0.5,
                    "throughput_steps": throughput_steps, "ttv_steps": ttv_steps, "poll_us": 100,
                    "rounds": rounds, "throughput_repeats_per_round": repeats,
                    "wide_limits": { "max_steps_in_flight": wide_steps, "max_calls_in_flight": wide_calls },
                    "baseline": "redis-benchmark -P 1000 EXISTS -c 1; on a cluster --cluster -c <masters> (and the literal -c 1, one master)",
                    "masters": urls.len(),
                    "key_layout": tier.key_layout() },
        "keys_per_s": keys_per_s.round(),
        "baseline_keys_per_s": baseline.round(),
        "ratio": round3(ratio),
        "wide_limits_keys_per_s": wide_rate.round(),
        "wide_limits_ratio": round3(wide_ratio),
        "raw_redis_rs_keys_per_s": raw_rate.round(),
        "ratio_vs_raw_redis_rs": round3(raw_ratio),
        "raw_redis_rs_vs_benchmark": round3(raw_vs_benchmark),
        "lean_pipelines": tier.pipeline_stats().lean,
        "lean_fallbacks": tier.pipeline_stats().fallbacks,
        "ttv_p50_us": round3(percentile(&ttv, 0.5)),
        "ttv_p99_us": round3(percentile(&ttv, 0.99)),
        "ttv_split": ttv_split(&ttv_stats),
        "ttv_poll_sleep_p50_us": round3(percentile(&sleeps, 0.5)),
        "ttv_poll_sleep_p99_us": round3(percentile(&sleeps, 0.99)),
        "verdict_errors": verdict_errors,
        "errors": stats.errors + stats.timeouts + wide_stats.errors + wide_stats.timeouts
            + ttv_stats.errors + ttv_stats.timeouts,
    });
    line["baseline_matched_keys_per_s"] = json!(matched_rate.round());
    // Each round's rates, in round order: the ratios above are medians of
    // per-round pairs, and how far the rounds spread is part of the reading.
    let rounded = |rates: &[f64]| rates.iter().map(|r| r.round()).collect::<Vec<_>>();
    line["per_round_keys_per_s"] = json!({
        "ours": rounded(&rates),
        "wide_limits": rounded(&wide_rates),
        "matched_baseline": rounded(&matched),
        "pinned": rounded(&pinned_rates),
        "pinned_matched_baseline": rounded(&pinned_matched),
    });
    line["cpu"] = json!({ "ours": cpu_ours.json(), "wide_limits": cpu_wide.json(), "matched_baseline": cpu_matched.json(),
                          "coupled_floor_8": cpu_floor8.json(), "coupled_floor_all": cpu_floor_all.json() });
    line["coupled_floor"] = json!({
        "keys_per_s_8": percentile(&floor8, 0.5).round(),
        "keys_per_s_all": percentile(&floor_all, 0.5).round(),
        "vs_matched_8": round3(paired_ratio(&floor8, &matched)),
        "vs_matched_all": round3(paired_ratio(&floor_all, &matched)),
        "ours_vs_8": round3(paired_ratio(&rates, &floor8)),
        "per_round_8": rounded(&floor8),
        "per_round_all": rounded(&floor_all),
    });
    line["params"]["coupled_floor"] = json!(
        "the same steps with nothing but the I/O: per step and master one pre-encoded EXISTS pipeline on a raw TCP connection, one thread, a step leaving the window when every master has answered it; 8 steps in flight (the manager's default) and every step at once"
    );
    line["params"]["cpu"] = json!(
        "CPU time from /proc/PID/stat over the unpinned runs (the tier's: the timed part, without the verdict check and cleanup after it): the servers' and the client's (this process; redis-benchmark for the baseline) per key, and the cores busy on average"
    );
    line["ratio_vs_matched"] = json!(round3(matched_ratio));
    line["wide_limits_ratio_vs_matched"] = json!(round3(wide_matched_ratio));
    line["params"]["matched_baseline"] = json!(format!(
        "redis-benchmark EXISTS {} -r {}: names as long as the tier's, half of them present",
        matched_keys.key, matched_keys.keyspace
    ));
    if pinned_rates.is_empty() {
        line["pinned_skipped"] = json!(pinned_skipped.unwrap_or_default());
    } else {
        line["pinned_ratio"] = json!(round3(paired_ratio(&pinned_rates, &pinned_baselines)));
        line["pinned_ratio_vs_matched"] =
            json!(round3(paired_ratio(&pinned_rates, &pinned_matched)));
        line["pinned_keys_per_s"] = json!(percentile(&pinned_rates, 0.5).round());
        line["pinned_baseline_keys_per_s"] = json!(percentile(&pinned_baselines, 0.5).round());
        line["pinned_baseline_matched_keys_per_s"] =
            json!(percentile(&pinned_matched, 0.5).round());
        line["params"]["pinned"] =
            json!("servers on CPU 0; kvbench and redis-benchmark on the other CPUs (taskset)");
    }
    if let (Some(rate), Some(ratio)) = (one_connection_rate, one_connection_ratio) {
        line["baseline_one_connection_keys_per_s"] = json!(rate);
        line["ratio_vs_one_connection"] = json!(round3(ratio));
    }
    Ok(line)
}

/// `m`'s keys/s over `steps` issued back to back `repeats` times (each time
/// checked and cleaned up, untimed, so the keys are new again), over the
/// timed parts together; the CPU of those parts goes into `cpu`. Returns
/// the rate and the wrong verdicts.
fn repeated_back_to_back<T: kvtier_core::Tier>(
    m: &mut AsyncLookupManager<T>,
    steps: &[Step],
    repeats: usize,
    server_pids: &[u32],
    mut cpu: Option<&mut CpuTally>,
) -> Result<(f64, u64), Failure> {
    let keys: usize = steps.iter().map(|s| s.1.len()).sum();
    let (mut secs, mut verdict_errors) = (0.0, 0);
    for _ in 0..repeats {
        // The timed part alone: the verdict check and the cleanup after it
        // are the scheduler's, with the servers idle.
        let before = CpuSample::now(server_pids);
        let mut after = None;
        let (keys_per_s, errors) = back_to_back_then(m, steps, Duration::from_secs(120), || {
            after = CpuSample::now(server_pids);
        })?;
        if let Some(cpu) = cpu.as_deref_mut() {
            cpu.add_span(before, after, keys as f64, false);
        }
        secs += keys as f64 / keys_per_s;
        verdict_errors += errors;
    }
    Ok((keys as f64 * repeats as f64 / secs, verdict_errors))
}
