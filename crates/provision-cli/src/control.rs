//! The control socket: how `status`, `plan` and `down` talk to a running `up`.
//!
//! `provision up` listens on a Unix socket named after its run,
//! `<dir>/<run>.sock`. The directory is `--socket-dir` (or
//! `PROVISION_SOCKET_DIR`), else `$XDG_RUNTIME_DIR/provision`, else
//! `/tmp/provision-<uid>`; `--socket` (or `PROVISION_SOCKET`) names the socket
//! itself. The protocol is one JSON request line and one JSON response line
//! per connection, each at most [`MAX_MESSAGE_BYTES`], read and written with
//! the agent's one line codec ([`provisioning_agent::codec`]).

use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use provisioning_agent::codec::{
    CodecError, JsonLinesCodec, MessageReader, write_message_with_max_line_bytes,
};
use provisioning_agent::wire::PeersUpdate;
use provisioning_runtime::{HostHandle, PlanReport, ShutdownOutcome, StatusSnapshot};
use serde::{Deserialize, Serialize};
use tokio::io::AsyncWriteExt;
use tokio::net::{UnixListener, UnixStream};
use tokio::task::JoinSet;

use crate::shape_file;

/// The longest request or response line accepted, in bytes.
pub(crate) const MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

/// How long a connection may take to send its request.
pub(crate) const REQUEST_READ_TIMEOUT: Duration = Duration::from_secs(5);

/// How many connections are served at once; more wait in the backlog.
pub(crate) const MAX_CONNECTIONS: usize = 32;

/// How long a client waits to connect and get a non-`down` answer.
pub(crate) const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);

/// The most directory entries `status` and `down` look at when they search
/// for the socket of the only running `up`.
pub(crate) const MAX_SOCKETS_SCANNED: usize = 1024;

/// How long a stopped `up` still serves connections that were answering
/// (so a `down` client gets its reply).
pub(crate) const STOP_GRACE: Duration = Duration::from_secs(2);

/// Where to find control sockets.
#[derive(Clone, Debug)]
pub(crate) struct SocketLocation {
    /// An explicit socket path; wins over `dir`.
    pub(crate) socket: Option<PathBuf>,
    /// The directory holding one socket per run.
    pub(crate) dir: PathBuf,
}

impl SocketLocation {
    /// From the flags, falling back to the per-user default directory.
    pub(crate) fn new(socket: Option<PathBuf>, dir: Option<PathBuf>) -> Self {
        SocketLocation {
            socket,
            dir: dir.unwrap_or_else(default_dir),
        }
    }

    /// The socket of `run`.
    pub(crate) fn for_run(&self, run: &str) -> PathBuf {
        self.socket
            .clone()
            .unwrap_or_else(|| self.dir.join(format!("{run}.sock")))
    }

    /// The socket to talk to when the caller named no run: the explicit
    /// socket, or the only socket in the directory.
    ///
    /// # Errors
    /// A message when no socket or several sockets are found.
    pub(crate) fn find(&self, run: Option<&str>) -> Result<PathBuf, String> {
        if let Some(run) = run {
            return Ok(self.for_run(run));
        }
        if let Some(socket) = &self.socket {
            return Ok(socket.clone());
        }
        let mut found = Vec::new();
        let mut stale = Vec::new();
        if let Ok(entries) = std::fs::read_dir(&self.dir) {
            for entry in entries.flatten().take(MAX_SOCKETS_SCANNED) {
                let path = entry.path();
                if path.extension().is_none_or(|e| e != "sock") {
                    continue;
                }
                // A socket nobody answers on was left by an `up` that did
                // not stop cleanly (`kill -9`): not a running run.
                if std::os::unix::net::UnixStream::connect(&path).is_ok() {
                    found.push(path);
                } else {
                    tracing::info!(
                        "skipping {}: nobody answers on it (left by an `up` that did not stop cleanly)",
                        path.display()
                    );
                    stale.push(path);
                }
            }
        }
        found.sort();
        match found.len() {
            0 if stale.is_empty() => Err(format!(
                "no running `provision up` found (no socket in {})",
                self.dir.display()
            )),
            0 => Err(format!(
                "no running `provision up` found (nobody answers on {} socket(s) in {}, left by an `up` that did not stop cleanly)",
                stale.len(),
                self.dir.display()
            )),
            1 => Ok(found.remove(0)),
            _ => Err(format!(
                "several runs are up; name one with --run: {}",
                found
                    .iter()
                    .filter_map(|p| p.file_stem())
                    .map(|s| s.to_string_lossy().into_owned())
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
        }
    }

    /// Removes the socket of `run` if nobody answers on it (what a crashed
    /// `up` left behind), so that discovery does not trip over it.
    pub(crate) fn remove_stale(&self, run: &str) {
        let socket = self.for_run(run);
        if socket.exists() && std::os::unix::net::UnixStream::connect(&socket).is_err() {
            match std::fs::remove_file(&socket) {
                Ok(()) => tracing::info!("removed the stale socket {}", socket.display()),
                Err(error) => tracing::warn!(
                    "cannot remove the stale socket {}: {error}",
                    socket.display()
                ),
            }
        }
    }
}

fn default_dir() -> PathBuf {
    if let Some(runtime) = std::env::var_os("XDG_RUNTIME_DIR").filter(|v| !v.is_empty()) {
        return PathBuf::from(runtime).join("provision");
    }
    let uid = std::fs::metadata("/proc/self").map_or(0, |m| m.uid());
    std::env::temp_dir().join(format!("provision-{uid}"))
}

/// A request to a running `up`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "request", rename_all = "kebab-case")]
pub(crate) enum Request {
    /// The current status.
    Status,
    /// What applying this shape file text would change.
    Plan {
        /// The file name, for messages.
        path: PathBuf,
        /// The file's text.
        source: String,
    },
    /// Tear down and answer once done.
    Down,
    /// Close a group's breaker now.
    Resume {
        /// The group.
        group: String,
    },
    /// The run's membership: what every agent's peers file lists.
    Peers,
}

/// The answer of a running `up`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "response", rename_all = "kebab-case")]
pub(crate) enum Response {
    /// The status.
    Status {
        /// The snapshot.
        status: Box<StatusSnapshot>,
    },
    /// The plan.
    Plan {
        /// The report.
        plan: PlanReport,
    },
    /// Teardown finished.
    Down {
        /// Whether every node was torn down through the driver.
        clean: bool,
        /// Nodes still managed when the host stopped.
        remaining_nodes: usize,
    },
    /// The run's membership, as the peers files hold it.
    Peers {
        /// The ready nodes and every group's desired size.
        peers: PeersUpdate,
    },
    /// A breaker was closed.
    Resumed {
        /// Whether it was open.
        was_open: bool,
    },
    /// The request failed.
    Error {
        /// Why.
        message: String,
    },
}

/// Prepares `socket` for a new `up`: creates its directory (mode 0700) and
/// removes a stale socket file.
///
/// # Errors
/// When another `up` answers on the socket, or the directory cannot be made.
pub(crate) async fn claim(socket: &Path) -> Result<UnixListener, String> {
    if let Some(dir) = socket.parent() {
        if !dir.exists() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        }
    }
    if socket.exists() {
        if UnixStream::connect(socket).await.is_ok() {
            return Err(format!(
                "a `provision up` for this run is already running (socket {})",
                socket.display()
            ));
        }
        std::fs::remove_file(socket)
            .map_err(|e| format!("cannot remove stale socket {}: {e}", socket.display()))?;
    }
    let listener = UnixListener::bind(socket)
        .map_err(|e| format!("cannot listen on {}: {e}", socket.display()))?;
    // Only the owner may talk to the cluster.
    let _ = std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600));
    Ok(listener)
}

/// Serves requests until the host stops, then gives answering connections
/// [`STOP_GRACE`] to finish.
pub(crate) async fn serve(
    listener: UnixListener,
    handle: HostHandle,
    providers: Vec<&'static str>,
) {
    let mut connections = JoinSet::new();
    loop {
        while connections.try_join_next().is_some() {}
        tokio::select! {
            accepted = listener.accept(), if connections.len() < MAX_CONNECTIONS => {
                match accepted {
                    Ok((stream, _)) => {
                        let handle = handle.clone();
                        let providers = providers.clone();
                        connections.spawn(async move {
                            if let Err(error) = answer(stream, &handle, &providers).await {
                                tracing::debug!("control connection failed: {error}");
                            }
                        });
                    }
                    Err(error) => {
                        tracing::warn!("control socket accept failed: {error}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
            _ = connections.join_next(), if !connections.is_empty() => {}
            _ = handle.wait_stopped() => break,
        }
    }
    drop(listener);
    let _ = tokio::time::timeout(STOP_GRACE, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    connections.abort_all();
}

async fn answer(
    stream: UnixStream,
    handle: &HostHandle,
    providers: &[&'static str],
) -> io::Result<()> {
    let (read, mut write) = stream.into_split();
    let mut reader = MessageReader::<Request, _>::with_codec(
        read,
        JsonLinesCodec::with_max_line_bytes(MAX_MESSAGE_BYTES),
    );
    let request = tokio::time::timeout(REQUEST_READ_TIMEOUT, reader.next())
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no request in time"))?;
    let response = match request {
        Ok(Some(request)) => respond(request, handle, providers).await,
        Ok(None) => Response::Error {
            message: "malformed request: the connection closed before a request".to_owned(),
        },
        Err(CodecError::Io(error)) => return Err(error),
        Err(error) => Response::Error {
            message: format!("malformed request: {}", content_error(&error)),
        },
    };
    write_message_with_max_line_bytes(&mut write, &response, MAX_MESSAGE_BYTES)
        .await
        .map_err(|error| match error {
            CodecError::Io(error) => error,
            other => io::Error::other(other),
        })?;
    write.shutdown().await
}

async fn respond(request: Request, handle: &HostHandle, providers: &[&'static str]) -> Response {
    match request {
        Request::Status => Response::Status {
            status: Box::new(handle.status().await),
        },
        Request::Plan { path, source } => {
            let parsed = shape_file::parse(&path, &source, providers);
            match parsed {
                Err(error) => Response::Error {
                    message: error.to_string(),
                },
                Ok(shape) => match handle.plan(shape.run_id, shape.groups).await {
                    Ok(plan) => Response::Plan { plan },
                    Err(error) => Response::Error {
                        message: error.to_string(),
                    },
                },
            }
        }
        Request::Peers => Response::Peers {
            peers: handle
                .membership()
                .map(|membership| PeersUpdate::from_membership(&membership))
                .unwrap_or_default(),
        },
        Request::Resume { group } => {
            match handle
                .resume(provisioning::GroupId::new(group.as_str()))
                .await
            {
                Ok(was_open) => Response::Resumed { was_open },
                Err(error) => Response::Error {
                    message: error.to_string(),
                },
            }
        }
        Request::Down => {
            let report = handle.shutdown().await;
            Response::Down {
                clean: report.outcome == ShutdownOutcome::Clean,
                remaining_nodes: report.remaining_nodes,
            }
        }
    }
}

/// Sends one request and waits for the answer, at most `timeout`.
///
/// # Errors
/// A message when nothing listens on `socket`, the exchange fails or takes
/// too long.
pub(crate) async fn ask(
    socket: &Path,
    request: &Request,
    timeout: Duration,
) -> Result<Response, String> {
    let exchange = async {
        let stream = UnixStream::connect(socket).await.map_err(|e| {
            format!(
                "no running `provision up` answers on {}: {e}",
                socket.display()
            )
        })?;
        let (read, mut write) = stream.into_split();
        write_message_with_max_line_bytes(&mut write, request, MAX_MESSAGE_BYTES)
            .await
            .map_err(|error| match error {
                CodecError::Io(error) => format!("cannot send the request: {error}"),
                other => other.to_string(),
            })?;
        let mut answers = MessageReader::<Response, _>::with_codec(
            read,
            JsonLinesCodec::with_max_line_bytes(MAX_MESSAGE_BYTES),
        );
        match answers.next().await {
            Ok(Some(answer)) => Ok(answer),
            Ok(None) => Err("malformed answer: the connection closed before an answer".to_owned()),
            Err(CodecError::Io(error)) => Err(format!("cannot read the answer: {error}")),
            Err(error) => Err(format!("malformed answer: {}", content_error(&error))),
        }
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| format!("no answer from {} within {timeout:?}", socket.display()))?
}

/// What is wrong with a message that arrived: the JSON error itself for a
/// line that is not a message, the codec's word otherwise.
fn content_error(error: &CodecError) -> String {
    match error {
        CodecError::Malformed(json) => json.to_string(),
        other => other.to_string(),
    }
}

/// Whether something answers on `socket`.
pub(crate) async fn is_live(socket: &Path) -> bool {
    UnixStream::connect(socket).await.is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn location(dir: &Path) -> SocketLocation {
        SocketLocation::new(None, Some(dir.to_owned()))
    }

    #[test]
    fn find_picks_the_only_socket_or_asks_for_a_run() {
        let dir = tempfile::tempdir().unwrap();
        let at = location(dir.path());
        let none = at.find(None).unwrap_err();
        assert!(none.contains("no running `provision up`"), "{none}");

        let _alpha = std::os::unix::net::UnixListener::bind(dir.path().join("alpha.sock")).unwrap();
        std::fs::write(dir.path().join("notes.txt"), "").unwrap();
        assert_eq!(at.find(None).unwrap(), dir.path().join("alpha.sock"));

        let _beta = std::os::unix::net::UnixListener::bind(dir.path().join("beta.sock")).unwrap();
        let several = at.find(None).unwrap_err();
        assert!(
            several.contains("alpha, beta") && several.contains("--run"),
            "{several}"
        );
        assert_eq!(at.find(Some("beta")).unwrap(), dir.path().join("beta.sock"));
    }

    #[test]
    fn discovery_skips_a_socket_nobody_answers_on() {
        let dir = tempfile::tempdir().unwrap();
        let at = location(dir.path());
        // What a `kill -9`ed `up` leaves: the file, and nobody listening.
        drop(std::os::unix::net::UnixListener::bind(dir.path().join("dead.sock")).unwrap());
        let only_dead = at.find(None).unwrap_err();
        assert!(
            only_dead.contains("no running `provision up`")
                && only_dead.contains("did not stop cleanly"),
            "{only_dead}"
        );
        let _live = std::os::unix::net::UnixListener::bind(dir.path().join("live.sock")).unwrap();
        assert_eq!(at.find(None).unwrap(), dir.path().join("live.sock"));
        at.remove_stale("dead");
        assert!(!dir.path().join("dead.sock").exists());
        at.remove_stale("live");
        assert!(dir.path().join("live.sock").exists(), "a live socket stays");
    }

    #[test]
    fn an_explicit_socket_wins_over_the_directory() {
        let at = SocketLocation::new(Some(PathBuf::from("/x/y.sock")), Some(PathBuf::from("/d")));
        assert_eq!(at.for_run("any"), PathBuf::from("/x/y.sock"));
        assert_eq!(at.find(None).unwrap(), PathBuf::from("/x/y.sock"));
    }

    #[test]
    fn requests_travel_as_one_tagged_json_line() {
        let line = serde_json::to_string(&Request::Down).unwrap();
        assert_eq!(line, r#"{"request":"down"}"#);
        let plan: Request =
            serde_json::from_str(r#"{"request":"plan","path":"a.toml","source":"run = \"x\""}"#)
                .unwrap();
        assert!(matches!(plan, Request::Plan { .. }));
        assert!(serde_json::from_str::<Request>(r#"{"request":"explode"}"#).is_err());
    }

    #[tokio::test]
    async fn a_live_socket_is_not_claimed_twice_and_a_stale_one_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("nested").join("run.sock");
        let first = claim(&socket).await.unwrap();
        let refused = claim(&socket).await.unwrap_err();
        assert!(refused.contains("already running"), "{refused}");
        drop(first);
        // The file stays behind, as after a crash; nothing answers on it.
        assert!(socket.exists());
        let again = claim(&socket).await;
        assert!(again.is_ok(), "a stale socket is replaced");
    }
}
