//! A [`Spawner`] over tokio that keeps track of what it spawned.
//!
//! The executor hands every operation to a spawner, from the host loop. The
//! host must be able to stop that work when it shuts down, so
//! [`TokioSpawner`] keeps its tasks in a [`JoinSet`]:
//! [`TokioSpawner::shutdown`] aborts them and waits until they are gone, and
//! dropping the spawner aborts whatever is left.
//!
//! Spawning a tokio task costs the caller an allocation, a queue push and
//! often a wake of another worker; a drive that dispatches 100 000
//! operations would pay that 100 000 times on the host loop. So
//! [`Spawner::spawn`] only queues the future (a push under a lock held for
//! nothing else) and a dispatch task, started once per batch, moves the
//! queued futures into the [`JoinSet`] on whichever worker runs it: the host
//! loop pays one task spawn per batch, not per operation.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use provisioning::spawn::{BoxFuture, Spawner};
use tokio::runtime::Handle;
use tokio::task::JoinSet;

/// The most finished tasks the dispatch task collects from the set per
/// future it adds. Collecting keeps the set from growing with finished
/// tasks; the bound keeps one round cheap.
pub const MAX_REAPED_PER_SPAWN: usize = 64;

/// The most queued futures the dispatch task moves into the set under one
/// hold of the set's lock (so a shutdown waits for at most this many spawns).
pub const DISPATCH_CHUNK: usize = 1024;

/// Runs executor work on a tokio runtime and remembers every task so that
/// shutdown can abort and await them.
///
/// # Guarantees
/// - Every spawned future is run on the runtime (started by a dispatch task
///   soon after `spawn` returns) or, once shutdown began or the spawner was
///   dropped, dropped without being polled.
/// - After [`TokioSpawner::shutdown`] began, newly spawned futures are
///   dropped without being polled.
/// - Dropping the spawner aborts every task it still tracks and drops the
///   queued futures.
#[derive(Debug)]
pub struct TokioSpawner {
    runtime: Handle,
    shared: Arc<Shared>,
}

#[derive(Debug, Default)]
struct Shared {
    queue: Mutex<Queue>,
    /// `None` once closed.
    tasks: Mutex<Option<JoinSet<()>>>,
}

#[derive(Default)]
struct Queue {
    futures: Vec<BoxFuture<'static, ()>>,
    /// Whether a dispatch task is started and will look at the queue again.
    dispatching: bool,
    closed: bool,
}

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue")
            .field("futures", &self.futures.len())
            .field("dispatching", &self.dispatching)
            .field("closed", &self.closed)
            .finish()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl TokioSpawner {
    /// A spawner that runs its tasks on `runtime`.
    pub fn new(runtime: Handle) -> Self {
        TokioSpawner {
            runtime,
            shared: Arc::new(Shared {
                queue: Mutex::default(),
                tasks: Mutex::new(Some(JoinSet::new())),
            }),
        }
    }

    /// Tasks spawned and not yet collected, and futures queued for the
    /// dispatch task (finished tasks are collected lazily, so this is an
    /// upper bound on the work still running).
    pub fn tracked(&self) -> usize {
        let queued = lock(&self.shared.queue).futures.len();
        queued + lock(&self.shared.tasks).as_ref().map_or(0, JoinSet::len)
    }

    /// Whether [`TokioSpawner::shutdown`] was called.
    pub fn is_closed(&self) -> bool {
        lock(&self.shared.queue).closed
    }

    /// Refuses new work, drops the queued futures, aborts every tracked task
    /// and waits for them to end, at most `wait_max`. Returns the number of
    /// tasks that had not ended by then (they stay aborted and end on their
    /// next poll).
    pub async fn shutdown(&self, wait_max: Duration) -> usize {
        drop(self.shared.close());
        let Some(mut tasks) = lock(&self.shared.tasks).take() else {
            return 0;
        };
        tasks.abort_all();
        let drained = tokio::time::timeout(wait_max, async {
            while let Some(joined) = tasks.join_next().await {
                log_join_failure(joined);
            }
        })
        .await;
        match drained {
            Ok(()) => 0,
            Err(_) => tasks.len(),
        }
    }
}

impl Shared {
    /// Marks the queue closed and returns what it held (to be dropped by
    /// the caller, outside the lock).
    fn close(&self) -> Vec<BoxFuture<'static, ()>> {
        let mut queue = lock(&self.queue);
        queue.closed = true;
        std::mem::take(&mut queue.futures)
    }

    /// Moves queued futures into the set until the queue stays empty,
    /// yielding to the runtime after every [`DISPATCH_CHUNK`] of them.
    async fn dispatch(self: Arc<Self>, runtime: Handle) {
        loop {
            let batch = {
                let mut queue = lock(&self.queue);
                if queue.futures.is_empty() || queue.closed {
                    queue.dispatching = false;
                    return;
                }
                std::mem::take(&mut queue.futures)
            };
            let mut batch = batch.into_iter();
            while batch.len() > 0 {
                if !self.spawn_some(&mut batch, &runtime) {
                    // Closed meanwhile: what is left is dropped unpolled.
                    return;
                }
                tokio::task::yield_now().await;
            }
        }
    }

    /// Spawns up to [`DISPATCH_CHUNK`] futures of `batch` into the set;
    /// `false` when the set is closed.
    fn spawn_some(
        &self,
        batch: &mut std::vec::IntoIter<BoxFuture<'static, ()>>,
        runtime: &Handle,
    ) -> bool {
        let mut tasks = lock(&self.tasks);
        let Some(set) = tasks.as_mut() else {
            return false;
        };
        for task in batch.by_ref().take(DISPATCH_CHUNK) {
            for _ in 0..MAX_REAPED_PER_SPAWN {
                match set.try_join_next() {
                    Some(joined) => log_join_failure(joined),
                    None => break,
                }
            }
            set.spawn_on(task, runtime);
        }
        true
    }
}

impl Spawner for TokioSpawner {
    fn spawn(&self, task: BoxFuture<'static, ()>) {
        let start = {
            let mut queue = lock(&self.shared.queue);
            if queue.closed {
                drop(queue);
                tracing::debug!("executor work spawned after shutdown was dropped");
                drop(task);
                return;
            }
            queue.futures.push(task);
            !std::mem::replace(&mut queue.dispatching, true)
        };
        if start {
            let dispatch = self.shared.clone().dispatch(self.runtime.clone());
            self.runtime.spawn(dispatch);
        }
    }
}

impl Drop for TokioSpawner {
    fn drop(&mut self) {
        drop(self.shared.close());
        // Aborts every task still tracked.
        drop(lock(&self.shared.tasks).take());
    }
}

fn log_join_failure(joined: Result<(), tokio::task::JoinError>) {
    if let Err(error) = joined {
        if error.is_panic() {
            tracing::error!("an executor task panicked: {error}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[tokio::test]
    async fn spawned_work_runs_on_the_runtime() {
        let spawner = TokioSpawner::new(Handle::current());
        let (done, finished) = tokio::sync::oneshot::channel();
        spawner.spawn(Box::pin(async move {
            let _ = done.send(7);
        }));
        let value = tokio::time::timeout(Duration::from_secs(5), finished).await;
        assert_eq!(value.ok().and_then(Result::ok), Some(7));
    }

    #[tokio::test]
    async fn shutdown_aborts_running_work_and_refuses_new_work() {
        struct SetOnDrop(Arc<AtomicBool>);
        impl Drop for SetOnDrop {
            fn drop(&mut self) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let spawner = TokioSpawner::new(Handle::current());
        let dropped = Arc::new(AtomicBool::new(false));
        let guard = SetOnDrop(dropped.clone());
        spawner.spawn(Box::pin(async move {
            let _guard = guard;
            std::future::pending::<()>().await;
        }));
        tokio::task::yield_now().await;
        assert_eq!(spawner.shutdown(Duration::from_secs(5)).await, 0);
        assert!(
            dropped.load(Ordering::SeqCst),
            "the hanging task was aborted"
        );
        assert!(spawner.is_closed());

        let ran = Arc::new(AtomicBool::new(false));
        let flag = ran.clone();
        spawner.spawn(Box::pin(async move { flag.store(true, Ordering::SeqCst) }));
        tokio::task::yield_now().await;
        assert!(
            !ran.load(Ordering::SeqCst),
            "work after shutdown never runs"
        );
        assert_eq!(spawner.tracked(), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_future_of_a_large_batch_runs_once() {
        const TASKS: usize = 3 * DISPATCH_CHUNK + 17;
        let spawner = TokioSpawner::new(Handle::current());
        let ran = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (done, mut finished) = tokio::sync::mpsc::unbounded_channel();
        for _ in 0..TASKS {
            let ran = ran.clone();
            let done = done.clone();
            spawner.spawn(Box::pin(async move {
                tokio::task::yield_now().await;
                ran.fetch_add(1, Ordering::SeqCst);
                let _ = done.send(());
            }));
        }
        drop(done);
        let all = tokio::time::timeout(Duration::from_secs(60), async {
            let mut seen = 0;
            while finished.recv().await.is_some() {
                seen += 1;
            }
            seen
        })
        .await;
        assert_eq!(all.ok(), Some(TASKS), "every future ran to its end");
        assert_eq!(ran.load(Ordering::SeqCst), TASKS, "and none twice");
    }

    #[tokio::test]
    async fn queued_futures_are_dropped_unpolled_by_shutdown_and_by_drop() {
        struct SetOnDrop(Arc<AtomicBool>);
        impl Drop for SetOnDrop {
            fn drop(&mut self) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        for by_drop in [false, true] {
            let spawner = TokioSpawner::new(Handle::current());
            let polled = Arc::new(AtomicBool::new(false));
            let dropped = Arc::new(AtomicBool::new(false));
            let (flag, guard) = (polled.clone(), SetOnDrop(dropped.clone()));
            // No await before the shutdown: on this single-threaded runtime
            // the dispatch task cannot have run, so the future is queued.
            spawner.spawn(Box::pin(async move {
                let _guard = guard;
                flag.store(true, Ordering::SeqCst);
            }));
            assert_eq!(spawner.tracked(), 1);
            if by_drop {
                drop(spawner);
            } else {
                assert_eq!(spawner.shutdown(Duration::from_secs(5)).await, 0);
                assert_eq!(spawner.tracked(), 0);
            }
            tokio::task::yield_now().await;
            assert!(
                dropped.load(Ordering::SeqCst),
                "dropped (by drop: {by_drop})"
            );
            assert!(
                !polled.load(Ordering::SeqCst),
                "never polled (by drop: {by_drop})"
            );
        }
    }

    #[tokio::test]
    async fn finished_tasks_are_collected_by_later_spawns() {
        let spawner = TokioSpawner::new(Handle::current());
        for _ in 0..10 {
            spawner.spawn(Box::pin(async {}));
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert!(spawner.tracked() <= 2, "tracked {}", spawner.tracked());
    }
}
