//! The conformance kit of `provisioning`: proves that a driver, an executor
//! and a provider backend keep the guarantees G01–G30, G32 and G37 of the specification.
//!
//! Where to start:
//! - [`Battery`] runs many seeded traces in both modes, replays regressions
//!   first, shrinks failures and checks vacuity. [`Battery::level1`] is the
//!   kit's own Level 1 (the in-memory [`FakeSubstrate`]).
//! - [`contract::run_contract_suite`] checks a
//!   [`ProvisionPlugin`](provisioning_provider::ProvisionPlugin) against the
//!   seam contract, a few calls at a time, with faults from the author's
//!   optional [`ContractFaults`] hook. Start here if you wrote a plugin.
//! - [`Battery::level2`] runs the battery through the real
//!   [`PluginBackendAdapter`](provisioning_provider::PluginBackendAdapter)
//!   over [`FakePlugin`] ([`PluginSubstrate`]), with
//!   faults on every plugin method.
//! - [`Substrate`] is what you implement to put your own provider under the
//!   harness: the backend, fault scripting, work running, and an honest count
//!   of live resources.
//! - [`trace`] holds the input alphabet and its text form; [`harness`] folds
//!   a trace into a real driver and executor and runs the oracle;
//!   [`guarantee`] names the guarantees by stable id.
//!
//! # Running the battery against your own backend
//! ```
//! use provisioning_conformance::{Battery, FakeSubstrate, Mode};
//!
//! // A factory that builds a fresh substrate per run. Put your own type
//! // here: anything implementing `Substrate` (its backend goes under the
//! // real executor; its ledger is what G08 and G23 are checked against).
//! let report = Battery::new("my provider", FakeSubstrate::new)
//!     .seed_count(8)
//!     .modes([Mode::Adversarial, Mode::Fair])
//!     .require_vacuity(false) // 8 seeds do not reach every situation
//!     .reproduce_with("cargo test -p my-provider --test conformance")
//!     .run();
//! assert!(report.passed(), "{report}");
//! ```
//!
//! A failure report names the guarantee id, the input, the seed and mode,
//! the shrunk trace, and one command line that reproduces it, for example
//! `PROVISIONING_TRACE='tick 1000ms; run fifo' PROVISIONING_MODE=fair cargo
//! test -p my-provider --test conformance` — when the test builds its
//! battery with [`Battery::with_env_overrides`].
//!
//! # What the kit never does
//! It reads no clock inside a run (time is the trace's), draws no randomness
//! except from its own [`prng::SplitMix64`], and iterates only ordered
//! collections — so a deterministic substrate replays a trace identically.

pub mod battery;
pub mod contract;
pub mod driver_under_test;
pub mod explore;
pub mod fake;
mod fake_support;
pub mod generate;
pub mod guarantee;
pub mod harness;
pub mod journal;
pub mod level3;
mod oracle;
pub mod plugin_fake;
pub mod plugin_substrate;
pub mod prng;
pub mod shrink;
#[cfg(feature = "sqlite")]
pub mod sqlite;
pub mod substrate;
pub mod trace;

pub use battery::{Battery, BatteryReport, Evaluation, Failure, Regression};
pub use contract::{ContractFaults, ContractReport, ContractSubject, run_contract_suite};
pub use driver_under_test::{ChangeRead, DriverUnderTest, TakenChanges};
pub use explore::{Counterexample, ExploreConfig, ExploreReport, Explorer};
pub use fake::{Defect, FakeBackend, FakeSubstrate};
pub use generate::{GeneratorConfig, generate};
pub use guarantee::{GuaranteeId, Phase, Violation};
pub use harness::{
    BuildError, DriverSetup, HostOptions, HostOrder, Mode, RunOptions, RunOutcome, StepReport,
    Stepper, StepperBuilder, TailOutcome, Vacuity, cluster_driver, default_shape, kit_template,
    run_trace,
};
pub use journal::{InMemoryJournal, KitJournal, recover_cluster_driver};
pub use plugin_fake::{FakePlugin, PluginDefect};
pub use plugin_substrate::{PluginSubstrate, ScriptablePlugin};
pub use prng::SplitMix64;
pub use substrate::{CallRecord, Capabilities, LiveResources, Substrate};
pub use trace::{Input, Trace};
