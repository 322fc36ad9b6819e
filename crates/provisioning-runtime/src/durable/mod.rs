//! Durable state in the host (design §13): what the host needs to journal
//! every drive before its operations reach the executor, to resume a run a
//! crashed controller left behind, and to collect orphans.
//!
//! - [`Durability::open`] loads a journal. A run left unclean is resumed:
//!   [`crate::Host::start_durable`] recovers the driver from it, lists every
//!   provider's resources before the first pass, reports journaled nodes the
//!   provider no longer lists as lost (the ladder replaces them) and treats
//!   listed resources no current attempt owns as orphan suspects.
//! - Every wake, the host drives the driver into a buffer, commits the
//!   drive's change set as one transaction and only then submits the
//!   buffered operations. A failed commit submits nothing: each buffered
//!   operation is folded as a definite failure (it never reached a
//!   provider) and retried after backoff.
//! - Orphans: a periodic scan (every `orphan_scan_interval`) lists the
//!   providers again. A resource no node's current attempt owns is destroyed
//!   once it has been seen unowned for `orphan_grace`; one a current attempt
//!   owns is never touched.
//!
//! # Parts
//! - `durability`: [`Durability`], the journal as opened, with the run's
//!   secret and notes, and [`DurabilityError`].
//! - `host_side`: `DurableLoop`, what a durable host loop keeps of it.
//! - `commit`: each wake's drive into a buffer, the commit, then the
//!   submissions; the last commit at shutdown.
//! - `recovery`: the driver recovered from the journal, and the first
//!   listing of a resumed run held against it.
//! - `orphans`: suspects, their grace, the scans and the destroys.

mod commit;
mod durability;
mod host_side;
mod orphans;
mod recovery;

pub use durability::{Durability, DurabilityError, ResumeSummary};
pub(crate) use host_side::{DurableLoop, recv_report};
pub use orphans::{
    DEFAULT_ORPHAN_GRACE, DEFAULT_ORPHAN_SCAN_INTERVAL, LIST_TIMEOUT, ORPHAN_DESTROY_TIMEOUT,
};
pub(crate) use orphans::{OrphanReport, list_all};
