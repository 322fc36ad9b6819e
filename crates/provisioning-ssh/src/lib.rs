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
//! The system `ssh` is used (not a Rust SSH library) so that the user's
//! `~/.ssh/config`, keys, agent and `ProxyJump` keep working; every call is
//! one `ssh … sh -s` with its script on standard input.

mod config;
mod plugin;
mod script;
mod ssh;

pub use config::{
    ConfigError, ConfigErrors, DEFAULT_CLAIM_ROOT, DEFAULT_COMMAND_TIMEOUT,
    DEFAULT_CONNECT_TIMEOUT, MAX_SLOTS_PER_HOST, SshHost, SshPluginConfig,
};
pub use plugin::{FaultMode, FaultStep, PROVIDER_KIND, SshPlugin, WatchHandle};
