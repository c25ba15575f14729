//! [`AbortOnDrop`]: a spawned task that lives no longer than the future
//! awaiting it, as the worker's tier calls and the tiers' I/O tasks need.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::task::{JoinError, JoinHandle};

/// The handle of a spawned task that aborts the task when dropped: a
/// caller that gives up on the answer (a timeout, a cancelled tier call)
/// leaves no work behind, whatever runtime the task runs on. Awaiting it
/// gives the task's output, or the [`JoinError`] of a task that panicked or
/// was dropped by its runtime shutting down.
///
/// [`Spawner::spawn`](crate::Spawner::spawn) returns one; any tokio
/// [`JoinHandle`] becomes one with [`AbortOnDrop::new`] (as object_store's
/// spawned requests and redis-rs's connection driver do).
///
/// ```
/// use kvtier_core::Spawner;
///
/// let spawner = Spawner::dedicated("kvtier-doc", 1)?;
/// let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
/// // Awaited: the task's output.
/// assert_eq!(runtime.block_on(spawner.spawn(async { 6 * 7 }))?, 42);
/// // Dropped: the task is aborted.
/// drop(spawner.spawn(std::future::pending::<()>()));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Cancellation safety
/// Dropping it before it completes aborts the task at its next yield point.
#[must_use = "dropping an AbortOnDrop aborts its task at once"]
pub struct AbortOnDrop<T>(JoinHandle<T>);

impl<T> AbortOnDrop<T> {
    /// Takes charge of `task`: it is aborted when this handle drops.
    pub fn new(task: JoinHandle<T>) -> Self {
        Self(task)
    }

    /// Aborts the task now (as dropping the handle does, but the handle
    /// can still be awaited for the task's end).
    pub fn abort(&self) {
        self.0.abort();
    }

    /// Whether the task has finished (returned, panicked or been aborted).
    pub fn is_finished(&self) -> bool {
        self.0.is_finished()
    }
}

impl<T> From<JoinHandle<T>> for AbortOnDrop<T> {
    fn from(task: JoinHandle<T>) -> Self {
        Self::new(task)
    }
}

impl<T> Future for AbortOnDrop<T> {
    type Output = Result<T, JoinError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.0).poll(cx)
    }
}

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl<T> fmt::Debug for AbortOnDrop<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AbortOnDrop")
            .field("finished", &self.0.is_finished())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    /// Sets its flag when dropped: the task holding it ended.
    struct Ended(Arc<AtomicBool>);

    impl Drop for Ended {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    #[tokio::test]
    async fn dropping_the_handle_aborts_the_task_and_awaiting_it_gives_the_output() {
        let ended = Arc::new(AtomicBool::new(false));
        let guard = Ended(Arc::clone(&ended));
        let task = AbortOnDrop::new(tokio::spawn(async move {
            let _guard = guard;
            std::future::pending::<()>().await;
        }));
        tokio::task::yield_now().await;
        assert!(!task.is_finished());
        drop(task);
        for _ in 0..100 {
            if ended.load(Ordering::SeqCst) {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert!(ended.load(Ordering::SeqCst), "the task outlived its handle");

        assert_eq!(
            AbortOnDrop::from(tokio::spawn(async { 7 })).await.ok(),
            Some(7)
        );
        let aborted = AbortOnDrop::new(tokio::spawn(std::future::pending::<()>()));
        aborted.abort();
        assert!(aborted.await.is_err_and(|e| e.is_cancelled()));
    }
}
