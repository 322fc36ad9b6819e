//! How the loop answers a [`HostHandle`](super::HostHandle)'s commands:
//! applying a shape or a revision (unknown provider kinds are refused before
//! the driver sees them), status, plans, limits and closing a breaker.

use provisioning::{ClusterShape, DesiredUpdate, DriverError, Generation, NodeGroup, RunId};

use super::error::HostError;
use super::handle::{AppliedRevision, Command};
use super::run_loop::HostLoop;
use crate::plan::{PlanReport, plan_against};
use crate::status::HostPhase;

impl HostLoop {
    pub(super) fn handle(&mut self, command: Command) {
        match command {
            Command::Apply { shape, reply } => {
                let outcome = self.apply(shape);
                let _ = reply.send(outcome);
            }
            Command::ApplyRevision {
                run_id,
                groups,
                reply,
            } => {
                let outcome = self.apply_revision(run_id, groups);
                let _ = reply.send(outcome);
            }
            Command::Status { reply } => {
                let _ = reply.send(self.fresh_snapshot());
            }
            Command::Plan {
                run_id,
                groups,
                reply,
            } => {
                let _ = reply.send(self.plan(run_id, groups));
            }
            Command::SetLimits { limits, reply } => {
                if *self.driver.limits() != limits {
                    tracing::info!("limits changed: {limits:?}");
                    self.driver.set_limits(limits);
                }
                let _ = reply.send(());
            }
            Command::Resume { group, reply } => {
                let outcome = if self.driver.desired().groups().contains_key(&group) {
                    let was_open = self.driver.reset_breaker(&group);
                    tracing::info!(%group, was_open, "breaker closed by hand");
                    Ok(was_open)
                } else {
                    Err(HostError::UnknownGroup(group.to_string()))
                };
                let _ = reply.send(outcome);
            }
        }
    }

    fn check_providers(&self, groups: &[NodeGroup]) -> Result<(), HostError> {
        for group in groups {
            let provider = &group.template.provider;
            if !self.kinds.contains(provider) {
                return Err(HostError::UnknownProvider {
                    group: group.id.to_string(),
                    provider: provider.clone(),
                    available: self.kinds.iter().cloned().collect::<Vec<_>>().join(", "),
                });
            }
        }
        Ok(())
    }

    fn apply(&mut self, shape: ClusterShape) -> Result<DesiredUpdate, HostError> {
        if self.phase != HostPhase::Running {
            return Err(HostError::ShuttingDown);
        }
        self.check_providers(&shape.groups)?;
        let generation = shape.generation;
        let update = self.driver.update_desired(shape)?;
        if update == DesiredUpdate::Accepted {
            tracing::info!(generation = generation.get(), "desired shape accepted");
        }
        Ok(update)
    }

    fn next_shape(&self, run_id: RunId, groups: Vec<NodeGroup>) -> Result<ClusterShape, HostError> {
        let current = self.driver.desired().shape();
        let generation = if groups == current.groups {
            current.generation
        } else {
            let next = current
                .generation
                .get()
                .checked_add(1)
                .ok_or(HostError::GenerationExhausted(current.generation))?;
            Generation::new(next)
        };
        Ok(ClusterShape {
            run_id,
            generation,
            groups,
        })
    }

    fn apply_revision(
        &mut self,
        run_id: RunId,
        groups: Vec<NodeGroup>,
    ) -> Result<AppliedRevision, HostError> {
        let shape = self.next_shape(run_id, groups)?;
        let generation = shape.generation;
        Ok(match self.apply(shape)? {
            DesiredUpdate::Unchanged => AppliedRevision::Unchanged { generation },
            DesiredUpdate::Accepted => AppliedRevision::Applied { generation },
        })
    }

    fn plan(&self, run_id: RunId, groups: Vec<NodeGroup>) -> Result<PlanReport, HostError> {
        self.check_providers(&groups)?;
        if &run_id != self.driver.run_id() {
            return Err(DriverError::RunChanged {
                expected: self.driver.run_id().clone(),
                got: run_id,
            }
            .into());
        }
        let desired = self.next_shape(run_id, groups)?.validate()?;
        Ok(plan_against(self.driver.state(), &desired, self.now()))
    }
}
