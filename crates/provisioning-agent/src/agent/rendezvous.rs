//! What a workload is told (design §22): its place in the run, in its
//! environment, and the run's ready nodes, in its peers file.
//!
//! Both boot modes (a local agent, [`super::remote`]) give every command they
//! run the `workload_env`, and keep one `PeersFile` for the node: it is
//! written empty before the workload starts, so a workload always finds it,
//! and rewritten atomically (a temporary file, then a rename) with every
//! [`PeersUpdate`] the controller pushes on the swarm connection. After each
//! rewrite the group's `on_peers_change` command, if any, runs with the same
//! environment; rewrites that come while it runs are folded into one more
//! run after it.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use provisioning::LogicalNodeId;
use tokio::process::Command;
use tokio::sync::watch;

use crate::os;
use crate::wire::{BootOrder, PeersUpdate};

/// The run's name.
pub const RUN: &str = "PROVISION_RUN";
/// The node's group.
pub const GROUP: &str = "PROVISION_GROUP";
/// The node's slot index in its group (0-based, the same across
/// replacements of the slot).
pub const NODE_INDEX: &str = "PROVISION_NODE_INDEX";
/// The desired node count of the node's group when it was booted.
pub const GROUP_SIZE: &str = "PROVISION_GROUP_SIZE";
/// The node's address as its peers reach it.
pub const ADDRESS: &str = "PROVISION_ADDRESS";
/// The path of the node's peers file.
pub const PEERS_FILE: &str = "PROVISION_PEERS_FILE";

/// The longest an `on_peers_change` command may run before it is killed.
const PEERS_HOOK_RUN_MAX: Duration = Duration::from_secs(10 * 60);

/// The directory of `run`'s peers files on this machine for this user
/// (mode `0700`, under the system's temporary directory). A local provider
/// that stopped every node of the run removes it, with the files of agents
/// that were killed before they could remove their own.
pub fn peers_dir(run: &str) -> PathBuf {
    let uid = nix::unistd::getuid().as_raw();
    std::env::temp_dir().join(format!("provision-{uid}-{run}"))
}

/// Where the agent of `order` keeps its peers file: one file per attempt in
/// the run's [`peers_dir`].
pub(crate) fn peers_file_path(order: &BootOrder) -> PathBuf {
    peers_dir(&order.run).join(format!("{}.a{}.peers.json", order.node, order.attempt))
}

/// The environment every command of the node's workload gets, besides the
/// tags of [`crate::os`] (`PROVISION_RUN_ID`, `PROVISION_NODE_ID`,
/// `PROVISION_ATTEMPT`, which the caller sets).
pub(crate) fn workload_env(order: &BootOrder, peers_file: &Path) -> Vec<(&'static str, String)> {
    let mut env = vec![
        (RUN, order.run.clone()),
        (PEERS_FILE, peers_file.display().to_string()),
    ];
    if let Ok(slot) = LogicalNodeId::parse(&order.node) {
        env.push((GROUP, slot.group().to_string()));
        env.push((NODE_INDEX, slot.index().to_string()));
    }
    if let Some(size) = order.group_size {
        env.push((GROUP_SIZE, size.to_string()));
    }
    if let Some(address) = &order.address {
        env.push((ADDRESS, address.clone()));
    }
    env
}

/// Sets the tags and the [`workload_env`] on `command`; the tags come last
/// so that they win over a user's environment.
pub(crate) fn tell_workload(command: &mut Command, order: &BootOrder, peers_file: &Path) {
    command
        .envs(&order.env)
        .envs(workload_env(order, peers_file))
        .env(os::RUN_TAG, &order.run)
        .env(os::NODE_TAG, &order.node)
        .env(os::ATTEMPT_TAG, order.attempt.to_string());
}

/// The node's peers file and its `on_peers_change` command.
#[derive(Debug)]
pub(crate) struct PeersFile {
    path: PathBuf,
    /// Bumped after each rewrite; the hook task runs the command for it.
    rewritten: watch::Sender<u64>,
}

impl PeersFile {
    /// Creates the file at `path`, empty (no peers), and starts the task
    /// that runs `on_change` (a builder of the `on_peers_change` command,
    /// when the group has one) after each rewrite.
    ///
    /// # Errors
    /// When the directory or the file cannot be made.
    pub(crate) fn create(
        path: PathBuf,
        on_change: Option<Box<dyn Fn() -> Command + Send + Sync>>,
    ) -> Result<Arc<Self>, String> {
        if let Some(dir) = path.parent() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|error| format!("cannot make {}: {error}", dir.display()))?;
        }
        let (rewritten, seen) = watch::channel(0);
        let file = Arc::new(PeersFile { path, rewritten });
        file.write_file(&PeersUpdate::default())?;
        if let Some(on_change) = on_change {
            tokio::spawn(run_hook(seen, on_change));
        }
        Ok(file)
    }

    /// Rewrites the file with `update`, then has the hook run. A failed
    /// write is logged; the file keeps its last content.
    pub(crate) fn rewrite(&self, update: &PeersUpdate) {
        match self.write_file(update) {
            Ok(()) => {
                tracing::debug!(
                    version = update.version,
                    peers = update.peers.len(),
                    "peers file rewritten"
                );
                self.rewritten.send_modify(|count| *count += 1);
            }
            Err(error) => tracing::warn!(%error, "cannot rewrite the peers file"),
        }
    }

    /// Writes a temporary file beside the peers file and renames it over
    /// it, so a reader sees the old list or the new one, never a part.
    fn write_file(&self, update: &PeersUpdate) -> Result<(), String> {
        let mut text = serde_json::to_vec_pretty(update)
            .map_err(|error| format!("cannot encode the peers: {error}"))?;
        text.push(b'\n');
        let mut temporary = self.path.clone().into_os_string();
        temporary.push(".tmp");
        let temporary = PathBuf::from(temporary);
        let written = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o644)
            .open(&temporary)
            .and_then(|mut file| file.write_all(&text));
        written
            .and_then(|()| std::fs::rename(&temporary, &self.path))
            .map_err(|error| format!("cannot write {}: {error}", self.path.display()))
    }
}

impl PeersFile {
    /// Removes the file, and the run's directory once it is empty: the node
    /// stops.
    pub(crate) fn remove(&self) {
        let _ = std::fs::remove_file(&self.path);
        if let Some(dir) = self.path.parent() {
            // Fails while other nodes of the run keep their files: fine.
            let _ = std::fs::remove_dir(dir);
        }
    }
}

impl Drop for PeersFile {
    fn drop(&mut self) {
        self.remove();
    }
}

/// Runs the `on_peers_change` command after each rewrite, one run at a time.
async fn run_hook(
    mut rewritten: watch::Receiver<u64>,
    on_change: Box<dyn Fn() -> Command + Send + Sync>,
) {
    // Bounded by the peers file's life: its drop closes the channel.
    while rewritten.changed().await.is_ok() {
        rewritten.borrow_and_update();
        let mut command = on_change();
        command.kill_on_drop(true);
        let status = match command.spawn() {
            Ok(mut child) => tokio::time::timeout(PEERS_HOOK_RUN_MAX, child.wait()).await,
            Err(error) => {
                tracing::warn!(%error, "cannot start the on_peers_change command");
                continue;
            }
        };
        match status {
            Ok(Ok(status)) if status.success() => {}
            Ok(Ok(status)) => tracing::warn!(%status, "the on_peers_change command failed"),
            Ok(Err(error)) => tracing::warn!(%error, "cannot wait for the on_peers_change command"),
            Err(_) => {
                tracing::warn!("the on_peers_change command ran for {PEERS_HOOK_RUN_MAX:?}; killed")
            }
        }
    }
}
