//! The S3 tier against a real S3 server (s3s-fs from scripts/services.sh,
//! which checks request signatures): conformance, round trips, errors, and
//! the shared concurrency limit.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_core::testkit::{self, Fixture, unique_keys};
use kvtier_core::{BlockStore, OffloadKey, ReqContext, Tier, TierError, TierErrorKind};
use kvtier_s3::{S3Config, S3Tier, S3TierError};
use kvtier_test_services::required;

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

/// The tier's own error behind a [`TierError`] from [`BlockStore`].
fn s3_error(err: &TierError) -> &S3TierError {
    std::error::Error::source(err)
        .and_then(|source| source.downcast_ref::<S3TierError>())
        .unwrap_or_else(|| panic!("no S3TierError behind {err:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance() {
    let Some(config) = config("conformance") else {
        return;
    };
    let tier = Arc::new(S3Tier::new(config).await.unwrap());
    testkit::run_all(&Fixture::new(tier).with_name("s3")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trips_of_0_4k_and_8m_payloads() {
    let Some(config) = config("round_trips_of_0_4k_and_8m_payloads") else {
        return;
    };
    // An 8 MiB PUT from a debug build, next to the other tests on a shared
    // machine, can outlast the default 2 s attempt: this test is about the
    // bytes, not the speed.
    let tier = S3Tier::new(S3Config {
        request_timeout_ms: 30_000,
        ..config
    })
    .await
    .unwrap();
    let keys = unique_keys(4, 36);
    let payloads: Vec<Vec<u8>> = vec![
        Vec::new(),
        (0..4096).map(|i| i as u8).collect(),
        (0..8 << 20).map(|i| (i * 7) as u8).collect(),
    ];
    for (key, payload) in keys.iter().zip(&payloads) {
        tier.store(key, payload).await.unwrap();
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
    tier.store_many(&present).await.unwrap();
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
    let err = tier.store(&unique_keys(1, 36)[0], &[1]).await.unwrap_err();
    assert!(
        matches!(s3_error(&err), S3TierError::Configuration { .. }),
        "{err:?}"
    );
    assert_eq!(err.kind(), TierErrorKind::Config);
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
        S3Config {
            io_threads: 0,
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

/// A config for a server that is never reached: these failures happen
/// before (or instead of) a connection.
fn unreachable(bucket: &str) -> S3Config {
    S3Config {
        endpoint: Some("http://127.0.0.1:1".into()),
        force_path_style: true,
        access_key_id: Some("a".into()),
        secret_access_key: Some("b".into()),
        connect_timeout_ms: 300,
        request_timeout_ms: 500,
        max_attempts: 1,
        ..S3Config::new(bucket)
    }
}

/// `config` is refused by `S3Tier::new` as invalid, naming `field`. If it is
/// accepted, the first request shows what it would have done.
async fn refused_at_construction(config: S3Config, field: &str) -> String {
    match S3Tier::new(config).await {
        Err(err @ S3TierError::InvalidConfig { .. }) => {
            let S3TierError::InvalidConfig { field: f, .. } = &err else {
                unreachable!()
            };
            assert_eq!(*f, field, "{err}");
            assert_eq!(err.tier_kind(), TierErrorKind::Config);
            err.to_string()
        }
        Err(other) => panic!("a bad {field}: {other:?}"),
        Ok(tier) => {
            let answer = tier.exists_many(&unique_keys(1, 36)).await;
            panic!("a bad {field} was accepted; a lookup then gave {answer:?}");
        }
    }
}

#[tokio::test]
async fn control_characters_in_region_or_credentials_are_invalid_config() {
    for bad in ["us-east-1\n", "us\0east"] {
        refused_at_construction(
            S3Config {
                region: Some(bad.into()),
                ..unreachable("b")
            },
            "region",
        )
        .await;
    }
    for bad in ["AKID\nX-Evil: 1", "AK\0ID"] {
        refused_at_construction(
            S3Config {
                access_key_id: Some(bad.into()),
                ..unreachable("b")
            },
            "access_key_id",
        )
        .await;
    }
    refused_at_construction(
        S3Config {
            session_token: Some("tok\r\nen".into()),
            ..unreachable("b")
        },
        "session_token",
    )
    .await;
}

#[tokio::test]
async fn timeouts_and_limits_that_overflow_are_invalid_config() {
    refused_at_construction(
        S3Config {
            request_timeout_ms: u64::MAX,
            max_attempts: 2,
            ..unreachable("b")
        },
        "request_timeout_ms",
    )
    .await;
    refused_at_construction(
        S3Config {
            max_concurrent_requests: 1 << 62,
            ..unreachable("b")
        },
        "max_concurrent_requests",
    )
    .await;
}

#[tokio::test]
async fn an_endpoint_that_is_not_a_url_is_invalid_config() {
    for bad in [
        "not a url",
        "127.0.0.1:9000",
        "ftp://127.0.0.1:9000",
        "http://",
        "http://exa mple.com",
        "http://127.0.0.1:9000/?x=1",
    ] {
        let message = refused_at_construction(
            S3Config {
                endpoint: Some(bad.into()),
                ..unreachable("b")
            },
            "endpoint",
        )
        .await;
        assert!(message.contains("bad endpoint"), "{message}");
    }
}

/// An endpoint that holds credentials is refused (they go in the
/// credential fields; the SDK would log them), by an error that shows the
/// endpoint masked and says where they go; `Debug` masks it too.
#[tokio::test]
async fn an_endpoint_with_credentials_is_refused_without_showing_them() {
    for endpoint in [
        "http://kvtier:hunter2@127.0.0.1:1",
        "https://:hunter2@s3.example.com",
        "http://hunter2@127.0.0.1:1/",
        "ftp://kvtier:hunter2@127.0.0.1:1",
        "http:/kvtier:hunter2@127.0.0.1:1",
        "hunter2",
    ] {
        let config = S3Config {
            endpoint: Some(endpoint.into()),
            ..unreachable("b")
        };
        assert!(!format!("{config:?}").contains("hunter2"), "{config:?}");
        let message = refused_at_construction(config, "endpoint").await;
        assert!(!message.contains("hunter2"), "{message}");
        if endpoint.starts_with("http") {
            assert!(message.contains("access_key_id"), "{message}");
        }
    }
}

#[tokio::test]
async fn a_refused_connection_is_unavailable_connection_refused() {
    let tier = S3Tier::new(S3Config {
        max_attempts: 3,
        ..unreachable("b")
    })
    .await
    .unwrap();
    let start = Instant::now();
    let err = tier.exists_many(&unique_keys(1, 36)).await.unwrap_err();
    match &err {
        S3TierError::Unavailable { detail, .. } => {
            assert!(detail.contains("connection refused"), "{err}")
        }
        other => panic!("{other:?}"),
    }
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
}

#[tokio::test]
async fn no_credentials_is_a_configuration_error_that_says_so() {
    // credentials_from_aws_chain: false is the explicit "only this config"
    // path: the test does not depend on (or change) the process environment.
    let tier = S3Tier::new(S3Config {
        access_key_id: None,
        secret_access_key: None,
        credentials_from_aws_chain: false,
        ..unreachable("b")
    })
    .await
    .unwrap();
    for err in [
        tier.check().await.unwrap_err(),
        tier.exists_many(&unique_keys(1, 36)).await.unwrap_err(),
    ] {
        match &err {
            S3TierError::Configuration { reason, .. } => {
                assert!(reason.contains("no credentials found"), "{err}");
                assert!(reason.contains("AWS_ACCESS_KEY_ID"), "{err}");
            }
            other => panic!("{other:?}"),
        }
        assert!(!err.to_string().contains("HTTP 0"), "{err}");
        assert_eq!(err.tier_kind(), TierErrorKind::Config);
    }
}

#[tokio::test]
async fn check_fails_fast_with_the_typed_error() {
    let refused = S3Tier::new(unreachable("b")).await.unwrap();
    let start = Instant::now();
    assert!(
        matches!(
            refused.check().await,
            Err(S3TierError::Unavailable { ref detail, .. }) if detail == "connection refused"
        ),
        "{:?}",
        refused.check().await
    );
    assert!(start.elapsed() < Duration::from_secs(5));
    let Some(config) = config("check_fails_fast_with_the_typed_error") else {
        return;
    };
    S3Tier::new(config.clone())
        .await
        .unwrap()
        .check()
        .await
        .unwrap();
    let missing = S3Tier::new(S3Config {
        bucket: "kvtier-no-such-bucket".into(),
        ..config
    })
    .await
    .unwrap();
    assert!(
        matches!(
            missing.check().await,
            Err(S3TierError::Configuration { status: 404, .. })
        ),
        "{:?}",
        missing.check().await
    );
}

/// Deletes `bucket` (emptied first) with a client of the test's own.
async fn delete_bucket(config: &S3Config) {
    let shared = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .region(aws_sdk_s3::config::Region::new("us-east-1"))
        .load()
        .await;
    let client = aws_sdk_s3::Client::from_conf(
        aws_sdk_s3::config::Builder::from(&shared)
            .endpoint_url(config.endpoint.clone().unwrap())
            .force_path_style(true)
            .build(),
    );
    let listed = client
        .list_objects_v2()
        .bucket(&config.bucket)
        .send()
        .await
        .unwrap();
    for object in listed.contents() {
        client
            .delete_object()
            .bucket(&config.bucket)
            .key(object.key().unwrap())
            .send()
            .await
            .unwrap();
    }
    client
        .delete_bucket()
        .bucket(&config.bucket)
        .send()
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bucket_deleted_while_running_is_a_configuration_error_not_a_miss() {
    let Some(config) = config("a_bucket_deleted_while_running_is_a_configuration_error_not_a_miss")
    else {
        return;
    };
    let config = S3Config {
        bucket: format!("kvtier-gone-{}", &unique_keys(1, 16)[0].to_hex()[16..28]),
        bucket_recheck_ms: 0,
        ..config
    };
    let tier = Arc::new(S3Tier::new(config.clone()).await.unwrap());
    tier.create_bucket_if_missing().await.unwrap();
    let keys = unique_keys(2, 36);
    tier.store(&keys[0], &[1]).await.unwrap();
    assert_eq!(tier.exists_many(&keys).await.unwrap(), [true, false]);

    delete_bucket(&config).await;

    let err = tier.exists_many(&keys).await.unwrap_err();
    assert!(matches!(err, S3TierError::Configuration { .. }), "{err:?}");
    let err = tier.load(&keys[0]).await.unwrap_err();
    assert!(
        matches!(s3_error(&err), S3TierError::Configuration { .. }),
        "load of a deleted bucket: {err:?}"
    );
    // Through the manager: counted as errors, not misses.
    let mut manager = tier
        .manager(kvtier_core::ManagerConfig {
            failure_backoff_ms: 60_000,
            ..kvtier_core::ManagerConfig::named("s3-gone")
        })
        .unwrap();
    let ctx = ReqContext::new("r");
    let start = Instant::now();
    while manager.lookup(&keys[1], &ctx).unwrap() == kvtier_core::LookupVerdict::Pending {
        assert!(start.elapsed() < Duration::from_secs(10), "no verdict");
        manager.flush();
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let stats = manager.stats();
    assert_eq!((stats.errors, stats.misses), (1, 0), "{stats:?}");
}

#[test]
fn the_manager_counts_a_refused_connection_as_an_error_not_a_timeout() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    // The defaults a program gets: 3 attempts, a 1 s call deadline.
    let tier = Arc::new(
        rt.block_on(S3Tier::new(S3Config {
            max_attempts: 3,
            request_timeout_ms: 2000,
            connect_timeout_ms: 1000,
            ..unreachable("b")
        }))
        .unwrap(),
    );
    let mut manager = tier
        .manager(kvtier_core::ManagerConfig {
            failure_backoff_ms: 60_000,
            ..kvtier_core::ManagerConfig::default()
        })
        .unwrap();
    let ctx = ReqContext::new("r");
    let key = &unique_keys(1, 36)[0];
    let start = Instant::now();
    while manager.lookup(key, &ctx).unwrap() == kvtier_core::LookupVerdict::Pending {
        assert!(start.elapsed() < Duration::from_secs(10), "no verdict");
        manager.flush();
        std::thread::sleep(Duration::from_millis(5));
    }
    let stats = manager.stats();
    assert_eq!((stats.errors, stats.timeouts), (1, 0), "{stats:?}");
}

/// Issue 12, item 1: tenants keep apart by their prefix. Two tiers over the
/// same bucket with different prefixes store the same key bytes; each sees
/// only its own blocks through `batch_lookup`, `load` and a manager.
#[test]
fn two_tenants_with_their_own_prefix_in_one_bucket_see_only_their_blocks() {
    let Some(config) =
        config("two_tenants_with_their_own_prefix_in_one_bucket_see_only_their_blocks")
    else {
        return;
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let tenant = |name: &str| {
        let tier = rt.block_on(S3Tier::new(S3Config {
            prefix: format!("{}{name}/", config.prefix),
            ..config.clone()
        }));
        Arc::new(tier.unwrap())
    };
    let (a, b) = (tenant("tenant-a"), tenant("tenant-b"));
    // The same key bytes for both tenants.
    let keys = unique_keys(3, 36);
    rt.block_on(async {
        a.store_many(&[
            (keys[0].clone(), b"a0".to_vec()),
            (keys[1].clone(), b"a1".to_vec()),
        ])
        .await
        .unwrap();
        b.store_many(&[
            (keys[1].clone(), b"b1".to_vec()),
            (keys[2].clone(), b"b2".to_vec()),
        ])
        .await
        .unwrap();
    });
    let ctx = ReqContext::new("tenant");
    let sees_a = [true, true, false];
    let sees_b = [false, true, true];
    rt.block_on(async {
        assert_eq!(a.batch_lookup(&keys, &ctx).await.unwrap(), sees_a);
        assert_eq!(b.batch_lookup(&keys, &ctx).await.unwrap(), sees_b);
        assert_eq!(
            a.load_many(&keys).await.unwrap(),
            [Some(b"a0".to_vec()), Some(b"a1".to_vec()), None]
        );
        assert_eq!(
            b.load_many(&keys).await.unwrap(),
            [None, Some(b"b1".to_vec()), Some(b"b2".to_vec())]
        );
    });
    // Through one manager per tenant, looking up the same keys in the same window.
    let mut managers = [
        a.manager(kvtier_core::ManagerConfig::named("tenant-a"))
            .unwrap(),
        b.manager(kvtier_core::ManagerConfig::named("tenant-b"))
            .unwrap(),
    ];
    let start = Instant::now();
    let verdicts = loop {
        let answers: Vec<Vec<kvtier_core::LookupVerdict>> = managers
            .iter_mut()
            .map(|m| keys.iter().map(|k| m.lookup(k, &ctx).unwrap()).collect())
            .collect();
        if answers
            .iter()
            .flatten()
            .all(|v| *v != kvtier_core::LookupVerdict::Pending)
        {
            break answers;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "no verdict");
        managers.iter_mut().for_each(|m| m.flush());
        std::thread::sleep(Duration::from_millis(2));
    };
    let hits = |answers: &[kvtier_core::LookupVerdict]| -> Vec<bool> {
        answers
            .iter()
            .map(|v| *v == kvtier_core::LookupVerdict::Hit)
            .collect()
    };
    assert_eq!(hits(&verdicts[0]), sees_a);
    assert_eq!(hits(&verdicts[1]), sees_b);
    // A removal by one tenant leaves the other's block of the same key.
    rt.block_on(async {
        a.remove(&keys[1]).await.unwrap();
        assert_eq!(b.load(&keys[1]).await.unwrap(), Some(b"b1".to_vec()));
        assert_eq!(
            a.batch_lookup(&keys, &ctx).await.unwrap(),
            [true, false, false]
        );
    });
}
