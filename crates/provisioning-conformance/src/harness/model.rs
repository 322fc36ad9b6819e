//! The harness's model of the desired shape.

use std::collections::BTreeMap;
use std::sync::Arc;

use provisioning::shape::{BootParams, ProviderShape, SwarmJoinTemplate};
use provisioning::{ClusterShape, Generation, GroupId, NodeGroup, NodeTemplate, RunId};

use super::{PROVIDER_KIND, RUN_NAME};
use crate::trace::{DriftField, Group, ShapeChange};

/// The harness's own model of the desired shape: per group its size, where
/// its template comes from and the template's field versions. Shapes are
/// built from it, so the harness knows what the latest desired shape is
/// without asking the driver (G24).
///
/// Groups are kept in name order; trace inputs name the groups `a`, `b` and
/// `c` ([`Group`]), which are the groups of those names, whatever the initial
/// shape was.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct ShapeModel {
    run_id: RunId,
    groups: BTreeMap<GroupId, GroupModel>,
}

#[derive(Clone, Debug, PartialEq)]
struct GroupModel {
    count: u32,
    base: Base,
    versions: [u32; 4],
}

/// Where a group's template comes from.
#[derive(Clone, Debug, PartialEq)]
enum Base {
    /// The kit's template for the group's name ([`kit_template`]); a drift
    /// bumps the version inside the drifted field.
    Kit,
    /// A template the initial shape brought; a drift appends `~driftN` to
    /// the drifted field.
    Custom(Arc<NodeTemplate>),
}

const FIRST_VERSIONS: [u32; 4] = [1; 4];

impl ShapeModel {
    /// The kit's initial shape: group `a` with two nodes, run [`RUN_NAME`].
    pub(super) fn initial() -> Self {
        ShapeModel {
            run_id: RunId::new(RUN_NAME),
            groups: BTreeMap::from([(
                GroupId::new(Group::A.name()),
                GroupModel {
                    count: 2,
                    base: Base::Kit,
                    versions: FIRST_VERSIONS,
                },
            )]),
        }
    }

    /// The model of `shape` (whose generation is ignored). A group whose
    /// template is the kit's template for its name is modelled as a kit
    /// group, so a shape built from [`kit_template`]s drifts exactly as the
    /// kit's own initial shape does.
    pub(super) fn from_shape(shape: &ClusterShape) -> Self {
        let groups = shape
            .groups
            .iter()
            .map(|group| {
                let base = if group.template == kit_template(group.id.as_str(), FIRST_VERSIONS) {
                    Base::Kit
                } else {
                    Base::Custom(Arc::new(group.template.clone()))
                };
                (
                    group.id.clone(),
                    GroupModel {
                        count: group.count,
                        base,
                        versions: FIRST_VERSIONS,
                    },
                )
            })
            .collect();
        ShapeModel {
            run_id: shape.run_id.clone(),
            groups,
        }
    }

    /// The run every shape of the model is for.
    pub(super) fn run_id(&self) -> &RunId {
        &self.run_id
    }

    pub(super) fn apply(&mut self, change: ShapeChange) -> bool {
        match change {
            ShapeChange::Scale { group, count } => match self.groups.get_mut(&id_of(group)) {
                Some(model) if model.count != count => {
                    model.count = count;
                    true
                }
                _ => false,
            },
            ShapeChange::Drift { group, field } => match self.groups.get_mut(&id_of(group)) {
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
                let id = id_of(group);
                if self.groups.contains_key(&id) {
                    return false;
                }
                self.groups.insert(
                    id,
                    GroupModel {
                        count,
                        base: Base::Kit,
                        versions: FIRST_VERSIONS,
                    },
                );
                true
            }
            ShapeChange::Remove { group } => self.groups.remove(&id_of(group)).is_some(),
        }
    }

    pub(super) fn shape(&self, generation: u64) -> ClusterShape {
        let groups = self
            .groups
            .iter()
            .map(|(id, model)| NodeGroup {
                id: id.clone(),
                run_id: self.run_id.clone(),
                count: model.count,
                template: match &model.base {
                    Base::Kit => kit_template(id.as_str(), model.versions),
                    Base::Custom(template) => drifted(template, model.versions),
                },
            })
            .collect();
        ClusterShape {
            run_id: self.run_id.clone(),
            generation: Generation::new(generation),
            groups,
        }
    }

    /// The desired slots and templates of the model: the kit's own answer
    /// to "which slots are desired", for the oracle.
    pub(super) fn slots(&self) -> crate::oracle::DesiredSlots {
        crate::oracle::DesiredSlots::new(self.groups.iter().map(|(id, model)| {
            let template = match &model.base {
                Base::Kit => kit_template(id.as_str(), model.versions),
                Base::Custom(template) => drifted(template, model.versions),
            };
            (id.clone(), model.count, template)
        }))
    }

    /// A different shape, for the "silent change" revision probe.
    pub(super) fn altered(&self) -> ShapeModel {
        let mut altered = self.clone();
        let change = match self.groups.get(&id_of(Group::A)) {
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

fn id_of(group: Group) -> GroupId {
    GroupId::new(group.name())
}

/// The kit's template for group `name` at the given field versions
/// (image, boot, role, swarm).
pub(super) fn kit_template(name: &str, versions: [u32; 4]) -> NodeTemplate {
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
            on_peers_change: String::new(),
            start_command: format!("start-v{boot}"),
            ..BootParams::default()
        },
        swarm_join: SwarmJoinTemplate {
            swarm: format!("swarm-v{swarm}"),
            labels: BTreeMap::new(),
        },
    }
}

/// `base` with every field whose version is past the first marked as
/// drifted that many times.
fn drifted(base: &NodeTemplate, versions: [u32; 4]) -> NodeTemplate {
    let mark = |field: &mut String, version: u32| {
        if version > 1 {
            field.push_str(&format!("~drift{}", version - 1));
        }
    };
    let [image, boot, role, swarm] = versions;
    let mut template = base.clone();
    mark(&mut template.shape.image, image);
    mark(&mut template.boot.start_command, boot);
    mark(&mut template.role, role);
    mark(&mut template.swarm_join.swarm, swarm);
    template
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_initial_model_is_the_model_of_its_own_shape() {
        let initial = ShapeModel::initial();
        assert_eq!(ShapeModel::from_shape(&initial.shape(1)), initial);
    }

    #[test]
    fn a_custom_template_drifts_by_marking_the_field() {
        let mut template = kit_template("web", FIRST_VERSIONS);
        template.role = "frontend".to_owned();
        let shape = ClusterShape {
            run_id: RunId::new("r"),
            generation: Generation::new(1),
            groups: vec![NodeGroup {
                id: GroupId::new("a"),
                run_id: RunId::new("r"),
                count: 1,
                template,
            }],
        };
        let mut model = ShapeModel::from_shape(&shape);
        assert!(model.apply(ShapeChange::Drift {
            group: Group::A,
            field: DriftField::Role,
        }));
        let drifted = model.shape(2);
        assert_eq!(drifted.groups[0].template.role, "frontend~drift1");
        assert_eq!(drifted.groups[0].template.shape.image, "image-web:1");
        assert!(!model.apply(ShapeChange::Scale {
            group: Group::B,
            count: 1,
        }));
    }
}
