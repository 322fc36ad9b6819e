//! The Engine API client and how its failures are classified.
//!
//! One [`bollard::Docker`] client per plugin, on a `unix://` socket, with
//! the API version negotiated once at start (Docker 20.10 serves 1.41,
//! Podman 4 the same; newer clients must step down).

use std::path::Path;
use std::time::Duration;

use bollard::Docker;
use bollard::errors::Error as EngineError;
use provisioning_provider::PluginError;

/// What kind of failure an Engine API call had.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Failure {
    /// The socket could not be connected to (absent, refused): nothing was
    /// sent, nothing happened.
    NotConnected,
    /// The engine answered that the object is not there (HTTP 404).
    Missing,
    /// The engine answered that the name is taken (HTTP 409).
    Conflict,
    /// The engine refused the request (another 4xx): nothing happened.
    Refused,
    /// Anything else (a time-out, a broken connection, a 5xx): the call may
    /// have acted.
    Unknown,
}

/// Classifies an Engine API error.
pub(crate) fn classify(error: &EngineError) -> Failure {
    match error {
        EngineError::SocketNotFoundError(_) => Failure::NotConnected,
        EngineError::HyperLegacyError { err } if err.is_connect() => Failure::NotConnected,
        EngineError::DockerResponseServerError { status_code, .. } => match status_code {
            404 => Failure::Missing,
            409 => Failure::Conflict,
            400..=499 => Failure::Refused,
            _ => Failure::Unknown,
        },
        _ => Failure::Unknown,
    }
}

/// The failure of an acting call (`what` names it) as a plugin error:
/// definite when nothing can have happened, else ambiguous.
pub(crate) fn acting(what: &str, error: &EngineError) -> PluginError {
    match classify(error) {
        Failure::NotConnected => PluginError::definite(format!(
            "{what}: the engine's socket cannot be reached, nothing was sent: {error}"
        )),
        Failure::Missing | Failure::Conflict | Failure::Refused => {
            PluginError::definite(format!("{what}: the engine refused: {error}"))
        }
        Failure::Unknown => PluginError::ambiguous(format!(
            "{what}: the engine's answer was lost or unclear, the outcome is unknown: {error}"
        )),
    }
}

/// The failure of a read-only call: it changed nothing either way, but an
/// unclear one is reported ambiguous so that the driver asks again.
pub(crate) fn looking(what: &str, error: &EngineError) -> PluginError {
    match classify(error) {
        Failure::Unknown => PluginError::ambiguous(format!("{what}: {error}")),
        _ => PluginError::definite(format!("{what}: {error}")),
    }
}

/// Connects to the engine on `socket_path` and negotiates the API version.
///
/// # Errors
/// When the socket is absent or the engine does not answer.
pub(crate) async fn connect(socket_path: &Path, timeout: Duration) -> Result<Docker, EngineError> {
    let client = unconnected(socket_path, timeout)?;
    tokio::time::timeout(timeout, client.negotiate_version())
        .await
        .map_err(|_| EngineError::RequestTimeoutError)?
}

/// A client on `socket_path` without negotiating (for the fault hook's
/// refusing socket, which has no engine to negotiate with).
pub(crate) fn unconnected(socket_path: &Path, timeout: Duration) -> Result<Docker, EngineError> {
    let path = socket_path.to_string_lossy();
    Ok(Docker::connect_with_unix(
        &path,
        timeout.as_secs().max(1),
        bollard::API_DEFAULT_VERSION,
    )?
    .with_timeout(timeout))
}

/// The engine's networks with the gateway address of each (networks
/// without one, and a failed listing, give nothing: the caller only names
/// them in an error or matches an address against them).
pub(crate) async fn gateways(docker: &Docker) -> Vec<(String, std::net::IpAddr)> {
    let Ok(networks) = docker.list_networks(None).await else {
        return Vec::new();
    };
    let mut found: Vec<(String, std::net::IpAddr)> = networks
        .into_iter()
        .flat_map(|network| {
            let name = network.name.unwrap_or_default();
            network
                .ipam
                .and_then(|ipam| ipam.config)
                .unwrap_or_default()
                .into_iter()
                .filter_map(|config| config.gateway?.parse().ok())
                .map(move |ip| (name.clone(), ip))
        })
        .collect();
    found.sort();
    found.dedup();
    found
}
