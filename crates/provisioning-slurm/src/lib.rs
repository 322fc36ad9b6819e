//! The slurm provider (work in progress): configuration types and parsing of
//! Slurm's machine-readable CLI output. The `ProvisionPlugin` is not yet here.

use std::path::PathBuf;

use serde::Deserialize;

/// `[providers.slurm]` settings.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct SlurmSettings {
    /// Path to the `slurm.conf` the CLI tools should use (`SLURM_CONF`).
    pub slurm_conf: Option<PathBuf>,
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

/// Field separator used in every `squeue --format` this crate asks for.
pub const SEP: char = '|';

/// `squeue --noheader --format` string matching [`parse_squeue`].
pub const SQUEUE_FORMAT: &str = "%i|%j|%T|%N";

/// One job row from `squeue`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobRow {
    /// Job id.
    pub id: u64,
    /// Job name.
    pub name: String,
    /// State, e.g. `PENDING`, `RUNNING`.
    pub state: String,
    /// Allocated node list (empty while pending).
    pub nodes: String,
}

/// Errors parsing Slurm output.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ParseError {
    /// A line did not have the expected fields.
    #[error("squeue line {line}: expected 4 fields separated by '|': {text:?}")]
    Fields {
        /// 1-based line number.
        line: usize,
        /// The line.
        text: String,
    },
    /// The job id was not a number.
    #[error("squeue line {line}: bad job id {text:?}")]
    JobId {
        /// 1-based line number.
        line: usize,
        /// The field.
        text: String,
    },
}

/// Parse `squeue --noheader --format=SQUEUE_FORMAT` output.
pub fn parse_squeue(out: &str) -> Result<Vec<JobRow>, ParseError> {
    let mut rows = Vec::new();
    for (i, raw) in out.lines().enumerate() {
        let text = raw.trim();
        if text.is_empty() {
            continue;
        }
        let f: Vec<&str> = text.splitn(4, SEP).collect();
        let [id, name, state, nodes] = f.as_slice() else {
            return Err(ParseError::Fields {
                line: i + 1,
                text: text.to_owned(),
            });
        };
        let id = id.parse().map_err(|_| ParseError::JobId {
            line: i + 1,
            text: (*id).to_owned(),
        })?;
        rows.push(JobRow {
            id,
            name: (*name).to_owned(),
            state: (*state).to_owned(),
            nodes: (*nodes).to_owned(),
        });
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_recorded_squeue() {
        let out = "12|prov-r1-a-0|RUNNING|n1\n13|prov-r1-b-0|PENDING|\n";
        let rows = parse_squeue(out).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].nodes, "n1");
        assert_eq!(rows[1].state, "PENDING");
        assert!(rows[1].nodes.is_empty());
    }

    #[test]
    fn rejects_bad_lines() {
        assert!(matches!(
            parse_squeue("12|x"),
            Err(ParseError::Fields { .. })
        ));
        assert!(matches!(
            parse_squeue("x|a|RUNNING|n1"),
            Err(ParseError::JobId { .. })
        ));
    }

    #[test]
    fn shape_rejects_unknown_keys() {
        let ok: GroupShape = toml::from_str("partition = \"debug\"\ncpus = 1").unwrap();
        assert_eq!(ok.cpus, Some(1));
        assert!(toml::from_str::<GroupShape>("gpus = 2").is_err());
    }
}
