//! `provision up FILE`: bring the cluster up, keep it in shape, follow edits
//! of FILE, and tear everything down on Ctrl-C.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use provisioning::RunId;
use provisioning_runtime::{
    AppliedRevision, Durability, Host, HostConfig, HostError, HostHandle, ShutdownOutcome,
};
use tokio::signal::unix::{SignalKind, signal};

use crate::control::{self, SocketLocation};
use crate::display::Console;
use crate::providers;
use crate::shape_file;
use crate::state::{self, StateLocation};
use crate::{EXIT_FAILURE, EXIT_INVALID_INPUT};

/// How often `up` looks at its shape file for edits.
pub(crate) const FILE_POLL_INTERVAL: Duration = Duration::from_millis(500);

/// How long `up` waits for its display to print the last snapshot.
const DISPLAY_FINISH_WAIT: Duration = Duration::from_secs(2);

/// How `up` runs.
#[derive(Clone, Debug)]
pub(crate) struct UpOptions {
    /// The shape file.
    pub(crate) file: PathBuf,
    /// Where the control socket goes.
    pub(crate) location: SocketLocation,
    /// Where the run's state file is.
    pub(crate) state: StateLocation,
    /// The bound on the graceful teardown before it is forced.
    pub(crate) shutdown_timeout: Duration,
    /// Live bars (a terminal) or plain lines.
    pub(crate) live: bool,
    /// Where to serve Prometheus metrics, if anywhere.
    pub(crate) metrics: Option<std::net::SocketAddr>,
}

/// Removes the control socket when `up` ends, however it ends.
struct SocketFile(PathBuf);

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Runs `up` to the end and returns the exit code.
///
/// # Errors
/// When the control socket, the signal handlers, the provider or the host
/// cannot be set up.
pub(crate) async fn run(options: UpOptions) -> anyhow::Result<ExitCode> {
    // Handlers first: a Ctrl-C from now on tears down instead of killing us.
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    // A closed terminal tears down too, rather than leaving nodes behind.
    let mut hangup = signal(SignalKind::hangup())?;

    let file = options.file.as_path();
    let text = match shape_file::read(file) {
        Ok(text) => text,
        Err(error) => return Ok(invalid(&error)),
    };
    let source = match shape_file::parse(file, &text, &providers::kinds()) {
        Ok(source) => source,
        Err(error) => return Ok(invalid(&error)),
    };
    // The state first: its lock refuses a second controller of the run
    // before anything else is touched.
    let mut durability = match options.state.open(source.run_id.as_str()) {
        Ok(durability) => durability,
        Err(message) => return Ok(refused(&message)),
    };
    let secret = match state::run_secret(&mut durability) {
        Ok(secret) => secret,
        Err(message) => return Ok(refused(&message)),
    };
    // The file goes into the state too: a `down` after a crash starts the
    // same providers from it (a provider program, remote hosts).
    let note = serde_json::json!({ "path": file, "text": text }).to_string();
    if let Err(error) = durability.store_note(SHAPE_FILE_NOTE, &note) {
        return Ok(refused(&format!(
            "cannot write the state file {}: {error}",
            options.state.file(source.run_id.as_str())
        )));
    }
    if let Some(address) = options.metrics {
        if let Err(error) = metrics_exporter_prometheus::PrometheusBuilder::new()
            .with_http_listener(address)
            .install()
        {
            return Ok(refused(&format!(
                "cannot serve metrics on {address}: {error}"
            )));
        }
    }
    let socket = options.location.for_run(source.run_id.as_str());
    let listener = control::claim(&socket).await.map_err(anyhow::Error::msg)?;
    let _socket_file = SocketFile(socket.clone());
    let console = Arc::new(Console::new(options.live));
    console.set_group_order(source.groups.iter().map(|g| g.id.as_str().to_owned()));
    for warning in source.warnings() {
        console.line(format!("warning: {}: {warning}", file.display()));
    }
    if let Some(resumed) = durability.resume_summary() {
        console.line(format!(
            "resuming run {} from {}: generation {}, {} node(s) journaled; adopting what still runs",
            source.run_id,
            options.state.file(source.run_id.as_str()),
            resumed.generation,
            resumed.nodes
        ));
    }

    let host = start_host(
        &source.run_id,
        secret,
        &source,
        source.limits.clone(),
        durability,
        options.shutdown_timeout,
        options.metrics.is_some(),
    )
    .await?;
    if let Some(address) = options.metrics {
        console.line(format!("metrics at http://{address}/metrics"));
    }
    let handle = host.handle();

    let applied = match handle
        .apply_revision(source.run_id.clone(), source.groups.clone())
        .await
    {
        Ok(revision) => {
            console.line(format!(
                "{}: run {}, {} node(s) in {} group(s), generation {}; control socket {}",
                file.display(),
                source.run_id,
                source.node_count(),
                source.groups.len(),
                revision.generation(),
                socket.display()
            ));
            revision.generation().get()
        }
        Err(error) => {
            eprintln!("error: {}: {error}", file.display());
            handle.shutdown().await;
            host.join().await;
            return Ok(ExitCode::from(EXIT_INVALID_INPUT));
        }
    };

    let server = tokio::spawn(control::serve(listener, handle.clone(), providers::kinds()));
    let display = {
        let console = console.clone();
        let progress = handle.subscribe();
        tokio::spawn(async move { console.follow(progress, applied).await })
    };
    let watcher = tokio::spawn(watch_file(
        options.file.clone(),
        text,
        handle.clone(),
        console.clone(),
    ));

    let mut interrupts = 0_u32;
    loop {
        tokio::select! {
            _ = interrupt.recv() => interrupts += 1,
            _ = terminate.recv() => interrupts += 1,
            _ = hangup.recv() => interrupts += 1,
            _ = handle.wait_stopped() => break,
        }
        if interrupts == 1 {
            console.line("tearing the cluster down to zero nodes (Ctrl-C again to force)");
            handle.request_shutdown();
        } else {
            console.line("forcing shutdown: killing every node process");
            handle.force_shutdown();
        }
    }
    watcher.abort();
    let report = host.join().await;
    let _ = tokio::time::timeout(DISPLAY_FINISH_WAIT, display).await;
    let _ = server.await;
    Ok(match report.outcome {
        ShutdownOutcome::Clean => {
            console.line("every node was torn down; bye");
            ExitCode::SUCCESS
        }
        ShutdownOutcome::Forced => {
            console.line(format!(
                "shutdown was forced with {} node(s) still managed; the provider killed what was left",
                report.remaining_nodes
            ));
            ExitCode::from(EXIT_FAILURE)
        }
    })
}

fn invalid(error: &shape_file::ShapeFileError) -> ExitCode {
    refused(&error.to_string())
}

fn refused(message: &str) -> ExitCode {
    eprintln!("error: {message}");
    eprintln!("nothing was started");
    ExitCode::from(EXIT_INVALID_INPUT)
}

/// Starts the providers and a host that keeps its state in `durability`.
async fn start_host(
    run_id: &RunId,
    secret: provisioning_agent::RunSecret,
    source: &shape_file::ShapeSource,
    limits: provisioning::Limits,
    durability: Durability,
    shutdown_timeout: Duration,
    metrics: bool,
) -> anyhow::Result<Host> {
    let mut durability = durability;
    let memo = providers::ProviderMemo::from_notes(durability.notes());
    let mut plugins = Vec::with_capacity(source.providers.len());
    for provider in &source.providers {
        plugins.push(provider.start(run_id, secret.clone(), &memo).await?);
    }
    for (name, value) in memo.to_notes() {
        durability
            .store_note(&name, &value)
            .map_err(|e| anyhow::anyhow!("cannot write the state file: {e}"))?;
    }
    let mut config = HostConfig::new(run_id.clone());
    config.limits = limits;
    config.policy = providers::retry_policy();
    config.shutdown_deadline = shutdown_timeout;
    config.metrics = metrics;
    Ok(Host::start_durable(config, plugins, durability)?)
}

/// `provision down` with no `up` running: tears down a run that a crashed
/// `up` left unclean, from its state file (how a user cleans up after a
/// crash). `no_up` says why no running `up` was asked.
pub(crate) async fn down_from_state(
    state: &StateLocation,
    location: &SocketLocation,
    run: Option<String>,
    timeout: Duration,
    no_up: &str,
) -> anyhow::Result<ExitCode> {
    let named = run.is_some();
    let runs = run.map_or_else(|| state.runs(), |run| vec![run]);
    let mut unclean = Vec::new();
    for run in runs {
        match state.open_existing(&run) {
            Ok(Some(durability)) if durability.resume_summary().is_some() => {
                unclean.push((run, durability));
            }
            Ok(_) => {}
            Err(message) if named => {
                eprintln!("error: {message}");
                return Ok(ExitCode::from(EXIT_INVALID_INPUT));
            }
            Err(message) => tracing::warn!("{message}"),
        }
    }
    if unclean.len() > 1 {
        let names: Vec<_> = unclean.iter().map(|(run, _)| run.as_str()).collect();
        eprintln!(
            "error: {no_up}; several runs were left unclean, name one with --run: {}",
            names.join(", ")
        );
        return Ok(ExitCode::from(EXIT_FAILURE));
    }
    let Some((run, mut durability)) = unclean.pop() else {
        eprintln!("error: {no_up}, and no run was left unclean in the state directory");
        return Ok(ExitCode::from(EXIT_FAILURE));
    };
    let summary = durability.resume_summary();
    crate::print(&format!(
        "{no_up}; recovering run {run} from {} ({} node(s) journaled) to tear it down...\n",
        state.file(&run),
        summary.map_or(0, |s| s.nodes),
    ));
    let secret = match state::run_secret(&mut durability) {
        Ok(secret) => secret,
        Err(message) => {
            eprintln!("error: {message}");
            return Ok(ExitCode::from(EXIT_INVALID_INPUT));
        }
    };
    let run_id = RunId::new(run.as_str());
    // The providers are those of the file the run was started from, kept
    // in the state; without it (or if it no longer parses), only those
    // that can reach their nodes without it are served (the embedded one).
    let source = match stored_source(&durability, &run_id) {
        Ok(source) => source,
        Err(why) => {
            crate::print(&format!(
                "{why}; serving the embedded provider only (nodes of other providers are left to them)\n"
            ));
            shape_file::ShapeSource {
                run_id: run_id.clone(),
                groups: Vec::new(),
                limits: provisioning::Limits::default(),
                providers: providers::without_file(),
            }
        }
    };
    let limits = provisioning::Limits::default();
    let host = start_host(&run_id, secret, &source, limits, durability, timeout, false).await?;
    let report = host.handle().shutdown().await;
    host.join().await;
    // The crashed `up` left its socket behind; nobody answers on it.
    location.remove_stale(&run);
    Ok(match report.outcome {
        ShutdownOutcome::Clean => {
            crate::print("torn down: no node is left; the state is marked clean\n");
            ExitCode::SUCCESS
        }
        ShutdownOutcome::Forced => {
            crate::print(&format!(
                "teardown was forced with {} node(s) left to the provider's cleanup\n",
                report.remaining_nodes
            ));
            ExitCode::from(EXIT_FAILURE)
        }
    })
}

/// The name of the state note that keeps the shape file a run was started
/// from (`{"path": …, "text": …}`).
const SHAPE_FILE_NOTE: &str = "shape-file";

/// The providers' settings of the file `run` was started from, as kept in
/// its state.
fn stored_source(
    durability: &Durability,
    run_id: &RunId,
) -> Result<shape_file::ShapeSource, String> {
    let note = durability
        .note(SHAPE_FILE_NOTE)
        .ok_or_else(|| "the state keeps no shape file".to_owned())?;
    let value: serde_json::Value = serde_json::from_str(note)
        .map_err(|e| format!("the kept shape file is unreadable: {e}"))?;
    let (Some(path), Some(text)) = (value["path"].as_str(), value["text"].as_str()) else {
        return Err("the kept shape file is incomplete".to_owned());
    };
    let source = shape_file::parse(std::path::Path::new(path), text, &providers::kinds())
        .map_err(|e| format!("the kept shape file no longer parses: {e}"))?;
    if source.run_id != *run_id {
        return Err(format!(
            "the kept shape file is of run {}, not {run_id}",
            source.run_id
        ));
    }
    Ok(source)
}

/// Applies each valid edit of `path` as the next generation; reports and
/// ignores invalid ones.
async fn watch_file(
    path: PathBuf,
    mut last_text: String,
    handle: HostHandle,
    console: Arc<Console>,
) {
    let mut ticker = tokio::time::interval(FILE_POLL_INTERVAL);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_read_error: Option<String> = None;
    loop {
        ticker.tick().await;
        if handle.is_stopped() {
            return;
        }
        let text = match shape_file::read(&path) {
            Ok(text) => {
                last_read_error = None;
                text
            }
            Err(error) => {
                // Editors may replace the file in two steps; say it once.
                let message = error.to_string();
                if last_read_error.as_ref() != Some(&message) {
                    console.line(format!("{message} (the cluster keeps its current shape)"));
                    last_read_error = Some(message);
                }
                continue;
            }
        };
        if text == last_text {
            continue;
        }
        last_text.clone_from(&text);
        if !apply_edit(&path, &text, &handle, &console).await {
            return;
        }
    }
}

/// Applies one edit. Returns `false` when the host no longer takes shapes.
async fn apply_edit(path: &Path, text: &str, handle: &HostHandle, console: &Console) -> bool {
    let source = match shape_file::parse(path, text, &providers::kinds()) {
        Ok(source) => source,
        Err(error) => {
            console.line(format!(
                "edit ignored: {error} (the cluster keeps its current shape)"
            ));
            return true;
        }
    };
    for warning in source.warnings() {
        console.line(format!("warning: {}: {warning}", path.display()));
    }
    let limits = source.limits.clone();
    let group_ids: Vec<String> = source
        .groups
        .iter()
        .map(|g| g.id.as_str().to_owned())
        .collect();
    let outcome = handle.apply_revision(source.run_id, source.groups).await;
    if outcome.is_ok() && handle.set_limits(limits).await.is_err() {
        return false;
    }
    match outcome {
        Ok(AppliedRevision::Applied { generation }) => {
            console.set_group_order(group_ids);
            console.line(format!(
                "{}: edit applied as generation {generation}",
                path.display()
            ));
        }
        Ok(AppliedRevision::Unchanged { generation }) => {
            console.line(format!(
                "{}: no change to the shape in force (generation {generation})",
                path.display()
            ));
        }
        Err(HostError::ShuttingDown | HostError::Stopped) => return false,
        Err(error) => console.line(format!(
            "edit rejected: {}: {error} (the cluster keeps its current shape)",
            path.display()
        )),
    }
    true
}
