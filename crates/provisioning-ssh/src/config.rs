//! The typed configuration of an [`SshPlugin`](crate::SshPlugin): the
//! inventory of hosts and how to reach them.

use std::collections::BTreeSet;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use provisioning::RunId;
use thiserror::Error;

/// Where claims live on a host when the host names no directory of its own:
/// relative to the login directory of the SSH user.
pub const DEFAULT_CLAIM_ROOT: &str = ".provisioning-ssh/claims";

/// The default `ConnectTimeout` of every SSH call.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The default bound on one whole SSH call (connect, run, reply). Past it
/// the call is abandoned and its outcome is unknown (ambiguous).
pub const DEFAULT_COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

/// The most slots one host may offer.
pub const MAX_SLOTS_PER_HOST: u32 = 1024;

/// One machine of the inventory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SshHost {
    /// The host's name in the inventory (unique; part of every lease).
    pub name: String,
    /// The address `ssh` connects to (a name, an IPv4 or an IPv6 address,
    /// or a `Host` alias of the user's `~/.ssh/config`).
    pub address: String,
    /// The SSH port.
    pub port: u16,
    /// The remote user.
    pub user: String,
    /// A private key to use (`ssh -i`); `None` leaves the choice to the
    /// user's SSH configuration and agent.
    pub identity_file: Option<PathBuf>,
    /// How many nodes the host may hold at once (across all runs).
    pub slots: u32,
    /// The directory of claims on the host; `None` means
    /// [`DEFAULT_CLAIM_ROOT`] (relative to the user's login directory).
    pub claim_root: Option<String>,
}

impl SshHost {
    /// A host with one slot, port 22, no identity file and the default
    /// claim directory.
    pub fn new(
        name: impl Into<String>,
        address: impl Into<String>,
        user: impl Into<String>,
    ) -> Self {
        SshHost {
            name: name.into(),
            address: address.into(),
            port: 22,
            user: user.into(),
            identity_file: None,
            slots: 1,
            claim_root: None,
        }
    }

    /// The claim directory on this host.
    pub fn claim_root(&self) -> &str {
        self.claim_root.as_deref().unwrap_or(DEFAULT_CLAIM_ROOT)
    }
}

/// The configuration of one [`SshPlugin`](crate::SshPlugin), which serves
/// one run over one inventory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SshPluginConfig {
    /// The run every node of this plugin belongs to.
    pub run_id: RunId,
    /// The inventory's name, used in messages (for example the shape file's
    /// `[providers.ssh]` table).
    pub inventory_name: String,
    /// The hosts, in the order free slots are taken.
    pub hosts: Vec<SshHost>,
    /// The known-hosts file every host key is checked against
    /// (`StrictHostKeyChecking=yes`, no global file): an unknown or a
    /// changed key is a definite failure.
    pub known_hosts: PathBuf,
    /// An `ssh -F` configuration file; `None` uses the user's
    /// `~/.ssh/config` (so `ProxyJump`, aliases and keys keep working).
    pub ssh_config_file: Option<PathBuf>,
    /// The `ssh` program.
    pub ssh_program: PathBuf,
    /// `ConnectTimeout` of every call.
    pub connect_timeout: Duration,
    /// The bound on one whole call; past it the outcome is unknown.
    pub command_timeout: Duration,
}

impl SshPluginConfig {
    /// A configuration with the system `ssh`, the user's SSH configuration
    /// and the default timeouts.
    pub fn new(
        run_id: RunId,
        inventory_name: impl Into<String>,
        hosts: Vec<SshHost>,
        known_hosts: impl Into<PathBuf>,
    ) -> Self {
        SshPluginConfig {
            run_id,
            inventory_name: inventory_name.into(),
            hosts,
            known_hosts: known_hosts.into(),
            ssh_config_file: None,
            ssh_program: PathBuf::from("ssh"),
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            command_timeout: DEFAULT_COMMAND_TIMEOUT,
        }
    }

    /// Checks the configuration, reporting every problem with its location
    /// (`hosts[1].port`, …).
    ///
    /// # Errors
    /// [`ConfigErrors`] listing each problem found.
    pub fn validate(&self) -> Result<(), ConfigErrors> {
        let mut errors = Vec::new();
        let mut push = |field: String, problem: String| errors.push(ConfigError { field, problem });
        if !is_safe_name(self.run_id.as_str()) {
            push(
                "run_id".into(),
                format!(
                    "{:?} cannot name a claim directory: use letters, digits, '.', '_' and '-', not starting with '.' or '-'",
                    self.run_id.as_str()
                ),
            );
        }
        if self.inventory_name.trim().is_empty() {
            push("inventory_name".into(), "must not be empty".into());
        }
        if self.hosts.is_empty() {
            push("hosts".into(), "the inventory has no hosts".into());
        }
        if self.known_hosts.as_os_str().is_empty() {
            push(
                "known_hosts".into(),
                "must name a known-hosts file: host keys are always checked".into(),
            );
        }
        if self.connect_timeout.is_zero() {
            push("connect_timeout".into(), "must be positive".into());
        } else if self.connect_timeout.as_secs() == 0 {
            push(
                "connect_timeout".into(),
                "must be at least one second (ssh counts whole seconds)".into(),
            );
        }
        if self.command_timeout <= self.connect_timeout {
            push(
                "command_timeout".into(),
                "must be longer than connect_timeout".into(),
            );
        }
        let mut names = BTreeSet::new();
        for (index, host) in self.hosts.iter().enumerate() {
            let at = |field: &str| format!("hosts[{index}].{field}");
            if !is_safe_name(&host.name) {
                push(
                    at("name"),
                    format!(
                        "{:?} is not a host name: use letters, digits, '.', '_' and '-', not starting with '.' or '-'",
                        host.name
                    ),
                );
            } else if !names.insert(host.name.as_str()) {
                push(at("name"), format!("{:?} appears twice", host.name));
            }
            if host.address.is_empty() {
                push(at("address"), "must not be empty".into());
            } else if host.address.starts_with('-')
                || host.address.chars().any(|c| c.is_whitespace() || c == '@')
            {
                push(
                    at("address"),
                    format!("{:?} is not a host address", host.address),
                );
            }
            if host.port == 0 {
                push(at("port"), "must be between 1 and 65535".into());
            }
            if host.user.is_empty() {
                push(at("user"), "must not be empty".into());
            } else if host.user.starts_with('-')
                || host.user.chars().any(|c| c.is_whitespace() || c == '@')
            {
                push(at("user"), format!("{:?} is not a user name", host.user));
            }
            if let Some(identity) = &host.identity_file
                && identity.as_os_str().is_empty()
            {
                push(
                    at("identity_file"),
                    "must not be empty (leave it out instead)".into(),
                );
            }
            if host.slots == 0 || host.slots > MAX_SLOTS_PER_HOST {
                push(
                    at("slots"),
                    format!("must be between 1 and {MAX_SLOTS_PER_HOST}"),
                );
            }
            if let Some(root) = &host.claim_root
                && (root.is_empty() || root.contains('\0') || root.contains('\n'))
            {
                push(at("claim_root"), "is not a usable directory".into());
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(ConfigErrors(errors))
        }
    }
}

/// Whether `name` may be a path component of a claim: `[A-Za-z0-9._-]+`,
/// not starting with `.` or `-`.
pub(crate) fn is_safe_name(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with(['.', '-'])
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// One problem of a configuration.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("{field}: {problem}")]
pub struct ConfigError {
    /// Where: `hosts[2].slots`, `known_hosts`, ….
    pub field: String,
    /// What is wrong.
    pub problem: String,
}

/// Every problem of a configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid ssh inventory:")?;
        for error in &self.0 {
            write!(f, "\n  {error}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}
