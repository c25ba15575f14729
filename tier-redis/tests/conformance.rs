//! The lookup-core conformance suite against a real Redis server and a real
//! 3-master Redis Cluster (from scripts/services.sh).

use kvtier_test_services as support;

use std::sync::Arc;

use kvtier_core::testkit::{self, TierFixture};
use kvtier_core::{OffloadKey, TierError};
use kvtier_redis::{RedisConfig, RedisTier};

struct RedisFixture(Arc<RedisTier>);

impl TierFixture for RedisFixture {
    type Tier = RedisTier;

    fn tier(&self) -> Arc<RedisTier> {
        Arc::clone(&self.0)
    }

    async fn insert(&self, keys: &[OffloadKey]) -> Result<(), TierError> {
        let blocks: Vec<(OffloadKey, Vec<u8>)> = keys
            .iter()
            .map(|k| (k.clone(), k.as_bytes().to_vec()))
            .collect();
        Ok(self.0.store_many(&blocks, None).await?)
    }

    async fn remove(&self, keys: &[OffloadKey]) -> Result<(), TierError> {
        self.0.remove_many(keys).await?;
        Ok(())
    }

    fn name(&self) -> String {
        self.0.endpoint().to_owned()
    }
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
    testkit::run_all(&RedisFixture(Arc::new(RedisTier::new(config).unwrap()))).await;
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
    testkit::run_all(&RedisFixture(Arc::new(RedisTier::new(config).unwrap()))).await;
}
