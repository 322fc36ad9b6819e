//! Level 3 support: what every battery against a real plugin over a real
//! world (processes, an SSH host, a Slurm cluster) needs besides the world
//! itself.
//!
//! # What a Level 3 substrate supplies
//! - Its **fault mapping**: which scripted faults it can turn into real
//!   events for which calls (a [`Producible`] table), and how — a signal,
//!   a stopped daemon, a renamed program, a cut link — in its backend,
//!   around the call to the real
//!   [`PluginBackendAdapter`](provisioning_provider::PluginBackendAdapter).
//! - Its **independent count** of live resources (`/proc`, `squeue`, claim
//!   directories), never the plugin's word: that is what G08 and G23 are
//!   checked against, and what its teardown removes.
//! - Its fault counts (a [`FaultCounts`] type), so that the battery can
//!   tell that every real fault was applied at least once.
//!
//! # What the kit supplies
//! - [`Shared`]: the state the harness thread and the plugin's threads
//!   share — the scripted faults, the bounded observation inbox
//!   ([`INBOX_OBSERVATIONS_MAX`]), the session and owner [`Ledger`] folded
//!   from the plugin's answers and facts, the in-flight and hung calls
//!   (with guards that end them however the call ends), the G08 alarms,
//!   the vacuity counters — and [`Shared::wait_until`], the bounded wait
//!   for a fact the plugin reports in the background.
//! - [`run_work`]: polling the executor's work until quiet, within
//!   [`WorkBounds`].
//! - [`Runs`]: the run ids of one test, the sum of the faults applied and
//!   what outlived a plugin; [`RunsGuard`] removes every run's leftovers
//!   even when the test fails or panics.
//! - [`Intercepted`]: a real plugin with the methods an [`Intercept`]
//!   overrides wrapped (a fault around a call, a deliberate defect), the
//!   others passed straight through.
//! - [`Level3Substrate`]: the kit's `Substrate` over a provider's
//!   [`Level3World`] (its fault mapping, its own count of what is live, its
//!   teardown), on a [`SubstrateCore`] (the shared state, the manual
//!   spawner, the runtime the plugin runs on).
//! - [`RealNode`]: the kit's operations as a real plugin serves them (the
//!   substrate's run, the provider's kind, the world's verify command, a
//!   long-running workload).
//! - [`assert_clean_run`] and [`assert_leak_caught`]: one trace run clean
//!   and with a deliberate leak, to show that the world's own count bites.
//! - [`hold_call`]: a call held before it reaches the plugin, in a task of
//!   its own, as a slow provider API holds it.
//! - [`Level3Battery`]: seeds × both modes plus written traces, a small
//!   shrink budget, the reproduce line, and the final checks (failures,
//!   vacuity with reasoned waivers, required faults never applied).
//!
//! Nothing here reads a clock except the bounded waits, which real I/O
//! needs; the harness's clock stays the trace's.

mod battery;
mod defect;
mod held;
mod intercept;
mod ledger;
mod runs;
mod shared;
mod spec;
mod substrate;
mod work;

pub use battery::{Level3Battery, Level3Error, Waiver, describe, restricted};
#[cfg(feature = "sqlite")]
pub use battery::{TempSqliteJournal, temp_sqlite_journal};
pub use defect::{assert_clean_run, assert_leak_caught};
pub use held::{HOLD_POLL_INTERVAL, HOLD_WAIT_MAX, hold_call};
pub use intercept::{Intercept, Intercepted, PluginCall};
pub use ledger::{LeaseOwners, Ledger, LedgerPolicy, SessionHandles, SessionTrack};
pub use runs::{FaultCounts, RUN_ID_CHARS_MAX, RunCleanup, Runs, RunsGuard};
pub use shared::{
    Detached, Hang, HeldCall, INBOX_OBSERVATIONS_MAX, InFlight, Producible, Scripted, Shared,
    State, attempt_key,
};
pub use spec::{RealNode, WORKLOAD_COMMAND};
pub use substrate::{Core, Level3Substrate, Level3World, RUNTIME_SHUTDOWN_WAIT_MAX, SubstrateCore};
pub use work::{WorkBounds, run_work, run_work_reporting};
