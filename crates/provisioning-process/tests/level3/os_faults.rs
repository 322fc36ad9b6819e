//! The operating-system side of Level 3: the agent program the plugin
//! starts (and that can go missing), the boot gates, and the signals.
//!
//! - **Agent program.** The plugin starts agents through a symlink to
//!   `/bin/sh` ([`SHELL`]) in the substrate's directory, running a two-line script: an
//!   agent (not a helper) first stops itself with `SIGSTOP`, then `exec`s
//!   the real agent binary. A fresh node is therefore really not ready until
//!   its first endpoint lookup continues it. Renaming the symlink away makes
//!   every spawn through it fail with `ENOENT` — a real spawn failure.
//! - **Boot gates.** Every node's one verify command reads a verdict from a
//!   named pipe of its own (`<gates>/<node>.<attempt>`), so the boot waits
//!   until the harness writes `pass` (the agent goes on and joins) or `fail`
//!   (a really failing verify command).
//! - **Signals.** Nodes are found by their environment tags in `/proc`
//!   ([`provisioning_agent::os`]) and signalled there: `SIGKILL`,
//!   `SIGSTOP`, `SIGCONT`.

use std::fs::OpenOptions;
use std::io::{ErrorKind, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::signal::{Signal, kill};
use nix::sys::stat::Mode;
use nix::unistd::Pid;
use provisioning::RunId;
use provisioning_agent::os::{self, TaggedProcess};
use provisioning_conformance::substrate::ResourceKey;
use provisioning_provider::AttemptKey;

/// The name of the symlink the plugin starts agents through; also the
/// command name (`/proc/PID/stat`) of an agent still held before its `exec`.
pub(crate) const HELD_AGENT_NAME: &str = "l3-held-agent";

/// The shell the held-agent script runs in.
pub(crate) const SHELL: &str = "/bin/sh";

/// The environment variable naming the gate directory in verify commands.
pub(crate) const GATES_ENV: &str = "PROVISION_L3_GATES";

/// The verify command of every node: read the verdict from the node's gate.
pub(crate) const GATE_VERIFY_COMMAND: &str = "read verdict < \"$PROVISION_L3_GATES/$PROVISION_NODE_ID.$PROVISION_ATTEMPT\"; \
     [ \"$verdict\" = pass ] || { echo \"boot gate says: $verdict\" >&2; exit 1; }";

/// How long a stopped or continued process may take to show its new state.
const SIGNAL_SETTLE_WAIT_MAX: Duration = Duration::from_secs(2);

/// How often `/proc` is read while waiting for a state change.
const PROC_POLL_INTERVAL: Duration = Duration::from_millis(1);

/// How long opening a gate waits for its verify command to open the pipe.
pub(crate) const GATE_READER_WAIT_MAX: Duration = Duration::from_secs(3);

/// The script behind the agent program: agents hold, helpers do not.
pub(crate) fn agent_script(agent_binary: &Path) -> String {
    let binary = agent_binary.display().to_string();
    assert!(
        !binary.contains('\''),
        "the agent binary path {binary:?} cannot be quoted for the shell"
    );
    format!("[ -n \"$PROVISION_AGENT_ROLE\" ] || kill -STOP $$\nexec '{binary}'\n")
}

/// The symlink the plugin starts agents through, which faults can remove.
#[derive(Debug)]
pub(crate) struct AgentProgram {
    link: PathBuf,
    hidden: PathBuf,
    /// How many faults currently want the program missing.
    removals: Mutex<u32>,
}

/// Keeps the agent program missing until dropped.
#[derive(Debug)]
pub(crate) struct ProgramMissing<'a> {
    program: &'a AgentProgram,
}

impl Drop for ProgramMissing<'_> {
    fn drop(&mut self) {
        let mut removals = self.program.lock();
        *removals = removals.saturating_sub(1);
        if *removals == 0 {
            self.program.put_back();
        }
    }
}

impl AgentProgram {
    /// Creates the symlink `dir/name` to `target`.
    pub(crate) fn create(dir: &Path, name: &str, target: &Path) -> std::io::Result<AgentProgram> {
        let link = dir.join(name);
        std::os::unix::fs::symlink(target, &link)?;
        Ok(AgentProgram {
            hidden: dir.join(format!(".{name}.missing")),
            link,
            removals: Mutex::new(0),
        })
    }

    /// The path agents are started from.
    pub(crate) fn path(&self) -> &Path {
        &self.link
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, u32> {
        self.removals.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn put_back(&self) {
        if self.hidden.symlink_metadata().is_ok() {
            if let Err(error) = std::fs::rename(&self.hidden, &self.link) {
                eprintln!("level 3: cannot restore the agent program: {error}");
            }
        }
    }

    /// Makes the program missing (renamed away) until the guard drops.
    pub(crate) fn remove(&self) -> ProgramMissing<'_> {
        let mut removals = self.lock();
        if *removals == 0 {
            if let Err(error) = std::fs::rename(&self.link, &self.hidden) {
                eprintln!("level 3: cannot remove the agent program: {error}");
            }
        }
        *removals += 1;
        ProgramMissing { program: self }
    }

    /// Puts the program back now, whatever faults still want it missing.
    pub(crate) fn restore(&self) {
        let mut removals = self.lock();
        *removals = 0;
        self.put_back();
    }
}

/// The boot gates of one substrate.
#[derive(Debug)]
pub(crate) struct Gates {
    dir: PathBuf,
}

/// How opening a gate went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GateOpening {
    /// The verdict was written to the waiting verify command.
    Delivered,
    /// No verify command opened the gate in time, or it was given up.
    NoReader,
}

impl Gates {
    /// Gates in `dir`.
    pub(crate) fn new(dir: PathBuf) -> Self {
        Gates { dir }
    }

    /// The directory, for the verify commands' environment.
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, key: &ResourceKey) -> PathBuf {
        self.dir.join(format!("{}.{}", key.0, key.1.get()))
    }

    /// Creates the gate of `key` (a named pipe) unless it exists.
    pub(crate) fn prepare(&self, key: &ResourceKey) {
        match nix::unistd::mkfifo(&self.path(key), Mode::S_IRUSR | Mode::S_IWUSR) {
            Ok(()) | Err(Errno::EEXIST) => {}
            Err(error) => eprintln!("level 3: cannot create the boot gate of {key:?}: {error}"),
        }
    }

    /// Writes `verdict` to the verify command waiting on `key`'s gate, once
    /// it has opened the pipe; waits at most [`GATE_READER_WAIT_MAX`], and
    /// gives up early when `give_up` says the reader will never come.
    pub(crate) fn open(
        &self,
        key: &ResourceKey,
        verdict: &str,
        give_up: impl Fn() -> bool,
    ) -> GateOpening {
        let path = self.path(key);
        let deadline = Instant::now() + GATE_READER_WAIT_MAX;
        // Bounded by the deadline.
        loop {
            let opened = OpenOptions::new()
                .write(true)
                .custom_flags(OFlag::O_NONBLOCK.bits())
                .open(&path);
            match opened {
                Ok(mut pipe) => {
                    return match pipe.write_all(format!("{verdict}\n").as_bytes()) {
                        Ok(()) => GateOpening::Delivered,
                        Err(_) => GateOpening::NoReader,
                    };
                }
                // ENXIO: nobody has the pipe open for reading yet.
                Err(error) if error.raw_os_error() == Some(Errno::ENXIO as i32) => {}
                Err(error) if error.kind() == ErrorKind::NotFound => return GateOpening::NoReader,
                Err(error) => {
                    eprintln!("level 3: cannot open the boot gate of {key:?}: {error}");
                    return GateOpening::NoReader;
                }
            }
            if give_up() || Instant::now() >= deadline {
                return GateOpening::NoReader;
            }
            std::thread::sleep(PROC_POLL_INTERVAL);
        }
    }
}

/// The attempt key of `key` in `run`, for the `os` module.
pub(crate) fn attempt_key(run: &RunId, key: &ResourceKey) -> AttemptKey {
    AttemptKey {
        run_id: run.clone(),
        node: key.0.clone(),
        attempt: key.1,
    }
}

/// The live processes of `key`, from `/proc`. Unreadable `/proc` is a broken
/// test environment, not a fault to tolerate.
pub(crate) fn node_processes(run: &RunId, key: &ResourceKey) -> Vec<TaggedProcess> {
    os::node_processes(&attempt_key(run, key))
        .unwrap_or_else(|error| panic!("level 3 needs a readable /proc: {error}"))
}

/// The agent of `key` (its process group leader), if alive.
pub(crate) fn agent_of(run: &RunId, key: &ResourceKey) -> Option<TaggedProcess> {
    node_processes(run, key)
        .into_iter()
        .find(TaggedProcess::is_group_leader)
}

/// Sends `SIGKILL` to every process of `key`. Returns how many there were.
pub(crate) fn kill_node(run: &RunId, key: &ResourceKey) -> usize {
    let processes = node_processes(run, key);
    os::signal_processes(&processes, Signal::SIGKILL);
    processes.len()
}

/// Sends `SIGKILL` to the agent of `key` only. Returns whether there was one.
pub(crate) fn kill_agent(run: &RunId, key: &ResourceKey) -> bool {
    agent_of(run, key).is_some_and(|agent| signal_pid(agent.pid, Signal::SIGKILL))
}

fn signal_pid(pid: i32, signal: Signal) -> bool {
    pid > 1 && kill(Pid::from_raw(pid), signal).is_ok()
}

/// Waits (bounded) until the agent of `key` is in a state `wanted` accepts.
fn wait_for_agent_state(run: &RunId, key: &ResourceKey, wanted: impl Fn(char) -> bool) -> bool {
    let deadline = Instant::now() + SIGNAL_SETTLE_WAIT_MAX;
    // Bounded by the deadline.
    loop {
        match agent_of(run, key) {
            Some(agent) if wanted(agent.state) => return true,
            Some(_) => {}
            None => return false,
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(PROC_POLL_INTERVAL);
    }
}

/// Stops the running agent of `key` with `SIGSTOP` and waits until it shows
/// as stopped. Returns its pid, or `None` when there is no running agent.
pub(crate) fn stop_agent(run: &RunId, key: &ResourceKey) -> Option<i32> {
    let agent = agent_of(run, key).filter(|a| a.name != HELD_AGENT_NAME)?;
    if !signal_pid(agent.pid, Signal::SIGSTOP) {
        return None;
    }
    wait_for_agent_state(run, key, |state| state == 'T').then_some(agent.pid)
}

/// Continues the agent `pid` of `key` with `SIGCONT`, if it is still that
/// agent (a pid is checked against the node's tags before it is signalled).
pub(crate) fn continue_agent(run: &RunId, key: &ResourceKey, pid: i32) -> bool {
    let still_there = agent_of(run, key).is_some_and(|agent| agent.pid == pid);
    still_there && signal_pid(pid, Signal::SIGCONT)
}

/// Whether the agent of `key` is still held before its `exec`.
pub(crate) fn held_agent(run: &RunId, key: &ResourceKey) -> Option<TaggedProcess> {
    agent_of(run, key).filter(|agent| agent.name == HELD_AGENT_NAME && agent.state == 'T')
}

/// Lets a held agent of `key` go on (`SIGCONT`). Returns whether one was held.
pub(crate) fn release_held_agent(run: &RunId, key: &ResourceKey) -> bool {
    held_agent(run, key).is_some_and(|agent| signal_pid(agent.pid, Signal::SIGCONT))
}
