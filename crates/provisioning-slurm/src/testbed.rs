//! A real Slurm cluster on this machine, for tests and benchmarks (feature
//! `testbed`): a generated `slurm.conf` in a temporary directory, `munged` on
//! a socket of its own, `slurmctld` and N `slurmd -N nX` daemons, all as
//! root on 127.0.0.1 — the layout of `scripts/slurm-testbed`.
//!
//! # Guarantees
//! - Dropping a [`Testbed`] stops every daemon it started and every process
//!   that carries its `SLURM_CONF` in its environment (job steps and their
//!   tasks), then removes its directory — also when the test panicked.
//! - Only one testbed runs at a time on the machine: [`Testbed::start`]
//!   takes an exclusive lock on [`LOCK_FILE`] and holds it until the drop,
//!   so tests of one binary (which cargo runs in parallel) and test binaries
//!   of other crates take turns. Ports are picked free on 127.0.0.1 while the
//!   lock is held; the directory is fresh for every testbed.
//!
//! # Panics
//! Every constructor panics with a diagnosis when a binary is missing, the
//! process is not root, or a daemon does not come up in time: these tests
//! need a real Slurm and say so loudly.

use std::fs;
use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The machine-wide lock that serialises testbeds.
pub const LOCK_FILE: &str = "/tmp/provisioning-slurm-testbed.lock";

/// Where Debian puts the daemons.
const DAEMON_DIR: &str = "/usr/sbin";

/// The client commands the testbed and the plugin need.
const CLIENT_TOOLS: [&str; 6] = ["sbatch", "squeue", "scancel", "srun", "sinfo", "scontrol"];

/// How long daemons may take to come up (nodes idle, controller answering).
const READY_WAIT_MAX: Duration = Duration::from_secs(30);

/// The pause between two readiness looks.
const READY_POLL: Duration = Duration::from_millis(50);

/// How long a stopped daemon may take to exit before it is killed.
const STOP_WAIT_MAX: Duration = Duration::from_secs(5);

/// The most nodes a testbed runs.
pub const NODES_MAX: usize = 64;

/// Memory per node in MB (`RealMemory`); a request above it is unsatisfiable.
pub const NODE_MEMORY_MB: u32 = 1000;

/// One running daemon (none once stopped or killed).
struct Daemon {
    child: Option<Child>,
}

impl Daemon {
    fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        signal(child.id(), "TERM");
        let deadline = Instant::now() + STOP_WAIT_MAX;
        while Instant::now() < deadline {
            if matches!(child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn signal(pid: u32, name: &str) {
    let _ = Command::new("kill")
        .args([&format!("-{name}"), &pid.to_string()])
        .stderr(Stdio::null())
        .status();
}

/// A running one-machine Slurm cluster (see the module docs).
pub struct Testbed {
    dir: tempfile::TempDir,
    conf: PathBuf,
    unreachable_conf: PathBuf,
    nodes: usize,
    munged: Daemon,
    controller: Daemon,
    slurmds: Vec<Daemon>,
    _lock: nix::fcntl::Flock<fs::File>,
}

impl std::fmt::Debug for Testbed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Testbed")
            .field("conf", &self.conf)
            .field("nodes", &self.nodes)
            .finish_non_exhaustive()
    }
}

fn require_tools() {
    assert_eq!(
        nix_uid(),
        0,
        "the Slurm testbed runs its daemons as root (SlurmUser=root); run the tests as root"
    );
    for daemon in ["munged", "slurmctld", "slurmd"] {
        let path = Path::new(DAEMON_DIR).join(daemon);
        assert!(
            path.exists(),
            "{} is missing: these tests run a real Slurm cluster. Install it with \
             scripts/test-deps.sh (apt-get install slurmctld slurmd slurm-client munge)",
            path.display()
        );
    }
    for tool in CLIENT_TOOLS {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        assert!(
            found,
            "{tool} is missing: install slurm-client with scripts/test-deps.sh"
        );
    }
}

fn nix_uid() -> u32 {
    // `id -u` keeps the crate free of unsafe code and of a libc dependency.
    let output = Command::new("id").arg("-u").output().expect("run id -u");
    String::from_utf8_lossy(&output.stdout)
        .trim()
        .parse()
        .expect("a numeric uid")
}

fn short_hostname() -> String {
    let output = Command::new("hostname")
        .arg("-s")
        .output()
        .expect("run hostname -s");
    let name = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    assert!(!name.is_empty(), "hostname -s printed nothing");
    name
}

/// `count` distinct free loopback ports, all bound at once so none repeats.
fn free_ports(count: usize) -> Vec<u16> {
    let listeners: Vec<TcpListener> = (0..count)
        .map(|_| TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("a free loopback port"))
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().expect("local address").port())
        .collect()
}

/// The testbed's `slurm.conf`.
fn slurm_conf(dir: &Path, host: &str, controller_port: u16, node_ports: &[u16]) -> String {
    let d = dir.display();
    let mut text = format!(
        "ClusterName=testbed
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={controller_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge/munge.socket
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/run/slurmctld.pid
SlurmdPidFile={d}/run/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=100000
ReturnToService=2
SlurmdTimeout=10
MinJobAge=30
KillWait=2
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"
    );
    // One line per node: each has its own port.
    for (index, port) in node_ports.iter().enumerate() {
        text.push_str(&format!(
            "NodeName=n{} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs=1 RealMemory={NODE_MEMORY_MB} State=UNKNOWN\n",
            index + 1
        ));
    }
    text
}

impl Testbed {
    /// Starts a cluster of `nodes` nodes (`n1` … `nN`, one CPU each) and
    /// waits until every node is idle.
    ///
    /// # Panics
    /// See the module docs.
    pub fn start(nodes: usize) -> Testbed {
        assert!(
            (1..=NODES_MAX).contains(&nodes),
            "between 1 and {NODES_MAX} nodes"
        );
        require_tools();
        let lock = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(LOCK_FILE)
            .unwrap_or_else(|e| panic!("cannot open {LOCK_FILE}: {e}"));
        let lock = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive)
            .unwrap_or_else(|(_, e)| panic!("cannot lock {LOCK_FILE}: {e}"));
        let dir = tempfile::Builder::new()
            .prefix("slurm-testbed-")
            .tempdir()
            .expect("a temporary directory");
        for sub in ["munge", "state", "spool", "log", "run"] {
            fs::create_dir_all(dir.path().join(sub)).expect("create testbed directories");
        }
        // munged wants its socket directory world-readable (0755), and
        // clients traverse the testbed directory to reach it.
        set_mode(dir.path(), 0o755);
        set_mode(&dir.path().join("munge"), 0o755);
        let key = dir.path().join("munge.key");
        let mut random = Vec::new();
        std::io::Read::read_to_end(
            &mut std::io::Read::take(
                fs::File::open("/dev/urandom").expect("open /dev/urandom"),
                1024,
            ),
            &mut random,
        )
        .expect("read /dev/urandom");
        fs::write(&key, random).expect("write the munge key");
        set_mode(&key, 0o600);
        let host = short_hostname();
        let ports = free_ports(nodes + 2);
        let conf = dir.path().join("slurm.conf");
        fs::write(
            &conf,
            slurm_conf(dir.path(), &host, ports[0], &ports[2..nodes + 2]),
        )
        .expect("write slurm.conf");
        // The same cluster behind a closed controller port: a client using
        // it cannot reach the controller (a real connect failure).
        let unreachable_conf = dir.path().join("unreachable").join("slurm.conf");
        fs::create_dir_all(unreachable_conf.parent().expect("parent")).expect("mkdir");
        fs::write(
            &unreachable_conf,
            slurm_conf(dir.path(), &host, ports[1], &ports[2..nodes + 2]),
        )
        .expect("write the unreachable slurm.conf");
        let mut bed = Testbed {
            munged: Daemon { child: None },
            controller: Daemon { child: None },
            slurmds: Vec::new(),
            conf,
            unreachable_conf,
            nodes,
            dir,
            _lock: lock,
        };
        bed.start_munged();
        bed.start_controller_cold();
        for index in 1..=nodes {
            let name = format!("n{index}");
            let child = bed.spawn_daemon("slurmd", &["-D", "-N", &name, "-f"], true);
            bed.slurmds.push(Daemon { child: Some(child) });
        }
        bed.wait_idle(nodes);
        bed
    }

    fn spawn_daemon(&self, daemon: &str, args: &[&str], with_conf: bool) -> Child {
        let mut command = Command::new(Path::new(DAEMON_DIR).join(daemon));
        command.args(args);
        if with_conf {
            command.arg(&self.conf);
        }
        command
            .env("SLURM_CONF", &self.conf)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(
                fs::File::create(self.dir.path().join("log").join(format!("{daemon}.stderr")))
                    .expect("create a log file"),
            ))
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {daemon}: {e}"))
    }

    fn start_munged(&mut self) {
        let d = self.dir.path();
        let args = [
            "-F".to_owned(),
            "--force".to_owned(),
            format!("--key-file={}", d.join("munge.key").display()),
            format!("--socket={}", self.munge_socket().display()),
            format!("--pid-file={}", d.join("run/munged.pid").display()),
            format!("--log-file={}", d.join("log/munged.log").display()),
            format!("--seed-file={}", d.join("munge.seed").display()),
        ];
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let child = self.spawn_daemon("munged", &args, false);
        self.munged.child = Some(child);
        self.wait_for("munged's socket", || self.munge_socket().exists());
    }

    fn munge_socket(&self) -> PathBuf {
        self.dir.path().join("munge").join("munge.socket")
    }

    fn start_controller_cold(&mut self) {
        let child = self.spawn_daemon("slurmctld", &["-D", "-c", "-f"], true);
        self.controller.child = Some(child);
        self.wait_for("slurmctld to answer", || self.controller_answers());
    }

    /// Whether `scontrol ping` reaches the controller.
    fn controller_answers(&self) -> bool {
        self.client("scontrol")
            .arg("ping")
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("is UP"))
    }

    fn wait_idle(&self, count: usize) {
        self.wait_for("every node to be idle", || self.idle_nodes() == count);
    }

    fn idle_nodes(&self) -> usize {
        let Ok(output) = self
            .client("sinfo")
            .args(["-h", "-N", "-t", "idle", "-o", "%N"])
            .output()
        else {
            return 0;
        };
        let text = String::from_utf8_lossy(&output.stdout);
        let mut names: Vec<&str> = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect();
        names.sort_unstable();
        names.dedup();
        names.len()
    }

    fn wait_for(&self, what: &str, ready: impl Fn() -> bool) {
        let deadline = Instant::now() + READY_WAIT_MAX;
        while Instant::now() < deadline {
            if ready() {
                return;
            }
            std::thread::sleep(READY_POLL);
        }
        panic!(
            "the Slurm testbed timed out waiting for {what} after {READY_WAIT_MAX:?}; logs:\n{}",
            self.log_tail()
        );
    }

    /// The last lines of every log of the testbed, for failure messages.
    pub fn log_tail(&self) -> String {
        let mut out = String::new();
        let Ok(entries) = fs::read_dir(self.dir.path().join("log")) else {
            return out;
        };
        let mut paths: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
        paths.sort();
        for path in paths {
            let text = fs::read_to_string(&path).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            out.push_str(&format!("== {}\n", path.display()));
            for line in &lines[lines.len().saturating_sub(15)..] {
                out.push_str(line);
                out.push('\n');
            }
        }
        out
    }

    /// A Slurm client command (`sbatch`, `squeue`, …) pointed at this cluster.
    pub fn client(&self, tool: &str) -> Command {
        let mut command = Command::new(tool);
        command
            .env("SLURM_CONF", &self.conf)
            .stdin(Stdio::null())
            .current_dir(self.dir.path());
        command
    }

    /// The cluster's `slurm.conf` (what `SLURM_CONF` must name).
    pub fn conf(&self) -> &Path {
        &self.conf
    }

    /// A `slurm.conf` of the same cluster whose controller port is closed:
    /// a client using it fails with a real connect failure before acting.
    pub fn unreachable_conf(&self) -> &Path {
        &self.unreachable_conf
    }

    /// The testbed's directory (a scratch place for job output).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// How many nodes the cluster has.
    pub fn nodes(&self) -> usize {
        self.nodes
    }

    /// Every job the controller knows (all states), from `squeue`,
    /// independently of any plugin: `(id, name, state, nodes)`.
    ///
    /// # Panics
    /// When `squeue` fails.
    pub fn jobs(&self) -> Vec<(u64, String, String, String)> {
        let output = self
            .client("squeue")
            .args(["-h", "-t", "all", "-o", "%i|%j|%T|%N"])
            .output()
            .expect("run squeue");
        assert!(
            output.status.success(),
            "squeue failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .filter_map(|line| {
                let mut fields = line.trim().splitn(4, '|');
                let id = fields.next()?.parse().ok()?;
                Some((
                    id,
                    fields.next()?.to_owned(),
                    fields.next()?.to_owned(),
                    fields.next().unwrap_or("").to_owned(),
                ))
            })
            .collect()
    }

    /// The jobs whose name starts with `prefix` and that still hold or wait
    /// for an allocation (pending, configuring, running, completing, …).
    pub fn live_jobs(&self, prefix: &str) -> Vec<(u64, String, String, String)> {
        self.jobs()
            .into_iter()
            .filter(|(_, name, state, _)| name.starts_with(prefix) && !is_terminal(state))
            .collect()
    }

    /// `scancel JOB` by hand, as an operator would.
    ///
    /// # Panics
    /// When `scancel` fails.
    pub fn cancel_by_hand(&self, job: u64) {
        let status = self
            .client("scancel")
            .arg(job.to_string())
            .status()
            .expect("run scancel");
        assert!(status.success(), "scancel {job} failed");
    }

    /// SIGKILLs the `slurmd` of node `index` (1-based): the node goes down
    /// once the controller notices (`SlurmdTimeout`).
    pub fn kill_slurmd(&mut self, index: usize) {
        self.slurmds[index - 1].kill();
    }

    /// Starts the `slurmd` of node `index` (1-based) again after
    /// [`Testbed::kill_slurmd`]; the node returns to service once it
    /// registers (`ReturnToService=2`). A running one is left alone.
    pub fn restart_slurmd(&mut self, index: usize) {
        if self.slurmds[index - 1].child.is_some() {
            return;
        }
        let name = format!("n{index}");
        let child = self.spawn_daemon("slurmd", &["-D", "-N", &name, "-f"], true);
        self.slurmds[index - 1].child = Some(child);
    }

    /// Stops the controller (SIGTERM; it saves its state).
    pub fn stop_controller(&mut self) {
        self.controller.stop();
    }

    /// Starts the controller again from its saved state and waits until it
    /// answers.
    pub fn restart_controller(&mut self) {
        self.controller.stop();
        let child = self.spawn_daemon("slurmctld", &["-D", "-f"], true);
        self.controller.child = Some(child);
        self.wait_for("slurmctld to answer after a restart", || {
            self.controller_answers()
        });
    }

    /// Kills every process that carries this testbed's `SLURM_CONF` (job
    /// steps, their tasks, agents), except the calling process.
    fn kill_tagged(&self) {
        let wanted = format!("SLURM_CONF={}", self.conf.display());
        let me = std::process::id();
        let Ok(entries) = fs::read_dir("/proc") else {
            return;
        };
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            if pid == me {
                continue;
            }
            let Ok(environ) = fs::read(entry.path().join("environ")) else {
                continue;
            };
            if environ.split(|b| *b == 0).any(|v| v == wanted.as_bytes()) {
                signal(pid, "KILL");
            }
        }
    }
}

/// Whether a Slurm job state is final (the job holds nothing any more).
pub fn is_terminal(state: &str) -> bool {
    matches!(
        state,
        "BOOT_FAIL"
            | "CANCELLED"
            | "COMPLETED"
            | "DEADLINE"
            | "FAILED"
            | "NODE_FAIL"
            | "OUT_OF_MEMORY"
            | "PREEMPTED"
            | "TIMEOUT"
            | "SPECIAL_EXIT"
            | "REVOKED"
    )
}

impl Drop for Testbed {
    fn drop(&mut self) {
        for slurmd in &mut self.slurmds {
            slurmd.stop();
        }
        self.controller.stop();
        // Steps outlive their slurmd; they and their tasks carry our conf.
        self.kill_tagged();
        self.munged.stop();
        // The directory goes with `self.dir`; the lock with `self._lock`.
    }
}

fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .unwrap_or_else(|e| panic!("chmod {}: {e}", path.display()));
}
