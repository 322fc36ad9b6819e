//! The real side of Level 3 over SSH: the namespaced sshd hosts of a
//! [`Testbed`], what runs in each host's network namespace (read from
//! `/proc`), the claims on each host (read from its claim directory), and
//! the faults, each a real event on a host:
//!
//! - **sshd stopped**: the host's server is killed for the call and started
//!   again after it; connections are refused.
//! - **link down**: the root side of the host's veth pair goes down (a
//!   partition) and comes up again.
//! - **changed host key**: the host's line in the known-hosts file names
//!   another key for the call.
//! - **exhausted inventory**: claims of a filler run take every slot of
//!   every host for the call.
//! - **claim lock held**: the test holds `flock` on a host's claim lock, so
//!   a claim script waits on the host (in `flock`) until it lets go.
//! - **signals**: `SIGKILL`, `SIGSTOP`, `SIGCONT` of remote agents and
//!   workloads, found by their environment in the host's namespace.
//!
//! Every fault is reference-counted per host, so that overlapping calls
//! each keep it until the last is done, and [`Hosts::restore`] undoes all
//! of them at teardown.

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufRead, BufReader, ErrorKind, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use provisioning::{LogicalNodeId, NodeAttemptId, RunId};
use provisioning_agent::os::{ATTEMPT_TAG, NODE_TAG, RUN_TAG};
use provisioning_conformance::substrate::ResourceKey;

use crate::common::Testbed;

/// The environment variable naming an agent's boot file (its session).
const BOOT_FILE_ENV: &str = "PROVISION_AGENT_BOOT_FILE";

/// `O_NONBLOCK` on Linux: a gate is opened without waiting for its reader.
const O_NONBLOCK: i32 = 0o4000;

/// `ENXIO`: a named pipe opened for writing has no reader yet.
const ENXIO: i32 = 6;

/// How long opening a gate waits for its agent to open the pipe.
const GATE_READER_WAIT_MAX: Duration = Duration::from_secs(5);

/// How often `/proc` or a pipe is looked at while waiting.
const POLL_INTERVAL: Duration = Duration::from_millis(5);

/// How long the test waits to take a host's claim lock.
const LOCK_WAIT_SECS: &str = "10";

/// The filler run whose claims exhaust the inventory.
fn filler_run() -> String {
    format!("l3fill-{}", std::process::id())
}

/// What a process in a host's namespace is to Level 3.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    /// A node agent (or its boot gate, before the agent's `exec`).
    Agent,
    /// A process its agent started (the workload).
    Workload,
}

/// A process of some run in a host's namespace.
#[derive(Clone, Debug)]
pub(crate) struct HostProcess {
    pub(crate) host: usize,
    pub(crate) pid: u32,
    parent: u32,
    pub(crate) state: char,
    pub(crate) role: Role,
    pub(crate) run: String,
    pub(crate) node: String,
    pub(crate) attempt: u64,
}

impl HostProcess {
    /// The kit's key of the process, if its node parses.
    pub(crate) fn key(&self) -> Option<ResourceKey> {
        let node = LogicalNodeId::parse(&self.node).ok()?;
        Some((node, NodeAttemptId::from_raw(self.attempt)))
    }
}

/// One host as Level 3 sees it.
#[derive(Debug)]
struct Host {
    claims: PathBuf,
    /// `net:[inode]` of its namespace, as `/proc/PID/ns/net` links to it.
    net: String,
    original_line: String,
    changed_line: String,
}

/// How many calls currently want each fault of a host.
#[derive(Debug, Default)]
struct Faulted {
    stopped: BTreeMap<usize, u32>,
    changed: BTreeMap<usize, u32>,
    partitioned: BTreeMap<usize, u32>,
    filled: u32,
}

/// The testbed's hosts, shared by every substrate of a test.
pub(crate) struct Hosts {
    bed: Mutex<Testbed>,
    hosts: Vec<Host>,
    faulted: Mutex<Faulted>,
    known_hosts: PathBuf,
    slots: u32,
}

/// A fault of one kind held until dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Stopped,
    Changed,
    Partitioned,
    Filled,
}

/// Keeps a host fault until dropped.
#[must_use = "the fault lasts only while the guard lives"]
pub(crate) struct HostFault<'a> {
    hosts: &'a Hosts,
    kind: Kind,
    host: usize,
}

impl Drop for HostFault<'_> {
    fn drop(&mut self) {
        self.hosts.undo(self.kind, self.host);
    }
}

/// Holds the claim lock of every host until dropped.
pub(crate) struct ClaimLocks {
    holders: Vec<Child>,
}

impl ClaimLocks {
    /// Lets go of every lock.
    pub(crate) fn release(&mut self) {
        for mut holder in self.holders.drain(..) {
            // Closing its input ends `cat`, and with it the lock.
            drop(holder.stdin.take());
            let _ = holder.wait();
        }
    }
}

impl Drop for ClaimLocks {
    fn drop(&mut self) {
        self.release();
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Sends `signal` (a `kill` name: `KILL`, `STOP`, `CONT`) to `pid`, or to
/// its process group when `group`. Returns whether it was delivered.
pub(crate) fn signal(pid: u32, signal: &str, group: bool) -> bool {
    if pid <= 1 {
        return false;
    }
    let target = if group {
        format!("-{pid}")
    } else {
        pid.to_string()
    };
    Command::new("kill")
        .args([format!("-{signal}"), "--".to_owned(), target])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

/// The state letter of `/proc/PID/stat` and the parent, if `pid` lives.
fn stat_of(pid: u32) -> Option<(char, u32)> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let parent = fields.next()?.parse().ok()?;
    (!matches!(state, 'Z' | 'X')).then_some((state, parent))
}

impl Hosts {
    /// The hosts of `bed`, each with `slots` slots; one other host key per
    /// host is generated for the "changed host key" fault.
    pub(crate) fn new(bed: Testbed, slots: u32) -> Self {
        let hosts = bed
            .hosts
            .iter()
            .map(|h| {
                let netns = h.netns.as_ref().expect("Level 3 runs namespaced hosts");
                let inode = fs::metadata(Path::new("/run/netns").join(&netns.name))
                    .expect("the host's namespace is mounted")
                    .ino();
                let other = bed.other_key(&format!("changed-{}", h.name));
                Host {
                    claims: h.claims(),
                    net: format!("net:[{inode}]"),
                    original_line: h.known_hosts_line(),
                    changed_line: format!("{} {other}", h.address),
                }
            })
            .collect();
        Hosts {
            known_hosts: bed.known_hosts.clone(),
            bed: Mutex::new(bed),
            hosts,
            faulted: Mutex::new(Faulted::default()),
            slots,
        }
    }

    /// The testbed.
    pub(crate) fn bed(&self) -> MutexGuard<'_, Testbed> {
        lock(&self.bed)
    }

    /// How many hosts there are.
    pub(crate) fn len(&self) -> usize {
        self.hosts.len()
    }

    /// The slots of every host.
    pub(crate) fn slots(&self) -> u32 {
        self.slots
    }

    /// The claims of `run` on every host, as (host, key).
    pub(crate) fn claims(&self, run: &RunId) -> Vec<(usize, ResourceKey)> {
        let mut found = Vec::new();
        for (index, host) in self.hosts.iter().enumerate() {
            let nodes = fs::read_dir(host.claims.join(run.as_str()));
            for node in nodes.into_iter().flatten().flatten() {
                let Some(id) = node
                    .file_name()
                    .to_str()
                    .and_then(|n| LogicalNodeId::parse(n).ok())
                else {
                    continue;
                };
                for attempt in fs::read_dir(node.path()).into_iter().flatten().flatten() {
                    let number = attempt
                        .file_name()
                        .to_str()
                        .and_then(|a| a.strip_prefix('a'))
                        .and_then(|a| a.parse::<u64>().ok());
                    if let Some(number) = number {
                        found.push((index, (id.clone(), NodeAttemptId::from_raw(number))));
                    }
                }
            }
        }
        found
    }

    /// The claim directory of `key` of `run` on host `host`.
    pub(crate) fn claim_dir(&self, host: usize, run: &RunId, key: &ResourceKey) -> PathBuf {
        self.hosts[host]
            .claims
            .join(run.as_str())
            .join(key.0.to_string())
            .join(key.1.to_string())
    }

    /// The host holding the claim of `key`, if one does.
    pub(crate) fn host_of(&self, run: &RunId, key: &ResourceKey) -> Option<usize> {
        (0..self.hosts.len()).find(|&host| self.claim_dir(host, run, key).is_dir())
    }

    /// The processes of every run in the hosts' namespaces, from `/proc`.
    /// A child that still has its agent's environment (the boot gate's
    /// `mkfifo`, a moment before its `exec`) is part of its agent, not an
    /// agent of its own.
    pub(crate) fn processes(&self) -> Vec<HostProcess> {
        let all = self.all_processes();
        let agents: std::collections::BTreeSet<u32> = all
            .iter()
            .filter(|p| p.role == Role::Agent)
            .map(|p| p.pid)
            .collect();
        all.into_iter()
            .filter(|p| !(p.role == Role::Agent && agents.contains(&p.parent)))
            .collect()
    }

    fn all_processes(&self) -> Vec<HostProcess> {
        let mut found = Vec::new();
        let Ok(entries) = fs::read_dir("/proc") else {
            panic!("level 3 needs a readable /proc");
        };
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            let Ok(net) = fs::read_link(entry.path().join("ns/net")) else {
                continue;
            };
            let Some(host) = self
                .hosts
                .iter()
                .position(|h| net.as_os_str() == h.net.as_str())
            else {
                continue;
            };
            if let Some(process) = self.classify(host, pid) {
                found.push(process);
            }
        }
        found
    }

    /// What process `pid` in host `host`'s namespace is, from its environment.
    fn classify(&self, host: usize, pid: u32) -> Option<HostProcess> {
        let environ = fs::read(format!("/proc/{pid}/environ")).ok()?;
        let mut vars = BTreeMap::new();
        for var in environ.split(|b| *b == 0) {
            let text = String::from_utf8_lossy(var);
            if let Some((name, value)) = text.split_once('=') {
                vars.insert(name.to_owned(), value.to_owned());
            }
        }
        let (state, parent) = stat_of(pid)?;
        let root = format!("{}/", self.hosts[host].claims.display());
        if let Some(rest) = vars.get(BOOT_FILE_ENV).and_then(|f| f.strip_prefix(&root)) {
            let mut parts = rest.split('/');
            let run = parts.next()?.to_owned();
            let node = parts.next()?.to_owned();
            let attempt = parts.next()?.strip_prefix('a')?.parse().ok()?;
            return Some(HostProcess {
                host,
                pid,
                parent,
                state,
                role: Role::Agent,
                run,
                node,
                attempt,
            });
        }
        Some(HostProcess {
            host,
            pid,
            parent,
            state,
            role: Role::Workload,
            run: vars.get(RUN_TAG)?.clone(),
            node: vars.get(NODE_TAG)?.clone(),
            attempt: vars.get(ATTEMPT_TAG)?.parse().ok()?,
        })
    }

    /// The processes of `run`.
    pub(crate) fn processes_of(&self, run: &RunId) -> Vec<HostProcess> {
        self.processes()
            .into_iter()
            .filter(|p| p.run == run.as_str())
            .collect()
    }

    /// The processes of `key` of `run` with `role`.
    pub(crate) fn processes_of_key(
        &self,
        run: &RunId,
        key: &ResourceKey,
        role: Role,
    ) -> Vec<HostProcess> {
        self.processes_of(run)
            .into_iter()
            .filter(|p| p.role == role && p.key().as_ref() == Some(key))
            .collect()
    }

    /// `flock` processes waiting in a host's namespace: claim scripts
    /// blocked on a claim lock. Returns (host, pid).
    pub(crate) fn blocked_claims(&self) -> Vec<(usize, u32)> {
        let mut found = Vec::new();
        for entry in fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            let Ok(net) = fs::read_link(entry.path().join("ns/net")) else {
                continue;
            };
            let Some(host) = self
                .hosts
                .iter()
                .position(|h| net.as_os_str() == h.net.as_str())
            else {
                continue;
            };
            let comm = fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
            if comm.trim() == "flock" {
                found.push((host, pid));
            }
        }
        found
    }

    /// Takes the claim lock of every host (waiting for claim scripts that
    /// hold it); `None` when one cannot be taken in time.
    pub(crate) fn lock_claims(&self) -> Option<ClaimLocks> {
        let mut locks = ClaimLocks {
            holders: Vec::new(),
        };
        for host in &self.hosts {
            let mut holder = Command::new("flock")
                .args(["-w", LOCK_WAIT_SECS])
                .arg(host.claims.join(".lock"))
                .args(["sh", "-c", "echo locked; exec cat"])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .ok()?;
            let mut line = String::new();
            let read = holder
                .stdout
                .take()
                .map(|out| BufReader::new(out).read_line(&mut line));
            locks.holders.push(holder);
            if !matches!(read, Some(Ok(n)) if n > 0) {
                return None;
            }
        }
        Some(locks)
    }

    fn faulted(&self) -> MutexGuard<'_, Faulted> {
        lock(&self.faulted)
    }

    /// Stops the sshd of `host` until the guard drops.
    pub(crate) fn stop_sshd(&self, host: usize) -> HostFault<'_> {
        let first = {
            let mut faulted = self.faulted();
            let count = faulted.stopped.entry(host).or_insert(0);
            *count += 1;
            *count == 1
        };
        if first {
            self.bed().hosts[host].stop();
        }
        HostFault {
            hosts: self,
            kind: Kind::Stopped,
            host,
        }
    }

    /// Sets the link of `host` down until the guard drops.
    pub(crate) fn partition(&self, host: usize) -> HostFault<'_> {
        let first = {
            let mut faulted = self.faulted();
            let count = faulted.partitioned.entry(host).or_insert(0);
            *count += 1;
            *count == 1
        };
        if first {
            if let Some(netns) = &self.bed().hosts[host].netns {
                netns.partition();
            }
        }
        HostFault {
            hosts: self,
            kind: Kind::Partitioned,
            host,
        }
    }

    /// Puts another key for `host` into the known-hosts file until the
    /// guard drops.
    pub(crate) fn change_key(&self, host: usize) -> HostFault<'_> {
        {
            let mut faulted = self.faulted();
            *faulted.changed.entry(host).or_insert(0) += 1;
            self.write_known_hosts(&faulted);
        }
        HostFault {
            hosts: self,
            kind: Kind::Changed,
            host,
        }
    }

    /// Fills every slot of every host with claims of a filler run until the
    /// guard drops.
    pub(crate) fn fill(&self) -> HostFault<'_> {
        let first = {
            let mut faulted = self.faulted();
            faulted.filled += 1;
            faulted.filled == 1
        };
        if first {
            for host in &self.hosts {
                for slot in 0..self.slots {
                    let dir = host
                        .claims
                        .join(filler_run())
                        .join("fill-1")
                        .join(format!("a{}", slot + 1));
                    if let Err(error) = fs::create_dir_all(&dir) {
                        eprintln!("level 3: cannot fill {}: {error}", dir.display());
                    }
                }
            }
        }
        HostFault {
            hosts: self,
            kind: Kind::Filled,
            host: 0,
        }
    }

    fn remove_filler(&self) {
        for host in &self.hosts {
            let dir = host.claims.join(filler_run());
            if dir.exists() {
                if let Err(error) = fs::remove_dir_all(&dir) {
                    eprintln!("level 3: cannot remove {}: {error}", dir.display());
                }
            }
        }
    }

    /// Writes the known-hosts file with the changed keys of `faulted`,
    /// atomically (a reader sees the old or the new file).
    fn write_known_hosts(&self, faulted: &Faulted) {
        let text: String = self
            .hosts
            .iter()
            .enumerate()
            .map(|(index, host)| {
                let changed = faulted.changed.get(&index).is_some_and(|n| *n > 0);
                let line = if changed {
                    &host.changed_line
                } else {
                    &host.original_line
                };
                format!("{line}\n")
            })
            .collect();
        let next = self.known_hosts.with_extension("next");
        let written = fs::write(&next, text).and_then(|()| fs::rename(&next, &self.known_hosts));
        if let Err(error) = written {
            eprintln!("level 3: cannot write the known-hosts file: {error}");
        }
    }

    fn undo(&self, kind: Kind, host: usize) {
        let mut faulted = self.faulted();
        let count = match kind {
            Kind::Stopped => faulted.stopped.entry(host).or_insert(0),
            Kind::Changed => faulted.changed.entry(host).or_insert(0),
            Kind::Partitioned => faulted.partitioned.entry(host).or_insert(0),
            Kind::Filled => &mut faulted.filled,
        };
        *count = count.saturating_sub(1);
        if *count > 0 {
            return;
        }
        match kind {
            Kind::Stopped => {
                drop(faulted);
                self.bed().hosts[host].start();
            }
            Kind::Changed => self.write_known_hosts(&faulted),
            Kind::Partitioned => {
                drop(faulted);
                if let Some(netns) = &self.bed().hosts[host].netns {
                    netns.heal();
                }
            }
            Kind::Filled => {
                drop(faulted);
                self.remove_filler();
            }
        }
    }

    /// Undoes every fault whatever guards are left: sshd running, links
    /// up, the known-hosts file as generated, no filler claims.
    pub(crate) fn restore(&self) {
        let mut faulted = self.faulted();
        let stopped: Vec<usize> = std::mem::take(&mut faulted.stopped)
            .into_iter()
            .filter(|(_, n)| *n > 0)
            .map(|(h, _)| h)
            .collect();
        let partitioned: Vec<usize> = std::mem::take(&mut faulted.partitioned)
            .into_iter()
            .filter(|(_, n)| *n > 0)
            .map(|(h, _)| h)
            .collect();
        faulted.changed.clear();
        faulted.filled = 0;
        self.write_known_hosts(&faulted);
        drop(faulted);
        self.remove_filler();
        let mut bed = self.bed();
        for host in stopped {
            bed.hosts[host].start();
        }
        for host in partitioned {
            if let Some(netns) = &bed.hosts[host].netns {
                netns.heal();
            }
        }
    }

    /// Writes `verdict` to the boot gate of `key` once its agent waits on
    /// it; gives up after [`GATE_READER_WAIT_MAX`] or when `give_up` says
    /// the agent will never come. Returns whether the verdict was delivered.
    pub(crate) fn open_gate(
        &self,
        run: &RunId,
        key: &ResourceKey,
        verdict: &str,
        give_up: impl Fn() -> bool,
    ) -> bool {
        let deadline = Instant::now() + GATE_READER_WAIT_MAX;
        // Bounded by the deadline.
        loop {
            if let Some(host) = self.host_of(run, key) {
                let gate = self.claim_dir(host, run, key).join("session/gate");
                let opened = fs::OpenOptions::new()
                    .write(true)
                    .custom_flags(O_NONBLOCK)
                    .open(&gate);
                match opened {
                    Ok(mut pipe) => {
                        return pipe.write_all(format!("{verdict}\n").as_bytes()).is_ok();
                    }
                    Err(error) if error.raw_os_error() == Some(ENXIO) => {}
                    Err(error) if error.kind() == ErrorKind::NotFound => {}
                    Err(error) => {
                        eprintln!("level 3: cannot open the boot gate of {key:?}: {error}");
                        return false;
                    }
                }
            }
            if give_up() || Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(POLL_INTERVAL);
        }
    }

    /// Kills every process of `run` on every host and removes its claims.
    /// Returns what there was: (processes, claims).
    pub(crate) fn purge(&self, run: &RunId) -> (Vec<HostProcess>, Vec<(usize, ResourceKey)>) {
        let processes: Vec<HostProcess> = self
            .all_processes()
            .into_iter()
            .filter(|p| p.run == run.as_str())
            .collect();
        for process in &processes {
            signal(process.pid, "KILL", false);
        }
        let claims = self.claims(run);
        for (index, host) in self.hosts.iter().enumerate() {
            let dir = host.claims.join(run.as_str());
            if dir.exists() {
                if let Err(error) = fs::remove_dir_all(&dir) {
                    eprintln!(
                        "level 3: cannot remove the claims of {run} on host {index}: {error}"
                    );
                }
            }
        }
        (processes, claims)
    }
}

/// The agent program the plugin installs on the hosts: a boot gate, then
/// the real agent. It makes the named pipe `session/gate` beside its boot
/// file and waits for a verdict there; `pass` lets it `exec` the real agent
/// binary (on the same file system as the hosts), which joins the swarm.
pub(crate) fn write_gate_agent(dir: &Path, agent: &str) -> PathBuf {
    assert!(
        !agent.contains('\''),
        "the agent path {agent:?} cannot be quoted"
    );
    let path = dir.join("l3-gated-agent");
    let script = format!(
        "#!/bin/sh\n\
         s=\"${{{BOOT_FILE_ENV}%/*}}\"\n\
         mkfifo \"$s/gate\" 2>/dev/null\n\
         read verdict < \"$s/gate\" || exit 1\n\
         [ \"$verdict\" = pass ] || exit 1\n\
         exec '{agent}'\n"
    );
    fs::write(&path, script).expect("level 3 writes its gated agent");
    let mut permissions = fs::metadata(&path).expect("the gated agent").permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut permissions, 0o755);
    fs::set_permissions(&path, permissions).expect("the gated agent is executable");
    path
}
