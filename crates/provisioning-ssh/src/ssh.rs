//! One call of the system OpenSSH client: a shell script sent on standard
//! input to `sh -s` on the host, and the classification of what went wrong.
//!
//! Scripts travel on standard input, never on the command line, so nothing
//! they carry shows up in a process listing on either side.

use std::process::Stdio;

use tokio::io::AsyncWriteExt;
use tokio::process::Command;

use crate::config::{SshHost, SshPluginConfig};

/// What a finished remote script produced.
#[derive(Debug)]
pub(crate) struct Reply {
    /// The script's exit status.
    pub(crate) status: i32,
    /// Its standard output.
    pub(crate) stdout: String,
    /// Its standard error.
    pub(crate) stderr: String,
}

impl Reply {
    /// The last non-empty line of standard output: the script's verdict.
    pub(crate) fn verdict(&self) -> &str {
        self.stdout
            .lines()
            .rev()
            .find(|line| !line.trim().is_empty())
            .unwrap_or("")
            .trim()
    }
}

/// Why a call produced no reply.
#[derive(Clone, Debug)]
pub(crate) enum SshFailure {
    /// The host's key is not in the known-hosts file, or differs from it.
    /// Nothing ran.
    HostKey(String),
    /// The connection was never made (refused, timed out, no route, not
    /// authenticated) or `ssh` could not be started. Nothing ran.
    NotConnected(String),
    /// The connection broke or the call timed out after the script may have
    /// started: its outcome is unknown.
    Unknown(String),
}

/// Quotes `text` for a POSIX shell.
pub(crate) fn quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

/// Fragments of `ssh`'s own messages that mean the host key check failed.
const HOST_KEY_SIGNS: [&str; 4] = [
    "Host key verification failed",
    "REMOTE HOST IDENTIFICATION HAS CHANGED",
    "host key is known for",
    "Host key for",
];

/// Fragments that mean no session was ever established.
const NOT_CONNECTED_SIGNS: [&str; 12] = [
    "Connection refused",
    "Connection timed out",
    "Operation timed out",
    "No route to host",
    "Network is unreachable",
    "Could not resolve hostname",
    "Name or service not known",
    "Permission denied",
    "Too many authentication failures",
    "kex_exchange_identification",
    "banner exchange",
    "Bad configuration option",
];

/// Runs `script` with `sh -s` on `host`. With `port` the connection goes to
/// that port instead of the host's (the fault hook's refused connection).
pub(crate) async fn run(
    config: &SshPluginConfig,
    host: &SshHost,
    port: Option<u16>,
    script: &str,
) -> Result<Reply, SshFailure> {
    run_with_input(config, host, port, "exec sh -s", script.as_bytes()).await
}

/// Runs the remote command line `remote` (parsed by the user's login shell
/// on the host) on `host`, with `input` on its standard input.
pub(crate) async fn run_with_input(
    config: &SshPluginConfig,
    host: &SshHost,
    port: Option<u16>,
    remote: &str,
    input: &[u8],
) -> Result<Reply, SshFailure> {
    let mut command = Command::new(&config.ssh_program);
    if let Some(file) = &config.ssh_config_file {
        command.arg("-F").arg(file);
    }
    let mut known_hosts = std::ffi::OsString::from("UserKnownHostsFile=");
    known_hosts.push(&config.known_hosts);
    command
        .args([
            "-T",
            "-o",
            "BatchMode=yes",
            "-o",
            "StrictHostKeyChecking=yes",
        ])
        .arg("-o")
        .arg(known_hosts)
        .args(["-o", "GlobalKnownHostsFile=/dev/null"])
        .args(["-o", "UpdateHostKeys=no", "-o", "LogLevel=ERROR"])
        .arg("-o")
        .arg(format!(
            "ConnectTimeout={}",
            config.connect_timeout.as_secs().max(1)
        ))
        .args(["-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=2"]);
    if let Some(identity) = &host.identity_file {
        command
            .arg("-i")
            .arg(identity)
            .args(["-o", "IdentitiesOnly=yes"]);
    }
    command
        .arg("-p")
        .arg(port.unwrap_or(host.port).to_string())
        .arg("-l")
        .arg(&host.user)
        .arg("--")
        .arg(&host.address)
        .arg(remote)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = command.spawn().map_err(|error| {
        SshFailure::NotConnected(format!(
            "cannot run {}: {error}",
            config.ssh_program.display()
        ))
    })?;
    let mut stdin = child.stdin.take();
    let call = async move {
        if let Some(stdin) = stdin.as_mut() {
            // A write error means ssh exited early; its status says why.
            let _ = stdin.write_all(input).await;
            let _ = stdin.shutdown().await;
        }
        drop(stdin);
        child.wait_with_output().await
    };
    let output = match tokio::time::timeout(config.command_timeout, call).await {
        Ok(Ok(output)) => output,
        Ok(Err(error)) => {
            return Err(SshFailure::Unknown(format!(
                "lost the ssh process to {}: {error}",
                host.name
            )));
        }
        Err(_) => {
            return Err(SshFailure::Unknown(format!(
                "no reply from {} within {:?}",
                host.name, config.command_timeout
            )));
        }
    };
    let reply = Reply {
        status: output.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    };
    if reply.status != 255 {
        return Ok(reply);
    }
    let said = reply.stderr.trim().to_owned();
    if HOST_KEY_SIGNS.iter().any(|sign| said.contains(sign)) {
        return Err(SshFailure::HostKey(said));
    }
    if reply.stdout.is_empty() && NOT_CONNECTED_SIGNS.iter().any(|sign| said.contains(sign)) {
        return Err(SshFailure::NotConnected(said));
    }
    Err(SshFailure::Unknown(if said.is_empty() {
        "ssh exited with status 255 and said nothing".to_owned()
    } else {
        said
    }))
}
