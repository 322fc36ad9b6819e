//! Processes run inside a node's container with the Engine API's `exec`:
//! short shell scripts (is the agent running, stop it), and the node agent
//! itself, whose boot order goes in on standard input and whose stages
//! come back on the exec's output.

use std::sync::Weak;

use bollard::Docker;
use bollard::exec::{StartExecOptions, StartExecResults};
use bollard::models::ExecConfig;
use futures_util::StreamExt;
use provisioning::state::{BootstrapFailure, BootstrapProgress};
use provisioning_agent::wire::{ControlReply, FailureStage, ProgressStage};
use provisioning_provider::{AttemptKey, PluginError};
use tokio::io::AsyncWriteExt;

use super::Shared;
use crate::engine;

/// The most output a script's answer keeps.
const SCRIPT_OUTPUT_BYTES_MAX: usize = 16 * 1024;

/// The longest agent output line read for stages.
const STAGE_LINE_BYTES_MAX: usize = 64 * 1024;

/// The agent's process id inside the container, written by [`AGENT_SCRIPT`]
/// (the agent keeps the shell's process id when the shell `exec`s it).
pub(crate) const AGENT_PID_FILE: &str = "${TMPDIR:-/tmp}/provision-agent.pid";

/// The agent's shell: the boot order arrives on standard input and goes
/// into a `0600` file the agent removes once it has read it, so the
/// credential is never on a command line or in the container's
/// configuration. Stages go to descriptor 3, which is the exec's output;
/// the agent's and its workload's own output go to the container's log
/// (the output of its first process) when that can be opened.
pub(crate) fn agent_script() -> String {
    format!(
        "umask 077
f=$(mktemp \"${{TMPDIR:-/tmp}}/provision-boot.XXXXXX\") || exit 2
cat >\"$f\" || {{ rm -f \"$f\"; exit 2; }}
echo $$ >\"{AGENT_PID_FILE}\" || exit 2
if [ -w /proc/1/fd/1 ]; then o=/proc/1/fd/1; else o=/dev/null; fi
PROVISION_AGENT_BOOT_FILE=$f PROVISION_AGENT_STATUS_FILE=/dev/fd/3 exec \"$@\" 3>&1 >\"$o\" 2>&1"
    )
}

/// Prints `RUNNING` when the agent of the container runs.
pub(crate) fn probe_script() -> String {
    format!(
        "p=$(cat \"{AGENT_PID_FILE}\" 2>/dev/null) || exit 0
kill -0 \"$p\" 2>/dev/null && echo RUNNING
exit 0"
    )
}

/// Stops the agent (`SIGTERM`: it stops its workload with a grace), waits
/// for it to go, `SIGKILL`s its process group after `grace_ticks` tenths
/// of a second; prints `GONE` once it is gone.
pub(crate) fn stop_script(grace_ticks: u64) -> String {
    format!(
        "p=$(cat \"{AGENT_PID_FILE}\" 2>/dev/null) || {{ echo GONE; exit 0; }}
kill -TERM \"$p\" 2>/dev/null
i=0
while kill -0 \"$p\" 2>/dev/null; do
  i=$((i+1))
  if [ $i -eq {grace_ticks} ]; then kill -KILL -- -\"$p\" \"$p\" 2>/dev/null; fi
  if [ $i -gt $(({grace_ticks}+50)) ]; then exit 1; fi
  sleep 0.1
done
rm -f \"{AGENT_PID_FILE}\"
echo GONE"
    )
}

/// The container's first process: it holds the container until it is
/// stopped, and then asks every other process of the container to stop
/// (`SIGTERM`) and waits for them, within the engine's stop grace.
pub(crate) const HOLD_SCRIPT: &str = "trap 'kill -TERM -1 2>/dev/null; wait; n=0; while set -- /proc/[0-9]*; [ $# -gt 1 ] && [ $n -lt 100 ]; do n=$((n+1)); sleep 0.1; done; exit 0' TERM INT
while :; do sleep 3600 & wait $!; done";

/// What a script printed and how it ended.
pub(crate) struct ScriptOutcome {
    pub(crate) stdout: String,
    pub(crate) exit_code: Option<i64>,
}

/// Runs `script` with `sh -c` in `container` and waits for it.
pub(crate) async fn run_script(
    docker: &Docker,
    container: &str,
    what: &str,
    script: &str,
) -> Result<ScriptOutcome, PluginError> {
    let config = ExecConfig {
        attach_stdout: Some(true),
        attach_stderr: Some(true),
        cmd: Some(vec!["/bin/sh".into(), "-c".into(), script.into()]),
        ..Default::default()
    };
    let exec = docker
        .create_exec(container, config)
        .await
        .map_err(|e| exec_error(what, &e))?;
    let started = docker
        .start_exec(&exec.id, None::<StartExecOptions>)
        .await
        .map_err(|e| engine::acting(what, &e))?;
    let mut stdout = Vec::new();
    if let StartExecResults::Attached { mut output, .. } = started {
        // Bounded by the script, which ends.
        while let Some(chunk) = output.next().await {
            match chunk {
                Ok(bollard::container::LogOutput::StdOut { message }) => {
                    if stdout.len() < SCRIPT_OUTPUT_BYTES_MAX {
                        stdout.extend_from_slice(&message);
                    }
                }
                Ok(_) => {}
                Err(error) => return Err(engine::acting(what, &error)),
            }
        }
    }
    let inspected = docker
        .inspect_exec(&exec.id)
        .await
        .map_err(|e| engine::looking(what, &e))?;
    Ok(ScriptOutcome {
        stdout: String::from_utf8_lossy(&stdout).into_owned(),
        exit_code: inspected.exit_code,
    })
}

/// An exec that could not be created: a container that is gone or not
/// running is "not found"/definite, the rest as any acting call.
fn exec_error(what: &str, error: &bollard::errors::Error) -> PluginError {
    match engine::classify(error) {
        engine::Failure::Missing => PluginError::not_found(format!("{what}: {error}")),
        engine::Failure::Conflict => {
            PluginError::definite(format!("{what}: the container is not running: {error}"))
        }
        _ => engine::acting(what, error),
    }
}

/// Starts the agent in `container` with `order` (the boot order, JSON) on
/// its standard input, and a task that relays its stages for session
/// `serial` of `key` until its output ends.
pub(crate) async fn launch_agent(
    docker: &Docker,
    shared: &std::sync::Arc<Shared>,
    key: &AttemptKey,
    serial: u64,
    container: &str,
    command: Vec<String>,
    order: Vec<u8>,
) -> Result<(), PluginError> {
    let what = format!("starting the agent of {key}");
    let mut cmd = vec!["/bin/sh".into(), "-c".into(), agent_script(), "sh".into()];
    cmd.extend(command);
    let config = ExecConfig {
        attach_stdin: Some(true),
        attach_stdout: Some(true),
        attach_stderr: Some(true),
        cmd: Some(cmd),
        ..Default::default()
    };
    let exec = docker
        .create_exec(container, config)
        .await
        .map_err(|e| exec_error(&what, &e))?;
    let started = docker
        .start_exec(&exec.id, None::<StartExecOptions>)
        .await
        .map_err(|e| engine::acting(&what, &e))?;
    let StartExecResults::Attached { output, mut input } = started else {
        return Err(PluginError::ambiguous(format!(
            "{what}: the engine did not attach to the agent"
        )));
    };
    let written = async {
        input.write_all(&order).await?;
        input.shutdown().await
    }
    .await;
    tokio::spawn(follow(
        std::sync::Arc::downgrade(shared),
        key.clone(),
        serial,
        exec.id,
        output,
    ));
    written.map_err(|error| {
        // The agent's shell may have started before the stream broke.
        PluginError::ambiguous(format!(
            "{what}: handing over the boot order failed: {error}"
        ))
    })
}

/// Relays the agent's stage lines; reports a failure when its output ends
/// before it joined.
async fn follow(
    shared: Weak<Shared>,
    key: AttemptKey,
    serial: u64,
    exec: String,
    mut output: std::pin::Pin<
        Box<
            dyn futures_util::Stream<
                    Item = Result<bollard::container::LogOutput, bollard::errors::Error>,
                > + Send,
        >,
    >,
) {
    let mut pending: Vec<u8> = Vec::new();
    // Bounded by the exec's output: it ends with the agent.
    while let Some(chunk) = output.next().await {
        let Ok(chunk) = chunk else {
            break;
        };
        let Some(shared) = shared.upgrade() else {
            return;
        };
        pending.extend_from_slice(&chunk.into_bytes());
        while let Some(end) = pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            relay(&shared, &key, serial, &String::from_utf8_lossy(&line));
        }
        if pending.len() > STAGE_LINE_BYTES_MAX {
            pending.clear();
        }
    }
    let Some(shared) = shared.upgrade() else {
        return;
    };
    // The stream also ends when the engine restarts (its containers and
    // their processes live on): only an agent the engine says ended failed.
    // One that never joins is failed by the join watchdog.
    let Ok(inspected) = shared.docker.inspect_exec(&exec).await else {
        return;
    };
    if inspected.running == Some(true) {
        return;
    }
    let detail = match inspected.exit_code {
        Some(code) => format!("the agent ended (exit status {code}) before it joined"),
        None => "the agent's output ended before it joined".to_owned(),
    };
    shared.fail(&key, serial, BootstrapFailure::StartFailed, detail);
}

fn relay(shared: &Shared, key: &AttemptKey, serial: u64, line: &str) {
    match serde_json::from_str::<ControlReply>(line.trim()) {
        Ok(ControlReply::Progress { stage }) => {
            let stage = match stage {
                ProgressStage::BootChecking => BootstrapProgress::BootChecking,
                ProgressStage::AgentStarting => BootstrapProgress::AgentStarting,
                ProgressStage::WaitingForJoin => BootstrapProgress::WaitingForJoin,
            };
            shared.progress(key, serial, stage);
        }
        Ok(ControlReply::Failed { stage, detail }) => {
            let failure = match stage {
                FailureStage::BootCheck => BootstrapFailure::BootCheckFailed,
                FailureStage::Start => BootstrapFailure::StartFailed,
                FailureStage::Join => BootstrapFailure::JoinFailed,
            };
            shared.fail(key, serial, failure, detail);
        }
        Ok(_) => {}
        Err(_) => tracing::debug!(node = %key, line, "agent output"),
    }
}
