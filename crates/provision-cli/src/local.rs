//! The providers this build serves: the embedded local-process provider.
//!
//! This is the only module that knows about `provisioning-process`; the rest
//! of the CLI sees plugins as [`PluginEntry`] values.

use std::ffi::OsString;
use std::process::ExitCode;
use std::time::Duration;

use provisioning::{RetryPolicy, RunId};
use provisioning_agent::RunSecret;
use provisioning_process::{
    AgentCommand, AgentLifetime, ENDPOINT_PROBE_INTERVAL, ProcessPlugin, ProcessPluginConfig,
};

use crate::shape_file::{EXEC_PROVIDER, ExecSettings, ProcessSettings};
use provisioning_runtime::PluginEntry;

/// The provider kinds this build serves.
pub(crate) const PROVIDERS: &[&str] = &["process"];

/// How long a node's processes get between the polite stop signal and the kill.
pub(crate) const STOP_GRACE: Duration = Duration::from_secs(3);

/// The argument that makes this binary run as a node agent.
pub(crate) const AGENT_SUBCOMMAND: &str = "agent";

/// Starts the local-process plugin for `run_id`. Its node agents are this
/// same binary, run as `provision agent ...`.
///
/// # Errors
/// When the path of this binary is unknown or the plugin cannot start.
pub(crate) async fn start_plugins(
    run_id: &RunId,
    run_secret: RunSecret,
    settings: &ProcessSettings,
) -> anyhow::Result<Vec<PluginEntry>> {
    let lifetime = if settings.detached {
        AgentLifetime::Detached {
            log_dir: settings.log_dir.clone(),
        }
    } else {
        AgentLifetime::WithController
    };
    let program = std::env::current_exe()?;
    let config = ProcessPluginConfig {
        run_id: run_id.clone(),
        agent: AgentCommand {
            program,
            args: vec![OsString::from(AGENT_SUBCOMMAND)],
        },
        run_secret,
        stop_grace: STOP_GRACE,
        lifetime,
    };
    let plugin = ProcessPlugin::start(config).await?;
    tracing::info!(swarm = %plugin.swarm_address(), "local-process provider started");
    let for_shutdown = plugin.clone();
    Ok(vec![PluginEntry::new(plugin).with_shutdown(
        move || async move { for_shutdown.shutdown().await },
    )])
}

/// The plugin of a `[providers.exec]` program: started at once, so a program
/// that cannot run is an error before anything else starts.
///
/// # Errors
/// When the program cannot be started or fails its handshake.
pub(crate) async fn start_exec(settings: &ExecSettings) -> anyhow::Result<PluginEntry> {
    let (command, args) = settings
        .command
        .split_first()
        .ok_or_else(|| anyhow::anyhow!("[providers.exec] names no command"))?;
    let mut config = provisioning_exec::ExecConfig::new(command.clone(), args.iter().cloned())
        .with_kind(EXEC_PROVIDER);
    if let Some(timeout) = settings.call_timeout {
        config = config.with_call_timeout(timeout);
    }
    let plugin = provisioning_exec::ExecPlugin::start(config)
        .await
        .map_err(|e| anyhow::anyhow!("provider program {command}: {e}"))?;
    tracing::info!(program = %command, "exec provider started");
    Ok(PluginEntry::new(std::sync::Arc::new(plugin)))
}

/// The driver's policy for the providers this build serves: the core's
/// defaults, except that endpoints are probed at the pace of local
/// processes, which announce theirs within milliseconds.
pub(crate) fn retry_policy() -> RetryPolicy {
    RetryPolicy {
        endpoint_probe_interval: ENDPOINT_PROBE_INTERVAL,
        ..RetryPolicy::default()
    }
}

/// Runs the node agent with the arguments that followed `agent`.
pub(crate) fn agent_main(args: Vec<OsString>) -> ExitCode {
    provisioning_agent::main(args)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_local_policy_differs_from_the_core_defaults_only_in_its_probe_interval() {
        let policy = retry_policy();
        assert_eq!(policy.endpoint_probe_interval, ENDPOINT_PROBE_INTERVAL);
        let with_default_probe = RetryPolicy {
            endpoint_probe_interval: RetryPolicy::default().endpoint_probe_interval,
            ..policy
        };
        assert_eq!(with_default_probe, RetryPolicy::default());
    }
}
