//! Configuration: the `[providers.slurm]` settings, a group's `slurm` table
//! and how that table travels inside a node template (as `slurm.*` labels).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use provisioning::RunId;
use provisioning_agent::RunSecret;
use serde::Deserialize;

/// The default bound on one Slurm command (`sbatch`, `squeue`, `scancel`).
/// An unreachable controller makes the tools retry for about 9 s first.
pub const DEFAULT_COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

/// The default pause between two looks for jobs that ended by themselves.
pub const DEFAULT_WATCH_INTERVAL: Duration = Duration::from_secs(1);

/// The default longest wait for a cancelled job or step to be gone.
pub const DEFAULT_GONE_WAIT: Duration = Duration::from_secs(30);

/// The label prefix under which a group's `slurm` table travels in its
/// node template (`slurm.partition`, `slurm.cpus`, …).
pub const LABEL_PREFIX: &str = "slurm.";

/// `[providers.slurm]` settings.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct SlurmSettings {
    /// Path to the `slurm.conf` the CLI tools should use (`SLURM_CONF`).
    pub slurm_conf: Option<PathBuf>,
    /// The address the run's swarm listener binds (default `127.0.0.1:0`).
    pub listen: Option<SocketAddr>,
    /// The address agents dial, when it differs from the bound one.
    pub advertise: Option<SocketAddr>,
    /// The agent binary as the compute nodes see it (default: this
    /// controller's own `provision` binary, for a shared file system).
    pub agent: Option<PathBuf>,
    /// Bound on one Slurm command, in seconds.
    pub command_timeout_secs: Option<u64>,
}

/// A group's `slurm` table: what one node's allocation asks for.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct GroupShape {
    /// Partition (`--partition`).
    pub partition: Option<String>,
    /// CPUs per task (`--cpus-per-task`).
    pub cpus: Option<u32>,
    /// Memory (`--mem`), e.g. "512M".
    pub memory: Option<String>,
    /// Generic resources (`--gres`).
    pub gres: Option<String>,
    /// Time limit (`--time`), Slurm syntax.
    pub time_limit: Option<String>,
    /// Account (`--account`).
    pub account: Option<String>,
    /// Quality of service (`--qos`).
    pub qos: Option<String>,
}

/// A `slurm.*` label that does not name a field of [`GroupShape`], or a
/// value that does not fit its field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("label {label:?} of the node template: {problem}")]
pub struct LabelError {
    /// The label.
    pub label: String,
    /// What is wrong with it.
    pub problem: String,
}

impl GroupShape {
    /// The table as template labels (each set field under [`LABEL_PREFIX`]).
    pub fn to_labels(&self) -> BTreeMap<String, String> {
        let mut labels = BTreeMap::new();
        let mut put = |name: &str, value: Option<String>| {
            if let Some(value) = value {
                labels.insert(format!("{LABEL_PREFIX}{name}"), value);
            }
        };
        put("partition", self.partition.clone());
        put("cpus", self.cpus.map(|c| c.to_string()));
        put("memory", self.memory.clone());
        put("gres", self.gres.clone());
        put("time_limit", self.time_limit.clone());
        put("account", self.account.clone());
        put("qos", self.qos.clone());
        labels
    }

    /// The table back from template labels; labels without the prefix are
    /// not the plugin's and are ignored.
    ///
    /// # Errors
    /// An unknown `slurm.*` label, a bad CPU count, or a value with a
    /// character that would change the meaning of an `sbatch` argument.
    pub fn from_labels(labels: &BTreeMap<String, String>) -> Result<Self, LabelError> {
        let mut shape = GroupShape::default();
        for (label, value) in labels {
            let Some(name) = label.strip_prefix(LABEL_PREFIX) else {
                continue;
            };
            let bad = |problem: &str| LabelError {
                label: label.clone(),
                problem: problem.to_owned(),
            };
            if value.is_empty() || value.chars().any(|c| c.is_whitespace() || c.is_control()) {
                return Err(bad("must be non-empty without whitespace"));
            }
            let text = Some(value.clone());
            match name {
                "partition" => shape.partition = text,
                "cpus" => {
                    let cpus = value
                        .parse::<u32>()
                        .ok()
                        .filter(|c| *c > 0)
                        .ok_or_else(|| bad("must be a positive whole number"))?;
                    shape.cpus = Some(cpus);
                }
                "memory" => shape.memory = text,
                "gres" => shape.gres = text,
                "time_limit" => shape.time_limit = text,
                "account" => shape.account = text,
                "qos" => shape.qos = text,
                _ => {
                    return Err(bad(
                        "unknown; a group's slurm table takes partition, cpus, memory, gres, time_limit, account and qos",
                    ));
                }
            }
        }
        Ok(shape)
    }

    /// The `sbatch` options this table asks for.
    pub fn sbatch_options(&self) -> Vec<String> {
        let mut options = Vec::new();
        let mut put = |flag: &str, value: &Option<String>| {
            if let Some(value) = value {
                options.push(format!("--{flag}={value}"));
            }
        };
        put("partition", &self.partition);
        put("cpus-per-task", &self.cpus.map(|c| c.to_string()));
        put("mem", &self.memory);
        put("gres", &self.gres);
        put("time", &self.time_limit);
        put("account", &self.account);
        put("qos", &self.qos);
        options
    }
}

/// How a [`SlurmPlugin`](crate::SlurmPlugin) is set up.
#[derive(Clone, Debug)]
pub struct SlurmPluginConfig {
    /// The run whose jobs the plugin manages.
    pub run_id: RunId,
    /// The run's secret; agents' join credentials derive from it.
    pub secret: RunSecret,
    /// `SLURM_CONF` for every Slurm command (`None`: the tools' default).
    pub slurm_conf: Option<PathBuf>,
    /// The agent command inside a job step: the program and its leading
    /// arguments (for example `provision agent`), as the compute node sees it.
    pub agent: Vec<String>,
    /// The address the swarm listener binds.
    pub listen: SocketAddr,
    /// The address agents dial (`None`: the bound address).
    pub advertise: Option<SocketAddr>,
    /// Bound on one Slurm command.
    pub command_timeout: Duration,
    /// Pause between two looks for jobs that ended by themselves.
    pub watch_interval: Duration,
    /// Longest wait for a cancelled job or step to be gone.
    pub gone_wait: Duration,
    /// How long a dropped agent may take to re-join before it is lost.
    pub rejoin_grace: Duration,
}

impl SlurmPluginConfig {
    /// A configuration with the defaults: listen on `127.0.0.1:0`, default
    /// timeouts, the tools' own `slurm.conf`.
    pub fn new(run_id: RunId, secret: RunSecret, agent: Vec<String>) -> Self {
        SlurmPluginConfig {
            run_id,
            secret,
            slurm_conf: None,
            agent,
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise: None,
            command_timeout: DEFAULT_COMMAND_TIMEOUT,
            watch_interval: DEFAULT_WATCH_INTERVAL,
            gone_wait: DEFAULT_GONE_WAIT,
            rejoin_grace: provisioning_agent::remote::DEFAULT_REJOIN_GRACE,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_rejects_unknown_keys() {
        let ok: GroupShape = toml::from_str("partition = \"debug\"\ncpus = 1").unwrap();
        assert_eq!(ok.cpus, Some(1));
        assert!(toml::from_str::<GroupShape>("gpus = 2").is_err());
    }

    #[test]
    fn shape_survives_the_trip_through_labels() {
        let shape = GroupShape {
            partition: Some("debug".into()),
            cpus: Some(2),
            memory: Some("512M".into()),
            gres: Some("gpu:1".into()),
            time_limit: Some("00:10:00".into()),
            account: Some("ml".into()),
            qos: Some("normal".into()),
        };
        let mut labels = shape.to_labels();
        labels.insert("team".into(), "not ours".into());
        assert_eq!(GroupShape::from_labels(&labels).unwrap(), shape);
        assert_eq!(
            shape.sbatch_options(),
            [
                "--partition=debug",
                "--cpus-per-task=2",
                "--mem=512M",
                "--gres=gpu:1",
                "--time=00:10:00",
                "--account=ml",
                "--qos=normal"
            ]
        );
    }

    #[test]
    fn unknown_or_malformed_labels_are_refused() {
        let labels = BTreeMap::from([("slurm.gpus".to_owned(), "2".to_owned())]);
        assert!(GroupShape::from_labels(&labels).is_err());
        let labels = BTreeMap::from([("slurm.cpus".to_owned(), "0".to_owned())]);
        assert!(GroupShape::from_labels(&labels).is_err());
        let labels = BTreeMap::from([("slurm.partition".to_owned(), "a b".to_owned())]);
        assert!(GroupShape::from_labels(&labels).is_err());
    }
}
