//! Which program the SSH and Slurm providers install and start on their
//! hosts as the node agent.
//!
//! The agent is `provisioning-agent`'s slim `provision-agent` binary, shipped
//! next to `provision`: a few MiB instead of the whole command, so uploading
//! it to every host and hashing it is cheap. When it is missing (a build of
//! `provision` alone), the providers fall back to the running `provision`
//! binary run as `provision agent`, which runs the same agent code.

use std::path::{Path, PathBuf};

use anyhow::Context as _;

/// The file name of the slim agent binary.
pub(crate) const AGENT_BINARY_NAME: &str = "provision-agent";

/// The argument that makes the full `provision` binary run as a node agent.
const FULL_BINARY_AGENT_ARGUMENT: &str = "agent";

/// The agent program for remote hosts and its leading arguments: the
/// `provision-agent` binary next to the running `provision` executable,
/// with no arguments; when there is none, the running executable itself
/// with `["agent"]` (and a warning saying so).
///
/// # Errors
/// When the running executable cannot be located.
pub(crate) fn remote_agent_command() -> anyhow::Result<(PathBuf, Vec<String>)> {
    let current = std::env::current_exe().context("cannot locate the running provision binary")?;
    Ok(agent_next_to(&current))
}

/// Whether `path` names the slim agent (which takes no `agent` argument),
/// judged by its file name.
pub(crate) fn is_slim_agent(path: &Path) -> bool {
    path.file_name()
        .is_some_and(|name| name == std::ffi::OsStr::new(AGENT_BINARY_NAME))
}

/// The agent program for a `provision` binary at `current` (see
/// [`remote_agent_command`]).
fn agent_next_to(current: &Path) -> (PathBuf, Vec<String>) {
    let slim = current.with_file_name(AGENT_BINARY_NAME);
    if slim.is_file() {
        return (slim, Vec::new());
    }
    tracing::warn!(
        missing = %slim.display(),
        "no {AGENT_BINARY_NAME} next to provision: the hosts get the full provision binary \
         (run as `provision agent`); build the slim agent with \
         `cargo build --release --bin {AGENT_BINARY_NAME}` and install it beside provision"
    );
    (
        current.to_owned(),
        vec![FULL_BINARY_AGENT_ARGUMENT.to_owned()],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slim_agent_next_to_provision_is_preferred_and_provision_agent_is_the_fallback() {
        let dir = tempfile::tempdir().unwrap();
        let provision = dir.path().join("provision");
        std::fs::write(&provision, b"").unwrap();
        assert_eq!(
            agent_next_to(&provision),
            (provision.clone(), vec!["agent".to_owned()])
        );
        let slim = dir.path().join(AGENT_BINARY_NAME);
        std::fs::write(&slim, b"").unwrap();
        assert_eq!(agent_next_to(&provision), (slim, Vec::new()));
    }
}
