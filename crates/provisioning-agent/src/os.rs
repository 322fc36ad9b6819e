//! What the operating system says about the processes of a run.
//!
//! Every process the plugin starts for a node — the agent, its verify
//! commands, its workload and whatever the workload forks — carries three
//! environment tags: [`RUN_TAG`], [`NODE_TAG`] and [`ATTEMPT_TAG`]. This
//! module finds them by reading `/proc/PID/environ` and `/proc/PID/stat`, so
//! tests (and operators) can count the live processes of a run without
//! trusting the plugin's bookkeeping, and can signal a node's processes to
//! inject faults (`SIGSTOP`, `SIGKILL`).
//!
//! Zombies are not counted as live: in a container whose init does not reap
//! orphans, a dead process may linger as a zombie that holds nothing.

use std::collections::BTreeSet;
use std::fs;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;
use provisioning::RunId;
use provisioning_provider::AttemptKey;
use thiserror::Error;

/// The environment variable naming the run of a process.
pub const RUN_TAG: &str = "PROVISION_RUN_ID";

/// The environment variable naming the slot (`{group}-{index}`) of a process.
pub const NODE_TAG: &str = "PROVISION_NODE_ID";

/// The environment variable naming the attempt of a process.
pub const ATTEMPT_TAG: &str = "PROVISION_ATTEMPT";

/// The most `/proc` entries one scan visits (the kernel's largest pid space).
pub const PROC_SCAN_ENTRIES_MAX: usize = 4 * 1024 * 1024;

/// The longest `environ` file read per process; tags past it are not seen.
const ENVIRON_BYTES_MAX: u64 = 1024 * 1024;

/// The most open descriptors [`tcp_listeners`] looks at per process.
const FDS_SCANNED_MAX: usize = 64 * 1024;

/// How often [`wait_until_run_gone`] looks again.
const RUN_GONE_POLL_INTERVAL: Duration = Duration::from_millis(20);

/// Reading `/proc` failed as a whole.
#[derive(Debug, Error)]
pub enum OsError {
    /// `/proc` could not be listed.
    #[error("cannot list /proc: {0}")]
    ProcUnavailable(#[source] io::Error),
}

/// One live process that carries the tags of a run.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct TaggedProcess {
    /// Its process id.
    pub pid: i32,
    /// Its parent's process id.
    pub parent_pid: i32,
    /// Its process group.
    pub process_group: i32,
    /// Its scheduler state letter from `/proc/PID/stat` (`R`, `S`, `T`, …).
    pub state: char,
    /// Its command name.
    pub name: String,
    /// The value of [`NODE_TAG`], when present.
    pub node: Option<String>,
    /// The value of [`ATTEMPT_TAG`], when present and numeric.
    pub attempt: Option<u64>,
}

impl TaggedProcess {
    /// Whether it leads its process group (a node agent does).
    pub fn is_group_leader(&self) -> bool {
        self.pid == self.process_group
    }

    /// Whether it belongs to `key`'s node and attempt.
    pub fn belongs_to(&self, key: &AttemptKey) -> bool {
        self.attempt == Some(key.attempt.get())
            && self.node.as_deref() == Some(key.node.to_string().as_str())
    }
}

struct Stat {
    parent_pid: i32,
    process_group: i32,
    state: char,
    name: String,
}

/// Parses `/proc/PID/stat`: `pid (comm) state ppid pgrp …`. The command name
/// may contain spaces and parentheses, so parsing starts after the last `)`.
fn parse_stat(text: &str) -> Option<Stat> {
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    let name = text.get(open + 1..close)?.to_owned();
    let mut fields = text.get(close + 1..)?.split_ascii_whitespace();
    let state = fields.next()?.chars().next()?;
    let parent_pid = fields.next()?.parse().ok()?;
    let process_group = fields.next()?.parse().ok()?;
    Some(Stat {
        parent_pid,
        process_group,
        state,
        name,
    })
}

fn read_stat(dir: &Path) -> Option<Stat> {
    parse_stat(&fs::read_to_string(dir.join("stat")).ok()?)
}

struct Tags {
    run: Option<Vec<u8>>,
    node: Option<String>,
    attempt: Option<u64>,
}

fn read_tags(dir: &Path) -> Option<Tags> {
    use std::io::Read;
    let mut environ = Vec::new();
    fs::File::open(dir.join("environ"))
        .ok()?
        .take(ENVIRON_BYTES_MAX)
        .read_to_end(&mut environ)
        .ok()?;
    let mut tags = Tags {
        run: None,
        node: None,
        attempt: None,
    };
    for entry in environ.split(|b| *b == 0) {
        let Some(eq) = entry.iter().position(|b| *b == b'=') else {
            continue;
        };
        let (name, value) = (&entry[..eq], &entry[eq + 1..]);
        if name == RUN_TAG.as_bytes() {
            tags.run = Some(value.to_vec());
        } else if name == NODE_TAG.as_bytes() {
            tags.node = String::from_utf8(value.to_vec()).ok();
        } else if name == ATTEMPT_TAG.as_bytes() {
            tags.attempt = std::str::from_utf8(value).ok().and_then(|v| v.parse().ok());
        }
    }
    Some(tags)
}

fn is_dead(state: char) -> bool {
    matches!(state, 'Z' | 'X' | 'x')
}

/// Every live (non-zombie) process tagged with `run`, sorted by pid.
///
/// A process that exits during the scan is skipped; a process whose
/// environment cannot be read (another user's) is not counted.
///
/// This reads every process's environment: O(processes on the machine).
/// Callers that serve many nodes share one scan (the plugin's scanner) and
/// run it off the async runtime.
///
/// # Errors
/// [`OsError::ProcUnavailable`] when `/proc` cannot be listed.
pub fn run_processes(run: &RunId) -> Result<Vec<TaggedProcess>, OsError> {
    scan(run, |_| true)
}

/// The live processes of `run` whose `stat` passes `wanted`: `stat` is read
/// first (cheap), the environment only of the processes it lets through.
fn scan(run: &RunId, wanted: impl Fn(&Stat) -> bool) -> Result<Vec<TaggedProcess>, OsError> {
    let entries = fs::read_dir("/proc").map_err(OsError::ProcUnavailable)?;
    let mut found = Vec::new();
    for entry in entries.take(PROC_SCAN_ENTRIES_MAX).flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|name| name.parse::<i32>().ok())
        else {
            continue;
        };
        let dir = entry.path();
        let Some(stat) = read_stat(&dir) else {
            continue;
        };
        if is_dead(stat.state) || !wanted(&stat) {
            continue;
        }
        let Some(tags) = read_tags(&dir) else {
            continue;
        };
        if tags.run.as_deref() != Some(run.as_str().as_bytes()) {
            continue;
        }
        found.push(TaggedProcess {
            pid,
            parent_pid: stat.parent_pid,
            process_group: stat.process_group,
            state: stat.state,
            name: stat.name,
            node: tags.node,
            attempt: tags.attempt,
        });
    }
    found.sort();
    Ok(found)
}

/// The live processes of one node attempt.
///
/// # Errors
/// As [`run_processes`].
pub fn node_processes(key: &AttemptKey) -> Result<Vec<TaggedProcess>, OsError> {
    Ok(run_processes(&key.run_id)?
        .into_iter()
        .filter(|process| process.belongs_to(key))
        .collect())
}

/// The live node agents of `run`: the tagged processes that lead their own
/// process group. One per live lease; two for one `(node, attempt)` would be
/// a double create.
///
/// # Errors
/// As [`run_processes`].
pub fn agents(run: &RunId) -> Result<Vec<TaggedProcess>, OsError> {
    Ok(run_processes(run)?
        .into_iter()
        .filter(TaggedProcess::is_group_leader)
        .collect())
}

/// The live processes of `run` in process group `group`.
///
/// # Errors
/// As [`run_processes`].
pub fn group_processes(run: &RunId, group: i32) -> Result<Vec<TaggedProcess>, OsError> {
    if group <= 1 || !group_exists(group) {
        return Ok(Vec::new());
    }
    // Only the group's members have their environment read.
    scan(run, |stat| stat.process_group == group)
}

/// Whether any process (a zombie too) is in process group `group`, asked of
/// the kernel with signal 0: no `/proc` scan. `false` is definite (nothing
/// of the group is left to find or signal); `true` may be a zombie or, once
/// the group emptied and its id was reused, another group.
pub fn group_exists(group: i32) -> bool {
    group > 1 && killpg(Pid::from_raw(group), None) != Err(Errno::ESRCH)
}

/// The most processes [`live_descendants`] visits.
const DESCENDANTS_MAX: usize = 64 * 1024;

/// The live (non-zombie) descendants of `pid` — children, their children, and
/// so on — from `/proc/PID/task/TID/children`: O(descendants), no scan of
/// every process. A descendant whose parent died was re-parented away and
/// is not found. Sorted by pid.
///
/// # Errors
/// The I/O error when `pid`'s own task list or `children` file cannot be
/// read (the kernel may lack `CONFIG_PROC_CHILDREN`); callers fall back to
/// a scan.
pub fn live_descendants(pid: i32) -> io::Result<Vec<Descendant>> {
    let mut found = Vec::new();
    let mut queue = vec![pid];
    let mut first = true;
    while let Some(parent) = queue.pop() {
        let children = match children_of(parent) {
            Ok(children) => children,
            Err(error) if first => return Err(error),
            // A descendant that exited meanwhile has no children to list.
            Err(_) => continue,
        };
        first = false;
        for child in children {
            if found.len() >= DESCENDANTS_MAX {
                break;
            }
            let dir = Path::new("/proc").join(child.to_string());
            let Some(stat) = read_stat(&dir) else {
                continue;
            };
            if is_dead(stat.state) {
                continue;
            }
            found.push(Descendant {
                pid: child,
                process_group: stat.process_group,
            });
            queue.push(child);
        }
    }
    found.sort();
    Ok(found)
}

/// One live process found by [`live_descendants`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Descendant {
    /// Its process id.
    pub pid: i32,
    /// Its process group.
    pub process_group: i32,
}

/// The children of every thread of `pid`.
fn children_of(pid: i32) -> io::Result<Vec<i32>> {
    let tasks = Path::new("/proc").join(pid.to_string()).join("task");
    let mut children = Vec::new();
    let mut read_any = false;
    for task in fs::read_dir(&tasks)?.flatten() {
        match fs::read_to_string(task.path().join("children")) {
            Ok(text) => {
                read_any = true;
                children.extend(
                    text.split_ascii_whitespace()
                        .filter_map(|child| child.parse::<i32>().ok()),
                );
            }
            // A thread that ended meanwhile.
            Err(error) if error.kind() == io::ErrorKind::NotFound => {}
            Err(error) => return Err(error),
        }
    }
    if !read_any {
        // No thread has a `children` file: the kernel does not offer it
        // (or the process is gone), so nothing can be concluded.
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("no readable {}/*/children", tasks.display()),
        ));
    }
    Ok(children)
}

/// The live process `pid`, when it carries `key`'s tags (so a reused pid is
/// never mistaken for the agent it replaced).
pub fn tagged_process(pid: i32, key: &AttemptKey) -> Option<TaggedProcess> {
    let dir = Path::new("/proc").join(pid.to_string());
    let tags = read_tags(&dir)?;
    if tags.run.as_deref() != Some(key.run_id.as_str().as_bytes()) {
        return None;
    }
    let stat = read_stat(&dir)?;
    if is_dead(stat.state) {
        return None;
    }
    let process = TaggedProcess {
        pid,
        parent_pid: stat.parent_pid,
        process_group: stat.process_group,
        state: stat.state,
        name: stat.name,
        node: tags.node,
        attempt: tags.attempt,
    };
    process.belongs_to(key).then_some(process)
}

/// The IPv4 TCP addresses process `pid` listens on, from its open file
/// descriptors and `/proc/PID/net/tcp`. This is how a restarted controller
/// finds the control endpoint of an agent it did not start.
///
/// # Errors
/// The I/O error when the process's descriptors or sockets cannot be read
/// (it is gone, or belongs to another user).
pub fn tcp_listeners(pid: i32) -> io::Result<Vec<SocketAddr>> {
    let dir = Path::new("/proc").join(pid.to_string());
    let mut inodes = BTreeSet::new();
    for entry in fs::read_dir(dir.join("fd"))?
        .take(FDS_SCANNED_MAX)
        .flatten()
    {
        let Ok(target) = fs::read_link(entry.path()) else {
            continue;
        };
        let target = target.to_string_lossy();
        if let Some(inode) = target
            .strip_prefix("socket:[")
            .and_then(|rest| rest.strip_suffix(']'))
            .and_then(|inode| inode.parse::<u64>().ok())
        {
            inodes.insert(inode);
        }
    }
    if inodes.is_empty() {
        return Ok(Vec::new());
    }
    let table = fs::read_to_string(dir.join("net").join("tcp"))?;
    Ok(parse_tcp_listeners(&table, &inodes))
}

/// The `LISTEN` sockets of `/proc/net/tcp` whose inode is in `inodes`.
fn parse_tcp_listeners(table: &str, inodes: &BTreeSet<u64>) -> Vec<SocketAddr> {
    const LISTEN: &str = "0A";
    let mut found = Vec::new();
    for line in table.lines().skip(1) {
        // sl local rem st tx:rx tr:when retrnsmt uid timeout inode …
        let fields: Vec<&str> = line.split_ascii_whitespace().collect();
        let (Some(local), Some(state), Some(inode)) = (fields.get(1), fields.get(3), fields.get(9))
        else {
            continue;
        };
        if *state != LISTEN || !inode.parse::<u64>().is_ok_and(|i| inodes.contains(&i)) {
            continue;
        }
        let Some((ip, port)) = local.split_once(':') else {
            continue;
        };
        let (Ok(ip), Ok(port)) = (u32::from_str_radix(ip, 16), u16::from_str_radix(port, 16))
        else {
            continue;
        };
        // The kernel prints the address's bytes (network order) as a native
        // integer.
        found.push(SocketAddr::from((Ipv4Addr::from(ip.to_ne_bytes()), port)));
    }
    found
}

/// Sends `signal` to each process, and to each process group led by one of
/// them. Returns how many deliveries succeeded; processes that are already
/// gone are skipped silently.
///
/// Only groups whose leader is in `processes` are signalled as groups: a
/// tagged process that shares a group with untagged ones (for example a
/// child started without a group of its own) must not take its group's other
/// members along.
pub fn signal_processes(processes: &[TaggedProcess], signal: Signal) -> usize {
    let led_groups: BTreeSet<i32> = processes
        .iter()
        .filter(|p| p.is_group_leader())
        .map(|p| p.process_group)
        .collect();
    let mut delivered = 0;
    for group in led_groups {
        if group > 1 && killpg(Pid::from_raw(group), signal).is_ok() {
            delivered += 1;
        }
    }
    // Members whose leader is gone, or that left the group, are reached by pid.
    for process in processes {
        if process.pid > 1 && kill(Pid::from_raw(process.pid), signal).is_ok() {
            delivered += 1;
        }
    }
    delivered
}

/// Sends `signal` to every process of `key`'s node attempt: the agent's whole
/// process group and every tagged process. Returns the processes found.
///
/// # Errors
/// As [`run_processes`].
pub fn signal_node(key: &AttemptKey, signal: Signal) -> Result<Vec<TaggedProcess>, OsError> {
    let processes = node_processes(key)?;
    signal_processes(&processes, signal);
    Ok(processes)
}

/// Sends `signal` to the agent of `key` only (the group leader), not to its
/// workload. Returns the agent, when one was found.
///
/// # Errors
/// As [`run_processes`].
pub fn signal_agent(key: &AttemptKey, signal: Signal) -> Result<Option<TaggedProcess>, OsError> {
    let agent = node_processes(key)?
        .into_iter()
        .find(TaggedProcess::is_group_leader);
    if let Some(agent) = &agent {
        match kill(Pid::from_raw(agent.pid), signal) {
            Ok(()) | Err(Errno::ESRCH) => {}
            Err(error) => tracing::warn!(pid = agent.pid, %error, "cannot signal agent"),
        }
    }
    Ok(agent)
}

/// Kills (`SIGKILL`) every process of `run`, repeatedly, until none is left
/// or `timeout` passes. Returns the processes still alive at the end — empty
/// on success. Test guards call this from `Drop`.
///
/// # Errors
/// As [`run_processes`].
pub fn kill_run(run: &RunId, timeout: Duration) -> Result<Vec<TaggedProcess>, OsError> {
    let deadline = Instant::now() + timeout;
    loop {
        let alive = run_processes(run)?;
        if alive.is_empty() || Instant::now() >= deadline {
            return Ok(alive);
        }
        signal_processes(&alive, Signal::SIGKILL);
        std::thread::sleep(RUN_GONE_POLL_INTERVAL);
    }
}

/// Waits (blocking) until no process of `run` is alive, or `timeout` passes.
/// Returns the processes still alive at the end — empty on success.
///
/// # Errors
/// As [`run_processes`].
pub fn wait_until_run_gone(run: &RunId, timeout: Duration) -> Result<Vec<TaggedProcess>, OsError> {
    let deadline = Instant::now() + timeout;
    loop {
        let alive = run_processes(run)?;
        if alive.is_empty() || Instant::now() >= deadline {
            return Ok(alive);
        }
        std::thread::sleep(RUN_GONE_POLL_INTERVAL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_parsing_survives_names_with_spaces_and_parentheses() {
        let stat = parse_stat("4242 (my (odd) name) S 17 4242 4242 0 -1 4194560").unwrap();
        assert_eq!(stat.name, "my (odd) name");
        assert_eq!(stat.state, 'S');
        assert_eq!(stat.parent_pid, 17);
        assert_eq!(stat.process_group, 4242);
        assert!(parse_stat("garbage").is_none());
        assert!(parse_stat("1 (x) S notanumber 1").is_none());
    }

    #[test]
    #[cfg(target_endian = "little")]
    fn listening_sockets_are_parsed_from_proc_net_tcp() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
            0: 0100007F:A1B2 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 4242 1 0 100 0 0 10 0\n\
            1: 0100007F:A1B3 0100007F:1234 01 00000000:00000000 00:00000000 00000000  1000        0 4243 1 0 100 0 0 10 0\n\
            2: 0100007F:A1B4 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 9999 1 0 100 0 0 10 0\n";
        let inodes = BTreeSet::from([4242, 4243]);
        let expected = SocketAddr::from((Ipv4Addr::LOCALHOST, 0xA1B2));
        assert_eq!(parse_tcp_listeners(table, &inodes), vec![expected]);
    }

    #[test]
    fn this_process_listening_socket_is_found() {
        let listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let address = listener.local_addr().unwrap();
        let found = tcp_listeners(i32::try_from(std::process::id()).unwrap()).unwrap();
        assert!(found.contains(&address), "{address} not in {found:?}");
    }

    #[test]
    fn a_run_nobody_uses_has_no_processes() {
        let run = RunId::new(format!("no-such-run-{}", std::process::id()));
        assert_eq!(run_processes(&run).unwrap(), Vec::new());
        assert_eq!(
            wait_until_run_gone(&run, Duration::ZERO).unwrap(),
            Vec::new()
        );
    }

    #[test]
    fn a_tagged_child_is_found_and_killed_by_its_run_tag() {
        let run = RunId::new(format!("os-unit-{}", std::process::id()));
        let mut child = std::process::Command::new("sleep")
            .arg("60")
            .env(RUN_TAG, run.as_str())
            .env(NODE_TAG, "g-0")
            .env(ATTEMPT_TAG, "7")
            .spawn()
            .expect("spawn sleep");
        // A process that has just been spawned may show an empty environment
        // for a moment: the kernel wakes the spawning parent before the new
        // program's environment is in place.
        let deadline = Instant::now() + Duration::from_secs(5);
        let found = loop {
            let found = run_processes(&run).unwrap();
            if !found.is_empty() || Instant::now() >= deadline {
                break found;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].pid as u32, child.id());
        assert_eq!(found[0].node.as_deref(), Some("g-0"));
        assert_eq!(found[0].attempt, Some(7));
        let left = kill_run(&run, Duration::from_secs(5)).unwrap();
        // The killed child is a zombie until reaped, and zombies do not count.
        assert_eq!(left, Vec::new());
        let _ = child.wait();
    }
}
