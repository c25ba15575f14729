//! Tenants sharing one manager: a tenant never receives a verdict made for
//! another tenant. The manager identifies a block by its key bytes, so
//! tenants keep apart by salting their block hashes (vLLM's `cache_salt`);
//! `ReqContext` carries no namespace a tier could scope keys by (one the
//! ledger did not key by would hand tenant B the verdict of tenant A's
//! probe).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_core::ledger::{CallOutcome, LazyNow, Ledger};
use kvtier_core::testkit::FaultTier;
use kvtier_core::{
    AsyncLookupManager, LookupVerdict, ManagerConfig, OffloadKey, PrefixVerdict, ReqContext,
};

/// Block `i` of a prompt every tenant sends, salted for `tenant`: the salt
/// enters the hash of the first block and so every block's key.
fn salted(tenant: &str, i: u32) -> OffloadKey {
    let mut hash = [0x42u8; 32];
    for (h, s) in hash.iter_mut().zip(tenant.bytes()) {
        *h ^= s;
    }
    OffloadKey::from_block_hash(&hash, i)
}

/// Two tenants with salted keys: both ask for the same
/// block in one window, one probe is answered per tenant key, and each
/// tenant gets its own verdict.
#[test]
fn salted_keys_keep_tenants_apart_in_the_ledger() {
    let now = Instant::now();
    let mut ledger = Ledger::new(&ManagerConfig::named("shared"), now);
    let (a, b) = (ReqContext::new("a"), ReqContext::new("b"));
    let (key_a, key_b) = (salted("tenant-a", 0), salted("tenant-b", 0));
    assert_ne!(key_a, key_b);
    for (key, ctx) in [(&key_a, &a), (&key_b, &b)] {
        assert_eq!(
            ledger.lookup(key, ctx, &mut LazyNow::at(now)),
            Ok(LookupVerdict::Pending)
        );
    }
    ledger.flush(now);
    // The tier holds tenant-a's block only.
    let mut probed = Vec::new();
    while let Some(call) = ledger.next_call(now) {
        let found = call.keys.iter().map(|k| *k == key_a).collect();
        probed.extend(call.keys.iter().cloned());
        ledger.complete(call.id, CallOutcome::Answered(found), Duration::ZERO, now);
    }
    probed.sort();
    let mut both = vec![key_a.clone(), key_b.clone()];
    both.sort();
    assert_eq!(probed, both, "each tenant's key is probed once");
    assert_eq!(
        ledger.lookup(&key_a, &a, &mut LazyNow::at(now)),
        Ok(LookupVerdict::Hit)
    );
    assert_eq!(
        ledger.lookup(&key_b, &b, &mut LazyNow::at(now)),
        Ok(LookupVerdict::Miss),
        "tenant-b got tenant-a's verdict"
    );
}

/// The same through the manager and its worker, over one tier holding
/// tenant-a's whole prompt and none of tenant-b's.
#[test]
fn salted_keys_keep_tenants_apart_in_the_manager() {
    let tier = Arc::new(FaultTier::default());
    let prompt = |tenant: &str| -> Vec<OffloadKey> { (0..4).map(|i| salted(tenant, i)).collect() };
    tier.insert(prompt("tenant-a"));
    let mut manager =
        AsyncLookupManager::from_arc(Arc::clone(&tier), ManagerConfig::named("shared"))
            .expect("manager starts");
    let asks = [
        (ReqContext::new("a"), prompt("tenant-a")),
        (ReqContext::new("b"), prompt("tenant-b")),
    ];
    let guard = Instant::now();
    let verdicts = loop {
        let verdicts: Vec<PrefixVerdict> = asks
            .iter()
            .map(|(ctx, keys)| manager.lookup_prefix(keys, ctx).expect("valid keys"))
            .collect();
        if verdicts.iter().all(|v| *v != PrefixVerdict::Pending) {
            break verdicts;
        }
        // Only stops a broken build from hanging; no speed is asserted.
        assert!(guard.elapsed() < Duration::from_secs(20), "no verdict");
        manager.flush();
        std::thread::sleep(Duration::from_millis(1));
    };
    assert_eq!(
        verdicts,
        [PrefixVerdict::Ready(4), PrefixVerdict::Ready(0)],
        "tenant-a has its prompt cached, tenant-b none of it"
    );
    manager.shutdown();
}
