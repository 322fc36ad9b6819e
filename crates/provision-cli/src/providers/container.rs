//! `provider = "container"`: nodes that are containers on a Docker Engine
//! API, Docker's or Podman's (`provisioning-container`). This module reads
//! `[providers.container]` and a group's `container` table (folded into
//! the group's labels as `container.*`) and starts the plugin.
//!
//! ```toml
//! [providers.container]
//! socket = "unix:///run/podman/podman.sock"  # optional: default DOCKER_HOST, else the Docker socket
//! listen = "172.17.0.1:7300"                 # required: the swarm listener, an address containers reach
//! advertise = "172.17.0.1:7300"              # optional: what agents dial, when it differs
//! agent = "/usr/local/bin/provision-agent"   # optional: the agent bind-mounted read-only (default: beside provision)
//! agent_in_image = "/usr/bin/provision-agent" # optional instead: the agent the image holds
//! stop_grace_secs = 10                       # optional: SIGTERM to SIGKILL on destroy
//!
//! [[group]]
//! id = "workers"
//! count = 4
//! provider = "container"
//! container = { image = "worker:1", cpus = 0.5, memory = "256m", network = "bridge" }
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
use provisioning_container::{
    AgentSource, ContainerPlugin, ContainerPluginConfig, GroupShape, default_socket, socket_path,
};
use provisioning_runtime::PluginEntry;
use serde::Deserialize;
use toml::Spanned;
use toml::de::DeValue;

use super::{ConfiguredProvider, PluginStart, ProviderMemo, ProviderModule};
use crate::located::{Locator, ShapeFileError};

/// The provider kind `[providers.container]` serves, and the name of its
/// groups' table.
const KIND: &str = "container";

/// The argument that makes the `provision` binary run as a node agent.
const AGENT_ARGUMENT: &str = "agent";

/// The container provider's module.
pub(super) struct Container;

/// `[providers.container]` as written.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub(crate) struct ContainerSettings {
    /// The Engine API socket (default: `DOCKER_HOST`, else the Docker socket).
    pub(crate) socket: Option<String>,
    /// The address the run's swarm listener binds.
    pub(crate) listen: Option<SocketAddr>,
    /// The address agents dial, when it differs from `listen`.
    pub(crate) advertise: Option<SocketAddr>,
    /// The agent executable to bind-mount read-only into every container.
    pub(crate) agent: Option<PathBuf>,
    /// The agent executable the image holds (instead of a mount).
    pub(crate) agent_in_image: Option<String>,
    /// Seconds a destroyed container gets between `SIGTERM` and `SIGKILL`.
    pub(crate) stop_grace_secs: Option<u64>,
}

/// A problem with its place in the file.
#[derive(Debug)]
struct ContainerFieldError {
    span: Option<Range<usize>>,
    field: String,
    message: String,
}

impl ProviderModule for Container {
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
        let table: Spanned<ContainerSettings> = super::read_table(at, KIND, table)?;
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
        let table: Spanned<GroupShape> = at.deserialize_value(table, &field)?;
        group_labels(index, labels, &table).map_err(|e| at.error(e.span, Some(e.field), e.message))
    }
}

/// `[providers.container]`, checked: paths resolved against the shape file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ContainerCliSettings {
    /// The table.
    pub(crate) settings: ContainerSettings,
}

impl ConfiguredProvider for ContainerCliSettings {
    fn start<'a>(
        &'a self,
        run_id: &'a RunId,
        secret: RunSecret,
        _memo: &'a ProviderMemo,
    ) -> PluginStart<'a> {
        Box::pin(start_container(run_id, secret, self))
    }

    #[cfg(test)]
    fn as_any(&self) -> &dyn Any {
        self
    }
}

fn resolve(file: &Path, path: &Path) -> PathBuf {
    if path.is_relative() {
        file.parent().unwrap_or_else(|| Path::new("")).join(path)
    } else {
        path.to_owned()
    }
}

/// Checks `[providers.container]` of the shape file `file`.
///
/// # Errors
/// The first problem, placed at the table.
fn check(
    file: &Path,
    table: &Spanned<ContainerSettings>,
) -> Result<ContainerCliSettings, ContainerFieldError> {
    let mut settings = table.get_ref().clone();
    let fail = |field: &str, message: String| ContainerFieldError {
        span: Some(table.span()),
        field: format!("providers.container.{field}"),
        message,
    };
    if let Some(socket) = &settings.socket
        && socket_path(socket).is_none()
    {
        return Err(fail(
            "socket",
            format!("{socket:?} is not a unix socket (unix:///path or /path)"),
        ));
    }
    let Some(listen) = settings.listen else {
        return Err(fail(
            "listen",
            "missing: the swarm listener's address, one the containers can reach (their network's gateway, e.g. 172.17.0.1:7300)".to_owned(),
        ));
    };
    if settings.advertise.unwrap_or(listen).ip().is_unspecified() {
        return Err(fail(
            "advertise",
            "agents cannot dial an unspecified address: set advertise to an address of this machine the containers can reach".to_owned(),
        ));
    }
    if settings.agent.is_some() && settings.agent_in_image.is_some() {
        return Err(fail(
            "agent_in_image",
            "set either agent (mounted) or agent_in_image, not both".to_owned(),
        ));
    }
    if settings
        .agent_in_image
        .as_deref()
        .is_some_and(|p| !p.starts_with('/'))
    {
        return Err(fail(
            "agent_in_image",
            "must be an absolute path inside the image".to_owned(),
        ));
    }
    settings.agent = settings.agent.map(|p| resolve(file, &p));
    Ok(ContainerCliSettings { settings })
}

/// The labels of group `index` with its `container` table folded in (as
/// `container.*` labels, which the plugin reads back).
///
/// # Errors
/// Every value the plugin would refuse, placed at the table and named.
fn group_labels(
    index: usize,
    labels: &BTreeMap<String, String>,
    table: &Spanned<GroupShape>,
) -> Result<BTreeMap<String, String>, ContainerFieldError> {
    if let Err(errors) = table.get_ref().validate() {
        let first = &errors[0];
        let rest: Vec<String> = errors[1..].iter().map(ToString::to_string).collect();
        return Err(ContainerFieldError {
            span: Some(table.span()),
            field: format!("group[{index}].{KIND}.{}", first.field),
            message: if rest.is_empty() {
                first.problem.clone()
            } else {
                format!("{}; also: {}", first.problem, rest.join("; "))
            },
        });
    }
    let mut merged = labels.clone();
    merged.extend(table.get_ref().to_labels());
    Ok(merged)
}

/// Starts the container plugin for `run_id`.
///
/// # Errors
/// When the engine does not answer, the listener cannot bind or the agent
/// cannot be found.
async fn start_container(
    run_id: &RunId,
    secret: RunSecret,
    settings: &ContainerCliSettings,
) -> anyhow::Result<PluginEntry> {
    let settings = &settings.settings;
    // The table's agent, else the slim `provision-agent` beside this binary
    // (design §18), bind-mounted read-only; or the one the image holds.
    let (agent, agent_args) = match (&settings.agent, &settings.agent_in_image) {
        (_, Some(inside)) => (AgentSource::InImage(inside.clone()), Vec::new()),
        (Some(path), None) => {
            let args = if crate::agent_binary::is_slim_agent(path) {
                Vec::new()
            } else {
                vec![AGENT_ARGUMENT.to_owned()]
            };
            (AgentSource::Mount(path.clone()), args)
        }
        (None, None) => {
            let (program, args) = crate::agent_binary::remote_agent_command()?;
            (AgentSource::Mount(program), args)
        }
    };
    let mut config = ContainerPluginConfig::new(run_id.clone(), secret, agent);
    config.agent_args = agent_args;
    config.socket = settings.socket.clone().unwrap_or_else(default_socket);
    if let Some(listen) = settings.listen {
        config.listen = listen;
    }
    config.advertise = settings.advertise;
    if let Some(secs) = settings.stop_grace_secs {
        config.stop_grace = Duration::from_secs(secs);
    }
    let plugin = ContainerPlugin::start(config)
        .await
        .map_err(|e| anyhow::anyhow!("[providers.container]: {e}"))?;
    tracing::info!(swarm = %plugin.swarm_address(), "container provider started");
    Ok(PluginEntry::new(Arc::new(plugin)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shape_file::{ShapeSource, parse};

    fn parse_text(text: &str) -> Result<ShapeSource, ShapeFileError> {
        parse(Path::new("fleet.toml"), text, &super::super::kinds())
    }

    const GOOD: &str = r#"
run = "fleet"

[providers.container]
socket = "unix:///run/podman/podman.sock"
listen = "172.17.0.1:7300"

[[group]]
id = "workers"
count = 2
provider = "container"
container = { image = "worker:1", cpus = 0.5, memory = "256m", env = { MODE = "batch" } }
"#;

    #[test]
    fn a_container_group_carries_its_table_as_labels() {
        let source = parse_text(GOOD).expect("parses");
        let settings = source
            .settings::<ContainerCliSettings>()
            .expect("container settings")
            .settings
            .clone();
        assert_eq!(
            settings.socket.as_deref(),
            Some("unix:///run/podman/podman.sock")
        );
        let labels = &source.groups[0].template.shape.labels;
        assert_eq!(
            labels.get("container.image").map(String::as_str),
            Some("worker:1")
        );
        assert_eq!(
            labels.get("container.env.MODE").map(String::as_str),
            Some("batch")
        );
        assert_eq!(
            GroupShape::from_labels(labels).expect("valid").cpus,
            Some(0.5)
        );
    }

    #[test]
    fn unknown_keys_and_bad_values_are_refused_with_their_line_and_field() {
        let text = GOOD.replace("cpus = 0.5", "gpus = 1");
        let shown = parse_text(&text).expect_err("refused").to_string();
        assert!(shown.contains("fleet.toml:12"), "{shown}");
        assert!(shown.contains("gpus"), "{shown}");
        let text = GOOD.replace("memory = \"256m\"", "memory = \"lots\"");
        let shown = parse_text(&text).expect_err("refused").to_string();
        assert!(shown.contains("fleet.toml:12"), "{shown}");
        assert!(shown.contains("group[0].container.memory"), "{shown}");
        let text = GOOD.replace("image = \"worker:1\", ", "");
        let shown = parse_text(&text).expect_err("refused").to_string();
        assert!(shown.contains("group[0].container.image"), "{shown}");
        let text = GOOD.replace("socket =", "sokcet =");
        let shown = parse_text(&text).expect_err("refused").to_string();
        assert!(shown.contains("fleet.toml:5"), "{shown}");
    }

    #[test]
    fn the_listener_must_be_dialable_from_a_container() {
        let text = GOOD.replace("listen = \"172.17.0.1:7300\"", "");
        let shown = parse_text(&text).expect_err("refused").to_string();
        assert!(shown.contains("providers.container.listen"), "{shown}");
        let text = GOOD.replace("172.17.0.1:7300", "0.0.0.0:7300");
        let shown = parse_text(&text).expect_err("refused").to_string();
        assert!(shown.contains("advertise"), "{shown}");
        let text = GOOD.replace("provider = \"container\"", "provider = \"process\"");
        let shown = parse_text(&text).expect_err("refused").to_string();
        assert!(shown.contains("group[0].container"), "{shown}");
    }
}
