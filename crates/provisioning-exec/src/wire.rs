//! The wire form of the plugin protocol (`docs/plugin-protocol.md`): request
//! encoding and the decoder of everything a program writes to its stdout.
//! The stdout is cut into bounded lines by the agent's one line codec
//! ([`provisioning_agent::codec::LossyLinesCodec`] bounded by
//! [`MAX_LINE_BYTES`]).
//!
//! Everything here is pure: no I/O, no clock. The decoder never panics; every
//! input, whatever its bytes, is either a [`Message`] or a [`DecodeError`].

use provisioning::observe::{BootstrapEvent, LossCause};
use provisioning::state::{BootstrapFailure, BootstrapProgress};
use provisioning::{GroupId, LogicalNodeId, NodeAttemptId, Observation, RunId};
use provisioning_provider::AttemptKey;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use thiserror::Error;

/// The protocol's name in the handshake.
pub const PROTOCOL: &str = "provisioning-plugin";

/// The protocol version this crate speaks.
pub const PROTOCOL_VERSION: u64 = 1;

/// The longest line accepted from a program, newline excluded.
pub const MAX_LINE_BYTES: usize = 1 << 20;

/// The request id of the handshake.
pub const HANDSHAKE_ID: u64 = 0;

/// An attempt key on the wire.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireKey {
    /// The run.
    pub run: String,
    /// The slot.
    pub node: WireNode,
    /// The attempt.
    pub attempt: u64,
}

/// A slot on the wire.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireNode {
    /// The group.
    pub group: String,
    /// The index in the group.
    pub index: u32,
}

impl WireKey {
    /// The wire form of `key`.
    pub fn of(key: &AttemptKey) -> Self {
        WireKey {
            run: key.run_id.as_str().to_owned(),
            node: WireNode {
                group: key.node.group().as_str().to_owned(),
                index: key.node.index(),
            },
            attempt: key.attempt.get(),
        }
    }

    /// The attempt key it names.
    pub fn to_key(&self) -> AttemptKey {
        AttemptKey {
            run_id: RunId::new(self.run.as_str()),
            node: LogicalNodeId::new(GroupId::new(self.node.group.as_str()), self.node.index),
            attempt: NodeAttemptId::from_raw(self.attempt),
        }
    }
}

/// The disposition of an error reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Disposition {
    /// `"definite"`.
    Definite,
    /// `"ambiguous"`.
    Ambiguous,
    /// `"not_found"`.
    NotFound,
}

/// An error reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WireError {
    /// Whether the call may have acted.
    pub disposition: Disposition,
    /// For operators.
    pub message: String,
}

/// One line a program wrote, decoded.
#[derive(Clone, Debug, PartialEq)]
pub enum Message {
    /// The answer to request `id`.
    Reply {
        /// The request's id.
        id: u64,
        /// Its `result`, or its `error`.
        outcome: Result<Value, WireError>,
    },
    /// An unsolicited fact.
    Observation(Observation),
}

/// Why a line is not a [`Message`].
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum DecodeError {
    /// Longer than [`MAX_LINE_BYTES`].
    #[error("line of {0} bytes is longer than the limit of {MAX_LINE_BYTES}")]
    TooLong(usize),
    /// Not JSON (or not UTF-8).
    #[error("not JSON: {0}")]
    NotJson(String),
    /// JSON, but not an object.
    #[error("not a JSON object")]
    NotAnObject,
    /// An object that is neither a reply nor an observation.
    #[error("neither a reply nor an observation: {0}")]
    Unrecognised(String),
    /// A reply to `id` that is not well formed.
    #[error("malformed reply to request {id}: {why}")]
    BadReply {
        /// The request the reply names.
        id: u64,
        /// What is wrong.
        why: String,
    },
    /// An observation that is not well formed.
    #[error("malformed observation: {0}")]
    BadObservation(String),
}

/// Decodes one line (without its newline) a program wrote to stdout.
///
/// # Errors
/// A [`DecodeError`] saying what is wrong; never panics.
pub fn decode_line(line: &[u8]) -> Result<Message, DecodeError> {
    if line.len() > MAX_LINE_BYTES {
        return Err(DecodeError::TooLong(line.len()));
    }
    let value: Value =
        serde_json::from_slice(line).map_err(|e| DecodeError::NotJson(e.to_string()))?;
    let Value::Object(mut object) = value else {
        return Err(DecodeError::NotAnObject);
    };
    if let Some(id) = object.get("id") {
        let Some(id) = id.as_u64() else {
            return Err(DecodeError::Unrecognised(
                "`id` is not a non-negative integer".to_owned(),
            ));
        };
        return decode_reply(id, &mut object);
    }
    if object.contains_key("observation") {
        return decode_observation(Value::Object(object))
            .map(Message::Observation)
            .map_err(DecodeError::BadObservation);
    }
    Err(DecodeError::Unrecognised(
        "an object without `id` or `observation`".to_owned(),
    ))
}

fn decode_reply(id: u64, object: &mut Map<String, Value>) -> Result<Message, DecodeError> {
    let bad = |why: &str| DecodeError::BadReply {
        id,
        why: why.to_owned(),
    };
    match (object.remove("result"), object.remove("error")) {
        (Some(result), None) => Ok(Message::Reply {
            id,
            outcome: Ok(result),
        }),
        (None, Some(error)) => {
            let Value::Object(error) = error else {
                return Err(bad("`error` is not an object"));
            };
            let disposition = match error.get("disposition").and_then(Value::as_str) {
                Some("definite") => Disposition::Definite,
                Some("ambiguous") => Disposition::Ambiguous,
                Some("not_found") => Disposition::NotFound,
                _ => {
                    return Err(bad(
                        "`error.disposition` is not one of \"definite\", \"ambiguous\", \"not_found\"",
                    ));
                }
            };
            let Some(message) = error.get("message").and_then(Value::as_str) else {
                return Err(bad("`error.message` is not a string"));
            };
            Ok(Message::Reply {
                id,
                outcome: Err(WireError {
                    disposition,
                    message: message.to_owned(),
                }),
            })
        }
        (Some(_), Some(_)) => Err(bad("both `result` and `error`")),
        (None, None) => Err(bad("neither `result` nor `error`")),
    }
}

#[derive(Deserialize)]
#[serde(tag = "observation", rename_all = "snake_case")]
enum WireObservation {
    Progress {
        key: WireKey,
        stage: WireStage,
    },
    Joined {
        key: WireKey,
    },
    Converged {
        key: WireKey,
    },
    Closed {
        key: WireKey,
    },
    Failed {
        key: WireKey,
        failure: WireFailure,
        detail: String,
    },
    Lost {
        key: WireKey,
        cause: WireCause,
    },
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum WireStage {
    Created,
    Connecting,
    Connected,
    Streaming,
    BootChecking,
    AgentStarting,
    WaitingForJoin,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum WireFailure {
    ConnectFailed,
    BootCheckFailed,
    StartFailed,
    JoinFailed,
    StreamError,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum WireCause {
    AgentGone,
    LeaseGone,
    WorkloadExited,
}

fn decode_observation(value: Value) -> Result<Observation, String> {
    let observation: WireObservation = serde_json::from_value(value).map_err(|e| e.to_string())?;
    let bootstrap = |key: WireKey, event| {
        let key = key.to_key();
        Observation::Bootstrap {
            node: key.node,
            attempt: key.attempt,
            event,
        }
    };
    Ok(match observation {
        WireObservation::Progress { key, stage } => bootstrap(
            key,
            BootstrapEvent::Progress(match stage {
                WireStage::Created => BootstrapProgress::Created,
                WireStage::Connecting => BootstrapProgress::Connecting,
                WireStage::Connected => BootstrapProgress::Connected,
                WireStage::Streaming => BootstrapProgress::Streaming,
                WireStage::BootChecking => BootstrapProgress::BootChecking,
                WireStage::AgentStarting => BootstrapProgress::AgentStarting,
                WireStage::WaitingForJoin => BootstrapProgress::WaitingForJoin,
            }),
        ),
        WireObservation::Joined { key } => bootstrap(key, BootstrapEvent::Joined),
        WireObservation::Converged { key } => bootstrap(key, BootstrapEvent::Converged),
        WireObservation::Closed { key } => bootstrap(key, BootstrapEvent::Closed),
        WireObservation::Failed {
            key,
            failure,
            detail,
        } => bootstrap(
            key,
            BootstrapEvent::Failed {
                failure: match failure {
                    WireFailure::ConnectFailed => BootstrapFailure::ConnectFailed,
                    WireFailure::BootCheckFailed => BootstrapFailure::BootCheckFailed,
                    WireFailure::StartFailed => BootstrapFailure::StartFailed,
                    WireFailure::JoinFailed => BootstrapFailure::JoinFailed,
                    WireFailure::StreamError => BootstrapFailure::StreamError,
                },
                detail,
            },
        ),
        WireObservation::Lost { key, cause } => {
            let key = key.to_key();
            Observation::NodeLost {
                node: key.node,
                attempt: key.attempt,
                cause: match cause {
                    WireCause::AgentGone => LossCause::AgentGone,
                    WireCause::LeaseGone => LossCause::LeaseGone,
                    WireCause::WorkloadExited => LossCause::WorkloadExited,
                },
            }
        }
    })
}

/// Encodes one request line (with its newline).
pub fn encode_request(id: u64, method: &str, key: Option<&AttemptKey>, args: Value) -> String {
    let mut object = Map::new();
    object.insert("id".to_owned(), Value::from(id));
    object.insert("method".to_owned(), Value::from(method));
    if let Some(key) = key {
        object.insert(
            "key".to_owned(),
            serde_json::to_value(WireKey::of(key)).unwrap_or(Value::Null),
        );
    }
    object.insert("args".to_owned(), args);
    let mut line = Value::Object(object).to_string();
    line.push('\n');
    line
}

/// The program's handshake answer.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct Hello {
    /// Must be [`PROTOCOL`].
    pub protocol: String,
    /// The version spoken.
    pub version: u64,
    /// The program's name.
    pub program: String,
    /// The provider kind it implements.
    pub kind: String,
    /// The faults `inject_fault` can arm.
    #[serde(default)]
    pub faults: Vec<FaultOffer>,
    /// Whether `lose_node` is implemented.
    #[serde(default)]
    pub lose_node: bool,
    /// The battery's test hooks implemented (§6.3): `live`, `emit`,
    /// `release`, `lose_cause`. Unknown names are ignored.
    #[serde(default)]
    pub hooks: Vec<String>,
}

impl Hello {
    /// Whether the program listed hook `name`.
    pub fn has_hook(&self, name: &str) -> bool {
        self.hooks.iter().any(|hook| hook == name)
    }

    /// Whether `inject_fault` can arm `fault` for `method`.
    pub fn offers_fault(&self, method: &str, fault: &str) -> bool {
        self.faults
            .iter()
            .any(|offer| offer.method == method && offer.fault == fault)
    }
}

/// One fault a program can arm.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct FaultOffer {
    /// The method name.
    pub method: String,
    /// `definite`, `ambiguous_done` or `ambiguous_undone`.
    pub fault: String,
}

/// The `result` of `create_node`.
#[derive(Debug, Deserialize)]
pub(crate) struct CreateResult {
    pub(crate) lease: String,
    #[serde(default)]
    pub(crate) endpoint: Option<String>,
    pub(crate) adopted: bool,
}

/// The `result` of `lookup_endpoint`.
#[derive(Debug, Deserialize)]
pub(crate) struct LookupResult {
    pub(crate) ready: bool,
    #[serde(default)]
    pub(crate) endpoint: Option<String>,
}

/// The `result` of `start_bootstrap`.
#[derive(Debug, Deserialize)]
pub(crate) struct StartResult {
    pub(crate) session: String,
    pub(crate) adopted: bool,
}

/// The `result` of `list_nodes`.
#[derive(Debug, Deserialize)]
pub(crate) struct ListResult {
    pub(crate) nodes: Vec<ListedWire>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct ListedWire {
    pub(crate) key: WireKey,
    pub(crate) lease: String,
}

/// The `result` of `lose_node` (the test hooks' replies are read only by
/// the kit's side of the crate).
#[cfg(feature = "kit")]
#[derive(Debug, Deserialize)]
pub(crate) struct LoseResult {
    pub(crate) lost: bool,
}

/// The `result` of the `live` hook.
#[cfg(feature = "kit")]
#[derive(Debug, Deserialize)]
pub(crate) struct LiveResult {
    pub(crate) leases: Vec<LiveLease>,
    pub(crate) sessions: Vec<LiveSession>,
}

#[cfg(feature = "kit")]
#[derive(Debug, Deserialize)]
pub(crate) struct LiveLease {
    pub(crate) key: WireKey,
    pub(crate) lease: String,
}

#[cfg(feature = "kit")]
#[derive(Debug, Deserialize)]
pub(crate) struct LiveSession {
    pub(crate) key: WireKey,
    pub(crate) session: String,
    pub(crate) joined: bool,
}

/// The `result` of the `emit` hook.
#[cfg(feature = "kit")]
#[derive(Debug, Deserialize)]
pub(crate) struct EmitResult {
    pub(crate) emitted: bool,
}

/// The `result` of the `release` hook.
#[cfg(feature = "kit")]
#[derive(Debug, Deserialize)]
pub(crate) struct ReleaseResult {
    pub(crate) released: u64,
}

/// Decodes a `result` into the method's shape.
pub(crate) fn decode_result<T: serde::de::DeserializeOwned>(value: Value) -> Result<T, String> {
    serde_json::from_value(value).map_err(|e| e.to_string())
}

/// Whether an empty result (`{}` or `null`, any object) is well formed.
pub(crate) fn is_empty_result(value: &Value) -> bool {
    matches!(value, Value::Object(_) | Value::Null)
}

#[cfg(test)]
mod tests {
    use provisioning_agent::codec::{LossyLine, LossyLinesCodec};
    use provisioning_conformance::SplitMix64;
    use tokio_util::bytes::BytesMut;
    use tokio_util::codec::Decoder;

    use super::*;

    const VALID: &[&str] = &[
        r#"{"id":3,"result":{"lease":"l","endpoint":null,"adopted":false}}"#,
        r#"{"id":4,"error":{"disposition":"ambiguous","message":"m"}}"#,
        r#"{"observation":"progress","key":{"run":"r","node":{"group":"g","index":1},"attempt":2},"stage":"connecting"}"#,
        r#"{"observation":"failed","key":{"run":"r","node":{"group":"g","index":1},"attempt":2},"failure":"join_failed","detail":"d"}"#,
        r#"{"observation":"lost","key":{"run":"r","node":{"group":"g","index":1},"attempt":2},"cause":"lease_gone"}"#,
        r#"{"observation":"lost","key":{"run":"r","node":{"group":"g","index":1},"attempt":2},"cause":"workload_exited"}"#,
    ];

    #[test]
    fn decoding_random_bytes_never_panics_and_yields_a_typed_answer() {
        let mut rng = SplitMix64::new(0x5eed_f0e8);
        for _ in 0..20_000 {
            let len = rng.below(200) as usize;
            let bytes: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
            // Either answer is fine; a panic fails the test.
            let _typed: Result<Message, DecodeError> = decode_line(&bytes);
        }
    }

    #[test]
    fn decoding_mutated_valid_lines_never_panics_and_yields_a_typed_answer() {
        let mut rng = SplitMix64::new(0xdec0de);
        let alphabet = b"{}[]\":,0123456789-.eEtrufalsn \\u";
        for _ in 0..20_000 {
            let base = VALID[rng.below(VALID.len() as u64) as usize];
            let mut bytes = base.as_bytes().to_vec();
            for _ in 0..=rng.below(4) {
                let at = rng.below(bytes.len() as u64 + 1) as usize;
                match rng.below(3) {
                    0 if at < bytes.len() => {
                        bytes.remove(at);
                    }
                    1 => bytes.insert(at, alphabet[rng.below(alphabet.len() as u64) as usize]),
                    _ if at < bytes.len() => bytes[at] = rng.next_u64() as u8,
                    _ => {}
                }
            }
            let _typed: Result<Message, DecodeError> = decode_line(&bytes);
        }
    }

    /// Feeds every chunk to `codec`, appending the lines it completes to
    /// `out`.
    fn feed(
        codec: &mut LossyLinesCodec,
        buf: &mut BytesMut,
        chunk: &[u8],
        out: &mut Vec<LossyLine>,
    ) {
        buf.extend_from_slice(chunk);
        while let Some(line) = codec.decode(buf).unwrap() {
            out.push(line);
        }
    }

    #[test]
    fn splitting_random_chunks_never_panics_and_keeps_lines_within_the_limit() {
        let mut rng = SplitMix64::new(0x11ae);
        let mut codec = LossyLinesCodec::new(MAX_LINE_BYTES);
        let mut buf = BytesMut::new();
        let mut out = Vec::new();
        for _ in 0..2_000 {
            let len = rng.below(64) as usize;
            let chunk: Vec<u8> = (0..len)
                .map(|_| {
                    if rng.chance(100) {
                        b'\n'
                    } else {
                        rng.next_u64() as u8
                    }
                })
                .collect();
            feed(&mut codec, &mut buf, &chunk, &mut out);
        }
        while let Some(line) = codec.decode_eof(&mut buf).unwrap() {
            out.push(line);
        }
        assert!(out.iter().all(|line| match line {
            LossyLine::Text(text) => text.len() <= MAX_LINE_BYTES && !text.contains(&b'\n'),
            LossyLine::TooLong(_) => true,
        }));
    }

    #[test]
    fn a_line_longer_than_the_limit_is_reported_too_long_and_the_next_line_survives() {
        let mut codec = LossyLinesCodec::new(MAX_LINE_BYTES);
        let mut buf = BytesMut::new();
        let mut out = Vec::new();
        let long = vec![b'x'; MAX_LINE_BYTES + 10];
        for chunk in long.chunks(4096) {
            feed(&mut codec, &mut buf, chunk, &mut out);
        }
        feed(
            &mut codec,
            &mut buf,
            b"\n{\"id\":1,\"result\":{}}\r\n",
            &mut out,
        );
        assert_eq!(out.len(), 2);
        assert_eq!(out[0], LossyLine::TooLong(MAX_LINE_BYTES + 10));
        assert_eq!(
            out[1],
            LossyLine::Text(b"{\"id\":1,\"result\":{}}".to_vec())
        );
        assert_eq!(
            decode_line(&vec![b' '; MAX_LINE_BYTES + 1]),
            Err(DecodeError::TooLong(MAX_LINE_BYTES + 1))
        );
    }

    #[test]
    fn every_documented_message_decodes() {
        for line in VALID {
            assert!(decode_line(line.as_bytes()).is_ok(), "{line}");
        }
        assert_eq!(
            decode_line(br#"{"id":4,"error":{"disposition":"not_found","message":"gone"}}"#),
            Ok(Message::Reply {
                id: 4,
                outcome: Err(WireError {
                    disposition: Disposition::NotFound,
                    message: "gone".to_owned()
                })
            })
        );
    }

    #[test]
    fn a_reply_with_an_unknown_disposition_is_a_malformed_reply_to_its_id() {
        let decoded = decode_line(br#"{"id":9,"error":{"disposition":"maybe","message":"m"}}"#);
        assert!(
            matches!(decoded, Err(DecodeError::BadReply { id: 9, .. })),
            "{decoded:?}"
        );
        let both = decode_line(br#"{"id":9,"result":{},"error":{}}"#);
        assert!(
            matches!(both, Err(DecodeError::BadReply { id: 9, .. })),
            "{both:?}"
        );
    }

    #[test]
    fn a_key_survives_the_round_trip_through_the_wire() {
        let key = AttemptKey {
            run_id: RunId::new("run-1"),
            node: LogicalNodeId::new(GroupId::new("web-a"), 7),
            attempt: NodeAttemptId::from_raw(42),
        };
        let wire = WireKey::of(&key);
        let text = serde_json::to_string(&wire).unwrap();
        let back: WireKey = serde_json::from_str(&text).unwrap();
        assert_eq!(back.to_key(), key);
        let line = encode_request(
            5,
            "destroy_node",
            Some(&key),
            serde_json::json!({"lease":"l"}),
        );
        assert!(line.ends_with('\n') && !line[..line.len() - 1].contains('\n'));
    }
}
