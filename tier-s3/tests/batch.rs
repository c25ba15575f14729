//! The batch forms against real S3 servers (s3s-fs): what a partial failure
//! answers (objects deleted or replaced behind the tier's back, the server
//! killed), and a batch larger than the concurrency limit. Round trips at
//! 2 MiB and odd sizes are the conformance suite's (`tests/s3.rs`).

use std::sync::Arc;

use kvtier_core::testkit::{self, block_of, unique_keys};
use kvtier_core::{BlockOutcome, BlockStore, OffloadKey, TierErrorKind};
use kvtier_s3::{S3Config, S3Tier};
use kvtier_test_services::{self as support, PrivateServer};

fn config(test: &str) -> Option<S3Config> {
    let endpoint = support::service("KVTIER_S3_ENDPOINT", test)?;
    let bucket = support::service("KVTIER_S3_BUCKET", test)?;
    Some(S3Config {
        endpoint: Some(endpoint),
        force_path_style: true,
        prefix: format!("batch-{}/", unique_keys(1, 16)[0].to_hex()),
        ..S3Config::new(bucket)
    })
}

/// Loads `keys` into regions of the given lengths, filled with 0xEE first.
async fn load(
    tier: &S3Tier,
    keys: &[OffloadKey],
    lens: &[usize],
) -> (Vec<BlockOutcome>, Vec<Vec<u8>>) {
    testkit::load_regions(tier, keys, lens, 0xEE).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn objects_deleted_or_replaced_behind_the_tiers_back() {
    let Some(config) = config("objects_deleted_or_replaced_behind_the_tiers_back") else {
        return;
    };
    let tier = S3Tier::new(config.clone()).await.unwrap();
    let other = S3Tier::new(config).await.unwrap();
    let keys = unique_keys(6, 36);
    let lens = [2 << 20, 1, 300_001, 7, 65_537, 2 << 20];
    let stored: Vec<(OffloadKey, Vec<u8>)> = keys
        .iter()
        .zip(lens)
        .map(|(k, len)| (k.clone(), block_of(k, len)))
        .collect();
    let outcomes = tier.store_batch(&testkit::store_pairs(&stored)).await;
    assert!(outcomes.iter().all(BlockOutcome::is_done), "{outcomes:?}");
    // Behind the tier's back: two objects deleted, one replaced by a block
    // of another length.
    other.remove(&keys[1]).await.unwrap();
    other.remove(&keys[4]).await.unwrap();
    other.store(&keys[2], &[1; 1000]).await.unwrap();
    let (outcomes, regions) = load(&tier, &keys, &lens).await;
    for (i, outcome) in outcomes.iter().enumerate() {
        match i {
            1 | 4 => assert!(
                matches!(outcome, BlockOutcome::Absent),
                "key {i}: {outcome:?}"
            ),
            2 => assert_eq!(
                outcome.error().map(|e| e.kind()),
                Some(TierErrorKind::LengthMismatch),
                "key {i}: {outcome:?}"
            ),
            _ => {
                assert!(outcome.is_done(), "key {i}: {outcome:?}");
                assert!(regions[i] == stored[i].1, "key {i} loaded wrong");
                continue;
            }
        }
        assert!(
            regions[i].iter().all(|&b| b == 0xEE),
            "key {i}: region touched"
        );
    }
}

/// More keys than requests in flight: every one answered, in order, never
/// more requests in flight than the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_larger_than_the_limit_round_trips_within_it() {
    let Some(config) = config("a_batch_larger_than_the_limit_round_trips_within_it") else {
        return;
    };
    let tier = S3Tier::new(S3Config {
        max_concurrent_requests: 4,
        ..config
    })
    .await
    .unwrap();
    let keys = unique_keys(40, 36);
    let stored: Vec<(OffloadKey, Vec<u8>)> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| (k.clone(), block_of(k, 1 + i * 4099)))
        .collect();
    let outcomes = tier.store_batch(&testkit::store_pairs(&stored)).await;
    assert!(outcomes.iter().all(BlockOutcome::is_done), "{outcomes:?}");
    let lens: Vec<usize> = stored.iter().map(|(_, b)| b.len()).collect();
    let (outcomes, regions) = load(&tier, &keys, &lens).await;
    for (i, outcome) in outcomes.iter().enumerate() {
        assert!(
            outcome.is_done() && regions[i] == stored[i].1,
            "key {i}: {outcome:?}"
        );
    }
    assert!(tier.stats().max_in_flight <= 4, "{:?}", tier.stats());
}

/// The server killed: a batch fails every key with a transient error, soon;
/// started again (its files kept), the blocks stored before load back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_server_fails_every_key_and_the_tier_recovers() {
    let test = "a_killed_server_fails_every_key_and_the_tier_recovers";
    let Some(binary) = support::binary("s3s-fs", test) else {
        return;
    };
    let (bucket, access, secret) = ("kvtier-batch", "batch-access", "batch-secret-0123456789");
    let mut server = PrivateServer::s3(binary, bucket, access, secret);
    let tier = Arc::new(
        S3Tier::new(S3Config {
            endpoint: Some(format!("http://127.0.0.1:{}", server.port)),
            force_path_style: true,
            access_key_id: Some(access.into()),
            secret_access_key: Some(secret.into()),
            connect_timeout_ms: 300,
            request_timeout_ms: 2_000,
            max_attempts: 2,
            region: Some("us-east-1".into()),
            ..S3Config::new(bucket)
        })
        .await
        .unwrap(),
    );
    let keys = unique_keys(8, 36);
    let stored: Vec<(OffloadKey, Vec<u8>)> = keys
        .iter()
        .map(|k| (k.clone(), block_of(k, 100_003)))
        .collect();
    let outcomes = tier.store_batch(&testkit::store_pairs(&stored[..4])).await;
    assert!(outcomes.iter().all(BlockOutcome::is_done), "{outcomes:?}");

    server.kill();
    let started = std::time::Instant::now();
    let outcomes = tier.store_batch(&testkit::store_pairs(&stored[4..])).await;
    let (loaded, _) = load(&tier, &keys[..4], &[100_003; 4]).await;
    for (i, outcome) in outcomes.iter().chain(&loaded).enumerate() {
        let err = outcome
            .error()
            .unwrap_or_else(|| panic!("key {i}: {outcome:?}"));
        assert!(err.kind().is_transient(), "key {i}: {err}");
    }
    assert!(
        started.elapsed() < std::time::Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );

    server.start();
    let (loaded, regions) = load(&tier, &keys, &[100_003; 8]).await;
    for i in 0..8 {
        if i < 4 {
            assert!(
                loaded[i].is_done() && regions[i] == stored[i].1,
                "key {i}: {:?}",
                loaded[i]
            );
        } else {
            assert!(
                matches!(loaded[i], BlockOutcome::Absent),
                "key {i}: {:?}",
                loaded[i]
            );
        }
    }
}
