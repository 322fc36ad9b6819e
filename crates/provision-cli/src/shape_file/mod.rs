//! The shape file: a TOML description of a cluster, and its translation into
//! a [`provisioning::ClusterShape`].
//!
//! Only this module parses files. It reads the generic document — the run,
//! the groups with their shape, boot, swarm join and limits — and hands
//! each `[providers.KIND]` table and each group's provider table (a key of
//! the group named after a provider kind) to that provider's module in
//! [`crate::providers`]; it names no provider itself. The format (see
//! `examples/local.toml` and the README for a commented example):
//!
//! ```toml
//! run = "local-demo"          # the run; every node is tagged with it
//!
//! [[group]]                   # one table per node group
//! id = "web"                  # slots are named web-0, web-1, ...
//! count = 3
//! role = "web"                # optional, defaults to the id
//! provider = "process"        # optional, defaults to "process"
//!
//! [group.shape]               # optional
//! image = "local"
//! resources = { cpu = 0.5 }   # finite, non-negative numbers
//! labels = { tier = "front" }
//!
//! [group.boot]                # optional
//! user = ""
//! verify_commands = ["true"]  # each must succeed before the workload starts
//! start_command = "sleep 3600"
//! env = { GREETING = "hello" }
//! args = []
//! on_peers_change = ""        # run after each rewrite of the peers file
//!
//! [group.swarm_join]          # optional
//! swarm = "main"
//! labels = { zone = "local" }
//! ```
//!
//! The file carries no generation: `provision up` numbers the versions it
//! applies (the first is generation 1, and each edit that changes the
//! content takes the next number).
//!
//! Unknown fields, wrong types and invalid values are errors that name the
//! file, the line and column, and the field ([`crate::located`]).

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use provisioning::{
    BootParams, BreakerPolicy, ClusterShape, DesiredState, Generation, GroupId, Limits,
    MaxUnavailable, NodeGroup, NodeTemplate, ProviderShape, RunId, ShapeError, SwarmJoinTemplate,
};
use serde::Deserialize;
use serde::de::IgnoredAny;
use toml::Spanned;
use toml::de::{DeTable, DeValue, Deserializer};

pub(crate) use crate::located::ShapeFileError;
use crate::located::{ECHO_CHARS_MAX, Locator, cut, cut_quoted, echo, echo_number, expected_names};
use crate::providers::{self, ConfiguredProvider, ProviderModule};

/// The largest shape file read, in bytes.
pub(crate) const MAX_SHAPE_FILE_BYTES: u64 = 1024 * 1024;

/// The swarm a group's agents join when the file names none.
pub(crate) const DEFAULT_SWARM: &str = "main";

/// How many ready nodes of a group a drift rollout may take down at once
/// unless the group says otherwise. One: replacement is delete-then-create,
/// so one at a time keeps every other node serving during a rollout, and a
/// bad new spec (caught by the breaker) costs one node, not the group.
pub(crate) const DEFAULT_MAX_UNAVAILABLE: u32 = 1;

/// Consecutive failed attempts after which a group pauses, unless it says
/// otherwise (`breaker_failures = 0` turns the breaker off).
pub(crate) const DEFAULT_BREAKER_FAILURES: u32 = 5;

/// How long a paused group waits before it lets one probe attempt start.
pub(crate) const DEFAULT_BREAKER_COOLDOWN_SECS: u64 = 60;

/// How long a node must stay ready before its group counts as healthy again:
/// a node lost sooner (a workload that exits right after it started) counts
/// as a failed attempt towards the breaker.
pub(crate) const DEFAULT_BREAKER_STABLE_SECS: u64 = 10;

/// A parsed and validated shape file.
#[derive(Clone, Debug)]
pub(crate) struct ShapeSource {
    /// The run it declares.
    pub(crate) run_id: RunId,
    /// Its groups, each declared for the run.
    pub(crate) groups: Vec<NodeGroup>,
    /// Launch caps, rollout budgets and breakers.
    pub(crate) limits: Limits,
    /// The providers the file configures (every one that needs no table,
    /// and every one whose table it has), in the registry's order.
    pub(crate) providers: Vec<Arc<dyn ConfiguredProvider>>,
}

impl ShapeSource {
    /// The shape at `generation`.
    pub(crate) fn shape(&self, generation: Generation) -> ClusterShape {
        ClusterShape {
            run_id: self.run_id.clone(),
            generation,
            groups: self.groups.clone(),
        }
    }

    /// The number of nodes the file declares.
    pub(crate) fn node_count(&self) -> u64 {
        self.groups.iter().map(|g| u64::from(g.count)).sum()
    }

    /// What is valid but most likely not meant: a file whose groups ask
    /// for no node at all (a `count = 0` left everywhere) starts nothing.
    pub(crate) fn warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        if self.node_count() == 0 {
            warnings.push(if self.groups.is_empty() {
                "no group asks for a node: the file declares no [[group]]".to_owned()
            } else {
                "no group asks for a node: every group has count = 0".to_owned()
            });
        }
        warnings
    }

    /// The validated desired state at `generation`.
    ///
    /// # Errors
    /// The core's [`ShapeError`]; [`load`] and [`parse`] already ran the
    /// same validation, so this fails only for a hand-built source.
    pub(crate) fn desired(&self, generation: Generation) -> Result<DesiredState, ShapeError> {
        self.shape(generation).validate()
    }

    /// The settings of type `T` among its providers', if configured.
    #[cfg(test)]
    pub(crate) fn settings<T: 'static>(&self) -> Option<&T> {
        self.providers
            .iter()
            .find_map(|provider| provider.as_any().downcast_ref::<T>())
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileDocument {
    run: Spanned<String>,
    /// Read only so that `providers` is a known key that must be a table;
    /// its tables are read by the providers' modules.
    #[serde(default, rename = "providers")]
    _providers: FileProviders,
    #[serde(default, rename = "group")]
    groups: Vec<Spanned<FileGroup>>,
}

/// `[providers]`: a table per provider kind, each read by its provider's
/// module; the document only takes note of them here.
#[derive(Debug, Default, Deserialize)]
struct FileProviders {
    #[serde(flatten)]
    _tables: BTreeMap<String, IgnoredAny>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileGroup {
    id: Spanned<String>,
    count: u32,
    #[serde(default)]
    role: Option<String>,
    #[serde(default)]
    provider: Option<Spanned<String>>,
    #[serde(default)]
    shape: FileShape,
    #[serde(default)]
    boot: FileBoot,
    #[serde(default)]
    swarm_join: FileSwarmJoin,
    #[serde(default)]
    max_unavailable: Option<Spanned<FileBudget>>,
    #[serde(default)]
    breaker_failures: Option<u32>,
    #[serde(default)]
    breaker_cooldown_secs: Option<Spanned<u64>>,
    #[serde(default)]
    breaker_stable_secs: Option<u64>,
}

/// `max_unavailable = 2` or `max_unavailable = "25%"`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum FileBudget {
    Count(u32),
    Text(String),
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileShape {
    #[serde(default)]
    image: String,
    #[serde(default)]
    resources: BTreeMap<String, Spanned<f64>>,
    #[serde(default)]
    labels: BTreeMap<String, String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileBoot {
    #[serde(default)]
    user: String,
    #[serde(default)]
    verify_commands: Vec<Spanned<String>>,
    #[serde(default)]
    start_command: Option<Spanned<String>>,
    #[serde(default)]
    env: BTreeMap<String, Spanned<String>>,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    on_peers_change: Option<Spanned<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileSwarmJoin {
    #[serde(default)]
    swarm: Option<String>,
    #[serde(default)]
    labels: BTreeMap<String, String>,
}

/// Reads and parses the shape file at `path`.
///
/// # Errors
/// A [`ShapeFileError`] when the file cannot be read, is too large, is not
/// valid TOML, does not match the format, or declares invalid values
/// (including provider kinds outside `providers`).
pub(crate) fn load(path: &Path, providers: &[&str]) -> Result<ShapeSource, ShapeFileError> {
    let source = read(path)?;
    parse(path, &source, providers)
}

/// Reads a shape file's text, bounded by [`MAX_SHAPE_FILE_BYTES`].
///
/// # Errors
/// A [`ShapeFileError`] naming the file when it cannot be read or is too large.
pub(crate) fn read(path: &Path) -> Result<String, ShapeFileError> {
    let fail = |message: String| ShapeFileError {
        path: path.to_owned(),
        line: None,
        column: None,
        field: None,
        message,
    };
    let metadata = std::fs::metadata(path).map_err(|e| fail(format!("cannot read: {e}")))?;
    if metadata.len() > MAX_SHAPE_FILE_BYTES {
        return Err(fail(format!(
            "the file has {} bytes; at most {MAX_SHAPE_FILE_BYTES} are read",
            metadata.len()
        )));
    }
    std::fs::read_to_string(path).map_err(|e| fail(format!("cannot read: {e}")))
}

/// Parses shape-file text; `path` is only used in messages (and relative
/// paths of provider tables are taken from its directory). `providers` are
/// the kinds the caller serves, of those in the [registry](providers::REGISTRY).
///
/// # Errors
/// As [`load`], except for reading.
pub(crate) fn parse(
    path: &Path,
    source: &str,
    providers: &[&str],
) -> Result<ShapeSource, ShapeFileError> {
    let at = Locator { path, source };
    let served: Vec<&'static dyn ProviderModule> = providers::REGISTRY
        .iter()
        .copied()
        .filter(|provider| providers.contains(&provider.kind()))
        .collect();
    let mut tree = at.tree()?;
    // The providers' parts of the file are theirs to read: their tables as
    // they are, and their groups' tables taken out of the groups, which
    // the document does not know.
    let provider_tables = provider_tables(&tree);
    let mut group_tables = take_group_tables(&mut tree, &served);
    let document: FileDocument = at
        .deserialize(Deserializer::from(tree), None)
        .map_err(|error| with_group_tables(error, &served))?;
    let run_id = RunId::new(document.run.get_ref().as_str());
    let configured = configure(&at, &run_id, provider_tables, &served)?;
    let mut groups = Vec::with_capacity(document.groups.len());
    let mut limits = Limits::default();
    for (index, group) in document.groups.iter().enumerate() {
        let tables = group_tables.remove(&index).unwrap_or_default();
        let checked = check_group(&at, index, group, &run_id, &served, &configured, tables)?;
        group_limits(&at, index, group.get_ref(), &checked.id, &mut limits)?;
        groups.push(checked);
    }
    for (provider, settings) in &configured {
        if let Some(cap) = settings.max_concurrent_creates() {
            limits
                .max_concurrent_creates
                .insert(provider.kind().to_owned(), cap);
        }
    }
    let shape = ClusterShape {
        run_id: run_id.clone(),
        generation: Generation::new(1),
        groups,
    };
    if let Err(error) = shape.validate() {
        return Err(core_error(&at, &document, error));
    }
    Ok(ShapeSource {
        run_id,
        groups: shape.groups,
        limits,
        providers: configured
            .into_iter()
            .map(|(_, settings)| settings)
            .collect(),
    })
}

/// A provider's table as the file names it: the key (`ssh` of
/// `[providers.ssh]`) and the table.
type ProviderTable<'s> = (Spanned<String>, Spanned<DeValue<'s>>);

/// Every `[providers.KIND]` table of the file, in the file's key order.
fn provider_tables<'s>(tree: &Spanned<DeTable<'s>>) -> Vec<ProviderTable<'s>> {
    let Some(DeValue::Table(tables)) = tree.get_ref().get("providers").map(Spanned::get_ref) else {
        // Absent, or not a table: the document's own check reports it.
        return Vec::new();
    };
    tables
        .iter()
        .map(|(key, table)| {
            let name = Spanned::new(key.span(), key.get_ref().to_string());
            (name, table.clone())
        })
        .collect()
}

/// Takes each group's provider tables (the keys named after a served
/// provider that takes one) out of the tree, by group index.
fn take_group_tables<'s>(
    tree: &mut Spanned<DeTable<'s>>,
    served: &[&'static dyn ProviderModule],
) -> BTreeMap<usize, Vec<(&'static str, Spanned<DeValue<'s>>)>> {
    let mut taken = BTreeMap::new();
    let Some(DeValue::Array(groups)) = tree.get_mut().get_mut("group").map(Spanned::get_mut) else {
        return taken;
    };
    for (index, group) in groups.iter_mut().enumerate() {
        let DeValue::Table(group) = group.get_mut() else {
            continue;
        };
        for provider in served.iter().filter(|p| p.takes_group_table()) {
            if let Some(table) = group.remove(provider.kind()) {
                taken
                    .entry(index)
                    .or_insert_with(Vec::new)
                    .push((provider.kind(), table));
            }
        }
    }
    taken
}

/// A group's unknown field is reported by the document, which knows the
/// generic fields only; the names it expected include the provider tables
/// a group may carry too.
fn with_group_tables(
    mut error: ShapeFileError,
    served: &[&'static dyn ProviderModule],
) -> ShapeFileError {
    let of_a_group = error.field.as_deref().is_some_and(|field| {
        field.strip_prefix("group[").is_some_and(|rest| {
            rest.split_once("].")
                .is_some_and(|(index, name)| index.parse::<usize>().is_ok() && !name.contains('.'))
        })
    });
    if of_a_group && error.message.starts_with("unknown field `") {
        for provider in served.iter().filter(|p| p.takes_group_table()) {
            error.message.push_str(&format!(", `{}`", provider.kind()));
        }
    }
    error
}

/// A provider the file configures: its module and its settings.
type Configured = (&'static dyn ProviderModule, Arc<dyn ConfiguredProvider>);

/// Configures every served provider: each one whose table the file has,
/// and each one that needs no table; in the registry's order.
fn configure(
    at: &Locator<'_>,
    run_id: &RunId,
    tables: Vec<ProviderTable<'_>>,
    served: &[&'static dyn ProviderModule],
) -> Result<Vec<Configured>, ShapeFileError> {
    let mut tables: BTreeMap<String, ProviderTable<'_>> = tables
        .into_iter()
        .map(|(name, table)| (name.get_ref().clone(), (name, table)))
        .collect();
    for (name, _) in tables.values() {
        if !served.iter().any(|p| p.kind() == name.get_ref()) {
            let kinds: Vec<&str> = served.iter().map(|p| p.kind()).collect();
            return Err(at.error(
                Some(name.span()),
                Some(format!("providers.{}", cut(name.get_ref(), ECHO_CHARS_MAX))),
                cut_quoted(&format!(
                    "unknown field `{}`, expected {}",
                    name.get_ref(),
                    expected_names(&kinds)
                )),
            ));
        }
    }
    let mut configured = Vec::new();
    for provider in served {
        let table = tables.remove(provider.kind()).map(|(_, table)| table);
        if table.is_some() || !provider.needs_table() {
            configured.push((*provider, provider.configure(at, run_id, table)?));
        }
    }
    Ok(configured)
}

/// The rollout budget and breaker of one group.
fn group_limits(
    at: &Locator<'_>,
    index: usize,
    group: &FileGroup,
    id: &GroupId,
    limits: &mut Limits,
) -> Result<(), ShapeFileError> {
    let budget = match &group.max_unavailable {
        None => MaxUnavailable::Count(DEFAULT_MAX_UNAVAILABLE),
        Some(spanned) => {
            let bad = |why: &str| {
                at.error(
                    Some(spanned.span()),
                    Some(format!("group[{index}].max_unavailable")),
                    format!("max_unavailable {why}: give a count of at least 1 or a percentage such as \"25%\""),
                )
            };
            match spanned.get_ref() {
                FileBudget::Count(0) => return Err(bad("is 0, so a rollout could never start")),
                FileBudget::Count(n) => MaxUnavailable::Count(*n),
                FileBudget::Text(text) => {
                    let percent = text
                        .strip_suffix('%')
                        .and_then(|p| p.trim().parse::<u32>().ok())
                        .filter(|p| (1..=100).contains(p))
                        .ok_or_else(|| {
                            bad(&format!(
                                "{} is not a percentage from 1% to 100%",
                                echo(text)
                            ))
                        })?;
                    MaxUnavailable::Percent(percent)
                }
            }
        }
    };
    limits.max_unavailable.insert(id.clone(), budget);
    let failures = group.breaker_failures.unwrap_or(DEFAULT_BREAKER_FAILURES);
    let cooldown = group
        .breaker_cooldown_secs
        .as_ref()
        .map_or(DEFAULT_BREAKER_COOLDOWN_SECS, |c| *c.get_ref());
    if let Some(spanned) = &group.breaker_cooldown_secs {
        if *spanned.get_ref() == 0 {
            return Err(at.error(
                Some(spanned.span()),
                Some(format!("group[{index}].breaker_cooldown_secs")),
                "breaker_cooldown_secs must be at least 1".to_owned(),
            ));
        }
    }
    if failures > 0 {
        limits.breakers.insert(
            id.clone(),
            BreakerPolicy::new(failures, std::time::Duration::from_secs(cooldown))
                .with_stable_after(std::time::Duration::from_secs(
                    group
                        .breaker_stable_secs
                        .unwrap_or(DEFAULT_BREAKER_STABLE_SECS),
                )),
        );
    }
    Ok(())
}

/// Checks group `index` and builds it; `tables` are the provider tables
/// taken out of it, `configured` the providers the file configures.
fn check_group(
    at: &Locator<'_>,
    index: usize,
    group: &Spanned<FileGroup>,
    run_id: &RunId,
    served: &[&'static dyn ProviderModule],
    configured: &[Configured],
    tables: Vec<(&'static str, Spanned<DeValue<'_>>)>,
) -> Result<NodeGroup, ShapeFileError> {
    let field = |name: &str| Some(format!("group[{index}].{name}"));
    let value = group.get_ref();
    let id = value.id.get_ref();
    let group_name = echo(id);
    let (provider, provider_span) = match &value.provider {
        Some(provider) => (provider.get_ref().clone(), Some(provider.span())),
        None => (providers::DEFAULT_KIND.to_owned(), Some(group.span())),
    };
    let Some(module) = served.iter().find(|p| p.kind() == provider) else {
        let kinds: Vec<&str> = served.iter().map(|p| p.kind()).collect();
        return Err(at.error(
            provider_span,
            field("provider"),
            format!(
                "group {group_name} names provider kind {}, which this build does not serve (available: {})",
                echo(&provider),
                kinds.join(", ")
            ),
        ));
    };
    if !configured.iter().any(|(p, _)| p.kind() == provider) {
        return Err(at.error(
            provider_span,
            field("provider"),
            format!(
                "group {group_name} uses provider {}, but the file has no [providers.{provider}] table",
                echo(&provider),
            ),
        ));
    }
    for (name, quantity) in &value.shape.resources {
        let number = *quantity.get_ref();
        let problem = if !number.is_finite() {
            Some("is not a finite number")
        } else if number < 0.0 {
            Some("is negative")
        } else {
            None
        };
        if let Some(problem) = problem {
            return Err(at.error(
                Some(quantity.span()),
                field(&format!("shape.resources.{}", cut(name, ECHO_CHARS_MAX))),
                format!("group {group_name}: {} {problem}", echo_number(number)),
            ));
        }
    }
    let commands = value
        .boot
        .verify_commands
        .iter()
        .enumerate()
        .map(|(i, c)| (format!("boot.verify_commands[{i}]"), c))
        .chain(
            value
                .boot
                .start_command
                .iter()
                .map(|c| ("boot.start_command".to_owned(), c)),
        )
        .chain(
            value
                .boot
                .on_peers_change
                .iter()
                .map(|c| ("boot.on_peers_change".to_owned(), c)),
        );
    for (name, command) in commands {
        if command.get_ref().contains('\0') {
            return Err(at.error(
                Some(command.span()),
                field(&name),
                format!("group {group_name}: a command must not contain a NUL character"),
            ));
        }
    }
    for (name, env_value) in &value.boot.env {
        if name.is_empty() || name.contains('=') || name.contains('\0') {
            return Err(at.error(
                Some(env_value.span()),
                field(&format!("boot.env.{}", cut(name, ECHO_CHARS_MAX))),
                format!(
                    "group {group_name}: {} is not a valid environment variable name",
                    echo(name)
                ),
            ));
        }
        if env_value.get_ref().contains('\0') {
            return Err(at.error(
                Some(env_value.span()),
                field(&format!("boot.env.{}", cut(name, ECHO_CHARS_MAX))),
                format!("group {group_name}: the value must not contain a NUL character"),
            ));
        }
    }
    let mut labels = value.shape.labels.clone();
    for (kind, table) in tables {
        if kind != provider {
            return Err(at.error(
                Some(table.span()),
                field(kind),
                format!(
                    "a {kind} table only applies to groups with provider = {kind:?} (this one has {provider:?})"
                ),
            ));
        }
        labels = module.group_labels(at, index, &labels, table)?;
    }
    Ok(NodeGroup {
        id: GroupId::new(id.as_str()),
        run_id: run_id.clone(),
        count: value.count,
        template: NodeTemplate {
            role: value.role.clone().unwrap_or_else(|| id.clone()),
            provider,
            shape: ProviderShape {
                image: value.shape.image.clone(),
                resources: value
                    .shape
                    .resources
                    .iter()
                    .map(|(k, v)| (k.clone(), *v.get_ref()))
                    .collect(),
                labels,
            },
            boot: BootParams {
                on_peers_change: value
                    .boot
                    .on_peers_change
                    .as_ref()
                    .map(|c| c.get_ref().clone())
                    .unwrap_or_default(),
                user: value.boot.user.clone(),
                verify_commands: value
                    .boot
                    .verify_commands
                    .iter()
                    .map(|c| c.get_ref().clone())
                    .collect(),
                start_command: value
                    .boot
                    .start_command
                    .as_ref()
                    .map(|c| c.get_ref().clone())
                    .unwrap_or_default(),
                env: value
                    .boot
                    .env
                    .iter()
                    .map(|(k, v)| (k.clone(), v.get_ref().clone()))
                    .collect(),
                args: value.boot.args.clone(),
            },
            swarm_join: SwarmJoinTemplate {
                swarm: value
                    .swarm_join
                    .swarm
                    .clone()
                    .unwrap_or_else(|| DEFAULT_SWARM.to_owned()),
                labels: value.swarm_join.labels.clone(),
            },
        },
    })
}

/// Maps a validation error of the core to the place in the file it is about.
fn core_error(at: &Locator<'_>, document: &FileDocument, error: ShapeError) -> ShapeFileError {
    let group_index = |name: &str, last: bool| {
        let mut matches = document
            .groups
            .iter()
            .enumerate()
            .filter(|(_, g)| g.get_ref().id.get_ref() == name);
        if last {
            matches.next_back()
        } else {
            matches.next()
        }
    };
    let group_field = |name: &str, last: bool, field: &str| {
        group_index(name, last).map_or((None, None), |(index, group)| {
            (
                Some(group.get_ref().id.span()),
                Some(format!("group[{index}].{field}")),
            )
        })
    };
    let (span, field) = match &error {
        ShapeError::InvalidRunId { .. } => (Some(document.run.span()), Some("run".to_owned())),
        ShapeError::InvalidGroupId { group, .. } => group_field(group, false, "id"),
        ShapeError::DuplicateGroup { group } => group_field(group.as_str(), true, "id"),
        ShapeError::RunMismatch { group, .. } | ShapeError::EmptyField { group, .. } => {
            group_field(group.as_str(), false, "id")
        }
        ShapeError::NonFiniteValue { group, field, .. }
        | ShapeError::NegativeValue { group, field, .. } => {
            let (span, _) = group_field(group.as_str(), false, "id");
            let index = group_index(group.as_str(), false).map(|(i, _)| i);
            (span, index.map(|i| format!("group[{i}].{field}")))
        }
        ShapeError::TooManyNodes { .. } => (None, None),
    };
    at.error(span, field, core_message(&error))
}

/// The core's message, without the field path where the report names it,
/// and with the file's values cut to [`ECHO_CHARS_MAX`] characters.
fn core_message(error: &ShapeError) -> String {
    match error {
        ShapeError::InvalidRunId { run, reason } => {
            format!("invalid run id {}: {reason}", echo(run))
        }
        ShapeError::InvalidGroupId { group, reason } => {
            format!("invalid group id {}: {reason}", echo(group))
        }
        // The field is reported on its own; the message names the value.
        ShapeError::NonFiniteValue { group, value, .. } => format!(
            "group {}: {} is not a finite number",
            echo(group.as_str()),
            echo_number(*value)
        ),
        ShapeError::NegativeValue { group, value, .. } => format!(
            "group {}: {} is negative",
            echo(group.as_str()),
            echo_number(*value)
        ),
        // The others quote names the core accepted (at most 63 characters);
        // cut whatever they quote all the same.
        other => cut_quoted(&other.to_string()),
    }
}
