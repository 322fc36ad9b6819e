//! `provider = "ssh"`: machines the user already owns, reached over SSH
//! (`provisioning-ssh`). This module reads and checks `[providers.ssh]`
//! and starts the plugin.
//!
//! ```toml
//! [providers.ssh]
//! known_hosts = "known_hosts"        # required; relative to the shape file
//! listen = "10.0.0.1:7100"           # the swarm listener the agents join
//! advertise = "10.0.0.1:7100"        # optional: what agents dial (default: listen)
//! agent = ["/usr/local/bin/provision", "agent"]  # optional (default: this binary)
//! ssh_config = "/dev/null"           # optional `ssh -F` file (default: ~/.ssh/config)
//! connect_timeout_secs = 5           # optional
//! command_timeout_secs = 30          # optional
//! join_timeout_secs = 60             # optional
//!
//! [[providers.ssh.host]]
//! name = "gpu-1"
//! address = "10.0.0.11"
//! port = 22                          # optional, 22
//! user = "ops"
//! identity_file = "~/.ssh/id_ed25519"  # optional
//! slots = 2                          # optional, 1
//! claim_root = "/var/lib/provisioning/claims"  # optional
//! ```

#[cfg(test)]
use std::any::Any;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use provisioning::RunId;
use provisioning_agent::RunSecret;
use provisioning_runtime::PluginEntry;
use provisioning_ssh::{SshAgentConfig, SshHost, SshPlugin, SshPluginConfig};
use serde::Deserialize;
use toml::Spanned;
use toml::de::DeValue;

use super::{ConfiguredProvider, PluginStart, ProviderMemo, ProviderModule};
use crate::located::{Locator, ShapeFileError};

/// The provider kind `[providers.ssh]` serves.
const KIND: &str = "ssh";

/// The SSH provider's module.
pub(super) struct Ssh;

/// How often the plugin looks for claims removed behind its back.
const LOSS_WATCH_INTERVAL: Duration = Duration::from_secs(5);

/// `[providers.ssh]` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileSshProvider {
    known_hosts: Spanned<String>,
    listen: Spanned<String>,
    #[serde(default)]
    advertise: Option<Spanned<String>>,
    #[serde(default)]
    agent: Option<Spanned<Vec<String>>>,
    #[serde(default)]
    ssh_config: Option<Spanned<String>>,
    #[serde(default)]
    connect_timeout_secs: Option<Spanned<u64>>,
    #[serde(default)]
    command_timeout_secs: Option<Spanned<u64>>,
    #[serde(default)]
    join_timeout_secs: Option<Spanned<u64>>,
    #[serde(default, rename = "host")]
    hosts: Vec<Spanned<FileSshHost>>,
}

/// One `[[providers.ssh.host]]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileSshHost {
    name: Spanned<String>,
    address: Spanned<String>,
    #[serde(default)]
    port: Option<Spanned<u16>>,
    user: Spanned<String>,
    #[serde(default)]
    identity_file: Option<Spanned<String>>,
    #[serde(default)]
    slots: Option<Spanned<u32>>,
    #[serde(default)]
    claim_root: Option<Spanned<String>>,
}

/// The checked `[providers.ssh]` table. Read when `up` (or a `down` after a
/// crash) starts; an edit takes effect at the next start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SshSettings {
    /// The inventory.
    pub(crate) hosts: Vec<SshHost>,
    /// The known-hosts file every host key is checked against.
    pub(crate) known_hosts: PathBuf,
    /// Where the swarm listener binds.
    pub(crate) listen: SocketAddr,
    /// What agents dial, when not `listen`.
    pub(crate) advertise: Option<SocketAddr>,
    /// The agent program and its leading arguments; `None`: this binary.
    pub(crate) agent: Option<Vec<String>>,
    /// An `ssh -F` file.
    pub(crate) ssh_config: Option<PathBuf>,
    /// `ConnectTimeout` of every call.
    pub(crate) connect_timeout: Option<Duration>,
    /// The bound on one call.
    pub(crate) command_timeout: Option<Duration>,
    /// How long an agent may take to join.
    pub(crate) join_timeout: Option<Duration>,
    /// The shape file, for messages.
    pub(crate) file: PathBuf,
}

/// A problem of the table: where (a byte range of the file), which field,
/// and what is wrong; [`Ssh::configure`] places it in the file.
#[derive(Debug)]
struct SshFieldError {
    /// The bytes of the file the problem is about.
    span: Option<Range<usize>>,
    /// The field, dotted (`providers.ssh.host[1].port`).
    field: String,
    /// What is wrong.
    message: String,
}

fn problem(
    span: Range<usize>,
    field: impl Into<String>,
    message: impl Into<String>,
) -> SshFieldError {
    SshFieldError {
        span: Some(span),
        field: field.into(),
        message: message.into(),
    }
}

/// `~/x` expanded with `$HOME`, and a relative path taken relative to the
/// directory of the shape file `file`.
fn resolve(file: &Path, text: &str) -> PathBuf {
    let expanded = match (text.strip_prefix("~/"), std::env::var_os("HOME")) {
        (Some(rest), Some(home)) => PathBuf::from(home).join(rest),
        _ => PathBuf::from(text),
    };
    if expanded.is_relative() {
        file.parent()
            .unwrap_or_else(|| Path::new(""))
            .join(expanded)
    } else {
        expanded
    }
}

fn address(value: &Spanned<String>, field: &str) -> Result<SocketAddr, SshFieldError> {
    value.get_ref().parse().map_err(|_| {
        problem(
            value.span(),
            field,
            format!(
                "{:?} is not an address with a port, such as \"10.0.0.1:7100\"",
                value.get_ref()
            ),
        )
    })
}

fn seconds(value: &Option<Spanned<u64>>, field: &str) -> Result<Option<Duration>, SshFieldError> {
    match value {
        None => Ok(None),
        Some(secs) if *secs.get_ref() == 0 => {
            Err(problem(secs.span(), field, "must be at least 1 second"))
        }
        Some(secs) => Ok(Some(Duration::from_secs(*secs.get_ref()))),
    }
}

impl ProviderModule for Ssh {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn needs_table(&self) -> bool {
        true
    }

    fn configure(
        &self,
        at: &Locator<'_>,
        run_id: &RunId,
        table: Option<Spanned<DeValue<'_>>>,
    ) -> Result<Arc<dyn ConfiguredProvider>, ShapeFileError> {
        let table: Spanned<FileSshProvider> = super::read_table(at, KIND, table)?;
        let settings = check(at.path, run_id, &table)
            .map_err(|e| at.error(e.span, Some(e.field), e.message))?;
        Ok(Arc::new(settings))
    }
}

impl ConfiguredProvider for SshSettings {
    fn start<'a>(
        &'a self,
        run_id: &'a RunId,
        secret: RunSecret,
        _memo: &'a ProviderMemo,
    ) -> PluginStart<'a> {
        Box::pin(start_ssh(run_id, secret, self))
    }

    #[cfg(test)]
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Checks `[providers.ssh]` of the shape file `file` for run `run_id`.
///
/// # Errors
/// The first problem found, with its place in the file.
fn check(
    file: &Path,
    run_id: &RunId,
    table: &Spanned<FileSshProvider>,
) -> Result<SshSettings, SshFieldError> {
    let ssh = table.get_ref();
    let field = |name: &str| format!("providers.ssh.{name}");
    if ssh.hosts.is_empty() {
        return Err(problem(
            table.span(),
            field("host"),
            "the inventory has no hosts: add a [[providers.ssh.host]] table with name, address and user",
        ));
    }
    if ssh.known_hosts.get_ref().trim().is_empty() {
        return Err(problem(
            ssh.known_hosts.span(),
            field("known_hosts"),
            "must name a known-hosts file: every host key is checked",
        ));
    }
    let listen = address(&ssh.listen, &field("listen"))?;
    let advertise = match &ssh.advertise {
        Some(value) => Some(address(value, &field("advertise"))?),
        None => None,
    };
    let dialed = advertise.unwrap_or(listen);
    if dialed.ip().is_unspecified() {
        let span = ssh.advertise.as_ref().unwrap_or(&ssh.listen).span();
        return Err(problem(
            span,
            field(if advertise.is_some() {
                "advertise"
            } else {
                "listen"
            }),
            format!(
                "agents cannot dial {dialed}: set advertise to an address of this machine the hosts can reach"
            ),
        ));
    }
    let agent = match &ssh.agent {
        None => None,
        Some(command) => {
            if command
                .get_ref()
                .first()
                .is_none_or(|p| p.trim().is_empty())
            {
                return Err(problem(
                    command.span(),
                    field("agent"),
                    "must name the agent program, e.g. [\"/usr/local/bin/provision\", \"agent\"]",
                ));
            }
            let mut parts = command.get_ref().clone();
            parts[0] = resolve(file, &parts[0]).display().to_string();
            Some(parts)
        }
    };
    let ssh_config = ssh.ssh_config.as_ref().map(|f| resolve(file, f.get_ref()));
    let connect_timeout = seconds(&ssh.connect_timeout_secs, &field("connect_timeout_secs"))?;
    let command_timeout = seconds(&ssh.command_timeout_secs, &field("command_timeout_secs"))?;
    let join_timeout = seconds(&ssh.join_timeout_secs, &field("join_timeout_secs"))?;
    let mut hosts = Vec::with_capacity(ssh.hosts.len());
    for host in &ssh.hosts {
        let value = host.get_ref();
        let mut entry = SshHost::new(
            value.name.get_ref().as_str(),
            value.address.get_ref().as_str(),
            value.user.get_ref().as_str(),
        );
        if let Some(port) = &value.port {
            entry.port = *port.get_ref();
        }
        if let Some(slots) = &value.slots {
            entry.slots = *slots.get_ref();
        }
        entry.identity_file = value
            .identity_file
            .as_ref()
            .map(|f| resolve(file, f.get_ref()));
        entry.claim_root = value.claim_root.as_ref().map(|r| r.get_ref().clone());
        hosts.push(entry);
    }
    let settings = SshSettings {
        hosts,
        known_hosts: resolve(file, ssh.known_hosts.get_ref()),
        listen,
        advertise,
        agent,
        ssh_config,
        connect_timeout,
        command_timeout,
        join_timeout,
        file: file.to_owned(),
    };
    // The plugin's own checks, each placed at the value it is about.
    if let Err(errors) = settings.plugin_config(run_id).validate()
        && let Some(first) = errors.0.first()
    {
        return Err(locate(table, &first.field, &first.problem));
    }
    Ok(settings)
}

/// Places a problem the plugin's validation reported (`hosts[1].port`,
/// `command_timeout`, …) at its value in the file.
fn locate(table: &Spanned<FileSshProvider>, field: &str, message: &str) -> SshFieldError {
    let ssh = table.get_ref();
    let host_field = field.strip_prefix("hosts[").and_then(|rest| {
        let (index, name) = rest.split_once("].")?;
        Some((index.parse::<usize>().ok()?, name))
    });
    if let Some((index, name)) = host_field
        && let Some(host) = ssh.hosts.get(index)
    {
        let value = host.get_ref();
        let span = match name {
            "name" => Some(value.name.span()),
            "address" => Some(value.address.span()),
            "user" => Some(value.user.span()),
            "port" => value.port.as_ref().map(Spanned::span),
            "slots" => value.slots.as_ref().map(Spanned::span),
            "identity_file" => value.identity_file.as_ref().map(Spanned::span),
            "claim_root" => value.claim_root.as_ref().map(Spanned::span),
            _ => None,
        };
        return SshFieldError {
            span: Some(span.unwrap_or_else(|| host.span())),
            field: format!("providers.ssh.host[{index}].{name}"),
            message: message.to_owned(),
        };
    }
    let (span, name) = match field {
        "known_hosts" => (Some(ssh.known_hosts.span()), "known_hosts"),
        "connect_timeout" => (
            ssh.connect_timeout_secs.as_ref().map(Spanned::span),
            "connect_timeout_secs",
        ),
        "command_timeout" => (
            ssh.command_timeout_secs.as_ref().map(Spanned::span),
            "command_timeout_secs",
        ),
        "run_id" => (None, "run"),
        other => (None, other),
    };
    SshFieldError {
        span: Some(span.unwrap_or_else(|| table.span())),
        field: if name == "run" {
            "run".to_owned()
        } else {
            format!("providers.ssh.{name}")
        },
        message: message.to_owned(),
    }
}

impl SshSettings {
    /// The plugin's configuration for `run_id`.
    fn plugin_config(&self, run_id: &RunId) -> SshPluginConfig {
        let mut config = SshPluginConfig::new(
            run_id.clone(),
            format!("[providers.ssh] of {}", self.file.display()),
            self.hosts.clone(),
            self.known_hosts.clone(),
        );
        config.ssh_config_file = self.ssh_config.clone();
        if let Some(timeout) = self.connect_timeout {
            config.connect_timeout = timeout;
        }
        if let Some(timeout) = self.command_timeout {
            config.command_timeout = timeout;
        }
        config
    }
}

/// Starts the ssh plugin of `[providers.ssh]` for `run_id`: binds the swarm
/// listener and reads the agent (by default this binary, run as
/// `provision agent`), so a listen address in use or an unreadable agent is
/// an error before anything else starts.
///
/// # Errors
/// When the agent cannot be read or the listener cannot be bound.
async fn start_ssh(
    run_id: &RunId,
    secret: RunSecret,
    settings: &SshSettings,
) -> anyhow::Result<PluginEntry> {
    // The table's agent command, else the slim `provision-agent` beside
    // this binary (design §18): never the whole CLI when the slim one is there.
    let (program, args) = match &settings.agent {
        Some(command) => (PathBuf::from(&command[0]), command[1..].to_vec()),
        None => crate::agent_binary::remote_agent_command()?,
    };
    let mut agent = SshAgentConfig::new(program, args, secret, settings.listen);
    agent.advertised = settings.advertise;
    if let Some(timeout) = settings.join_timeout {
        agent.join_timeout = timeout;
    }
    let plugin = SshPlugin::start(settings.plugin_config(run_id), agent)
        .await
        .map_err(|e| anyhow::anyhow!("[providers.ssh]: {e}"))?;
    let watch = plugin.start_watch(LOSS_WATCH_INTERVAL);
    tracing::info!(
        hosts = settings.hosts.len(),
        swarm = ?plugin.swarm().map(|s| s.advertised()),
        "ssh provider started"
    );
    Ok(PluginEntry::new(plugin).with_shutdown(move || async move { drop(watch) }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shape_file::{ShapeSource, parse};

    const GOOD: &str = r#"
run = "fleet"

[providers.ssh]
known_hosts = "keys/known_hosts"
listen = "10.0.0.1:7100"
ssh_config = "/dev/null"
join_timeout_secs = 20

[[providers.ssh.host]]
name = "gpu-1"
address = "10.0.0.11"
user = "ops"
identity_file = "/keys/id"
slots = 2

[[providers.ssh.host]]
name = "gpu-2"
address = "10.0.0.12"
port = 2222
user = "ops"

[[group]]
id = "trainer"
count = 3
provider = "ssh"
"#;

    fn parse_text(text: &str) -> Result<ShapeSource, ShapeFileError> {
        parse(
            Path::new("/etc/fleet/shape.toml"),
            text,
            &super::super::kinds(),
        )
    }

    fn ssh_of(source: &ShapeSource) -> SshSettings {
        source
            .settings::<SshSettings>()
            .expect("ssh settings")
            .clone()
    }

    fn check_error(text: &str, line: usize, field: &str, says: &str) {
        let error = parse_text(text).expect_err("invalid");
        let shown = error.to_string();
        assert_eq!(error.line, Some(line), "{shown}");
        assert_eq!(error.field.as_deref(), Some(field), "{shown}");
        assert!(shown.contains(says), "{says:?} missing from {shown}");
        assert!(shown.starts_with("/etc/fleet/shape.toml:"), "{shown}");
    }

    #[test]
    fn a_valid_inventory_is_read_with_defaults_and_paths_beside_the_file() {
        let source = parse_text(GOOD).expect("valid");
        let ssh = ssh_of(&source);
        assert_eq!(
            ssh.known_hosts,
            PathBuf::from("/etc/fleet/keys/known_hosts")
        );
        assert_eq!(ssh.listen, "10.0.0.1:7100".parse().expect("address"));
        assert_eq!(ssh.advertise, None);
        assert_eq!(ssh.agent, None);
        assert_eq!(ssh.join_timeout, Some(Duration::from_secs(20)));
        assert_eq!(ssh.hosts.len(), 2);
        assert_eq!(ssh.hosts[0].port, 22);
        assert_eq!(ssh.hosts[0].slots, 2);
        assert_eq!(ssh.hosts[0].identity_file, Some(PathBuf::from("/keys/id")));
        assert_eq!(ssh.hosts[1].port, 2222);
        assert_eq!(ssh.hosts[1].slots, 1);
        assert_eq!(source.groups[0].template.provider, KIND);
    }

    #[test]
    fn an_ssh_group_without_the_table_names_the_served_kinds() {
        let text = "run = \"r\"\n[[group]]\nid = \"web\"\ncount = 1\nprovider = \"ssh\"\n";
        let error = parse_text(text).expect_err("no ssh table");
        assert_eq!(
            error.to_string(),
            "/etc/fleet/shape.toml:5:12: field `group[0].provider`: group \"web\" uses provider \"ssh\", but the file has no [providers.ssh] table"
        );
    }

    #[test]
    fn bad_fields_are_located_errors() {
        check_error(
            &GOOD.replace("slots = 2", "slots = 0"),
            15,
            "providers.ssh.host[0].slots",
            "must be between 1 and",
        );
        check_error(
            &GOOD.replace("port = 2222", "port = 0"),
            20,
            "providers.ssh.host[1].port",
            "between 1 and 65535",
        );
        check_error(
            &GOOD.replace("name = \"gpu-2\"", "name = \"gpu-1\""),
            18,
            "providers.ssh.host[1].name",
            "appears twice",
        );
        check_error(
            &GOOD.replace("listen = \"10.0.0.1:7100\"", "listen = \"nowhere\""),
            6,
            "providers.ssh.listen",
            "is not an address with a port",
        );
        check_error(
            &GOOD.replace("listen = \"10.0.0.1:7100\"", "listen = \"0.0.0.0:7100\""),
            6,
            "providers.ssh.listen",
            "agents cannot dial 0.0.0.0:7100",
        );
        check_error(
            &GOOD.replace("join_timeout_secs = 20", "join_timeout_secs = 0"),
            8,
            "providers.ssh.join_timeout_secs",
            "at least 1 second",
        );
        check_error(
            &GOOD.replace("slots = 2", "slots = 2\nsolts = 3"),
            16,
            "providers.ssh.host[0].solts",
            "unknown field `solts`",
        );
        check_error(
            &GOOD.replace("ssh_config", "ssh_konfig"),
            7,
            "providers.ssh.ssh_konfig",
            "unknown field `ssh_konfig`",
        );
    }

    #[test]
    fn a_wildcard_listen_address_needs_an_advertised_one() {
        let text = GOOD.replace(
            "listen = \"10.0.0.1:7100\"",
            "listen = \"0.0.0.0:7100\"\nadvertise = \"10.0.0.1:0\"",
        );
        let ssh = ssh_of(&parse_text(&text).expect("valid"));
        assert!(ssh.listen.ip().is_unspecified());
        assert_eq!(ssh.advertise, Some("10.0.0.1:0".parse().expect("address")));
    }
}
