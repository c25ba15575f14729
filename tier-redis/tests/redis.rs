//! The Redis tier against real servers: round trips, TTL, binary keys,
//! large and empty batches, wrong credentials, unreachable ports, TLS.

use kvtier_test_services as support;

use std::time::{Duration, Instant};

use kvtier_core::testkit::{self, unique_keys};
use std::sync::Arc;

use kvtier_core::{
    AsyncLookupManager, BlockStore, LookupVerdict, ManagerConfig, OffloadKey, ReqContext, Tier,
    TierErrorKind,
};
use kvtier_redis::{RedisConfig, RedisTier, RedisTierError};
use support::PrivateServer;

fn tiers(test: &str) -> Vec<RedisTier> {
    let mut tiers = Vec::new();
    if let Some(url) = support::service("KVTIER_REDIS_URL", test) {
        tiers.push(
            RedisTier::new(RedisConfig {
                key_prefix: "kvtier-test:".into(),
                ..RedisConfig::from_url(url)
            })
            .unwrap(),
        );
    }
    if let Some(urls) = support::service("KVTIER_REDIS_CLUSTER_URLS", test) {
        tiers.push(
            RedisTier::new(RedisConfig {
                key_prefix: "kvtier-test:".into(),
                ..RedisConfig::cluster(urls.split(','))
            })
            .unwrap(),
        );
    }
    tiers
}

/// Stores every `step`-th key of `keys` (from the first) with a one-byte payload.
async fn store_every(tier: &RedisTier, keys: &[OffloadKey], step: usize) {
    let present: Vec<(OffloadKey, Vec<u8>)> = keys
        .iter()
        .step_by(step)
        .map(|k| (k.clone(), b"x".to_vec()))
        .collect();
    tier.store_many(&present).await.unwrap();
}

/// How many of `found` (the answers for keys `from..` of a slice stored
/// with [`store_every`]`(.., step)`) say otherwise than what was stored.
fn wrong_answers(found: &[bool], from: usize, step: usize) -> usize {
    found
        .iter()
        .enumerate()
        .filter(|&(i, &f)| f != (from + i).is_multiple_of(step))
        .count()
}

#[tokio::test]
async fn store_lookup_load_remove_round_trip() {
    for tier in tiers("store_lookup_load_remove_round_trip") {
        let keys = unique_keys(3, 36);
        tier.store(&keys[0], b"zero").await.unwrap();
        tier.store(&keys[1], &[0u8, 255, 0, 10, 13]).await.unwrap();
        assert_eq!(
            tier.exists_many(&keys).await.unwrap(),
            [true, true, false],
            "{}",
            tier.endpoint()
        );
        assert_eq!(
            tier.load(&keys[0]).await.unwrap().as_deref(),
            Some(&b"zero"[..])
        );
        assert_eq!(
            tier.load(&keys[1]).await.unwrap().as_deref(),
            Some(&[0u8, 255, 0, 10, 13][..])
        );
        assert_eq!(tier.load(&keys[2]).await.unwrap(), None);
        assert!(tier.store_nx(&keys[2], b"first").await.unwrap());
        assert!(!tier.store_nx(&keys[2], b"second").await.unwrap());
        assert_eq!(
            tier.load(&keys[2]).await.unwrap().as_deref(),
            Some(&b"first"[..])
        );
        tier.remove(&keys[0]).await.unwrap();
        // Removal is idempotent.
        tier.remove(&keys[0]).await.unwrap();
        assert_eq!(tier.exists_many(&keys).await.unwrap(), [false, true, true]);
    }
}

#[tokio::test]
async fn binary_keys_with_every_byte_value_are_distinct() {
    for tier in tiers("binary_keys_with_every_byte_value_are_distinct") {
        let base = unique_keys(1, 36).remove(0);
        let keys: Vec<OffloadKey> = (0..=255u8)
            .map(|b| {
                let mut bytes = base.as_bytes().to_vec();
                bytes[20] = b; // includes 0, '{', '}', '\r', '\n' and non-UTF-8 bytes
                OffloadKey::new(&bytes)
            })
            .collect();
        let present: Vec<(OffloadKey, Vec<u8>)> = keys
            .iter()
            .step_by(2)
            .map(|k| (k.clone(), vec![k.as_bytes()[20]]))
            .collect();
        tier.store_many(&present).await.unwrap();
        let found = tier.exists_many(&keys).await.unwrap();
        assert!(
            found.iter().enumerate().all(|(i, &f)| f == (i % 2 == 0)),
            "{}",
            tier.endpoint()
        );
        for (key, payload) in &present {
            assert_eq!(tier.load(key).await.unwrap().as_ref(), Some(payload));
        }
        // Plain TCP: the lookups went through the lean path, none fell back.
        let stats = tier.pipeline_stats();
        assert!(stats.lean > 0, "{}: {stats:?}", tier.endpoint());
        assert_eq!(stats.fallbacks, 0, "{}: {stats:?}", tier.endpoint());
    }
}

#[tokio::test]
async fn lookups_without_the_lean_path_give_the_same_answers() {
    for tier in tiers("lookups_without_the_lean_path") {
        let plain = RedisTier::new(RedisConfig {
            lean_pipelines: false,
            ..tier.config().clone()
        })
        .unwrap();
        let keys = unique_keys(3_000, 36);
        store_every(&tier, &keys, 2).await;
        let lean = tier.exists_many(&keys).await.unwrap();
        let redis_rs = plain.exists_many(&keys).await.unwrap();
        assert_eq!(lean, redis_rs, "{}", tier.endpoint());
        assert_eq!(lean.iter().filter(|&&f| f).count(), 1_500);
        assert!(tier.pipeline_stats().lean > 0);
        assert_eq!(
            plain.pipeline_stats(),
            kvtier_redis::PipelineStats::default()
        );
    }
}

#[tokio::test]
async fn ttl_ms_expires_every_stored_block() {
    for long in tiers("ttl_ms_expires_every_stored_block") {
        let short = RedisTier::new(RedisConfig {
            ttl_ms: Some(150),
            ..long.config().clone()
        })
        .unwrap();
        let keys = unique_keys(5, 36);
        short.store(&keys[0], b"short").await.unwrap();
        long.store(&keys[1], b"kept").await.unwrap();
        // The batched store and store_nx honour the TTL too (pipelines, on
        // a cluster per master).
        let batch = [
            (keys[2].clone(), b"short".to_vec()),
            (keys[3].clone(), b"short".to_vec()),
        ];
        short.store_many(&batch).await.unwrap();
        assert!(short.store_nx(&keys[4], b"short").await.unwrap());
        assert_eq!(long.exists_many(&keys).await.unwrap(), [true; 5]);
        let start = Instant::now();
        while long.exists_many(&keys).await.unwrap() != [false, true, false, false, false] {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "TTL never expired: {}",
                long.endpoint()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        long.remove(&keys[1]).await.unwrap();
    }
}

#[tokio::test]
async fn batched_loads_and_removes_answer_per_position() {
    for tier in tiers("batched_loads_and_removes_answer_per_position") {
        // More keys than one chunk, on every master of a cluster.
        let keys = unique_keys(1_200, 36);
        let present: Vec<(OffloadKey, Vec<u8>)> = keys
            .iter()
            .enumerate()
            .filter(|(i, _)| i % 3 != 1)
            .map(|(i, k)| (k.clone(), i.to_le_bytes().to_vec()))
            .collect();
        tier.store_many(&present).await.unwrap();
        let loaded = tier.load_many(&keys).await.unwrap();
        assert_eq!(loaded.len(), keys.len());
        for (i, block) in loaded.iter().enumerate() {
            let expected = (i % 3 != 1).then(|| i.to_le_bytes().to_vec());
            assert_eq!(block, &expected, "{}: key {i}", tier.endpoint());
        }
        assert!(tier.load_many(&[]).await.unwrap().is_empty());
        // Remove every other key (present or not): the rest stay.
        let removed: Vec<OffloadKey> = keys.iter().step_by(2).cloned().collect();
        tier.remove_many(&removed).await.unwrap();
        tier.remove_many(&[]).await.unwrap();
        let found = tier.exists_many(&keys).await.unwrap();
        for (i, &f) in found.iter().enumerate() {
            assert_eq!(f, i % 2 == 1 && i % 3 != 1, "{}: key {i}", tier.endpoint());
        }
        tier.remove_many(&keys).await.unwrap();
        assert!(tier.exists_many(&keys).await.unwrap().iter().all(|&f| !f));
    }
}

/// Looks up `keys` for a fresh request until every key has a verdict.
fn manager_verdicts(
    m: &mut AsyncLookupManager<RedisTier>,
    keys: &[OffloadKey],
    req: &str,
) -> Vec<LookupVerdict> {
    testkit::verdicts(m, keys, req, Duration::from_secs(10))
}

/// Issue 12 item 1: two tenants, each with its own tier instance and key
/// prefix over the same server, store blocks under the same key bytes; each
/// sees only its own blocks, through lookups, loads and a manager.
#[test]
fn tenants_with_their_own_prefix_see_only_their_own_blocks() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    for base in tiers("tenants_with_their_own_prefix_see_only_their_own_blocks") {
        let tenant = |name: &str| {
            Arc::new(
                RedisTier::new(RedisConfig {
                    key_prefix: format!("kvtier-tenant-{name}:"),
                    ..base.config().clone()
                })
                .unwrap(),
            )
        };
        let (a, b) = (tenant("a"), tenant("b"));
        let keys = unique_keys(4, 36);
        // A holds keys 0 and 1, B holds keys 1 and 2 (key 1 with its own
        // bytes); neither holds key 3.
        rt.block_on(a.store_many(&[
            (keys[0].clone(), b"a0".to_vec()),
            (keys[1].clone(), b"a1".to_vec()),
        ]))
        .unwrap();
        rt.block_on(b.store_many(&[
            (keys[1].clone(), b"b1".to_vec()),
            (keys[2].clone(), b"b2".to_vec()),
        ]))
        .unwrap();
        let ctx = ReqContext::new("tenants");
        assert_eq!(
            rt.block_on(a.batch_lookup(&keys, &ctx)).unwrap(),
            [true, true, false, false],
            "{}",
            base.endpoint()
        );
        assert_eq!(
            rt.block_on(b.batch_lookup(&keys, &ctx)).unwrap(),
            [false, true, true, false]
        );
        let blocks = |tier: &Arc<RedisTier>| -> Vec<Option<Vec<u8>>> {
            rt.block_on(tier.load_many(&keys)).unwrap()
        };
        let some = |bytes: &[u8]| Some(bytes.to_vec());
        assert_eq!(blocks(&a), [some(b"a0"), some(b"a1"), None, None]);
        assert_eq!(blocks(&b), [None, some(b"b1"), some(b"b2"), None]);
        assert_eq!(rt.block_on(b.load(&keys[0])).unwrap(), None);
        use LookupVerdict::{Hit, Miss};
        let mut ma = a.manager(ManagerConfig::default()).unwrap();
        let mut mb = b.manager(ManagerConfig::default()).unwrap();
        assert_eq!(
            manager_verdicts(&mut ma, &keys, "r"),
            [Hit, Hit, Miss, Miss]
        );
        assert_eq!(
            manager_verdicts(&mut mb, &keys, "r"),
            [Miss, Hit, Hit, Miss]
        );
        // Removing one tenant's blocks leaves the other's.
        rt.block_on(a.remove_many(&keys)).unwrap();
        assert_eq!(
            rt.block_on(b.batch_lookup(&keys, &ctx)).unwrap(),
            [false, true, true, false]
        );
        rt.block_on(b.remove_many(&keys)).unwrap();
        ma.shutdown();
        mb.shutdown();
    }
}

#[tokio::test]
async fn ten_thousand_key_batches_and_empty_batches() {
    for tier in tiers("ten_thousand_key_batches_and_empty_batches") {
        assert!(tier.exists_many(&[]).await.unwrap().is_empty());
        let keys = unique_keys(10_000, 36);
        store_every(&tier, &keys, 3).await;
        let found = tier
            .batch_lookup(&keys, &ReqContext::new("big"))
            .await
            .unwrap();
        assert_eq!(found.len(), 10_000);
        assert_eq!(wrong_answers(&found, 0, 3), 0, "{}", tier.endpoint());
    }
}

#[tokio::test]
async fn a_wrong_password_is_a_typed_auth_error() {
    let Some(redis) = support::binary("redis-server", "a_wrong_password_is_a_typed_auth_error")
    else {
        return;
    };
    let server = PrivateServer::redis_with(redis, &["--requirepass", "right-password"]);
    let wrong = RedisTier::new(RedisConfig {
        password: Some("wrong-password".into()),
        ..RedisConfig::from_url(server.url())
    })
    .unwrap();
    let err = wrong.exists_many(&unique_keys(1, 36)).await.unwrap_err();
    assert!(matches!(err, RedisTierError::Auth { .. }), "{err:?}");
    let shown = format!("{err} {err:?} {wrong:?}");
    assert!(
        !shown.contains("wrong-password"),
        "credentials leaked: {shown}"
    );
    let tier_err = wrong
        .batch_lookup(&unique_keys(1, 36), &ReqContext::new("r"))
        .await
        .unwrap_err();
    assert_eq!(tier_err.kind(), TierErrorKind::Config);

    let right = RedisTier::new(RedisConfig::from_url(format!(
        "redis://:right-password@127.0.0.1:{}/",
        server.port
    )))
    .unwrap();
    right.ping().await.unwrap();
    assert!(!format!("{right:?}").contains("right-password"));
}

/// A user whom an ACL denies EXISTS (issue 25.8) gets a permission error,
/// not "authentication failed": its credentials work (stores succeed), on
/// both lookup paths; a wrong password stays an authentication error.
#[tokio::test]
async fn a_user_denied_exists_by_an_acl_gets_a_permission_error() {
    let Some(redis) = support::binary(
        "redis-server",
        "a_user_denied_exists_by_an_acl_gets_a_permission_error",
    ) else {
        return;
    };
    let server = PrivateServer::redis(redis);
    let admin = redis::Client::open(server.url()).unwrap();
    let mut admin = admin.get_multiplexed_async_connection().await.unwrap();
    let _: () = redis::cmd("ACL")
        .arg(&[
            "SETUSER",
            "no-exists",
            "reset",
            "on",
            ">user-password",
            "~*",
            "+@all",
            "-exists",
        ])
        .query_async(&mut admin)
        .await
        .unwrap();
    let keys = unique_keys(2, 36);
    for lean_pipelines in [true, false] {
        let tier = RedisTier::new(RedisConfig {
            username: Some("no-exists".into()),
            password: Some("user-password".into()),
            lean_pipelines,
            ..RedisConfig::from_url(server.url())
        })
        .unwrap();
        tier.store(&keys[0], b"allowed").await.unwrap();
        let err = tier.exists_many(&keys).await.unwrap_err();
        assert!(
            matches!(err, RedisTierError::Permission { .. }),
            "lean {lean_pipelines}: {err:?}"
        );
        assert_eq!(err.tier_kind(), TierErrorKind::PermissionDenied);
        let shown = err.to_string();
        assert!(
            shown.contains("permission denied") && !shown.contains("authentication"),
            "{shown}"
        );
        assert!(
            !format!("{shown} {err:?}").contains("user-password"),
            "{shown}"
        );
        let tier_err = tier
            .batch_lookup(&keys, &ReqContext::new("r"))
            .await
            .unwrap_err();
        assert_eq!(tier_err.kind(), TierErrorKind::PermissionDenied);
        assert!(!tier_err.is_transient());
    }
    let wrong = RedisTier::new(RedisConfig {
        username: Some("no-exists".into()),
        password: Some("wrong-password".into()),
        ..RedisConfig::from_url(server.url())
    })
    .unwrap();
    let err = wrong.exists_many(&keys).await.unwrap_err();
    assert!(matches!(err, RedisTierError::Auth { .. }), "{err:?}");
}

#[tokio::test]
async fn an_unreachable_server_is_a_fast_typed_error() {
    let port = support::free_port();
    let tier = RedisTier::new(RedisConfig {
        connect_timeout_ms: 200,
        ..RedisConfig::from_url(format!("redis://127.0.0.1:{port}/"))
    })
    .unwrap();
    let start = Instant::now();
    let err = tier.exists_many(&unique_keys(4, 36)).await.unwrap_err();
    assert!(
        matches!(
            err,
            RedisTierError::Unavailable { .. } | RedisTierError::Timeout { .. }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains(&port.to_string()), "{err}");
    assert!(start.elapsed() < Duration::from_secs(5));
    let cluster = RedisTier::new(RedisConfig {
        connect_timeout_ms: 200,
        ..RedisConfig::cluster([format!("redis://127.0.0.1:{port}/")])
    })
    .unwrap();
    let err = cluster.exists_many(&unique_keys(4, 36)).await.unwrap_err();
    assert!(err.tier_kind().is_transient(), "{err:?}");
}

#[tokio::test]
async fn bad_configuration_is_a_typed_error() {
    for config in [
        RedisConfig {
            pipeline_chunk: 0,
            ..RedisConfig::default()
        },
        RedisConfig {
            url: "not a url".into(),
            ..RedisConfig::default()
        },
        RedisConfig {
            tls_ca_cert: Some("/nonexistent/ca.pem".into()),
            ..RedisConfig::default()
        },
        RedisConfig {
            ttl_ms: Some(0),
            ..RedisConfig::default()
        },
    ] {
        assert!(matches!(
            RedisTier::new(config),
            Err(RedisTierError::InvalidConfig { .. })
        ));
    }
}

/// redis-server on this machine is built with TLS (it links libssl), and
/// scripts/services.sh starts a TLS node with a certificate it generates.
#[tokio::test]
async fn tls_connections_verify_the_server_certificate() {
    let Some(url) = support::service(
        "KVTIER_REDIS_TLS_URL",
        "tls_connections_verify_the_server_certificate",
    ) else {
        return;
    };
    let Some(ca) = support::service(
        "KVTIER_REDIS_TLS_CA",
        "tls_connections_verify_the_server_certificate",
    ) else {
        return;
    };
    let tier = RedisTier::new(RedisConfig {
        tls_ca_cert: Some(ca.into()),
        key_prefix: "kvtier-tls:".into(),
        ..RedisConfig::from_url(url.clone())
    })
    .unwrap();
    let keys = unique_keys(2, 36);
    tier.store(&keys[0], b"over tls").await.unwrap();
    assert_eq!(tier.exists_many(&keys).await.unwrap(), [true, false]);
    assert_eq!(
        tier.load(&keys[0]).await.unwrap().as_deref(),
        Some(&b"over tls"[..])
    );
    // Without the test CA, the self-made certificate is refused.
    let untrusted = RedisTier::new(RedisConfig {
        connect_timeout_ms: 500,
        ..RedisConfig::from_url(url)
    })
    .unwrap();
    assert!(untrusted.exists_many(&keys).await.is_err());
}

/// Names follow the layout (`RedisConfig::key_layout`): a raw client finds
/// each block under `key_name`, built as documented; on a cluster the
/// servers' `CLUSTER KEYSLOT` agrees with the tier's slot of the name, and
/// the default is the tagged layout. A tier of the other layout over the
/// same server does not see the blocks (the names differ).
#[tokio::test]
async fn names_follow_the_key_layout() {
    use kvtier_redis::{KeyLayout, key_slot};
    for base in tiers("names_follow_the_key_layout") {
        let cluster = base.config().is_cluster();
        let expected_default = if cluster {
            KeyLayout::Tagged
        } else {
            KeyLayout::Plain
        };
        assert_eq!(base.key_layout(), expected_default, "{}", base.endpoint());
        let with = |layout| {
            RedisTier::new(RedisConfig {
                key_prefix: "kvtier-layout:".into(),
                key_layout: Some(layout),
                ..base.config().clone()
            })
            .unwrap()
        };
        let (plain, tagged) = (with(KeyLayout::Plain), with(KeyLayout::Tagged));
        // Binary keys, braces included: a brace in a plain name's key is
        // the server's hash tag, which the tier's slots must follow too.
        let keys: Vec<OffloadKey> = unique_keys(40, 36)
            .into_iter()
            .enumerate()
            .map(|(i, k)| {
                let mut bytes = k.as_bytes().to_vec();
                if i % 2 == 0 {
                    bytes[3] = b'{';
                    bytes[4 + i % 5] = b'}';
                }
                OffloadKey::new(&bytes)
            })
            .collect();
        let (mine, theirs) = keys.split_at(20);
        store_every(&plain, mine, 1).await;
        store_every(&tagged, theirs, 1).await;
        assert_eq!(
            plain.exists_many(&keys).await.unwrap(),
            [[true; 20], [false; 20]].concat()
        );
        assert_eq!(
            tagged.exists_many(&keys).await.unwrap(),
            [[false; 20], [true; 20]].concat()
        );

        for (i, key) in keys.iter().enumerate() {
            // Each key under the name of the tier that stored it, and not
            // under the other's.
            let (tier, other) = if i < 20 {
                (&plain, &tagged)
            } else {
                (&tagged, &plain)
            };
            let name = tier.key_name(key);
            let built = match tier.key_layout() {
                KeyLayout::Plain => [b"kvtier-layout:", key.as_bytes()].concat(),
                KeyLayout::Tagged => {
                    // CRC16/XMODEM, bit by bit, four bits a character
                    // (`0x40 | bits`), high bits first.
                    let mut crc: u16 = 0;
                    for &b in key.as_bytes() {
                        crc ^= u16::from(b) << 8;
                        for _ in 0..8 {
                            crc = if crc & 0x8000 != 0 {
                                (crc << 1) ^ 0x1021
                            } else {
                                crc << 1
                            };
                        }
                    }
                    let tag: Vec<u8> = [12, 8, 4, 0]
                        .iter()
                        .map(|s| 0x40 | ((crc >> s) & 0xf) as u8)
                        .collect();
                    [&b"kvtier-layout:{"[..], &tag, b"}", key.as_bytes()].concat()
                }
            };
            assert_eq!(name, built, "key {i}");
            let exists: i64 = raw_query(&base, redis::cmd("EXISTS").arg(&name)).await;
            assert_eq!(exists, 1, "key {i} on {}", base.endpoint());
            let elsewhere = other.key_name(key);
            assert_ne!(elsewhere, name);
            let exists: i64 = raw_query(&base, redis::cmd("EXISTS").arg(&elsewhere)).await;
            assert_eq!(exists, 0, "key {i} on {}", base.endpoint());
            if cluster {
                let slot: i64 =
                    raw_query(&base, redis::cmd("CLUSTER").arg("KEYSLOT").arg(&name)).await;
                assert_eq!(slot, i64::from(key_slot(&name)), "key {i}");
            }
        }
        // Every pipeline went to the master holding its keys: a key sent to
        // the wrong one would answer MOVED and fall back to redis-rs.
        for tier in [&plain, &tagged] {
            let stats = tier.pipeline_stats();
            assert!(stats.lean > 0, "{}: {stats:?}", tier.endpoint());
            assert_eq!(stats.fallbacks, 0, "{}: {stats:?}", tier.endpoint());
        }
        plain.remove_many(mine).await.unwrap();
        tagged.remove_many(theirs).await.unwrap();
    }
}

/// `cmd` through a raw client of `tier`'s server or cluster.
async fn raw_query<T: redis::FromRedisValue>(tier: &RedisTier, cmd: &redis::Cmd) -> T {
    let config = tier.config();
    if config.is_cluster() {
        let client = redis::cluster::ClusterClient::new(config.cluster_urls.clone()).unwrap();
        let mut conn = client.get_async_connection().await.unwrap();
        cmd.query_async(&mut conn).await.unwrap()
    } else {
        let client = redis::Client::open(config.url.as_str()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        cmd.query_async(&mut conn).await.unwrap()
    }
}

/// `connected_clients` of the server behind `url`.
async fn connected_clients(url: &str) -> u64 {
    let client = redis::Client::open(url).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let info: String = redis::cmd("INFO")
        .arg("clients")
        .query_async(&mut conn)
        .await
        .unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("connected_clients:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// Lean pipelines share one connection per server: 32 tasks looking up at
/// once, 64 keys to a pipeline, each get their own answers, none falls
/// back to redis-rs, and the server sees one lookup connection, not one
/// per pipeline in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_lean_pipelines_share_one_connection_and_keep_their_answers() {
    let Some(redis) = support::binary(
        "redis-server",
        "concurrent_lean_pipelines_share_one_connection_and_keep_their_answers",
    ) else {
        return;
    };
    let server = PrivateServer::redis(redis);
    let tier = Arc::new(
        RedisTier::new(RedisConfig {
            pipeline_chunk: 64,
            ..RedisConfig::from_url(server.url())
        })
        .unwrap(),
    );
    tier.ping().await.unwrap();
    let keys = unique_keys(32 * 1024, 36);
    store_every(&tier, &keys, 3).await;
    let before = connected_clients(&server.url()).await;
    let tasks: Vec<_> = keys
        .chunks(1024)
        .enumerate()
        .map(|(t, chunk)| {
            let tier = Arc::clone(&tier);
            let chunk = chunk.to_vec();
            tokio::spawn(async move {
                let mut wrong = 0;
                for round in 0..4 {
                    let found = tier.exists_many(&chunk).await.unwrap();
                    assert_eq!(found.len(), chunk.len(), "task {t} round {round}");
                    wrong += wrong_answers(&found, t * 1024, 3);
                }
                wrong
            })
        })
        .collect();
    let mut wrong = 0;
    for task in tasks {
        wrong += task.await.unwrap();
    }
    assert_eq!(wrong, 0);
    let stats = tier.pipeline_stats();
    assert_eq!(stats.fallbacks, 0, "{stats:?}");
    assert!(stats.lean >= 32 * 4 * 16, "{stats:?}");
    // The stores' connection was there before; the lookups add one.
    assert_eq!(connected_clients(&server.url()).await, before + 1);
}

/// A lookup cancelled at any point (before, during or after its pipeline
/// is written, while its replies arrive) leaves no stray replies behind:
/// the next lookups get their own answers, on the lean path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_lookups_leave_the_next_ones_their_own_answers() {
    for tier in tiers("cancelled_lookups_leave_the_next_ones_their_own_answers") {
        let keys = unique_keys(20_000, 36);
        store_every(&tier, &keys, 2).await;
        let first = tier.exists_many(&keys[..1]).await.unwrap();
        assert_eq!(first, [true]);
        let fallbacks = tier.pipeline_stats().fallbacks;
        for micros in [0, 20, 50, 100, 200, 500, 1000, 2000, 5000] {
            let cut =
                tokio::time::timeout(Duration::from_micros(micros), tier.exists_many(&keys)).await;
            if let Ok(found) = cut {
                assert_eq!(found.unwrap().len(), keys.len());
            }
            let found = tier.exists_many(&keys[..4096]).await.unwrap();
            assert_eq!(
                wrong_answers(&found, 0, 2),
                0,
                "{} after a cut at {micros} µs",
                tier.endpoint()
            );
        }
        assert_eq!(
            tier.pipeline_stats().fallbacks,
            fallbacks,
            "{}",
            tier.endpoint()
        );
    }
}

/// A lean connection the server closes while it is idle (`CLIENT KILL`, a
/// server `timeout`) is noticed before the next lookup uses it: that
/// lookup opens a new one and is answered on the lean path, no fallback.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_lean_connection_the_server_closes_is_replaced_without_a_fallback() {
    let Some(redis) = support::binary(
        "redis-server",
        "an_idle_lean_connection_the_server_closes_is_replaced_without_a_fallback",
    ) else {
        return;
    };
    let server = PrivateServer::redis(redis);
    let tier = RedisTier::new(RedisConfig::from_url(server.url())).unwrap();
    let keys = unique_keys(64, 36);
    store_every(&tier, &keys, 2).await;
    let expected: Vec<bool> = (0..keys.len()).map(|i| i % 2 == 0).collect();
    assert_eq!(tier.exists_many(&keys).await.unwrap(), expected);
    let admin = redis::Client::open(server.url()).unwrap();
    let mut admin = admin.get_multiplexed_async_connection().await.unwrap();
    for round in 0..3 {
        let killed: i64 = redis::cmd("CLIENT")
            .arg(&["KILL", "TYPE", "normal", "SKIPME", "yes"])
            .query_async(&mut admin)
            .await
            .unwrap();
        assert!(killed >= 1, "round {round}");
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(
            tier.exists_many(&keys).await.unwrap(),
            expected,
            "round {round}"
        );
    }
    let stats = tier.pipeline_stats();
    assert_eq!(stats.fallbacks, 0, "{stats:?}");
    assert_eq!(stats.lean, 4, "{stats:?}");
}

/// Sends `signal` (`-STOP`, `-CONT`) to process `pid`.
fn signal(pid: u32, signal: &str) {
    let status = std::process::Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill {signal} {pid}");
}

/// A lookup cancelled while its pipeline is being written (a cut write:
/// the server is stopped, so the socket's buffers fill) takes the
/// connection out of use without failing the pipeline another lookup wrote
/// on it before: that one is answered on the lean path once the server
/// goes on, with no fallback to redis-rs, and the next lookup opens a new
/// connection. Before, the cut write dropped the connection and with it
/// the earlier pipeline, which fell back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_write_leaves_the_pipelines_written_before_it_their_answers() {
    let Some(redis) = support::binary(
        "redis-server",
        "a_cut_write_leaves_the_pipelines_written_before_it_their_answers",
    ) else {
        return;
    };
    let server = PrivateServer::redis(redis);
    let pid = server.pid().unwrap();
    let tier = Arc::new(
        RedisTier::new(RedisConfig {
            // Pipelines of megabytes: a few fill the socket's buffers.
            pipeline_chunk: 100_000,
            response_timeout_ms: 5_000,
            ..RedisConfig::from_url(server.url())
        })
        .unwrap(),
    );
    let small = unique_keys(4096, 36);
    store_every(&tier, &small, 2).await;
    assert_eq!(tier.exists_many(&small[..1]).await.unwrap(), [true]);
    let big = unique_keys(400_000, 36);
    signal(pid, "-STOP");
    let written_first = {
        let tier = Arc::clone(&tier);
        let small = small.clone();
        tokio::spawn(async move { tier.exists_many(&small).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let cut = tokio::time::timeout(Duration::from_millis(300), tier.exists_many(&big)).await;
    signal(pid, "-CONT");
    assert!(cut.is_err(), "the big lookup was written whole");
    let found = written_first.await.unwrap().unwrap();
    assert_eq!(wrong_answers(&found, 0, 2), 0);
    assert_eq!(tier.pipeline_stats().fallbacks, 0);
    assert_eq!(
        tier.exists_many(&small[..4]).await.unwrap(),
        [true, false, true, false]
    );
    assert_eq!(tier.pipeline_stats().fallbacks, 0);
}
