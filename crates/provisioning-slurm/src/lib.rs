//! The slurm provider: every node is a one-node Slurm job allocation, and
//! its agent runs as a job step inside it that joins the run's swarm over
//! TCP.
//!
//! Where to start reading:
//! - [`SlurmPlugin`] — the [`ProvisionPlugin`](provisioning_provider::ProvisionPlugin)
//!   implementation (kind `slurm`): adoption and listing by job name,
//!   endpoint once the job runs, the agent as an overlapping job step,
//!   losses when a job ends by itself.
//! - [`cli`] — the seam to Slurm's command-line tools ([`SlurmCli`]), with
//!   bounded commands; [`parse`] — their `|`-delimited output, job names and
//!   the definite/ambiguous classification of their errors, unit-tested on
//!   recorded outputs.
//! - [`config`] — `[providers.slurm]` settings ([`SlurmSettings`]), a group's
//!   `slurm` table ([`GroupShape`], carried in the node template as
//!   `slurm.*` labels) and [`SlurmPluginConfig`].
//! - `testbed` (feature `testbed`) — a real Slurm cluster on this machine
//!   for tests and benchmarks.

pub mod cli;
pub mod config;
pub mod parse;
mod plugin;
#[cfg(feature = "testbed")]
pub mod testbed;

pub use cli::{CommandFailure, CommandOutput, SlurmCli, SystemCli, Tool};
pub use config::{GroupShape, LABEL_PREFIX, SlurmPluginConfig, SlurmSettings};
pub use plugin::{PROVIDER_KIND, SlurmError, SlurmPlugin};
