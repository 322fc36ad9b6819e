//! The wire formats between the controller and its node agents.
//!
//! Every message is one line of JSON (an object with a `"type"` field),
//! at most [`LINE_BYTES_MAX`](crate::codec::LINE_BYTES_MAX) long including
//! the newline, read and written with [`crate::codec`]. There are three
//! channels:
//!
//! 1. **Announcement** — the agent's standard output. Its first line is an
//!    [`AgentAnnouncement::Listening`] naming the loopback address of its
//!    control listener; that address is the node's endpoint.
//! 2. **Control** — a TCP connection from the controller to the agent's
//!    endpoint, one per bootstrap session. The controller sends a
//!    [`ControlRequest::Boot`]; the agent answers [`ControlReply::Accepted`]
//!    (or [`ControlReply::Refused`]) and then streams progress. When the
//!    agent reports [`ProgressStage::WaitingForJoin`], the controller answers
//!    [`ControlRequest::Join`] and the agent joins the swarm. After the join,
//!    [`ControlRequest::Close`] ends the session; the agent keeps running.
//!    The controller closing the connection before the join cancels the boot
//!    ([`ControlRequest::Cancel`] says so explicitly; a detached agent treats
//!    a bare hang-up after its workload started as its controller's death,
//!    not as a cancel, and keeps the workload).
//!
//!    **Resume.** A detached agent that already booted answers a later boot
//!    order for its own key with [`ControlReply::Resumed`] instead of
//!    [`ControlReply::Accepted`], provided the order carries the credential
//!    of its first order (which only a holder of the run secret can
//!    compute). It then reports [`ProgressStage::WaitingForJoin`], and on
//!    [`ControlRequest::Join`] joins the swarm at the order's (new) address
//!    with its original credential, swarm and labels; its workload is not
//!    restarted. A restarted controller learns a detached agent's endpoint
//!    from `/proc`, so the new swarm address and the credential travel only
//!    over this loopback connection, never on a command line or in a log.
//! 3. **Swarm** — a TCP connection from the agent to the controller's swarm
//!    listener. The agent sends a [`SwarmHello`] with its key and credential;
//!    the controller answers [`SwarmReply::Welcome`] or
//!    [`SwarmReply::Rejected`]. A welcomed agent keeps the connection open for
//!    its whole life and may send [`SwarmNotice`]s; its end is the agent's
//!    loss. The controller sends [`SwarmPush`]es on it: the run's membership
//!    ([`PeersUpdate`]) right after the welcome and whenever it changes.
//!    These lines may be up to [`PEERS_LINE_BYTES_MAX`] long.
//!
//! A malformed or oversized line is rejected with a log line and ends the
//! connection; nothing else on either side changes.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

/// The protocol version both sides must speak.
pub const PROTOCOL_VERSION: u32 = 1;

/// The first line an agent prints on its standard output.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum AgentAnnouncement {
    /// The agent accepts control connections at `address`.
    Listening {
        /// A loopback address.
        address: SocketAddr,
        /// The agent's process id, for logs.
        pid: u32,
    },
}

/// What the agent needs to boot: the group's boot parameters and how to join.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BootOrder {
    /// Must equal [`PROTOCOL_VERSION`].
    pub protocol: u32,
    /// The run the agent belongs to; must match its own tag.
    pub run: String,
    /// The slot, `{group}-{index}`; must match the agent's tag.
    pub node: String,
    /// The attempt; must match the agent's tag.
    pub attempt: u64,
    /// The user commands run as; empty means the agent's own user.
    pub user: String,
    /// Commands that must all exit with status 0 before the workload starts.
    pub verify_commands: Vec<String>,
    /// The workload; empty means the agent alone is the workload.
    pub start_command: String,
    /// Environment for verify and start commands.
    pub env: BTreeMap<String, String>,
    /// Positional arguments given to the start command (`$1`, `$2`, …).
    pub args: Vec<String>,
    /// How to join the run's swarm.
    pub join: JoinOrder,
    /// The desired size of the node's group when the order was made
    /// (`PROVISION_GROUP_SIZE`); absent from controllers before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_size: Option<u32>,
    /// The node's address as its peers reach it (`PROVISION_ADDRESS`): the
    /// host part of its endpoint ([`address_of_endpoint`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    /// A command run after each rewrite of the peers file, with the
    /// workload's environment; empty means none.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub on_peers_change: String,
    /// Only resume an agent that already booted (its workload runs): a
    /// restarted controller re-attaching the agents it found. An agent
    /// that has not booted refuses such an order instead of booting.
    #[serde(default)]
    pub resume_only: bool,
}

/// Where and how an agent joins the swarm.
///
/// `Debug` never shows the credential.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JoinOrder {
    /// The controller's swarm listener (loopback).
    pub address: SocketAddr,
    /// The node's credential, hex.
    pub credential: String,
    /// The swarm within the run.
    pub swarm: String,
    /// Labels announced on join.
    pub labels: BTreeMap<String, String>,
}

impl std::fmt::Debug for JoinOrder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JoinOrder")
            .field("address", &self.address)
            .field("credential", &"..")
            .field("swarm", &self.swarm)
            .field("labels", &self.labels)
            .finish()
    }
}

/// Controller → agent, on a control connection.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ControlRequest {
    /// Boot with these parameters. Accepted once per agent lifetime.
    Boot(Box<BootOrder>),
    /// Go ahead and join the swarm (answers [`ProgressStage::WaitingForJoin`]).
    Join,
    /// The session is over; the agent keeps running.
    Close,
    /// The controller abandons the boot: the agent stops its commands.
    Cancel,
}

/// A bootstrap stage the agent reports as it enters it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProgressStage {
    /// Running the verify commands.
    BootChecking,
    /// Starting the workload.
    AgentStarting,
    /// Ready to join; waiting for the controller's go-ahead.
    WaitingForJoin,
}

impl ProgressStage {
    /// The stage in words, for logs.
    pub fn describe(self) -> &'static str {
        match self {
            ProgressStage::BootChecking => "running the verify commands",
            ProgressStage::AgentStarting => "starting the workload",
            ProgressStage::WaitingForJoin => "waiting for the go-ahead to join",
        }
    }
}

/// The stage at which a boot failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureStage {
    /// A verify command failed.
    BootCheck,
    /// The workload could not be started.
    Start,
    /// Joining the swarm failed.
    Join,
}

impl FailureStage {
    /// The stage in words, for logs.
    pub fn describe(self) -> &'static str {
        match self {
            FailureStage::BootCheck => "a verify command",
            FailureStage::Start => "the workload start",
            FailureStage::Join => "the join",
        }
    }
}

/// Agent → controller, on a control connection.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ControlReply {
    /// The boot order was taken; progress follows.
    Accepted,
    /// The agent had booted already and resumes: its workload runs on, it
    /// waits for the go-ahead to join the swarm at the order's address.
    Resumed,
    /// The boot order was refused; nothing was started.
    Refused {
        /// Why.
        reason: String,
    },
    /// The agent entered a stage.
    Progress {
        /// The stage.
        stage: ProgressStage,
    },
    /// The boot failed; the agent stays up but does nothing more.
    Failed {
        /// Where it failed.
        stage: FailureStage,
        /// What went wrong, for operators.
        detail: String,
    },
    /// The swarm welcomed the agent.
    Joined,
}

/// Agent → controller: the first line on a swarm connection.
///
/// `Debug` never shows the credential.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename = "hello")]
pub struct SwarmHello {
    /// Must equal [`PROTOCOL_VERSION`].
    pub protocol: u32,
    /// The run the agent claims.
    pub run: String,
    /// The slot the agent claims.
    pub node: String,
    /// The attempt the agent claims.
    pub attempt: u64,
    /// The credential for that key, hex.
    pub credential: String,
    /// The swarm within the run.
    pub swarm: String,
    /// Labels the agent announces.
    pub labels: BTreeMap<String, String>,
}

impl std::fmt::Debug for SwarmHello {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SwarmHello")
            .field("protocol", &self.protocol)
            .field("run", &self.run)
            .field("node", &self.node)
            .field("attempt", &self.attempt)
            .field("credential", &"..")
            .field("swarm", &self.swarm)
            .field("labels", &self.labels)
            .finish()
    }
}

/// Controller → agent: the answer to a [`SwarmHello`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum SwarmReply {
    /// The agent is a member of the swarm from now on.
    Welcome,
    /// The hello was refused; the controller closes the connection.
    Rejected {
        /// Why, in general terms (no secret material).
        reason: String,
    },
}

/// Agent → controller: informational messages on a welcomed swarm connection.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum SwarmNotice {
    /// The workload exited.
    WorkloadExited {
        /// Its exit code, when it exited normally.
        code: Option<i32>,
        /// The signal that ended it, when one did.
        signal: Option<i32>,
    },
}

/// The longest line of a [`SwarmPush`]: a membership lists every ready
/// node of the run, so it may be far longer than other messages.
pub const PEERS_LINE_BYTES_MAX: usize = 16 * 1024 * 1024;

/// Controller → agent: what the controller sends on a welcomed swarm
/// connection.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum SwarmPush {
    /// The run's membership as the controller held it when it sent it.
    Peers(PeersUpdate),
    /// A message of a newer controller this agent does not know: ignored,
    /// so that new kinds of pushes never cost an older agent its node.
    #[serde(other)]
    Unknown,
}

/// The run's membership: its ready nodes, and every group's desired size.
/// This is also the JSON of the peers file.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeersUpdate {
    /// Grows with every change; an agent ignores an update older than the
    /// one it wrote.
    pub version: u64,
    /// Every desired group's desired node count.
    pub groups: BTreeMap<String, u32>,
    /// The ready nodes, in slot order (group, then index).
    pub peers: Vec<Peer>,
}

/// One ready node of the run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Peer {
    /// Its group.
    pub group: String,
    /// Its slot index in the group (0-based, the same across replacements).
    pub index: u32,
    /// Its slot, `{group}-{index}`.
    pub node: String,
    /// Its current attempt.
    pub attempt: u64,
    /// Where its peers reach it (the host part of its endpoint).
    pub address: String,
    /// When it became ready, in milliseconds on the controller's clock
    /// (since the controller started).
    pub ready_since_ms: u64,
}

impl PeersUpdate {
    /// The update that carries `membership`.
    pub fn from_membership(membership: &provisioning::Membership) -> Self {
        PeersUpdate {
            version: membership.version,
            groups: membership
                .group_sizes
                .iter()
                .map(|(group, size)| (group.to_string(), *size))
                .collect(),
            peers: membership
                .members
                .iter()
                .map(|member| Peer {
                    group: member.node.group().to_string(),
                    index: member.node.index(),
                    node: member.node.to_string(),
                    attempt: member.attempt.get(),
                    address: address_of_endpoint(&member.endpoint.0),
                    ready_since_ms: member.ready_since.as_millis(),
                })
                .collect(),
        }
    }
}

/// A node's address as its peers reach it, from its endpoint: its host.
/// An endpoint may be `host:port` (local processes), or a URL such as
/// `ssh://user@host:port` (SSH) or `slurm://node/job` (Slurm): the scheme,
/// user, path and port are dropped, and the brackets of an IPv6 address.
pub fn address_of_endpoint(endpoint: &str) -> String {
    if let Ok(socket) = endpoint.parse::<SocketAddr>() {
        return socket.ip().to_string();
    }
    let rest = endpoint
        .split_once("://")
        .map_or(endpoint, |(_, rest)| rest);
    let rest = rest.split('/').next().unwrap_or(rest);
    let host_port = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
    if let Some(bracketed) = host_port.strip_prefix('[') {
        return bracketed
            .split_once(']')
            .map_or(bracketed, |(host, _)| host)
            .to_owned();
    }
    match host_port.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') && port.parse::<u16>().is_ok() => host.to_owned(),
        _ => host_port.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use serde::de::DeserializeOwned;

    use super::*;
    use crate::codec::{CodecError, LINE_BYTES_MAX, MessageReader, encode_message};

    async fn read_all<T: DeserializeOwned>(input: &[u8]) -> Vec<Result<Option<T>, String>> {
        let mut reader = MessageReader::<T, _>::new(input);
        let mut out = Vec::new();
        for _ in 0..8 {
            let result = reader.next().await.map_err(|e| e.to_string());
            let stop = !matches!(result, Ok(Some(_)));
            out.push(result);
            if stop {
                break;
            }
        }
        out
    }

    #[tokio::test]
    async fn messages_round_trip_as_tagged_json_lines() {
        let reply = ControlReply::Failed {
            stage: FailureStage::BootCheck,
            detail: "exit 3".into(),
        };
        let line = encode_message(&reply).unwrap();
        assert_eq!(
            String::from_utf8(line.clone()).unwrap(),
            "{\"type\":\"failed\",\"stage\":\"boot_check\",\"detail\":\"exit 3\"}\n"
        );
        assert_eq!(
            read_all::<ControlReply>(&line).await,
            vec![Ok(Some(reply)), Ok(None)]
        );
        let hello: SwarmHello = serde_json::from_str(
            r#"{"type":"hello","protocol":1,"run":"r","node":"g-0","attempt":2,
                "credential":"00","swarm":"s","labels":{}}"#,
        )
        .unwrap();
        assert_eq!(hello.attempt, 2);
    }

    #[tokio::test]
    async fn malformed_truncated_and_oversized_lines_are_errors() {
        assert_eq!(
            read_all::<ControlReply>(b"{\"type\":\"nonsense\"}\n").await[0]
                .as_ref()
                .unwrap_err()
                .split(':')
                .next(),
            Some("malformed message")
        );
        assert_eq!(
            read_all::<ControlReply>(b"{\"type\":\"accepted\"}").await,
            vec![Err("connection closed in the middle of a line".to_owned())]
        );
        let long = vec![b'x'; LINE_BYTES_MAX + 10];
        assert_eq!(
            read_all::<ControlReply>(&long).await,
            vec![Err(format!("line longer than {LINE_BYTES_MAX} bytes"))]
        );
    }

    #[test]
    fn an_address_is_the_host_part_of_an_endpoint() {
        assert_eq!(address_of_endpoint("127.1.0.3:4000"), "127.1.0.3");
        assert_eq!(address_of_endpoint("[::1]:4000"), "::1");
        assert_eq!(address_of_endpoint("node7"), "node7");
        assert_eq!(address_of_endpoint("host.example:22"), "host.example");
        assert_eq!(address_of_endpoint("fe80::1"), "fe80::1");
        assert_eq!(address_of_endpoint("ssh://me@10.0.0.7:22"), "10.0.0.7");
        assert_eq!(address_of_endpoint("ssh://me@[fd00::7]:2222"), "fd00::7");
        assert_eq!(address_of_endpoint("slurm://node3/4711"), "node3");
    }

    #[test]
    fn a_peers_push_is_a_tagged_json_line() {
        let push = SwarmPush::Peers(PeersUpdate {
            version: 3,
            groups: BTreeMap::from([("web".to_owned(), 1)]),
            peers: vec![Peer {
                group: "web".into(),
                index: 0,
                node: "web-0".into(),
                attempt: 4,
                address: "127.1.0.1".into(),
                ready_since_ms: 12,
            }],
        });
        let line = String::from_utf8(encode_message(&push).unwrap()).unwrap();
        assert!(
            line.starts_with("{\"type\":\"peers\",\"version\":3,"),
            "{line}"
        );
        assert_eq!(serde_json::from_str::<SwarmPush>(&line).unwrap(), push);
        assert_eq!(
            serde_json::from_str::<SwarmPush>(r#"{"type":"news","x":1}"#).unwrap(),
            SwarmPush::Unknown
        );
    }

    #[test]
    fn encoding_refuses_oversized_messages() {
        let reply = ControlReply::Refused {
            reason: "x".repeat(LINE_BYTES_MAX),
        };
        assert!(matches!(
            encode_message(&reply),
            Err(CodecError::LineTooLong(_))
        ));
    }
}
