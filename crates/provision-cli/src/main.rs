//! The `provision` command.
//!
//! `provision up FILE` runs a cluster in the foreground; `status`, `plan`
//! and `down` talk to it over its control socket; `validate` checks a shape
//! file offline. See the README for a quick start and `shape_file` for the
//! file format.

mod control;
mod display;
mod local;
mod shape_file;
mod up;

use std::ffi::OsString;
use std::io::{IsTerminal, Write as _};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::{ArgAction, Parser, Subcommand};
use provisioning::{ClusterState, Generation, Timestamp};
use provisioning_runtime::{ChangeKind, PlanReport, plan_against};
use tracing_subscriber::EnvFilter;

use crate::control::{Request, Response, SocketLocation};

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
    /// The directory of the control sockets (one per run).
    #[arg(long, global = true, env = "PROVISION_SOCKET_DIR", value_name = "DIR")]
    socket_dir: Option<PathBuf>,
    /// The control socket itself (overrides --socket-dir).
    #[arg(long, global = true, env = "PROVISION_SOCKET", value_name = "PATH")]
    socket: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
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
    },
    /// Shows the state of a running `up`.
    Status {
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
    /// Asks a running `up` to tear its cluster down and waits until it did.
    Down {
        /// The run to stop (needed only when several are up).
        #[arg(long)]
        run: Option<String>,
        /// Seconds to wait for the teardown.
        #[arg(long, default_value_t = DEFAULT_DOWN_TIMEOUT_SECS, value_name = "SECS")]
        timeout: u64,
    },
    /// Checks a shape file without starting anything.
    Validate {
        /// The shape file (TOML).
        file: PathBuf,
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
        if first == local::AGENT_SUBCOMMAND {
            return local::agent_main(raw.collect());
        }
    }
    let cli = Cli::parse();
    init_logging(cli.verbose);
    match run(cli) {
        Ok(code) => code,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::from(EXIT_FAILURE)
        }
    }
}

fn init_logging(verbose: u8) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        EnvFilter::new(match verbose {
            0 => "warn",
            1 => "info",
            2 => "debug",
            _ => "trace",
        })
    });
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
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
    match cli.command {
        Command::Up {
            file,
            shutdown_timeout,
            plain,
        } => runtime()?.block_on(up::run(up::UpOptions {
            file,
            location,
            shutdown_timeout: Duration::from_secs(shutdown_timeout),
            live: !plain && std::io::stdout().is_terminal(),
        })),
        Command::Status { json, run } => runtime()?.block_on(status(&location, run, json)),
        Command::Plan { file, json } => runtime()?.block_on(plan(&location, &file, json)),
        Command::Down { run, timeout } => {
            runtime()?.block_on(down(&location, run, Duration::from_secs(timeout)))
        }
        Command::Validate { file } => Ok(validate(&file)),
        Command::Agent { args } => Ok(local::agent_main(args)),
    }
}

/// Prints to stdout, ignoring a closed pipe.
fn print(text: &str) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(text.as_bytes());
    let _ = out.flush();
}

async fn status(
    location: &SocketLocation,
    run: Option<String>,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let socket = location.find(run.as_deref()).map_err(anyhow::Error::msg)?;
    let response = control::ask(&socket, &Request::Status, control::CLIENT_TIMEOUT)
        .await
        .map_err(anyhow::Error::msg)?;
    match response {
        Response::Status { status } => {
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
    let source = match shape_file::parse(file, &text, local::PROVIDERS) {
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
    for change in &report.changes {
        let attempt = change
            .attempt
            .map(|a| format!(" (attempt {a})"))
            .unwrap_or_default();
        out.push_str(&format!(
            "  {:<9} {}{attempt}\n",
            change.change.name(),
            change.node
        ));
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

async fn down(
    location: &SocketLocation,
    run: Option<String>,
    timeout: Duration,
) -> anyhow::Result<ExitCode> {
    let socket = location.find(run.as_deref()).map_err(anyhow::Error::msg)?;
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

fn validate(file: &Path) -> ExitCode {
    match shape_file::load(file, local::PROVIDERS) {
        Ok(source) => {
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
