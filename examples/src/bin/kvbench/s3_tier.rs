//! `s3` (alias `w4`; JSON `"workload": "w4"`), the S3 tier through the
//! manager at concurrency 1, 16 and 64, next to a raw aws-sdk-s3 HEAD loop.

use std::sync::Arc;
use std::time::{Duration, Instant};

use examples::{Rng, key_from_id, percentile};
use kvtier_core::{AsyncLookupManager, ManagerConfig, OffloadKey, ReqContext};
use serde_json::{Value, json};

use crate::common::{Step, back_to_back, paired_ratio, polled, round3, unpark_me};
use crate::{Cli, Failure};

/// s3: the S3 tier through the manager at concurrency 1, 16 and 64. Preload
/// 2,000 objects; steps of 256 keys (half present): keys/s with steps issued
/// back to back, and time-to-verdict p50/p99 of steps issued one at a time
/// (polled every 0.1 ms). Next to a raw aws-sdk-s3 HEAD loop over the same
/// keys at the same concurrency, without the manager.
pub(crate) fn s3_tier(cli: &Cli) -> Result<Vec<Value>, Failure> {
    use futures_util::StreamExt;
    let (Ok(endpoint), Ok(bucket)) = (
        std::env::var("KVTIER_S3_ENDPOINT"),
        std::env::var("KVTIER_S3_BUCKET"),
    ) else {
        return Err("s3 (w4) needs KVTIER_S3_ENDPOINT and KVTIER_S3_BUCKET: run `scripts/services.sh start` and `source .services/env`".into());
    };
    const STEP: usize = 256;
    const PRELOAD: u64 = 2_000;
    let throughput_steps = if cli.quick { 2 } else { 12 }; // 12 × 128 distinct present keys < 2,000
    let ttv_steps = if cli.quick { 2 } else { 10 };
    // A round lasts 0.5 to 1.5 s against a server that saturates both
    // cores, and its rate moves by ±15% from one round to the next: seven
    // rounds, and the median of the paired ratios.
    let rounds = if cli.quick { 1 } else { 7 };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let run = Rng::new(cli.seed).next_u64() ^ std::process::id() as u64;
    let base = kvtier_s3::S3Config {
        endpoint: Some(endpoint),
        force_path_style: true,
        prefix: format!("kvbench-{run:x}/"),
        ..kvtier_s3::S3Config::new(bucket.clone())
    };
    let preload: Vec<OffloadKey> = (0..PRELOAD).map(|i| key_from_id(i, 36)).collect();
    let loader = rt.block_on(kvtier_s3::S3Tier::new(base.clone()))?;
    let blocks: Vec<(OffloadKey, Vec<u8>)> =
        preload.iter().map(|k| (k.clone(), vec![0u8; 64])).collect();
    rt.block_on(kvtier_core::BlockStore::store_many(&loader, &blocks))?;
    let names: Vec<String> = preload.iter().map(|k| loader.object_name(k)).collect();

    let mut lines = Vec::new();
    let mut absent_id = 1u64 << 52;
    for concurrency in [1usize, 16, 64] {
        let tier = Arc::new(rt.block_on(kvtier_s3::S3Tier::new(kvtier_s3::S3Config {
            max_concurrent_requests: concurrency,
            ..base.clone()
        }))?);
        let mut m = AsyncLookupManager::with_wake_hook(
            Arc::clone(&tier),
            ManagerConfig {
                call_timeout_ms: 60_000,
                ..ManagerConfig::named("s3")
            },
            unpark_me(),
        )?;
        let mut make_step = |present: &mut dyn FnMut() -> usize| -> (Vec<OffloadKey>, Vec<bool>) {
            (0..STEP)
                .map(|j| {
                    if j % 2 == 0 {
                        (preload[present()].clone(), true)
                    } else {
                        absent_id += 1;
                        (key_from_id(absent_id, 36), false)
                    }
                })
                .unzip()
        };
        let mut next = 0usize;
        let steps: Vec<Step> = (0..throughput_steps)
            .map(|s| {
                let (keys, truth) = make_step(&mut || {
                    next += 1;
                    next - 1
                });
                (
                    ReqContext::new(format!("w4-{concurrency}-{s}")),
                    keys,
                    truth,
                )
            })
            .collect();
        // Baseline: the same keys, HEAD by HEAD with the SDK alone.
        let raw_names: Vec<String> = steps
            .iter()
            .flat_map(|(_, keys, _)| {
                keys.iter()
                    .map(|k| format!("{}{}", base.prefix, k.to_hex()))
            })
            .collect();
        debug_assert!(names.len() == PRELOAD as usize);
        let client = rt.block_on(async {
            let shared = aws_config::defaults(aws_config::BehaviorVersion::latest())
                .load()
                .await;
            let mut conf = aws_sdk_s3::config::Builder::from(&shared).force_path_style(true);
            if let Some(endpoint) = &base.endpoint {
                conf = conf.endpoint_url(endpoint);
            }
            let client = aws_sdk_s3::Client::from_conf(conf.build());
            let _ = client
                .head_object()
                .bucket(&bucket)
                .key("warm-up")
                .send()
                .await;
            client
        });
        let raw_loop = || {
            rt.block_on(async {
                let t = Instant::now();
                let heads = raw_names.iter().map(|name| {
                    let client = client.clone();
                    let bucket = bucket.clone();
                    async move {
                        client
                            .head_object()
                            .bucket(bucket)
                            .key(name)
                            .send()
                            .await
                            .is_ok()
                    }
                });
                let found = futures_util::stream::iter(heads)
                    .buffer_unordered(concurrency)
                    .filter(|&f| async move { f })
                    .count()
                    .await;
                (found, raw_names.len() as f64 / t.elapsed().as_secs_f64())
            })
        };
        // Rounds alternate between the manager and the raw loop; the median
        // rates and the median of each round's ratio are reported (this
        // machine's noise is larger than the difference).
        let (mut ours, mut raws) = (Vec::new(), Vec::new());
        let mut verdict_errors = 0;
        for _ in 0..rounds {
            let (keys_per_s, errors) = back_to_back(&mut m, &steps, Duration::from_secs(300))?;
            ours.push(keys_per_s);
            verdict_errors += errors;
            let (found, rate) = raw_loop();
            if found != raw_names.len() / 2 {
                return Err(format!(
                    "raw HEAD loop found {found} of {} objects",
                    raw_names.len() / 2
                )
                .into());
            }
            raws.push(rate);
        }
        let ratio = paired_ratio(&ours, &raws);
        let keys_per_s = percentile(&ours, 0.5);
        let raw = percentile(&raws, 0.5);
        let mut rng = Rng::new(cli.seed ^ concurrency as u64);
        let ttv_work: Vec<Step> = (0..ttv_steps)
            .map(|s| {
                let (keys, truth) = make_step(&mut || rng.below(PRELOAD) as usize);
                (
                    ReqContext::new(format!("w4-ttv-{concurrency}-{s}")),
                    keys,
                    truth,
                )
            })
            .collect();
        let (ttv, errors) = polled(&mut m, ttv_work, Duration::from_secs(120))?;
        verdict_errors += errors;
        let stats = m.stats();
        m.shutdown();
        lines.push(json!({
            "workload": "w4",
            "tier": "s3",
            "params": { "concurrency": concurrency, "preload": PRELOAD, "keys_per_step": STEP, "present_fraction": 0.5,
                        "throughput_steps": throughput_steps, "ttv_steps": ttv_steps, "poll_us": 100, "rounds": rounds,
                        "server": "s3s-fs on loopback", "baseline": "aws-sdk-s3 HEAD loop, buffer_unordered(concurrency)" },
            "keys_per_s": keys_per_s.round(),
            "baseline_keys_per_s": raw.round(),
            "ratio": round3(ratio),
            "ttv_p50_us": round3(percentile(&ttv, 0.5)),
            "ttv_p99_us": round3(percentile(&ttv, 0.99)),
            "verdict_errors": verdict_errors,
            "errors": stats.errors + stats.timeouts,
        }));
    }
    Ok(lines)
}
