//! Spawners: where the executor hands its work.
//!
//! The core owns no runtime. The host passes a [`Spawner`] backed by its
//! runtime (tokio in `provisioning-runtime`); tests and the conformance kit
//! use [`ManualSpawner`], which runs nothing until asked and then runs queued
//! work in a chosen order, deterministically.

use std::collections::{BTreeSet, VecDeque};
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
            if queue.tasks.contains(self.id) {
                queue.ready.insert(self.id);
            }
        }
    }
}

#[derive(Default)]
struct ManualQueue {
    /// Every unfinished task.
    tasks: TaskTable,
    /// Tasks spawned or woken since their last poll.
    ready: BTreeSet<u64>,
}

/// Where a task is.
enum Slot {
    /// Waiting for its next poll.
    Queued(BoxFuture<'static, ()>),
    /// Taken out to be polled.
    Polling,
    /// Done (or dropped by [`ManualSpawner::clear`]).
    Finished,
}

/// The most slots an empty table keeps room for.
const IDLE_SLOTS: usize = 64;

/// The unfinished tasks by id. Ids are handed out in order, so task `id`
/// is at `slots[id - first]`: spawning appends, and finished tasks leave a
/// [`Slot::Finished`] behind until every older task has finished too (the
/// slots then go from the front). A lookup is an index, not a tree search;
/// the table holds one slot per task spawned since the oldest unfinished
/// one.
#[derive(Default)]
struct TaskTable {
    first: u64,
    slots: VecDeque<Slot>,
    live: usize,
}

impl TaskTable {
    fn index(&self, id: u64) -> Option<usize> {
        usize::try_from(id.checked_sub(self.first)?).ok()
    }

    fn slot(&mut self, id: u64) -> Option<&mut Slot> {
        let index = self.index(id)?;
        self.slots.get_mut(index)
    }

    /// Adds a task under the next id, which it returns.
    fn push(&mut self, task: BoxFuture<'static, ()>) -> u64 {
        let id = self.first + self.slots.len() as u64;
        self.slots.push_back(Slot::Queued(task));
        self.live += 1;
        id
    }

    fn contains(&self, id: u64) -> bool {
        let slot = self.index(id).and_then(|index| self.slots.get(index));
        matches!(slot, Some(Slot::Queued(_) | Slot::Polling))
    }

    /// Takes task `id` out to be polled.
    fn take(&mut self, id: u64) -> Option<BoxFuture<'static, ()>> {
        let slot = self.slot(id)?;
        match std::mem::replace(slot, Slot::Polling) {
            Slot::Queued(task) => Some(task),
            other => {
                *slot = other;
                None
            }
        }
    }

    /// Puts a polled task back; `Err` gives it back when the task was
    /// dropped meanwhile (the table was cleared).
    fn put_back(
        &mut self,
        id: u64,
        task: BoxFuture<'static, ()>,
    ) -> Result<(), BoxFuture<'static, ()>> {
        match self.slot(id) {
            Some(slot @ Slot::Polling) => {
                *slot = Slot::Queued(task);
                Ok(())
            }
            _ => Err(task),
        }
    }

    /// Marks a polled task done.
    fn finish(&mut self, id: u64) {
        if let Some(slot @ Slot::Polling) = self.slot(id) {
            *slot = Slot::Finished;
            self.live -= 1;
            while matches!(self.slots.front(), Some(Slot::Finished)) {
                self.slots.pop_front();
                self.first += 1;
            }
            if self.slots.is_empty() && self.slots.capacity() > IDLE_SLOTS {
                // An idle spawner keeps no table sized for its largest batch.
                self.slots = VecDeque::new();
            }
        }
    }

    /// Takes every task out; ids go on from where they were.
    fn clear(&mut self) -> VecDeque<Slot> {
        self.first += self.slots.len() as u64;
        self.live = 0;
        std::mem::take(&mut self.slots)
    }
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
        let id = queue.tasks.push(task);
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
        self.lock().tasks.live
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
            queue.tasks.clear()
        };
        drop(tasks);
    }

    /// Polls task `id`, which the caller already took out of the ready set.
    fn poll_task(&self, id: u64) {
        let Some(mut future) = self.lock().tasks.take(id) else {
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
            queue.tasks.finish(id);
            queue.ready.remove(&id);
            drop(queue);
            drop(future);
        } else if let Err(dropped) = queue.tasks.put_back(id, future) {
            drop(queue);
            drop(dropped);
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

    #[test]
    fn a_parked_old_task_holds_the_table_until_it_finishes_and_clear_drops_all() {
        let open = Arc::new(AtomicBool::new(false));
        let waker = Arc::new(Mutex::new(None));
        let log = Arc::new(Mutex::new(Vec::new()));
        let spawner = ManualSpawner::new();
        let (o, w, l) = (open.clone(), waker.clone(), log.clone());
        spawner.spawn(Box::pin(async move {
            std::future::poll_fn(|cx| {
                if o.load(Ordering::SeqCst) {
                    Poll::Ready(())
                } else {
                    *w.lock().unwrap() = Some(cx.waker().clone());
                    Poll::Pending
                }
            })
            .await;
            l.lock().unwrap().push(0);
        }));
        for v in 1..=3 {
            spawner.spawn(recorder(&log, v));
        }
        assert_eq!(spawner.run_all(RunOrder::Lifo), 4);
        assert_eq!(*log.lock().unwrap(), [3, 2, 1]);
        assert_eq!(spawner.len(), 1, "only the parked task is left");
        assert_eq!(
            spawner.lock().tasks.slots.len(),
            4,
            "the slots behind the oldest unfinished task wait for it"
        );
        open.store(true, Ordering::SeqCst);
        waker.lock().unwrap().take().unwrap().wake();
        assert_eq!(spawner.run_all(RunOrder::Fifo), 1);
        assert!(spawner.is_empty());
        assert!(spawner.lock().tasks.slots.is_empty(), "compacted");
        // A waker of a finished task wakes nothing.
        let stale = Waker::from(Arc::new(TaskWaker {
            id: 0,
            queue: Arc::downgrade(&spawner.queue),
        }));
        stale.wake_by_ref();
        assert_eq!(spawner.ready_count(), 0);
        // Cleared tasks are dropped unrun; ids go on from where they were.
        spawner.spawn(recorder(&log, 5));
        spawner.spawn(recorder(&log, 6));
        spawner.clear();
        assert!(spawner.is_empty());
        assert_eq!(spawner.lock().tasks.first, 6, "no id is handed out twice");
        spawner.spawn(recorder(&log, 7));
        assert_eq!(spawner.run_all(RunOrder::Fifo), 1);
        assert_eq!(*log.lock().unwrap(), [3, 2, 1, 0, 7]);
        assert!(spawner.is_empty());
    }

    #[test]
    fn an_emptied_table_gives_back_the_room_of_its_largest_batch() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let spawner = ManualSpawner::new();
        for v in 0..1000 {
            spawner.spawn(recorder(&log, v));
        }
        assert!(spawner.lock().tasks.slots.capacity() >= 1000);
        assert_eq!(spawner.run_all(RunOrder::Fifo), 1000);
        assert!(spawner.is_empty());
        assert!(
            spawner.lock().tasks.slots.capacity() <= IDLE_SLOTS,
            "an idle spawner holds no table for a thousand tasks"
        );
        // Ids go on; the table grows again as needed.
        spawner.spawn(recorder(&log, 1000));
        assert_eq!(spawner.lock().tasks.first, 1000);
        assert_eq!(spawner.run_all(RunOrder::Fifo), 1);
        assert_eq!(log.lock().unwrap().len(), 1001);
    }
}
