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
//! An inventory, as the shape file is meant to spell it (the CLI does not
//! parse it yet; the fields map one to one onto [`SshHost`]):
//!
//! ```toml
//! [providers.ssh]
//! known_hosts = "~/.ssh/known_hosts"   # required: every host key is checked
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
//! # Not yet done
//! - `start_bootstrap` runs the verify commands and starts
//!   `boot.start_command` detached, recorded in the claim; it does not yet
//!   start the node agent and wait for its swarm join.
//!   [`SshPlugin::install_agent`] (upload once per content hash) is the
//!   first piece of that; the others exist and are tested on loopback
//!   (`tests/remote_agent.rs`): the controller's listener
//!   `provisioning_process::remote::RemoteSwarm` and the agent's remote boot
//!   mode (`provisioning_process::agent::remote`, the
//!   `provision-remote-agent` binary of this crate), which takes its boot
//!   order from a `0600` file, joins over TCP and re-dials for a bounded
//!   window.
//! - Connection multiplexing (`ControlMaster`), the Level 3 battery over
//!   SSH, the CLI's `[providers.ssh]` table.

mod config;
mod plugin;
mod script;
mod ssh;

pub use config::{
    ConfigError, ConfigErrors, DEFAULT_CLAIM_ROOT, DEFAULT_COMMAND_TIMEOUT,
    DEFAULT_CONNECT_TIMEOUT, MAX_SLOTS_PER_HOST, SshHost, SshPluginConfig,
};
pub use plugin::{FaultMode, FaultStep, PROVIDER_KIND, SshPlugin, WatchHandle};
