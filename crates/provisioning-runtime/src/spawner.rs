//! A [`Spawner`] over tokio that keeps track of what it spawned.
//!
//! The executor hands every operation to a spawner. The host must be able to
//! stop that work when it shuts down, so [`TokioSpawner`] keeps its tasks in a
//! [`JoinSet`]: [`TokioSpawner::shutdown`] aborts them and waits until they
//! are gone, and dropping the spawner aborts whatever is left.

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use provisioning::spawn::{BoxFuture, Spawner};
use tokio::runtime::Handle;
use tokio::task::JoinSet;

/// The most finished tasks one [`Spawner::spawn`] call collects from the set
/// before adding the new one. Collecting keeps the set from growing with
/// finished tasks; the bound keeps one spawn cheap.
pub const MAX_REAPED_PER_SPAWN: usize = 64;

/// Runs executor work on a tokio runtime and remembers every task so that
/// shutdown can abort and await them.
///
/// # Guarantees
/// - After [`TokioSpawner::shutdown`] began, newly spawned futures are
///   dropped without being polled.
/// - Dropping the spawner aborts every task it still tracks.
#[derive(Debug)]
pub struct TokioSpawner {
    runtime: Handle,
    tasks: Mutex<Option<JoinSet<()>>>,
}

impl TokioSpawner {
    /// A spawner that runs its tasks on `runtime`.
    pub fn new(runtime: Handle) -> Self {
        TokioSpawner {
            runtime,
            tasks: Mutex::new(Some(JoinSet::new())),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Option<JoinSet<()>>> {
        self.tasks.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Tasks spawned and not yet collected (finished tasks are collected
    /// lazily, so this is an upper bound on the tasks still running).
    pub fn tracked(&self) -> usize {
        self.lock().as_ref().map_or(0, JoinSet::len)
    }

    /// Whether [`TokioSpawner::shutdown`] was called.
    pub fn is_closed(&self) -> bool {
        self.lock().is_none()
    }

    /// Refuses new work, aborts every tracked task and waits for them to
    /// end, at most `wait_max`. Returns the number of tasks that had not
    /// ended by then (they stay aborted and end on their next poll).
    pub async fn shutdown(&self, wait_max: Duration) -> usize {
        let Some(mut tasks) = self.lock().take() else {
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

impl Spawner for TokioSpawner {
    fn spawn(&self, task: BoxFuture<'static, ()>) {
        let mut guard = self.lock();
        let Some(tasks) = guard.as_mut() else {
            tracing::debug!("executor work spawned after shutdown was dropped");
            return;
        };
        for _ in 0..MAX_REAPED_PER_SPAWN {
            match tasks.try_join_next() {
                Some(joined) => log_join_failure(joined),
                None => break,
            }
        }
        tasks.spawn_on(task, &self.runtime);
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
