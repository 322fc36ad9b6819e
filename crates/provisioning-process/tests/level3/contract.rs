//! The seam contract suite's fault hook for the process plugin, with every
//! fault a real event.
//!
//! The suite arms a fault for the next call of a method; [`FaultHook`]
//! (intercepting the real [`ProcessPlugin`]; the other methods pass
//! straight through) makes it happen around that call:
//!
//! | Armed fault | Method | What really happens |
//! |---|---|---|
//! | `definite` | `create_node` | the agent program is renamed away for the call: the spawn fails with `ENOENT` (or a live node is adopted) |
//! | `ambiguous-undone` | `create_node`, `destroy_node` | the caller's deadline passes once the call reached the operating system: the spawn request or the `SIGTERM` is out (the work may even be done), the reply is never read |
//! | loss | — | every process of the node is killed with `SIGKILL` |
//!
//! A definite destroy failure and a lost reply after finished work are no
//! events the operating system can produce here; the hook says so and the
//! suite checks what it can.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::Poll;
use std::time::Duration;

use provisioning::spawn::BoxFuture;
use provisioning::{LeaseHandle, LogicalNodeSpec, RunId};
use provisioning_conformance::contract::{ContractFaults, ContractSubject, PluginMethod};
use provisioning_conformance::level3::{Intercept, Intercepted, PluginCall};
use provisioning_conformance::trace::Fault;
use provisioning_process::{AgentCommand, ProcessPlugin, ProcessPluginConfig};
use provisioning_provider::{AttemptKey, NodeLease, PluginError, ProvisionPlugin};

use super::Level3;
use super::os_faults::{self, AgentProgram};
use super::substrate::STOP_GRACE;

/// The name of the symlink the contract's plugins start agents through.
const CONTRACT_AGENT_NAME: &str = "l3-agent";

/// How often a loss waits for the plugin to notice the dead node.
const LOSS_POLL_INTERVAL: Duration = Duration::from_millis(5);

/// The most times it looks.
const LOSS_POLLS_MAX: usize = 1_000;

/// How long the suite pauses between endpoint polls.
fn pause(duration: Duration) -> BoxFuture<'static, ()> {
    Box::pin(tokio::time::sleep(duration))
}

/// The faults armed for the next calls, and the means to produce them.
pub(crate) struct ProcessFaults {
    run: RunId,
    plugin: Arc<ProcessPlugin>,
    program: AgentProgram,
    armed: Mutex<BTreeMap<PluginMethod, Fault>>,
    /// Holds the agent program's symlink.
    _dir: tempfile::TempDir,
}

impl ProcessFaults {
    fn take(&self, method: PluginMethod) -> Option<Fault> {
        self.armed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&method)
    }
}

impl ContractFaults for ProcessFaults {
    fn inject(&self, method: PluginMethod, fault: Fault) -> bool {
        let producible = matches!(
            (method, fault),
            (
                PluginMethod::CreateNode,
                Fault::Definite | Fault::AmbiguousUndone
            ) | (PluginMethod::DestroyNode, Fault::AmbiguousUndone)
        );
        if producible {
            self.armed
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(method, fault);
        }
        producible
    }

    fn lose_node<'a>(&'a self, key: &'a AttemptKey) -> BoxFuture<'a, bool> {
        Box::pin(async move {
            let node = (key.node.clone(), key.attempt);
            if os_faults::kill_node(&self.run, &node) == 0 {
                return false;
            }
            // The plugin stops listing the node once it reaped its agent;
            // the loss is reported right then.
            for _ in 0..LOSS_POLLS_MAX {
                let listed = self.plugin.list_nodes(&self.run).await.unwrap_or_default();
                if !listed.iter().any(|n| n.key == *key) {
                    break;
                }
                tokio::time::sleep(LOSS_POLL_INTERVAL).await;
            }
            true
        })
    }
}

/// Polls `call` once — far enough for it to reach the operating system (the
/// spawn request, the `SIGTERM`) — and gives up on it right there, as a
/// caller whose deadline passes: whether the work happened or not, its
/// reply is never read.
async fn deadline_passes<T>(call: impl Future<Output = Result<T, PluginError>>) -> PluginError {
    let mut call = std::pin::pin!(call);
    let first = std::future::poll_fn(|cx| Poll::Ready(call.as_mut().poll(cx))).await;
    let stage = if first.is_ready() {
        "just as the call answered"
    } else {
        "while the call was in flight"
    };
    PluginError::ambiguous(format!("the caller's deadline passed {stage}"))
}

/// Makes armed faults happen around the calls of the real
/// [`ProcessPlugin`]; every other call passes straight through.
struct FaultHook {
    faults: Arc<ProcessFaults>,
}

impl Intercept for FaultHook {
    fn create_node<'a>(
        &'a self,
        inner: &'a dyn ProvisionPlugin,
        key: &'a AttemptKey,
        spec: &'a LogicalNodeSpec,
    ) -> PluginCall<'a, NodeLease> {
        match self.faults.take(PluginMethod::CreateNode) {
            Some(Fault::Definite) => Box::pin(async move {
                let _missing = self.faults.program.remove();
                inner.create_node(key, spec).await
            }),
            Some(Fault::AmbiguousUndone) => {
                Box::pin(async move { Err(deadline_passes(inner.create_node(key, spec)).await) })
            }
            _ => inner.create_node(key, spec),
        }
    }

    fn destroy_node<'a>(
        &'a self,
        inner: &'a dyn ProvisionPlugin,
        key: &'a AttemptKey,
        lease: &'a LeaseHandle,
    ) -> PluginCall<'a, ()> {
        match self.faults.take(PluginMethod::DestroyNode) {
            Some(Fault::AmbiguousUndone) => {
                Box::pin(async move { Err(deadline_passes(inner.destroy_node(key, lease)).await) })
            }
            _ => inner.destroy_node(key, lease),
        }
    }
}

/// A fresh process plugin for one contract, on a run of `context`, with its
/// fault hook. Must be called inside a tokio runtime.
///
/// # Errors
/// What went wrong starting it.
pub(crate) async fn contract_subject(context: &Level3) -> Result<ContractSubject, String> {
    let run = context.next_run();
    let dir = tempfile::tempdir().map_err(|e| format!("no temporary directory: {e}"))?;
    let program = AgentProgram::create(dir.path(), CONTRACT_AGENT_NAME, context.agent_binary())
        .map_err(|e| format!("cannot link the agent program: {e}"))?;
    let mut config = ProcessPluginConfig::new(run.clone(), AgentCommand::new(program.path(), []));
    config.stop_grace = STOP_GRACE;
    let plugin = ProcessPlugin::start(config)
        .await
        .map_err(|e| format!("the process plugin does not start: {e}"))?;
    let faults = Arc::new(ProcessFaults {
        run: run.clone(),
        plugin: plugin.clone(),
        program,
        armed: Mutex::new(BTreeMap::new()),
        _dir: dir,
    });
    let faulted = Intercepted::new(
        plugin,
        FaultHook {
            faults: faults.clone(),
        },
    );
    Ok(ContractSubject::new(Arc::new(faulted), run)
        .with_faults(faults)
        .with_pause(Arc::new(pause)))
}
