//! A testbed of real OpenSSH servers on loopback: per host a generated host
//! key, an `sshd -D -f CONFIG` child on a free port of 127.0.0.1 and its
//! own claim directory; one generated user key authorised on every host and
//! a known-hosts file with every host key. Dropping it kills every sshd and
//! removes every file.

#![allow(dead_code, unreachable_pub)]

use std::fs;
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use provisioning::{
    BootParams, GroupId, LogicalNodeId, LogicalNodeSpec, NodeAttemptId, NodeTemplate,
    ProviderShape, RunId, SwarmJoinTemplate,
};
use provisioning_provider::AttemptKey;
use provisioning_ssh::{SshHost, SshPlugin, SshPluginConfig};

/// The OpenSSH server the testbed runs.
pub const SSHD: &str = "/usr/sbin/sshd";

/// How many times the testbed looks for a started sshd's port.
const READY_POLLS_MAX: usize = 1_000;

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

/// One sshd of the testbed.
pub struct SshdHost {
    pub name: String,
    pub dir: PathBuf,
    pub port: u16,
    /// `ssh-ed25519 AAAA… comment`.
    pub host_key: String,
    config: PathBuf,
    child: Option<Child>,
}

impl SshdHost {
    fn create(root: &Path, index: usize, user_key: &str) -> Self {
        let name = format!("host{index}");
        let dir = root.join(&name);
        fs::create_dir_all(dir.join("claims")).expect("host dir");
        let host_key = keygen(&dir.join("ssh_host_ed25519_key"), &name);
        fs::write(dir.join("authorized_keys"), format!("{user_key}\n")).expect("authorized_keys");
        let port = free_port();
        let config = dir.join("sshd_config");
        fs::write(
            &config,
            format!(
                "Port {port}\nListenAddress 127.0.0.1\nHostKey {dir}/ssh_host_ed25519_key\n\
                 PidFile none\nAuthorizedKeysFile {dir}/authorized_keys\nPubkeyAuthentication yes\n\
                 PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n\
                 PermitRootLogin prohibit-password\nStrictModes no\nLogLevel ERROR\n\
                 MaxStartups 200\nMaxSessions 200\n",
                dir = dir.display()
            ),
        )
        .expect("sshd_config");
        let mut host = SshdHost {
            name,
            dir,
            port,
            host_key,
            config,
            child: None,
        };
        host.start();
        host
    }

    /// Starts (or restarts) the server on its port.
    pub fn start(&mut self) {
        assert!(self.child.is_none(), "{} already runs", self.name);
        // sshd refuses to start without its privilege separation directory.
        let _ = fs::create_dir_all("/run/sshd");
        let log = self.dir.join("sshd.log");
        let mut child = Command::new(SSHD)
            .arg("-D")
            .arg("-f")
            .arg(&self.config)
            .arg("-E")
            .arg(&log)
            .stdin(Stdio::null())
            .spawn()
            .expect("start sshd");
        for _ in 0..READY_POLLS_MAX {
            if let Some(status) = child.try_wait().expect("poll sshd") {
                panic!(
                    "sshd of {} exited with {status}: {}",
                    self.name,
                    fs::read_to_string(&log).unwrap_or_default()
                );
            }
            if TcpStream::connect((Ipv4Addr::LOCALHOST, self.port)).is_ok() {
                self.child = Some(child);
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!("sshd of {} never listened on port {}", self.name, self.port);
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

    /// The known-hosts line of this host.
    pub fn known_hosts_line(&self) -> String {
        format!("[127.0.0.1]:{} {}", self.port, self.host_key)
    }
}

impl Drop for SshdHost {
    fn drop(&mut self) {
        self.stop();
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
    pub fn start(hosts: usize) -> Self {
        require_tools();
        let dir = tempfile::tempdir().expect("testbed dir");
        let identity = dir.path().join("id_ed25519");
        let user_key = keygen(&identity, "provisioning-ssh-test");
        let hosts: Vec<_> = (0..hosts)
            .map(|i| SshdHost::create(dir.path(), i, &user_key))
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
                address: "127.0.0.1".into(),
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
