//! The controller's end of the peers push (design §22): the run's latest
//! membership, encoded once per version, which the swarm listener sends to
//! every member right after its welcome and whenever it changes.
//!
//! A provider keeps one [`PeersFeed`], [publishes](PeersFeed::publish) each
//! membership the host hands it, and gives the listener a
//! [subscription](PeersFeed::subscribe). The feed also answers the desired
//! size of a group ([`PeersFeed::group_size`]) for the boot orders the
//! provider writes.

use std::sync::Arc;

use provisioning::{GroupId, Membership};
use tokio::sync::watch;

use crate::codec::encode_message_with_max_line_bytes;
use crate::wire::{PEERS_LINE_BYTES_MAX, PeersUpdate, SwarmPush};

/// One published membership: as the host handed it, and as the line the
/// listener writes to every member.
#[derive(Debug)]
pub struct PublishedPeers {
    /// The membership.
    pub membership: Arc<Membership>,
    /// Its [`SwarmPush::Peers`] line, newline included (empty when too
    /// long to send); shared by every connection that writes it.
    pub line: Arc<[u8]>,
}

/// What the swarm listener watches: the latest published membership, if any.
pub type PeersSubscription = watch::Receiver<Option<Arc<PublishedPeers>>>;

/// The latest membership of the run, for a provider's swarm listener.
#[derive(Debug)]
pub struct PeersFeed {
    latest: watch::Sender<Option<Arc<PublishedPeers>>>,
}

impl Default for PeersFeed {
    fn default() -> Self {
        PeersFeed {
            latest: watch::channel(None).0,
        }
    }
}

impl PeersFeed {
    /// A feed with nothing published yet.
    pub fn new() -> Self {
        PeersFeed::default()
    }

    /// Publishes `membership` unless a newer (or the same) version was
    /// published already. A membership too long for one line
    /// ([`PEERS_LINE_BYTES_MAX`]) is not sent; its group sizes still serve
    /// [`PeersFeed::group_size`].
    pub fn publish(&self, membership: &Arc<Membership>) {
        let update = SwarmPush::Peers(PeersUpdate::from_membership(membership));
        let line = match encode_message_with_max_line_bytes(&update, PEERS_LINE_BYTES_MAX) {
            Ok(line) => line,
            Err(error) => {
                tracing::warn!(%error, "the run's membership is not sent to its agents");
                Vec::new()
            }
        };
        let published = Arc::new(PublishedPeers {
            membership: membership.clone(),
            line: line.into(),
        });
        self.latest.send_if_modified(|latest| {
            let newer = latest
                .as_ref()
                .is_none_or(|held| held.membership.version < membership.version);
            if newer {
                *latest = Some(published);
            }
            newer
        });
    }

    /// A subscription for the swarm listener
    /// ([`ListenerSettings::peers`](crate::swarm::ListenerSettings::peers)).
    pub fn subscribe(&self) -> PeersSubscription {
        self.latest.subscribe()
    }

    /// The desired size of `group` in the latest membership.
    pub fn group_size(&self, group: &GroupId) -> Option<u32> {
        self.latest
            .borrow()
            .as_ref()
            .and_then(|held| held.membership.group_size(group))
    }

    /// The latest published membership.
    pub fn latest(&self) -> Option<Arc<Membership>> {
        self.latest
            .borrow()
            .as_ref()
            .map(|held| held.membership.clone())
    }
}
