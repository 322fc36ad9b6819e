//! The `container` provider of `provisioning`: nodes are containers on a
//! Docker Engine API — Docker's `dockerd`, or Podman's
//! `podman system service`, which serves the same API.
//!
//! [`ContainerPlugin`] serves one run on one engine socket
//! ([`ContainerPluginConfig`]). A lease is a container labelled with the
//! run, node and attempt, so adoption and listing work from any controller,
//! also after a restart. The node agent runs inside the container and dials
//! the controller's swarm listener. See [`ContainerPlugin`] for the details
//! and how failures are classified.
//!
//! # A group of containers
//!
//! ```toml
//! [providers.container]
//! socket = "unix:///run/podman/podman.sock"   # default: DOCKER_HOST, else the Docker socket
//! listen = "0.0.0.0:7300"                      # the swarm listener the agents dial
//! advertise = "172.17.0.1:7300"                # the host as the containers see it
//!
//! [[group]]
//! id = "worker"
//! count = 4
//! provider = "container"
//! [group.container]
//! image = "worker:1"          # required, must be on the engine (never pulled)
//! cpus = 0.5
//! memory = "256m"
//! network = "bridge"
//! mounts = ["/srv/data:/data:ro"]
//! env = { MODE = "batch" }
//! user = "1000:1000"
//! ```
//!
//! What the image needs: a POSIX `sh` with `cat`, `mktemp`, `rm` and
//! `sleep`, and either the agent's C libraries (the agent is bind-mounted
//! read-only from beside the controller) or the agent itself
//! ([`AgentSource`]).

mod config;
mod engine;
mod plugin;
#[cfg(feature = "testbed")]
pub mod testbed;

pub use config::{
    AGENT_MOUNT_PATH, AgentSource, ContainerPluginConfig, DEFAULT_CALL_TIMEOUT, DEFAULT_SOCKET,
    DEFAULT_STOP_GRACE, DEFAULT_WATCH_INTERVAL, ENV_VARS_MAX, GroupShape, LABEL_PREFIX, MOUNTS_MAX,
    ShapeError, default_socket, parse_memory, socket_path,
};
pub use plugin::{
    ContainerError, ContainerPlugin, FaultMode, FaultStep, LABEL_ATTEMPT, LABEL_MANAGED_BY,
    LABEL_NODE, LABEL_RUN, MANAGED_BY, PROVIDER_KIND, container_name, with_refused_engine,
};
