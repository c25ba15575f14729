//! Issue 12, item 2: the S3 tier does not depend on the runtime of its
//! callers. Stores made from a tokio runtime that is then dropped (or that
//! stays alive but is never driven again) are followed by lookups through
//! the manager, on its own worker: every lookup answers exactly, with no
//! error and no timeout. aws-sdk's hyper pool spawns each connection's task
//! on the runtime of the request that opened it, so without care those
//! connections die (or freeze) with that runtime while the pool still
//! hands them out.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_core::testkit::unique_keys;
use kvtier_core::{
    AsyncLookupManager, BlockStore, LookupVerdict, ManagerConfig, OffloadKey, ReqContext, Spawner,
};
use kvtier_s3::{S3Config, S3Tier};
use kvtier_test_services::required;

/// The configured server, or `None` after saying loudly that the test skipped.
fn config(test: &str) -> Option<S3Config> {
    let (Ok(endpoint), Ok(bucket)) = (
        std::env::var("KVTIER_S3_ENDPOINT"),
        std::env::var("KVTIER_S3_BUCKET"),
    ) else {
        assert!(
            !required(),
            "KVTIER_REQUIRE_SERVICES=1 but KVTIER_S3_ENDPOINT / KVTIER_S3_BUCKET are not set"
        );
        eprintln!("SKIPPED {test}: KVTIER_S3_ENDPOINT is not set (source .services/env)");
        return None;
    };
    Some(S3Config {
        endpoint: Some(endpoint),
        force_path_style: true,
        prefix: format!("test-rt-{}/", unique_keys(1, 16)[0].to_hex()),
        // Many pooled connections, each opened by a store.
        max_concurrent_requests: 32,
        // One attempt: a request sent on a dead connection is an error
        // here, not a retry that hides it behind an attempt timeout.
        max_attempts: 1,
        ..S3Config::new(bucket)
    })
}

/// Looks `keys` up through `manager` until every one has a verdict; `true`
/// for a hit. Gives up (fails) after 30 s without an answer.
fn verdicts(manager: &mut AsyncLookupManager<S3Tier>, keys: &[OffloadKey]) -> Vec<bool> {
    let ctx = ReqContext::new("after-the-runtime");
    let start = Instant::now();
    loop {
        let answers: Vec<LookupVerdict> = keys
            .iter()
            .map(|key| manager.lookup(key, &ctx).unwrap())
            .collect();
        if !answers.contains(&LookupVerdict::Pending) {
            manager.cleanup("after-the-runtime");
            return answers.iter().map(|v| *v == LookupVerdict::Hit).collect();
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no verdict after 30 s: {:?}",
            manager.stats()
        );
        manager.flush();
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Stores half of 64 keys from `store_runtime` (dropped or not by `after`),
/// then looks all of them up through a manager, twice.
fn stores_then_lookups(
    test: &str,
    store_runtime: tokio::runtime::Runtime,
    after: impl FnOnce(tokio::runtime::Runtime),
) {
    let Some(config) = config(test) else {
        return;
    };
    let keys = unique_keys(64, 36);
    let blocks: Vec<(OffloadKey, Vec<u8>)> = keys
        .iter()
        .step_by(2)
        .map(|key| (key.clone(), vec![7; 64]))
        .collect();
    let tier = store_runtime.block_on(async {
        let tier = Arc::new(S3Tier::new(config).await.unwrap());
        // The bucket check, then 32 concurrent PUTs: up to 32 connections
        // made from this runtime, pooled by the client.
        BlockStore::store_many(&*tier, &blocks).await.unwrap();
        tier
    });
    after(store_runtime);

    let mut manager = tier
        .manager(ManagerConfig {
            call_timeout_ms: 20_000,
            ..ManagerConfig::named(test)
        })
        .unwrap();
    let truth: Vec<bool> = (0..keys.len()).map(|i| i % 2 == 0).collect();
    // Twice: the second round reuses what the first left in the pool.
    for round in 0..2 {
        let found = verdicts(&mut manager, &keys);
        assert_eq!(found, truth, "round {round}: {:?}", manager.stats());
        let stats = manager.stats();
        assert_eq!(
            (stats.errors, stats.timeouts),
            (0, 0),
            "round {round}: {stats:?}"
        );
    }
    // And a load from yet another runtime reads a block back.
    let other = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    assert_eq!(
        other.block_on(BlockStore::load(&*tier, &keys[0])).unwrap(),
        Some(vec![7; 64])
    );
    manager.shutdown();
}

#[test]
fn stores_from_a_dropped_multi_thread_runtime_then_manager_lookups_answer_exactly() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    stores_then_lookups(
        "stores_from_a_dropped_multi_thread_runtime_then_manager_lookups_answer_exactly",
        rt,
        drop,
    );
}

#[test]
fn stores_from_a_dropped_current_thread_runtime_then_manager_lookups_answer_exactly() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    stores_then_lookups(
        "stores_from_a_dropped_current_thread_runtime_then_manager_lookups_answer_exactly",
        rt,
        drop,
    );
}

#[test]
fn stores_from_a_current_thread_runtime_left_idle_then_manager_lookups_answer_exactly() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // The runtime stays alive but nothing drives it again (a caller's
    // `block_on` returned): tasks spawned on it never run.
    let (keep, kept) = std::sync::mpsc::channel();
    stores_then_lookups(
        "stores_from_a_current_thread_runtime_left_idle_then_manager_lookups_answer_exactly",
        rt,
        move |rt| keep.send(rt).unwrap(),
    );
    drop(kept);
}

#[test]
fn a_tier_on_the_callers_runtime_answers_then_fails_typed_once_that_runtime_is_gone() {
    let Some(config) =
        config("a_tier_on_the_callers_runtime_answers_then_fails_typed_once_that_runtime_is_gone")
    else {
        return;
    };
    let io = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let caller = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let tier = caller
        .block_on(S3Tier::with_spawner(
            config,
            &Spawner::from_handle(io.handle().clone()),
        ))
        .unwrap();
    let keys = unique_keys(2, 36);
    caller.block_on(async {
        BlockStore::store(&tier, &keys[0], b"on the caller's runtime")
            .await
            .unwrap();
        assert_eq!(tier.exists_many(&keys).await.unwrap(), [true, false]);
    });
    drop(io);
    let err = caller.block_on(tier.exists_many(&keys)).unwrap_err();
    assert!(
        matches!(err, kvtier_s3::S3TierError::Unavailable { .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("shut down"), "{err}");
}

/// The README's set-up: the tier's requests and its lookup manager share
/// one dedicated runtime of one thread, through one `Spawner`.
#[test]
fn a_tier_and_its_manager_on_one_spawner_answer_exactly() {
    let Some(config) = config("a_tier_and_its_manager_on_one_spawner_answer_exactly") else {
        return;
    };
    let spawner = Spawner::dedicated("kvtier-s3-shared", 1).unwrap();
    let caller = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let tier = Arc::new(
        caller
            .block_on(S3Tier::with_spawner(config, &spawner))
            .unwrap(),
    );
    let keys = unique_keys(16, 36);
    caller.block_on(async {
        for key in keys.iter().step_by(2) {
            BlockStore::store(&*tier, key, b"shared spawner")
                .await
                .unwrap();
        }
    });
    drop(caller);
    let mut manager = tier
        .manager_on(ManagerConfig::named("s3-shared"), &spawner)
        .unwrap();
    let expected: Vec<bool> = (0..keys.len()).map(|i| i % 2 == 0).collect();
    assert_eq!(verdicts(&mut manager, &keys), expected);
    assert_eq!(manager.stats().errors + manager.stats().timeouts, 0);
    manager.shutdown();
}

/// A tier keeps its spawner's runtime alive: the caller may drop the
/// dedicated `Spawner` it built the tier with, and the tier's stores,
/// loads and lookups (direct and through a manager) still run.
#[test]
fn a_tier_keeps_a_dedicated_spawner_it_was_given_alive() {
    let Some(config) = config("a_tier_keeps_a_dedicated_spawner_it_was_given_alive") else {
        return;
    };
    let spawner = Spawner::dedicated("kvtier-s3-given", 1).unwrap();
    let caller = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let tier = Arc::new(
        caller
            .block_on(S3Tier::with_spawner(config, &spawner))
            .unwrap(),
    );
    drop(spawner);
    let keys = unique_keys(4, 36);
    caller.block_on(async {
        BlockStore::store(&*tier, &keys[0], b"spawner dropped")
            .await
            .unwrap();
        assert_eq!(
            BlockStore::load(&*tier, &keys[0]).await.unwrap().as_deref(),
            Some(&b"spawner dropped"[..])
        );
        assert_eq!(
            tier.exists_many(&keys).await.unwrap(),
            [true, false, false, false]
        );
    });
    let mut manager = tier.manager(ManagerConfig::named("s3-given")).unwrap();
    assert_eq!(verdicts(&mut manager, &keys), [true, false, false, false]);
    manager.shutdown();
}
