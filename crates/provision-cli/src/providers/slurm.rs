//! `provider = "slurm"`: nodes from a Slurm cluster (`provisioning-slurm`).
//! This module reads `[providers.slurm]` and a group's `slurm` table (folded
//! into the group's labels as `slurm.*`) and starts the plugin.
//!
//! ```toml
//! [providers.slurm]
//! slurm_conf = "/etc/slurm/slurm.conf"   # optional: SLURM_CONF for every command
//! listen = "10.0.0.1:7200"               # optional (default 127.0.0.1:0): the swarm listener;
//!                                        # port 0: the port picked is kept in the run's state
//!                                        # and bound again by a restarted `up`
//! advertise = "10.0.0.1:7200"            # optional: what agents dial
//! agent = "/shared/bin/provision"        # optional: the agent binary as the nodes see it
//! command_timeout_secs = 30              # optional
//!
//! [[group]]
//! id = "workers"
//! count = 4
//! provider = "slurm"
//! slurm = { partition = "debug", cpus = 1, memory = "100M", time_limit = "60" }
//! ```

#[cfg(test)]
use std::any::Any;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use provisioning::RunId;
use provisioning_agent::RunSecret;
use provisioning_runtime::PluginEntry;
use provisioning_slurm::{GroupShape, SlurmPlugin, SlurmPluginConfig, SlurmSettings};
use toml::Spanned;
use toml::de::DeValue;

use super::{ConfiguredProvider, PluginStart, ProviderMemo, ProviderModule};
use crate::located::{Locator, ShapeFileError};

/// The provider kind `[providers.slurm]` serves, and the name of its
/// groups' table.
const KIND: &str = "slurm";

/// The Slurm provider's module.
pub(super) struct Slurm;

/// The argument that makes the `provision` binary run as a node agent.
const AGENT_ARGUMENT: &str = "agent";

/// `[providers.slurm]` as written: the crate's own settings type, which
/// rejects unknown keys (the locator places them at their line).
type FileSlurmProvider = SlurmSettings;

/// A group's `slurm` table as written.
type FileSlurmGroup = GroupShape;

/// A problem with its place in the file; [`Slurm`] places it in the file.
#[derive(Debug)]
struct SlurmFieldError {
    /// The bytes of the file the problem is about.
    span: Option<Range<usize>>,
    /// The field, dotted (`providers.slurm.listen`, `group[1].slurm`).
    field: String,
    /// What is wrong.
    message: String,
}

impl ProviderModule for Slurm {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn needs_table(&self) -> bool {
        true
    }

    fn takes_group_table(&self) -> bool {
        true
    }

    fn configure(
        &self,
        at: &Locator<'_>,
        _run_id: &RunId,
        table: Option<Spanned<DeValue<'_>>>,
    ) -> Result<Arc<dyn ConfiguredProvider>, ShapeFileError> {
        let table: Spanned<FileSlurmProvider> = super::read_table(at, KIND, table)?;
        let settings =
            check(at.path, &table).map_err(|e| at.error(e.span, Some(e.field), e.message))?;
        Ok(Arc::new(settings))
    }

    fn group_labels(
        &self,
        at: &Locator<'_>,
        index: usize,
        labels: &BTreeMap<String, String>,
        table: Spanned<DeValue<'_>>,
    ) -> Result<BTreeMap<String, String>, ShapeFileError> {
        let field = format!("group[{index}].{KIND}");
        let table: Spanned<FileSlurmGroup> = at.deserialize_value(table, &field)?;
        group_labels(index, labels, &table).map_err(|e| at.error(e.span, Some(e.field), e.message))
    }
}

impl ConfiguredProvider for SlurmCliSettings {
    fn start<'a>(
        &'a self,
        run_id: &'a RunId,
        secret: RunSecret,
        memo: &'a ProviderMemo,
    ) -> PluginStart<'a> {
        Box::pin(start_slurm(run_id, secret, self, memo))
    }

    #[cfg(test)]
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// `[providers.slurm]`, checked: paths resolved against the shape file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SlurmCliSettings {
    /// The table.
    pub(crate) settings: SlurmSettings,
}

fn resolve(file: &Path, path: &Path) -> PathBuf {
    if path.is_relative() {
        file.parent().unwrap_or_else(|| Path::new("")).join(path)
    } else {
        path.to_owned()
    }
}

/// Checks `[providers.slurm]` of the shape file `file`.
///
/// # Errors
/// The first problem, placed at the table.
fn check(
    file: &Path,
    table: &Spanned<FileSlurmProvider>,
) -> Result<SlurmCliSettings, SlurmFieldError> {
    let mut settings = table.get_ref().clone();
    let fail = |field: &str, message: String| SlurmFieldError {
        span: Some(table.span()),
        field: format!("providers.slurm.{field}"),
        message,
    };
    if settings.command_timeout_secs == Some(0) {
        return Err(fail(
            "command_timeout_secs",
            "must be at least 1 second".to_owned(),
        ));
    }
    let dialed = settings.advertise.or(settings.listen);
    if dialed.is_some_and(|a| a.ip().is_unspecified()) {
        return Err(fail(
            "advertise",
            "agents cannot dial an unspecified address: set advertise to an address of this machine the nodes can reach".to_owned(),
        ));
    }
    settings.slurm_conf = settings.slurm_conf.map(|p| resolve(file, &p));
    settings.agent = settings.agent.map(|p| resolve(file, &p));
    Ok(SlurmCliSettings { settings })
}

/// The labels of group `index` with its `slurm` table folded in (as
/// `slurm.*` labels, which the plugin reads back).
///
/// # Errors
/// A value the plugin would refuse, placed at the table.
fn group_labels(
    index: usize,
    labels: &BTreeMap<String, String>,
    table: &Spanned<FileSlurmGroup>,
) -> Result<BTreeMap<String, String>, SlurmFieldError> {
    let fail = |message: String| SlurmFieldError {
        span: Some(table.span()),
        field: format!("group[{index}].{KIND}"),
        message,
    };
    let mut merged = labels.clone();
    merged.extend(table.get_ref().to_labels());
    GroupShape::from_labels(&merged).map_err(|e| fail(e.to_string()))?;
    Ok(merged)
}

/// Starts the slurm plugin for `run_id`.
///
/// # Errors
/// When the swarm listener cannot bind or this binary cannot be found.
async fn start_slurm(
    run_id: &RunId,
    secret: RunSecret,
    settings: &SlurmCliSettings,
    memo: &ProviderMemo,
) -> anyhow::Result<PluginEntry> {
    let settings = &settings.settings;
    // The table's agent binary, else the slim `provision-agent` beside this
    // binary (design §18). A configured path to the full `provision` binary
    // runs it as `provision agent`.
    let agent = match &settings.agent {
        Some(path) => {
            let mut command = vec![path.display().to_string()];
            if !crate::agent_binary::is_slim_agent(path) {
                command.push(AGENT_ARGUMENT.to_owned());
            }
            command
        }
        None => {
            let (program, args) = crate::agent_binary::remote_agent_command()?;
            std::iter::once(program.display().to_string())
                .chain(args)
                .collect()
        }
    };
    let mut config = SlurmPluginConfig::new(run_id.clone(), secret, agent);
    config.slurm_conf = settings.slurm_conf.clone();
    if let Some(listen) = settings.listen {
        config.listen = listen;
    }
    config.advertise = settings.advertise;
    if let Some(secs) = settings.command_timeout_secs {
        config.command_timeout = Duration::from_secs(secs);
    }
    // Agent steps outlive a crashed controller and re-dial the address
    // they were given for their re-join window: with no fixed port
    // configured, a restarted controller listens on the port the last one
    // picked, kept in the run's state.
    let configured = config.listen;
    let picks_port = configured.port() == 0;
    let remembered = remembered_listen(memo, configured);
    if let Some(address) = remembered {
        config.listen = address;
    }
    let plugin = match SlurmPlugin::start(config.clone()).await {
        Ok(plugin) => plugin,
        Err(error) if remembered.is_some() => {
            tracing::warn!(
                "cannot listen on {} again ({error}): agents the last controller left running cannot re-join, and their nodes will be replaced",
                config.listen
            );
            config.listen = configured;
            SlurmPlugin::start(config)
                .await
                .map_err(|e| anyhow::anyhow!("[providers.slurm]: {e}"))?
        }
        Err(error) => return Err(anyhow::anyhow!("[providers.slurm]: {error}")),
    };
    if picks_port {
        memo.set(LISTEN_MEMO, plugin.listen_address().to_string());
    }
    tracing::info!(swarm = %plugin.swarm_address(), "slurm provider started");
    Ok(PluginEntry::new(Arc::new(plugin)))
}

/// The memo name of the swarm listener's address (see [`ProviderMemo`]).
const LISTEN_MEMO: &str = "slurm.listen";

/// The listen address the run's last controller bound, when the table
/// leaves the port to the system and the address is on the same interface.
fn remembered_listen(memo: &ProviderMemo, configured: SocketAddr) -> Option<SocketAddr> {
    if configured.port() != 0 {
        return None;
    }
    memo.get(LISTEN_MEMO)
        .and_then(|value| value.parse::<SocketAddr>().ok())
        .filter(|address| address.ip() == configured.ip() && address.port() != 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shape_file::{ShapeSource, parse};

    fn parse_text(text: &str) -> Result<ShapeSource, ShapeFileError> {
        parse(Path::new("hpc.toml"), text, &super::super::kinds())
    }

    const GOOD: &str = r#"
run = "hpc"

[providers.slurm]
slurm_conf = "/etc/slurm/slurm.conf"

[[group]]
id = "workers"
count = 2
provider = "slurm"
slurm = { partition = "debug", cpus = 1, memory = "100M" }
"#;

    #[test]
    fn a_slurm_group_carries_its_table_as_labels() {
        let source = parse_text(GOOD).expect("parses");
        let settings = source
            .settings::<SlurmCliSettings>()
            .expect("slurm settings")
            .settings
            .clone();
        assert_eq!(
            settings.slurm_conf.as_deref(),
            Some(std::path::Path::new("/etc/slurm/slurm.conf"))
        );
        let labels = &source.groups[0].template.shape.labels;
        assert_eq!(
            labels.get("slurm.partition").map(String::as_str),
            Some("debug")
        );
        assert_eq!(labels.get("slurm.memory").map(String::as_str), Some("100M"));
    }

    #[test]
    fn unknown_keys_are_refused_with_their_line() {
        let text = GOOD.replace("cpus = 1", "gpus = 1");
        let error = parse_text(&text).expect_err("refused");
        let shown = error.to_string();
        assert!(shown.contains("hpc.toml:11"), "{shown}");
        assert!(shown.contains("gpus"), "{shown}");
        let text = GOOD.replace("slurm_conf =", "slurm_cnof =");
        let shown = parse_text(&text).expect_err("refused").to_string();
        assert!(shown.contains("hpc.toml:5"), "{shown}");
        assert!(shown.contains("slurm_cnof"), "{shown}");
    }

    #[test]
    fn a_slurm_table_on_another_provider_or_a_bad_value_is_refused() {
        let text = GOOD.replace("provider = \"slurm\"", "provider = \"process\"");
        let shown = parse_text(&text).expect_err("refused").to_string();
        assert!(shown.contains("group[0].slurm"), "{shown}");
        let text = GOOD.replace("cpus = 1", "cpus = 0");
        let shown = parse_text(&text).expect_err("refused").to_string();
        assert!(shown.contains("hpc.toml:11"), "{shown}");
    }
}
