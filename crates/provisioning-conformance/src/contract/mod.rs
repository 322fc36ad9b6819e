//! The seam contract suite: what every [`ProvisionPlugin`] must do, checked
//! against a plugin you hand in.
//!
//! The battery ([`crate::Battery`]) drives a whole cluster through a plugin
//! and checks the cluster's guarantees. This suite is smaller and sharper: it
//! calls the plugin's methods directly, a few at a time, and checks the
//! promises the driver relies on — the ones in the [`ProvisionPlugin`] docs:
//!
//! | Contract | What is checked |
//! |---|---|
//! | [`Contract::CreateTwiceAdopts`] | a second `create_node` for one key adopts the first node; `list_nodes` still shows one |
//! | [`Contract::DefiniteFaultCreatesNothing`] | a `create_node` that fails definitely leaves nothing listed for its key |
//! | [`Contract::DefiniteFaultAdoptsExisting`] | a fault on the creation path never hides a live node: the call adopts it (or is ambiguous), never fails definitely |
//! | [`Contract::AmbiguousFaultRetryAdopts`] | after an ambiguous `create_node`, at most one node exists, and the retry adopts it without creating a second |
//! | [`Contract::StartTwiceAdopts`] | a second `start_bootstrap` for one key adopts the running session |
//! | [`Contract::CleanupOfAbsentSucceeds`] | `cancel_bootstrap` and `destroy_node` of something absent succeed (or say not found) |
//! | [`Contract::CleanupFaultsRetry`] | a definite `destroy_node` failure leaves the node; an ambiguous one is followed by a retry that succeeds |
//! | [`Contract::ListIsExact`] | `list_nodes` reports exactly the live nodes of the run, each once, with the lease `create_node` returned |
//! | [`Contract::TeardownLeavesNothing`] | cancelling and destroying every node leaves nothing listed |
//! | [`Contract::SupersededFactsDropped`] | facts of a lost node are reported under its own attempt, and those of a superseded attempt never reach the driver |
//!
//! Contracts that need a fault the plugin cannot be made to produce are
//! **skipped with a reason**, never silently passed: faults come from the
//! plugin author through the optional [`ContractFaults`] hook.
//!
//! # Running it
//! The suite is an `async fn` you await on your own runtime; it spawns
//! nothing and reads no clock. The factory builds a fresh plugin for every
//! contract.
//!
//! ```
//! use std::convert::Infallible;
//! use provisioning_conformance::contract::{complete_without_runtime, run_contract_suite};
//! use provisioning_conformance::plugin_fake::FakePlugin;
//!
//! let suite = run_contract_suite(|| async {
//!     let plugin = FakePlugin::new();
//!     // Your plugin here; `with_faults` is optional but unlocks most contracts.
//!     Ok::<_, Infallible>(plugin.contract_subject())
//! });
//! // With tokio: `let report = suite.await;` inside `#[tokio::test]`.
//! let report = complete_without_runtime(suite).expect("the fake never waits");
//! report.assert_passed();
//! assert!(report.skipped().is_empty(), "{report}");
//! ```
//!
//! # Caveats
//! The suite awaits every plugin call as it is; a call that never returns
//! hangs the suite. Bound it with your runtime's timeout
//! (`tokio::time::timeout(Duration::from_secs(120), suite)`).
//!
//! The parts: `subject` (what the suite runs against, and the fault hook),
//! `report` (contracts and verdicts), `suite` (the runner), `run` (one
//! contract's run and its steps) and `checks` (the contracts themselves).

mod checks;
mod report;
mod run;
mod subject;
mod suite;

pub use report::{Contract, ContractReport, ContractResult, ContractVerdict};
pub use run::{
    CONTRACT_GROUP, ENDPOINT_POLL_PAUSE, ENDPOINT_POLLS_MAX, LOSS_REPORT_POLLS_MAX,
    TEARDOWN_NODES_MAX,
};
pub use subject::{ContractFaults, ContractSubject, PauseFn, PluginMethod};
pub use suite::{MAX_POLLS_WITHOUT_RUNTIME, complete_without_runtime, run_contract_suite};
