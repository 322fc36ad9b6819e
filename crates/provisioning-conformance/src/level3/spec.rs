//! What a real plugin is asked for: [`RealNode`] turns the kit's
//! operations — provider `fake`, boot commands that do not exist, the fixed
//! run `conformance` — into ones a real provider can serve: the substrate's
//! own run (so that concurrent runs never see each other's resources), the
//! provider's kind, the world's verify command with its environment, and a
//! long-running workload ([`WORKLOAD_COMMAND`]). The operation id, slot and
//! attempt are untouched.

use std::collections::BTreeMap;
use std::sync::Arc;

use provisioning::{BootParams, LogicalNodeSpec, NodeTemplate, Operation, ProviderShape, RunId};

/// The workload every Level 3 node runs once its boot passed.
pub const WORKLOAD_COMMAND: &str = "exec sleep 3600";

/// How one world's nodes are booted.
#[derive(Clone, Debug)]
pub struct RealNode<'a> {
    /// The substrate's own run.
    pub run: &'a RunId,
    /// The provider kind the plugin serves.
    pub provider: &'a str,
    /// The node's one verify command.
    pub verify_command: &'a str,
    /// The boot's environment (what the verify command reads).
    pub env: BTreeMap<String, String>,
    /// The shape, when the world replaces the kit's.
    pub shape: Option<ProviderShape>,
}

impl RealNode<'_> {
    /// `spec` as the plugin sees it.
    pub fn spec(self, spec: &LogicalNodeSpec) -> LogicalNodeSpec {
        let template = spec.template();
        let real = NodeTemplate {
            role: template.role.clone(),
            provider: self.provider.to_owned(),
            shape: self.shape.unwrap_or_else(|| template.shape.clone()),
            boot: BootParams {
                on_peers_change: String::new(),
                user: String::new(),
                verify_commands: vec![self.verify_command.to_owned()],
                start_command: WORKLOAD_COMMAND.to_owned(),
                env: self.env,
                args: Vec::new(),
            },
            swarm_join: template.swarm_join.clone(),
        };
        LogicalNodeSpec::new(spec.id().clone(), self.run.clone(), Arc::new(real))
    }

    /// `operation` as the plugin sees it: of the substrate's run, with its
    /// spec as [`RealNode::spec`] makes it.
    pub fn operation(self, operation: &Operation) -> Operation {
        Operation {
            id: operation.id,
            run_id: self.run.clone(),
            node: operation.node.clone(),
            request: operation.request.clone(),
            spec: self.spec(&operation.spec),
        }
    }
}
