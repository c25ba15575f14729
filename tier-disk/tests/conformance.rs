//! The lookup-core conformance suite against the disk tier.

use std::sync::Arc;

use kvtier_core::testkit::{self, TierFixture};
use kvtier_core::{OffloadKey, TierError};
use kvtier_disk::{DiskConfig, DiskTier, FsyncPolicy};

struct DiskFixture {
    tier: Arc<DiskTier>,
    _dir: tempfile::TempDir,
}

impl TierFixture for DiskFixture {
    type Tier = DiskTier;

    fn tier(&self) -> Arc<DiskTier> {
        Arc::clone(&self.tier)
    }

    async fn insert(&self, keys: &[OffloadKey]) -> Result<(), TierError> {
        for key in keys {
            self.tier.store(key, key.as_bytes())?;
        }
        Ok(())
    }

    async fn remove(&self, keys: &[OffloadKey]) -> Result<(), TierError> {
        for key in keys {
            self.tier.remove(key)?;
        }
        Ok(())
    }
}

fn fixture(fsync: FsyncPolicy) -> DiskFixture {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = DiskConfig {
        fsync,
        initial_slots: 64, // grows several times during the suite
        ..DiskConfig::new(dir.path())
    };
    DiskFixture {
        tier: Arc::new(DiskTier::open(config).expect("open")),
        _dir: dir,
    }
}

#[tokio::test]
async fn conformance_fsync_never() {
    testkit::run_all(&fixture(FsyncPolicy::Never)).await;
}

#[tokio::test]
async fn conformance_fsync_always() {
    let f = fixture(FsyncPolicy::Always);
    testkit::empty_batch(&f).await;
    testkit::answers_follow_key_order(&f).await;
    testkit::removed_keys_are_misses(&f).await;
    testkit::through_manager(&f).await;
}
