//! The lookup-core conformance suite against the mock tier, with and without latency.

use std::sync::Arc;
use std::time::Duration;

use kvtier_core::testkit::{self, Fixture};
use kvtier_mock::{MockConfig, MockTier};

fn fixture(config: MockConfig) -> Fixture<MockTier> {
    Fixture::new(Arc::new(MockTier::new(config))).with_name("mock")
}

#[tokio::test]
async fn conformance_without_latency() {
    testkit::run_all(&fixture(MockConfig::default())).await;
}

#[tokio::test]
async fn conformance_with_latency_and_jitter() {
    let config = MockConfig {
        latency_us: 300,
        jitter_us: 700,
        seed: 7,
        ..MockConfig::default()
    };
    testkit::run_all(&fixture(config)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_on_a_multi_thread_runtime() {
    let config = MockConfig::with_latency(Duration::from_micros(200));
    testkit::run_all(&fixture(config)).await;
}
