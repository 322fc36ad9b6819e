//! `[providers.slurm]` and a group's `slurm` table: nodes from a Slurm
//! cluster (`provisioning-slurm`). The shape file's parser calls [`check`]
//! for the provider table and [`group_labels`] for each group; `up` (and a
//! `down` after a crash) starts the plugin with [`start_slurm`].
//!
//! ```toml
//! [providers.slurm]
//! slurm_conf = "/etc/slurm/slurm.conf"   # optional: SLURM_CONF for every command
//! listen = "10.0.0.1:7200"               # optional (default 127.0.0.1:0): the swarm listener
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

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use provisioning::RunId;
use provisioning_agent::RunSecret;
use provisioning_runtime::PluginEntry;
use provisioning_slurm::{GroupShape, SlurmPlugin, SlurmPluginConfig, SlurmSettings};
use toml::Spanned;

/// The provider kind `[providers.slurm]` serves.
pub(crate) const SLURM_PROVIDER: &str = "slurm";

/// The argument that makes the `provision` binary run as a node agent.
const AGENT_ARGUMENT: &str = "agent";

/// `[providers.slurm]` as written: the crate's own settings type, which
/// rejects unknown keys (the parser places them at their line).
pub(crate) type FileSlurmProvider = SlurmSettings;

/// A group's `slurm` table as written.
pub(crate) type FileSlurmGroup = GroupShape;

/// A problem with its place in the file; the shape file's parser turns it
/// into a located error.
#[derive(Debug)]
pub(crate) struct SlurmFieldError {
    /// The bytes of the file the problem is about.
    pub(crate) span: Option<Range<usize>>,
    /// The field, dotted (`providers.slurm.listen`, `group[1].slurm`).
    pub(crate) field: String,
    /// What is wrong.
    pub(crate) message: String,
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
pub(crate) fn check(
    file: &Path,
    table: Option<&Spanned<FileSlurmProvider>>,
) -> Result<Option<SlurmCliSettings>, SlurmFieldError> {
    let Some(table) = table else {
        return Ok(None);
    };
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
    Ok(Some(SlurmCliSettings { settings }))
}

/// The labels of group `index` with its `slurm` table folded in (as
/// `slurm.*` labels, which the plugin reads back).
///
/// # Errors
/// A `slurm` table on a group of another provider, or a value the plugin
/// would refuse, placed at the table.
pub(crate) fn group_labels(
    index: usize,
    provider: &str,
    labels: &BTreeMap<String, String>,
    table: Option<&Spanned<FileSlurmGroup>>,
) -> Result<BTreeMap<String, String>, SlurmFieldError> {
    let Some(table) = table else {
        return Ok(labels.clone());
    };
    let fail = |message: String| SlurmFieldError {
        span: Some(table.span()),
        field: format!("group[{index}].slurm"),
        message,
    };
    if provider != SLURM_PROVIDER {
        return Err(fail(format!(
            "a slurm table only applies to groups with provider = \"slurm\" (this one has {provider:?})"
        )));
    }
    let mut merged = labels.clone();
    merged.extend(table.get_ref().to_labels());
    GroupShape::from_labels(&merged).map_err(|e| fail(e.to_string()))?;
    Ok(merged)
}

/// Starts the slurm plugin for `run_id`.
///
/// # Errors
/// When the swarm listener cannot bind or this binary cannot be found.
pub(crate) async fn start_slurm(
    run_id: &RunId,
    secret: RunSecret,
    settings: &SlurmCliSettings,
) -> anyhow::Result<PluginEntry> {
    let settings = &settings.settings;
    let agent = match &settings.agent {
        Some(path) => vec![path.display().to_string(), AGENT_ARGUMENT.to_owned()],
        None => vec![
            std::env::current_exe()?.display().to_string(),
            AGENT_ARGUMENT.to_owned(),
        ],
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
    let plugin = SlurmPlugin::start(config)
        .await
        .map_err(|e| anyhow::anyhow!("[providers.slurm]: {e}"))?;
    tracing::info!(swarm = %plugin.swarm_address(), "slurm provider started");
    Ok(PluginEntry::new(Arc::new(plugin)))
}

#[cfg(test)]
mod tests {
    use crate::shape_file::parse;

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
        let source = parse("hpc.toml".as_ref(), GOOD, &["process"]).expect("parses");
        let settings = source.slurm.expect("slurm settings").settings;
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
        let error = parse("hpc.toml".as_ref(), &text, &["process"]).expect_err("refused");
        let shown = error.to_string();
        assert!(shown.contains("hpc.toml:11"), "{shown}");
        assert!(shown.contains("gpus"), "{shown}");
        let text = GOOD.replace("slurm_conf =", "slurm_cnof =");
        let shown = parse("hpc.toml".as_ref(), &text, &["process"])
            .expect_err("refused")
            .to_string();
        assert!(shown.contains("hpc.toml:5"), "{shown}");
        assert!(shown.contains("slurm_cnof"), "{shown}");
    }

    #[test]
    fn a_slurm_table_on_another_provider_or_a_bad_value_is_refused() {
        let text = GOOD.replace("provider = \"slurm\"", "provider = \"process\"");
        let shown = parse("hpc.toml".as_ref(), &text, &["process"])
            .expect_err("refused")
            .to_string();
        assert!(shown.contains("group[0].slurm"), "{shown}");
        let text = GOOD.replace("cpus = 1", "cpus = 0");
        let shown = parse("hpc.toml".as_ref(), &text, &["process"])
            .expect_err("refused")
            .to_string();
        assert!(shown.contains("hpc.toml:11"), "{shown}");
    }
}
