//! Where the worker runs: a dedicated runtime shared by a stack, or the
//! caller's runtime (multi-thread or current-thread), and what happens when
//! the manager is dropped inside a runtime, shut down with `shutdown_async`,
//! or outlived by the caller's runtime. No test asserts a speed; time limits
//! here only stop a broken build from hanging.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvtier_core::testkit::threads_named;
use kvtier_core::{
    AsyncLookupManager, LookupVerdict, ManagerConfig, ManagerError, OffloadKey, PrefixVerdict,
    ReqContext, Spawner, StackPolicy, StackVerdict, Tier, TierError, TierStack,
};

const GUARD: Duration = Duration::from_secs(20);

/// Long enough that a test waiting for it would hit [`GUARD`] first.
const FOREVER_MS: u64 = 600_000;

fn key(i: u8) -> OffloadKey {
    OffloadKey::new(&[i; 36])
}

/// Holds the keys whose first byte is in the set.
struct Holds(HashSet<u8>);

impl Holds {
    fn new(bytes: &[u8]) -> Arc<Self> {
        Arc::new(Self(bytes.iter().copied().collect()))
    }
}

impl Tier for Holds {
    async fn batch_lookup(
        &self,
        keys: &[OffloadKey],
        _: &ReqContext,
    ) -> Result<Vec<bool>, TierError> {
        Ok(keys
            .iter()
            .map(|k| self.0.contains(&k.as_bytes()[0]))
            .collect())
    }
}

/// Adds one to its counter when dropped.
struct CountOnDrop(Arc<AtomicUsize>);

impl Drop for CountOnDrop {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// Never answers (cancellably); counts calls started and calls dropped.
#[derive(Default)]
struct Hangs {
    started: Arc<AtomicUsize>,
    cancelled: Arc<AtomicUsize>,
}

impl Tier for Hangs {
    async fn batch_lookup(
        &self,
        keys: &[OffloadKey],
        _: &ReqContext,
    ) -> Result<Vec<bool>, TierError> {
        let _dropped = CountOnDrop(Arc::clone(&self.cancelled));
        self.started.fetch_add(1, Ordering::SeqCst);
        std::future::pending::<()>().await;
        Ok(vec![false; keys.len()])
    }
}

fn hanging_config(name: &str) -> ManagerConfig {
    ManagerConfig {
        call_timeout_ms: FOREVER_MS,
        shutdown_timeout_ms: FOREVER_MS,
        ..ManagerConfig::named(name)
    }
}

fn multi_thread_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

fn current_thread_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

fn wait_until(mut cond: impl FnMut() -> bool, what: &str) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < GUARD, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Looks `key` up, draining results (never flushing), until it has a verdict.
fn wait_verdict<T: Tier>(
    m: &mut AsyncLookupManager<T>,
    key: &OffloadKey,
    ctx: &ReqContext,
) -> LookupVerdict {
    let start = Instant::now();
    loop {
        match m.lookup(key, ctx).expect("valid key") {
            LookupVerdict::Pending => {
                assert!(start.elapsed() < GUARD, "no verdict for {key:?}");
                m.drain_results();
                std::thread::sleep(Duration::from_millis(1));
            }
            v => return v,
        }
    }
}

#[test]
fn a_manager_runs_on_a_callers_multi_thread_runtime() {
    let runtime = multi_thread_runtime();
    let spawner = Spawner::from_handle(runtime.handle().clone());
    assert!(!spawner.is_dedicated());
    let mut m = AsyncLookupManager::with_spawner(
        Holds::new(&[0, 1]),
        ManagerConfig::named("caller-mt"),
        &spawner,
    )
    .unwrap();
    // A synchronous scheduler thread; the worker runs on the caller's threads.
    let prompt: Vec<OffloadKey> = (0..4).map(key).collect();
    let ctx = ReqContext::new("r");
    let start = Instant::now();
    let hits = loop {
        match m.lookup_prefix(&prompt, &ctx).unwrap() {
            PrefixVerdict::Ready(n) => break n,
            PrefixVerdict::Pending => {
                assert!(start.elapsed() < GUARD);
                m.flush();
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    };
    assert_eq!(hits, 2);
    assert_eq!(threads_named("kvtier-lookup-c"), 0, "no thread of its own");
    let report = runtime.block_on(m.shutdown_async());
    assert!(report.worker_stopped, "{report:?}");
    assert_eq!(report.abandoned_calls, 0);
    assert!(m.spawner().is_none(), "the spawner is released at shutdown");
}

#[test]
fn a_manager_runs_on_a_callers_current_thread_runtime_while_the_scheduler_awaits() {
    let runtime = current_thread_runtime();
    let spawner = Spawner::from_handle(runtime.handle().clone());
    let mut m = AsyncLookupManager::with_spawner(
        Holds::new(&[0, 1, 2]),
        ManagerConfig::named("caller-ct"),
        &spawner,
    )
    .unwrap();
    let notifier = m.notifier();
    let prompt: Vec<OffloadKey> = (0..5).map(key).collect();
    let ctx = ReqContext::new("r");
    // An async scheduler on the same thread: awaiting between steps is what
    // runs the worker.
    let (hits, report) = runtime.block_on(async {
        let hits = loop {
            match m.lookup_prefix(&prompt, &ctx).unwrap() {
                PrefixVerdict::Ready(n) => break n,
                PrefixVerdict::Pending => {
                    m.flush();
                    tokio::time::timeout(GUARD, notifier.notified())
                        .await
                        .expect("a result wakes the scheduler");
                }
            }
        };
        (hits, m.shutdown_async().await)
    });
    assert_eq!(hits, 3);
    assert!(report.worker_stopped, "{report:?}");
    assert_eq!(m.stats().hits, 3);
}

#[test]
fn calls_on_a_current_thread_runtime_nobody_drives_resolve_as_timeouts() {
    let runtime = current_thread_runtime();
    let spawner = Spawner::from_handle(runtime.handle().clone());
    let mut m = AsyncLookupManager::with_spawner(
        Holds::new(&[1]),
        ManagerConfig {
            call_timeout_ms: 50,
            shutdown_timeout_ms: 50,
            ..ManagerConfig::named("undriven")
        },
        &spawner,
    )
    .unwrap();
    let ctx = ReqContext::new("r");
    m.lookup(&key(1), &ctx).unwrap();
    m.flush();
    // Nothing runs the runtime: the call never starts, but the key is not
    // left pending; it resolves at its deadline, as a counted timeout.
    assert_eq!(wait_verdict(&mut m, &key(1), &ctx), LookupVerdict::Miss);
    let stats = m.stats();
    assert_eq!((stats.timeouts, stats.hits, stats.errors), (1, 0, 0));
    // The blocking shutdown cannot stop an undriven worker: it says so.
    assert!(!m.shutdown().worker_stopped);
    drop(runtime);
}

#[cfg(target_os = "linux")]
#[test]
fn a_three_tier_stack_on_one_dedicated_spawner_runs_one_thread() {
    const NAME: &str = "kvtier-stack3";
    let spawner = Spawner::dedicated(NAME, 1).unwrap();
    assert!(spawner.is_dedicated());
    let mut stack = TierStack::with_spawner(StackPolicy::default(), spawner.clone());
    stack
        .add(Holds::new(&[0]), ManagerConfig::named("near"))
        .unwrap()
        .add(Holds::new(&[0, 1]), ManagerConfig::named("mid"))
        .unwrap()
        .add(Holds::new(&[0, 1, 2]), ManagerConfig::named("far"))
        .unwrap();
    let prompt: Vec<OffloadKey> = (0..5).map(key).collect();
    let ctx = ReqContext::new("r");
    let start = Instant::now();
    let verdict = loop {
        match stack.lookup_prefix(&prompt, &ctx).unwrap() {
            StackVerdict::Pending => {
                assert!(start.elapsed() < GUARD);
                stack.flush();
                std::thread::sleep(Duration::from_millis(1));
            }
            ready => break ready,
        }
    };
    assert_eq!(
        verdict,
        StackVerdict::Ready {
            locations: vec![0, 1, 2]
        }
    );
    assert_eq!(threads_named(NAME), 1, "one thread serves the three tiers");
    let reports = stack.shutdown();
    assert!(reports.iter().all(|r| r.worker_stopped), "{reports:?}");
    // The runtime stops in the background once the last clone is gone.
    assert_eq!(threads_named(NAME), 1, "still held by `spawner`");
    drop(stack);
    drop(spawner);
    wait_until(|| threads_named(NAME) == 0, "the spawner's thread to end");
}

/// Drops, inside a task on a caller's runtime, a manager whose tier call
/// hangs and whose shutdown timeout is far beyond [`GUARD`]; returns once
/// the drop has returned, and checks the hung call was cancelled.
fn drop_inside_a_runtime_while_a_tier_hangs(on_callers_runtime: bool) {
    let runtime = multi_thread_runtime();
    let tier = Arc::new(Hangs::default());
    let spawner = Spawner::from_handle(runtime.handle().clone());
    let mut m = if on_callers_runtime {
        AsyncLookupManager::with_spawner(Arc::clone(&tier), hanging_config("drop-c"), &spawner)
    } else {
        AsyncLookupManager::from_arc(Arc::clone(&tier), hanging_config("drop-d"))
    }
    .unwrap();
    m.lookup(&key(1), &ReqContext::new("r")).unwrap();
    m.flush();
    wait_until(|| tier.started.load(Ordering::SeqCst) == 1, "the call");
    let (dropped_tx, dropped) = std::sync::mpsc::channel();
    runtime.spawn(async move {
        drop(m);
        let _ = dropped_tx.send(());
    });
    // A Drop that waited for the shutdown timeout would not return in time.
    dropped
        .recv_timeout(GUARD)
        .expect("dropping the manager inside a runtime returned");
    wait_until(
        || tier.cancelled.load(Ordering::SeqCst) == 1,
        "the hung call to be aborted",
    );
}

#[test]
fn dropping_a_manager_on_the_callers_runtime_inside_it_does_not_wait_for_a_hung_call() {
    drop_inside_a_runtime_while_a_tier_hangs(true);
}

#[test]
fn dropping_a_manager_with_its_own_runtime_inside_a_runtime_does_not_wait_for_a_hung_call() {
    drop_inside_a_runtime_while_a_tier_hangs(false);
}

#[test]
fn shutdown_async_is_bounded_when_a_tier_hangs() {
    let runtime = multi_thread_runtime();
    let tier = Arc::new(Hangs::default());
    let spawner = Spawner::from_handle(runtime.handle().clone());
    let mut m = AsyncLookupManager::with_spawner(
        Arc::clone(&tier),
        ManagerConfig {
            shutdown_timeout_ms: 200,
            ..hanging_config("async-stop")
        },
        &spawner,
    )
    .unwrap();
    let ctx = ReqContext::new("r");
    m.lookup(&key(1), &ctx).unwrap();
    m.flush();
    wait_until(|| tier.started.load(Ordering::SeqCst) == 1, "the call");
    let report = runtime.block_on(async {
        tokio::time::timeout(GUARD, m.shutdown_async())
            .await
            .expect("shutdown_async is bounded")
    });
    assert!(
        report.worker_stopped,
        "a cancellable hang is abandoned: {report:?}"
    );
    assert_eq!(report.abandoned_calls, 1);
    // Aborted tasks are dropped when their runtime next gets to them.
    wait_until(
        || tier.cancelled.load(Ordering::SeqCst) == 1,
        "the hung call to be aborted",
    );
    assert_eq!(m.stats().errors, 1);
    assert_eq!(runtime.block_on(m.shutdown_async()), report, "idempotent");
    assert_eq!(m.shutdown(), report);
}

#[test]
fn a_stack_shuts_down_asynchronously_with_every_tier_hung() {
    let runtime = multi_thread_runtime();
    let spawner = Spawner::dedicated("kvtier-hung3", 1).unwrap();
    let mut stack = TierStack::with_spawner(StackPolicy::default(), spawner);
    let tiers: Vec<Arc<Hangs>> = (0..3).map(|_| Arc::new(Hangs::default())).collect();
    for (i, tier) in tiers.iter().enumerate() {
        stack
            .add(
                Arc::clone(tier),
                ManagerConfig {
                    shutdown_timeout_ms: 200,
                    ..hanging_config(&format!("hung{i}"))
                },
            )
            .unwrap();
    }
    let ctx = ReqContext::new("r");
    assert_eq!(
        stack.lookup_prefix(&[key(1)], &ctx).unwrap(),
        StackVerdict::Pending
    );
    stack.flush();
    wait_until(
        || tiers.iter().all(|t| t.started.load(Ordering::SeqCst) == 1),
        "every call",
    );
    let reports = runtime.block_on(async {
        tokio::time::timeout(GUARD, stack.shutdown_async())
            .await
            .expect("the stack's shutdown_async is bounded")
    });
    assert_eq!(reports.len(), 3);
    for report in &reports {
        assert!(report.worker_stopped, "{reports:?}");
        assert_eq!(report.abandoned_calls, 1, "{reports:?}");
    }
    assert!(stack.stats().iter().all(|s| s.errors == 1));
}

#[test]
fn lookups_resolve_as_counted_errors_after_the_callers_runtime_is_dropped() {
    let runtime = multi_thread_runtime();
    let tier = Arc::new(Hangs::default());
    let spawner = Spawner::from_handle(runtime.handle().clone());
    let mut m =
        AsyncLookupManager::with_spawner(Arc::clone(&tier), hanging_config("gone"), &spawner)
            .unwrap();
    let ctx = ReqContext::new("r");
    m.lookup(&key(1), &ctx).unwrap();
    m.flush();
    wait_until(|| tier.started.load(Ordering::SeqCst) == 1, "the call");
    drop(runtime);
    // The running call's deadline is far away: it resolves because its task
    // was dropped with the runtime, as an error, not a miss or a timeout.
    assert_eq!(wait_verdict(&mut m, &key(1), &ctx), LookupVerdict::Miss);
    let stats = m.stats();
    assert_eq!(
        (stats.errors, stats.timeouts, stats.misses),
        (1, 0, 0),
        "{stats:?}"
    );
    // A new key: the worker is gone, so it resolves at once as an error.
    assert_eq!(m.lookup(&key(2), &ctx), Ok(LookupVerdict::Pending));
    m.flush();
    assert_eq!(m.lookup(&key(2), &ctx), Ok(LookupVerdict::Miss));
    assert_eq!(m.stats().errors, 2);
    let report = m.shutdown();
    assert!(
        report.worker_stopped,
        "the worker is known gone: {report:?}"
    );
    assert_eq!(report.abandoned_calls, 0);
}

#[test]
fn a_manager_built_on_a_runtime_already_shut_down_answers_errors() {
    let runtime = current_thread_runtime();
    let spawner = Spawner::from_handle(runtime.handle().clone());
    drop(runtime);
    let mut m = AsyncLookupManager::with_spawner(
        Holds::new(&[1]),
        hanging_config("dead-on-arrival"),
        &spawner,
    )
    .unwrap();
    let ctx = ReqContext::new("r");
    m.lookup(&key(1), &ctx).unwrap();
    m.flush();
    assert_eq!(m.lookup(&key(1), &ctx), Ok(LookupVerdict::Miss));
    assert_eq!(m.stats().errors, 1);
    assert!(m.shutdown().worker_stopped);
}

#[test]
fn spawners_reject_what_they_cannot_run_with_typed_errors() {
    assert!(matches!(
        Spawner::current(),
        Err(ManagerError::NoRuntime { .. })
    ));
    let runtime = current_thread_runtime();
    let spawner = runtime.block_on(async { Spawner::current() }).unwrap();
    assert!(!spawner.is_dedicated());
    for (name, threads, field) in [
        ("kvtier-zero", 0, "worker_threads"),
        (
            "kvtier-many",
            ManagerConfig::MAX_WORKER_THREADS + 1,
            "worker_threads",
        ),
        ("kvtier\0nul", 1, "spawner name"),
    ] {
        match Spawner::dedicated(name, threads) {
            Err(ManagerError::InvalidConfig { field: f, .. }) => assert_eq!(f, field),
            other => panic!("{name:?} with {threads} threads: {other:?}"),
        }
    }
}

#[test]
fn a_multi_thread_dedicated_spawner_serves_managers_and_stops_in_the_background() {
    let spawner = Spawner::dedicated("kvtier-pool", 2).unwrap();
    let mut m =
        AsyncLookupManager::with_spawner(Holds::new(&[3]), ManagerConfig::named("pool"), &spawner)
            .unwrap();
    drop(spawner);
    let ctx = ReqContext::new("r");
    m.lookup(&key(3), &ctx).unwrap();
    m.flush();
    assert_eq!(wait_verdict(&mut m, &key(3), &ctx), LookupVerdict::Hit);
    // The manager held the last clone: dropping it inside another runtime
    // must neither block nor panic.
    let outer = current_thread_runtime();
    outer.block_on(async move { drop(m) });
}

/// The fields of one span, by name, as `Debug` shows them.
type SpanFields = Vec<(String, String)>;

/// Records the fields of every `tier_call` span.
struct SpanRecorder(Arc<Mutex<Vec<SpanFields>>>);

#[derive(Default)]
struct Fields(SpanFields);

impl tracing::field::Visit for Fields {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.push((field.name().to_owned(), format!("{value:?}")));
    }
}

impl tracing::Subscriber for SpanRecorder {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, span: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        if span.metadata().name() == "tier_call" {
            let mut fields = Fields::default();
            span.record(&mut fields);
            self.0.lock().expect("recorder").push(fields.0);
        }
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, _: &tracing::Event<'_>) {}
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

#[test]
fn the_tier_call_span_carries_the_tier_the_request_and_the_key_count() {
    let spans = Arc::new(Mutex::new(Vec::new()));
    let recorder = SpanRecorder(Arc::clone(&spans));
    // A current-thread runtime driven by this thread: the worker's spans are
    // made here, under this thread's subscriber.
    let runtime = current_thread_runtime();
    let spawner = Spawner::from_handle(runtime.handle().clone());
    let mut m = AsyncLookupManager::with_spawner(
        Holds::new(&[0]),
        ManagerConfig::named("traced"),
        &spawner,
    )
    .unwrap();
    let notifier = m.notifier();
    let prompt: Vec<OffloadKey> = (0..3).map(key).collect();
    let ctx = ReqContext::new("req-42");
    tracing::subscriber::with_default(recorder, || {
        runtime.block_on(async {
            while m.lookup_prefix(&prompt, &ctx).unwrap() == PrefixVerdict::Pending {
                m.flush();
                tokio::time::timeout(GUARD, notifier.notified())
                    .await
                    .expect("woken");
            }
        });
    });
    let spans = spans.lock().unwrap();
    assert_eq!(spans.len(), 1, "{spans:?}");
    let field = |name: &str| {
        spans[0]
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    };
    assert_eq!(field("tier").as_deref(), Some("traced"));
    assert_eq!(field("req_id").as_deref(), Some("req-42"));
    assert_eq!(field("keys").as_deref(), Some("3"));
}

/// Polls `future` to completion on this thread, without tokio.
fn block_on_without_tokio<F: std::future::Future>(future: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut future = std::pin::pin!(future);
    loop {
        if let std::task::Poll::Ready(output) = future.as_mut().poll(&mut cx) {
            return output;
        }
        std::thread::park();
    }
}

#[test]
fn shutdown_async_polled_outside_tokio_is_bounded_by_the_workers_runtime() {
    assert!(tokio::runtime::Handle::try_current().is_err());
    let tier = Arc::new(Hangs::default());
    let mut m = AsyncLookupManager::from_arc(
        Arc::clone(&tier),
        ManagerConfig {
            shutdown_timeout_ms: 200,
            ..hanging_config("no-tokio")
        },
    )
    .unwrap();
    let ctx = ReqContext::new("r");
    m.lookup(&key(1), &ctx).unwrap();
    m.flush();
    wait_until(|| tier.started.load(Ordering::SeqCst) == 1, "the call");
    let report = block_on_without_tokio(m.shutdown_async());
    assert!(report.worker_stopped, "{report:?}");
    assert_eq!(report.abandoned_calls, 1);
}

#[test]
fn managers_sharing_a_spawner_keep_their_own_call_slots() {
    let spawner = Spawner::dedicated("kvtier-slots", 1).unwrap();
    let hung = Arc::new(Hangs::default());
    let mut busy = AsyncLookupManager::with_spawner(
        Arc::clone(&hung),
        ManagerConfig {
            max_calls_in_flight: 1,
            ..hanging_config("busy")
        },
        &spawner,
    )
    .unwrap();
    let mut free =
        AsyncLookupManager::with_spawner(Holds::new(&[7]), ManagerConfig::named("free"), &spawner)
            .unwrap();
    // `busy`'s one slot is held by a call that never answers; a second
    // request's call waits for that slot.
    busy.lookup(&key(1), &ReqContext::new("a")).unwrap();
    busy.flush();
    wait_until(|| hung.started.load(Ordering::SeqCst) == 1, "the hung call");
    busy.lookup(&key(2), &ReqContext::new("b")).unwrap();
    busy.flush();
    // The other manager on the same runtime still answers.
    let ctx = ReqContext::new("c");
    free.lookup(&key(7), &ctx).unwrap();
    free.flush();
    assert_eq!(wait_verdict(&mut free, &key(7), &ctx), LookupVerdict::Hit);
    assert_eq!(
        hung.started.load(Ordering::SeqCst),
        1,
        "busy's second call still waits for busy's slot"
    );
    assert_eq!(busy.stats().in_flight_keys, 2);
}
