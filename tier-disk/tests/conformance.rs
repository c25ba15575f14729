//! The lookup-core conformance suite against the disk tier.

use std::sync::Arc;

use kvtier_core::testkit::{self, Fixture};
use kvtier_disk::{DiskConfig, DiskTier, FsyncPolicy};

/// The fixture and the directory it lives in (removed on drop).
fn fixture(fsync: FsyncPolicy) -> (Fixture<DiskTier>, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = DiskConfig {
        fsync,
        initial_slots: 64, // grows several times during the suite
        ..DiskConfig::new(dir.path())
    };
    let tier = Arc::new(DiskTier::open(config).expect("open"));
    (Fixture::new(tier).with_name("disk"), dir)
}

#[tokio::test]
async fn conformance_fsync_never() {
    let (f, _dir) = fixture(FsyncPolicy::Never);
    testkit::run_all(&f).await;
}

#[tokio::test]
async fn conformance_fsync_always() {
    let (f, _dir) = fixture(FsyncPolicy::Always);
    testkit::empty_batch(&f).await;
    testkit::answers_follow_key_order(&f).await;
    testkit::removed_keys_are_misses(&f).await;
    testkit::stored_blocks_load_back(&f).await;
    testkit::batch_forms(&f).await;
    testkit::through_manager(&f).await;
}
