//! Tenant isolation (issue 12 item 1) with the documented pattern for this
//! tier: one `DiskTier` per tenant, each in its own directory. Two tenants
//! store the same key bytes; each sees only its own blocks through
//! `batch_lookup`, `load` and a manager, in the same window.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{key, small};
use kvtier_core::{BlockStore, ManagerConfig, OffloadKey, PrefixVerdict, ReqContext, Tier};
use kvtier_disk::DiskTier;

fn block(tenant: &str, i: u64) -> Vec<u8> {
    format!("{tenant}-{i}").into_bytes()
}

#[tokio::test]
async fn two_tenants_with_the_same_key_bytes_see_only_their_own_blocks() {
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = Arc::new(DiskTier::open(small(dir_a.path())).unwrap());
    let b = Arc::new(DiskTier::open(small(dir_b.path())).unwrap());
    let keys: Vec<OffloadKey> = (0..6).map(key).collect();
    // A holds keys 0..4, B keys 2..6: keys 2 and 3 are in both, with other bytes.
    let blocks_a: Vec<_> = (0..4).map(|i| (key(i), block("a", i))).collect();
    let blocks_b: Vec<_> = (2..6).map(|i| (key(i), block("b", i))).collect();
    a.store_many(&blocks_a).await.unwrap();
    b.store_many(&blocks_b).await.unwrap();

    let ctx = ReqContext::new("same-request");
    assert_eq!(
        a.batch_lookup(&keys, &ctx).await.unwrap(),
        [true, true, true, true, false, false]
    );
    assert_eq!(
        b.batch_lookup(&keys, &ctx).await.unwrap(),
        [false, false, true, true, true, true]
    );
    let loaded_a = a.load_many(&keys).await.unwrap();
    let loaded_b = b.load_many(&keys).await.unwrap();
    for i in 0..6u64 {
        let (want_a, want_b) = (
            (i < 4).then(|| block("a", i)),
            (i >= 2).then(|| block("b", i)),
        );
        assert_eq!(loaded_a[i as usize], want_a, "tenant a, key {i}");
        assert_eq!(loaded_b[i as usize], want_b, "tenant b, key {i}");
        assert_eq!(BlockStore::load(&*a, &key(i)).await.unwrap(), want_a);
    }

    // Through a manager per tenant, the same prompts in the same window.
    let prompts = [
        keys.clone(),                                         // a: 4, b: 0
        vec![key(2), key(3), key(4), key(5), key(0), key(1)], // a: 2, b: 4
    ];
    let config = ManagerConfig::named("tenant");
    let mut managers = [
        a.manager(config.clone()).unwrap(),
        b.manager(config).unwrap(),
    ];
    // One request per prompt; the two tenants' managers see the same requests.
    let contexts = [ReqContext::new("req-0"), ReqContext::new("req-1")];
    let mut answers = [[None; 2]; 2];
    let started = Instant::now();
    while answers.iter().flatten().any(Option::is_none) {
        for (t, manager) in managers.iter_mut().enumerate() {
            for (p, prompt) in prompts.iter().enumerate() {
                if answers[t][p].is_none()
                    && let PrefixVerdict::Ready(n) =
                        manager.lookup_prefix(prompt, &contexts[p]).unwrap()
                {
                    answers[t][p] = Some(n);
                }
            }
            manager.flush();
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the managers did not answer"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(answers, [[Some(4), Some(2)], [Some(0), Some(4)]]);

    // A removal in one tenant leaves the other's block of the same key.
    a.remove(&key(2)).await.unwrap();
    assert_eq!(a.load_blocking(&key(2)).unwrap(), None);
    assert_eq!(b.load_blocking(&key(2)).unwrap(), Some(block("b", 2)));
}
