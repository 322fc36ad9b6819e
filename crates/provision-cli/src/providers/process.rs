//! `provider = "process"`: the embedded local-process provider
//! (`provisioning-process`), which needs no table, and `[providers.process]`,
//! how it runs its agents. Its node agents are this same binary, run as
//! `provision agent ...`; so the agent's entry is here too.
//!
//! ```toml
//! [providers.process]
//! agents = "detached"           # default: "with-controller"
//! log_dir = "/var/log/my-run"   # optional, only with detached agents
//! max_concurrent_creates = 4    # optional: a cap on creates in flight
//! ```

#[cfg(test)]
use std::any::Any;
use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use provisioning::RunId;
use provisioning_agent::RunSecret;
use provisioning_process::{AgentCommand, AgentLifetime, ProcessPlugin, ProcessPluginConfig};
use provisioning_runtime::PluginEntry;
use serde::Deserialize;
use toml::Spanned;
use toml::de::DeValue;

use super::{ConfiguredProvider, PluginStart, ProviderMemo, ProviderModule};
use crate::located::{Locator, ShapeFileError};

/// The provider kind of the embedded provider.
pub(super) const KIND: &str = "process";

/// How long a node's processes get between the polite stop signal and the kill.
pub(crate) const STOP_GRACE: Duration = Duration::from_secs(3);

/// The argument that makes this binary run as a node agent.
pub(crate) const AGENT_SUBCOMMAND: &str = "agent";

/// Runs the node agent with the arguments that followed `agent`.
pub(crate) fn agent_main(args: Vec<OsString>) -> ExitCode {
    provisioning_agent::agent::main(args)
}

/// The embedded provider's module.
pub(super) struct Process;

/// `[providers.process]` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileProcessProvider {
    #[serde(default)]
    agents: FileAgents,
    #[serde(default)]
    max_concurrent_creates: Option<Spanned<u32>>,
    #[serde(default)]
    log_dir: Option<Spanned<String>>,
}

/// Whether the embedded provider's agents die with the controller.
#[derive(Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
enum FileAgents {
    #[default]
    WithController,
    Detached,
}

/// How the embedded provider runs its agents (`[providers.process]`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct ProcessSettings {
    /// Whether agents outlive the controller (`agents = "detached"`).
    pub(crate) detached: bool,
    /// Where detached agents write their logs (`log_dir`).
    pub(crate) log_dir: Option<PathBuf>,
    /// The cap on creates in flight (`max_concurrent_creates`), if any.
    pub(crate) max_concurrent_creates: Option<u32>,
}

impl ProviderModule for Process {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn needs_table(&self) -> bool {
        false
    }

    fn configure(
        &self,
        at: &Locator<'_>,
        _run_id: &RunId,
        table: Option<Spanned<DeValue<'_>>>,
    ) -> Result<Arc<dyn ConfiguredProvider>, ShapeFileError> {
        let process: FileProcessProvider = match table {
            Some(table) => at.deserialize_value(table, "providers.process")?,
            None => FileProcessProvider::default(),
        };
        let field = |name: &str| Some(format!("providers.process.{name}"));
        if let Some(cap) = &process.max_concurrent_creates {
            if *cap.get_ref() == 0 {
                return Err(at.error(
                    Some(cap.span()),
                    field("max_concurrent_creates"),
                    "max_concurrent_creates must be at least 1 (leave it out for no cap)",
                ));
            }
        }
        let detached = process.agents == FileAgents::Detached;
        if let Some(log_dir) = &process.log_dir {
            if !detached {
                return Err(at.error(
                    Some(log_dir.span()),
                    field("log_dir"),
                    "log_dir is only used with agents = \"detached\" (agents that die with the controller log through it)",
                ));
            }
            if log_dir.get_ref().is_empty() {
                return Err(at.error(
                    Some(log_dir.span()),
                    field("log_dir"),
                    "log_dir must not be empty",
                ));
            }
        }
        Ok(Arc::new(ProcessSettings {
            detached,
            log_dir: process.log_dir.map(|d| PathBuf::from(d.into_inner())),
            max_concurrent_creates: process.max_concurrent_creates.map(Spanned::into_inner),
        }))
    }

    /// Detached agents that outlived a crash are found through /proc
    /// whatever the setting, and agents started from here on (none: this
    /// is a teardown) would die with this process; so the defaults serve.
    fn without_file(&self) -> Option<Arc<dyn ConfiguredProvider>> {
        Some(Arc::new(ProcessSettings::default()))
    }
}

impl ConfiguredProvider for ProcessSettings {
    fn max_concurrent_creates(&self) -> Option<u32> {
        self.max_concurrent_creates
    }

    fn start<'a>(
        &'a self,
        run_id: &'a RunId,
        secret: RunSecret,
        _memo: &'a ProviderMemo,
    ) -> PluginStart<'a> {
        Box::pin(start_process(run_id, secret, self))
    }

    #[cfg(test)]
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Starts the local-process plugin for `run_id`. Its node agents are this
/// same binary, run as `provision agent ...`.
///
/// # Errors
/// When the path of this binary is unknown or the plugin cannot start.
async fn start_process(
    run_id: &RunId,
    run_secret: RunSecret,
    settings: &ProcessSettings,
) -> anyhow::Result<PluginEntry> {
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
    Ok(
        PluginEntry::new(plugin)
            .with_shutdown(move || async move { for_shutdown.shutdown().await }),
    )
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::shape_file::{ShapeSource, parse};

    fn parse_text(text: &str) -> Result<ShapeSource, ShapeFileError> {
        parse(Path::new("shape.toml"), text, &super::super::kinds())
    }

    fn settings(source: &ShapeSource) -> ProcessSettings {
        source
            .settings::<ProcessSettings>()
            .expect("the embedded provider is always configured")
            .clone()
    }

    #[test]
    fn the_process_provider_runs_agents_with_the_controller_unless_told_to_detach_them() {
        let plain = parse_text("run = \"r\"\n[[group]]\nid = \"w\"\ncount = 1\n").unwrap();
        assert_eq!(settings(&plain), ProcessSettings::default());
        let detached =
            "run = \"r\"\n[providers.process]\nagents = \"detached\"\nlog_dir = \"/var/log/r\"\n";
        assert_eq!(
            settings(&parse_text(detached).unwrap()),
            ProcessSettings {
                detached: true,
                log_dir: Some(PathBuf::from("/var/log/r")),
                max_concurrent_creates: None,
            }
        );
        let wrong = "run = \"r\"\n[providers.process]\nagents = \"forever\"\n";
        let error = parse_text(wrong).unwrap_err().to_string();
        assert!(error.starts_with("shape.toml:3:"), "{error}");
        assert!(error.contains("providers.process.agents"), "{error}");
        let stray = "run = \"r\"\n[providers.process]\nlog_dir = \"/tmp/x\"\n";
        let error = parse_text(stray).unwrap_err().to_string();
        assert!(
            error.contains("only used with agents = \"detached\""),
            "{error}"
        );
    }

    #[test]
    fn a_process_cap_of_zero_is_refused_at_its_value() {
        let text = "run = \"r\"\n[providers.process]\nmax_concurrent_creates = 0\n";
        assert_eq!(
            parse_text(text).unwrap_err().to_string(),
            "shape.toml:3:26: field `providers.process.max_concurrent_creates`: max_concurrent_creates must be at least 1 (leave it out for no cap)"
        );
    }
}
