//! Spawners: where the executor hands its work.
//!
//! The core owns no runtime. The host passes a [`Spawner`] backed by its
//! runtime (tokio in `provisioning-runtime`); tests and the conformance kit
//! use [`ManualSpawner`], which runs nothing until asked and then runs queued
//! work in a chosen order, deterministically.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::task::{Context, Wake, Waker};

/// A boxed, sendable future.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Runs futures handed to it.
///
/// # Guarantees expected of implementors
/// Every spawned future is either polled to completion or dropped; a spawner
/// that is dropped drops its queued futures.
pub trait Spawner: Send + Sync {
    /// Takes ownership of `task` and runs it at some later point.
    fn spawn(&self, task: BoxFuture<'static, ()>);
}

/// The most polls one [`ManualSpawner::run_all`] call performs.
pub const MAX_POLLS_PER_RUN: usize = 1 << 20;

/// The order in which [`ManualSpawner`] picks ready tasks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunOrder {
    /// Oldest ready task first.
    Fifo,
    /// Newest ready task first.
    Lifo,
}

/// Wakes one task by putting its id back into the ready set. Holds the queue
/// weakly: a waker that outlives the spawner does nothing.
struct TaskWaker {
    id: u64,
    queue: Weak<Mutex<ManualQueue>>,
}

impl Wake for TaskWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if let Some(queue) = self.queue.upgrade() {
            let mut queue = queue.lock().unwrap_or_else(PoisonError::into_inner);
            if queue.tasks.contains_key(&self.id) {
                queue.ready.insert(self.id);
            }
        }
    }
}

#[derive(Default)]
struct ManualQueue {
    next_id: u64,
    /// Every unfinished task; the future is `None` while it is being polled.
    tasks: BTreeMap<u64, Option<BoxFuture<'static, ()>>>,
    /// Tasks spawned or woken since their last poll.
    ready: BTreeSet<u64>,
}

/// A deterministic spawner: tasks run only when the owner says so.
///
/// A task is *ready* when it was just spawned or its waker fired since its
/// last poll; a task that returned `Pending` and was not woken is *parked*.
#[derive(Clone, Default)]
pub struct ManualSpawner {
    queue: Arc<Mutex<ManualQueue>>,
}

impl std::fmt::Debug for ManualSpawner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ManualSpawner")
            .field("tasks", &self.len())
            .field("ready", &self.ready_count())
            .finish()
    }
}

impl Spawner for ManualSpawner {
    fn spawn(&self, task: BoxFuture<'static, ()>) {
        let mut queue = self.lock();
        let id = queue.next_id;
        queue.next_id += 1;
        queue.tasks.insert(id, Some(task));
        queue.ready.insert(id);
    }
}

impl ManualSpawner {
    /// An empty spawner.
    pub fn new() -> Self {
        ManualSpawner::default()
    }

    fn lock(&self) -> MutexGuard<'_, ManualQueue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Tasks not yet finished, ready or parked.
    pub fn len(&self) -> usize {
        self.lock().tasks.len()
    }

    /// Whether no task is left.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tasks that would make progress if polled.
    pub fn ready_count(&self) -> usize {
        self.lock().ready.len()
    }

    /// Polls the `index`-th ready task (oldest first) once. Returns whether
    /// a task was polled.
    pub fn run_nth(&self, index: usize) -> bool {
        let picked = {
            let mut queue = self.lock();
            let id = queue.ready.iter().nth(index).copied();
            id.inspect(|id| {
                queue.ready.remove(id);
            })
        };
        picked.is_some_and(|id| {
            self.poll_task(id);
            true
        })
    }

    /// Polls one ready task, picked by `order`. Returns whether one was polled.
    pub fn run_one(&self, order: RunOrder) -> bool {
        let picked = {
            let mut queue = self.lock();
            match order {
                RunOrder::Fifo => queue.ready.pop_first(),
                RunOrder::Lifo => queue.ready.pop_last(),
            }
        };
        picked.is_some_and(|id| {
            self.poll_task(id);
            true
        })
    }

    /// Polls ready tasks in `order` until none is ready (tasks woken by
    /// others run too), at most [`MAX_POLLS_PER_RUN`] polls. Returns the number
    /// of polls.
    pub fn run_all(&self, order: RunOrder) -> usize {
        let mut polls = 0;
        while polls < MAX_POLLS_PER_RUN && self.run_one(order) {
            polls += 1;
        }
        polls
    }

    /// Drops every queued task without running it.
    pub fn clear(&self) {
        let tasks = {
            let mut queue = self.lock();
            queue.ready.clear();
            std::mem::take(&mut queue.tasks)
        };
        drop(tasks);
    }

    /// Polls task `id`, which the caller already took out of the ready set.
    fn poll_task(&self, id: u64) {
        let Some(mut future) = self.lock().tasks.get_mut(&id).and_then(Option::take) else {
            return;
        };
        let waker = Waker::from(Arc::new(TaskWaker {
            id,
            queue: Arc::downgrade(&self.queue),
        }));
        let mut cx = Context::from_waker(&waker);
        let done = future.as_mut().poll(&mut cx).is_ready();
        let mut queue = self.lock();
        if done {
            queue.tasks.remove(&id);
            queue.ready.remove(&id);
            drop(queue);
            drop(future);
        } else if let Some(slot) = queue.tasks.get_mut(&id) {
            *slot = Some(future);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::task::Poll;

    fn recorder(log: &Arc<Mutex<Vec<u32>>>, value: u32) -> BoxFuture<'static, ()> {
        let log = log.clone();
        Box::pin(async move { log.lock().unwrap().push(value) })
    }

    #[test]
    fn manual_spawner_runs_nothing_until_asked_then_in_the_chosen_order() {
        let spawner = ManualSpawner::new();
        let log = Arc::new(Mutex::new(Vec::new()));
        for v in 1..=3 {
            spawner.spawn(recorder(&log, v));
        }
        assert!(log.lock().unwrap().is_empty());
        assert!(spawner.run_one(RunOrder::Lifo));
        assert!(spawner.run_nth(1));
        assert_eq!(spawner.run_all(RunOrder::Fifo), 1);
        assert_eq!(*log.lock().unwrap(), [3, 2, 1]);
        assert!(spawner.is_empty());
    }

    #[test]
    fn a_parked_task_runs_again_only_after_its_waker_fires() {
        struct Gate {
            open: Arc<AtomicBool>,
            waker: Arc<Mutex<Option<Waker>>>,
        }
        impl Future for Gate {
            type Output = ();
            fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
                if self.open.load(Ordering::SeqCst) {
                    Poll::Ready(())
                } else {
                    *self.waker.lock().unwrap() = Some(cx.waker().clone());
                    Poll::Pending
                }
            }
        }
        let open = Arc::new(AtomicBool::new(false));
        let waker = Arc::new(Mutex::new(None));
        let finished = Arc::new(AtomicUsize::new(0));
        let spawner = ManualSpawner::new();
        let (o, w, f) = (open.clone(), waker.clone(), finished.clone());
        spawner.spawn(Box::pin(async move {
            Gate { open: o, waker: w }.await;
            f.fetch_add(1, Ordering::SeqCst);
        }));
        assert_eq!(spawner.run_all(RunOrder::Fifo), 1);
        assert_eq!(spawner.ready_count(), 0);
        assert_eq!(spawner.len(), 1, "parked, not finished");
        open.store(true, Ordering::SeqCst);
        assert_eq!(spawner.run_all(RunOrder::Fifo), 0, "not woken yet");
        waker.lock().unwrap().take().unwrap().wake();
        assert_eq!(spawner.run_all(RunOrder::Fifo), 1);
        assert_eq!(finished.load(Ordering::SeqCst), 1);
        assert!(spawner.is_empty());
    }
}
