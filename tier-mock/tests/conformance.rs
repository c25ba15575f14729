//! The lookup-core conformance suite against the mock tier, with and without latency.

use std::sync::Arc;
use std::time::Duration;

use kvtier_core::testkit::{self, TierFixture};
use kvtier_core::{OffloadKey, TierError};
use kvtier_mock::{MockConfig, MockTier};

struct MockFixture(Arc<MockTier>);

impl TierFixture for MockFixture {
    type Tier = MockTier;

    fn tier(&self) -> Arc<MockTier> {
        Arc::clone(&self.0)
    }

    async fn insert(&self, keys: &[OffloadKey]) -> Result<(), TierError> {
        self.0.insert(keys.iter().cloned());
        Ok(())
    }

    async fn remove(&self, keys: &[OffloadKey]) -> Result<(), TierError> {
        self.0.remove(keys);
        Ok(())
    }
}

#[tokio::test]
async fn conformance_without_latency() {
    testkit::run_all(&MockFixture(Arc::new(MockTier::new(MockConfig::default())))).await;
}

#[tokio::test]
async fn conformance_with_latency_and_jitter() {
    let config = MockConfig {
        latency_us: 300,
        jitter_us: 700,
        seed: 7,
        ..MockConfig::default()
    };
    testkit::run_all(&MockFixture(Arc::new(MockTier::new(config)))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_on_a_multi_thread_runtime() {
    let config = MockConfig::with_latency(Duration::from_micros(200));
    testkit::run_all(&MockFixture(Arc::new(MockTier::new(config)))).await;
}
