//! The host: a tokio task that owns the driver, the executor and the plugins.
//!
//! [`Host::start`] builds the pieces and spawns the host loop. The loop is
//! the only code that touches the [`ClusterDriver`]; everyone else talks to
//! it through a [`HostHandle`] (commands over a bounded channel, progress
//! over a watch channel).
//!
//! # The loop
//! The loop sleeps until one of these happens: the executor reports a
//! result (its notify callback pings a [`Notify`]), a plugin reports an
//! observation, a command arrives, the timer armed at
//! [`ClusterDriver::requeue_at`] fires, the periodic safety tick fires (it
//! forces a full pass), or shutdown is requested. After every wake it folds
//! executor results, folds observations, expires operations whose stored
//! deadline passed, drives the driver until it is blocked, publishes a
//! snapshot when one is due and re-arms the timer.
//!
//! # Publishing
//! A snapshot lists every node. The loop keeps a progress view
//! ([`crate::status`]) with every node's status, brought up to date only for
//! the nodes the driver's change tracker names (one status built per changed
//! node and snapshot; the whole view after a new desired generation), and a
//! snapshot shares the view's node statuses, so assembling one copies a
//! pointer per node. The loop publishes only when something changed since
//! the last (the change tracker says so, or the phase or the orphan
//! bookkeeping moved), and at most once per [`publish_interval`]: ten times
//! what assembling the last one cost, capped at [`PUBLISH_INTERVAL_MAX`]. A
//! small cluster publishes after every wake; a large one spends at most about
//! a tenth of its time assembling snapshots, and a change held back is
//! published when the interval ends (the loop arms a timer for it), so a
//! subscriber is never more than [`PUBLISH_INTERVAL_MAX`] behind. Status
//! queries always build a fresh, whole one (with the nodes' histories).
//!
//! # Shutdown
//! A graceful shutdown applies an empty shape at the next generation and
//! keeps reconciling until no node is left, bounded by
//! [`HostConfig::shutdown_deadline`]. Past the deadline, or when forced, the
//! host stops the executor's tasks and calls each plugin's shutdown hook,
//! which must release everything the plugin still holds.
//!
//! # Parts
//! - `config`: what a host is started with ([`HostConfig`], [`PluginEntry`]).
//! - `build`: [`Host`], which builds the driver, the executor and the
//!   adapter and spawns the loop.
//! - `handle`: [`HostHandle`], what callers hold, and the commands it sends.
//! - `error`: [`HostError`].
//! - `run_loop`: the loop itself (wakes, timer, fold, expire, drive).
//! - `commands`: how the loop answers a handle's commands.
//! - `publish`: snapshots for subscribers and status queries.
//! - `shutdown`: graceful and forced teardown.
//!
//! What the loop journals, recovers and collects as orphans lives in
//! [`crate::durable`].

mod build;
mod commands;
mod config;
mod error;
mod handle;
mod publish;
mod run_loop;
mod shutdown;

pub use build::{COMMAND_QUEUE_CAPACITY, Host, OBSERVATION_QUEUE_CAPACITY};
pub use config::{
    DEFAULT_HISTORY_DEPTH, DEFAULT_SAFETY_TICK, DEFAULT_SHUTDOWN_DEADLINE, HostConfig, PluginEntry,
};
pub use error::HostError;
pub use handle::{AppliedRevision, HostHandle, ShutdownOutcome, ShutdownReport};
pub use publish::{PUBLISH_INTERVAL_MAX, publish_interval};
pub use run_loop::{MAX_OBSERVATIONS_PER_WAKE, MEMBERSHIP_INTERVAL, STALE_DEADLINE_RETRY};
pub use shutdown::{PLUGIN_SHUTDOWN_WAIT, TASK_SHUTDOWN_WAIT};
