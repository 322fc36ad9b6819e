//! The agent's remote boot mode: started on another machine by a remote
//! provider (SSH, Slurm), it takes its [`BootOrder`] from a file, joins the
//! run's swarm over TCP at the order's address and re-dials it when the
//! connection ends, for a bounded re-join window.
//!
//! Selected by [`env::BOOT_FILE`](super::env::BOOT_FILE). The file holds one
//! JSON [`BootOrder`] (the same as [`ControlRequest::Boot`]'s payload, with
//! the credential); it must be a regular file of the agent's own user that
//! nobody else may read (mode `0600` or stricter), and it is removed as soon
//! as it is read. The credential never reaches a command line or a log.
//!
//! Stages go, one JSON [`ControlReply`] a line, to the optional file named
//! by [`env::STATUS_FILE`](super::env::STATUS_FILE), so a provider can read
//! how far the boot got. Exit codes: `0` after an orderly stop (`SIGTERM`,
//! workload exit or the end of the re-join window), `2` for a bad
//! configuration or boot file, `3` when a verify command failed, `4` when
//! the workload could not start.

use std::io::Write;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::time::Duration;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::{getpgrp, getpid, getuid, setsid};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::process::Command;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;

use super::{env, rendezvous};
use crate::codec::{JsonLinesCodec, MessageReader, encode_message, write_message};
use crate::credential::NodeCredential;
use crate::os;
use crate::wire::{
    BootOrder, ControlReply, FailureStage, PEERS_LINE_BYTES_MAX, PROTOCOL_VERSION, ProgressStage,
    SwarmHello, SwarmNotice, SwarmPush, SwarmReply,
};

/// The default re-join window.
pub const DEFAULT_REJOIN_WINDOW: Duration = Duration::from_secs(60);

/// The default grace between `SIGTERM` and `SIGKILL` of the group.
const DEFAULT_STOP_GRACE: Duration = Duration::from_secs(5);

/// The largest boot file read.
const BOOT_FILE_BYTES_MAX: u64 = 1024 * 1024;

/// The longest a single verify command may run.
const VERIFY_COMMAND_TIMEOUT: Duration = Duration::from_secs(10 * 60);

/// The first and the longest pause between two dials of the swarm.
const DIAL_PAUSE_FIRST: Duration = Duration::from_millis(100);
const DIAL_PAUSE_MAX: Duration = Duration::from_secs(2);

/// How long one dial (connect, hello, welcome) may take.
const DIAL_TIMEOUT: Duration = Duration::from_secs(5);

/// How often the group is looked at while stopping it.
const GROUP_POLL_INTERVAL: Duration = Duration::from_millis(20);

const EXIT_CONFIG: u8 = 2;
const EXIT_VERIFY: u8 = 3;
const EXIT_START: u8 = 4;

/// Why the boot file could not be used.
fn read_boot_file(path: &Path) -> Result<BootOrder, String> {
    let file = std::fs::File::open(path).map_err(|e| format!("cannot open the boot file: {e}"))?;
    let meta = file
        .metadata()
        .map_err(|e| format!("cannot stat the boot file: {e}"))?;
    // Removed first, whatever follows: the credential must not linger.
    let _ = std::fs::remove_file(path);
    if !meta.is_file() {
        return Err("the boot file is not a regular file".to_owned());
    }
    if meta.uid() != getuid().as_raw() {
        return Err("the boot file belongs to another user".to_owned());
    }
    if meta.permissions().mode() & 0o077 != 0 {
        return Err(format!(
            "the boot file is readable by others (mode {:o}); it must be 0600",
            meta.permissions().mode() & 0o777
        ));
    }
    if meta.len() > BOOT_FILE_BYTES_MAX {
        return Err("the boot file is too large".to_owned());
    }
    let mut text = String::new();
    std::io::Read::read_to_string(
        &mut std::io::Read::take(file, BOOT_FILE_BYTES_MAX),
        &mut text,
    )
    .map_err(|e| format!("cannot read the boot file: {e}"))?;
    let order: BootOrder =
        serde_json::from_str(text.trim()).map_err(|e| format!("malformed boot order: {e}"))?;
    if order.protocol != PROTOCOL_VERSION {
        return Err(format!("unsupported protocol version {}", order.protocol));
    }
    if NodeCredential::from_hex(&order.join.credential).is_none() {
        return Err("the credential is not 32 bytes of hex".to_owned());
    }
    Ok(order)
}

fn millis(name: &'static str, default: Duration) -> Result<Duration, String> {
    match std::env::var(name) {
        Err(_) => Ok(default),
        Ok(value) => value
            .parse::<u64>()
            .map(Duration::from_millis)
            .map_err(|_| format!("{name} has an invalid value {value:?}")),
    }
}

/// Where stages are written.
struct Status(Option<PathBuf>);

impl Status {
    fn report(&self, reply: &ControlReply) {
        tracing::info!(?reply, "boot stage");
        let Some(path) = &self.0 else { return };
        let Ok(line) = encode_message(reply) else {
            return;
        };
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path);
        if let Ok(mut file) = file {
            let _ = file.write_all(&line);
        }
    }
}

/// The remote agent's entry point (see the module documentation).
pub(crate) fn main(path: PathBuf) -> ExitCode {
    let order = match read_boot_file(&path) {
        Ok(order) => order,
        Err(error) => {
            tracing::error!(%error, "cannot start the remote node agent");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let settings = millis(env::REJOIN_WINDOW_MS, DEFAULT_REJOIN_WINDOW)
        .and_then(|w| millis(env::STOP_GRACE_MS, DEFAULT_STOP_GRACE).map(|g| (w, g)));
    let (window, grace) = match settings {
        Ok(settings) => settings,
        Err(error) => {
            tracing::error!(%error, "cannot start the remote node agent");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    // A session of its own: the SSH connection's hang-up does not reach it.
    if getpgrp() != getpid()
        && let Err(error) = setsid()
    {
        tracing::error!(%error, "cannot start a session of its own");
        return ExitCode::from(EXIT_CONFIG);
    }
    let status = Status(std::env::var_os(env::STATUS_FILE).map(PathBuf::from));
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            tracing::error!(%error, "cannot build the agent's runtime");
            return ExitCode::FAILURE;
        }
    };
    let code = runtime.block_on(run(order, status, window, grace));
    ExitCode::from(code)
}

fn command(order: &BootOrder, shell_command: &str, args: &[String]) -> Command {
    let mut command = Command::new("/bin/sh");
    command
        .arg("-c")
        .arg(shell_command)
        .arg("sh")
        .args(args)
        .env_remove(env::BOOT_FILE)
        .env_remove(env::STATUS_FILE)
        .stdin(Stdio::null());
    rendezvous::tell_workload(&mut command, order, &rendezvous::peers_file_path(order));
    command
}

async fn verify(order: &BootOrder, check: &str) -> Result<(), String> {
    let mut child = command(order, check, &[])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start it: {e}"))?;
    let mut stderr = child.stderr.take();
    let status = match tokio::time::timeout(VERIFY_COMMAND_TIMEOUT, child.wait()).await {
        Ok(Ok(status)) => status,
        Ok(Err(e)) => return Err(format!("cannot wait for it: {e}")),
        Err(_) => {
            let _ = child.start_kill();
            return Err(format!("still running after {VERIFY_COMMAND_TIMEOUT:?}"));
        }
    };
    if status.success() {
        return Ok(());
    }
    let mut tail = Vec::new();
    if let Some(stderr) = stderr.as_mut() {
        let _ = tokio::time::timeout(
            Duration::from_millis(200),
            stderr.take(2048).read_to_end(&mut tail),
        )
        .await;
    }
    Err(format!(
        "{}; output: {:?}",
        describe(status),
        String::from_utf8_lossy(&tail).trim()
    ))
}

fn describe(status: std::process::ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit status {code}"),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        (None, None) => "ended abnormally".to_owned(),
    }
}

async fn run(order: BootOrder, status: Status, window: Duration, grace: Duration) -> u8 {
    let mut terminate = match signal(SignalKind::terminate()) {
        Ok(terminate) => terminate,
        Err(error) => {
            tracing::error!(%error, "cannot handle SIGTERM");
            return EXIT_CONFIG;
        }
    };
    if !order.user.is_empty() {
        let me = nix::unistd::User::from_uid(getuid()).ok().flatten();
        if me.is_none_or(|me| me.name != order.user) {
            let detail = format!(
                "the remote agent runs as the login user; it cannot switch to {:?}",
                order.user
            );
            status.report(&ControlReply::Failed {
                stage: FailureStage::Start,
                detail,
            });
            return EXIT_START;
        }
    }
    status.report(&ControlReply::Accepted);
    status.report(&ControlReply::Progress {
        stage: ProgressStage::BootChecking,
    });
    for (index, check) in order.verify_commands.iter().enumerate() {
        if let Err(detail) = verify(&order, check).await {
            let detail = format!("verify command #{} `{check}` failed: {detail}", index + 1);
            status.report(&ControlReply::Failed {
                stage: FailureStage::BootCheck,
                detail,
            });
            stop_group(&order.run, grace).await;
            return EXIT_VERIFY;
        }
    }
    status.report(&ControlReply::Progress {
        stage: ProgressStage::AgentStarting,
    });
    let on_change = (!order.on_peers_change.is_empty()).then(|| {
        let order = order.clone();
        Box::new(move || {
            let mut hook = command(&order, &order.on_peers_change, &[]);
            hook.stdout(Stdio::null()).stderr(Stdio::null());
            hook
        }) as Box<dyn Fn() -> Command + Send + Sync>
    });
    let peers = match rendezvous::PeersFile::create(rendezvous::peers_file_path(&order), on_change)
    {
        Ok(peers) => peers,
        Err(detail) => {
            status.report(&ControlReply::Failed {
                stage: FailureStage::Start,
                detail,
            });
            return EXIT_START;
        }
    };
    let (notices_tx, mut notices) = mpsc::channel::<SwarmNotice>(1);
    if !order.start_command.is_empty() {
        let spawned = command(&order, &order.start_command, &order.args).spawn();
        match spawned {
            Ok(mut workload) => {
                tokio::spawn(async move {
                    if let Ok(exit) = workload.wait().await {
                        tracing::info!(status = %describe(exit), "workload exited");
                        let _ = notices_tx
                            .send(SwarmNotice::WorkloadExited {
                                code: exit.code(),
                                signal: exit.signal(),
                            })
                            .await;
                    }
                });
            }
            Err(error) => {
                status.report(&ControlReply::Failed {
                    stage: FailureStage::Start,
                    detail: format!("cannot start the workload: {error}"),
                });
                return EXIT_START;
            }
        }
    }
    status.report(&ControlReply::Progress {
        stage: ProgressStage::WaitingForJoin,
    });
    let mut pending_notice: Option<SwarmNotice> = None;
    let mut first = true;
    // Bounded: every pass either holds a membership until it ends, or
    // dials until the re-join window closes, which stops the agent.
    loop {
        let deadline = tokio::time::Instant::now() + window;
        let mut pause = DIAL_PAUSE_FIRST;
        let connection = loop {
            tokio::select! {
                _ = terminate.recv() => {
                    tracing::info!("terminating");
                    stop_group(&order.run, grace).await;
                    return 0;
                }
                dialed = dial(&order) => match dialed {
                    Ok(connection) => break Some(connection),
                    Err(error) => tracing::info!(%error, "cannot join the swarm yet"),
                },
            }
            if tokio::time::Instant::now() + pause >= deadline {
                break None;
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(DIAL_PAUSE_MAX);
        };
        let Some(mut connection) = connection else {
            tracing::warn!(
                "no swarm to re-join within {} s; stopping the node",
                window.as_secs()
            );
            stop_group(&order.run, grace).await;
            return 0;
        };
        if first {
            status.report(&ControlReply::Joined);
            first = false;
        }
        tracing::info!(swarm = %order.join.address, "joined the swarm");
        if let Some(notice) = pending_notice.take()
            && write_message(&mut connection.1, &notice).await.is_err()
        {
            pending_notice = Some(notice);
            continue;
        }
        // Bounded by the connection's life.
        loop {
            tokio::select! {
                _ = terminate.recv() => {
                    tracing::info!("terminating");
                    stop_group(&order.run, grace).await;
                    return 0;
                }
                push = connection.0.next() => match push {
                    Ok(Some(SwarmPush::Peers(update))) => peers.rewrite(&update),
                    Ok(Some(SwarmPush::Unknown)) => tracing::debug!("ignoring an unknown push"),
                    Ok(None) | Err(_) => {
                        tracing::warn!("swarm connection lost; re-dialing");
                        break;
                    }
                },
                notice = notices.recv() => {
                    let Some(notice) = notice else { continue };
                    if write_message(&mut connection.1, &notice).await.is_err() {
                        pending_notice = Some(notice);
                        break;
                    }
                    // The workload is gone: the node is done.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    stop_group(&order.run, grace).await;
                    return 0;
                }
            }
        }
    }
}

/// A welcomed swarm connection: the controller's pushes are read from it.
type Connection = (
    MessageReader<SwarmPush, tokio::net::tcp::OwnedReadHalf>,
    tokio::net::tcp::OwnedWriteHalf,
);

async fn dial(order: &BootOrder) -> Result<Connection, String> {
    let attempt = async {
        let stream = TcpStream::connect(order.join.address)
            .await
            .map_err(|e| format!("cannot reach {}: {e}", order.join.address))?;
        let (read, mut write) = stream.into_split();
        let hello = SwarmHello {
            protocol: PROTOCOL_VERSION,
            run: order.run.clone(),
            node: order.node.clone(),
            attempt: order.attempt,
            credential: order.join.credential.clone(),
            swarm: order.join.swarm.clone(),
            labels: order.join.labels.clone(),
        };
        write_message(&mut write, &hello)
            .await
            .map_err(|e| format!("cannot send the hello: {e}"))?;
        // The membership pushed after the welcome may be long, and may
        // arrive in the welcome's read: the reader keeps it.
        let mut reader = MessageReader::<SwarmReply, _>::with_codec(
            read,
            JsonLinesCodec::with_max_line_bytes(PEERS_LINE_BYTES_MAX),
        );
        match reader.next().await {
            Ok(Some(SwarmReply::Welcome)) => Ok((reader.retyped(), write)),
            Ok(Some(SwarmReply::Rejected { reason })) => Err(format!("rejected: {reason}")),
            Ok(None) => Err("the swarm closed the connection".to_owned()),
            Err(e) => Err(format!("bad answer from the swarm: {e}")),
        }
    };
    tokio::time::timeout(DIAL_TIMEOUT, attempt)
        .await
        .unwrap_or_else(|_| Err(format!("no welcome within {DIAL_TIMEOUT:?}")))
}

/// `SIGTERM` to the agent's group, a grace, then `SIGKILL` to every other
/// member of it (found by the run tag in `/proc`); the agent then exits.
async fn stop_group(run: &str, grace: Duration) {
    let group = getpgrp();
    if group != getpid() {
        return;
    }
    let _ = killpg(group, Signal::SIGTERM);
    let me = getpid().as_raw();
    let deadline = tokio::time::Instant::now() + grace;
    while tokio::time::Instant::now() < deadline {
        let others = os::live_descendants(me)
            .map(|found| found.iter().any(|p| p.process_group == group.as_raw()))
            .unwrap_or(false);
        if !others {
            break;
        }
        tokio::time::sleep(GROUP_POLL_INTERVAL).await;
    }
    let run = provisioning::RunId::new(run);
    match os::group_processes(&run, group.as_raw()) {
        Ok(processes) => {
            let others: Vec<_> = processes.into_iter().filter(|p| p.pid != me).collect();
            os::signal_processes(&others, Signal::SIGKILL);
        }
        Err(error) => {
            tracing::warn!(%error, "cannot list the node's processes; killing the group");
            let _ = killpg(group, Signal::SIGKILL);
        }
    }
}
