//! Whether a host answers again after a call to it failed to connect.
//!
//! A call to a host that is cut off costs a whole `ConnectTimeout`, and a
//! connection that `ssh` opened while the host was cut off often stays dead
//! after the link comes back (its SYNs go out on the route that was taken
//! while the host's own route was gone, or are retransmitted seconds
//! apart). A cleanup retried against a partitioned host could therefore
//! miss a heal by a whole call plus the cleanup backoff.
//!
//! So once a call to a host failed to connect, the next calls first probe
//! the host's address with fresh TCP connections, at most [`PROBE_EVERY`]
//! apart, for up to the connect timeout, and call `ssh` as soon as one is
//! greeted by the SSH server (a bare connection proves nothing: a proxy or
//! firewall on the way may accept it): a heal is seen within about a second. When no probe connects,
//! the call fails as `ssh` would have (nothing ran) without running `ssh`,
//! except for every [`SSH_EVERY`]-th such call, which runs `ssh` anyway:
//! the probe is an accelerator, never a gate. A host that `ssh` reaches
//! while its address does not answer TCP (a `ProxyJump` or a `HostName`
//! alias in the user's ssh config) is marked blind and never probed again.

use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::time::Instant;

/// The longest a single probe waits for its connection, and the spacing of
/// probes: a heal is seen within about this long.
pub(crate) const PROBE_EVERY: Duration = Duration::from_secs(1);

/// Every how many calls that found no probe answering `ssh` runs anyway.
pub(crate) const SSH_EVERY: u32 = 3;

/// What the plugin knows of one host's reachability.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Reach {
    /// The last call to the host failed to connect.
    unreachable: bool,
    /// Probes of the host's address say nothing of `ssh`'s reach.
    blind: bool,
    /// Calls answered by a failed probe since the last `ssh` run.
    skipped: u32,
}

/// What a call does before running `ssh`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Gate {
    /// Run `ssh`: the host was not known to be cut off.
    Call,
    /// Probe first.
    Probe,
}

/// What the probes decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Probed {
    /// A probe connected (or was refused: the host answers): run `ssh`.
    Answered,
    /// No probe connected; run `ssh` anyway (every `SSH_EVERY`-th time).
    SilentButCall,
    /// No probe connected: fail without running `ssh`.
    Silent,
}

impl Reach {
    pub(crate) fn gate(&self) -> Gate {
        if self.unreachable && !self.blind {
            Gate::Probe
        } else {
            Gate::Call
        }
    }

    /// Records probes that found no answer; whether `ssh` runs anyway.
    pub(crate) fn silent(&mut self) -> Probed {
        self.skipped += 1;
        if self.skipped >= SSH_EVERY {
            self.skipped = 0;
            Probed::SilentButCall
        } else {
            Probed::Silent
        }
    }

    /// Records how an `ssh` run went: `connected` when it reached the host
    /// (whatever the script did), after probes that found `probed`.
    pub(crate) fn called(&mut self, connected: bool, probed: Option<Probed>) {
        if connected {
            if probed == Some(Probed::SilentButCall) {
                self.blind = true;
            }
            self.unreachable = false;
            self.skipped = 0;
        } else {
            self.unreachable = true;
        }
    }
}

/// Probes `address:port` with fresh connections for up to `window`:
/// whether one was greeted by an SSH server, or was refused (the host
/// answers, `ssh` will say the rest).
pub(crate) async fn answers(address: &str, port: u16, window: Duration) -> bool {
    let deadline = Instant::now() + window;
    loop {
        let started = Instant::now();
        let left = deadline.saturating_duration_since(started);
        if left.is_zero() {
            return false;
        }
        let wait = left.min(PROBE_EVERY);
        match tokio::time::timeout(wait, greeting(address, port)).await {
            Ok(Ok(true)) => return true,
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => return true,
            // Unreachable, no route, a name that does not resolve, a
            // middlebox that accepts the connection but is not the host, or
            // no answer yet: try a fresh connection, a probe's spacing later.
            Ok(Ok(false) | Err(_)) | Err(_) => {}
        }
        tokio::time::sleep_until((started + PROBE_EVERY).min(deadline)).await;
    }
}

/// Connects and reads the server's greeting: whether it is an SSH
/// identification string. Only a greeting shows the host itself answered:
/// a connection alone may have been accepted by a proxy or a firewall on
/// the way.
async fn greeting(address: &str, port: u16) -> std::io::Result<bool> {
    let mut stream = TcpStream::connect((address, port)).await?;
    let mut seen = Vec::with_capacity(GREETING_MAX);
    let mut buffer = [0_u8; 256];
    while seen.len() < GREETING_MAX {
        let n = stream.read(&mut buffer).await?;
        if n == 0 {
            return Ok(false);
        }
        seen.extend_from_slice(&buffer[..n]);
        if seen.windows(4).any(|w| w == b"SSH-") {
            return Ok(true);
        }
    }
    Ok(false)
}

/// How much of a greeting is read looking for `SSH-` (a server may send
/// other lines before its identification string).
const GREETING_MAX: usize = 1024;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_is_probed_only_after_a_call_failed_to_connect_and_until_one_connects() {
        let mut reach = Reach::default();
        assert_eq!(reach.gate(), Gate::Call);
        reach.called(false, None);
        assert_eq!(reach.gate(), Gate::Probe);
        reach.called(true, Some(Probed::Answered));
        assert_eq!(reach.gate(), Gate::Call);
    }

    #[test]
    fn every_third_silent_probe_runs_ssh_and_a_host_ssh_reaches_anyway_is_never_probed_again() {
        let mut reach = Reach::default();
        reach.called(false, None);
        assert_eq!(reach.silent(), Probed::Silent);
        assert_eq!(reach.silent(), Probed::Silent);
        assert_eq!(reach.silent(), Probed::SilentButCall);
        // ssh failed too: still probed.
        reach.called(false, Some(Probed::SilentButCall));
        assert_eq!(reach.gate(), Gate::Probe);
        assert_eq!(reach.silent(), Probed::Silent);
        assert_eq!(reach.silent(), Probed::Silent);
        assert_eq!(reach.silent(), Probed::SilentButCall);
        // ssh got through where no probe did: probes are blind here.
        reach.called(true, Some(Probed::SilentButCall));
        reach.called(false, None);
        assert_eq!(reach.gate(), Gate::Call);
    }

    #[tokio::test]
    async fn a_greeting_or_refusing_loopback_port_answers_a_silent_one_does_not() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let greet = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let server = tokio::spawn({
            let greet = greet.clone();
            async move {
                use tokio::io::AsyncWriteExt;
                let mut held = Vec::new();
                while let Ok((mut stream, _)) = listener.accept().await {
                    if greet.load(std::sync::atomic::Ordering::SeqCst) {
                        let _ = stream.write_all(b"a banner line\r\nSSH-2.0-test\r\n").await;
                    }
                    // Held open: a silent peer never closes.
                    held.push(stream);
                }
            }
        });
        // Accepted but silent (a middlebox): not the host.
        assert!(!answers("127.0.0.1", port, Duration::from_millis(1_500)).await);
        greet.store(true, std::sync::atomic::Ordering::SeqCst);
        assert!(answers("127.0.0.1", port, Duration::from_secs(2)).await);
        server.abort();
        let _ = server.await;
        assert!(answers("127.0.0.1", port, Duration::from_secs(2)).await);
        // An empty window probes nothing.
        assert!(!answers("127.0.0.1", port, Duration::ZERO).await);
    }
}
