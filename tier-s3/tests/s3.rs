//! The S3 tier against a real S3 server (s3s-fs from scripts/services.sh,
//! which checks request signatures): conformance, round trips, errors, and
//! the shared concurrency limit.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_test_services::required;
use lookup_core::testkit::{self, TierFixture, unique_keys};
use lookup_core::{OffloadKey, ReqContext, Tier, TierError, TierErrorKind};
use tier_s3::{S3Config, S3Tier, S3TierError};

/// The configured server, or `None` after saying loudly that the test skipped.
fn config(test: &str) -> Option<S3Config> {
    let (Ok(endpoint), Ok(bucket)) = (
        std::env::var("KVTIER_S3_ENDPOINT"),
        std::env::var("KVTIER_S3_BUCKET"),
    ) else {
        if required() {
            panic!(
                "KVTIER_REQUIRE_SERVICES=1 but KVTIER_S3_ENDPOINT / KVTIER_S3_BUCKET are not set: run `scripts/services.sh start`"
            );
        }
        eprintln!(
            "SKIPPED {test}: KVTIER_S3_ENDPOINT is not set (run `scripts/services.sh start` and `source .services/env`)"
        );
        return None;
    };
    Some(S3Config {
        endpoint: Some(endpoint),
        force_path_style: true,
        prefix: format!("test-{}/", unique_keys(1, 16)[0].to_hex()),
        ..S3Config::new(bucket)
    })
}

struct S3Fixture(Arc<S3Tier>);

impl TierFixture for S3Fixture {
    type Tier = S3Tier;

    fn tier(&self) -> Arc<S3Tier> {
        Arc::clone(&self.0)
    }

    async fn insert(&self, keys: &[OffloadKey]) -> Result<(), TierError> {
        Ok(self
            .0
            .store_many(
                keys.iter()
                    .map(|k| (k.clone(), k.as_bytes().to_vec()))
                    .collect(),
            )
            .await?)
    }

    async fn remove(&self, keys: &[OffloadKey]) -> Result<(), TierError> {
        for key in keys {
            self.0.remove(key).await?;
        }
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance() {
    let Some(config) = config("conformance") else {
        return;
    };
    testkit::run_all(&S3Fixture(Arc::new(S3Tier::new(config).await.unwrap()))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trips_of_0_4k_and_8m_payloads() {
    let Some(config) = config("round_trips_of_0_4k_and_8m_payloads") else {
        return;
    };
    let tier = S3Tier::new(config).await.unwrap();
    let keys = unique_keys(4, 36);
    let payloads: Vec<Vec<u8>> = vec![
        Vec::new(),
        (0..4096).map(|i| i as u8).collect(),
        (0..8 << 20).map(|i| (i * 7) as u8).collect(),
    ];
    for (key, payload) in keys.iter().zip(&payloads) {
        tier.store(key, payload.clone()).await.unwrap();
    }
    assert_eq!(
        tier.exists_many(&keys).await.unwrap(),
        [true, true, true, false]
    );
    for (key, payload) in keys.iter().zip(&payloads) {
        assert_eq!(
            tier.load(key).await.unwrap().as_ref(),
            Some(payload),
            "{} bytes",
            payload.len()
        );
    }
    assert_eq!(tier.load(&keys[3]).await.unwrap(), None);
    tier.remove(&keys[1]).await.unwrap();
    tier.remove(&keys[3]).await.unwrap(); // absent: not an error
    assert_eq!(
        tier.exists_many(&keys).await.unwrap(),
        [true, false, true, false]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_thousand_key_batches_and_an_empty_bucket() {
    let Some(config) = config("five_thousand_key_batches_and_an_empty_bucket") else {
        return;
    };
    // A bucket of its own, new and empty.
    let empty = S3Tier::new(S3Config {
        bucket: format!("kvtier-empty-{}", &unique_keys(1, 16)[0].to_hex()[16..28]),
        ..config.clone()
    })
    .await
    .unwrap();
    empty.create_bucket_if_missing().await.unwrap();
    let keys = unique_keys(5000, 36);
    let found = empty.exists_many(&keys).await.unwrap();
    assert_eq!(found.len(), 5000);
    assert!(found.iter().all(|&f| !f));

    let tier = S3Tier::new(config).await.unwrap();
    let present: Vec<(OffloadKey, Vec<u8>)> = keys
        .iter()
        .step_by(4)
        .map(|k| (k.clone(), vec![1]))
        .collect();
    tier.store_many(present).await.unwrap();
    let found = tier
        .batch_lookup(&keys, &ReqContext::new("big"))
        .await
        .unwrap();
    let wrong = found
        .iter()
        .enumerate()
        .filter(|&(i, &f)| f != (i % 4 == 0))
        .count();
    assert_eq!(wrong, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_concurrency_limit_is_shared_by_all_batches() {
    let Some(config) = config("the_concurrency_limit_is_shared_by_all_batches") else {
        return;
    };
    let tier = Arc::new(
        S3Tier::new(S3Config {
            max_concurrent_requests: 5,
            ..config
        })
        .await
        .unwrap(),
    );
    let batches: Vec<_> = (0..6)
        .map(|_| {
            let tier = Arc::clone(&tier);
            tokio::spawn(async move { tier.exists_many(&unique_keys(200, 36)).await })
        })
        .collect();
    for batch in batches {
        assert!(batch.await.unwrap().unwrap().iter().all(|&f| !f));
    }
    let stats = tier.stats();
    assert!(stats.max_in_flight <= 5, "{stats:?}");
    assert!(
        stats.max_in_flight >= 2,
        "requests did run concurrently: {stats:?}"
    );
    assert!(stats.requests >= 1200);
    assert_eq!(stats.in_flight, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_secret_key_is_a_configuration_error_not_a_miss() {
    let Some(config) = config("a_wrong_secret_key_is_a_configuration_error_not_a_miss") else {
        return;
    };
    let tier = S3Tier::new(S3Config {
        access_key_id: std::env::var("AWS_ACCESS_KEY_ID").ok(),
        secret_access_key: Some("definitely-the-wrong-secret".into()),
        ..config
    })
    .await
    .unwrap();
    let start = Instant::now();
    let err = tier.exists_many(&unique_keys(3, 36)).await.unwrap_err();
    assert!(
        matches!(err, S3TierError::Configuration { status: 403, .. }),
        "{err:?}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "not retried forever"
    );
    assert!(
        !format!("{err} {tier:?}").contains("definitely-the-wrong-secret"),
        "secret leaked"
    );
    let tier_err = tier
        .batch_lookup(&unique_keys(1, 36), &ReqContext::new("r"))
        .await
        .unwrap_err();
    assert_eq!(tier_err.kind(), TierErrorKind::Config);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_bucket_is_a_configuration_error() {
    let Some(config) = config("a_missing_bucket_is_a_configuration_error") else {
        return;
    };
    let tier = S3Tier::new(S3Config {
        bucket: "kvtier-no-such-bucket".into(),
        ..config
    })
    .await
    .unwrap();
    let err = tier.exists_many(&unique_keys(3, 36)).await.unwrap_err();
    assert!(matches!(err, S3TierError::Configuration { .. }), "{err:?}");
    assert!(err.to_string().contains("kvtier-no-such-bucket"), "{err}");
    assert!(matches!(
        tier.store(&unique_keys(1, 36)[0], vec![1]).await,
        Err(S3TierError::Configuration { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_is_not_running_is_a_fast_typed_error() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let tier = S3Tier::new(S3Config {
        endpoint: Some(format!("http://127.0.0.1:{port}")),
        force_path_style: true,
        access_key_id: Some("a".into()),
        secret_access_key: Some("b".into()),
        connect_timeout_ms: 300,
        request_timeout_ms: 500,
        max_attempts: 2,
        ..S3Config::new("bucket")
    })
    .await
    .unwrap();
    let start = Instant::now();
    let err = tier.exists_many(&unique_keys(3, 36)).await.unwrap_err();
    assert!(
        matches!(
            err,
            S3TierError::Unavailable { .. } | S3TierError::Timeout { .. }
        ),
        "{err:?}"
    );
    assert!(err.tier_kind().is_transient());
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
}

#[tokio::test]
async fn bad_configuration_is_a_typed_error() {
    for config in [
        S3Config::new(""),
        S3Config {
            max_concurrent_requests: 0,
            ..S3Config::new("b")
        },
        S3Config {
            access_key_id: Some("only-the-id".into()),
            ..S3Config::new("b")
        },
    ] {
        assert!(matches!(
            S3Tier::new(config).await,
            Err(S3TierError::InvalidConfig { .. })
        ));
    }
    let debug = format!(
        "{:?}",
        S3Config {
            secret_access_key: Some("s3cr3t".into()),
            ..S3Config::new("b")
        }
    );
    assert!(!debug.contains("s3cr3t"));
}
