//! The runs of one Level 3 test: every substrate serves a run of its own,
//! registered here, so that the test can check at the end that nothing of
//! any of them is left, and sum the real faults they applied.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use provisioning::RunId;

/// The longest run id a substrate hands out (providers put it in process
/// environments, job names and directory names).
pub const RUN_ID_CHARS_MAX: usize = 63;

/// How often each real fault of a substrate was applied. The battery
/// requires every [`FaultCounts::required`] count to leave zero.
pub trait FaultCounts: Clone + Default + Send {
    /// Adds `other` to `self`.
    fn add(&mut self, other: &Self);

    /// The counts that must not stay at zero over a battery, by name.
    fn required(&self) -> Vec<(&'static str, u64)>;

    /// Every count, by name, for the summary (the required ones unless a
    /// substrate counts more, such as refused inputs).
    fn all(&self) -> Vec<(&'static str, u64)> {
        self.required()
    }
}

/// The runs, fault sums and survivors of one Level 3 test.
#[derive(Debug)]
pub struct Runs<F> {
    name: String,
    serial: AtomicU32,
    runs: Mutex<Vec<RunId>>,
    faults: Mutex<F>,
    survivors: Mutex<Vec<String>>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl<F: FaultCounts> Runs<F> {
    /// A registry whose runs are named after `name` and this test process.
    pub fn new(name: &str) -> Self {
        Runs {
            name: name.to_owned(),
            serial: AtomicU32::new(0),
            runs: Mutex::new(Vec::new()),
            faults: Mutex::new(F::default()),
            survivors: Mutex::new(Vec::new()),
        }
    }

    /// The name runs are named after.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A run id no other substrate (or test process) uses, registered.
    pub fn next_run(&self) -> RunId {
        let serial = self.serial.fetch_add(1, Ordering::Relaxed);
        let mut text = format!("l3-{}-{}-{serial}", std::process::id(), self.name);
        text.truncate(RUN_ID_CHARS_MAX);
        let run = RunId::new(text);
        lock(&self.runs).push(run.clone());
        run
    }

    /// Records what a substrate did once it is torn down: the faults it
    /// applied, and what of its run outlived the plugin (each entry one
    /// line for the final report).
    pub fn finished(&self, faults: &F, survivors: impl IntoIterator<Item = String>) {
        lock(&self.faults).add(faults);
        lock(&self.survivors).extend(survivors);
    }

    /// Every run started so far.
    pub fn runs(&self) -> Vec<RunId> {
        lock(&self.runs).clone()
    }

    /// The faults applied by every finished substrate.
    pub fn faults(&self) -> F {
        lock(&self.faults).clone()
    }

    /// What outlived a plugin (each was then removed by the substrate).
    pub fn survivors(&self) -> Vec<String> {
        lock(&self.survivors).clone()
    }
}

/// A test context that can remove everything of a run by itself, without
/// any plugin: the last line of defence of [`RunsGuard`].
pub trait RunCleanup: Send + Sync {
    /// Every run started so far.
    fn runs(&self) -> Vec<RunId>;

    /// Undoes every fault still applied to the world the runs share (a
    /// stopped daemon, a cut link), before the runs are cleaned up.
    fn restore(&self) {}

    /// Removes (kills, cancels, deletes) everything of `run` the real world
    /// still holds; what could not be removed, if anything.
    fn clean_up(&self, run: &RunId) -> Option<String>;
}

/// Cleans up every run of a context when dropped, so that a failing or
/// panicking test leaves nothing behind.
#[derive(Debug)]
pub struct RunsGuard<C: RunCleanup> {
    context: Arc<C>,
}

impl<C: RunCleanup> RunsGuard<C> {
    /// A guard over the runs of `context`.
    pub fn new(context: &Arc<C>) -> Self {
        RunsGuard {
            context: context.clone(),
        }
    }
}

impl<C: RunCleanup> Drop for RunsGuard<C> {
    fn drop(&mut self) {
        self.context.restore();
        for run in self.context.runs() {
            if let Some(left) = self.context.clean_up(&run) {
                eprintln!("level 3: run {run} left something behind: {left}");
            }
        }
    }
}
