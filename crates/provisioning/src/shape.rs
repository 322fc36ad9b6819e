//! Desired state: the cluster shape a user declares, its validation, and its
//! expansion into one [`LogicalNodeSpec`] per slot.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use thiserror::Error;

use crate::id::{Generation, GroupId, LogicalNodeId, RunId};

/// The most slots a validated shape may expand to. A bound on every
/// collection the driver builds from a shape.
pub const MAX_NODES: u64 = 1 << 22;

/// The longest run or group name accepted.
pub const MAX_NAME_LEN: usize = 63;

/// A declared cluster: which node groups exist and how many nodes each has.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ClusterShape {
    /// The run this shape belongs to; fixed for a driver's lifetime.
    pub run_id: RunId,
    /// The revision; must strictly increase whenever content changes.
    pub generation: Generation,
    /// The node groups, each expanded to `count` slots.
    pub groups: Vec<NodeGroup>,
}

/// One group of identical nodes.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct NodeGroup {
    /// The group name; slots are named `{id}-{index}`.
    pub id: GroupId,
    /// The run the group was declared for; must equal the shape's run.
    pub run_id: RunId,
    /// How many slots the group has.
    pub count: u32,
    /// The template every node of the group is created from.
    pub template: NodeTemplate,
}

/// Everything that defines one node of a group. Any difference between a
/// node's template and the desired one means the node's attempt is replaced.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct NodeTemplate {
    /// The role the node plays in the run (for example `trainer`).
    pub role: String,
    /// Which provider creates the node (for example `process`).
    pub provider: String,
    /// The provider-facing description of the machine.
    pub shape: ProviderShape,
    /// How the node is booted once it is reachable.
    pub boot: BootParams,
    /// How the node's agent joins the run's swarm.
    pub swarm_join: SwarmJoinTemplate,
}

/// The provider-facing description of a machine.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ProviderShape {
    /// The image or binary the provider boots.
    pub image: String,
    /// Named quantities (`cpu`, `memory_gib`, …); finite and non-negative.
    pub resources: BTreeMap<String, f64>,
    /// Free-form labels passed to the provider.
    pub labels: BTreeMap<String, String>,
}

/// Boot parameters applied by the bootstrap session.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BootParams {
    /// The user the workload runs as, where the provider supports it.
    pub user: String,
    /// Commands that must succeed before the workload starts (boot checks).
    pub verify_commands: Vec<String>,
    /// The workload's command; empty means the agent alone is the workload.
    pub start_command: String,
    /// Environment given to verify and start commands.
    pub env: BTreeMap<String, String>,
    /// Extra arguments passed to the agent.
    pub args: Vec<String>,
    /// A command the agent runs after each rewrite of the node's peers
    /// file (design §22), with the workload's environment; empty means none.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub on_peers_change: String,
}

/// How an agent joins the run's swarm.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SwarmJoinTemplate {
    /// The swarm (within the run) the agent joins.
    pub swarm: String,
    /// Labels the agent announces when it joins.
    pub labels: BTreeMap<String, String>,
}

/// The desired spec of one slot: its id, its run and its group's template.
///
/// Cloning is cheap: the template is shared by every slot of the group.
///
/// The run and the template come first (`repr(C)`): a full pass compares
/// them, and a node keeps its spec next to what else the pass reads.
#[derive(Clone, Debug)]
#[repr(C)]
pub struct LogicalNodeSpec {
    run_id: RunId,
    template: Arc<NodeTemplate>,
    id: LogicalNodeId,
}

impl LogicalNodeSpec {
    /// Builds the spec of slot `id` from a shared template.
    pub fn new(id: LogicalNodeId, run_id: RunId, template: Arc<NodeTemplate>) -> Self {
        LogicalNodeSpec {
            id,
            run_id,
            template,
        }
    }

    /// The slot.
    pub fn id(&self) -> &LogicalNodeId {
        &self.id
    }

    /// The run.
    pub fn run_id(&self) -> &RunId {
        &self.run_id
    }

    /// The template shared with the other slots of the group.
    pub fn template(&self) -> &NodeTemplate {
        &self.template
    }

    /// The shared template handle.
    pub fn shared_template(&self) -> &Arc<NodeTemplate> {
        &self.template
    }
}

impl PartialEq for LogicalNodeSpec {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
            && self.run_id == other.run_id
            && (Arc::ptr_eq(&self.template, &other.template) || self.template == other.template)
    }
}

/// A shape rejected by validation. Each variant names the group and field.
#[derive(Clone, Debug, PartialEq, Error)]
pub enum ShapeError {
    /// The run name is empty, too long or has characters outside `[A-Za-z0-9_.-]`.
    #[error("invalid run id {run:?}: {reason}")]
    InvalidRunId {
        /// The rejected run name.
        run: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A group name is empty, too long or has characters outside `[A-Za-z0-9_.-]`.
    #[error("invalid group id {group:?}: {reason}")]
    InvalidGroupId {
        /// The rejected group name.
        group: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A group was declared for another run than the shape's.
    #[error(
        "group \"{group}\" belongs to run \"{group_run}\", but the shape is for run \"{shape_run}\""
    )]
    RunMismatch {
        /// The group.
        group: GroupId,
        /// The run named by the group.
        group_run: RunId,
        /// The run named by the shape.
        shape_run: RunId,
    },
    /// Two groups share one id. Because slot ids are `(group, index)` pairs,
    /// this is also the only way two slots could share an id.
    #[error("group \"{group}\" is declared more than once")]
    DuplicateGroup {
        /// The repeated group id.
        group: GroupId,
    },
    /// A number is NaN or infinite.
    #[error("group \"{group}\": field `{field}` is not a finite number ({value})")]
    NonFiniteValue {
        /// The group.
        group: GroupId,
        /// The field path, for example `shape.resources.cpu`.
        field: String,
        /// The rejected value.
        value: f64,
    },
    /// A quantity is negative.
    #[error("group \"{group}\": field `{field}` is negative ({value})")]
    NegativeValue {
        /// The group.
        group: GroupId,
        /// The field path.
        field: String,
        /// The rejected value.
        value: f64,
    },
    /// A field that must name something is empty.
    #[error("group \"{group}\": field `{field}` must not be empty")]
    EmptyField {
        /// The group.
        group: GroupId,
        /// The field path.
        field: &'static str,
    },
    /// The shape expands to more slots than [`MAX_NODES`].
    #[error("the shape declares {total} nodes; at most {limit} are supported")]
    TooManyNodes {
        /// The declared total.
        total: u64,
        /// The supported maximum.
        limit: u64,
    },
}

fn check_name(name: &str) -> Result<(), &'static str> {
    if name.is_empty() {
        return Err("must not be empty");
    }
    if name.len() > MAX_NAME_LEN {
        return Err("longer than 63 characters");
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
    {
        return Err("only ASCII letters, digits, '_', '.' and '-' are allowed");
    }
    if name.starts_with('-') || name.starts_with('.') {
        return Err("must start with a letter, digit or '_'");
    }
    Ok(())
}

impl ClusterShape {
    /// An empty shape (no groups) for `run_id` at `generation`.
    pub fn empty(run_id: RunId, generation: Generation) -> Self {
        ClusterShape {
            run_id,
            generation,
            groups: Vec::new(),
        }
    }

    /// Checks the shape and expands it into its slots.
    ///
    /// # Errors
    /// The first [`ShapeError`] found, in group order.
    pub fn validate(&self) -> Result<DesiredState, ShapeError> {
        check_name(self.run_id.as_str()).map_err(|reason| ShapeError::InvalidRunId {
            run: self.run_id.as_str().to_owned(),
            reason,
        })?;
        let mut groups = BTreeMap::new();
        let mut total: u64 = 0;
        for group in &self.groups {
            validate_group(self, group)?;
            if groups.contains_key(&group.id) {
                return Err(ShapeError::DuplicateGroup {
                    group: group.id.clone(),
                });
            }
            total += u64::from(group.count);
            if total > MAX_NODES {
                return Err(ShapeError::TooManyNodes {
                    total,
                    limit: MAX_NODES,
                });
            }
            groups.insert(
                group.id.clone(),
                DesiredGroup {
                    count: group.count,
                    template: Arc::new(group.template.clone()),
                },
            );
        }
        Ok(DesiredState {
            shape: self.clone(),
            groups,
            node_count: total,
        })
    }
}

fn validate_group(shape: &ClusterShape, group: &NodeGroup) -> Result<(), ShapeError> {
    check_name(group.id.as_str()).map_err(|reason| ShapeError::InvalidGroupId {
        group: group.id.as_str().to_owned(),
        reason,
    })?;
    if group.run_id != shape.run_id {
        return Err(ShapeError::RunMismatch {
            group: group.id.clone(),
            group_run: group.run_id.clone(),
            shape_run: shape.run_id.clone(),
        });
    }
    if group.template.provider.is_empty() {
        return Err(ShapeError::EmptyField {
            group: group.id.clone(),
            field: "provider",
        });
    }
    for (name, value) in &group.template.shape.resources {
        let field = || format!("shape.resources.{name}");
        if !value.is_finite() {
            return Err(ShapeError::NonFiniteValue {
                group: group.id.clone(),
                field: field(),
                value: *value,
            });
        }
        if *value < 0.0 {
            return Err(ShapeError::NegativeValue {
                group: group.id.clone(),
                field: field(),
                value: *value,
            });
        }
    }
    Ok(())
}

/// One group of a validated shape.
#[derive(Clone, Debug, PartialEq)]
pub struct DesiredGroup {
    count: u32,
    template: Arc<NodeTemplate>,
}

impl DesiredGroup {
    /// How many slots the group has.
    pub fn count(&self) -> u32 {
        self.count
    }

    /// The shared template.
    pub fn template(&self) -> &Arc<NodeTemplate> {
        &self.template
    }
}

/// A validated shape with its slots indexed by group.
///
/// Slots are not materialised one by one: [`DesiredState::spec`] builds the
/// spec of a slot on demand from its group's shared template.
#[derive(Clone, Debug, PartialEq)]
pub struct DesiredState {
    shape: ClusterShape,
    groups: BTreeMap<GroupId, DesiredGroup>,
    node_count: u64,
}

impl DesiredState {
    /// The shape this state was validated from.
    pub fn shape(&self) -> &ClusterShape {
        &self.shape
    }

    /// The run.
    pub fn run_id(&self) -> &RunId {
        &self.shape.run_id
    }

    /// The generation.
    pub fn generation(&self) -> Generation {
        self.shape.generation
    }

    /// The groups, by id.
    pub fn groups(&self) -> &BTreeMap<GroupId, DesiredGroup> {
        &self.groups
    }

    /// The number of desired slots.
    pub fn node_count(&self) -> u64 {
        self.node_count
    }

    /// Whether `node` is a desired slot.
    pub fn contains(&self, node: &LogicalNodeId) -> bool {
        self.groups
            .get(node.group())
            .is_some_and(|g| node.index() < g.count)
    }

    /// The desired spec of `node`, or `None` when the slot is not desired.
    pub fn spec(&self, node: &LogicalNodeId) -> Option<LogicalNodeSpec> {
        let group = self.groups.get(node.group())?;
        (node.index() < group.count).then(|| {
            LogicalNodeSpec::new(
                node.clone(),
                self.shape.run_id.clone(),
                group.template.clone(),
            )
        })
    }

    /// Every desired slot with its spec, in slot order.
    pub fn specs(&self) -> impl Iterator<Item = LogicalNodeSpec> + '_ {
        self.groups.iter().flat_map(move |(id, group)| {
            (0..group.count).map(move |index| {
                LogicalNodeSpec::new(
                    LogicalNodeId::new(id.clone(), index),
                    self.shape.run_id.clone(),
                    group.template.clone(),
                )
            })
        })
    }

    /// Whether `spec` is the desired spec of its slot (what comparing it with
    /// [`DesiredState::spec`] answers, without building that spec).
    pub fn is_desired_spec(&self, spec: &LogicalNodeSpec) -> bool {
        let Some(group) = self.groups.get(spec.id().group()) else {
            return false;
        };
        spec.id().index() < group.count
            && *spec.run_id() == self.shape.run_id
            && (Arc::ptr_eq(&group.template, spec.shared_template())
                || *group.template == *spec.template())
    }

    /// Reuses `previous`'s shared template of every group whose template did
    /// not change, so that nodes created from it keep comparing by pointer,
    /// and `previous`'s group names, so that node ids of a group keep
    /// comparing by pointer too.
    pub fn share_templates_with(&mut self, previous: &DesiredState) {
        let groups = std::mem::take(&mut self.groups);
        self.groups = groups
            .into_iter()
            .map(|(id, mut group)| match previous.groups.get_key_value(&id) {
                Some((old_id, old)) => {
                    if !Arc::ptr_eq(&old.template, &group.template)
                        && old.template == group.template
                    {
                        group.template = old.template.clone();
                    }
                    (old_id.clone(), group)
                }
                None => (id, group),
            })
            .collect();
    }

    /// The groups whose count or template differ between `self` and `other`,
    /// including groups present in only one of them.
    pub fn changed_groups(&self, other: &DesiredState) -> BTreeSet<GroupId> {
        let mut changed = BTreeSet::new();
        for (id, group) in &self.groups {
            if other.groups.get(id) != Some(group) {
                changed.insert(id.clone());
            }
        }
        for id in other.groups.keys() {
            if !self.groups.contains_key(id) {
                changed.insert(id.clone());
            }
        }
        changed
    }
}

/// A worker template of `image` on a provider named `fake`, for the crate's
/// unit tests.
#[cfg(test)]
pub(crate) fn test_template(image: &str) -> NodeTemplate {
    NodeTemplate {
        role: "worker".into(),
        provider: "fake".into(),
        shape: ProviderShape {
            image: image.into(),
            ..ProviderShape::default()
        },
        boot: BootParams::default(),
        swarm_join: SwarmJoinTemplate::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template() -> NodeTemplate {
        NodeTemplate {
            role: "worker".into(),
            provider: "fake".into(),
            shape: ProviderShape {
                image: "img:1".into(),
                resources: BTreeMap::from([("cpu".into(), 2.0)]),
                labels: BTreeMap::new(),
            },
            boot: BootParams::default(),
            swarm_join: SwarmJoinTemplate::default(),
        }
    }

    fn group(id: &str, count: u32) -> NodeGroup {
        NodeGroup {
            id: GroupId::new(id),
            run_id: RunId::new("run"),
            count,
            template: template(),
        }
    }

    fn shape(groups: Vec<NodeGroup>) -> ClusterShape {
        ClusterShape {
            run_id: RunId::new("run"),
            generation: Generation::new(1),
            groups,
        }
    }

    fn check_rejected(groups: Vec<NodeGroup>, expected: &str) {
        let err = shape(groups).validate().unwrap_err();
        assert_eq!(err.to_string(), expected);
    }

    #[test]
    fn expansion_names_slots_group_dash_index() {
        let desired = shape(vec![group("a", 2), group("b", 1)])
            .validate()
            .unwrap();
        let names: Vec<String> = desired.specs().map(|s| s.id().to_string()).collect();
        assert_eq!(names, ["a-0", "a-1", "b-0"]);
        assert_eq!(desired.node_count(), 3);
        assert!(desired.contains(&LogicalNodeId::new(GroupId::new("a"), 1)));
        assert!(!desired.contains(&LogicalNodeId::new(GroupId::new("a"), 2)));
    }

    #[test]
    fn validation_rejects_a_group_of_another_run() {
        let mut g = group("a", 1);
        g.run_id = RunId::new("other");
        check_rejected(
            vec![g],
            "group \"a\" belongs to run \"other\", but the shape is for run \"run\"",
        );
    }

    #[test]
    fn validation_rejects_duplicate_groups() {
        check_rejected(
            vec![group("a", 1), group("a", 2)],
            "group \"a\" is declared more than once",
        );
    }

    #[test]
    fn validation_rejects_non_finite_and_negative_resources_naming_the_field() {
        let mut g = group("a", 1);
        g.template.shape.resources.insert("mem".into(), f64::NAN);
        check_rejected(
            vec![g],
            "group \"a\": field `shape.resources.mem` is not a finite number (NaN)",
        );
        let mut g = group("b", 1);
        g.template
            .shape
            .resources
            .insert("cpu".into(), f64::INFINITY);
        assert!(matches!(
            shape(vec![g]).validate(),
            Err(ShapeError::NonFiniteValue { .. })
        ));
        let mut g = group("c", 1);
        g.template.shape.resources.insert("cpu".into(), -1.0);
        assert!(matches!(
            shape(vec![g]).validate(),
            Err(ShapeError::NegativeValue { .. })
        ));
    }

    #[test]
    fn validation_rejects_bad_names_empty_provider_and_oversized_shapes() {
        assert!(matches!(
            shape(vec![group("", 1)]).validate(),
            Err(ShapeError::InvalidGroupId { .. })
        ));
        assert!(matches!(
            shape(vec![group("a b", 1)]).validate(),
            Err(ShapeError::InvalidGroupId { .. })
        ));
        let mut s = shape(vec![]);
        s.run_id = RunId::new("bad/run");
        assert!(matches!(s.validate(), Err(ShapeError::InvalidRunId { .. })));
        let mut g = group("a", 1);
        g.template.provider.clear();
        assert!(matches!(
            shape(vec![g]).validate(),
            Err(ShapeError::EmptyField {
                field: "provider",
                ..
            })
        ));
        let big = vec![group("a", u32::MAX), group("b", u32::MAX)];
        assert!(matches!(
            shape(big).validate(),
            Err(ShapeError::TooManyNodes { .. })
        ));
    }

    #[test]
    fn changed_groups_lists_added_removed_and_modified_groups() {
        let before = shape(vec![group("a", 1), group("b", 1), group("c", 1)])
            .validate()
            .unwrap();
        let mut drifted = group("b", 1);
        drifted.template.shape.image = "img:2".into();
        let after = shape(vec![group("a", 1), drifted, group("d", 1)])
            .validate()
            .unwrap();
        let changed: Vec<String> = before
            .changed_groups(&after)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(changed, ["b", "c", "d"]);
    }

    #[test]
    fn specs_compare_by_content_not_by_pointer() {
        let one = shape(vec![group("a", 1)]).validate().unwrap();
        let two = shape(vec![group("a", 1)]).validate().unwrap();
        let id = LogicalNodeId::new(GroupId::new("a"), 0);
        assert_eq!(one.spec(&id), two.spec(&id));
        let mut g = group("a", 1);
        g.template.boot.start_command = "run".into();
        let three = shape(vec![g]).validate().unwrap();
        assert_ne!(one.spec(&id), three.spec(&id));
    }
}
