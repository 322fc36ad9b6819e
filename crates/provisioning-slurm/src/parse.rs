//! Parsing of Slurm's machine-readable output (fields separated by [`SEP`],
//! never column positions), job names, and the classification of a failed
//! command's error output.

use provisioning::{LogicalNodeId, NodeAttemptId, RunId};
use provisioning_provider::AttemptKey;

/// Field separator used in every `squeue --format` this crate asks for.
pub const SEP: char = '|';

/// `squeue --noheader --format` for jobs, matching [`parse_squeue`].
/// The name comes last, so a name holding the separator stays whole.
pub const SQUEUE_FORMAT: &str = "%i|%T|%N|%r|%j";

/// `squeue --steps --noheader --format` for steps, matching [`parse_steps`].
pub const STEPS_FORMAT: &str = "%i|%N|%j";

/// The first part of every job name of this provider.
pub const JOB_PREFIX: &str = "prov";

/// Separates the parts of a job name. Run and group names never contain it
/// (they are made of letters, digits, `.`, `_` and `-`).
pub const NAME_SEP: char = '+';

/// The name of the agent's job step inside a node's allocation.
pub const AGENT_STEP: &str = "provision-agent";

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
    /// Why the job is in its state (`None`, `Resources`, `TimeLimit`, …).
    pub reason: String,
}

impl JobRow {
    /// Whether the job still holds or waits for an allocation and is not on
    /// its way out (see [`is_live_state`]).
    pub fn is_live(&self) -> bool {
        is_live_state(&self.state)
    }

    /// Whether the job exists at all for the controller (not yet final).
    pub fn is_present(&self) -> bool {
        !is_final_state(&self.state)
    }
}

/// One job step row from `squeue --steps`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepRow {
    /// The job id.
    pub job: u64,
    /// The step id within the job (`batch`, `0`, `1`, …).
    pub step: String,
    /// The step name.
    pub name: String,
    /// The nodes it runs on.
    pub nodes: String,
}

impl StepRow {
    /// `JOB.STEP`, as `scancel` takes it.
    pub fn id(&self) -> String {
        format!("{}.{}", self.job, self.step)
    }
}

/// Errors parsing Slurm output.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ParseError {
    /// A line did not have the expected fields.
    #[error("squeue line {line}: expected {fields} fields separated by '|': {text:?}")]
    Fields {
        /// 1-based line number.
        line: usize,
        /// How many fields were expected.
        fields: usize,
        /// The line.
        text: String,
    },
    /// The job id was not a number.
    #[error("line {line}: bad job id {text:?}")]
    JobId {
        /// 1-based line number.
        line: usize,
        /// The field.
        text: String,
    },
    /// `sbatch --parsable` printed no job id.
    #[error("sbatch printed no job id: {0:?}")]
    Submitted(String),
}

/// Whether a job state is final: the job holds nothing any more.
pub fn is_final_state(state: &str) -> bool {
    matches!(
        state,
        "BOOT_FAIL"
            | "CANCELLED"
            | "COMPLETED"
            | "DEADLINE"
            | "FAILED"
            | "NODE_FAIL"
            | "OUT_OF_MEMORY"
            | "PREEMPTED"
            | "TIMEOUT"
            | "SPECIAL_EXIT"
            | "REVOKED"
    )
}

/// Whether a job in `state` counts as a live node: not final and not
/// `COMPLETING` (a job whose processes are being cleaned up is ending).
pub fn is_live_state(state: &str) -> bool {
    !is_final_state(state) && state != "COMPLETING"
}

fn split_fields(text: &str, count: usize, line: usize) -> Result<Vec<&str>, ParseError> {
    let fields: Vec<&str> = text.splitn(count, SEP).collect();
    if fields.len() != count {
        return Err(ParseError::Fields {
            line,
            fields: count,
            text: text.to_owned(),
        });
    }
    Ok(fields)
}

/// Parses `squeue --noheader --format=SQUEUE_FORMAT` output.
///
/// # Errors
/// A line without five fields, or with a job id that is not a number.
pub fn parse_squeue(out: &str) -> Result<Vec<JobRow>, ParseError> {
    let mut rows = Vec::new();
    for (index, raw) in out.lines().enumerate() {
        let text = raw.trim();
        if text.is_empty() {
            continue;
        }
        let line = index + 1;
        let fields = split_fields(text, 5, line)?;
        let id = fields[0].parse().map_err(|_| ParseError::JobId {
            line,
            text: fields[0].to_owned(),
        })?;
        rows.push(JobRow {
            id,
            state: fields[1].to_owned(),
            nodes: fields[2].to_owned(),
            reason: fields[3].to_owned(),
            name: fields[4].to_owned(),
        });
    }
    Ok(rows)
}

/// Parses `squeue --steps --noheader --format=STEPS_FORMAT` output.
///
/// # Errors
/// A line without three fields, or a step id that is not `JOB.STEP`.
pub fn parse_steps(out: &str) -> Result<Vec<StepRow>, ParseError> {
    let mut rows = Vec::new();
    for (index, raw) in out.lines().enumerate() {
        let text = raw.trim();
        if text.is_empty() {
            continue;
        }
        let line = index + 1;
        let fields = split_fields(text, 3, line)?;
        let bad = || ParseError::JobId {
            line,
            text: fields[0].to_owned(),
        };
        let (job, step) = fields[0].split_once('.').ok_or_else(bad)?;
        rows.push(StepRow {
            job: job.parse().map_err(|_| bad())?,
            step: step.to_owned(),
            nodes: fields[1].to_owned(),
            name: fields[2].to_owned(),
        });
    }
    Ok(rows)
}

/// Parses `sbatch --parsable` output: `ID` or `ID;CLUSTER`.
///
/// # Errors
/// When no job id is there.
pub fn parse_submitted(out: &str) -> Result<u64, ParseError> {
    out.lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .and_then(|l| l.split(';').next())
        .and_then(|id| id.trim().parse().ok())
        .ok_or_else(|| ParseError::Submitted(out.to_owned()))
}

/// Whether `name` can be part of a job name: letters, digits, `.`, `_`, `-`.
pub fn is_safe_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// `prov+{run}+` — the start of every job name of `run`.
pub fn run_prefix(run: &RunId) -> String {
    format!("{JOB_PREFIX}{NAME_SEP}{run}{NAME_SEP}")
}

/// The job name of an attempt: `prov+{run}+{node}+a{attempt}`, or `None`
/// when the run or group name has characters a job name must not hold.
pub fn job_name(key: &AttemptKey) -> Option<String> {
    let node = key.node.to_string();
    if !is_safe_name(key.run_id.as_str()) || !is_safe_name(&node) {
        return None;
    }
    Some(format!(
        "{}{node}{NAME_SEP}{}",
        run_prefix(&key.run_id),
        key.attempt
    ))
}

/// The attempt a job name of `run` stands for, if it is one.
pub fn parse_job_name(run: &RunId, name: &str) -> Option<AttemptKey> {
    let rest = name.strip_prefix(&run_prefix(run))?;
    let (node, attempt) = rest.rsplit_once(NAME_SEP)?;
    let attempt = attempt.strip_prefix('a')?.parse::<u64>().ok()?;
    let key = AttemptKey {
        run_id: run.clone(),
        node: LogicalNodeId::parse(node).ok()?,
        attempt: NodeAttemptId::from_raw(attempt),
    };
    // Only names this crate would have made (no stray forms).
    (job_name(&key).as_deref() == Some(name)).then_some(key)
}

/// Whether a pending job's reason says it can never run as submitted (the
/// request exceeds what the partition or any node offers, or names an
/// account or QoS it may not use). Slurm accepts some such jobs and leaves
/// them pending instead of refusing them at submission.
pub fn is_hopeless_reason(reason: &str) -> bool {
    matches!(
        reason,
        "PartitionConfig"
            | "BadConstraints"
            | "PartitionNodeLimit"
            | "PartitionTimeLimit"
            | "InvalidAccount"
            | "InvalidQOS"
    )
}

/// What a failed Slurm command's error output says about its outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The command never reached the controller: nothing was done.
    Unreachable,
    /// The controller answered and refused the request: nothing was done.
    Refused,
    /// The outcome is unknown (the connection broke off after the request
    /// may have been sent, or the error is one this crate does not know).
    Unknown,
}

/// Classifies the error output of a failed command that asked the
/// controller to act. A connect failure happens before any request is
/// sent; a time-out or a dropped connection may follow a request the
/// controller already carried out.
pub fn classify(stderr: &str) -> Failure {
    const UNREACHABLE: [&str; 2] = [
        "Unable to contact slurm controller (connect failure)",
        "Connection refused",
    ];
    const UNKNOWN: [&str; 4] = [
        "Socket timed out",
        "Zero Bytes were transmitted or received",
        "Communication connection failure",
        "Connection reset",
    ];
    if UNKNOWN.iter().any(|m| stderr.contains(m)) {
        return Failure::Unknown;
    }
    if UNREACHABLE.iter().any(|m| stderr.contains(m)) {
        return Failure::Unreachable;
    }
    // The controller's own verdicts on a submission.
    const REFUSED: [&str; 9] = [
        "Batch job submission failed",
        "Requested node configuration is not available",
        "Invalid partition name",
        "Invalid generic resource",
        "invalid partition",
        "Invalid account",
        "Invalid qos",
        "can not be satisfied",
        "Invalid time limit",
    ];
    if REFUSED.iter().any(|m| stderr.contains(m)) {
        return Failure::Refused;
    }
    Failure::Unknown
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(run: &str, node: &str, attempt: u64) -> AttemptKey {
        AttemptKey {
            run_id: RunId::new(run),
            node: LogicalNodeId::parse(node).unwrap(),
            attempt: NodeAttemptId::from_raw(attempt),
        }
    }

    /// Recorded from Slurm 22.05 on the testbed: `squeue -h -t all -o '%i|%T|%N|%r|%j'`.
    const RECORDED_JOBS: &str = "\
1|CANCELLED|n1|None|prov+r1+workers-0+a1
2|FAILED||BadConstraints|x
4|RUNNING|n2|None|prov+r1+workers-1+a2
5|PENDING||Resources|prov+r1+workers-2+a3
6|COMPLETING|n3|NonZeroExitCode|prov+r1+workers-3+a1
";

    #[test]
    fn parses_recorded_squeue() {
        let rows = parse_squeue(RECORDED_JOBS).unwrap();
        assert_eq!(rows.len(), 5);
        assert_eq!(rows[2].nodes, "n2");
        assert_eq!(rows[3].state, "PENDING");
        assert_eq!(rows[3].reason, "Resources");
        assert!(rows[3].nodes.is_empty());
        let live: Vec<u64> = rows.iter().filter(|r| r.is_live()).map(|r| r.id).collect();
        assert_eq!(live, [4, 5]);
        let present: Vec<u64> = rows
            .iter()
            .filter(|r| r.is_present())
            .map(|r| r.id)
            .collect();
        assert_eq!(present, [4, 5, 6]);
    }

    #[test]
    fn a_job_name_with_the_separator_keeps_its_fields() {
        let rows = parse_squeue("7|RUNNING|n1|None|odd|name").unwrap();
        assert_eq!(rows[0].state, "RUNNING");
        assert_eq!(rows[0].name, "odd|name");
    }

    #[test]
    fn rejects_bad_lines() {
        assert!(matches!(
            parse_squeue("12|x"),
            Err(ParseError::Fields { .. })
        ));
        assert!(matches!(
            parse_squeue("x|RUNNING|n1|None|a"),
            Err(ParseError::JobId { .. })
        ));
        assert!(parse_steps("12|x|n1").is_err());
    }

    /// Recorded: `squeue -s -h -o '%i|%N|%j'` with an agent step running.
    #[test]
    fn parses_recorded_steps() {
        let rows = parse_steps("1.0|n1|provision-agent\n1.batch|n1|batch\n").unwrap();
        assert_eq!(rows[0].id(), "1.0");
        assert_eq!(rows[0].name, AGENT_STEP);
        assert_eq!(rows[1].step, "batch");
    }

    #[test]
    fn a_job_pending_for_its_partition_config_can_never_run() {
        // Recorded: `sbatch --cpus-per-task=4` on a one-CPU cluster.
        let rows = parse_squeue("1|PENDING||PartitionConfig|a\n2|PENDING||Resources|b\n").unwrap();
        assert!(is_hopeless_reason(&rows[0].reason));
        assert!(!is_hopeless_reason(&rows[1].reason));
        assert!(!is_hopeless_reason("None"));
    }

    #[test]
    fn parses_sbatch_parsable() {
        assert_eq!(parse_submitted("42\n").unwrap(), 42);
        assert_eq!(parse_submitted("42;cluster\n").unwrap(), 42);
        assert!(parse_submitted("").is_err());
    }

    #[test]
    fn job_names_round_trip_and_stay_within_their_run() {
        let k = key("r1", "workers-3", 7);
        let name = job_name(&k).unwrap();
        assert_eq!(name, "prov+r1+workers-3+a7");
        assert_eq!(parse_job_name(&RunId::new("r1"), &name), Some(k));
        assert_eq!(parse_job_name(&RunId::new("r"), &name), None);
        assert_eq!(parse_job_name(&RunId::new("r1"), "prov+r1+x+7"), None);
        assert!(job_name(&key("r 1", "w-0", 1)).is_none());
    }

    /// Recorded error output of Slurm 22.05's tools.
    #[test]
    fn classifies_recorded_errors() {
        let check =
            |stderr: &str, expected: Failure| assert_eq!(classify(stderr), expected, "{stderr}");
        check(
            "sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect failure)",
            Failure::Unreachable,
        );
        check(
            "scancel: error: Kill job error on job id 4: Unable to contact slurm controller (connect failure)",
            Failure::Unreachable,
        );
        check(
            "sbatch: error: CPU count per node can not be satisfied\nsbatch: error: Batch job submission failed: Requested node configuration is not available",
            Failure::Refused,
        );
        check(
            "sbatch: error: invalid partition specified: nope\nsbatch: error: Batch job submission failed: Invalid partition name specified",
            Failure::Refused,
        );
        check(
            "sbatch: error: Batch job submission failed: Socket timed out on send/recv operation",
            Failure::Unknown,
        );
        check("something new", Failure::Unknown);
    }
}
