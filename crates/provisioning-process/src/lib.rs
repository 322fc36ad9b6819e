//! The embedded local provider of `provisioning`: every node is a local
//! process.
//!
//! Where to start reading:
//! - [`ProcessPlugin`] — the [`ProvisionPlugin`](provisioning_provider::ProvisionPlugin)
//!   implementation. A lease is a node agent process in its own process group,
//!   keyed by `(run, node, attempt)`; bootstrap talks to the agent over a
//!   loopback control connection; the agent then joins the run's swarm on the
//!   plugin's swarm listener with a per-node credential.
//! - The node agent (the other end of every connection), its wire protocol,
//!   the run's credentials, the swarm listener and `/proc` tagging live in
//!   [`provisioning_agent`]: the plugin starts the `provision-agent` binary
//!   (or `provision agent`), and admits joins on the listener through a gate
//!   of its own. [`provisioning_agent::os`] counts and signals a run's
//!   processes independently of the plugin's own bookkeeping.
//!
//! By default no process outlives its controller: every agent asks the
//! kernel for a signal when its parent dies and then takes its whole process
//! group down, and dropping the plugin kills every group it started. With
//! [`AgentLifetime::Detached`] agents outlive the controller instead, and a
//! restarted plugin of the same run and secret adopts and re-attaches them.

mod addresses;
mod node;
mod plugin;
mod scan;
mod session;
mod spawner;
mod state;
mod swarm;

pub use plugin::{
    AgentCommand, AgentLifetime, DEFAULT_STOP_GRACE, ENDPOINT_PROBE_INTERVAL, PROVIDER_KIND,
    ProcessError, ProcessPlugin, ProcessPluginConfig,
};
