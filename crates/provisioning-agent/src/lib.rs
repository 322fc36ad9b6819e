//! The node agent of `provisioning` and everything its two ends share.
//!
//! Where to start reading:
//! - [`agent`] — the node agent's entry point, [`agent::main`]: the
//!   `provision-agent` binary (and `provision agent`) run it. It boots one
//!   node: on this machine for the process provider (configured through its
//!   environment, booted over a loopback control connection), or on another
//!   machine for a remote provider (SSH, Slurm: its boot order in a file,
//!   see [`agent::remote`]).
//! - [`wire`] — the line-JSON messages between controller and agent, and
//!   [`codec`] — the one bounded, cancel-safe JSON-lines codec every reader
//!   and writer of them uses.
//! - [`credential`] — the run secret and the per-node credentials derived
//!   from it.
//! - [`swarm`] — the controller's swarm listener, where agents join with
//!   their credentials; [`remote`] — its use by remote providers
//!   ([`RemoteSwarm`](remote::RemoteSwarm)). The process provider uses the
//!   listener with a gate of its own. [`peers`] — the run's membership the
//!   listener pushes to every member, which the agent writes to the peers
//!   file.
//! - [`os`] — the tags every process of a node carries, and counting and
//!   signalling tagged processes through `/proc`: the agent finds its own
//!   node's processes with it, the process provider a run's.

pub mod agent;
pub mod codec;
pub mod credential;
pub mod os;
pub mod peers;
pub mod remote;
pub mod swarm;
pub mod wire;

pub use agent::main;
pub use credential::{NodeCredential, RunSecret};
