//! The shape file: a TOML description of a cluster, and its translation into
//! a [`provisioning::ClusterShape`].
//!
//! Only this module parses files. The format (see `examples/local.toml` and
//! the README for a commented example):
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
//! file, the line and column, and the field.
//! A value of the file that an error echoes is cut to its first
//! [`ECHO_CHARS_MAX`] characters, followed by `… (N characters)`.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use provisioning::{
    BootParams, BreakerPolicy, ClusterShape, DesiredState, Generation, GroupId, Limits,
    MaxUnavailable, NodeGroup, NodeTemplate, ProviderShape, RunId, ShapeError, SwarmJoinTemplate,
};
use serde::Deserialize;
use toml::Spanned;

/// The largest shape file read, in bytes.
pub(crate) const MAX_SHAPE_FILE_BYTES: u64 = 1024 * 1024;

/// The provider kind a group gets when it names none.
pub(crate) const DEFAULT_PROVIDER: &str = "process";

/// The swarm a group's agents join when the file names none.
pub(crate) const DEFAULT_SWARM: &str = "main";

/// The most characters of one of the file's values (a name, a key, a
/// string) that an error echoes; longer values are cut to this many,
/// followed by `… (N characters)`. Valid names have at most 63.
pub(crate) const ECHO_CHARS_MAX: usize = 64;

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

/// The most characters of an error's message, whatever it quotes.
pub(crate) const MESSAGE_CHARS_MAX: usize = 1024;

/// `text` itself when it has at most `max` characters; else its first `max`
/// characters followed by `… (N characters)`.
fn cut(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        None => text.to_owned(),
        Some((end, _)) => format!(
            "{}\u{2026} ({} characters)",
            &text[..end],
            text.chars().count()
        ),
    }
}

/// A value of the file as an error echoes it: quoted, and cut when long
/// (`"aaaa"… (5000 characters)`).
fn echo(value: &str) -> String {
    match value.char_indices().nth(ECHO_CHARS_MAX) {
        None => format!("{value:?}"),
        Some((end, _)) => format!(
            "{:?}\u{2026} ({} characters)",
            &value[..end],
            value.chars().count()
        ),
    }
}

/// A number of the file as an error echoes it: a huge one in scientific
/// notation rather than with its hundreds of digits.
fn echo_number(number: f64) -> String {
    let plain = number.to_string();
    if plain.chars().count() <= ECHO_CHARS_MAX {
        plain
    } else {
        format!("{number:e}")
    }
}

/// Cuts the long quoted parts (`"..."` with escapes, or `` `...` ``) of a
/// message built elsewhere (the TOML parser, serde), which may quote a
/// value of the file whole; then bounds the whole message.
fn cut_quoted(message: &str) -> String {
    let mut out = String::with_capacity(message.len().min(MESSAGE_CHARS_MAX));
    let mut chars = message.chars();
    while let Some(c) = chars.next() {
        if c != '"' && c != '`' {
            out.push(c);
            continue;
        }
        let mut inner = String::new();
        let mut closed = false;
        while let Some(next) = chars.next() {
            if next == c {
                closed = true;
                break;
            }
            inner.push(next);
            if c == '"' && next == '\\' {
                if let Some(escaped) = chars.next() {
                    inner.push(escaped);
                }
            }
        }
        let close = if closed { c.to_string() } else { String::new() };
        match inner.char_indices().nth(ECHO_CHARS_MAX) {
            None => {
                out.push(c);
                out.push_str(&inner);
                out.push_str(&close);
            }
            Some((end, _)) => {
                let total = inner.chars().count();
                out.push(c);
                out.push_str(&inner[..end]);
                out.push_str(&close);
                out.push_str(&format!("\u{2026} ({total} characters)"));
            }
        }
    }
    cut(&out, MESSAGE_CHARS_MAX)
}

/// A shape file that could not be used. Displays as
/// `FILE:LINE:COLUMN: field `PATH`: MESSAGE`, omitting what is unknown.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) struct ShapeFileError {
    /// The file.
    pub(crate) path: PathBuf,
    /// The 1-based line, when known.
    pub(crate) line: Option<usize>,
    /// The 1-based column, when known.
    pub(crate) column: Option<usize>,
    /// The field, as a dotted path (`group[1].boot.start_command`), when known.
    pub(crate) field: Option<String>,
    /// What is wrong.
    pub(crate) message: String,
}

impl fmt::Display for ShapeFileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.path.display())?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
            if let Some(column) = self.column {
                write!(f, ":{column}")?;
            }
        }
        f.write_str(": ")?;
        if let Some(field) = &self.field {
            write!(f, "field `{field}`: ")?;
        }
        f.write_str(&self.message)
    }
}

/// A parsed and validated shape file.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ShapeSource {
    /// The file it came from.
    pub(crate) path: PathBuf,
    /// The run it declares.
    pub(crate) run_id: RunId,
    /// Its groups, each declared for the run.
    pub(crate) groups: Vec<NodeGroup>,
    /// Settings of the embedded local-process provider.
    pub(crate) process: ProcessSettings,
    /// Launch caps, rollout budgets and breakers.
    pub(crate) limits: Limits,
    /// The provider program serving `provider = "exec"`, when declared.
    pub(crate) exec: Option<ExecSettings>,
    /// The inventory serving `provider = "ssh"`, when declared.
    pub(crate) ssh: Option<crate::ssh_provider::SshSettings>,
    /// The cluster serving `provider = "slurm"`, when declared.
    pub(crate) slurm: Option<crate::slurm_provider::SlurmCliSettings>,
}

/// `[providers.exec]`: the program and its call timeout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ExecSettings {
    /// The program and its arguments.
    pub(crate) command: Vec<String>,
    /// How long one call may wait for its reply.
    pub(crate) call_timeout: Option<std::time::Duration>,
}

/// The provider kind a `[providers.exec]` program serves.
pub(crate) const EXEC_PROVIDER: &str = "exec";

/// How the embedded provider runs its agents (`[providers.process]`). Read
/// when `up` starts; an edit takes effect at the next start.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct ProcessSettings {
    /// Whether agents outlive the controller (`agents = "detached"`).
    pub(crate) detached: bool,
    /// Where detached agents write their logs (`log_dir`).
    pub(crate) log_dir: Option<PathBuf>,
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

    /// The validated desired state at `generation`.
    ///
    /// # Errors
    /// The core's [`ShapeError`]; [`load`] and [`parse`] already ran the
    /// same validation, so this fails only for a hand-built source.
    pub(crate) fn desired(&self, generation: Generation) -> Result<DesiredState, ShapeError> {
        self.shape(generation).validate()
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileDocument {
    run: Spanned<String>,
    #[serde(default)]
    providers: FileProviders,
    #[serde(default, rename = "group")]
    groups: Vec<Spanned<FileGroup>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileProviders {
    #[serde(default)]
    process: FileProcessProvider,
    #[serde(default)]
    exec: Option<Spanned<FileExecProvider>>,
    #[serde(default)]
    ssh: Option<Spanned<crate::ssh_provider::FileSshProvider>>,
    #[serde(default)]
    slurm: Option<Spanned<crate::slurm_provider::FileSlurmProvider>>,
}

/// `[providers.exec]`: a provider program speaking docs/plugin-protocol.md.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileExecProvider {
    command: Vec<String>,
    #[serde(default)]
    call_timeout_secs: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileProcessProvider {
    #[serde(default)]
    agents: FileAgents,
    #[serde(default)]
    max_concurrent_creates: Option<Spanned<u32>>,
    #[serde(default)]
    log_dir: Option<Spanned<String>>,
}

/// Whether the embedded provider's agents die with the controller.
#[derive(Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
enum FileAgents {
    #[default]
    WithController,
    Detached,
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
    #[serde(default)]
    slurm: Option<Spanned<crate::slurm_provider::FileSlurmGroup>>,
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
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileSwarmJoin {
    #[serde(default)]
    swarm: Option<String>,
    #[serde(default)]
    labels: BTreeMap<String, String>,
}

/// Where a byte offset sits in a text.
fn line_column(source: &str, offset: usize) -> (usize, usize) {
    let before = &source[..offset.min(source.len())];
    let line = before.matches('\n').count() + 1;
    let column = before
        .rfind('\n')
        .map_or(before.chars().count(), |newline| {
            before[newline + 1..].chars().count()
        })
        + 1;
    (line, column)
}

/// Builds errors that point into one file.
struct Locator<'a> {
    path: &'a Path,
    source: &'a str,
}

impl Locator<'_> {
    fn error(
        &self,
        span: Option<std::ops::Range<usize>>,
        field: Option<String>,
        message: impl Into<String>,
    ) -> ShapeFileError {
        let (line, column) = match span {
            Some(span) => {
                let (line, column) = line_column(self.source, span.start);
                (Some(line), Some(column))
            }
            None => (None, None),
        };
        ShapeFileError {
            path: self.path.to_owned(),
            line,
            column,
            field: field.map(|field| cut(&field, MESSAGE_CHARS_MAX)),
            message: cut(&message.into(), MESSAGE_CHARS_MAX),
        }
    }
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

/// Parses shape-file text; `path` is only used in messages.
///
/// # Errors
/// As [`load`], except for reading.
pub(crate) fn parse(
    path: &Path,
    source: &str,
    providers: &[&str],
) -> Result<ShapeSource, ShapeFileError> {
    let at = Locator { path, source };
    let document = deserialize(&at)?;
    let run_id = RunId::new(document.run.get_ref().as_str());
    let exec = match &document.providers.exec {
        None => None,
        Some(spanned) => {
            let exec = spanned.get_ref();
            if exec.command.first().is_none_or(|c| c.trim().is_empty()) {
                return Err(at.error(
                    Some(spanned.span()),
                    Some("providers.exec.command".to_owned()),
                    "command must name the provider program, e.g. [\"python3\", \"provider.py\"]"
                        .to_owned(),
                ));
            }
            if exec.call_timeout_secs == Some(0) {
                return Err(at.error(
                    Some(spanned.span()),
                    Some("providers.exec.call_timeout_secs".to_owned()),
                    "call_timeout_secs must be at least 1".to_owned(),
                ));
            }
            Some(ExecSettings {
                command: exec.command.clone(),
                call_timeout: exec.call_timeout_secs.map(std::time::Duration::from_secs),
            })
        }
    };
    let mut served: Vec<&str> = providers.to_vec();
    if exec.is_some() && !served.contains(&EXEC_PROVIDER) {
        served.push(EXEC_PROVIDER);
    }
    let ssh = match &document.providers.ssh {
        Some(table) => Some(
            crate::ssh_provider::check(path, &run_id, table)
                .map_err(|e| at.error(e.span, Some(e.field), e.message))?,
        ),
        None => None,
    };
    if ssh.is_some() && !served.contains(&crate::ssh_provider::SSH_PROVIDER) {
        served.push(crate::ssh_provider::SSH_PROVIDER);
    }
    let slurm = crate::slurm_provider::check(path, document.providers.slurm.as_ref())
        .map_err(|e| at.error(e.span, Some(e.field), e.message))?;
    if slurm.is_some() && !served.contains(&crate::slurm_provider::SLURM_PROVIDER) {
        served.push(crate::slurm_provider::SLURM_PROVIDER);
    }
    let providers = served.as_slice();
    let mut groups = Vec::with_capacity(document.groups.len());
    let mut limits = Limits::default();
    for (index, group) in document.groups.iter().enumerate() {
        let checked = check_group(&at, index, group, &run_id, providers)?;
        group_limits(&at, index, group.get_ref(), &checked.id, &mut limits)?;
        groups.push(checked);
    }
    if let Some(cap) = &document.providers.process.max_concurrent_creates {
        if *cap.get_ref() == 0 {
            return Err(at.error(
                Some(cap.span()),
                Some("providers.process.max_concurrent_creates".to_owned()),
                "max_concurrent_creates must be at least 1 (leave it out for no cap)".to_owned(),
            ));
        }
        limits
            .max_concurrent_creates
            .insert(DEFAULT_PROVIDER.to_owned(), *cap.get_ref());
    }
    let shape = ClusterShape {
        run_id: run_id.clone(),
        generation: Generation::new(1),
        groups,
    };
    if let Err(error) = shape.validate() {
        return Err(core_error(&at, &document, error));
    }
    let process = &document.providers.process;
    let detached = process.agents == FileAgents::Detached;
    if let Some(log_dir) = &process.log_dir {
        if !detached {
            return Err(at.error(
                Some(log_dir.span()),
                Some("providers.process.log_dir".to_owned()),
                "log_dir is only used with agents = \"detached\" (agents that die with the controller log through it)".to_owned(),
            ));
        }
        if log_dir.get_ref().is_empty() {
            return Err(at.error(
                Some(log_dir.span()),
                Some("providers.process.log_dir".to_owned()),
                "log_dir must not be empty".to_owned(),
            ));
        }
    }
    Ok(ShapeSource {
        path: path.to_owned(),
        run_id,
        groups: shape.groups,
        limits,
        exec,
        ssh,
        slurm,
        process: ProcessSettings {
            detached,
            log_dir: process.log_dir.as_ref().map(|d| PathBuf::from(d.get_ref())),
        },
    })
}

fn deserialize(at: &Locator<'_>) -> Result<FileDocument, ShapeFileError> {
    let deserializer = toml::de::Deserializer::parse(at.source)
        .map_err(|error| at.error(error.span(), None, cut_quoted(error.message().trim_end())))?;
    serde_path_to_error::deserialize(deserializer).map_err(|error| {
        let field = field_path(error.path());
        let inner = error.into_inner();
        at.error(inner.span(), field, cut_quoted(inner.message().trim_end()))
    })
}

/// A dotted field path (`group[1].boot.env`) without the private segments
/// that span-tracking wrappers add; `None` for the document itself.
fn field_path(path: &serde_path_to_error::Path) -> Option<String> {
    use serde_path_to_error::Segment;
    let mut text = String::new();
    for segment in path.iter() {
        match segment {
            Segment::Seq { index } => text.push_str(&format!("[{index}]")),
            Segment::Map { key } | Segment::Enum { variant: key } => {
                if key.starts_with("$__") {
                    continue;
                }
                if !text.is_empty() {
                    text.push('.');
                }
                text.push_str(&cut(key, ECHO_CHARS_MAX));
            }
            Segment::Unknown => {}
        }
    }
    (!text.is_empty()).then_some(text)
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

fn check_group(
    at: &Locator<'_>,
    index: usize,
    group: &Spanned<FileGroup>,
    run_id: &RunId,
    providers: &[&str],
) -> Result<NodeGroup, ShapeFileError> {
    let field = |name: &str| Some(format!("group[{index}].{name}"));
    let value = group.get_ref();
    let id = value.id.get_ref();
    let group_name = echo(id);
    let (provider, provider_span) = match &value.provider {
        Some(provider) => (provider.get_ref().clone(), Some(provider.span())),
        None => (DEFAULT_PROVIDER.to_owned(), Some(group.span())),
    };
    if !providers.contains(&provider.as_str()) {
        return Err(at.error(
            provider_span,
            field("provider"),
            format!(
                "group {group_name} names provider kind {}, which this build does not serve (available: {})",
                echo(&provider),
                providers.join(", ")
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
    let labels = crate::slurm_provider::group_labels(
        index,
        &provider,
        &value.shape.labels,
        value.slurm.as_ref(),
    )
    .map_err(|e| at.error(e.span, Some(e.field), e.message))?;
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

#[cfg(test)]
mod tests {
    use super::*;

    const PROVIDERS: &[&str] = &["process"];

    const GOOD: &str = r#"
run = "demo"

[[group]]
id = "web"
count = 2
[group.boot]
verify_commands = ["true"]
start_command = "sleep 3600"
env = { GREETING = "hello" }

[[group]]
id = "worker"
count = 1
role = "batch"
provider = "process"
[group.shape]
image = "local"
resources = { cpu = 0.5 }
labels = { tier = "back" }
[group.swarm_join]
swarm = "jobs"
"#;

    fn parse_text(text: &str) -> Result<ShapeSource, ShapeFileError> {
        parse(Path::new("shape.toml"), text, PROVIDERS)
    }

    fn check_error(text: &str, expected: &str) {
        let error = parse_text(text).expect_err("the file must be rejected");
        assert_eq!(error.to_string(), expected);
    }

    #[test]
    fn the_process_provider_runs_agents_with_the_controller_unless_told_to_detach_them() {
        assert_eq!(
            parse_text(GOOD).unwrap().process,
            ProcessSettings::default()
        );
        let detached =
            "run = \"r\"\n[providers.process]\nagents = \"detached\"\nlog_dir = \"/var/log/r\"\n";
        assert_eq!(
            parse_text(detached).unwrap().process,
            ProcessSettings {
                detached: true,
                log_dir: Some(PathBuf::from("/var/log/r")),
            }
        );
        let wrong = "run = \"r\"\n[providers.process]\nagents = \"forever\"\n";
        let error = parse_text(wrong).unwrap_err().to_string();
        assert!(error.starts_with("shape.toml:3:"), "{error}");
        assert!(error.contains("providers.process.agents"), "{error}");
        let stray = "run = \"r\"\n[providers.process]\nlog_dir = \"/tmp/x\"\n";
        let error = parse_text(stray).unwrap_err().to_string();
        assert!(
            error.contains("only used with agents = \"detached\""),
            "{error}"
        );
    }

    #[test]
    fn limits_default_to_one_unavailable_and_a_breaker_of_five_and_can_be_set() {
        let source = parse_text(GOOD).unwrap();
        let first = &source.groups[0].id;
        assert_eq!(
            source.limits.max_unavailable[first],
            MaxUnavailable::Count(1)
        );
        assert_eq!(
            source.limits.breakers[first].failures,
            DEFAULT_BREAKER_FAILURES
        );
        assert!(
            source.limits.max_concurrent_creates.is_empty(),
            "no cap for process"
        );
        let text = "run = \"r\"\n[providers.process]\nmax_concurrent_creates = 4\n[[group]]\nid = \"a\"\ncount = 8\nmax_unavailable = \"25%\"\nbreaker_failures = 0\n[[group]]\nid = \"b\"\ncount = 1\nmax_unavailable = 3\nbreaker_cooldown_secs = 9\nbreaker_stable_secs = 0\n";
        let limits = parse_text(text).unwrap().limits;
        assert_eq!(limits.max_concurrent_creates["process"], 4);
        let (a, b) = (GroupId::new("a"), GroupId::new("b"));
        assert_eq!(limits.max_unavailable[&a], MaxUnavailable::Percent(25));
        assert_eq!(limits.max_unavailable[&b], MaxUnavailable::Count(3));
        assert!(!limits.breakers.contains_key(&a), "0 turns the breaker off");
        assert_eq!(
            limits.breakers[&b].cooldown,
            std::time::Duration::from_secs(9)
        );
        assert_eq!(limits.breakers[&b].stable_after, std::time::Duration::ZERO);
        for (bad, field) in [
            ("max_unavailable = 0", "max_unavailable"),
            ("max_unavailable = \"150%\"", "max_unavailable"),
            ("max_unavailable = \"half\"", "max_unavailable"),
            ("breaker_cooldown_secs = 0", "breaker_cooldown_secs"),
        ] {
            let text = format!("run = \"r\"\n[[group]]\nid = \"a\"\ncount = 1\n{bad}\n");
            let error = parse_text(&text).unwrap_err().to_string();
            assert!(error.starts_with("shape.toml:5:"), "{bad}: {error}");
            assert!(
                error.contains(&format!("group[0].{field}")),
                "{bad}: {error}"
            );
        }
    }

    #[test]
    fn a_valid_file_maps_to_groups_of_its_run_with_defaults_filled_in() {
        let source = parse_text(GOOD).unwrap();
        assert_eq!(source.run_id.as_str(), "demo");
        assert_eq!(source.node_count(), 3);
        let web = &source.groups[0];
        assert_eq!(web.id.as_str(), "web");
        assert_eq!(web.run_id.as_str(), "demo");
        assert_eq!(web.template.role, "web", "the role defaults to the id");
        assert_eq!(web.template.provider, DEFAULT_PROVIDER);
        assert_eq!(web.template.swarm_join.swarm, DEFAULT_SWARM);
        assert_eq!(web.template.boot.verify_commands, ["true"]);
        assert_eq!(web.template.boot.start_command, "sleep 3600");
        assert_eq!(web.template.boot.env["GREETING"], "hello");
        let worker = &source.groups[1];
        assert_eq!(worker.template.role, "batch");
        assert_eq!(worker.template.shape.resources["cpu"], 0.5);
        assert_eq!(worker.template.swarm_join.swarm, "jobs");
        assert!(source.desired(Generation::new(1)).is_ok());
    }

    #[test]
    fn an_unknown_field_is_rejected_with_its_line_and_path() {
        let text = "run = \"demo\"\n[[group]]\nid = \"web\"\ncount = 1\n[group.boot]\nstrat_command = \"x\"\n";
        let error = parse_text(text).unwrap_err();
        assert_eq!(error.line, Some(6), "{error}");
        let shown = error.to_string();
        assert!(shown.starts_with("shape.toml:6:"), "{shown}");
        assert!(shown.contains("strat_command"), "{shown}");
        assert!(shown.contains("group[0].boot"), "{shown}");
    }

    #[test]
    fn an_unknown_top_level_field_is_rejected() {
        let error = parse_text("run = \"demo\"\ngeneration = 3\n").unwrap_err();
        assert_eq!(error.line, Some(2), "{error}");
        assert!(error.to_string().contains("generation"), "{error}");
    }

    #[test]
    fn a_wrong_type_is_rejected_naming_the_field() {
        let text = "run = \"demo\"\n[[group]]\nid = \"web\"\ncount = \"three\"\n";
        let error = parse_text(text).unwrap_err();
        assert_eq!(error.line, Some(4), "{error}");
        assert_eq!(error.field.as_deref(), Some("group[0].count"), "{error}");
    }

    #[test]
    fn a_negative_count_is_rejected_naming_the_field() {
        let text = "run = \"demo\"\n[[group]]\nid = \"web\"\ncount = -1\n";
        let error = parse_text(text).unwrap_err();
        assert_eq!(error.line, Some(4), "{error}");
        assert_eq!(error.field.as_deref(), Some("group[0].count"), "{error}");
    }

    #[test]
    fn a_missing_required_field_is_rejected() {
        let error = parse_text("run = \"demo\"\n[[group]]\nid = \"web\"\n").unwrap_err();
        assert!(error.to_string().contains("count"), "{error}");
        let error = parse_text("[[group]]\nid = \"web\"\ncount = 1\n").unwrap_err();
        assert!(error.to_string().contains("run"), "{error}");
    }

    #[test]
    fn invalid_toml_is_rejected_with_its_position() {
        let error = parse_text("run = \"demo\"\n[[group]\n").unwrap_err();
        assert_eq!(error.line, Some(2), "{error}");
    }

    #[test]
    fn a_non_finite_or_negative_resource_is_rejected_at_its_line() {
        check_error(
            "run = \"demo\"\n[[group]]\nid = \"web\"\ncount = 1\n[group.shape]\nresources = { cpu = nan }\n",
            "shape.toml:6:21: field `group[0].shape.resources.cpu`: group \"web\": NaN is not a finite number",
        );
        let error = parse_text(
            "run = \"demo\"\n[[group]]\nid = \"web\"\ncount = 1\n[group.shape]\nresources = { cpu = -2.0 }\n",
        )
        .unwrap_err();
        assert!(error.to_string().contains("is negative"), "{error}");
    }

    #[test]
    fn an_unknown_provider_kind_is_rejected_naming_the_group() {
        check_error(
            "run = \"demo\"\n[[group]]\nid = \"gpu\"\ncount = 1\nprovider = \"cloud\"\n",
            "shape.toml:5:12: field `group[0].provider`: group \"gpu\" names provider kind \"cloud\", which this build does not serve (available: process)",
        );
    }

    #[test]
    fn core_validation_errors_name_the_file_line_and_group() {
        let duplicate = "run = \"demo\"\n[[group]]\nid = \"web\"\ncount = 1\n[[group]]\nid = \"web\"\ncount = 2\n";
        let error = parse_text(duplicate).unwrap_err();
        assert_eq!(error.line, Some(6), "{error}");
        assert_eq!(error.field.as_deref(), Some("group[1].id"));
        assert!(
            error.to_string().contains("declared more than once"),
            "{error}"
        );

        let bad_name = "run = \"demo\"\n[[group]]\nid = \"a b\"\ncount = 1\n";
        let error = parse_text(bad_name).unwrap_err();
        assert_eq!(error.line, Some(3), "{error}");
        assert!(error.to_string().contains("invalid group id"), "{error}");

        let bad_run = "run = \"no/slash\"\n";
        let error = parse_text(bad_run).unwrap_err();
        assert_eq!(error.line, Some(1), "{error}");
        assert_eq!(error.field.as_deref(), Some("run"));
    }

    #[test]
    fn environment_names_and_commands_must_be_usable() {
        let error = parse_text(
            "run = \"demo\"\n[[group]]\nid = \"web\"\ncount = 1\n[group.boot]\nenv = { \"A=B\" = \"x\" }\n",
        )
        .unwrap_err();
        assert!(
            error.to_string().contains("environment variable name"),
            "{error}"
        );
        let error = parse_text(
            "run = \"demo\"\n[[group]]\nid = \"web\"\ncount = 1\n[group.boot]\nstart_command = \"a\\u0000b\"\n",
        )
        .unwrap_err();
        assert!(error.to_string().contains("NUL"), "{error}");
    }

    #[test]
    fn a_file_without_groups_is_an_empty_cluster() {
        let source = parse_text("run = \"demo\"\n").unwrap();
        assert!(source.groups.is_empty());
    }

    /// Every quoted part of `shown` has at most `ECHO_CHARS_MAX` characters.
    fn assert_echoes_are_cut(shown: &str, total: usize) {
        assert!(shown.chars().count() < 400, "{shown}");
        assert!(
            shown.contains(&format!("\u{2026} ({total} characters)")),
            "{shown}"
        );
    }

    #[test]
    fn an_over_long_value_is_echoed_cut_with_its_length() {
        let long = "a".repeat(5000);
        let kept = "a".repeat(ECHO_CHARS_MAX);

        // The core's check of the run name.
        let error = parse_text(&format!("run = \"{long}\"\n")).unwrap_err();
        assert_eq!(
            error.to_string(),
            format!(
                "shape.toml:1:7: field `run`: invalid run id \"{kept}\"\u{2026} (5000 characters): longer than 63 characters"
            )
        );

        // The core's check of a group name.
        let error = parse_text(&format!(
            "run = \"demo\"\n[[group]]\nid = \"{long}\"\ncount = 1\n"
        ))
        .unwrap_err();
        assert_echoes_are_cut(&error.to_string(), 5000);
        assert!(error.to_string().contains("invalid group id"), "{error}");

        // The CLI's own checks, which run before the core's.
        let error = parse_text(&format!(
            "run = \"demo\"\n[[group]]\nid = \"{long}\"\ncount = 1\nprovider = \"{long}\"\n"
        ))
        .unwrap_err();
        let shown = error.to_string();
        assert_eq!(shown.matches("(5000 characters)").count(), 2, "{shown}");
        assert_echoes_are_cut(&shown, 5000);
        let error = parse_text(&format!(
            "run = \"demo\"\n[[group]]\nid = \"web\"\ncount = 1\n[group.boot]\nenv = {{ \"{long}=\" = \"x\" }}\n"
        ))
        .unwrap_err();
        assert_echoes_are_cut(&error.to_string(), 5001);
        let error = parse_text(&format!(
            "run = \"demo\"\n[[group]]\nid = \"web\"\ncount = 1\n[group.shape]\nresources = {{ {long} = -1e300 }}\n"
        ))
        .unwrap_err();
        assert_echoes_are_cut(&error.to_string(), 5000);
        assert!(error.to_string().contains("-1e300 is negative"), "{error}");

        // The parser's messages: a wrong type quotes the value, an unknown
        // field its name (which is also in the field path).
        let error = parse_text(&format!(
            "run = \"demo\"\n[[group]]\nid = \"web\"\ncount = \"{long}\"\n"
        ))
        .unwrap_err();
        assert_eq!(error.field.as_deref(), Some("group[0].count"));
        assert_eq!(
            error.message,
            format!("invalid type: string \"{kept}\"\u{2026} (5000 characters), expected u32")
        );
        let error = parse_text(&format!(
            "run = \"demo\"\n[[group]]\nid = \"web\"\ncount = 1\n{long} = 1\n"
        ))
        .unwrap_err();
        let shown = error.to_string();
        assert_eq!(shown.matches("(5000 characters)").count(), 2, "{shown}");
        assert_echoes_are_cut(&shown, 5000);
        assert_eq!(error.line, Some(5), "{error}");
    }

    #[test]
    fn a_short_value_is_echoed_whole() {
        let name = "b".repeat(ECHO_CHARS_MAX);
        assert_eq!(echo(&name), format!("{name:?}"));
        assert_eq!(cut(&name, ECHO_CHARS_MAX), name);
        assert_eq!(
            cut_quoted(&format!("x `{name}` y")),
            format!("x `{name}` y")
        );
        assert_eq!(
            echo("é".repeat(70).as_str()),
            format!("{:?}\u{2026} (70 characters)", "é".repeat(64)),
            "characters, not bytes"
        );
    }

    #[test]
    fn a_quoted_value_with_escapes_or_without_its_closing_quote_is_cut_too() {
        let inner = "\\\"".repeat(50);
        let cut_text = cut_quoted(&format!("string \"{inner}\", expected u32"));
        assert!(
            cut_text.ends_with("\u{2026} (100 characters), expected u32"),
            "{cut_text}"
        );
        let unclosed = cut_quoted(&format!("key `{}", "c".repeat(300)));
        assert_eq!(
            unclosed,
            format!("key `{}\u{2026} (300 characters)", "c".repeat(64))
        );
        let bounded = cut_quoted(&"d ".repeat(MESSAGE_CHARS_MAX));
        assert!(
            bounded.chars().count() < MESSAGE_CHARS_MAX + 32,
            "{bounded}"
        );
    }

    #[test]
    fn line_and_column_count_from_one() {
        assert_eq!(line_column("ab\ncd", 0), (1, 1));
        assert_eq!(line_column("ab\ncd", 4), (2, 2));
        assert_eq!(line_column("ab", 99), (1, 3));
    }
}
