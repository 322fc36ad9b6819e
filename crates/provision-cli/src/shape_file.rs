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

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use provisioning::{
    BootParams, ClusterShape, DesiredState, Generation, GroupId, NodeGroup, NodeTemplate,
    ProviderShape, RunId, ShapeError, SwarmJoinTemplate,
};
use serde::Deserialize;
use toml::Spanned;

/// The largest shape file read, in bytes.
pub(crate) const MAX_SHAPE_FILE_BYTES: u64 = 1024 * 1024;

/// The provider kind a group gets when it names none.
pub(crate) const DEFAULT_PROVIDER: &str = "process";

/// The swarm a group's agents join when the file names none.
pub(crate) const DEFAULT_SWARM: &str = "main";

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
    #[serde(default, rename = "group")]
    groups: Vec<Spanned<FileGroup>>,
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
            field,
            message: message.into(),
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
    let mut groups = Vec::with_capacity(document.groups.len());
    for (index, group) in document.groups.iter().enumerate() {
        groups.push(check_group(&at, index, group, &run_id, providers)?);
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
        path: path.to_owned(),
        run_id,
        groups: shape.groups,
    })
}

fn deserialize(at: &Locator<'_>) -> Result<FileDocument, ShapeFileError> {
    let deserializer = toml::de::Deserializer::parse(at.source)
        .map_err(|error| at.error(error.span(), None, error.message().trim_end()))?;
    serde_path_to_error::deserialize(deserializer).map_err(|error| {
        let field = field_path(error.path());
        let inner = error.into_inner();
        at.error(inner.span(), field, inner.message().trim_end())
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
                text.push_str(key);
            }
            Segment::Unknown => {}
        }
    }
    (!text.is_empty()).then_some(text)
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
    let (provider, provider_span) = match &value.provider {
        Some(provider) => (provider.get_ref().clone(), Some(provider.span())),
        None => (DEFAULT_PROVIDER.to_owned(), Some(group.span())),
    };
    if !providers.contains(&provider.as_str()) {
        return Err(at.error(
            provider_span,
            field("provider"),
            format!(
                "group {id:?} names provider kind {provider:?}, which this build does not serve (available: {})",
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
                field(&format!("shape.resources.{name}")),
                format!("group {id:?}: {number} {problem}"),
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
                format!("group {id:?}: a command must not contain a NUL character"),
            ));
        }
    }
    for (name, env_value) in &value.boot.env {
        if name.is_empty() || name.contains('=') || name.contains('\0') {
            return Err(at.error(
                Some(env_value.span()),
                field(&format!("boot.env.{name}")),
                format!("group {id:?}: {name:?} is not a valid environment variable name"),
            ));
        }
        if env_value.get_ref().contains('\0') {
            return Err(at.error(
                Some(env_value.span()),
                field(&format!("boot.env.{name}")),
                format!("group {id:?}: the value must not contain a NUL character"),
            ));
        }
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
                labels: value.shape.labels.clone(),
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

/// The core's message, without the field path where the report names it.
fn core_message(error: &ShapeError) -> String {
    match error {
        // The field is reported on its own; the message names the value.
        ShapeError::NonFiniteValue { group, value, .. } => {
            format!("group {:?}: {value} is not a finite number", group.as_str())
        }
        ShapeError::NegativeValue { group, value, .. } => {
            format!("group {:?}: {value} is negative", group.as_str())
        }
        other => other.to_string(),
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

    #[test]
    fn line_and_column_count_from_one() {
        assert_eq!(line_column("ab\ncd", 0), (1, 1));
        assert_eq!(line_column("ab\ncd", 4), (2, 2));
        assert_eq!(line_column("ab", 99), (1, 3));
    }
}
