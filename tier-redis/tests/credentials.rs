//! Credentials in URLs never show: not in `Debug`, not in any error, not in
//! the endpoint the manager logs; and a URL that cannot be used is refused
//! up front with an error that names it (masked) and the schemes accepted.

use kvtier_test_services as support;

use kvtier_core::testkit::unique_keys;
use kvtier_core::{BlockStore, ReqContext, Tier};
use kvtier_redis::{RedisConfig, RedisTier, RedisTierError};

const SECRET: &str = "Sup3rSecret";
/// `SECRET` percent-encoded, as a URL may carry it.
const ENCODED_SECRET: &str = "Sup3r%53ecret";

/// Every form in which redis-rs 1.8 reads a user or password from a URL.
fn credential_forms(port: u16) -> Vec<String> {
    let dir = std::env::temp_dir();
    let sock = dir.join(format!("kvtier-missing-{port}.sock"));
    let sock = sock.display();
    vec![
        format!("redis://alice:{SECRET}@127.0.0.1:{port}/0"),
        format!("redis://alice:{ENCODED_SECRET}@127.0.0.1:{port}/0"),
        format!("redis://:{SECRET}@127.0.0.1:{port}"),
        format!("redis://{SECRET}@127.0.0.1:{port}/"),
        format!("rediss://:{SECRET}@127.0.0.1:{port}/"),
        format!("valkey://bob:{SECRET}@127.0.0.1:{port}/1?protocol=resp2"),
        format!("valkeys://bob:{SECRET}@127.0.0.1:{port}/"),
        format!("redis+unix://{sock}?pass={SECRET}"),
        format!("redis+unix://{sock}?db=1&user=carol&pass={ENCODED_SECRET}"),
        format!("unix://{sock}?user={SECRET}&pass={SECRET}"),
        format!("valkey+unix://{sock}?pass={SECRET}&db=2"),
    ]
}

fn assert_hidden(shown: &str, form: &str) {
    assert!(
        !shown.contains(SECRET) && !shown.contains(ENCODED_SECRET),
        "a credential of {form} shows in: {shown}"
    );
}

/// What `config`'s tier shows of itself and of its errors, with where it
/// connects.
async fn everything_shown(config: RedisConfig) -> (String, String) {
    let mut shown = format!("{config:?}\n");
    let tier = RedisTier::new(config).unwrap_or_else(|e| panic!("{e}"));
    shown += &format!("{tier:?}\n{}\n", tier.endpoint());
    let keys = unique_keys(2, 36);
    let err = tier.exists_many(&keys).await.unwrap_err();
    shown += &format!("{err}\n{err:?}\n");
    let err = BlockStore::store(&tier, &keys[0], b"v").await.unwrap_err();
    shown += &format!("{err}\n{err:?}\n");
    // What the lookup manager logs: the tier error's Display.
    let tier_err = tier
        .batch_lookup(&keys, &ReqContext::new("r"))
        .await
        .unwrap_err();
    shown += &format!("{tier_err}\n{tier_err:?}\n");
    (shown, tier.endpoint().to_owned())
}

#[tokio::test]
async fn no_url_credential_shows_in_debug_errors_or_the_logged_endpoint() {
    let port = support::free_port();
    let mut checks = tokio::task::JoinSet::new();
    for form in credential_forms(port) {
        let single = RedisConfig {
            connect_timeout_ms: 200,
            response_timeout_ms: 300,
            ..RedisConfig::from_url(form.clone())
        };
        let mut configs = vec![single.clone()];
        if !form.contains("unix") {
            configs.push(RedisConfig {
                cluster_urls: vec![form.clone()],
                ..single
            });
        }
        for config in configs {
            let form = form.clone();
            checks.spawn(async move { (form, everything_shown(config).await) });
        }
    }
    let mut checked = 0;
    while let Some(done) = checks.join_next().await {
        let (form, (shown, endpoint)) = done.unwrap();
        assert_hidden(&shown, &form);
        // The endpoint still says where.
        assert!(
            endpoint.contains("127.0.0.1") || endpoint.contains(".sock"),
            "{endpoint}"
        );
        checked += 1;
    }
    assert_eq!(checked, 18);
}

#[test]
fn a_url_that_does_not_parse_is_named_masked_with_the_schemes_accepted() {
    let cases = [
        (
            format!("redis://alice:{SECRET}@127.0.0.1:notaport/"),
            "127.0.0.1:notaport",
        ),
        (
            "http://127.0.0.1:6379/".to_owned(),
            "scheme \"http\" is not a Redis scheme",
        ),
        (
            format!("redis://alice:{SECRET}@127.0.0.1:6379/notadb"),
            "redis://***@127.0.0.1:6379/notadb",
        ),
        (format!("redis:{SECRET}@127.0.0.1"), "127.0.0.1"),
        (format!("redis+unix://relative?pass={SECRET}"), "relative"),
    ];
    for (url, named) in cases {
        for config in [
            RedisConfig::from_url(url.clone()),
            RedisConfig::cluster(["redis://127.0.0.1:7000/".to_owned(), url.clone()]),
        ] {
            let err = RedisTier::new(config).unwrap_err();
            assert!(
                matches!(err, RedisTierError::InvalidConfig { .. }),
                "{url}: {err:?}"
            );
            let shown = format!("{err}\n{err:?}");
            assert_hidden(&shown, &url);
            for needle in [named, "redis://", "rediss://", "redis+unix://", "unix://"] {
                assert!(shown.contains(needle), "{url}: {needle:?} not in {shown}");
            }
        }
    }
}

#[test]
fn insecure_tls_urls_are_refused_with_the_way_to_trust_a_private_ca() {
    for url in [
        "rediss://127.0.0.1:6390/#insecure",
        "valkeys://127.0.0.1:6390/#insecure",
    ] {
        let config = RedisConfig::from_url(url);
        let err = config.validate().unwrap_err();
        assert!(
            matches!(err, RedisTierError::InvalidConfig { field: "url", .. }),
            "{err:?}"
        );
        let shown = err.to_string();
        assert!(
            shown.contains("#insecure") && shown.contains("tls_ca_cert"),
            "{shown}"
        );
        assert!(RedisTier::new(config).is_err());
        assert!(RedisTier::new(RedisConfig::cluster([url])).is_err());
    }
}

/// Malformed URLs (issue 25.6): a missing host, three slashes, a bare
/// password pasted into `url`, a forgotten `@host`. Each is refused, in
/// `url` and as an entry of `cluster_urls`, by an error that names the
/// field and the schemes accepted and shows the URL masked (a string
/// without a scheme only by its length); `Debug` masks it the same way.
#[test]
fn malformed_urls_and_bare_passwords_never_show_their_secret() {
    let cases = [
        (
            format!("redis:/u:{SECRET}@127.0.0.1:1"),
            "\"redis:/***@127.0.0.1:1\"",
        ),
        (
            format!("redis:///u:{SECRET}@127.0.0.1:1"),
            "\"redis:///***@127.0.0.1:1\"",
        ),
        (SECRET.to_owned(), "\"<hidden: 11 characters>\""),
        (format!("{SECRET}@127.0.0.1"), "\"<hidden: 21 characters>\""),
        (format!("alice:{SECRET}"), "\"<hidden: 17 characters>\""),
        (format!("redis://alice:{SECRET}"), "\"redis://alice:***\""),
        (
            format!("redis://alice:{ENCODED_SECRET}/0"),
            "\"redis://alice:***\"",
        ),
    ];
    for (url, shown) in &cases {
        for (field, config) in [
            ("url", RedisConfig::from_url(url.clone())),
            (
                "cluster_urls",
                RedisConfig::cluster(["redis://127.0.0.1:7000/".to_owned(), url.clone()]),
            ),
        ] {
            let err = RedisTier::new(config.clone()).unwrap_err();
            let text = format!("{err}\n{err:?}\n{config:?}");
            assert_hidden(&text, url);
            assert!(
                matches!(err, RedisTierError::InvalidConfig { field: f, .. } if f == field),
                "{url}: {err:?}"
            );
            for needle in [*shown, "redis://", "rediss://", "redis+unix://"] {
                assert!(text.contains(needle), "{url}: {needle:?} not in {text}");
            }
            // Without a scheme, not even the user name shows.
            if shown.starts_with("\"<hidden") {
                assert!(!text.contains("alice"), "{url}: {text}");
            }
        }
    }
}
