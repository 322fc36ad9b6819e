//! [`Ec2Error`]: a failed EC2 call, classified by what it means for the
//! reconciler — whether the call may have acted, and, for a refusal, its
//! reason class (capacity or quota), so `status` and placement can tell a
//! full region from a bad image.

use std::time::Duration;

use provisioning_provider::PluginError;
use thiserror::Error;

/// Why a refusal that changed nothing happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ReasonClass {
    /// The provider has no capacity of that kind there right now
    /// (`InsufficientInstanceCapacity`, `Unsupported`).
    Capacity,
    /// The account's limit is reached (`InstanceLimitExceeded`,
    /// `VcpuLimitExceeded`, `MaxSpotInstanceCountExceeded`).
    Quota,
    /// Anything else the server refused (a bad image, parameters,
    /// credentials).
    Request,
}

impl ReasonClass {
    /// Its name, as messages and `status` show it.
    pub fn as_str(self) -> &'static str {
        match self {
            ReasonClass::Capacity => "capacity",
            ReasonClass::Quota => "quota",
            ReasonClass::Request => "request",
        }
    }
}

/// What kind of failure a call met.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ec2ErrorKind {
    /// The server refused; nothing happened.
    Refused {
        /// The reason class.
        class: ReasonClass,
        /// The API's error code.
        code: String,
    },
    /// Throttled (`RequestLimitExceeded`, `Throttling`): nothing happened,
    /// ask again after a backoff.
    Throttled {
        /// The API's error code.
        code: String,
    },
    /// A 5xx: the server may have acted.
    Server {
        /// The HTTP status.
        status: u16,
        /// The API's error code, when the body had one.
        code: Option<String>,
    },
    /// No reply within the timeout: the call may have acted.
    Timeout,
    /// The connection could not be made: nothing was sent.
    NotConnected,
    /// The exchange broke after the request may have been sent, or the
    /// reply made no sense: the call may have acted.
    Broken,
}

/// A failed EC2 call.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("{detail}")]
pub struct Ec2Error {
    /// The kind.
    pub kind: Ec2ErrorKind,
    /// What happened, for people.
    pub detail: String,
}

/// Codes that mean "no capacity of that kind there".
const CAPACITY_CODES: &[&str] = &[
    "InsufficientInstanceCapacity",
    "InsufficientHostCapacity",
    "InsufficientReservedInstanceCapacity",
    "InsufficientCapacity",
    "Unsupported",
];

/// Codes that mean "the account's limit is reached".
const QUOTA_CODES: &[&str] = &[
    "InstanceLimitExceeded",
    "VcpuLimitExceeded",
    "MaxSpotInstanceCountExceeded",
    "InsufficientFreeAddressesInSubnet",
];

/// Codes of throttling.
const THROTTLE_CODES: &[&str] = &["RequestLimitExceeded", "Throttling", "ThrottlingException"];

impl Ec2Error {
    /// A refusal of class `Request` with `code`.
    pub(crate) fn client(code: &str, detail: impl Into<String>) -> Self {
        Ec2Error {
            kind: Ec2ErrorKind::Refused {
                class: ReasonClass::Request,
                code: code.to_owned(),
            },
            detail: detail.into(),
        }
    }

    /// A broken exchange or a reply that made no sense.
    pub(crate) fn broken(detail: impl Into<String>) -> Self {
        Ec2Error {
            kind: Ec2ErrorKind::Broken,
            detail: detail.into(),
        }
    }

    pub(crate) fn timeout(action: &str, after: Duration) -> Self {
        Ec2Error {
            kind: Ec2ErrorKind::Timeout,
            detail: format!("{action} got no reply within {after:?}"),
        }
    }

    pub(crate) fn from_transport(error: hyper_util::client::legacy::Error) -> Self {
        if error.is_connect() {
            Ec2Error {
                kind: Ec2ErrorKind::NotConnected,
                detail: format!("could not connect to the EC2 endpoint: {error}"),
            }
        } else {
            Ec2Error::broken(format!("the exchange with the EC2 endpoint broke: {error}"))
        }
    }

    /// The error of a reply with HTTP `status` and body `body`.
    pub(crate) fn from_reply(status: u16, body: &str) -> Self {
        let (code, message) = crate::response::error_code(body)
            .unwrap_or_else(|| (String::new(), body.chars().take(200).collect()));
        let detail = format!("{code} (HTTP {status}): {message}");
        let kind = if THROTTLE_CODES.contains(&code.as_str()) || status == 429 {
            Ec2ErrorKind::Throttled { code }
        } else if status >= 500 {
            Ec2ErrorKind::Server {
                status,
                code: (!code.is_empty()).then_some(code),
            }
        } else if CAPACITY_CODES.contains(&code.as_str()) {
            Ec2ErrorKind::Refused {
                class: ReasonClass::Capacity,
                code,
            }
        } else if QUOTA_CODES.contains(&code.as_str()) {
            Ec2ErrorKind::Refused {
                class: ReasonClass::Quota,
                code,
            }
        } else {
            Ec2ErrorKind::Refused {
                class: ReasonClass::Request,
                code,
            }
        };
        Ec2Error { kind, detail }
    }

    /// The API's error code, when the server sent one.
    pub fn code(&self) -> Option<&str> {
        match &self.kind {
            Ec2ErrorKind::Refused { code, .. } | Ec2ErrorKind::Throttled { code } => Some(code),
            Ec2ErrorKind::Server { code, .. } => code.as_deref(),
            _ => None,
        }
    }

    /// Whether the server said the instance does not exist.
    pub fn is_not_found(&self) -> bool {
        self.code().is_some_and(|c| {
            c.starts_with("InvalidInstanceID.NotFound") || c == "InvalidInstanceID.Malformed"
        })
    }

    /// The reason class of a refusal.
    pub fn reason_class(&self) -> Option<ReasonClass> {
        match &self.kind {
            Ec2ErrorKind::Refused { class, .. } => Some(*class),
            _ => None,
        }
    }

    /// Whether the call may have acted on the server.
    pub fn may_have_acted(&self) -> bool {
        matches!(
            self.kind,
            Ec2ErrorKind::Server { .. } | Ec2ErrorKind::Timeout | Ec2ErrorKind::Broken
        )
    }

    /// This failure of `what` as the seam's error. A call that may have
    /// acted is ambiguous; so is throttling of a mutating call, which the
    /// reconciler then re-issues (adopting first) after its backoff rather
    /// than failing the attempt. A refusal is definite and starts with its
    /// reason class in brackets (`[capacity] …`).
    pub fn into_plugin_error(self, what: &str, mutating: bool) -> PluginError {
        match &self.kind {
            Ec2ErrorKind::Refused { class, .. } => {
                PluginError::definite(format!("[{}] {what}: {}", class.as_str(), self.detail))
            }
            Ec2ErrorKind::NotConnected => PluginError::definite(format!("{what}: {}", self.detail)),
            Ec2ErrorKind::Throttled { .. } if !mutating => {
                PluginError::definite(format!("[throttled] {what}: {}", self.detail))
            }
            Ec2ErrorKind::Throttled { .. } => {
                PluginError::ambiguous(format!("[throttled] {what}: {}", self.detail))
            }
            _ => PluginError::ambiguous(format!("{what}: {}", self.detail)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(code: &str) -> String {
        format!(
            "<Response><Errors><Error><Code>{code}</Code><Message>m</Message></Error></Errors><RequestID>r</RequestID></Response>"
        )
    }

    fn check(status: u16, code: &str, class: Option<ReasonClass>, acted: bool, ambiguous: bool) {
        let error = Ec2Error::from_reply(status, &reply(code));
        assert_eq!(error.reason_class(), class, "{code}");
        assert_eq!(error.may_have_acted(), acted, "{code}");
        let plugin = error.into_plugin_error("creating", true);
        assert_eq!(
            matches!(plugin, PluginError::Ambiguous(_)),
            ambiguous,
            "{code}: {plugin:?}"
        );
    }

    #[test]
    fn failures_are_classified_as_the_issue_says() {
        check(500, "InsufficientInstanceCapacity", None, true, true);
        check(
            400,
            "InsufficientInstanceCapacity",
            Some(ReasonClass::Capacity),
            false,
            false,
        );
        check(
            400,
            "Unsupported",
            Some(ReasonClass::Capacity),
            false,
            false,
        );
        check(
            400,
            "InstanceLimitExceeded",
            Some(ReasonClass::Quota),
            false,
            false,
        );
        check(
            400,
            "VcpuLimitExceeded",
            Some(ReasonClass::Quota),
            false,
            false,
        );
        check(503, "RequestLimitExceeded", None, false, true);
        check(400, "RequestLimitExceeded", None, false, true);
        check(500, "InternalError", None, true, true);
        check(
            400,
            "InvalidAMIID.NotFound",
            Some(ReasonClass::Request),
            false,
            false,
        );
    }

    #[test]
    fn a_refusal_names_its_reason_class() {
        let error = Ec2Error::from_reply(400, &reply("VcpuLimitExceeded"));
        let shown = error.into_plugin_error("creating node x", true).to_string();
        assert!(
            shown.starts_with("[quota] creating node x: VcpuLimitExceeded"),
            "{shown}"
        );
    }

    #[test]
    fn an_unknown_instance_is_not_found() {
        assert!(Ec2Error::from_reply(400, &reply("InvalidInstanceID.NotFound")).is_not_found());
        assert!(!Ec2Error::from_reply(400, &reply("InvalidAMIID.NotFound")).is_not_found());
    }
}
