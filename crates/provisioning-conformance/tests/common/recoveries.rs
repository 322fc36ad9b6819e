//! Deliberately broken recoveries, shared by the battery's crash proofs
//! (`crash_bites.rs`) and the explorer's (`explore.rs`): each wraps the real
//! `ClusterDriver::recover` and breaks one thing.

use provisioning::durable::{RecoveryError, RecoveryReport};
use provisioning::id::AttemptAllocator;
use provisioning::{ClusterDriver, DurableState, Timestamp};
use provisioning_conformance::journal::Recovered;
use provisioning_conformance::{DriverSetup, DriverUnderTest};

/// The real recovery.
pub(crate) fn real_recovery(
    setup: &DriverSetup,
    stored: DurableState,
    now: Timestamp,
) -> Result<(ClusterDriver, RecoveryReport), RecoveryError> {
    ClusterDriver::recover(&setup.run_id, stored, setup.policy, now)
}

/// Recovers, then forgets the allocator's mark: the next attempt id starts
/// at 1 again.
pub(crate) fn allocator_not_restored(
    setup: &DriverSetup,
    stored: DurableState,
    now: Timestamp,
) -> Result<Recovered, RecoveryError> {
    let (driver, report) = real_recovery(setup, stored, now)?;
    let mut state = driver.state().clone();
    state.attempts = AttemptAllocator::new();
    let mut rebuilt = ClusterDriver::with_state(driver.desired().clone(), state, setup.policy);
    rebuilt.track_changes();
    let rebuilt: Box<dyn DriverUnderTest> = Box::new(rebuilt);
    Ok((rebuilt, report))
}

/// Recovers from a state whose pending operations were dropped instead of
/// being made ambiguous.
pub(crate) fn drops_pending(
    setup: &DriverSetup,
    mut stored: DurableState,
    now: Timestamp,
) -> Result<Recovered, RecoveryError> {
    for entry in &mut stored.nodes {
        entry.node.pending = None;
    }
    let (driver, report) = real_recovery(setup, stored, now)?;
    let driver: Box<dyn DriverUnderTest> = Box::new(driver);
    Ok((driver, report))
}

/// Recovers, then takes readiness on the journal's word: every node
/// recovery marked rejoining is ready again at once, as before G37 (the
/// `recover.rs` mutant `readiness-from-the-journal` does the same inside the
/// core). The explorer's proofs share this file and do not use it.
#[allow(dead_code)]
pub(crate) fn readiness_from_the_journal(
    setup: &DriverSetup,
    stored: DurableState,
    now: Timestamp,
) -> Result<Recovered, RecoveryError> {
    let (driver, report) = real_recovery(setup, stored, now)?;
    let mut state = driver.state().clone();
    let mut restored = false;
    for node in state.nodes.values_mut() {
        if node.record.stage == provisioning::NodeStage::Rejoining {
            node.record.stage = provisioning::NodeStage::Dormant;
            node.record.ready = true;
            node.record.rejoin_by = None;
            restored = true;
        }
    }
    if !restored {
        // Nothing to take on the journal's word: the real recovery, which
        // keeps what a rebuilt driver would lose (its breakers).
        let driver: Box<dyn DriverUnderTest> = Box::new(driver);
        return Ok((driver, report));
    }
    let mut rebuilt = ClusterDriver::with_state(driver.desired().clone(), state, setup.policy);
    rebuilt.track_changes();
    let rebuilt: Box<dyn DriverUnderTest> = Box::new(rebuilt);
    Ok((rebuilt, report))
}
