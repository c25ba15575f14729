//! The lookup-core conformance suite against a real Redis server and a real
//! 3-master Redis Cluster (from scripts/services.sh).

use kvtier_test_services as support;

use std::sync::Arc;

use kvtier_core::testkit::{self, Fixture};
use kvtier_redis::{RedisConfig, RedisTier};

fn fixture(config: RedisConfig) -> Fixture<RedisTier> {
    let tier = Arc::new(RedisTier::new(config).unwrap());
    let name = tier.endpoint().to_owned();
    Fixture::new(tier).with_name(name)
}

#[tokio::test]
async fn conformance_single_node() {
    let Some(url) = support::service("KVTIER_REDIS_URL", "conformance_single_node") else {
        return;
    };
    let config = RedisConfig {
        key_prefix: "kvtier-conformance:".into(),
        pipeline_chunk: 64,
        ..RedisConfig::from_url(url)
    };
    testkit::run_all(&fixture(config)).await;
}

#[tokio::test]
async fn conformance_cluster() {
    let Some(urls) = support::service("KVTIER_REDIS_CLUSTER_URLS", "conformance_cluster") else {
        return;
    };
    let config = RedisConfig {
        key_prefix: "kvtier-conformance:".into(),
        pipeline_chunk: 64,
        ..RedisConfig::cluster(urls.split(','))
    };
    testkit::run_all(&fixture(config)).await;
}

#[tokio::test]
async fn conformance_tls() {
    let Some(url) = support::service("KVTIER_REDIS_TLS_URL", "conformance_tls") else {
        return;
    };
    let Some(ca) = support::service("KVTIER_REDIS_TLS_CA", "conformance_tls") else {
        return;
    };
    let config = RedisConfig {
        key_prefix: "kvtier-conformance-tls:".into(),
        tls_ca_cert: Some(ca.into()),
        pipeline_chunk: 64,
        ..RedisConfig::from_url(url)
    };
    testkit::run_all(&fixture(config)).await;
}
