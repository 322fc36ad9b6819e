//! The EC2 testbed for the tests: `scripts/ec2-testbed/server.py` (moto with
//! token idempotency, timed transitions, faults and user-data boot) started
//! on 127.0.0.1 on a free port, and stopped — with every instance it booted
//! — when the [`Testbed`] is dropped, also when a test fails (and, should
//! the test process die, when its standard input closes).
//!
//! The server needs moto in the test virtual environment
//! (`scripts/test-deps.sh`); without it the tests fail loudly, never skip.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use provisioning::{NodeTemplate, RunId};
use provisioning_agent::RunSecret;
use provisioning_ec2::{
    AddressChoice, ApiEndpoint, Credentials, Ec2AgentConfig, Ec2Plugin, Ec2PluginConfig, GroupShape,
};
use serde_json::Value;

/// The test agent binary: what each booted instance starts.
pub(crate) const AGENT: &str = env!("CARGO_BIN_EXE_provision-ec2-agent");

/// An AMI moto knows.
pub(crate) const IMAGE: &str = "ami-12c6146b";

/// How long the server may take to say it listens.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// How the testbed runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Tokens, transitions, faults and boot.
    Full,
    /// Plain moto: tokens ignored, no transitions, no faults (still boots).
    Plain,
}

/// A running testbed.
pub(crate) struct Testbed {
    child: Child,
    stdin: Option<ChildStdin>,
    /// `http://127.0.0.1:PORT`.
    pub(crate) url: String,
    authority: String,
}

fn venv() -> PathBuf {
    std::env::var_os("PROVISION_TEST_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/opt/provisioning-test/venv"))
}

impl Testbed {
    /// Starts a testbed in `mode` whose instances stay `pending` for
    /// `pending_ms`.
    ///
    /// # Panics
    /// When moto's virtual environment is missing or the server does not
    /// start: the EC2 tests need it (run `scripts/test-deps.sh` as root).
    pub(crate) fn start(mode: Mode, pending_ms: u64) -> Testbed {
        let python = venv().join("bin/python");
        assert!(
            python.is_file(),
            "the EC2 testbed needs moto in the virtual environment {} (PROVISION_TEST_VENV); run scripts/test-deps.sh as root",
            venv().display()
        );
        let script =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/ec2-testbed/server.py");
        let mut command = Command::new(&python);
        command
            .arg(&script)
            .args(["--port", "0", "--exit-on-stdin-eof"])
            .args(["--pending-ms", &pending_ms.to_string()])
            .args(["--shutting-down-ms", "300"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if mode == Mode::Plain {
            command.arg("--plain");
        }
        let mut child = command
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", python.display()));
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            if let Some(Ok(line)) = lines.next() {
                let _ = tx.send(line);
            }
            // Keep draining so the server never blocks on a full pipe.
            for _ in lines {}
        });
        let line = match rx.recv_timeout(START_TIMEOUT) {
            Ok(line) => line,
            Err(_) => {
                let _ = child.kill();
                panic!(
                    "the EC2 testbed did not start within {START_TIMEOUT:?} (is moto installed? run scripts/test-deps.sh as root)"
                );
            }
        };
        let url = line
            .strip_prefix("LISTENING ")
            .unwrap_or_else(|| panic!("unexpected first line of the testbed: {line:?}"))
            .to_owned();
        let authority = url.trim_start_matches("http://").to_owned();
        Testbed {
            child,
            stdin,
            url,
            authority,
        }
    }

    /// A plugin configuration for `run` against this testbed.
    pub(crate) fn plugin_config(&self, run: &str) -> Ec2PluginConfig {
        Ec2PluginConfig {
            run_id: RunId::new(run),
            endpoint: ApiEndpoint::parse(&self.url).expect("testbed url"),
            region: "us-east-1".to_owned(),
            credentials: Credentials {
                access_key_id: "AKIDTESTBED".to_owned(),
                secret_access_key: "testbed-secret".to_owned(),
                session_token: None,
            },
            request_timeout: Duration::from_secs(5),
            address: AddressChoice::Private,
        }
    }

    /// A plugin for `run` whose instances boot the test agent, joining a
    /// listener on a free loopback port.
    pub(crate) async fn agent_plugin(&self, run: &str) -> Arc<Ec2Plugin> {
        let mut agent =
            Ec2AgentConfig::new(AGENT, RunSecret::generate(), "127.0.0.1:0".parse().unwrap());
        agent.join_timeout = Duration::from_secs(30);
        agent.rejoin_window = Some(Duration::from_secs(5));
        Ec2Plugin::start(self.plugin_config(run), agent)
            .await
            .expect("start the ec2 plugin")
    }

    fn http(&self, method: &str, path: &str, body: &str) -> Value {
        let mut stream = TcpStream::connect(&self.authority).expect("connect to the testbed");
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .expect("timeout");
        write!(
            stream,
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            self.authority,
            body.len()
        )
        .expect("send to the testbed");
        let mut reply = String::new();
        stream
            .read_to_string(&mut reply)
            .expect("read the testbed's reply");
        let (head, body) = reply.split_once("\r\n\r\n").expect("an HTTP reply");
        assert!(
            head.starts_with("HTTP/1.1 200") || head.starts_with("HTTP/1.0 200"),
            "the testbed refused {method} {path}: {reply}"
        );
        serde_json::from_str(body).expect("JSON from the testbed")
    }

    /// Arms `kind` for the next `count` calls of `action`.
    pub(crate) fn fault(&self, action: &str, kind: &str, count: u32) {
        let body = serde_json::json!({"action": action, "kind": kind, "count": count});
        self.http("POST", "/_testbed/fault", &body.to_string());
    }

    /// Delays the next answer to `action` by `delay_ms`.
    pub(crate) fn delay(&self, action: &str, delay_ms: u64) {
        let body = serde_json::json!({"action": action, "kind": "delay", "delay_ms": delay_ms});
        self.http("POST", "/_testbed/fault", &body.to_string());
    }

    /// Drops every armed fault.
    pub(crate) fn clear_faults(&self) {
        self.http("POST", "/_testbed/clear", "{}");
    }

    /// A spot interruption of `instance`.
    pub(crate) fn interrupt(&self, instance: &str) {
        let body = serde_json::json!({"instance_id": instance});
        self.http("POST", "/_testbed/interrupt", &body.to_string());
    }

    /// A termination of `instance` by someone else.
    pub(crate) fn terminate_outside(&self, instance: &str) {
        let body = serde_json::json!({"instance_id": instance});
        self.http("POST", "/_testbed/terminate", &body.to_string());
    }

    /// Every instance the server knows: id, state, tags, booted.
    pub(crate) fn instances(&self) -> Vec<Value> {
        self.http("GET", "/_testbed/instances", "")
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// The instances of `run` that are not terminated or shutting down.
    pub(crate) fn live_instances(&self, run: &str) -> Vec<Value> {
        self.instances()
            .into_iter()
            .filter(|i| i["tags"]["provision:run"] == run)
            .filter(|i| !matches!(i["state"].as_str(), Some("terminated" | "shutting-down")))
            .collect()
    }

    /// API calls received, by action.
    pub(crate) fn calls(&self) -> Value {
        self.http("GET", "/_testbed/calls", "")
    }

    /// Waits until `check` holds, at most `timeout`.
    pub(crate) fn wait_for(
        &self,
        timeout: Duration,
        mut check: impl FnMut(&Testbed) -> bool,
    ) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if check(self) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        check(self)
    }
}

impl Drop for Testbed {
    fn drop(&mut self) {
        // Closing its standard input stops the server and what it booted.
        drop(self.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The group shape the tests create instances with.
pub(crate) fn shape() -> GroupShape {
    GroupShape {
        instance_type: "t3.micro".to_owned(),
        image: IMAGE.to_owned(),
        ..GroupShape::default()
    }
}

/// A node template of provider `ec2` carrying [`shape`].
pub(crate) fn template() -> NodeTemplate {
    NodeTemplate {
        role: "contract".to_owned(),
        provider: "ec2".to_owned(),
        shape: provisioning::ProviderShape {
            labels: shape().to_labels(),
            ..Default::default()
        },
        boot: Default::default(),
        swarm_join: Default::default(),
    }
}
