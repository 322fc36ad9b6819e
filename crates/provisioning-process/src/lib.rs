//! The embedded local provider of `provisioning`: every node is a local
//! process.
//!
//! Where to start reading:
//! - [`ProcessPlugin`] — the [`ProvisionPlugin`](provisioning_provider::ProvisionPlugin)
//!   implementation. A lease is a node agent process in its own process group,
//!   keyed by `(run, node, attempt)`; bootstrap talks to the agent over a
//!   loopback control connection; the agent then joins the run's swarm on the
//!   plugin's swarm listener with a per-node credential.
//! - [`agent`] — the node agent's entry point (the other end of every
//!   connection). The `provision-node-agent` binary and `provision agent`
//!   both call [`agent::main`].
//! - [`wire`] — the line-JSON messages between the two.
//! - [`credential`] — the run secret and the per-node credentials derived
//!   from it.
//! - [`os`] — counting and signalling a run's processes through `/proc`,
//!   independently of the plugin's own bookkeeping.
//!
//! By default no process outlives its controller: every agent asks the
//! kernel for a signal when its parent dies and then takes its whole process
//! group down, and dropping the plugin kills every group it started. With
//! [`AgentLifetime::Detached`] agents outlive the controller instead, and a
//! restarted plugin of the same run and secret adopts and re-attaches them.

pub mod agent;
pub mod credential;
mod node;
pub mod os;
mod plugin;
pub mod remote;
mod scan;
mod session;
mod spawner;
mod state;
mod swarm;
pub mod wire;

pub use credential::{NodeCredential, RunSecret};
pub use plugin::{
    AgentCommand, AgentLifetime, DEFAULT_STOP_GRACE, ENDPOINT_PROBE_INTERVAL, PROVIDER_KIND,
    ProcessError, ProcessPlugin, ProcessPluginConfig,
};
