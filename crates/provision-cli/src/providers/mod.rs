//! The providers this build serves, and the one seam each of them is
//! reached through.
//!
//! A provider's module knows everything the CLI knows about its provider:
//! its kind (the string groups name in `provider = "…"`), its
//! `[providers.KIND]` table and its groups' own table (a group's table
//! named after the kind), the plugin it starts for a run, and what it can
//! serve when a `down` finds no shape file to start it from. The shape
//! file's parser names no provider: it hands each `[providers.*]` table and
//! each group's provider table to the module of that kind in [`REGISTRY`].
//!
//! Adding a provider is one module implementing [`ProviderModule`] and one
//! line in [`REGISTRY`].

mod container;
mod ec2;
mod exec;
mod process;
mod slurm;
mod ssh;

#[cfg(test)]
use std::any::Any;
use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use provisioning::{RetryPolicy, RunId};
use provisioning_agent::RunSecret;
use provisioning_runtime::PluginEntry;
use toml::Spanned;
use toml::de::DeValue;

use crate::located::{Locator, ShapeFileError};

pub(crate) use process::{AGENT_SUBCOMMAND, agent_main};

/// Every provider this build serves, in the order their tables are read
/// and their plugins started.
pub(crate) static REGISTRY: &[&dyn ProviderModule] = &[
    &process::Process,
    &exec::Exec,
    &ssh::Ssh,
    &slurm::Slurm,
    &container::Container,
    &ec2::Ec2,
];

/// The provider a group gets when it names none: the embedded one, which
/// needs no table.
pub(crate) const DEFAULT_KIND: &str = process::KIND;

/// The kinds of every provider in the [`REGISTRY`], in its order.
pub(crate) fn kinds() -> Vec<&'static str> {
    REGISTRY.iter().map(|provider| provider.kind()).collect()
}

/// The providers a `down` serves when the run's shape file is gone: those
/// that can reach their nodes without it.
pub(crate) fn without_file() -> Vec<Arc<dyn ConfiguredProvider>> {
    REGISTRY
        .iter()
        .filter_map(|provider| provider.without_file())
        .collect()
}

/// The driver's policy for the providers this build serves: the core's
/// defaults, except that endpoints are probed at the pace of local
/// processes, which announce theirs within milliseconds.
pub(crate) fn retry_policy() -> RetryPolicy {
    RetryPolicy {
        endpoint_probe_interval: provisioning_process::ENDPOINT_PROBE_INTERVAL,
        ..RetryPolicy::default()
    }
}

/// The `[providers.KIND]` table of a provider that
/// [needs one](ProviderModule::needs_table), read as `T`. The shape file
/// configures such a provider only when its table is there; a missing one
/// is still refused as such rather than trusted away.
///
/// # Errors
/// The table is missing, or its first problem, placed.
pub(crate) fn read_table<'de, T: serde::Deserialize<'de>>(
    at: &Locator<'_>,
    kind: &str,
    table: Option<Spanned<DeValue<'de>>>,
) -> Result<Spanned<T>, ShapeFileError> {
    let field = format!("providers.{kind}");
    let Some(table) = table else {
        return Err(at.error(
            None,
            Some(field),
            format!("the file has no [providers.{kind}] table"),
        ));
    };
    at.deserialize_value(table, &field)
}

/// One provider as the CLI knows it: how the shape file declares it and
/// what it starts. Every error it returns is placed in the file with the
/// [`Locator`] it is handed.
pub(crate) trait ProviderModule: Sync {
    /// Its kind: what groups name in `provider = "…"`, the key of its
    /// `[providers.KIND]` table, and what errors call it.
    fn kind(&self) -> &'static str;

    /// Whether a group may use it only when the file has its
    /// `[providers.KIND]` table (the embedded provider needs none).
    fn needs_table(&self) -> bool;

    /// Whether its groups may carry a table named after its kind
    /// (`slurm = { partition = "debug" }`), read by [`Self::group_labels`].
    fn takes_group_table(&self) -> bool {
        false
    }

    /// Reads its `[providers.KIND]` table, `None` when the file has none
    /// (asked only of a provider that [needs no table](Self::needs_table)),
    /// for the run `run_id`.
    ///
    /// # Errors
    /// The first problem of the table, placed.
    fn configure(
        &self,
        at: &Locator<'_>,
        run_id: &RunId,
        table: Option<Spanned<DeValue<'_>>>,
    ) -> Result<Arc<dyn ConfiguredProvider>, ShapeFileError>;

    /// The labels of group `index` (of this provider) with its table folded
    /// in; asked only of a provider that [takes one](Self::takes_group_table).
    ///
    /// # Errors
    /// The first problem of the table, placed.
    fn group_labels(
        &self,
        at: &Locator<'_>,
        index: usize,
        labels: &BTreeMap<String, String>,
        table: Spanned<DeValue<'_>>,
    ) -> Result<BTreeMap<String, String>, ShapeFileError> {
        let _ = labels;
        Err(at.error(
            Some(table.span()),
            Some(format!("group[{index}].{}", self.kind())),
            format!("provider {:?} takes no group table", self.kind()),
        ))
    }

    /// What a `down` serves of this provider when the run's shape file is
    /// gone; `None` when it cannot reach its nodes without the file.
    fn without_file(&self) -> Option<Arc<dyn ConfiguredProvider>> {
        None
    }
}

/// What providers keep in the run's state for the next controller of the
/// run (notes of the state file, named `provider.KIND.…`): a listener's
/// port that running agents re-dial, for instance. Loaded before the
/// providers start; whatever they set is stored once all have started.
#[derive(Debug, Default)]
pub(crate) struct ProviderMemo {
    entries: std::sync::Mutex<BTreeMap<String, String>>,
}

/// The prefix of every note a provider keeps.
pub(crate) const MEMO_PREFIX: &str = "provider.";

impl ProviderMemo {
    /// A memo holding the provider notes among `notes` (name, value).
    pub(crate) fn from_notes<'n>(notes: impl IntoIterator<Item = (&'n str, &'n str)>) -> Self {
        let entries = notes
            .into_iter()
            .filter(|(name, _)| name.starts_with(MEMO_PREFIX))
            .map(|(name, value)| (name.to_owned(), value.to_owned()))
            .collect();
        ProviderMemo {
            entries: std::sync::Mutex::new(entries),
        }
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, String>> {
        self.entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// What the run's last controller kept under `provider.{name}`.
    pub(crate) fn get(&self, name: &str) -> Option<String> {
        self.entries().get(&format!("{MEMO_PREFIX}{name}")).cloned()
    }

    /// Keeps `value` under `provider.{name}` for the next controller.
    pub(crate) fn set(&self, name: &str, value: String) {
        self.entries().insert(format!("{MEMO_PREFIX}{name}"), value);
    }

    /// Every entry (full note names), in name order.
    pub(crate) fn to_notes(&self) -> Vec<(String, String)> {
        self.entries()
            .iter()
            .map(|(name, value)| (name.clone(), value.clone()))
            .collect()
    }
}

/// What starting a provider's plugin yields, once awaited.
pub(crate) type PluginStart<'a> =
    Pin<Box<dyn Future<Output = anyhow::Result<PluginEntry>> + Send + 'a>>;

/// A provider as its table configured it, ready to start for a run. Read
/// when `up` (or a `down` after a crash) starts; an edit of the table takes
/// effect at the next start.
pub(crate) trait ConfiguredProvider: fmt::Debug + Send + Sync {
    /// The cap on its creates in flight that its table sets, if any.
    fn max_concurrent_creates(&self) -> Option<u32> {
        None
    }

    /// Starts its plugin for `run_id`, whose agents prove themselves with
    /// `secret`. Starting binds what it listens on and runs what it runs,
    /// so a provider that cannot work is an error before anything starts.
    /// `memo` holds what the run's last controller kept, and takes what
    /// the next one will need.
    fn start<'a>(
        &'a self,
        run_id: &'a RunId,
        secret: RunSecret,
        memo: &'a ProviderMemo,
    ) -> PluginStart<'a>;

    /// Itself, for a test to look at its settings.
    #[cfg(test)]
    fn as_any(&self) -> &dyn Any;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_registry_serves_each_kind_once() {
        let kinds = kinds();
        assert_eq!(
            kinds,
            ["process", "exec", "ssh", "slurm", "container", "ec2"]
        );
        let default = REGISTRY.iter().filter(|p| p.kind() == DEFAULT_KIND);
        assert_eq!(
            default.map(|p| p.needs_table()).collect::<Vec<_>>(),
            [false]
        );
    }

    #[test]
    fn the_local_policy_differs_from_the_core_defaults_only_in_its_probe_interval() {
        let policy = retry_policy();
        assert_eq!(
            policy.endpoint_probe_interval,
            provisioning_process::ENDPOINT_PROBE_INTERVAL
        );
        let with_default_probe = RetryPolicy {
            endpoint_probe_interval: RetryPolicy::default().endpoint_probe_interval,
            ..policy
        };
        assert_eq!(with_default_probe, RetryPolicy::default());
    }
}
