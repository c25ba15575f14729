//! TierStack: prefix semantics across tiers, both policies, fan-out.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_core::testkit::{FaultConfig, FaultTier, RequestFault};
use kvtier_core::{
    AsyncLookupManager, ManagerConfig, OffloadKey, ReqContext, StackPolicy, StackVerdict, TierStack,
};

fn key(i: u8) -> OffloadKey {
    OffloadKey::new(&[i; 36])
}

fn tier(keys: &[u8], latency_ms: u64) -> Arc<FaultTier> {
    let tier = Arc::new(FaultTier::new(FaultConfig::with_latency(
        Duration::from_millis(latency_ms),
    )));
    tier.insert(keys.iter().map(|&k| key(k)));
    tier
}

fn stack(policy: StackPolicy, tiers: &[&Arc<FaultTier>]) -> TierStack {
    let mut stack = TierStack::new(policy);
    for (i, tier) in tiers.iter().enumerate() {
        stack.push(Box::new(
            AsyncLookupManager::from_arc(Arc::clone(tier), ManagerConfig::named(format!("t{i}")))
                .unwrap(),
        ));
    }
    stack
}

fn resolve(stack: &mut TierStack, prompt: &[OffloadKey], ctx: &ReqContext) -> StackVerdict {
    let start = Instant::now();
    loop {
        match stack.lookup_prefix(prompt, ctx).unwrap() {
            StackVerdict::Pending => {
                assert!(start.elapsed() < Duration::from_secs(20));
                stack.flush();
                std::thread::sleep(Duration::from_millis(1));
            }
            ready => return ready,
        }
    }
}

#[test]
fn each_block_comes_from_the_first_tier_that_holds_it() {
    let near = tier(&[0, 1, 3], 0);
    let far = tier(&[0, 1, 2, 3, 5], 0);
    let mut s = stack(StackPolicy::default(), &[&near, &far]);
    let prompt: Vec<OffloadKey> = (0..7).map(key).collect();
    let ctx = ReqContext::new("r");
    // 4 is nowhere: the prefix ends there even though 5 is in `far`.
    assert_eq!(
        resolve(&mut s, &prompt, &ctx),
        StackVerdict::Ready {
            locations: vec![0, 0, 1, 0]
        }
    );
    // One round trip per tier: the whole prompt went out in the first step.
    assert_eq!(near.call_count(), 1);
    assert_eq!(far.call_count(), 1);
    s.cleanup("r");
    s.drain_results();
    assert!(s.is_idle());
    let stats = s.stats();
    assert_eq!(stats.len(), 2);
    assert_eq!(
        (stats[0].tier.as_str(), stats[1].tier.as_str()),
        ("t0", "t1")
    );
    assert_eq!(s.shutdown().len(), 2);
}

#[test]
fn a_pending_preferred_tier_keeps_the_answer_pending_unless_the_policy_says_otherwise() {
    let near = tier(&[0], 0);
    near.set_request_fault("r", RequestFault::Delay(Duration::from_millis(300)));
    let far = tier(&[0], 0);
    let prompt = vec![key(0)];
    let ctx = ReqContext::new("r");

    let mut prefer = stack(StackPolicy::PreferEarlierTiers, &[&near, &far]);
    assert_eq!(
        prefer.lookup_prefix(&prompt, &ctx).unwrap(),
        StackVerdict::Pending
    );
    prefer.flush();
    // `far` answers at once, but `near` might hold the block: still pending.
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(100) {
        assert_eq!(
            prefer.lookup_prefix(&prompt, &ctx).unwrap(),
            StackVerdict::Pending
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(
        resolve(&mut prefer, &prompt, &ctx),
        StackVerdict::Ready { locations: vec![0] }
    );

    // Now `near` never answers this request (its call runs until the
    // deadline), so `far` answers first however slow the machine is.
    let ctx = ReqContext::new("r-hang");
    near.set_request_fault("r-hang", RequestFault::Hang);
    let mut first = stack(StackPolicy::FirstResolvedHit, &[&near, &far]);
    first.lookup_prefix(&prompt, &ctx).unwrap();
    first.flush();
    // The first resolved hit is taken: `far`, while `near` is still running.
    assert_eq!(
        resolve(&mut first, &prompt, &ctx),
        StackVerdict::Ready { locations: vec![1] }
    );
    // `near` has not answered: its call hangs (it may not even have started
    // on a busy machine, so count answers rather than running calls).
    assert_eq!(
        first.stats()[0].calls_finished,
        0,
        "answered before the preferred tier"
    );
}

#[test]
fn mark_miss_names_its_tier_and_the_block_falls_through() {
    let near = tier(&[0, 1], 0);
    let far = tier(&[0, 1], 0);
    let mut s = stack(StackPolicy::default(), &[&near, &far]);
    let prompt = vec![key(0), key(1)];
    let ctx = ReqContext::new("r");
    assert_eq!(
        resolve(&mut s, &prompt, &ctx),
        StackVerdict::Ready {
            locations: vec![0, 0]
        }
    );
    // Loading block 1 from `near` failed: mark it there; it now comes from `far`.
    s.mark_miss(0, &prompt[1..]);
    assert_eq!(
        resolve(&mut s, &prompt, &ctx),
        StackVerdict::Ready {
            locations: vec![0, 1]
        }
    );
    s.mark_miss(1, &prompt[1..]);
    assert_eq!(
        resolve(&mut s, &prompt, &ctx),
        StackVerdict::Ready { locations: vec![0] }
    );
    s.mark_miss(7, &prompt); // an unknown tier index is ignored
}
