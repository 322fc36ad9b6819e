//! The harness's model of the desired shape.

use std::collections::BTreeMap;

use provisioning::shape::{BootParams, ProviderShape, SwarmJoinTemplate};
use provisioning::{ClusterShape, Generation, GroupId, NodeGroup, NodeTemplate, RunId};

use super::{PROVIDER_KIND, RUN_NAME};
use crate::trace::{DriftField, Group, ShapeChange};

/// The harness's own model of the desired shape: group sizes and template
/// versions. Shapes are built from it, so the harness knows what the latest
/// desired shape is without asking the driver (G24).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct ShapeModel {
    groups: BTreeMap<Group, GroupModel>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct GroupModel {
    count: u32,
    versions: [u32; 4],
}

impl ShapeModel {
    pub(super) fn initial() -> Self {
        ShapeModel {
            groups: BTreeMap::from([(
                Group::A,
                GroupModel {
                    count: 2,
                    versions: [1; 4],
                },
            )]),
        }
    }

    pub(super) fn apply(&mut self, change: ShapeChange) -> bool {
        match change {
            ShapeChange::Scale { group, count } => match self.groups.get_mut(&group) {
                Some(model) if model.count != count => {
                    model.count = count;
                    true
                }
                _ => false,
            },
            ShapeChange::Drift { group, field } => match self.groups.get_mut(&group) {
                Some(model) => {
                    let index = DriftField::ALL
                        .iter()
                        .position(|f| *f == field)
                        .unwrap_or(0);
                    model.versions[index] += 1;
                    true
                }
                None => false,
            },
            ShapeChange::Add { group, count } => {
                if self.groups.contains_key(&group) {
                    return false;
                }
                self.groups.insert(
                    group,
                    GroupModel {
                        count,
                        versions: [1; 4],
                    },
                );
                true
            }
            ShapeChange::Remove { group } => self.groups.remove(&group).is_some(),
        }
    }

    pub(super) fn shape(&self, generation: u64) -> ClusterShape {
        let run_id = RunId::new(RUN_NAME);
        let groups = self
            .groups
            .iter()
            .map(|(group, model)| NodeGroup {
                id: GroupId::new(group.name()),
                run_id: run_id.clone(),
                count: model.count,
                template: template(*group, model.versions),
            })
            .collect();
        ClusterShape {
            run_id,
            generation: Generation::new(generation),
            groups,
        }
    }

    /// A different shape, for the "silent change" revision probe.
    pub(super) fn altered(&self) -> ShapeModel {
        let mut altered = self.clone();
        let change = match self.groups.get(&Group::A) {
            Some(model) => ShapeChange::Scale {
                group: Group::A,
                count: (model.count + 1) % 4,
            },
            None => ShapeChange::Add {
                group: Group::A,
                count: 1,
            },
        };
        altered.apply(change);
        altered
    }
}

fn template(group: Group, versions: [u32; 4]) -> NodeTemplate {
    let name = group.name();
    let [image, boot, role, swarm] = versions;
    NodeTemplate {
        role: format!("role-{name}-v{role}"),
        provider: PROVIDER_KIND.to_owned(),
        shape: ProviderShape {
            image: format!("image-{name}:{image}"),
            resources: BTreeMap::from([("cpu".to_owned(), 1.0)]),
            labels: BTreeMap::new(),
        },
        boot: BootParams {
            start_command: format!("start-v{boot}"),
            ..BootParams::default()
        },
        swarm_join: SwarmJoinTemplate {
            swarm: format!("swarm-v{swarm}"),
            labels: BTreeMap::new(),
        },
    }
}
