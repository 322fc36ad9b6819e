//! The per-run secret and the per-node swarm credentials derived from it.
//!
//! The controller holds one [`RunSecret`] per run. Each node attempt gets a
//! [`NodeCredential`]: an HMAC-SHA256 of the secret over the run id, the node
//! id and the attempt. An agent presents its credential when it joins the
//! swarm; the controller recomputes it for the key the agent claims and
//! compares in constant time. A credential therefore proves one exact
//! `(run, node, attempt)` and nothing else: it cannot be replayed for another
//! node, another attempt or another run.

use std::fmt;
use std::io::Read;

use hmac::{Hmac, KeyInit, Mac};
use provisioning_provider::AttemptKey;
use sha2::Sha256;

/// The length of a run secret, in bytes.
pub const RUN_SECRET_LEN: usize = 32;

/// The length of a node credential, in bytes (one SHA-256 output).
pub const CREDENTIAL_LEN: usize = 32;

/// A domain-separation prefix, so that the same secret used for another
/// purpose later can never produce a valid join credential by accident.
const CREDENTIAL_DOMAIN: &[u8] = b"provisioning/swarm-join/v1";

type HmacSha256 = Hmac<Sha256>;

/// The secret of one run. Node credentials derive from it.
///
/// `Debug` never shows the bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct RunSecret([u8; RUN_SECRET_LEN]);

impl fmt::Debug for RunSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RunSecret(..)")
    }
}

impl RunSecret {
    /// A fresh secret from the operating system's random source.
    ///
    /// # Panics
    /// When `/dev/urandom` cannot be read, which on Linux means the system
    /// is unusable. Use [`RunSecret::try_generate`] to handle that case.
    pub fn generate() -> Self {
        match RunSecret::try_generate() {
            Ok(secret) => secret,
            Err(error) => panic!("cannot read the operating system's random source: {error}"),
        }
    }

    /// A fresh secret from `/dev/urandom`.
    ///
    /// # Errors
    /// The I/O error when the random source cannot be opened or read.
    pub fn try_generate() -> std::io::Result<Self> {
        let mut bytes = [0_u8; RUN_SECRET_LEN];
        std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
        Ok(RunSecret(bytes))
    }

    /// A secret with the given bytes (tests, or a secret kept elsewhere).
    pub fn from_bytes(bytes: [u8; RUN_SECRET_LEN]) -> Self {
        RunSecret(bytes)
    }

    fn mac_for(&self, key: &AttemptKey) -> HmacSha256 {
        // HMAC pads a short key with zeros to the hash's block size; doing
        // the padding here uses the infallible constructor.
        let mut padded = hmac::digest::Key::<HmacSha256>::default();
        padded[..RUN_SECRET_LEN].copy_from_slice(&self.0);
        let mut mac = HmacSha256::new(&padded);
        // Every field is length-prefixed so that no two keys share an input.
        let attempt = key.attempt.get().to_string();
        for field in [
            CREDENTIAL_DOMAIN,
            key.run_id.as_str().as_bytes(),
            key.node.to_string().as_bytes(),
            attempt.as_bytes(),
        ] {
            mac.update(&(field.len() as u64).to_be_bytes());
            mac.update(field);
        }
        mac
    }

    /// The credential of `key` under this secret.
    pub fn credential(&self, key: &AttemptKey) -> NodeCredential {
        let bytes = self.mac_for(key).finalize().into_bytes();
        let mut credential = [0_u8; CREDENTIAL_LEN];
        credential.copy_from_slice(&bytes);
        NodeCredential(credential)
    }

    /// Whether `presented` is the credential of `key`, compared in constant time.
    pub fn verify(&self, key: &AttemptKey, presented: &NodeCredential) -> bool {
        self.mac_for(key).verify_slice(&presented.0).is_ok()
    }
}

/// The swarm-join credential of one node attempt.
///
/// `Debug` never shows the bytes; [`NodeCredential::to_hex`] is the wire form.
#[derive(Clone, PartialEq, Eq)]
pub struct NodeCredential([u8; CREDENTIAL_LEN]);

impl fmt::Debug for NodeCredential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("NodeCredential(..)")
    }
}

impl NodeCredential {
    /// A credential with the given bytes (for example a forged one in a test).
    pub fn from_bytes(bytes: [u8; CREDENTIAL_LEN]) -> Self {
        NodeCredential(bytes)
    }

    /// The lower-case hex form used on the wire.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Parses the hex wire form; `None` unless it is exactly
    /// [`CREDENTIAL_LEN`] bytes of valid hex.
    pub fn from_hex(text: &str) -> Option<Self> {
        let mut bytes = [0_u8; CREDENTIAL_LEN];
        hex::decode_to_slice(text, &mut bytes).ok()?;
        Some(NodeCredential(bytes))
    }
}

#[cfg(test)]
mod tests {
    use provisioning::{GroupId, LogicalNodeId, NodeAttemptId, RunId};

    use super::*;

    fn key(run: &str, group: &str, index: u32, attempt: u64) -> AttemptKey {
        AttemptKey {
            run_id: RunId::new(run),
            node: LogicalNodeId::new(GroupId::new(group), index),
            attempt: NodeAttemptId::from_raw(attempt),
        }
    }

    #[test]
    fn a_credential_verifies_only_for_its_own_key() {
        let secret = RunSecret::from_bytes([7; RUN_SECRET_LEN]);
        let own = key("run", "web", 0, 3);
        let credential = secret.credential(&own);
        assert!(secret.verify(&own, &credential));
        for other in [
            key("run", "web", 1, 3),
            key("run", "web", 0, 4),
            key("other", "web", 0, 3),
            key("run", "web-0", 0, 3),
        ] {
            assert!(!secret.verify(&other, &credential), "{other} accepted");
        }
        let other_secret = RunSecret::from_bytes([8; RUN_SECRET_LEN]);
        assert!(!other_secret.verify(&own, &credential));
    }

    #[test]
    fn the_padded_key_gives_standard_hmac_sha256() {
        // RFC 4231 test case 2: key "Jefe", data "what do ya want for nothing?".
        let mut padded = hmac::digest::Key::<HmacSha256>::default();
        padded[..4].copy_from_slice(b"Jefe");
        let mut mac = HmacSha256::new(&padded);
        mac.update(b"what do ya want for nothing?");
        assert_eq!(
            hex::encode(mac.finalize().into_bytes()),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn length_prefixes_keep_shifted_fields_apart() {
        // Without length prefixes, "ab" + "c-0" and "a" + "bc-0" would feed
        // the same bytes to the MAC.
        let secret = RunSecret::from_bytes([1; RUN_SECRET_LEN]);
        let one = key("ab", "c", 0, 1);
        let two = key("a", "bc", 0, 1);
        assert_ne!(secret.credential(&one), secret.credential(&two));
    }

    #[test]
    fn hex_round_trips_and_rejects_bad_text() {
        let credential = NodeCredential::from_bytes([0xab; CREDENTIAL_LEN]);
        assert_eq!(
            NodeCredential::from_hex(&credential.to_hex()),
            Some(credential)
        );
        assert_eq!(NodeCredential::from_hex("abcd"), None);
        assert_eq!(NodeCredential::from_hex(&"zz".repeat(CREDENTIAL_LEN)), None);
        assert_eq!(NodeCredential::from_hex(""), None);
    }

    #[test]
    fn debug_output_hides_secret_material() {
        let secret = RunSecret::from_bytes([0x5a; RUN_SECRET_LEN]);
        assert_eq!(format!("{secret:?}"), "RunSecret(..)");
        let credential = secret.credential(&key("run", "web", 0, 1));
        assert_eq!(format!("{credential:?}"), "NodeCredential(..)");
    }

    #[test]
    fn generated_secrets_differ() {
        let one = RunSecret::try_generate().expect("random source");
        let two = RunSecret::try_generate().expect("random source");
        assert_ne!(one, two);
    }
}
