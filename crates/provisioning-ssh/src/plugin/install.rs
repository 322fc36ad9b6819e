//! Installing the node agent on a host: once per content hash, checked on
//! the host before it is moved into place, with local hashes cached per file.

use super::*;

impl SshPlugin {
    /// Makes sure the host `host` (by inventory name) holds the executable
    /// `local`, uploading it once per content hash: it ends up at
    /// `{claim_root}/.agents/{sha256}` (mode 0755), checked against its hash
    /// on the host before it is renamed into place. Returns the remote path
    /// and whether it was uploaded now.
    ///
    /// # Errors
    /// Definite when `local` cannot be read, the host is unknown or could
    /// not be reached, or the upload did not check out; ambiguous when the
    /// call broke off.
    pub async fn install_agent(
        &self,
        host: &str,
        local: &std::path::Path,
    ) -> Result<(String, bool), PluginError> {
        let index = self
            .config
            .hosts
            .iter()
            .position(|h| h.name == host)
            .ok_or_else(|| {
                PluginError::definite(format!(
                    "host {host:?} is not in inventory {:?}",
                    self.config.inventory_name
                ))
            })?;
        let path = local.to_owned();
        let binary = tokio::task::spawn_blocking(move || std::fs::read(path))
            .await
            .map_err(|error| PluginError::definite(format!("reading the agent: {error}")))?
            .map_err(|error| {
                PluginError::definite(format!(
                    "cannot read the agent {}: {error}",
                    local.display()
                ))
            })?;
        let hash = digest_of(local, &binary);
        self.upload(index, &binary, &hash).await
    }

    /// Uploads `binary` (whose SHA-256 is `hash`) to host `index` unless it
    /// holds it (asked first, so a present agent is not sent again): the
    /// remote path and whether it was uploaded now.
    pub(super) async fn upload(
        &self,
        index: usize,
        binary: &[u8],
        hash: &str,
    ) -> Result<(String, bool), PluginError> {
        let path = format!("{}/.agents/{hash}", self.config.hosts[index].claim_root());
        if self.agent_present(index, hash).await? {
            return Ok((path, false));
        }
        self.send_agent(index, binary, hash).await?;
        Ok((path, true))
    }

    /// Whether host `index` holds the agent of content hash `hash`.
    pub(super) async fn agent_present(
        &self,
        index: usize,
        hash: &str,
    ) -> Result<bool, PluginError> {
        let host = &self.config.hosts[index];
        let reply = self
            .call(index, None, &script::agent_present(hash))
            .await
            .map_err(|failure| self.failure(host, "looking for the agent", failure))?;
        match reply.verdict() {
            "PRESENT" => Ok(true),
            "ABSENT" => Ok(false),
            _ => Err(self.unexpected(index, "looking for the agent", &reply)),
        }
    }

    /// Sends `binary` to host `index`, where it is installed under its hash
    /// after the hash checked out.
    pub(super) async fn send_agent(
        &self,
        index: usize,
        binary: &[u8],
        hash: &str,
    ) -> Result<(), PluginError> {
        let host = &self.config.hosts[index];
        let remote = format!(
            "sh -c {}",
            quote(&script::install_agent(host.claim_root(), hash))
        );
        let reply = ssh::run_with_input(&self.config, host, None, &remote, binary)
            .await
            .map_err(|failure| self.failure(host, "installing the agent", failure))?;
        match reply.verdict() {
            "PRESENT" => Ok(()),
            "INSTALLED" => {
                tracing::info!(host = %host.name, %hash, bytes = binary.len(), "agent installed");
                Ok(())
            }
            "MISMATCH" | "FAILED" => Err(PluginError::definite(format!(
                "installing the agent on host {:?} failed ({}): {}",
                host.name,
                reply.verdict(),
                reply.stderr.trim()
            ))),
            _ => Err(self.unexpected(index, "installing the agent", &reply)),
        }
    }

    /// Makes sure host `index` holds the plugin's agent, uploading it at
    /// most once per host and content hash.
    pub(super) async fn ensure_installed(&self, index: usize) -> Result<(), PluginError> {
        let Some(agent) = &self.agent else {
            return Err(no_agent());
        };
        let _one_upload_per_host = agent.install_locks[index].lock().await;
        if self.agent_present(index, &agent.digest).await? {
            return Ok(());
        }
        let program = agent.config.program.clone();
        let binary = tokio::task::spawn_blocking(move || std::fs::read(program))
            .await
            .map_err(|error| PluginError::definite(format!("reading the agent: {error}")))?
            .map_err(|error| {
                PluginError::definite(format!(
                    "cannot read the agent {}: {error}",
                    agent.config.program.display()
                ))
            })?;
        self.send_agent(index, &binary, &agent.digest).await
    }
}

/// Content hashes of local files by path, size and modification time, so
/// a large agent is hashed once per process, not once per plugin or call.
type DigestCache = BTreeMap<std::path::PathBuf, (u64, std::time::SystemTime, String)>;

static DIGESTS: Mutex<DigestCache> = Mutex::new(BTreeMap::new());

/// The size and modification time of `local`.
pub(super) fn stamp_of(local: &std::path::Path) -> Option<(u64, std::time::SystemTime)> {
    std::fs::metadata(local)
        .and_then(|m| m.modified().map(|t| (m.len(), t)))
        .ok()
}

/// The remembered hash of `local`, if it did not change since.
pub(super) fn cached_digest(local: &std::path::Path) -> Option<String> {
    let (len, modified) = stamp_of(local)?;
    lock(&DIGESTS)
        .get(local)
        .filter(|(l, m, _)| *l == len && *m == modified)
        .map(|(_, _, hash)| hash.clone())
}

/// The SHA-256 (hex) of `bytes`, just read from `local`.
pub(super) fn digest_of(local: &std::path::Path, bytes: &[u8]) -> String {
    let stamp = stamp_of(local).filter(|(len, _)| *len == bytes.len() as u64);
    if stamp.is_some()
        && let Some(hash) = cached_digest(local)
    {
        return hash;
    }
    let hash = hex::encode(sha2::Sha256::digest(bytes));
    if let Some((len, modified)) = stamp {
        lock(&DIGESTS).insert(local.to_owned(), (len, modified, hash.clone()));
    }
    hash
}

/// The SHA-256 (hex) of the file at `local`, read only when not remembered.
pub(super) fn file_digest(local: &std::path::Path) -> std::io::Result<String> {
    if let Some(hash) = cached_digest(local) {
        return Ok(hash);
    }
    let bytes = std::fs::read(local)?;
    Ok(digest_of(local, &bytes))
}
