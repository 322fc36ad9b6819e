//! One `provision up` of an end-to-end test, shared by the end-to-end
//! suites of every provider: its files in a temporary directory, the
//! binary's commands with that directory's sockets and state, bounded waits
//! on `status --json`, and a drop guard that kills `up` when the test ends,
//! passing or failing. What a provider's suite adds (its testbed, how it
//! counts live resources) stays in that suite.

#![allow(dead_code)]

use std::fs;
use std::io::Read;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;

/// The binary under test.
pub(crate) const BINARY: &str = env!("CARGO_BIN_EXE_provision");

/// How often the waits poll.
pub(crate) const POLL_INTERVAL: Duration = Duration::from_millis(200);

/// How many lines of `up`'s standard error a failure shows.
const LOG_TAIL_LINES: usize = 120;

/// How long a suite waits for each kind of thing.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Bounds {
    /// A status condition (convergence, a replacement).
    pub converge: Duration,
    /// `up` exiting after it was asked to.
    pub exit: Duration,
    /// One short command (`status`, `plan`, `down` of a small run).
    pub command: Duration,
}

/// How `up` writes its output files.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Logs {
    /// Each start truncates them.
    Fresh,
    /// Each start appends, so a restarted `up` keeps its first life's log.
    Append,
}

/// `provision up` and its files. Dropping it kills `up`.
pub(crate) struct Up {
    /// The test's directory: shape file, sockets, state, `up`'s output.
    pub(crate) dir: tempfile::TempDir,
    /// The run id.
    pub(crate) run: String,
    /// The shape file's name in `dir`.
    shape_name: &'static str,
    bounds: Bounds,
    /// `RUST_LOG` for every command; `None` removes it.
    log: Option<&'static str>,
    output: Logs,
    child: Option<Child>,
}

impl Up {
    /// A directory with prefix `prefix` and the run `run`; nothing runs yet.
    pub(crate) fn new(prefix: &str, run: String, shape_name: &'static str, bounds: Bounds) -> Self {
        let dir = tempfile::Builder::new()
            .prefix(prefix)
            .tempdir()
            .expect("a temporary directory");
        Up {
            dir,
            run,
            shape_name,
            bounds,
            log: None,
            output: Logs::Fresh,
            child: None,
        }
    }

    /// Every command gets `RUST_LOG=filter`.
    pub(crate) fn with_log(mut self, filter: &'static str) -> Self {
        self.log = Some(filter);
        self
    }

    /// `up`'s output files are appended to across restarts.
    pub(crate) fn appending(mut self) -> Self {
        self.output = Logs::Append;
        self
    }

    /// A file of the test's directory.
    pub(crate) fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The shape file.
    pub(crate) fn file(&self) -> PathBuf {
        self.path(self.shape_name)
    }

    /// Writes the shape file aside and renames it into place, as editors
    /// do, so `up` never reads half a file.
    pub(crate) fn write_shape(&self, text: &str) {
        let staging = self.path(&format!("{}.tmp", self.shape_name));
        fs::write(&staging, text).expect("write the shape file");
        fs::rename(&staging, self.file()).expect("replace the shape file");
    }

    pub(crate) fn socket_dir(&self) -> PathBuf {
        self.path("sockets")
    }

    pub(crate) fn state_dir(&self) -> PathBuf {
        self.path("state")
    }

    /// The binary with `args`, this test's sockets and state, no inherited
    /// socket, colour or log settings, and no standard input.
    pub(crate) fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(BINARY);
        command
            .args(args)
            .env("PROVISION_SOCKET_DIR", self.socket_dir())
            .env("PROVISION_STATE_DIR", self.state_dir())
            .env_remove("PROVISION_SOCKET")
            // Colour is the binary's own decision.
            .env_remove("NO_COLOR")
            .stdin(Stdio::null());
        match self.log {
            Some(filter) => command.env("RUST_LOG", filter),
            None => command.env_remove("RUST_LOG"),
        };
        command
    }

    /// Starts `up` with global `args` before it, `up_args` after it, on the
    /// shape file, with a graceful-shutdown bound of `shutdown_secs`.
    pub(crate) fn start(&mut self, args: &[&str], up_args: &[&str], shutdown_secs: u32) {
        assert!(self.child.is_none(), "up is already running");
        let open = |name: &str| {
            let mut options = fs::OpenOptions::new();
            options.create(true);
            match self.output {
                Logs::Fresh => options.write(true).truncate(true),
                Logs::Append => options.append(true),
            };
            options.open(self.path(name)).expect("an output file")
        };
        let child = self
            .command(args)
            .args(["up", "--plain", "--shutdown-timeout"])
            .arg(shutdown_secs.to_string())
            .args(up_args)
            .arg(self.file())
            .stdout(open("up.out"))
            .stderr(open("up.err"))
            .spawn()
            .expect("start provision up");
        self.child = Some(child);
    }

    /// Whether an `up` was started and not yet waited for.
    pub(crate) fn is_started(&self) -> bool {
        self.child.is_some()
    }

    /// `up`'s process id.
    pub(crate) fn pid(&self) -> u32 {
        self.child.as_ref().expect("up runs").id()
    }

    /// A file of the test's directory, empty when it does not exist.
    pub(crate) fn read(&self, name: &str) -> String {
        fs::read_to_string(self.path(name)).unwrap_or_default()
    }

    /// What `up` wrote to its standard error so far.
    pub(crate) fn log(&self) -> String {
        self.read("up.err")
    }

    /// `up`'s output for a failure message: all of its standard output and
    /// the tail of its standard error.
    pub(crate) fn output(&self) -> String {
        let err = self.log();
        let lines: Vec<&str> = err.lines().collect();
        let tail = &lines[lines.len().saturating_sub(LOG_TAIL_LINES)..];
        format!(
            "--- up stdout ---\n{}\n--- up stderr (last {LOG_TAIL_LINES} lines) ---\n{}",
            self.read("up.out"),
            tail.join("\n")
        )
    }

    /// Runs a short command to its end within the command bound.
    pub(crate) fn run_command(&self, args: &[&str]) -> Output {
        self.run_bounded(args, self.bounds.command)
    }

    /// Runs a command to its end within `bound`; kills it and fails past it.
    pub(crate) fn run_bounded(&self, args: &[&str], bound: Duration) -> Output {
        let child = self
            .command(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start provision");
        wait_output(child, bound, &format!("provision {args:?}"))
    }

    /// `provision status --json`, parsed; `None` while nothing answers.
    pub(crate) fn status(&self) -> Option<Value> {
        let output = self.run_command(&["status", "--json", "--run", &self.run]);
        output
            .status
            .success()
            .then(|| serde_json::from_slice(&output.stdout).expect("status --json is JSON"))
    }

    /// Polls the status until `done` holds. Fails with the last status,
    /// `up`'s output and `context()` when `up` exits first or the bound
    /// passes.
    pub(crate) fn wait_for(
        &mut self,
        what: &str,
        done: impl Fn(&Value) -> bool,
        context: impl Fn() -> String,
    ) -> Value {
        let deadline = Instant::now() + self.bounds.converge;
        let mut last = None;
        loop {
            if let Some(status) = self.status() {
                if done(&status) {
                    return status;
                }
                last = Some(status);
            }
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(exit)) = child.try_wait()
            {
                panic!(
                    "up exited ({exit}) while waiting for {what}\n{}\n{}",
                    self.output(),
                    context()
                );
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}; last status: {last:#?}\n{}\n{}",
                self.output(),
                context()
            );
            sleep(POLL_INTERVAL);
        }
    }

    /// Sends `signal` to `up`.
    pub(crate) fn signal(&self, signal: Signal) {
        let pid = i32::try_from(self.pid()).expect("a pid fits");
        kill(Pid::from_raw(pid), signal).expect("signal up");
    }

    /// Waits for `up` to exit within the exit bound; kills it and fails
    /// past it.
    pub(crate) fn wait_exit(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("up runs");
        let deadline = Instant::now() + self.bounds.exit;
        loop {
            if let Some(exit) = child.try_wait().expect("poll up") {
                return exit;
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("up did not exit in time\n{}", self.output());
            }
            sleep(POLL_INTERVAL);
        }
    }

    /// `kill -9` of `up`, reaped.
    pub(crate) fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Reads a child's pipe to its end on a thread of its own, so that a large
/// output cannot fill the pipe and stall the child.
fn drain(pipe: Option<impl Read + Send + 'static>) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        if let Some(mut pipe) = pipe {
            let _ = pipe.read_to_end(&mut bytes);
        }
        bytes
    })
}

/// Waits for `child` to exit within `bound` and returns its output; kills
/// it and fails (naming `what`, with its standard error) past the bound.
pub(crate) fn wait_output(mut child: Child, bound: Duration, what: &str) -> Output {
    let stdout = drain(child.stdout.take());
    let stderr = drain(child.stderr.take());
    let deadline = Instant::now() + bound;
    let status = loop {
        if let Some(status) = child.try_wait().expect("poll the child") {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            let stderr = stderr.join().unwrap_or_default();
            panic!(
                "{what} did not finish in {bound:?}: {}",
                String::from_utf8_lossy(&stderr)
            );
        }
        sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: stdout.join().expect("read stdout"),
        stderr: stderr.join().expect("read stderr"),
    }
}

/// The status's nodes: id, attempt, stage, ready.
pub(crate) fn nodes(status: &Value) -> Vec<(String, u64, String, bool)> {
    status["nodes"]
        .as_array()
        .expect("nodes is an array")
        .iter()
        .map(|n| {
            (
                n["id"].as_str().expect("id").to_owned(),
                n["attempt"].as_u64().expect("attempt"),
                n["stage"].as_str().expect("stage").to_owned(),
                n["ready"].as_bool().expect("ready"),
            )
        })
        .collect()
}

/// How many nodes of the status are ready.
pub(crate) fn ready(status: &Value) -> usize {
    nodes(status).iter().filter(|(.., ready)| *ready).count()
}

/// The ready nodes of a status: id and attempt.
pub(crate) fn ready_nodes(status: &Value) -> Vec<(String, u64)> {
    nodes(status)
        .into_iter()
        .filter(|(.., ready)| *ready)
        .map(|(id, attempt, ..)| (id, attempt))
        .collect()
}

/// A fixed pseudo-random sequence of crash points (xorshift64), so that a
/// failing chaos run can be told apart from the next by its repetition.
pub(crate) struct CrashPoints(u64);

impl CrashPoints {
    pub(crate) fn new(seed: u64) -> Self {
        CrashPoints(seed.max(1))
    }

    /// The next delay, below `max`.
    pub(crate) fn next_below(&mut self, max: Duration) -> Duration {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        let max_ms = u64::try_from(max.as_millis()).unwrap_or(u64::MAX).max(1);
        Duration::from_millis(self.0 % max_ms)
    }
}
