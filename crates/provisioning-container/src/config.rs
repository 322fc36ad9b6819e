//! Configuration: the plugin's settings ([`ContainerPluginConfig`]), a
//! group's `container` table ([`GroupShape`]) and how that table travels
//! inside a node template (as `container.*` labels).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use provisioning::RunId;
use provisioning_agent::RunSecret;
use serde::Deserialize;

/// The label prefix under which a group's `container` table travels in its
/// node template (`container.image`, `container.env.NAME`, …).
pub const LABEL_PREFIX: &str = "container.";

/// The Docker socket, used when neither the configuration nor `DOCKER_HOST`
/// names another.
pub const DEFAULT_SOCKET: &str = "unix:///var/run/docker.sock";

/// The default bound on one Engine API call.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// The default pause between two looks for containers that ended or went.
pub const DEFAULT_WATCH_INTERVAL: Duration = Duration::from_secs(1);

/// The default time a stopped container's processes get between `SIGTERM`
/// and `SIGKILL`.
pub const DEFAULT_STOP_GRACE: Duration = Duration::from_secs(10);

/// Where a bind-mounted agent appears inside every container.
pub const AGENT_MOUNT_PATH: &str = "/opt/provision/provision-agent";

/// The most mounts one group may ask for.
pub const MOUNTS_MAX: usize = 64;

/// The most environment variables one group may set.
pub const ENV_VARS_MAX: usize = 256;

/// `[providers.container] socket = …`: the Engine API endpoint, as
/// configured, from `DOCKER_HOST`, or [`DEFAULT_SOCKET`]. Only `unix://`
/// sockets (or plain paths) are served.
pub fn default_socket() -> String {
    std::env::var("DOCKER_HOST")
        .ok()
        .filter(|host| !host.is_empty())
        .unwrap_or_else(|| DEFAULT_SOCKET.to_owned())
}

/// The socket path of a `unix://` address or plain path; `None` for any
/// other scheme.
pub fn socket_path(socket: &str) -> Option<PathBuf> {
    if let Some(path) = socket.strip_prefix("unix://") {
        return (!path.is_empty()).then(|| PathBuf::from(path));
    }
    (socket.starts_with('/')).then(|| PathBuf::from(socket))
}

/// Where the node agent comes from inside a container.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AgentSource {
    /// This executable of the controller's machine, bind-mounted read-only
    /// at [`AGENT_MOUNT_PATH`] into every container. The image must hold
    /// the C libraries it links (`ldd` lists them) and a POSIX `sh`.
    Mount(PathBuf),
    /// An executable the image already holds, at this path.
    InImage(String),
}

/// A group's `container` table: what one node's container is made of.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct GroupShape {
    /// The image (required): it must be present on the engine; the plugin
    /// never pulls.
    pub image: Option<String>,
    /// CPUs (a fraction allowed), as the engine's CPU quota.
    pub cpus: Option<f64>,
    /// The memory limit: bytes, or a number with `k`, `m` or `g`.
    pub memory: Option<String>,
    /// The network to attach to (default: the engine's `bridge`).
    pub network: Option<String>,
    /// Bind mounts in the engine's syntax, `host:container[:ro]`.
    pub mounts: Option<Vec<String>>,
    /// Environment variables of the container.
    pub env: Option<BTreeMap<String, String>>,
    /// The user the container (and so the agent) runs as.
    pub user: Option<String>,
}

/// A `container.*` label that does not name a field of [`GroupShape`], or
/// a value that does not fit its field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {problem}")]
pub struct ShapeError {
    /// The field (`image`, `env.NAME`, `mounts[2]`, …).
    pub field: String,
    /// What is wrong with it.
    pub problem: String,
}

fn shape_error(field: impl Into<String>, problem: impl Into<String>) -> ShapeError {
    ShapeError {
        field: field.into(),
        problem: problem.into(),
    }
}

/// Whether `name` can be a name the engine accepts in a reference
/// (an image, a network, a user): no whitespace or control characters.
fn is_plain(value: &str) -> bool {
    !value.is_empty() && !value.chars().any(|c| c.is_whitespace() || c.is_control())
}

/// Bytes of a memory size such as `512m`, `1g`, `1048576`.
pub fn parse_memory(text: &str) -> Option<i64> {
    let lower = text.trim().to_ascii_lowercase();
    let lower = lower.strip_suffix('b').unwrap_or(&lower);
    let (digits, unit) = match lower.char_indices().last()? {
        (i, 'k') => (&lower[..i], 1i64 << 10),
        (i, 'm') => (&lower[..i], 1 << 20),
        (i, 'g') => (&lower[..i], 1 << 30),
        _ => (lower, 1),
    };
    let value: i64 = digits.parse().ok().filter(|v| *v > 0)?;
    value.checked_mul(unit)
}

impl GroupShape {
    /// Checks every field; the errors name the field.
    ///
    /// # Errors
    /// Every field whose value the engine would refuse or misread.
    pub fn validate(&self) -> Result<(), Vec<ShapeError>> {
        let mut errors = Vec::new();
        match &self.image {
            None => errors.push(shape_error(
                "image",
                "missing: every container group names its image",
            )),
            Some(image) if !is_plain(image) => {
                errors.push(shape_error("image", "must be non-empty without whitespace"))
            }
            Some(_) => {}
        }
        if let Some(cpus) = self.cpus
            && !(cpus.is_finite() && cpus > 0.0 && cpus <= 4096.0)
        {
            errors.push(shape_error(
                "cpus",
                "must be a number above 0 (fractions allowed)",
            ));
        }
        if let Some(memory) = &self.memory
            && parse_memory(memory).is_none()
        {
            errors.push(shape_error(
                "memory",
                format!("{memory:?} is not a size (bytes, or a number with k, m or g)"),
            ));
        }
        if let Some(network) = &self.network
            && !is_plain(network)
        {
            errors.push(shape_error(
                "network",
                "must be non-empty without whitespace",
            ));
        }
        if let Some(user) = &self.user
            && !is_plain(user)
        {
            errors.push(shape_error("user", "must be non-empty without whitespace"));
        }
        let mounts = self.mounts.as_deref().unwrap_or_default();
        if mounts.len() > MOUNTS_MAX {
            errors.push(shape_error(
                "mounts",
                format!("{} mounts; at most {MOUNTS_MAX}", mounts.len()),
            ));
        }
        for (i, mount) in mounts.iter().enumerate() {
            if let Err(problem) = check_mount(mount) {
                errors.push(shape_error(format!("mounts[{i}]"), problem));
            }
        }
        let env = self.env.as_ref();
        if env.is_some_and(|env| env.len() > ENV_VARS_MAX) {
            errors.push(shape_error(
                "env",
                format!("more than {ENV_VARS_MAX} variables"),
            ));
        }
        for (name, value) in env.into_iter().flatten() {
            let good_name = !name.is_empty()
                && !name.starts_with(|c: char| c.is_ascii_digit())
                && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
            if !good_name {
                errors.push(shape_error(
                    format!("env.{name}"),
                    "a variable name is letters, digits and '_', not starting with a digit",
                ));
            } else if value.contains('\0') {
                errors.push(shape_error(format!("env.{name}"), "contains a NUL byte"));
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }

    /// The table as template labels (each set field under [`LABEL_PREFIX`];
    /// the mounts as one JSON array, each variable as `env.NAME`).
    pub fn to_labels(&self) -> BTreeMap<String, String> {
        let mut labels = BTreeMap::new();
        let mut put = |name: &str, value: Option<String>| {
            if let Some(value) = value {
                labels.insert(format!("{LABEL_PREFIX}{name}"), value);
            }
        };
        put("image", self.image.clone());
        put("cpus", self.cpus.map(|c| c.to_string()));
        put("memory", self.memory.clone());
        put("network", self.network.clone());
        put("user", self.user.clone());
        put(
            "mounts",
            self.mounts
                .as_ref()
                .map(|m| serde_json::Value::from(m.clone()).to_string()),
        );
        for (name, value) in self.env.iter().flatten() {
            put(&format!("env.{name}"), Some(value.clone()));
        }
        labels
    }

    /// The table back from template labels; labels without the prefix are
    /// not the plugin's and are ignored. The result is validated.
    ///
    /// # Errors
    /// An unknown `container.*` label or a value that does not fit.
    pub fn from_labels(labels: &BTreeMap<String, String>) -> Result<Self, Vec<ShapeError>> {
        let mut shape = GroupShape::default();
        let mut errors = Vec::new();
        for (label, value) in labels {
            let Some(name) = label.strip_prefix(LABEL_PREFIX) else {
                continue;
            };
            match name {
                "image" => shape.image = Some(value.clone()),
                "cpus" => match value.parse::<f64>() {
                    Ok(cpus) => shape.cpus = Some(cpus),
                    Err(_) => errors.push(shape_error("cpus", "must be a number")),
                },
                "memory" => shape.memory = Some(value.clone()),
                "network" => shape.network = Some(value.clone()),
                "user" => shape.user = Some(value.clone()),
                "mounts" => match serde_json::from_str::<Vec<String>>(value) {
                    Ok(mounts) => shape.mounts = Some(mounts),
                    Err(_) => errors.push(shape_error("mounts", "must be a list of strings")),
                },
                _ => match name.strip_prefix("env.") {
                    Some(var) => {
                        shape
                            .env
                            .get_or_insert_with(BTreeMap::new)
                            .insert(var.to_owned(), value.clone());
                    }
                    None => errors.push(shape_error(
                        name,
                        "unknown; a group's container table takes image, cpus, memory, network, mounts, env and user",
                    )),
                },
            }
        }
        if let Err(more) = shape.validate() {
            errors.extend(more);
        }
        if errors.is_empty() {
            Ok(shape)
        } else {
            Err(errors)
        }
    }

    /// The memory limit in bytes, if set and valid.
    pub fn memory_bytes(&self) -> Option<i64> {
        self.memory.as_deref().and_then(parse_memory)
    }
}

/// Checks a bind mount `host:container[:ro|rw]`: both paths absolute.
fn check_mount(mount: &str) -> Result<(), String> {
    let parts: Vec<&str> = mount.split(':').collect();
    let (host, inside, mode) = match parts.as_slice() {
        [host, inside] => (*host, *inside, None),
        [host, inside, mode] => (*host, *inside, Some(*mode)),
        _ => return Err(format!("{mount:?} is not host:container[:ro]")),
    };
    if !host.starts_with('/') || !inside.starts_with('/') {
        return Err(format!("{mount:?}: both paths must be absolute"));
    }
    if let Some(mode) = mode
        && !matches!(mode, "ro" | "rw")
    {
        return Err(format!("{mount:?}: the mode is ro or rw, not {mode:?}"));
    }
    if inside == AGENT_MOUNT_PATH {
        return Err(format!(
            "{mount:?}: {AGENT_MOUNT_PATH} is where the node agent is mounted"
        ));
    }
    Ok(())
}

/// How a [`ContainerPlugin`](crate::ContainerPlugin) is set up.
#[derive(Clone, Debug)]
pub struct ContainerPluginConfig {
    /// The run whose containers the plugin manages.
    pub run_id: RunId,
    /// The run's secret; agents' join credentials derive from it.
    pub secret: RunSecret,
    /// The Engine API socket (`unix:///…` or a path); see [`default_socket`].
    pub socket: String,
    /// Where the agent comes from inside each container.
    pub agent: AgentSource,
    /// The agent's leading arguments (`["agent"]` for the `provision`
    /// binary; none for `provision-agent`).
    pub agent_args: Vec<String>,
    /// The address the swarm listener binds. Containers reach the host at
    /// their network's gateway, so this is usually `0.0.0.0:PORT` or the
    /// gateway's address.
    pub listen: SocketAddr,
    /// The address agents dial (`None`: the bound address).
    pub advertise: Option<SocketAddr>,
    /// Bound on one Engine API call.
    pub call_timeout: Duration,
    /// Pause between two looks for containers that ended or went.
    pub watch_interval: Duration,
    /// What `destroy_node` gives a container between `SIGTERM` and `SIGKILL`.
    pub stop_grace: Duration,
    /// How long a dropped agent may take to re-join before it is lost.
    pub rejoin_grace: Duration,
    /// How long a started agent may take to join before its bootstrap fails.
    pub join_timeout: Duration,
}

impl ContainerPluginConfig {
    /// A configuration with the defaults: the default socket, listen on
    /// `0.0.0.0:0` (advertise it explicitly: a container cannot dial a
    /// wildcard), default timeouts.
    pub fn new(run_id: RunId, secret: RunSecret, agent: AgentSource) -> Self {
        ContainerPluginConfig {
            run_id,
            secret,
            socket: default_socket(),
            agent,
            agent_args: Vec::new(),
            listen: SocketAddr::from(([0, 0, 0, 0], 0)),
            advertise: None,
            call_timeout: DEFAULT_CALL_TIMEOUT,
            watch_interval: DEFAULT_WATCH_INTERVAL,
            stop_grace: DEFAULT_STOP_GRACE,
            rejoin_grace: provisioning_agent::remote::DEFAULT_REJOIN_GRACE,
            join_timeout: Duration::from_secs(60),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_survives_the_trip_through_labels() {
        let shape = GroupShape {
            image: Some("provtest:1".into()),
            cpus: Some(0.5),
            memory: Some("256m".into()),
            network: Some("provnet".into()),
            mounts: Some(vec!["/data:/data:ro".into()]),
            env: Some(BTreeMap::from([("MODE".into(), "fast lane".into())])),
            user: Some("1000:1000".into()),
        };
        let mut labels = shape.to_labels();
        labels.insert("team".into(), "not ours".into());
        assert_eq!(GroupShape::from_labels(&labels).unwrap(), shape);
        assert_eq!(shape.memory_bytes(), Some(256 << 20));
    }

    #[test]
    fn every_bad_field_is_named() {
        let shape: GroupShape = toml::from_str(
            "cpus = 0\nmemory = \"lots\"\nmounts = [\"data:/data\", \"/a:/b:rx\"]\nenv = { \"1X\" = \"v\" }\nuser = \"a b\"",
        )
        .unwrap();
        let errors = shape.validate().unwrap_err();
        let fields: Vec<&str> = errors.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "image",
                "cpus",
                "memory",
                "user",
                "mounts[0]",
                "mounts[1]",
                "env.1X"
            ]
        );
        assert!(toml::from_str::<GroupShape>("gpus = 2").is_err());
        let labels = BTreeMap::from([("container.gpus".to_owned(), "2".to_owned())]);
        assert_eq!(
            GroupShape::from_labels(&labels).unwrap_err()[0].field,
            "gpus"
        );
    }

    #[test]
    fn memory_sizes_and_sockets_parse() {
        assert_eq!(parse_memory("1g"), Some(1 << 30));
        assert_eq!(parse_memory("512MB"), Some(512 << 20));
        assert_eq!(parse_memory("4096"), Some(4096));
        assert_eq!(parse_memory("0"), None);
        assert_eq!(parse_memory("m"), None);
        assert_eq!(
            socket_path("unix:///run/podman/podman.sock"),
            Some(PathBuf::from("/run/podman/podman.sock"))
        );
        assert_eq!(socket_path("tcp://host:2375"), None);
    }
}
