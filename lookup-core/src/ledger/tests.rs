//! The ledger's unit tests: request serials and shared references, the
//! time to verdict, and queue deadlines of keys topping up a group.

use std::time::{Duration, Instant};

use super::requests::SHARED_COMPACT_MIN;
use super::table::NO_REQUEST;
use super::*;

fn ledger() -> Ledger {
    Ledger::new(&ManagerConfig::named("test"), Instant::now())
}

fn answer_all(l: &mut Ledger, now: Instant) {
    l.flush(now);
    while let Some(call) = l.next_call(now) {
        let found = vec![true; call.keys.len()];
        l.complete(call.id, CallOutcome::Answered(found), Duration::ZERO, now);
    }
}

#[test]
fn request_serials_wrap_without_sharing_a_serial() {
    let mut l = ledger();
    l.set_next_serial(NO_REQUEST - 2);
    let now = Instant::now();
    let mut lazy = LazyNow::at(now);
    let key = OffloadKey::new(b"shared");
    let other = OffloadKey::new(b"other");
    let (a, b) = (ReqContext::new("a"), ReqContext::new("b"));
    // a creates the key (serial MAX-2), b shares it (MAX-1).
    l.lookup(&key, &a, &mut lazy).unwrap();
    l.lookup(&key, &b, &mut lazy).unwrap();
    answer_all(&mut l, now);
    // c is the first request past the wrap: live requests are renumbered
    // (a → 0, b → 1) and c gets 2, so c's marks cannot be taken for a's.
    let c = ReqContext::new("c");
    assert_eq!(l.lookup(&key, &c, &mut lazy), Ok(LookupVerdict::Hit));
    assert_eq!(l.lookup(&other, &c, &mut lazy), Ok(LookupVerdict::Pending));
    // A fourth request after renumbering gets a fresh serial too.
    let d = ReqContext::new("d");
    assert_eq!(l.lookup(&key, &d, &mut lazy), Ok(LookupVerdict::Hit));
    // The creator asks again after the renumbering: it must not take a
    // second reference that outlives its cleanup.
    assert_eq!(l.lookup(&key, &a, &mut lazy), Ok(LookupVerdict::Hit));
    answer_all(&mut l, now);
    for (req, tracked) in [("a", 2), ("b", 2), ("d", 2), ("c", 0)] {
        l.cleanup(req);
        assert_eq!(l.stats().tracked_keys, tracked, "after cleanup of {req}");
    }
    assert!(l.is_empty());
}

#[test]
fn time_to_verdict_runs_from_each_keys_flush_to_its_first_answer() {
    let cfg = ManagerConfig {
        max_calls_in_flight: 1,
        failure_backoff_ms: 5,
        ..ManagerConfig::named("test")
    };
    let mut l = Ledger::new(&cfg, Instant::now());
    let t0 = Instant::now();
    let ms = Duration::from_millis;
    let key = |i: u8| OffloadKey::new(&[i; 36]);
    // (samples, largest in ms): the histogram keeps 3 significant digits.
    let ttv = |l: &Ledger| {
        let s = l.stats().time_to_verdict;
        (s.count, (s.max_us + 5) / 1000)
    };
    let start = |l: &mut Ledger, at: Duration| {
        let mut calls = Vec::new();
        l.flush_and_start(t0 + at, &mut calls);
        calls
    };
    // a's two keys start at once; b's key waits for the only call slot.
    let (a, b) = (ReqContext::new("a"), ReqContext::new("b"));
    for i in [1, 2] {
        l.lookup(&key(i), &a, &mut LazyNow::at(t0)).unwrap();
    }
    let first = start(&mut l, ms(0)).pop().expect("a's call");
    l.lookup(&key(3), &b, &mut LazyNow::at(t0 + ms(1))).unwrap();
    assert!(start(&mut l, ms(1)).is_empty(), "the slot is taken");
    // a's answer at 3 ms: two first verdicts, 3 ms after their flush.
    l.complete(
        first.id,
        CallOutcome::Answered(vec![true, false]),
        ms(3),
        t0 + ms(3),
    );
    assert_eq!(ttv(&l), (2, 3));
    // b's key, queued at 1 ms, answered at 10 ms: 9 ms, its own flush.
    let second = l.next_call(t0 + ms(4)).expect("b's call");
    l.complete(
        second.id,
        CallOutcome::Answered(vec![true]),
        ms(6),
        t0 + ms(10),
    );
    assert_eq!(ttv(&l), (3, 9));
    // A failure is a first verdict too (a miss, counted as an error)...
    let c = ReqContext::new("c");
    l.lookup(&key(4), &c, &mut LazyNow::at(t0 + ms(10)))
        .unwrap();
    let failing = start(&mut l, ms(10)).pop().expect("c's call");
    let err = TierError::new(TierErrorKind::Unavailable, "down");
    l.complete(failing.id, CallOutcome::Failed(err), ms(2), t0 + ms(12));
    assert_eq!(ttv(&l).0, 4);
    // ...and its re-check past the back-off is not: c had its miss.
    let mut later = LazyNow::at(t0 + ms(20));
    assert_eq!(l.lookup(&key(4), &c, &mut later), Ok(LookupVerdict::Miss));
    let recheck = start(&mut l, ms(20)).pop().expect("the re-check");
    l.complete(
        recheck.id,
        CallOutcome::Answered(vec![true]),
        ms(1),
        t0 + ms(21),
    );
    assert_eq!(l.lookup(&key(4), &c, &mut later), Ok(LookupVerdict::Hit));
    assert_eq!(ttv(&l).0, 4);
    // Nor is the answer for a key whose request left while it ran.
    let d = ReqContext::new("d");
    l.lookup(&key(5), &d, &mut LazyNow::at(t0 + ms(21)))
        .unwrap();
    let orphan = start(&mut l, ms(21)).pop().expect("d's call");
    l.cleanup("d");
    l.complete(
        orphan.id,
        CallOutcome::Answered(vec![true]),
        ms(1),
        t0 + ms(30),
    );
    assert_eq!(ttv(&l).0, 4);
    assert_eq!(l.stats().tracked_keys, 4, "d's key is forgotten");
}

#[test]
fn a_request_sharing_many_keys_holds_each_once() {
    let mut l = ledger();
    let now = Instant::now();
    let mut lazy = LazyNow::at(now);
    let keys: Vec<OffloadKey> = (0..2 * SHARED_COMPACT_MIN as u32 + 3)
        .map(|i| OffloadKey::new(&i.to_be_bytes()))
        .collect();
    let (a, b) = (ReqContext::new("a"), ReqContext::new("b"));
    // a creates every key; b shares them, and both ask again in turns,
    // as waiting requests do every step, b in an order that changes
    // every round (its cursor loses track): such an ask of b after a's
    // takes one more reference, and compaction must release the extra
    // ones so b's list stays within twice its keys.
    for round in 0..20 {
        for ctx in [&a, &b] {
            let reversed = ctx.req_id() == "b" && round % 2 == 1;
            let order: Vec<&OffloadKey> = if reversed {
                keys.iter().rev().collect()
            } else {
                keys.iter().collect()
            };
            for key in order {
                l.lookup(key, ctx, &mut lazy).unwrap();
            }
        }
        if round == 0 {
            answer_all(&mut l, now);
        }
        let held = l.requests.shared_len("b");
        assert!(
            held <= 2 * keys.len(),
            "round {round}: b holds {held} entries"
        );
    }
    let refs: Vec<u32> = keys
        .iter()
        .map(|k| l.keys.cold(l.keys.find(k).unwrap()).unwrap().refs)
        .collect();
    assert!(refs.iter().all(|&r| (2..=3).contains(&r)), "{refs:?}");
    l.cleanup("b");
    assert_eq!(
        l.stats().tracked_keys,
        keys.len(),
        "a still refers to every key"
    );
    l.cleanup("a");
    assert!(l.is_empty(), "{:?}", l.stats());
}

fn forty_keys() -> Vec<OffloadKey> {
    (0..40u32)
        .map(|i| OffloadKey::new(&i.to_be_bytes()))
        .collect()
}

/// Each of the `sharers` has one entry per key on its shared list, and
/// each key `refs` references.
fn assert_each_shared_key_held_once(l: &Ledger, sharers: &[&str], keys: &[OffloadKey], refs: u32) {
    for name in sharers {
        let held = l.requests.shared_len(name);
        assert_eq!(held, keys.len(), "{name} holds {held} entries");
    }
    for key in keys {
        let cold = l.keys.cold(l.keys.find(key).unwrap()).unwrap();
        assert_eq!(cold.refs, refs);
    }
}

#[test]
fn a_sharer_asking_in_its_usual_order_takes_one_reference() {
    let (mut l, now, keys) = (ledger(), Instant::now(), forty_keys());
    let mut lazy = LazyNow::at(now);
    let ctxs: Vec<ReqContext> = ["a", "b", "c", "d"]
        .into_iter()
        .map(ReqContext::new)
        .collect();
    // Four requests share every key and ask in turns, in the same order
    // each round, as waiting requests do: the sharers find their keys at their
    // cursors (the front again when a round starts) and take no
    // reference twice.
    for round in 0..6 {
        for ctx in &ctxs {
            for key in &keys {
                l.lookup(key, ctx, &mut lazy).unwrap();
            }
        }
        if round == 0 {
            answer_all(&mut l, now);
        }
    }
    assert_each_shared_key_held_once(&l, &["b", "c", "d"], &keys, 4);
    for ctx in &ctxs[..3] {
        l.cleanup(ctx.req_id());
    }
    assert_eq!(l.stats().tracked_keys, keys.len(), "d still holds them");
    l.cleanup("d");
    assert!(l.is_empty(), "{:?}", l.stats());
}

#[test]
fn a_sharer_asking_for_each_key_twice_in_a_row_takes_one_reference() {
    let (mut l, now, keys) = (ledger(), Instant::now(), forty_keys());
    let mut lazy = LazyNow::at(now);
    let (a, b) = (ReqContext::new("a"), ReqContext::new("b"));
    // `b` shares `a`'s keys and asks for each one twice in a row (a
    // prefix scan, then a lookup of the same key): the second ask of a
    // key it found at its cursor is the same request asking again.
    for round in 0..6 {
        for key in &keys {
            l.lookup(key, &a, &mut lazy).unwrap();
        }
        for key in &keys {
            l.lookup(key, &b, &mut lazy).unwrap();
            l.lookup(key, &b, &mut lazy).unwrap();
        }
        if round == 0 {
            answer_all(&mut l, now);
        }
    }
    assert_each_shared_key_held_once(&l, &["b"], &keys, 2);
    l.cleanup("a");
    l.cleanup("b");
    assert!(l.is_empty(), "{:?}", l.stats());
}

#[test]
fn a_sharer_asking_for_failed_keys_in_its_usual_order_takes_one_reference() {
    let (mut l, now, keys) = (ledger(), Instant::now(), forty_keys());
    let mut lazy = LazyNow::at(now);
    let (a, b) = (ReqContext::new("a"), ReqContext::new("b"));
    // Every probe fails; within the back-off each lookup answers miss
    // through the failed-key path, which checks membership again.
    for round in 0..6 {
        for ctx in [&a, &b] {
            for key in &keys {
                l.lookup(key, ctx, &mut lazy).unwrap();
            }
        }
        if round == 0 {
            l.flush(now);
            while let Some(call) = l.next_call(now) {
                let failed = TierError::new(TierErrorKind::Unavailable, "down");
                l.complete(call.id, CallOutcome::Failed(failed), Duration::ZERO, now);
            }
        }
    }
    assert_each_shared_key_held_once(&l, &["b"], &keys, 2);
    l.cleanup("a");
    l.cleanup("b");
    assert!(l.is_empty(), "{:?}", l.stats());
}

#[test]
fn keys_topping_up_a_queued_group_time_out_at_their_own_deadline() {
    let cfg = ManagerConfig {
        call_timeout_ms: 100,
        max_calls_in_flight: 1,
        ..ManagerConfig::named("test")
    };
    let mut l = Ledger::new(&cfg, Instant::now());
    let t0 = Instant::now();
    let ms = Duration::from_millis;
    let (a, b) = (ReqContext::new("a"), ReqContext::new("b"));
    let key = |i: u8| OffloadKey::new(&[i; 36]);
    // a's call takes the only slot; b's first key waits in a group.
    l.lookup(&key(1), &a, &mut LazyNow::at(t0)).unwrap();
    l.flush(t0);
    let running = l.next_call(t0).expect("a call for a");
    l.lookup(&key(2), &b, &mut LazyNow::at(t0)).unwrap();
    l.flush(t0);
    assert!(l.next_call(t0).is_none(), "the only call slot is taken");
    // 60 ms later b's second key tops up the same waiting group.
    l.lookup(&key(3), &b, &mut LazyNow::at(t0 + ms(60)))
        .unwrap();
    l.flush(t0 + ms(60));
    // a's call answers at 50 ms: keep its key out of the way.
    l.complete(
        running.id,
        CallOutcome::Answered(vec![true]),
        ms(1),
        t0 + ms(50),
    );
    let verdict = |l: &mut Ledger, i: u8, at: Duration| {
        l.lookup(&key(i), &b, &mut LazyNow::at(t0 + at)).unwrap()
    };
    // At 100 ms only the key flushed at 0 has waited a whole timeout.
    l.expire(t0 + ms(100));
    assert_eq!(l.stats().timeouts, 1);
    assert_eq!(verdict(&mut l, 2, ms(100)), LookupVerdict::Miss);
    assert_eq!(verdict(&mut l, 3, ms(100)), LookupVerdict::Pending);
    l.expire(t0 + ms(159));
    assert_eq!(l.stats().timeouts, 1);
    l.expire(t0 + ms(160));
    assert_eq!(l.stats().timeouts, 2);
    assert_eq!(verdict(&mut l, 3, ms(160)), LookupVerdict::Miss);
}

#[test]
fn a_context_with_a_registered_id_but_its_own_arc_is_never_taken_for_another() {
    let mut l = ledger();
    let now = Instant::now();
    let mut lazy = LazyNow::at(now);
    let key = |i: u8| OffloadKey::new(&[i; 36]);
    let a = ReqContext::new("req-a");
    l.lookup(&key(1), &a, &mut lazy).unwrap();
    // The same request through a context of its own (another `Arc` with
    // the same id), which the caller then drops.
    let again = ReqContext::new("req-a");
    l.lookup(&key(2), &again, &mut lazy).unwrap();
    drop(again);
    // New requests with ids of the same length: one may be allocated
    // where the dropped id was, were the ledger not keeping it.
    for (i, id) in ["req-b", "req-c", "req-d", "req-e"].into_iter().enumerate() {
        let i = i as u8;
        let other = ReqContext::new(id);
        l.lookup(&key(10 + i), &other, &mut lazy).unwrap();
        l.cleanup(other.req_id());
        assert_eq!(l.stats().tracked_keys, 2, "{id} held only its own key");
    }
    assert_eq!(l.stats().tracked_requests, 1);
    l.cleanup("req-a");
    assert!(l.is_empty(), "{:?}", l.stats());
}

#[test]
fn requests_after_a_wrap_still_share_and_release() {
    let mut l = ledger();
    l.set_next_serial(NO_REQUEST - 1);
    let now = Instant::now();
    let mut lazy = LazyNow::at(now);
    let key = OffloadKey::new(b"k");
    for r in 0..5 {
        let ctx = ReqContext::new(format!("r{r}"));
        l.lookup(&key, &ctx, &mut lazy).unwrap();
    }
    answer_all(&mut l, now);
    for r in 0..4 {
        l.cleanup(&format!("r{r}"));
        assert_eq!(l.stats().tracked_keys, 1, "r4 still refers to the key");
    }
    l.cleanup("r4");
    assert!(l.is_empty());
}

/// vLLM 0.34's `mark_present`: a finished store answers hit at once, in
/// every phase of a probe started before it, and that probe's answer
/// (here: absent, as the tier said before the store) is dropped.
#[test]
fn mark_present_supersedes_probes_in_flight_queued_and_in_the_batch() {
    let cfg = ManagerConfig {
        max_calls_in_flight: 1,
        ..ManagerConfig::named("test")
    };
    let now = Instant::now();
    let mut l = Ledger::new(&cfg, now);
    let mut lazy = LazyNow::at(now);
    let (a, b) = (ReqContext::new("a"), ReqContext::new("b"));
    let (running, queued, batched) = (
        OffloadKey::new(b"running"),
        OffloadKey::new(b"queued"),
        OffloadKey::new(b"batched"),
    );
    l.lookup(&running, &a, &mut lazy).unwrap();
    l.lookup(&queued, &b, &mut lazy).unwrap();
    l.flush(now);
    let call = l.next_call(now).expect("a's call");
    assert!(l.next_call(now).is_none(), "b's call waits for the slot");
    l.lookup(&batched, &a, &mut lazy).unwrap();

    l.mark_present([&running, &queued, &batched]);
    for (key, ctx) in [(&running, &a), (&queued, &b), (&batched, &a)] {
        assert_eq!(l.lookup(key, ctx, &mut lazy), Ok(LookupVerdict::Hit));
    }
    // The stale probes: the running one answers absent, the queued and
    // batched ones are never sent.
    let found = vec![false; call.keys.len()];
    l.complete(call.id, CallOutcome::Answered(found), Duration::ZERO, now);
    l.flush(now);
    assert!(l.next_call(now).is_none(), "superseded probes are not sent");
    for (key, ctx) in [(&running, &a), (&queued, &b), (&batched, &a)] {
        assert_eq!(l.lookup(key, ctx, &mut lazy), Ok(LookupVerdict::Hit));
    }
    assert_eq!(l.stats().stale_results_dropped, 1);
    // A forced miss is replaced too; a key nobody tracks is skipped.
    l.mark_miss([&running]);
    assert_eq!(l.lookup(&running, &a, &mut lazy), Ok(LookupVerdict::Miss));
    l.mark_present([&running, &OffloadKey::new(b"untracked")]);
    assert_eq!(l.lookup(&running, &a, &mut lazy), Ok(LookupVerdict::Hit));
    assert_eq!(l.stats().tracked_keys, 3);
    l.cleanup("a");
    l.cleanup("b");
    assert!(l.is_empty());
}

/// A key kept only for its running probe (its requests finished) is
/// forgotten by `mark_present`, as vLLM drops such an orphan.
#[test]
fn mark_present_forgets_an_orphan_in_flight() {
    let now = Instant::now();
    let mut l = ledger();
    let key = OffloadKey::new(b"orphan");
    l.lookup(&key, &ReqContext::new("a"), &mut LazyNow::at(now))
        .unwrap();
    l.flush(now);
    let call = l.next_call(now).expect("a call");
    l.cleanup("a");
    assert_eq!(l.stats().tracked_keys, 1, "kept for its answer");
    l.mark_present([&key]);
    assert!(l.stats().tracked_keys == 0);
    l.complete(
        call.id,
        CallOutcome::Answered(vec![true]),
        Duration::ZERO,
        now,
    );
    assert!(l.is_empty());
}

#[test]
fn a_waiting_group_of_keys_from_several_flushes_times_each_from_its_own() {
    let cfg = ManagerConfig {
        max_calls_in_flight: 1,
        ..ManagerConfig::named("test")
    };
    let mut l = Ledger::new(&cfg, Instant::now());
    let t0 = Instant::now();
    let ms = Duration::from_millis;
    let key = |i: u8| OffloadKey::new(&[i; 36]);
    // `holder` takes the only call slot with key `held` at `at` ms, and
    // `waiter`'s keys wait for it, each batch flushed at its own ms; the
    // holder's call is answered `answer` at `freed` ms. Gives the waiting
    // group's call.
    let wait_behind = |l: &mut Ledger,
                       (holder, held, at): (&str, u8, u64),
                       (waiter, flushes): (&str, &[(u64, &[u8])]),
                       (answer, freed): (bool, u64)| {
        let start = |l: &mut Ledger, at: u64| {
            let mut calls = Vec::new();
            l.flush_and_start(t0 + ms(at), &mut calls);
            calls
        };
        let (holder, waiter) = (ReqContext::new(holder), ReqContext::new(waiter));
        l.lookup(&key(held), &holder, &mut LazyNow::at(t0 + ms(at)))
            .unwrap();
        let holding = start(l, at).pop().expect("the holder's call");
        for &(at, keys) in flushes {
            for &i in keys {
                l.lookup(&key(i), &waiter, &mut LazyNow::at(t0 + ms(at)))
                    .unwrap();
            }
            assert!(start(l, at).is_empty(), "the slot is taken");
        }
        l.complete(
            holding.id,
            CallOutcome::Answered(vec![answer]),
            ms(freed - at),
            t0 + ms(freed),
        );
        l.next_call(t0 + ms(freed))
            .expect("the waiting group's call")
    };
    // a takes the only call slot; b's keys wait for it, flushed at 1 ms
    // (two keys), 2 ms (three) and 3 ms (one): one waiting group.
    let b_flushes: [(u64, &[u8]); 3] = [(1, &[10, 11]), (2, &[12, 13, 14]), (3, &[15])];
    let second = wait_behind(&mut l, ("a", 1, 0), ("b", &b_flushes), (true, 4));
    assert_eq!(second.keys.len(), 6, "b's keys went out in one call");
    // Answered at 10 ms (the call ended at 8): 9, 9, 8, 8, 8 and 7 ms.
    l.complete_ended(
        second.id,
        CallOutcome::Answered(vec![true; 6]),
        ms(4),
        t0 + ms(8),
        t0 + ms(10),
    );
    let s = l.stats();
    let ms_mean = |x: crate::LatencySummary| (x.count, (x.mean_us / 100.0).round() / 10.0);
    // With a's key (4 ms): 7 samples, mean (4 + 18 + 24 + 7) / 7 ms.
    assert_eq!(ms_mean(s.time_to_verdict), (7, 7.6));
    // b's queueing: 3, 3, 2, 2, 2, 1 ms (its call started at 4 ms).
    assert_eq!(s.verdict_queueing.count, 6);
    assert_eq!(ms_mean(s.verdict_queueing).1, 2.2);
    assert_eq!(ms_mean(s.verdict_publication), (6, 2.0));
    let total_ms = |x: crate::LatencySummary| x.mean_us * x.count as f64 / 1000.0;
    let before = total_ms(s.time_to_verdict);
    // A failed waiting group is timed the same way: c's keys flushed at
    // 11 and 12 ms behind d's call, failed at 20 ms (9, 9, 8 ms).
    let c_flushes: [(u64, &[u8]); 2] = [(11, &[21, 22]), (12, &[23])];
    let fourth = wait_behind(&mut l, ("d", 20, 10), ("c", &c_flushes), (false, 15));
    let err = TierError::new(TierErrorKind::Unavailable, "down");
    l.complete(fourth.id, CallOutcome::Failed(err), ms(5), t0 + ms(20));
    let s = l.stats();
    assert_eq!(s.errors, 3);
    // d's key (5 ms) and c's three: 7 + 4 samples, the new ones 31 ms.
    assert_eq!(s.time_to_verdict.count, 11);
    let added = total_ms(s.time_to_verdict) - before;
    assert!((added - 31.0).abs() < 0.5, "{added} ms added");
}

#[test]
fn time_to_verdict_splits_into_queueing_round_trip_and_publication() {
    let mut l = ledger();
    let t0 = Instant::now();
    let ms = Duration::from_millis;
    let a = ReqContext::new("a");
    for i in [1u8, 2] {
        l.lookup(&OffloadKey::new(&[i; 36]), &a, &mut LazyNow::at(t0))
            .unwrap();
    }
    let mut calls = Vec::new();
    l.flush_and_start(t0, &mut calls);
    let call = calls.pop().expect("a's call");
    // Flushed at 0; the call started at 2 ms, ended at 5 ms; applied at 9 ms.
    l.complete_ended(
        call.id,
        CallOutcome::Answered(vec![true, false]),
        ms(3),
        t0 + ms(5),
        t0 + ms(9),
    );
    let s = l.stats();
    let ms_of = |x: crate::LatencySummary| (x.count, (x.max_us + 5) / 1000);
    assert_eq!(ms_of(s.time_to_verdict), (2, 9));
    assert_eq!(ms_of(s.verdict_queueing), (2, 2));
    assert_eq!(ms_of(s.verdict_round_trip), (2, 3));
    assert_eq!(ms_of(s.verdict_publication), (2, 4));
    // Without the end instant (`complete`), only the total is recorded.
    let b = ReqContext::new("b");
    l.lookup(
        &OffloadKey::new(&[3; 36]),
        &b,
        &mut LazyNow::at(t0 + ms(10)),
    )
    .unwrap();
    let mut calls = Vec::new();
    l.flush_and_start(t0 + ms(10), &mut calls);
    let call = calls.pop().expect("b's call");
    l.complete(
        call.id,
        CallOutcome::Answered(vec![true]),
        ms(1),
        t0 + ms(12),
    );
    let s = l.stats();
    assert_eq!(s.time_to_verdict.count, 3);
    assert_eq!(s.verdict_queueing.count, 2);
}

#[test]
fn lookup_each_answers_as_lookup_does_on_long_and_short_lists() {
    let mut l = ledger();
    let now = Instant::now();
    let ctx = ReqContext::new("a");
    let keys: Vec<OffloadKey> = (0..300u32)
        .map(|i| OffloadKey::new(&i.to_be_bytes().repeat(9)))
        .collect();
    // The first 200 resolved (even present, odd absent), the rest new.
    for k in &keys[..200] {
        l.lookup(k, &ctx, &mut LazyNow::at(now)).unwrap();
    }
    l.flush(now);
    while let Some(call) = l.next_call(now) {
        let found = call.keys.iter().map(|k| k.as_bytes()[3] % 2 == 0).collect();
        l.complete(call.id, CallOutcome::Answered(found), Duration::ZERO, now);
    }
    for list in [&keys[..], &keys[190..210], &keys[..0]] {
        let mut got = vec![None; list.len()];
        l.lookup_each(list, &ctx, &mut LazyNow::at(now), |i, v| got[i] = Some(v))
            .unwrap();
        let want: Vec<_> = list
            .iter()
            .map(|k| Some(l.lookup(k, &ctx, &mut LazyNow::at(now)).unwrap()))
            .collect();
        assert_eq!(got, want, "a list of {} keys", list.len());
    }
    assert_eq!(
        l.lookup(&keys[0], &ctx, &mut LazyNow::at(now)),
        Ok(LookupVerdict::Hit)
    );
    assert_eq!(
        l.lookup(&keys[1], &ctx, &mut LazyNow::at(now)),
        Ok(LookupVerdict::Miss)
    );
    assert_eq!(
        l.lookup(&keys[250], &ctx, &mut LazyNow::at(now)),
        Ok(LookupVerdict::Pending)
    );
    // An invalid key stops the loop; the keys before it were answered.
    let mut bad = keys[..100].to_vec();
    bad[70] = OffloadKey::new(&[]);
    let mut answered = 0;
    let err = l.lookup_each(&bad, &ctx, &mut LazyNow::at(now), |_, _| answered += 1);
    assert!(matches!(err, Err(LookupError::InvalidKey { len: 0, .. })));
    assert_eq!(answered, 70);
}
