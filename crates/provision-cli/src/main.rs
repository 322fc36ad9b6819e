//! The `provision` command.
//!
//! `provision up FILE` runs a cluster in the foreground; `status`, `plan`
//! and `down` talk to it over its control socket; `validate` checks a shape
//! file offline. See the README for a quick start and `shape_file` for the
//! file format.

mod agent_binary;
mod conformance;
mod control;
mod display;
mod located;
mod providers;
mod shape_file;
mod state;
mod up;

use std::ffi::{OsStr, OsString};
use std::io::{IsTerminal, Write as _};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::{ArgAction, Parser, Subcommand};
use provisioning::{ClusterState, Generation, Timestamp};
use provisioning_runtime::{ChangeKind, PlanReport, PlannedChange, plan_against};
use tracing_subscriber::EnvFilter;

use crate::control::{Request, Response, SocketLocation};

/// The host allocates and frees many small values per node and result from
/// two runtime threads; with mimalloc 100k nodes come up through the host in
/// about half the wall and CPU time of the system allocator (BENCHMARKS §6).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The exit code of a failure at run time.
pub(crate) const EXIT_FAILURE: u8 = 1;
/// The exit code of an invalid shape file or a rejected shape.
pub(crate) const EXIT_INVALID_INPUT: u8 = 2;

/// The default bound on `up`'s graceful teardown.
const DEFAULT_SHUTDOWN_TIMEOUT_SECS: u64 = 30;
/// The default bound on `down`'s wait.
const DEFAULT_DOWN_TIMEOUT_SECS: u64 = 120;
/// The most worker threads the runtime of `up` uses.
const RUNTIME_WORKERS: usize = 2;

/// Keeps a fleet of compute nodes in a declared shape.
#[derive(Debug, Parser)]
#[command(name = "provision", version)]
struct Cli {
    /// More logging on stderr (-v info, -vv debug, -vvv trace); RUST_LOG wins.
    #[arg(short, long, action = ArgAction::Count, global = true)]
    verbose: u8,
    /// How log lines on stderr look: `text` (coloured only on a terminal)
    /// or `json`, one object per line, for log shippers.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// The directory of the control sockets (one per run).
    #[arg(long, global = true, env = "PROVISION_SOCKET_DIR", value_name = "DIR")]
    socket_dir: Option<PathBuf>,
    /// The control socket itself (overrides --socket-dir).
    #[arg(long, global = true, env = "PROVISION_SOCKET", value_name = "PATH")]
    socket: Option<PathBuf>,
    /// The directory of the runs' state files (default:
    /// $XDG_STATE_HOME/provision, else ~/.local/state/provision).
    #[arg(long, global = true, env = "PROVISION_STATE_DIR", value_name = "DIR")]
    state_dir: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

/// The form of log lines.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Brings the cluster of FILE up, keeps it in shape and applies each
    /// valid edit of FILE; Ctrl-C tears it down (twice forces).
    Up {
        /// The shape file (TOML).
        file: PathBuf,
        /// Seconds the teardown may take before it is forced.
        #[arg(long, default_value_t = DEFAULT_SHUTDOWN_TIMEOUT_SECS, value_name = "SECS")]
        shutdown_timeout: u64,
        /// Plain lines instead of live progress bars, even on a terminal.
        #[arg(long)]
        plain: bool,
        /// Serves Prometheus metrics at http://ADDR/metrics (e.g.
        /// 127.0.0.1:9464).
        #[arg(long, value_name = "ADDR")]
        metrics: Option<std::net::SocketAddr>,
    },
    /// Shows the state of a running `up`, or one node's details and history.
    Status {
        /// A node (`{group}-{index}`) to show with its last transitions.
        node: Option<String>,
        /// Prints JSON.
        #[arg(long)]
        json: bool,
        /// The run to ask (needed only when several are up).
        #[arg(long)]
        run: Option<String>,
    },
    /// Shows what applying FILE would change against the running cluster
    /// (or from nothing when none runs).
    Plan {
        /// The shape file (TOML).
        file: PathBuf,
        /// Prints JSON.
        #[arg(long)]
        json: bool,
    },
    /// Asks a running `up` to tear its cluster down and waits until it did;
    /// with no `up` running, tears down a run a crashed `up` left behind,
    /// from its state file.
    Down {
        /// The run to stop (needed only when several are up).
        #[arg(long)]
        run: Option<String>,
        /// Seconds to wait for the teardown.
        #[arg(long, default_value_t = DEFAULT_DOWN_TIMEOUT_SECS, value_name = "SECS")]
        timeout: u64,
    },
    /// Lists the ready nodes of a running `up`: what every node's peers
    /// file holds (group, index, node, attempt, address).
    Peers {
        /// Prints JSON (the peers file's format).
        #[arg(long)]
        json: bool,
        /// Only the nodes of this group.
        #[arg(long)]
        group: Option<String>,
        /// The run to ask (needed only when several are up).
        #[arg(long)]
        run: Option<String>,
    },
    /// Closes the breaker of GROUP in a running `up`: the group starts new
    /// attempts again at once.
    Resume {
        /// The group.
        group: String,
        /// The run (needed only when several are up).
        #[arg(long)]
        run: Option<String>,
    },
    /// Checks a shape file without starting anything.
    Validate {
        /// The shape file (TOML).
        file: PathBuf,
    },
    /// Runs the seam contract suite and the kit's battery against a provider
    /// program that speaks the plugin protocol (docs/plugin-protocol.md);
    /// exits 0 only when no contract failed and the battery passed.
    Conformance {
        /// The program and its arguments, split at whitespace
        /// (for example "python3 provider.py").
        #[arg(long, value_name = "CMD")]
        plugin: String,
        /// Battery seeds per mode (both modes run; 0 skips the battery).
        #[arg(long, value_name = "N", default_value_t = provisioning_exec::battery::DEFAULT_BATTERY_SEEDS)]
        seeds: usize,
        /// Also writes the report as JUnit XML to FILE.
        #[arg(long, value_name = "FILE")]
        junit: Option<PathBuf>,
    },
    /// Runs a node agent (started by the local-process provider).
    #[command(hide = true, disable_help_flag = true)]
    Agent {
        /// Passed to the agent unchanged.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
}

fn main() -> ExitCode {
    // The agent gets its arguments untouched by clap.
    let mut raw = std::env::args_os().skip(1);
    if let Some(first) = raw.next() {
        if first == providers::AGENT_SUBCOMMAND {
            return providers::agent_main(raw.collect());
        }
    }
    let cli = Cli::parse();
    init_logging(cli.verbose, cli.log_format);
    match run(cli) {
        Ok(code) => code,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::from(EXIT_FAILURE)
        }
    }
}

fn init_logging(verbose: u8, format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        EnvFilter::new(match verbose {
            0 => "warn",
            1 => "info",
            2 => "debug",
            _ => "trace",
        })
    });
    let colour = use_colour(
        std::io::stderr().is_terminal(),
        std::env::var_os("NO_COLOR").as_deref(),
    );
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        // Standard error, past the live block of `up` while one is drawn.
        .with_writer(display::LogOutput);
    let _ = match format {
        LogFormat::Text => builder.with_ansi(colour).try_init(),
        LogFormat::Json => builder.json().with_ansi(false).try_init(),
    };
}

/// Whether log lines get ANSI colours: only on a terminal, and never when
/// `NO_COLOR` is set to a non-empty value (<https://no-color.org>). A log
/// redirected to a file or a pipe stays plain text.
fn use_colour(terminal: bool, no_color: Option<&OsStr>) -> bool {
    terminal && no_color.is_none_or(OsStr::is_empty)
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(RUNTIME_WORKERS)
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let location = SocketLocation::new(cli.socket, cli.socket_dir);
    let state = state::StateLocation::new(cli.state_dir);
    match cli.command {
        Command::Up {
            file,
            shutdown_timeout,
            plain,
            metrics,
        } => runtime()?.block_on(up::run(up::UpOptions {
            file,
            location,
            state,
            shutdown_timeout: Duration::from_secs(shutdown_timeout),
            live: !plain && std::io::stdout().is_terminal(),
            metrics,
        })),
        Command::Status { node, json, run } => {
            runtime()?.block_on(status(&location, run, node, json))
        }
        Command::Plan { file, json } => runtime()?.block_on(plan(&location, &file, json)),
        Command::Down { run, timeout } => {
            runtime()?.block_on(down(&location, &state, run, Duration::from_secs(timeout)))
        }
        Command::Peers { json, group, run } => {
            runtime()?.block_on(peers(&location, run, group, json))
        }
        Command::Resume { group, run } => runtime()?.block_on(resume(&location, run, group)),
        Command::Validate { file } => Ok(validate(&file)),
        Command::Conformance {
            plugin,
            seeds,
            junit,
        } => runtime()?.block_on(conformance::run(&plugin, seeds, junit.as_deref())),
        Command::Agent { args } => Ok(providers::agent_main(args)),
    }
}

/// Prints to stdout, ignoring a closed pipe.
pub(crate) fn print(text: &str) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(text.as_bytes());
    let _ = out.flush();
}

async fn status(
    location: &SocketLocation,
    run: Option<String>,
    node: Option<String>,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let socket = location.find(run.as_deref()).map_err(anyhow::Error::msg)?;
    let response = control::ask(&socket, &Request::Status, control::CLIENT_TIMEOUT)
        .await
        .map_err(anyhow::Error::msg)?;
    match response {
        Response::Status { status } => {
            if let Some(node) = node {
                let Some(found) = status.nodes.iter().find(|n| n.id == node) else {
                    eprintln!(
                        "provision: run {} has no node {node:?} (its nodes: {})",
                        status.run_id,
                        display::node_list(&status)
                    );
                    return Ok(ExitCode::from(2));
                };
                if json {
                    print(&format!("{}\n", serde_json::to_string_pretty(found)?));
                } else {
                    print(&display::node_details(found));
                }
                return Ok(ExitCode::SUCCESS);
            }
            if json {
                print(&format!("{}\n", serde_json::to_string_pretty(&status)?));
            } else {
                print(&display::status_table(&status));
            }
            Ok(ExitCode::SUCCESS)
        }
        other => unexpected(other),
    }
}

async fn peers(
    location: &SocketLocation,
    run: Option<String>,
    group: Option<String>,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let socket = location.find(run.as_deref()).map_err(anyhow::Error::msg)?;
    let response = control::ask(&socket, &Request::Peers, control::CLIENT_TIMEOUT)
        .await
        .map_err(anyhow::Error::msg)?;
    let Response::Peers { mut peers } = response else {
        return unexpected(response);
    };
    if let Some(group) = &group {
        if !peers.groups.contains_key(group) {
            let groups: Vec<&str> = peers.groups.keys().map(String::as_str).collect();
            eprintln!(
                "provision: the run has no group {group:?} (its groups: {})",
                groups.join(", ")
            );
            return Ok(ExitCode::from(2));
        }
        peers.peers.retain(|peer| &peer.group == group);
        peers.groups.retain(|name, _| name == group);
    }
    if json {
        print(&format!("{}\n", serde_json::to_string_pretty(&peers)?));
    } else {
        print(&display::peers_table(&peers));
    }
    Ok(ExitCode::SUCCESS)
}

fn unexpected(response: Response) -> anyhow::Result<ExitCode> {
    match response {
        Response::Error { message } => anyhow::bail!("{message}"),
        other => anyhow::bail!("unexpected answer: {other:?}"),
    }
}

async fn plan(location: &SocketLocation, file: &Path, json: bool) -> anyhow::Result<ExitCode> {
    let text = match shape_file::read(file) {
        Ok(text) => text,
        Err(error) => {
            eprintln!("error: {error}");
            return Ok(ExitCode::from(EXIT_INVALID_INPUT));
        }
    };
    let source = match shape_file::parse(file, &text, &providers::kinds()) {
        Ok(source) => source,
        Err(error) => {
            eprintln!("error: {error}");
            return Ok(ExitCode::from(EXIT_INVALID_INPUT));
        }
    };
    let socket = location.for_run(source.run_id.as_str());
    let (report, against) = if control::is_live(&socket).await {
        let request = Request::Plan {
            path: file.to_owned(),
            source: text,
        };
        match control::ask(&socket, &request, control::CLIENT_TIMEOUT)
            .await
            .map_err(anyhow::Error::msg)?
        {
            Response::Plan { plan } => (plan, "the running cluster"),
            Response::Error { message } => {
                eprintln!("error: {message}");
                return Ok(ExitCode::from(EXIT_INVALID_INPUT));
            }
            other => return unexpected(other),
        }
    } else {
        let desired = source.desired(Generation::new(1))?;
        (
            plan_against(&ClusterState::default(), &desired, Timestamp::ZERO),
            "an empty cluster (no `provision up` runs for this run)",
        )
    };
    if json {
        print(&format!("{}\n", serde_json::to_string_pretty(&report)?));
    } else {
        print(&plan_text(&report, against));
    }
    Ok(ExitCode::SUCCESS)
}

fn plan_text(report: &PlanReport, against: &str) -> String {
    let mut out = format!(
        "plan for run {} (generation {}) against {against}:\n",
        report.run_id, report.generation
    );
    for run in change_runs(&report.changes) {
        let kind = run.first.change.name();
        if run.count == 1 {
            let attempt = run
                .first
                .attempt
                .map(|a| format!(" (attempt {a})"))
                .unwrap_or_default();
            out.push_str(&format!("  {kind:<9} {}{attempt}\n", run.first.node));
        } else {
            out.push_str(&format!(
                "  {kind:<9} {} \u{2026} {} ({} nodes)\n",
                run.first.node, run.last.node, run.count
            ));
        }
    }
    out.push_str(&format!(
        "{} to create, {} to replace, {} to remove, {} unchanged\n",
        report.count(ChangeKind::Create),
        report.count(ChangeKind::Replace),
        report.count(ChangeKind::Remove) + report.count(ChangeKind::AlreadyRemoving),
        report.count(ChangeKind::Keep),
    ));
    out
}

/// Consecutive slots of one group that get the same change: one line of the
/// human plan.
struct ChangeRun<'a> {
    first: &'a PlannedChange,
    last: &'a PlannedChange,
    count: usize,
}

/// The group and index of a slot named `{group}-{index}`; `None` for a name
/// of another form (which then stands on a line of its own).
fn slot_of(node: &str) -> Option<(&str, u32)> {
    let (group, index) = node.rsplit_once('-')?;
    if index.is_empty() || !index.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((group, index.parse().ok()?))
}

/// Splits `changes` (in slot order) into runs of consecutive indices of one
/// group with the same change.
fn change_runs(changes: &[PlannedChange]) -> Vec<ChangeRun<'_>> {
    let mut runs: Vec<ChangeRun<'_>> = Vec::new();
    for change in changes {
        if let Some(run) = runs.last_mut() {
            let follows = match (slot_of(&run.last.node), slot_of(&change.node)) {
                (Some((group, index)), Some((next_group, next_index))) => {
                    group == next_group && index.checked_add(1) == Some(next_index)
                }
                _ => false,
            };
            if follows && run.last.change == change.change {
                run.last = change;
                run.count += 1;
                continue;
            }
        }
        runs.push(ChangeRun {
            first: change,
            last: change,
            count: 1,
        });
    }
    runs
}

async fn down(
    location: &SocketLocation,
    state: &state::StateLocation,
    run: Option<String>,
    timeout: Duration,
) -> anyhow::Result<ExitCode> {
    let socket = match location.find(run.as_deref()) {
        Ok(socket) if control::is_live(&socket).await => socket,
        found => {
            let no_up = match found {
                Ok(socket) => format!("no `provision up` answers on {}", socket.display()),
                Err(message) => message,
            };
            return up::down_from_state(state, location, run, timeout, &no_up).await;
        }
    };
    print(&format!("asking {} to tear down...\n", socket.display()));
    let response = control::ask(&socket, &Request::Down, timeout)
        .await
        .map_err(anyhow::Error::msg)?;
    match response {
        Response::Down {
            clean: true,
            remaining_nodes: _,
        } => {
            print("torn down: no node is left\n");
            Ok(ExitCode::SUCCESS)
        }
        Response::Down {
            clean: false,
            remaining_nodes,
        } => {
            print(&format!(
                "teardown was forced with {remaining_nodes} node(s) left to the provider's cleanup\n"
            ));
            Ok(ExitCode::from(EXIT_FAILURE))
        }
        other => unexpected(other),
    }
}

async fn resume(
    location: &SocketLocation,
    run: Option<String>,
    group: String,
) -> anyhow::Result<ExitCode> {
    let socket = location.find(run.as_deref()).map_err(anyhow::Error::msg)?;
    let request = Request::Resume {
        group: group.clone(),
    };
    match control::ask(&socket, &request, control::CLIENT_TIMEOUT)
        .await
        .map_err(anyhow::Error::msg)?
    {
        Response::Resumed { was_open: true } => {
            print(&format!(
                "group {group} resumed: new attempts start again\n"
            ));
            Ok(ExitCode::SUCCESS)
        }
        Response::Resumed { was_open: false } => {
            print(&format!("group {group} was not paused; nothing changed\n"));
            Ok(ExitCode::SUCCESS)
        }
        Response::Error { message } => {
            eprintln!("error: {message}");
            Ok(ExitCode::from(EXIT_INVALID_INPUT))
        }
        other => unexpected(other),
    }
}

fn validate(file: &Path) -> ExitCode {
    match shape_file::load(file, &providers::kinds()) {
        Ok(source) => {
            for warning in source.warnings() {
                eprintln!("warning: {}: {warning}", file.display());
            }
            print(&format!(
                "{}: valid: run {}, {} group(s), {} node(s)\n",
                file.display(),
                source.run_id,
                source.groups.len(),
                source.node_count()
            ));
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::from(EXIT_INVALID_INPUT)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn change(node: &str, change: ChangeKind, attempt: Option<u64>) -> PlannedChange {
        PlannedChange {
            node: node.to_owned(),
            change,
            attempt,
        }
    }

    fn report(changes: Vec<PlannedChange>) -> PlanReport {
        PlanReport {
            run_id: "demo".to_owned(),
            generation: 2,
            changes,
            next_steps: Vec::new(),
        }
    }

    fn body(text: &str) -> Vec<&str> {
        let lines: Vec<&str> = text.lines().collect();
        lines[1..lines.len() - 1].to_vec()
    }

    #[test]
    fn colour_is_used_only_on_a_terminal_without_no_color() {
        assert!(use_colour(true, None));
        assert!(
            use_colour(true, Some(OsStr::new(""))),
            "an empty NO_COLOR is unset"
        );
        assert!(!use_colour(true, Some(OsStr::new("1"))));
        assert!(!use_colour(false, None), "a file or a pipe gets no colour");
        assert!(!use_colour(false, Some(OsStr::new("1"))));
    }

    #[test]
    fn plan_text_summarises_a_100k_node_group_in_one_line() {
        let changes = (0..100_000)
            .map(|i| change(&format!("w-{i}"), ChangeKind::Create, None))
            .collect();
        let text = plan_text(&report(changes), "an empty cluster");
        assert_eq!(
            body(&text),
            ["  create    w-0 \u{2026} w-99999 (100000 nodes)"]
        );
        assert!(
            text.ends_with("100000 to create, 0 to replace, 0 to remove, 0 unchanged\n"),
            "{text}"
        );
    }

    #[test]
    fn plan_starts_a_new_line_at_a_gap_another_group_or_another_change() {
        let changes = vec![
            change("web-0", ChangeKind::Keep, Some(1)),
            change("web-1", ChangeKind::Keep, Some(2)),
            change("web-2", ChangeKind::Replace, Some(3)),
            change("web-3", ChangeKind::Keep, Some(4)),
            change("web-4", ChangeKind::Keep, Some(5)),
            change("web-6", ChangeKind::Keep, Some(7)),
            change("web-7", ChangeKind::Remove, Some(8)),
            change("web-8", ChangeKind::Remove, Some(9)),
            change("web-db-0", ChangeKind::Remove, Some(10)),
            change("web-db-1", ChangeKind::Create, None),
        ];
        let text = plan_text(&report(changes), "the running cluster");
        assert_eq!(
            body(&text),
            [
                "  keep      web-0 \u{2026} web-1 (2 nodes)",
                "  replace   web-2 (attempt 3)",
                "  keep      web-3 \u{2026} web-4 (2 nodes)",
                "  keep      web-6 (attempt 7)",
                "  remove    web-7 \u{2026} web-8 (2 nodes)",
                "  remove    web-db-0 (attempt 10)",
                "  create    web-db-1",
            ]
        );
        assert!(
            text.ends_with("1 to create, 1 to replace, 3 to remove, 5 unchanged\n"),
            "{text}"
        );
    }

    #[test]
    fn a_slot_name_of_another_form_stands_on_its_own_line() {
        assert_eq!(slot_of("web-12"), Some(("web", 12)));
        assert_eq!(slot_of("a-b-3"), Some(("a-b", 3)));
        assert_eq!(slot_of("web"), None);
        assert_eq!(slot_of("web-"), None);
        assert_eq!(slot_of("web-+1"), None);
        assert_eq!(slot_of("web-99999999999"), None);
        let changes = vec![
            change("odd", ChangeKind::Create, None),
            change("odd", ChangeKind::Create, None),
        ];
        let text = plan_text(&report(changes), "x");
        assert_eq!(body(&text), ["  create    odd", "  create    odd"]);
    }
}
