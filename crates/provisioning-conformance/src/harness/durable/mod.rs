//! The durable side of the harness host: journaling before dispatch (G27),
//! controller crashes and recovery (G26), and orphan collection (G28).
//!
//! Per wake the host drives the driver into a `Batch`, commits the drive's
//! change set to the journal, and only then submits the batch to the
//! executor — as the real host does. The executor runs over a
//! `ControllerBackend`, a thin wrapper of the substrate's backend that
//! belongs to one controller life (an *epoch*): it checks at every call start
//! that the operation was committed as pending (G27), and after a crash it
//! refuses every call the dead controller's executor still had queued, while
//! calls that were already running in the backend go on there (*zombies*).
//!
//! The parts: `options` (how the host is set up), `controller` (the
//! backend wrapper of one controller life and what it records), `side`
//! (what the durable side of a run keeps), `commit` (commit, then submit),
//! `replica` (the kit's own copy of the journal, held to the driver),
//! `crash` (crash and recovery), `rejoin` (readiness re-earned after a
//! crash, G37) and `orphans` (orphan collection).

mod commit;
mod controller;
mod crash;
mod options;
mod orphans;
mod rejoin;
mod replica;
mod side;

pub(super) use commit::Batch;
pub(super) use controller::ControllerBackend;
pub use options::{DEFAULT_ORPHAN_GRACE, DEFAULT_ORPHAN_SCAN_INTERVAL, HostOptions, HostOrder};
pub(super) use side::DurableSide;
