//! The `ssh` provider of `provisioning`: a static fleet of machines the
//! user already owns, reached with the system OpenSSH client.
//!
//! [`SshPlugin`] serves one run over an inventory ([`SshPluginConfig`]: hosts
//! with address, port, user, optional identity file and a number of slots).
//! A lease is a slot claimed **on the host** by an atomic `mkdir` of a claim
//! directory keyed by run, node and attempt, so adoption and listing work
//! from any controller, also after a restart. See [`SshPlugin`] for the
//! layout, the host key policy and how failures are classified.
//!
//! # Your own machines over SSH
//!
//! An inventory, as the shape file spells it (the `provision` CLI parses it;
//! the host fields map one to one onto [`SshHost`]):
//!
//! ```toml
//! [providers.ssh]
//! known_hosts = "~/.ssh/known_hosts"   # required: every host key is checked
//! listen = "10.0.0.1:7100"             # the swarm listener the agents join
//! connect_timeout_secs = 5
//!
//! [[providers.ssh.host]]
//! name = "gpu-1"
//! address = "10.0.0.11"
//! port = 22
//! user = "ops"
//! identity_file = "~/.ssh/id_ed25519"  # optional
//! slots = 2
//!
//! [[group]]
//! id = "trainer"
//! count = 3
//! provider = "ssh"
//! ```
//!
//! What must be on a host: an OpenSSH server that accepts the user's key,
//! a POSIX `sh`, and util-linux (`flock`, `setsid`) and coreutils
//! (`sha256sum`). Claims live under `~/.provisioning-ssh/claims` of the
//! SSH user (or the host's `claim_root`); removing a claim directory by hand
//! frees its slot and is reported as a lost node by a watching plugin.
//!
//! How host keys are checked: every call runs `ssh` with
//! `StrictHostKeyChecking=yes`, `UserKnownHostsFile=` the configured file
//! and no global file, `BatchMode=yes` (no prompt, ever) and
//! `UpdateHostKeys=no`. A host whose key is missing from that file or
//! differs from it is refused with a definite error that starts with
//! `HOST KEY VERIFICATION FAILED` and names the host and the file; add the
//! key after checking it out of band (`ssh-keyscan -p PORT HOST` prints it).
//!
//! The system `ssh` is used, not a Rust SSH library, so that the user's
//! `~/.ssh/config`, keys, agent and `ProxyJump` keep working and the
//! security-sensitive parts (key exchange, host key checking) are the
//! system's own. Each call is one `ssh … sh -s` with its script on standard
//! input (nothing it carries appears on a command line); calls are not yet
//! multiplexed over a master connection.
//!
//! # Bootstrap
//! [`SshPlugin::start`] gives the plugin a node agent ([`SshAgentConfig`]:
//! the executable, for `provision` the running binary itself, and the
//! address of the swarm listener the plugin owns). `start_bootstrap`
//! connects with the host key verified, runs the verify commands, installs
//! the agent if its content hash is absent on the host, and starts it
//! detached in the remote boot mode of `provisioning_agent::agent` (its
//! boot order and per-attempt credential in a `0600` file written from the
//! script on standard input). The agent's join over TCP is reported as the
//! node's `Joined`; a lost agent or an exited workload is a lost node.
//!
//! # Not yet done
//! - Connection multiplexing (`ControlMaster`): every call is a full
//!   OpenSSH handshake.

mod agent;
mod config;
mod plugin;
mod script;
mod ssh;

pub use agent::{DEFAULT_ADOPT_WAIT, DEFAULT_JOIN_TIMEOUT, SshAgentConfig, SshStartError};
pub use config::{
    ConfigError, ConfigErrors, DEFAULT_CLAIM_ROOT, DEFAULT_COMMAND_TIMEOUT,
    DEFAULT_CONNECT_TIMEOUT, MAX_SLOTS_PER_HOST, SshHost, SshPluginConfig,
};
pub use plugin::{FaultMode, FaultStep, PROVIDER_KIND, SshPlugin, WatchHandle};
