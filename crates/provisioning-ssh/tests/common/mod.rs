//! A testbed of real OpenSSH servers on loopback: per host a generated host
//! key, an `sshd -D -f CONFIG` child on a free port of 127.0.0.1 and its
//! own claim directory; one generated user key authorised on every host and
//! a known-hosts file with every host key. Dropping it kills every sshd and
//! removes every file.

#![allow(dead_code, unreachable_pub)]

use std::fs;
use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use provisioning::{
    BootParams, GroupId, LogicalNodeId, LogicalNodeSpec, NodeAttemptId, NodeTemplate,
    ProviderShape, RunId, SwarmJoinTemplate,
};
use provisioning_agent::RunSecret;
use provisioning_provider::AttemptKey;
use provisioning_ssh::{SshAgentConfig, SshHost, SshPlugin, SshPluginConfig};

/// The OpenSSH server the testbed runs.
pub const SSHD: &str = "/usr/sbin/sshd";

/// How many times the testbed looks for a started sshd's port.
const READY_POLLS_MAX: usize = 1_000;

/// How many other ports a loopback sshd tries when its port was taken.
const PORT_TRIES_MAX: usize = 10;

fn require_tools() {
    for tool in [SSHD, "/usr/bin/ssh", "/usr/bin/ssh-keygen"] {
        assert!(
            Path::new(tool).exists(),
            "{tool} is missing: these tests run real OpenSSH servers and clients. \
             Install them with `scripts/test-deps.sh` (as root: apt-get install openssh-server openssh-client)"
        );
    }
}

fn keygen(path: &Path, comment: &str) -> String {
    let status = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-C", comment, "-f"])
        .arg(path)
        .stdin(Stdio::null())
        .status()
        .expect("run ssh-keygen");
    assert!(status.success(), "ssh-keygen failed for {}", path.display());
    let public = fs::read_to_string(path.with_extension("pub")).expect("read public key");
    public.trim().to_owned()
}

fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port()
}

fn current_user() -> String {
    let output = Command::new("id").arg("-un").output().expect("run id -un");
    String::from_utf8(output.stdout)
        .expect("user name")
        .trim()
        .to_owned()
}

/// Runs `ip ARGS`, panicking with its error output on failure.
fn ip(args: &[&str]) {
    let output = Command::new("ip")
        .args(args)
        .output()
        .unwrap_or_else(|error| {
            panic!("cannot run ip (install iproute2 with scripts/test-deps.sh): {error}")
        });
    assert!(
        output.status.success(),
        "ip {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Namespaces made by this test process, for unique names and subnets.
static NAMESPACES: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// A network namespace joined to the root namespace by a veth pair:
/// `10.213.{n}.1/30` on the root side, `10.213.{n}.2/30` inside, with its
/// default route through the root side (so the host reaches the
/// controller's listener on any root-side address). Dropping it deletes
/// the link and the namespace, whatever was made of them.
pub struct Netns {
    pub name: String,
    /// The root side of the veth pair (set it down to partition the host).
    pub link: String,
    pub address: Ipv4Addr,
    /// The root side's address: where the host reaches the controller.
    pub gateway: Ipv4Addr,
    made_ns: bool,
    made_link: bool,
}

impl Netns {
    pub fn create() -> Self {
        let n = NAMESPACES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let pid = std::process::id() % 100_000;
        let subnet = 1 + (pid + n * 7) % 250;
        let address = Ipv4Addr::new(10, 213, subnet as u8, 2);
        let used = Command::new("ip")
            .args(["-o", "addr"])
            .output()
            .expect("ip addr");
        assert!(
            !String::from_utf8_lossy(&used.stdout).contains(&format!("10.213.{subnet}.")),
            "10.213.{subnet}.0/30 is already in use on this machine"
        );
        let mut netns = Netns {
            name: format!("pssh-{pid}-{n}"),
            link: format!("psv{pid}h{n}"),
            address,
            gateway: Ipv4Addr::new(10, 213, subnet as u8, 1),
            made_ns: false,
            made_link: false,
        };
        let peer = format!("psv{pid}n{n}");
        ip(&["netns", "add", &netns.name]);
        netns.made_ns = true;
        ip(&[
            "link",
            "add",
            &netns.link,
            "type",
            "veth",
            "peer",
            "name",
            &peer,
        ]);
        netns.made_link = true;
        ip(&["link", "set", &peer, "netns", &netns.name]);
        ip(&[
            "addr",
            "add",
            &format!("10.213.{subnet}.1/30"),
            "dev",
            &netns.link,
        ]);
        ip(&["link", "set", &netns.link, "up"]);
        let inside = |args: &[&str]| {
            let mut all = vec!["netns", "exec", netns.name.as_str(), "ip"];
            all.extend_from_slice(args);
            ip(&all);
        };
        inside(&["addr", "add", &format!("{address}/30"), "dev", &peer]);
        inside(&["link", "set", &peer, "up"]);
        inside(&["link", "set", "lo", "up"]);
        let gateway = netns.gateway.to_string();
        inside(&["route", "add", "default", "via", &gateway]);
        netns
    }

    /// The pids of the processes running in the namespace (`ip netns pids`).
    pub fn pids(&self) -> Vec<u32> {
        let output = Command::new("ip")
            .args(["netns", "pids", &self.name])
            .output()
            .expect("ip netns pids");
        String::from_utf8_lossy(&output.stdout)
            .split_whitespace()
            .filter_map(|pid| pid.parse().ok())
            .collect()
    }

    /// Cuts the host off: its link goes down.
    pub fn partition(&self) {
        ip(&["link", "set", &self.link, "down"]);
    }

    /// Joins it again.
    pub fn heal(&self) {
        ip(&["link", "set", &self.link, "up"]);
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if self.made_ns {
            // Whatever still runs inside (sessions of a partitioned sshd,
            // their commands) was started by this test: kill it by pid.
            if let Ok(output) = Command::new("ip")
                .args(["netns", "pids", &self.name])
                .output()
            {
                for pid in String::from_utf8_lossy(&output.stdout).split_whitespace() {
                    let _ = Command::new("kill").args(["-KILL", pid]).status();
                }
            }
        }
        if self.made_link {
            let _ = Command::new("ip")
                .args(["link", "del", &self.link])
                .status();
        }
        if self.made_ns {
            let _ = Command::new("ip")
                .args(["netns", "del", &self.name])
                .status();
        }
    }
}

/// One sshd of the testbed.
pub struct SshdHost {
    pub name: String,
    pub dir: PathBuf,
    pub address: Ipv4Addr,
    pub port: u16,
    /// `ssh-ed25519 AAAA… comment`.
    pub host_key: String,
    config: PathBuf,
    child: Option<Child>,
    /// Last: removed after the sshd inside it is dead.
    pub netns: Option<Netns>,
}

impl SshdHost {
    fn create(root: &Path, index: usize, user_key: &str, netns: Option<Netns>) -> Self {
        let name = format!("host{index}");
        let dir = root.join(&name);
        fs::create_dir_all(dir.join("claims")).expect("host dir");
        let host_key = keygen(&dir.join("ssh_host_ed25519_key"), &name);
        fs::write(dir.join("authorized_keys"), format!("{user_key}\n")).expect("authorized_keys");
        let (address, port) = match &netns {
            Some(netns) => (netns.address, 22),
            None => (Ipv4Addr::LOCALHOST, free_port()),
        };
        let config = dir.join("sshd_config");
        let mut host = SshdHost {
            name,
            dir,
            address,
            port,
            host_key,
            config,
            child: None,
            netns,
        };
        // A port found free may be taken before sshd binds it: try others.
        let mut tries = 0;
        loop {
            host.write_config();
            match host.try_start() {
                Ok(()) => return host,
                Err(log) if host.netns.is_none() && tries < PORT_TRIES_MAX => {
                    eprintln!(
                        "sshd of {} on port {} failed ({log}); another port",
                        host.name, host.port
                    );
                    tries += 1;
                    host.port = free_port();
                }
                Err(log) => panic!("sshd of {} did not start: {log}", host.name),
            }
        }
    }

    fn write_config(&self) {
        fs::write(
            &self.config,
            format!(
                "Port {port}\nListenAddress {address}\nHostKey {dir}/ssh_host_ed25519_key\n\
                 PidFile none\nAuthorizedKeysFile {dir}/authorized_keys\nPubkeyAuthentication yes\n\
                 PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n\
                 PermitRootLogin prohibit-password\nStrictModes no\nLogLevel INFO\n\
                 MaxStartups 200\nMaxSessions 200\nClientAliveInterval 2\nClientAliveCountMax 2\n",
                port = self.port,
                address = self.address,
                dir = self.dir.display()
            ),
        )
        .expect("sshd_config");
    }

    /// Starts (or restarts) the server on its port.
    pub fn start(&mut self) {
        if let Err(log) = self.try_start() {
            panic!("sshd of {} did not start: {log}", self.name);
        }
    }

    /// Starts the server; once its log says it listens, it is ready.
    /// `Err` with its log when it exited instead.
    fn try_start(&mut self) -> Result<(), String> {
        assert!(self.child.is_none(), "{} already runs", self.name);
        // sshd refuses to start without its privilege separation directory.
        let _ = fs::create_dir_all("/run/sshd");
        let log = self.dir.join("sshd.log");
        let _ = fs::remove_file(&log);
        let mut command = match &self.netns {
            Some(netns) => {
                let mut command = Command::new("ip");
                command.args(["netns", "exec", &netns.name, SSHD]);
                command
            }
            None => Command::new(SSHD),
        };
        let mut child = command
            .arg("-D")
            .arg("-f")
            .arg(&self.config)
            .arg("-E")
            .arg(&log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start sshd");
        let listening = format!("Server listening on {} port {}", self.address, self.port);
        for _ in 0..READY_POLLS_MAX {
            let text = fs::read_to_string(&log).unwrap_or_default();
            if let Some(status) = child.try_wait().expect("poll sshd") {
                return Err(format!("exited with {status}: {}", text.trim()));
            }
            if text.contains(&listening) {
                self.child = Some(child);
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = child.kill();
        let _ = child.wait();
        Err(format!("never listened on port {}", self.port))
    }

    /// Stops the server: connections to its port are refused.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The claim root on this host.
    pub fn claims(&self) -> PathBuf {
        self.dir.join("claims")
    }

    /// The claims of `run` on this host, as `{node}/a{attempt}`.
    pub fn claims_of(&self, run: &str) -> Vec<String> {
        let mut claims = Vec::new();
        for node in fs::read_dir(self.claims().join(run))
            .into_iter()
            .flatten()
            .flatten()
        {
            for attempt in fs::read_dir(node.path()).into_iter().flatten().flatten() {
                claims.push(format!(
                    "{}/{}",
                    node.file_name().to_string_lossy(),
                    attempt.file_name().to_string_lossy()
                ));
            }
        }
        claims.sort();
        claims
    }

    /// The known-hosts line of this host.
    pub fn known_hosts_line(&self) -> String {
        if self.port == 22 {
            format!("{} {}", self.address, self.host_key)
        } else {
            format!("[{}]:{} {}", self.address, self.port, self.host_key)
        }
    }
}

impl Drop for SshdHost {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Kills every process group a session under `claims` recorded (agents
/// and their workloads, also after their agent died) and every agent whose
/// boot file was below `claims`: what a failed test left running.
pub fn kill_sessions_under(claims: &Path) {
    let mut groups = Vec::new();
    let runs = fs::read_dir(claims).into_iter().flatten().flatten();
    for run in runs {
        for node in fs::read_dir(run.path()).into_iter().flatten().flatten() {
            for attempt in fs::read_dir(node.path()).into_iter().flatten().flatten() {
                let pid =
                    fs::read_to_string(attempt.path().join("session/pid")).unwrap_or_default();
                if let Ok(pid) = pid.trim().parse::<u32>() {
                    groups.push(pid);
                }
            }
        }
    }
    groups.extend(agents_under(claims));
    for pid in groups {
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{pid}")])
            .stderr(Stdio::null())
            .status();
        let _ = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .stderr(Stdio::null())
            .status();
    }
}

/// N sshd hosts, a user key and a known-hosts file.
pub struct Testbed {
    pub hosts: Vec<SshdHost>,
    pub user: String,
    pub identity: PathBuf,
    pub known_hosts: PathBuf,
    // Last: removed after every sshd is dead.
    dir: tempfile::TempDir,
}

impl Testbed {
    /// `hosts` sshd on free ports of 127.0.0.1.
    pub fn start(hosts: usize) -> Self {
        Self::build(hosts, false)
    }

    /// `hosts` sshd, each on port 22 of its own address in a network
    /// namespace of its own.
    pub fn start_netns(hosts: usize) -> Self {
        Self::build(hosts, true)
    }

    fn build(hosts: usize, netns: bool) -> Self {
        require_tools();
        let dir = tempfile::tempdir().expect("testbed dir");
        let identity = dir.path().join("id_ed25519");
        let user_key = keygen(&identity, "provisioning-ssh-test");
        let hosts: Vec<_> = (0..hosts)
            .map(|i| SshdHost::create(dir.path(), i, &user_key, netns.then(Netns::create)))
            .collect();
        let known_hosts = dir.path().join("known_hosts");
        let testbed = Testbed {
            hosts,
            user: current_user(),
            identity,
            known_hosts,
            dir,
        };
        testbed.write_known_hosts(&testbed.known_hosts_lines());
        testbed
    }

    pub fn known_hosts_lines(&self) -> String {
        self.hosts
            .iter()
            .map(|h| h.known_hosts_line() + "\n")
            .collect()
    }

    pub fn write_known_hosts(&self, text: &str) {
        fs::write(&self.known_hosts, text).expect("known_hosts");
    }

    /// A fresh key pair in the testbed directory (for a "changed" host key).
    pub fn other_key(&self, name: &str) -> String {
        keygen(&self.dir.path().join(name), name)
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// A plugin configuration over every host, each with `slots` slots.
    pub fn config(&self, run: &str, slots: u32) -> SshPluginConfig {
        let hosts = self
            .hosts
            .iter()
            .map(|h| SshHost {
                name: h.name.clone(),
                address: h.address.to_string(),
                port: h.port,
                user: self.user.clone(),
                identity_file: Some(self.identity.clone()),
                slots,
                claim_root: Some(h.claims().display().to_string()),
            })
            .collect();
        let mut config =
            SshPluginConfig::new(RunId::new(run), "testbed", hosts, self.known_hosts.clone());
        config.ssh_config_file = Some(PathBuf::from("/dev/null"));
        config.connect_timeout = Duration::from_secs(5);
        config.command_timeout = Duration::from_secs(30);
        config
    }

    pub fn plugin(&self, run: &str, slots: u32) -> Arc<SshPlugin> {
        Arc::new(SshPlugin::new(self.config(run, slots)).expect("valid config"))
    }

    /// Where the hosts reach a listener of this process: loopback for
    /// loopback hosts, else the root side of the first host's link.
    pub fn controller_address(&self) -> Ipv4Addr {
        self.hosts[0]
            .netns
            .as_ref()
            .map_or(Ipv4Addr::LOCALHOST, |netns| netns.gateway)
    }

    /// An agent configuration: `agent` (run with no arguments) joining a
    /// listener on `listen` (port 0: any free port) of
    /// [`Testbed::controller_address`].
    pub fn agent_config(&self, agent: &str, secret: RunSecret, port: u16) -> SshAgentConfig {
        let listen = std::net::SocketAddr::from((self.controller_address(), port));
        let mut config = SshAgentConfig::new(agent, Vec::new(), secret, listen);
        config.join_timeout = Duration::from_secs(30);
        config.rejoin_grace = Duration::from_millis(500);
        config.adopt_wait = Duration::from_secs(10);
        config
    }

    /// A plugin over every host that bootstraps with the agent `agent`.
    pub async fn agent_plugin(
        &self,
        run: &str,
        slots: u32,
        agent: SshAgentConfig,
    ) -> Arc<SshPlugin> {
        SshPlugin::start(self.config(run, slots), agent)
            .await
            .expect("start the ssh plugin")
    }
}

impl Drop for Testbed {
    fn drop(&mut self) {
        // Agents run detached: a failed test must not leave them behind.
        for host in &self.hosts {
            kill_sessions_under(&host.claims());
        }
    }
}

pub fn key(run: &str, group: &str, index: u32, attempt: u64) -> AttemptKey {
    AttemptKey {
        run_id: RunId::new(run),
        node: LogicalNodeId::new(GroupId::new(group), index),
        attempt: NodeAttemptId::from_raw(attempt),
    }
}

pub fn template(boot: BootParams) -> NodeTemplate {
    NodeTemplate {
        role: "worker".into(),
        provider: "ssh".into(),
        shape: ProviderShape::default(),
        boot,
        swarm_join: SwarmJoinTemplate::default(),
    }
}

pub fn spec(key: &AttemptKey, boot: BootParams) -> LogicalNodeSpec {
    LogicalNodeSpec::new(
        key.node.clone(),
        key.run_id.clone(),
        Arc::new(template(boot)),
    )
}

/// Whether the process `pid` runs (a zombie waiting for a reaper does not).
pub fn process_alive(pid: &str) -> bool {
    let stat = Path::new("/proc").join(pid.trim()).join("stat");
    fs::read_to_string(stat).is_ok_and(|stat| {
        stat.rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with(['Z', 'X']))
    })
}

/// The pids of live processes whose command line or environment contains
/// `needle` (`/proc/*/cmdline`, `/proc/*/environ`).
pub fn processes_mentioning(needle: &str) -> Vec<(u32, &'static str)> {
    let mut found = Vec::new();
    let Ok(entries) = fs::read_dir("/proc") else {
        return found;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        for file in ["cmdline", "environ"] {
            let Ok(bytes) = fs::read(entry.path().join(file)) else {
                continue;
            };
            if String::from_utf8_lossy(&bytes).contains(needle) {
                found.push((pid, file));
            }
        }
    }
    found
}

/// The live agents under claim root `claims`: pids of processes whose
/// environment names a boot file below it.
pub fn agents_under(claims: &Path) -> Vec<u32> {
    let needle = format!("PROVISION_AGENT_BOOT_FILE={}", claims.display());
    processes_mentioning(&needle)
        .into_iter()
        .filter(|(pid, file)| *file == "environ" && process_alive(&pid.to_string()))
        .map(|(pid, _)| pid)
        .collect()
}
