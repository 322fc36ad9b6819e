//! A private container engine for tests and benchmarks: its own `dockerd`
//! (with its own `containerd`) on a socket, data root, exec root and pid
//! file of its own, a bridge network of its own — or its own
//! `podman system service` ([`Engine::start_podman`]) — and a test image
//! built locally — no registry is reachable, so the image is a root file system
//! made of this machine's `sh`, a few tools, and the C libraries the node
//! agent links, loaded with `docker import`.
//!
//! The sandbox has no `CAP_SYS_RESOURCE`, so the daemon runs with default
//! ulimits (`nofile=1024:1024`, `nproc=4096:4096`); it gets no default
//! `docker0` bridge (`--bridge none`, so that engines of concurrent tests do
//! not fight over it) and sets no iptables rules.
//!
//! Dropping an [`Engine`] removes every container and the network, stops
//! the daemon and removes its directories, also when a test fails. A
//! missing `dockerd` is a loud panic, never a skipped test.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The tag of the test image.
pub const TEST_IMAGE: &str = "provision-test:1";

/// The tools the test image holds (besides the agent's libraries).
const IMAGE_TOOLS: [&str; 6] = ["sh", "cat", "mktemp", "rm", "sleep", "ls"];

/// How long the daemon may take to answer after it starts.
const START_WAIT: Duration = Duration::from_secs(60);

/// How long the daemon may take to stop before it is killed.
const STOP_WAIT: Duration = Duration::from_secs(20);

/// Which engine serves the API.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineKind {
    /// Docker's `dockerd`.
    Docker,
    /// Podman's `podman system service`, with `runc` (its default `crun`
    /// refuses this machine's hybrid cgroups) and default ulimits set in a
    /// `containers.conf` of its own.
    Podman,
}

/// The network Podman attaches containers to by default.
const PODMAN_NETWORK: &str = "podman";

/// A private engine daemon; see the module documentation.
#[derive(Debug)]
pub struct Engine {
    kind: EngineKind,
    dir: tempfile::TempDir,
    daemon: Option<Child>,
    network: String,
    /// Whether the network is this engine's own (removed on drop).
    own_network: bool,
    gateway: String,
}

impl Engine {
    /// Starts the daemon, makes the network and the test image from
    /// `agent`'s libraries.
    ///
    /// # Panics
    /// When `dockerd` or `docker` is missing or the daemon does not come up
    /// (run `scripts/test-deps.sh`).
    pub fn start(agent: &Path) -> Engine {
        Engine::start_kind(EngineKind::Docker, agent)
    }

    /// Starts `podman system service` on a socket and storage of its own,
    /// and makes the test image; containers join Podman's default network.
    ///
    /// # Panics
    /// When `podman` is missing or the service does not come up (run
    /// `scripts/test-deps.sh`).
    pub fn start_podman(agent: &Path) -> Engine {
        Engine::start_kind(EngineKind::Podman, agent)
    }

    fn start_kind(kind: EngineKind, agent: &Path) -> Engine {
        let dir = tempfile::Builder::new()
            .prefix("prov-dockerd-")
            .tempdir_in("/tmp")
            .expect("a directory for the test engine");
        let mut engine = Engine {
            kind,
            dir,
            daemon: None,
            network: String::new(),
            own_network: false,
            gateway: String::new(),
        };
        engine.launch();
        if kind == EngineKind::Podman {
            let gateway = engine.docker_ok(&[
                "network",
                "inspect",
                "-f",
                "{{(index .IPAM.Config 0).Gateway}}",
                PODMAN_NETWORK,
            ]);
            engine.network = PODMAN_NETWORK.to_owned();
            engine.gateway = gateway.trim().to_owned();
            engine.build_image(agent);
            return engine;
        }
        let network = format!(
            "provtest-{}",
            engine
                .dir
                .path()
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or("net")
                .trim_start_matches("prov-dockerd-")
                .to_ascii_lowercase()
        );
        engine.docker_ok(&["network", "create", "--driver", "bridge", &network]);
        let gateway = engine.docker_ok(&[
            "network",
            "inspect",
            "-f",
            "{{(index .IPAM.Config 0).Gateway}}",
            &network,
        ]);
        engine.network = network;
        engine.own_network = true;
        engine.gateway = gateway.trim().to_owned();
        engine.build_image(agent);
        engine
    }

    /// Which engine this is.
    pub fn kind(&self) -> EngineKind {
        self.kind
    }

    fn launch(&mut self) {
        let root = self.dir.path();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(root.join("dockerd.log"))
            .expect("the daemon's log");
        let child = match self.kind {
            EngineKind::Docker => self.dockerd(log),
            EngineKind::Podman => self.podman(log),
        };
        self.daemon = Some(child);
        self.wait_answering();
    }

    fn podman(&self, log: std::fs::File) -> Child {
        let root = self.dir.path();
        let conf = root.join("containers.conf");
        std::fs::write(
            &conf,
            "[containers]\ndefault_ulimits = [\"nofile=1024:1024\", \"nproc=4096:4096\"]\n\n[engine]\nruntime = \"runc\"\n",
        )
        .expect("the engine's containers.conf");
        Command::new("podman")
            .env("CONTAINERS_CONF", &conf)
            .arg("--root")
            .arg(root.join("storage"))
            .arg("--runroot")
            .arg(root.join("run"))
            .args(["--cgroup-manager", "cgroupfs", "--events-backend", "file"])
            .args(["system", "service", "--time=0"])
            .arg(self.socket())
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("the daemon's log"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start podman ({e}); install podman and runc with scripts/test-deps.sh"
                )
            })
    }

    fn dockerd(&self, log: std::fs::File) -> Child {
        let root = self.dir.path();
        Command::new("dockerd")
            .arg("--host")
            .arg(format!("unix://{}", self.socket_path().display()))
            .arg("--data-root")
            .arg(root.join("data"))
            .arg("--exec-root")
            .arg(root.join("exec"))
            .arg("--pidfile")
            .arg(root.join("docker.pid"))
            .args(["--default-ulimit", "nofile=1024:1024"])
            .args(["--default-ulimit", "nproc=4096:4096"])
            .args(["--bridge", "none", "--iptables=false", "--ip-masq=false"])
            // Containers outlive a daemon restart, as on a production host.
            .arg("--live-restore")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("the daemon's log"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot start dockerd ({e}); install docker.io with scripts/test-deps.sh")
            })
    }

    /// Waits (bounded) until the daemon answers.
    fn wait_answering(&mut self) {
        let deadline = Instant::now() + START_WAIT;
        // Bounded by the deadline.
        loop {
            if self
                .docker(&["version", "--format", "{{.Server.Version}}"])
                .0
            {
                return;
            }
            if let Some(child) = self.daemon.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                panic!(
                    "the {:?} engine exited ({status}):\n{}",
                    self.kind,
                    self.log_tail()
                );
            }
            assert!(
                Instant::now() < deadline,
                "the {:?} engine did not answer within {START_WAIT:?}:\n{}",
                self.kind,
                self.log_tail()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.path().join("dockerd.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// The engine's socket path.
    pub fn socket_path(&self) -> PathBuf {
        self.dir.path().join("docker.sock")
    }

    /// The engine's socket as the plugin is configured with it.
    pub fn socket(&self) -> String {
        format!("unix://{}", self.socket_path().display())
    }

    /// The test network's name.
    pub fn network(&self) -> &str {
        &self.network
    }

    /// The host's address on the test network: where containers dial the
    /// controller.
    pub fn gateway(&self) -> std::net::IpAddr {
        self.gateway.parse().expect("the network's gateway address")
    }

    /// Runs `docker ARGS` against this engine: (success, stdout, stderr).
    pub fn docker(&self, args: &[&str]) -> (bool, String, String) {
        let output = Command::new("docker")
            .arg("--host")
            .arg(self.socket())
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("cannot run the docker client ({e}); install docker.io"));
        (
            output.status.success(),
            String::from_utf8_lossy(&output.stdout).into_owned(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    }

    /// Runs `docker ARGS` and returns its output.
    ///
    /// # Panics
    /// When it fails.
    pub fn docker_ok(&self, args: &[&str]) -> String {
        let (ok, stdout, stderr) = self.docker(args);
        assert!(ok, "docker {args:?} failed: {stderr}");
        stdout
    }

    /// The ids of this engine's containers whose name starts with `prefix`
    /// (any state).
    pub fn containers(&self, prefix: &str) -> Vec<(String, String, String)> {
        let (_, out, _) = self.docker(&[
            "ps",
            "-a",
            "--no-trunc",
            "--format",
            "{{.ID}} {{.Names}} {{.State}}",
        ]);
        out.lines()
            .filter_map(|l| {
                let mut parts = l.split_whitespace();
                Some((
                    parts.next()?.to_owned(),
                    parts.next()?.to_owned(),
                    parts.next().unwrap_or("").to_owned(),
                ))
            })
            .filter(|(_, name, _)| name.starts_with(prefix))
            .collect()
    }

    /// Stops the daemon and starts it again on the same directories and
    /// socket; containers live on (live restore).
    pub fn restart(&mut self) {
        self.stop_daemon();
        self.launch();
    }

    /// Stops the daemon: its socket is gone until [`Engine::resume`].
    pub fn stop_daemon(&mut self) {
        if let Some(mut child) = self.daemon.take() {
            let _ = send_signal(child.id(), "TERM");
            let deadline = Instant::now() + STOP_WAIT;
            // Bounded by the deadline.
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the daemon again after [`Engine::stop_daemon`].
    pub fn resume(&mut self) {
        if self.daemon.is_none() {
            self.launch();
        }
    }

    fn build_image(&self, agent: &Path) {
        let root = self.dir.path().join("image-root");
        std::fs::create_dir_all(root.join("tmp")).expect("the image root");
        let mut files: Vec<PathBuf> = Vec::new();
        for tool in IMAGE_TOOLS {
            let path = which(tool).unwrap_or_else(|| panic!("no {tool} on this machine"));
            copy_into(&root, &path, Some(&Path::new("/bin").join(tool)));
            files.push(path);
        }
        files.push(agent.to_path_buf());
        for file in &files {
            for library in libraries(file) {
                copy_into(&root, &library, None);
            }
        }
        set_mode(&root.join("tmp"), 0o1777);
        let mut tar = Command::new("tar")
            .arg("-C")
            .arg(&root)
            .args(["-c", "."])
            .stdout(Stdio::piped())
            .spawn()
            .expect("tar");
        let status = Command::new("docker")
            .arg("--host")
            .arg(self.socket())
            .args(["import", "-", TEST_IMAGE])
            .stdin(tar.stdout.take().expect("tar's output"))
            .stdout(Stdio::null())
            .status()
            .expect("docker import");
        let packed = tar.wait().expect("tar");
        assert!(
            status.success() && packed.success(),
            "docker import of the test image failed"
        );
        let _ = std::fs::remove_dir_all(&root);
    }
}

fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

fn which(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(tool))
        .find(|candidate| candidate.is_file())
}

/// The shared libraries `ldd` lists for `file`.
fn libraries(file: &Path) -> Vec<PathBuf> {
    let output = Command::new("ldd").arg(file).output().expect("ldd");
    String::from_utf8_lossy(&output.stdout)
        .split_whitespace()
        .filter(|word| word.starts_with('/'))
        .map(PathBuf::from)
        .collect()
}

/// Copies `source` (following links) into `root` at `target` (default: its
/// own path).
fn copy_into(root: &Path, source: &Path, target: Option<&Path>) {
    let target = target.unwrap_or(source);
    let destination = root.join(target.strip_prefix("/").unwrap_or(target));
    if let Some(parent) = destination.parent() {
        std::fs::create_dir_all(parent).expect("a directory of the image root");
    }
    std::fs::copy(source, &destination)
        .unwrap_or_else(|e| panic!("cannot copy {} into the image: {e}", source.display()));
}

/// Sends `signal` to `pid` with the system's `kill`.
fn send_signal(pid: u32, signal: &str) -> std::io::Result<()> {
    Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()
        .map(|_| ())
}

impl Engine {
    /// SIGKILLs every process whose command line names this engine's
    /// directory (Podman's `conmon` monitors), by process id.
    fn kill_monitors(&self) {
        let needle = self.dir.path().to_string_lossy().into_owned();
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return;
        };
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
                continue;
            };
            if String::from_utf8_lossy(&cmdline).contains(&needle) {
                let _ = send_signal(pid, "KILL");
            }
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if self.daemon.is_some() {
            let (_, ids, _) = self.docker(&["ps", "-aq"]);
            let ids: Vec<&str> = ids.split_whitespace().collect();
            if !ids.is_empty() {
                let mut args = vec!["rm", "-f"];
                args.extend(ids);
                let _ = self.docker(&args);
            }
            if self.own_network {
                let network = self.network.clone();
                let _ = self.docker(&["network", "rm", &network]);
            }
        }
        self.stop_daemon();
        if self.kind == EngineKind::Podman {
            // Podman's per-container and per-exec monitors (`conmon`) outlive
            // the service; they carry this engine's storage path.
            self.kill_monitors();
        }
        // Whatever the daemon left mounted below its directory (Podman's
        // overlay driver mounts its storage onto itself), deepest first.
        let root = self.dir.path().to_string_lossy().into_owned();
        let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
        let mut below: Vec<&str> = mounts
            .lines()
            .filter_map(|line| line.split_whitespace().nth(1))
            .filter(|point| point.starts_with(&root))
            .collect();
        below.sort_by_key(|point| std::cmp::Reverse(point.len()));
        for point in below {
            let _ = Command::new("umount")
                .args(["-l", point])
                .stderr(Stdio::null())
                .status();
        }
        let _ = std::io::stderr().flush();
    }
}
