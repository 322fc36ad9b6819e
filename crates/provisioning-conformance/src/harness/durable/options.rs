//! How the harness host journals, recovers and collects orphans
//! ([`HostOptions`], [`HostOrder`]): the correct host by default, and the
//! deliberately wrong settings the kit's own mutation tests use.

use std::time::Duration;

/// The default `orphan_grace`: how long a resource must be seen unowned
/// before the host destroys it (design §13's default).
pub const DEFAULT_ORPHAN_GRACE: Duration = Duration::from_secs(30);

/// The default `orphan_scan_interval`: how often the host lists the
/// substrate's live resources while running.
pub const DEFAULT_ORPHAN_SCAN_INTERVAL: Duration = Duration::from_secs(10);

/// In which order the host makes a drive durable and hands it out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HostOrder {
    /// Commit the drive's change set, then submit its operations (correct;
    /// design §13, G27).
    CommitThenSubmit,
    /// Submit first, commit after — a deliberately wrong host, for the
    /// kit's own mutation tests (caught as G27).
    SubmitThenCommit,
}

/// How the harness host journals, recovers and collects orphans.
///
/// The defaults are the correct host. The other settings exist so the
/// kit's tests can prove the oracle notices a wrong host.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HostOptions {
    /// Commit before submit (default) or the reverse.
    pub order: HostOrder,
    /// Whether orphans are destroyed at all (default: yes; `false` is a
    /// mutation, caught as G28).
    pub collect_orphans: bool,
    /// How long a resource must be seen unowned before it is destroyed.
    pub orphan_grace: Duration,
    /// How often the live resources are listed while running.
    pub orphan_scan_interval: Duration,
}

impl Default for HostOptions {
    fn default() -> Self {
        HostOptions {
            order: HostOrder::CommitThenSubmit,
            collect_orphans: true,
            orphan_grace: DEFAULT_ORPHAN_GRACE,
            orphan_scan_interval: DEFAULT_ORPHAN_SCAN_INTERVAL,
        }
    }
}
