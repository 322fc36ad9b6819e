//! The conformance kit's [`ContractFaults`] for [`ExecPlugin`]: the seam
//! contract suite's faults and losses sent to the program through the
//! protocol's optional test hooks (`inject_fault`, `lose_node`). Built only
//! with the `kit` feature, so that running a provider program does not link
//! the kit.

use provisioning::spawn::BoxFuture;
use provisioning_conformance::contract::{ContractFaults, PluginMethod};
use provisioning_conformance::trace::Fault;
use provisioning_provider::AttemptKey;
use serde_json::{Value, json};

use crate::wire::LoseResult;
use crate::{Arm, ExecPlugin, Reply};

/// The protocol's name of a fault the contract suite asks for.
fn fault_name(fault: Fault) -> Option<&'static str> {
    match fault {
        Fault::Definite => Some("definite"),
        Fault::AmbiguousDone => Some("ambiguous_done"),
        Fault::AmbiguousUndone => Some("ambiguous_undone"),
        _ => None,
    }
}

impl ContractFaults for ExecPlugin {
    /// Sends `inject_fault` when the running program offered that fault in
    /// its handshake. The request is queued before any later call, and the
    /// program arms it before reading on, so it applies to the next call.
    fn inject(&self, method: PluginMethod, fault: Fault) -> bool {
        let Some(fault) = fault_name(fault) else {
            return false;
        };
        let Some(connection) = self.inner.live() else {
            return false;
        };
        let offered = connection
            .hello
            .faults
            .iter()
            .any(|offer| offer.method == method.name() && offer.fault == fault);
        if !offered {
            return false;
        }
        // The reply is not awaited (this hook is synchronous); a refusal
        // shows in the log when a runtime is there to watch for it.
        let Some((_, reply)) = connection.send(
            "inject_fault",
            None,
            json!({"method": method.name(), "fault": fault}),
        ) else {
            return false;
        };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let name = self.inner.name.clone();
            let what = format!("{fault} for {method}");
            runtime.spawn(async move {
                let armed = match reply.await {
                    Ok(Reply::Answer(Ok(value))) => value.get("armed").and_then(Value::as_bool),
                    _ => None,
                };
                if armed != Some(true) {
                    tracing::warn!(program = %name, "inject_fault {what} was not armed");
                }
            });
        }
        true
    }

    fn lose_node<'a>(&'a self, key: &'a AttemptKey) -> BoxFuture<'a, bool> {
        Box::pin(async move {
            let offered = self.inner.live().is_some_and(|c| c.hello.lose_node);
            if !offered {
                return false;
            }
            match self
                .inner
                .call_as::<LoseResult>("lose_node", Some(key), json!({}), Arm::NONE)
                .await
            {
                Ok(result) => result.lost,
                Err(error) => {
                    tracing::warn!(program = %self.inner.name, "lose_node of {key} failed: {error}");
                    false
                }
            }
        })
    }
}
