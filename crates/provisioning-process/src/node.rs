//! The life of a node agent process: watching it, reading what it prints,
//! and taking its process group down.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use provisioning::observe::LossCause;
use provisioning_provider::{AttemptKey, PluginError};
use tokio::process::{Child, ChildStderr, ChildStdout};
use tokio::sync::watch;

use crate::state::{Life, SessionState, Shared};
use provisioning_agent::codec::{MessageReader, TextLinesCodec};
use provisioning_agent::os;
use provisioning_agent::wire::AgentAnnouncement;
use tokio_util::codec::FramedRead;

/// How long a stop waits for the agent to exit after `SIGKILL`.
const EXIT_AFTER_KILL_WAIT_MAX: Duration = Duration::from_secs(5);

/// How long a stop waits for the rest of the process group after the agent.
const GROUP_GONE_WAIT_MAX: Duration = Duration::from_secs(5);

/// How often a stop looks at `/proc` while waiting for the group to go.
const GROUP_POLL_INTERVAL: Duration = Duration::from_millis(20);

/// The longest agent output line relayed to the log; longer lines are cut
/// into pieces of this size.
const RELAYED_LINE_BYTES_MAX: usize = 4096;

/// Waits for the agent to exit and records it. An exit nobody asked for is
/// the loss of the node: what is left of its group is killed and the loss
/// reported.
pub(crate) async fn watch_process(
    shared: Arc<Shared>,
    key: AttemptKey,
    instance: u64,
    mut child: Child,
    exited: watch::Sender<bool>,
) {
    // Unbounded by design: it ends when the process ends, and the plugin
    // ends every process it started (destroy, shutdown, drop) unless they
    // are detached, which is meant to outlive the plugin.
    let status = match child.wait().await {
        Ok(status) => describe_exit(status),
        Err(error) => format!("cannot be waited for: {error}"),
    };
    on_exit(&shared, &key, instance, &exited, &status);
}

/// How a process ended, in words: `exited with status 3`, `killed by
/// signal 9`.
pub(crate) fn describe_exit(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        (None, None) => "ended abnormally".to_owned(),
    }
}

/// How often the exit of an adopted agent (not this process's child, so
/// there is nothing to wait on) is looked for in `/proc`.
const ADOPTED_POLL_INTERVAL: Duration = Duration::from_millis(50);

/// Watches an adopted agent through `/proc` until it is gone (or the plugin
/// closes), then records its exit as [`watch_process`] does.
pub(crate) async fn watch_adopted(
    shared: Arc<Shared>,
    key: AttemptKey,
    instance: u64,
    pid: i32,
    exited: watch::Sender<bool>,
) {
    let mut closing = shared.shutdown.subscribe();
    // Bounded by the agent's life and by the plugin's.
    loop {
        let probe = key.clone();
        // Two small reads, but off the runtime like every `/proc` read.
        let alive = tokio::task::spawn_blocking(move || os::tagged_process(pid, &probe).is_some())
            .await
            .unwrap_or(false);
        if !alive {
            break;
        }
        tokio::select! {
            _ = closing.wait_for(|closing| *closing) => return,
            () = tokio::time::sleep(ADOPTED_POLL_INTERVAL) => {}
        }
    }
    on_exit(&shared, &key, instance, &exited, "is gone from /proc");
}

/// Records the exit of instance `instance` of `key`'s agent.
fn on_exit(
    shared: &Arc<Shared>,
    key: &AttemptKey,
    instance: u64,
    exited: &watch::Sender<bool>,
    status: &str,
) {
    let (before, group) = {
        let mut table = shared.table();
        match table.get_mut(key).filter(|e| e.instance == instance) {
            Some(entry) => {
                let before = entry.life;
                entry.life = Life::Exited;
                (Some(before), entry.group)
            }
            None => (None, 0),
        }
    };
    let _ = exited.send(true);
    if before == Some(Life::Running) && !shared.is_closing() {
        tracing::warn!(
            "node {} (attempt {}) lost: its agent {status}",
            key.node,
            key.attempt.get()
        );
        // The group leader is reaped, so its id may be reused: find what is
        // left of the group by its tags instead of signalling the id.
        //
        // Done here, in the poll that saw the exit, so nothing of the group
        // outlives the agent by a turn of the runtime: an unexpected exit is
        // one node's, and the look is cheap (`group_processes` asks the
        // kernel first and reads the environment of the group's members
        // only), unlike the fleet-wide scans of a teardown.
        if let Ok(left) = os::group_processes(&key.run_id, group) {
            os::signal_processes(&left, Signal::SIGKILL);
        }
        shared.report_lost(key, LossCause::LeaseGone);
    } else {
        tracing::debug!(node = %key, "node agent {status}");
    }
}

/// Reads the agent's announcement and records its endpoint; then drains the
/// rest of its standard output.
pub(crate) async fn read_announcement(
    shared: Arc<Shared>,
    key: AttemptKey,
    instance: u64,
    stdout: ChildStdout,
) {
    let mut reader = MessageReader::<AgentAnnouncement, _>::new(stdout);
    match reader.next().await {
        Ok(Some(AgentAnnouncement::Listening { address, pid })) if address.ip().is_loopback() => {
            tracing::debug!(node = %key, %address, pid, "node agent listening");
            if let Some(entry) = shared
                .table()
                .get_mut(&key)
                .filter(|e| e.instance == instance)
            {
                entry.endpoint = Some(address);
            }
        }
        Ok(Some(AgentAnnouncement::Listening { address, .. })) => {
            tracing::warn!(node = %key, %address, "agent announced a non-loopback address; ignored");
        }
        Ok(None) => {
            tracing::debug!(node = %key, "agent closed its output before announcing");
            return;
        }
        Err(error) => {
            tracing::warn!(node = %key, %error, "agent announcement rejected");
        }
    }
    // Nothing else is expected here; draining keeps the agent from blocking.
    let mut sink = tokio::io::sink();
    let _ = tokio::io::copy(&mut reader.into_inner(), &mut sink).await;
}

/// Relays the agent's (and its workload's) diagnostics to this process's log.
pub(crate) async fn relay_output(key: AttemptKey, stderr: ChildStderr) {
    let mut lines = FramedRead::new(stderr, TextLinesCodec::new(RELAYED_LINE_BYTES_MAX));
    // Bounded by the agent's life: it ends when the pipe closes.
    while let Some(Ok(line)) = lines.next().await {
        relay_line(&key, line.trim_end());
    }
}

/// The level an agent's log line carries, and the line without it. Lines
/// without a level (the workload's own output) are `None`.
fn split_level(text: &str) -> (Option<tracing::Level>, &str) {
    let trimmed = text.trim_start();
    let (first, rest) = trimmed
        .split_once(char::is_whitespace)
        .unwrap_or((trimmed, ""));
    let level = match first {
        "ERROR" => tracing::Level::ERROR,
        "WARN" => tracing::Level::WARN,
        "INFO" => tracing::Level::INFO,
        "DEBUG" => tracing::Level::DEBUG,
        "TRACE" => tracing::Level::TRACE,
        _ => return (None, text),
    };
    (Some(level), rest.trim_start())
}

/// Logs one line of an agent's output once: at the level the line carries
/// (without repeating it), so a warning of the agent reads as one warning
/// of the node. Its informational lines and the workload's output go to
/// debug level.
fn relay_line(key: &AttemptKey, text: &str) {
    const TARGET: &str = "provisioning_process::node";
    match split_level(text) {
        (Some(tracing::Level::ERROR), line) => {
            tracing::error!(target: TARGET, "node {}'s agent: {line}", key.node);
        }
        (Some(tracing::Level::WARN), line) => {
            tracing::warn!(target: TARGET, "node {}'s agent: {line}", key.node);
        }
        (Some(_), line) => tracing::debug!(target: TARGET, node = %key, "agent: {line}"),
        (None, line) => tracing::debug!(target: TARGET, node = %key, "output: {line}"),
    }
}

/// Stops the node of `key`: `SIGTERM` to its group, `SIGKILL` after the
/// grace, then waits (bounded) until the group is gone, and forgets it.
pub(crate) async fn stop_node(shared: &Arc<Shared>, key: &AttemptKey) -> Result<(), PluginError> {
    let Some((group, mut exited, session_task)) = ({
        let mut table = shared.table();
        table.get_mut(key).map(|entry| {
            if entry.life == Life::Running {
                entry.life = Life::Destroying;
            }
            let task = entry.session.as_mut().map(|session| {
                if !session.state.is_over() {
                    session.state = SessionState::Cancelled;
                }
                session.task.clone()
            });
            (entry.group, entry.exited.clone(), task)
        })
    }) else {
        return kill_strays(shared, key).await;
    };
    if let Some(task) = session_task {
        task.abort();
    }
    signal_group(shared, key, group, Signal::SIGTERM).await;
    // A stopped process only acts on SIGTERM once continued.
    signal_group(shared, key, group, Signal::SIGCONT).await;
    let graceful = tokio::time::timeout(shared.stop_grace, exited.wait_for(|gone| *gone))
        .await
        .is_ok_and(|result| result.is_ok());
    if !graceful {
        tracing::debug!(node = %key, "grace over; killing the node group");
    }
    signal_group(shared, key, group, Signal::SIGKILL).await;
    if tokio::time::timeout(EXIT_AFTER_KILL_WAIT_MAX, exited.wait_for(|gone| *gone))
        .await
        .is_err()
    {
        return Err(PluginError::ambiguous(format!(
            "the node agent of {key} did not exit after SIGKILL"
        )));
    }
    wait_group_gone(shared, key, group).await?;
    let mut table = shared.table();
    if table.get(key).is_some_and(|entry| entry.group == group) {
        table.remove(key);
    }
    Ok(())
}

/// Signals the group of `key`'s agent. While the agent is unreaped its pid
/// cannot be reused, so the group id is safe to signal; after that, only
/// processes carrying the node's tags are signalled — found in a shared
/// scan, and only when the kernel says the group still has members.
async fn signal_group(shared: &Shared, key: &AttemptKey, group: i32, signal: Signal) {
    // An adopted agent is not this process's child: its pid may be reused
    // the moment it exits, so it is only ever signalled by its tags.
    let by_tags = shared
        .table()
        .get(key)
        .is_none_or(|entry| entry.life == Life::Exited || entry.adopted);
    if by_tags {
        if let Ok(left) = shared.scanner.group(group).await {
            os::signal_processes(&left, signal);
        }
    } else if let Err(error) = killpg(Pid::from_raw(group), signal) {
        tracing::debug!(node = %key, group, %error, signal = signal.as_str(), "cannot signal node group");
    }
}

/// Where [`kill_until_gone`] looks for what is left.
enum Left<'a> {
    /// The process group of an agent.
    Group(i32),
    /// Every process tagged with the key.
    Node(&'a AttemptKey),
}

/// Kills what is left, again and again, until nothing is or the bound
/// passes. Every look is a shared scan (see [`crate::scan`]); a group the
/// kernel says is empty needs none.
async fn kill_until_gone(
    shared: &Shared,
    key: &AttemptKey,
    what: &str,
    left: Left<'_>,
) -> Result<(), PluginError> {
    let deadline = tokio::time::Instant::now() + GROUP_GONE_WAIT_MAX;
    loop {
        let alive = match left {
            Left::Group(group) => shared.scanner.group(group).await,
            Left::Node(node) => shared.scanner.processes(|p| p.belongs_to(node)).await,
        }
        .map_err(|error| PluginError::ambiguous(format!("cannot check processes: {error}")))?;
        if alive.is_empty() {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(PluginError::ambiguous(format!(
                "{} {what} of {key} survived SIGKILL",
                alive.len()
            )));
        }
        os::signal_processes(&alive, Signal::SIGKILL);
        tokio::time::sleep(GROUP_POLL_INTERVAL).await;
    }
}

async fn wait_group_gone(shared: &Shared, key: &AttemptKey, group: i32) -> Result<(), PluginError> {
    kill_until_gone(shared, key, "process(es)", Left::Group(group)).await
}

/// Kills processes of `key` the plugin does not know (for example left by a
/// previous controller that died before its agents noticed).
async fn kill_strays(shared: &Shared, key: &AttemptKey) -> Result<(), PluginError> {
    let strays = shared
        .scanner
        .processes(|p| p.belongs_to(key))
        .await
        .map_err(|error| PluginError::ambiguous(format!("cannot check processes: {error}")))?;
    if !strays.is_empty() {
        tracing::warn!(node = %key, count = strays.len(), "killing stray processes of an unknown node");
    }
    kill_until_gone(shared, key, "stray process(es)", Left::Node(key)).await
}

#[cfg(test)]
mod tests {
    use super::split_level;

    #[test]
    fn a_relayed_agent_line_loses_its_level_word() {
        let (level, line) = split_level("WARN stopping the node reason=\"x\"");
        assert_eq!(level, Some(tracing::Level::WARN));
        assert_eq!(line, "stopping the node reason=\"x\"");
        let (level, line) = split_level(" INFO boot order accepted");
        assert_eq!(level, Some(tracing::Level::INFO));
        assert_eq!(line, "boot order accepted");
        assert_eq!(
            split_level("hello from the workload"),
            (None, "hello from the workload")
        );
        assert_eq!(
            split_level("WARNING: a workload's own word"),
            (None, "WARNING: a workload's own word")
        );
    }
}
