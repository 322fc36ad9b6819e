//! Running a Level 3 substrate's work: the executor's operations queue on a
//! [`ManualSpawner`], so the trace decides when work runs and in which
//! order; because the calls do real I/O, "run everything" keeps polling
//! until no call does I/O and nothing is ready (calls hung on purpose may
//! stay), within a bound; "run one" polls one task once and may leave its
//! call in flight, a slow call the trace can time out.
//!
//! The caller enters its runtime first: the plugin's tasks run there.

use std::time::{Duration, Instant};

use provisioning::spawn::{ManualSpawner, RunOrder};

use crate::substrate::run_manual_work;
use crate::trace::WorkStep;

/// The bounds of one run of work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkBounds {
    /// How long running work waits for real I/O to finish.
    pub quiet_wait_max: Duration,
    /// How often running work looks again while calls do I/O.
    pub poll_interval: Duration,
    /// The most rounds of polling one run of work makes (the wait bound
    /// divided by the poll interval, so that the time bound is the one that
    /// bites).
    pub rounds_max: usize,
}

/// Runs one step of work on `spawner`: everything in `Fifo` or `Lifo`
/// order until quiet (`busy` counts the calls still doing I/O), or one
/// task once. Returns the polls. When the work does not settle in time,
/// says so on standard error with `describe`'s account and returns.
pub fn run_work(
    spawner: &ManualSpawner,
    step: WorkStep,
    bounds: &WorkBounds,
    busy: impl Fn() -> usize,
    describe: impl Fn() -> String,
) -> usize {
    run_work_reporting(spawner, step, bounds, busy, |waited| {
        eprintln!(
            "level 3: work did not settle within {waited:?}: {}",
            describe()
        );
    })
}

/// [`run_work`], telling `unsettled` how long it waited when the work did
/// not settle in time (for substrates that report through a logger).
pub fn run_work_reporting(
    spawner: &ManualSpawner,
    step: WorkStep,
    bounds: &WorkBounds,
    busy: impl Fn() -> usize,
    unsettled: impl FnOnce(Duration),
) -> usize {
    let order = match step {
        WorkStep::Fifo => RunOrder::Fifo,
        WorkStep::Lifo => RunOrder::Lifo,
        WorkStep::One(_) => return run_manual_work(spawner, step),
    };
    let deadline = Instant::now() + bounds.quiet_wait_max;
    let mut polls = 0;
    for _ in 0..bounds.rounds_max {
        polls += spawner.run_all(order);
        if busy() == 0 && spawner.ready_count() == 0 {
            break;
        }
        if Instant::now() >= deadline {
            unsettled(bounds.quiet_wait_max);
            break;
        }
        std::thread::sleep(bounds.poll_interval);
    }
    polls
}
