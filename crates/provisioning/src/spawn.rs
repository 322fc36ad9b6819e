//! Spawners: where the executor hands its work.
//!
//! The core owns no runtime. The host passes a [`Spawner`] backed by its
//! runtime (tokio in `provisioning-runtime`); tests and the conformance kit
//! use [`ManualSpawner`], which runs nothing until asked and then runs queued
//! work in a chosen order, deterministically.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
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

struct WakeFlag(AtomicBool);

impl Wake for WakeFlag {
    fn wake(self: Arc<Self>) {
        self.0.store(true, Ordering::SeqCst);
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.store(true, Ordering::SeqCst);
    }
}

struct TaskSlot {
    future: Option<BoxFuture<'static, ()>>,
    woken: Arc<WakeFlag>,
}

#[derive(Default)]
struct ManualQueue {
    next_id: u64,
    tasks: BTreeMap<u64, TaskSlot>,
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
        queue.tasks.insert(
            id,
            TaskSlot {
                future: Some(task),
                woken: Arc::new(WakeFlag(AtomicBool::new(true))),
            },
        );
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
        self.lock()
            .tasks
            .values()
            .filter(|t| t.future.is_some() && t.woken.0.load(Ordering::SeqCst))
            .count()
    }

    fn ready_ids(&self) -> Vec<u64> {
        self.lock()
            .tasks
            .iter()
            .filter(|(_, t)| t.future.is_some() && t.woken.0.load(Ordering::SeqCst))
            .map(|(id, _)| *id)
            .collect()
    }

    /// Polls the `index`-th ready task (in FIFO order) once. Returns whether
    /// a task was polled.
    pub fn run_nth(&self, index: usize) -> bool {
        match self.ready_ids().get(index) {
            Some(id) => {
                self.poll_task(*id);
                true
            }
            None => false,
        }
    }

    /// Polls one ready task, picked by `order`. Returns whether one was polled.
    pub fn run_one(&self, order: RunOrder) -> bool {
        let ids = self.ready_ids();
        let pick = match order {
            RunOrder::Fifo => ids.first(),
            RunOrder::Lifo => ids.last(),
        };
        match pick {
            Some(id) => {
                self.poll_task(*id);
                true
            }
            None => false,
        }
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
        let tasks = std::mem::take(&mut self.lock().tasks);
        drop(tasks);
    }

    fn poll_task(&self, id: u64) {
        let (mut future, woken) = {
            let mut queue = self.lock();
            let Some(slot) = queue.tasks.get_mut(&id) else {
                return;
            };
            let Some(future) = slot.future.take() else {
                return;
            };
            // Cleared before polling so that a wake during the poll is kept.
            slot.woken.0.store(false, Ordering::SeqCst);
            (future, slot.woken.clone())
        };
        let waker = Waker::from(woken);
        let mut cx = Context::from_waker(&waker);
        let done = future.as_mut().poll(&mut cx).is_ready();
        let mut queue = self.lock();
        if done {
            queue.tasks.remove(&id);
        } else if let Some(slot) = queue.tasks.get_mut(&id) {
            slot.future = Some(future);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
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
