//! Identity types: runs, slots, attempts and operations.
//!
//! Each identity is its own type. None converts silently into another: a
//! [`NodeAttemptId`] cannot be passed where an [`OperationId`] is expected, and
//! a [`LogicalNodeId`] is built from a group and an index, never parsed from an
//! arbitrary string by accident.

use std::fmt;
use std::sync::Arc;

use thiserror::Error;

/// A name shared by every id that carries it. An `Arc<String>` rather than
/// an `Arc<str>`: a thin pointer, so every node id (and every node, which
/// holds its id twice) is 8 bytes smaller.
fn shared_name(name: Arc<str>) -> Arc<String> {
    Arc::new(String::from(&*name))
}

/// One run: the unit a driver manages for its whole lifetime.
#[derive(
    Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(transparent)]
pub struct RunId(Arc<String>);

impl RunId {
    /// Wraps a run name. Validation of the characters happens in
    /// [`crate::shape::ClusterShape::validate`].
    pub fn new(name: impl Into<Arc<str>>) -> Self {
        RunId(shared_name(name.into()))
    }

    /// The run name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for RunId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The name of a node group inside a shape.
#[derive(
    Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(transparent)]
pub struct GroupId(Arc<String>);

impl GroupId {
    /// Wraps a group name. Validation of the characters happens in
    /// [`crate::shape::ClusterShape::validate`].
    pub fn new(name: impl Into<Arc<str>>) -> Self {
        GroupId(shared_name(name.into()))
    }

    /// The group name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether both share one name allocation (and so are equal), without
    /// reading the names.
    pub(crate) fn shares_name_with(&self, other: &GroupId) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl fmt::Display for GroupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A stable slot: `{group_id}-{index}`, index from 0.
///
/// Ordering is by group, then by numeric index, so `web-2` sorts before
/// `web-10` and iteration over a group visits its slots in index order.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct LogicalNodeId {
    group: GroupId,
    index: u32,
}

impl LogicalNodeId {
    /// Whether both ids name the same group. Ids the driver hands out share
    /// their group's name with the desired state, so a pointer comparison
    /// usually answers without reading the names.
    fn same_group(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.group.0, &other.group.0) || self.group.0 == other.group.0
    }
}

impl PartialEq for LogicalNodeId {
    fn eq(&self, other: &Self) -> bool {
        self.index == other.index && self.same_group(other)
    }
}

impl Eq for LogicalNodeId {}

impl std::hash::Hash for LogicalNodeId {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.group.hash(state);
        self.index.hash(state);
    }
}

impl PartialOrd for LogicalNodeId {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for LogicalNodeId {
    /// By group name, then by index (what a derived order would give); the
    /// names are compared only when the two ids do not share one.
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        if Arc::ptr_eq(&self.group.0, &other.group.0) {
            self.index.cmp(&other.index)
        } else {
            self.group
                .cmp(&other.group)
                .then(self.index.cmp(&other.index))
        }
    }
}

impl LogicalNodeId {
    /// The slot `index` of `group`.
    pub fn new(group: GroupId, index: u32) -> Self {
        LogicalNodeId { group, index }
    }

    /// The group this slot belongs to.
    pub fn group(&self) -> &GroupId {
        &self.group
    }

    /// The index of the slot inside its group.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// Parses the `{group}-{index}` form produced by [`fmt::Display`].
    ///
    /// # Errors
    /// [`IdError::MalformedNodeId`] when the text has no `-{digits}` suffix or
    /// an empty group part.
    pub fn parse(text: &str) -> Result<Self, IdError> {
        let malformed = || IdError::MalformedNodeId(text.to_owned());
        let (group, index) = text.rsplit_once('-').ok_or_else(malformed)?;
        if group.is_empty() || index.is_empty() || !index.bytes().all(|b| b.is_ascii_digit()) {
            return Err(malformed());
        }
        // A leading zero would give two spellings of one slot.
        if index.len() > 1 && index.starts_with('0') {
            return Err(malformed());
        }
        let index = index.parse::<u32>().map_err(|_| malformed())?;
        Ok(LogicalNodeId::new(GroupId::new(group), index))
    }
}

impl fmt::Display for LogicalNodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.group, self.index)
    }
}

/// One incarnation of a slot. Allocated from [`AttemptAllocator`], never reused.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(transparent)]
pub struct NodeAttemptId(u64);

impl NodeAttemptId {
    /// The raw counter value. Useful for provider keys and logs; there is no
    /// way back from a `u64` outside this crate except [`NodeAttemptId::from_raw`].
    pub fn get(self) -> u64 {
        self.0
    }

    /// Rebuilds an attempt id from its raw value, for example when a provider
    /// reads it back from a resource tag. The driver never allocates from this.
    pub fn from_raw(raw: u64) -> Self {
        NodeAttemptId(raw)
    }
}

impl fmt::Display for NodeAttemptId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a{}", self.0)
    }
}

/// A monotonic attempt counter, one per cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttemptAllocator {
    next: u64,
    limit: u64,
}

impl Default for AttemptAllocator {
    fn default() -> Self {
        AttemptAllocator::new()
    }
}

impl AttemptAllocator {
    /// An allocator whose first attempt is `1`.
    pub fn new() -> Self {
        AttemptAllocator {
            next: 1,
            limit: u64::MAX,
        }
    }

    /// An allocator that refuses to hand out attempt ids at or above `limit`.
    /// Tests use it to reach exhaustion without allocating `u64::MAX` times.
    pub fn with_limit(first: u64, limit: u64) -> Self {
        AttemptAllocator { next: first, limit }
    }

    /// The next id that would be allocated; every allocated id is below it.
    pub fn next_unallocated(&self) -> u64 {
        self.next
    }

    /// The exclusive upper bound of this allocator.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Peeks at the id [`allocate`](Self::allocate) would return.
    ///
    /// # Errors
    /// [`IdError::AttemptsExhausted`] when the counter reached its limit.
    pub fn peek(&self) -> Result<NodeAttemptId, IdError> {
        if self.next >= self.limit {
            Err(IdError::AttemptsExhausted)
        } else {
            Ok(NodeAttemptId(self.next))
        }
    }

    /// Hands out a fresh attempt id.
    ///
    /// # Errors
    /// [`IdError::AttemptsExhausted`] when the counter reached its limit; the
    /// allocator is unchanged.
    pub fn allocate(&mut self) -> Result<NodeAttemptId, IdError> {
        let id = self.peek()?;
        self.next += 1;
        Ok(id)
    }
}

/// The sequence number of an operation inside its attempt; starts at 1.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(transparent)]
pub struct OperationSequence(u32);

impl OperationSequence {
    /// The first sequence of every attempt.
    pub const FIRST: OperationSequence = OperationSequence(1);

    /// The raw value.
    pub fn get(self) -> u32 {
        self.0
    }

    /// Rebuilds a sequence from its raw value (for parsers and test kits).
    pub fn from_raw(raw: u32) -> Self {
        OperationSequence(raw)
    }

    /// The following sequence.
    ///
    /// # Errors
    /// [`IdError::SequenceExhausted`] when the counter would overflow.
    pub fn next(self) -> Result<OperationSequence, IdError> {
        self.0
            .checked_add(1)
            .map(OperationSequence)
            .ok_or(IdError::SequenceExhausted)
    }
}

/// Names one dispatched effect: `(attempt, sequence)`.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub struct OperationId {
    attempt: NodeAttemptId,
    sequence: OperationSequence,
}

impl OperationId {
    /// The operation `sequence` of `attempt`.
    pub fn new(attempt: NodeAttemptId, sequence: OperationSequence) -> Self {
        OperationId { attempt, sequence }
    }

    /// The attempt this operation belongs to.
    pub fn attempt(self) -> NodeAttemptId {
        self.attempt
    }

    /// The sequence inside the attempt.
    pub fn sequence(self) -> OperationSequence {
        self.sequence
    }
}

impl fmt::Display for OperationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/op{}", self.attempt, self.sequence.0)
    }
}

/// The revision of a desired shape.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(transparent)]
pub struct Generation(u64);

impl Generation {
    /// Wraps a revision number.
    pub fn new(value: u64) -> Self {
        Generation(value)
    }

    /// The raw value.
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for Generation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Errors of identity handling.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum IdError {
    /// The attempt counter reached its limit; no new attempt can be made.
    #[error("attempt ids are exhausted")]
    AttemptsExhausted,
    /// The operation counter of one attempt reached its limit.
    #[error("operation sequence numbers of an attempt are exhausted")]
    SequenceExhausted,
    /// A node id did not have the `{group}-{index}` form.
    #[error("malformed node id {0:?}: expected `{{group}}-{{index}}`")]
    MalformedNodeId(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_ids_sort_by_group_then_numeric_index() {
        let g = GroupId::new("web");
        let mut ids = [10, 2, 0].map(|i| LogicalNodeId::new(g.clone(), i));
        ids.sort();
        let shown: Vec<String> = ids.iter().map(ToString::to_string).collect();
        assert_eq!(shown, ["web-0", "web-2", "web-10"]);
    }

    #[test]
    fn node_id_parse_round_trips_and_rejects_malformed_text() {
        let id = LogicalNodeId::parse("gpu-pool-12").unwrap();
        assert_eq!(id.group().as_str(), "gpu-pool");
        assert_eq!(id.index(), 12);
        assert_eq!(id.to_string(), "gpu-pool-12");
        for bad in [
            "",
            "web",
            "-1",
            "web-",
            "web-x",
            "web-01",
            "web-99999999999",
        ] {
            assert!(
                LogicalNodeId::parse(bad).is_err(),
                "{bad:?} should be rejected"
            );
        }
    }

    #[test]
    fn attempt_allocator_is_monotonic_and_exhaustion_is_an_error() {
        let mut alloc = AttemptAllocator::with_limit(5, 7);
        assert_eq!(alloc.allocate().unwrap().get(), 5);
        assert_eq!(alloc.allocate().unwrap().get(), 6);
        assert_eq!(alloc.allocate(), Err(IdError::AttemptsExhausted));
        assert_eq!(
            alloc.next_unallocated(),
            7,
            "a failed allocation changes nothing"
        );
        let mut top = AttemptAllocator::with_limit(u64::MAX - 1, u64::MAX);
        assert!(top.allocate().is_ok());
        assert_eq!(top.allocate(), Err(IdError::AttemptsExhausted));
    }

    #[test]
    fn operation_sequence_exhaustion_is_an_error() {
        let last = OperationSequence::from_raw(u32::MAX);
        assert_eq!(last.next(), Err(IdError::SequenceExhausted));
        assert_eq!(OperationSequence::FIRST.next().unwrap().get(), 2);
    }
}
