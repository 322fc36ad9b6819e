//! The seam to Slurm's command-line tools: [`SlurmCli`] runs one bounded
//! command and hands back its output; [`SystemCli`] is the real one. The
//! plugin parses what comes back (see [`crate::parse`]), so its parsing and
//! classification are tested on recorded outputs, and a test can put faults
//! between the plugin and the real tools.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use async_trait::async_trait;
use tokio::io::AsyncReadExt;
use tokio::process::Command;

/// The Slurm tools the plugin calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tool {
    /// `sbatch`: submits a node's holding job.
    Sbatch,
    /// `squeue`: lists jobs and steps (read only).
    Squeue,
    /// `scancel`: cancels a job or a step.
    Scancel,
}

impl Tool {
    /// The program's name.
    pub fn program(self) -> &'static str {
        match self {
            Tool::Sbatch => "sbatch",
            Tool::Squeue => "squeue",
            Tool::Scancel => "scancel",
        }
    }
}

/// What a finished command printed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommandOutput {
    /// Whether it exited with status 0.
    pub success: bool,
    /// Its standard output.
    pub stdout: String,
    /// Its standard error.
    pub stderr: String,
}

/// A command that did not finish.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CommandFailure {
    /// It could not be started: it did nothing.
    #[error("cannot run {0}")]
    NotStarted(String),
    /// It did not finish in time and was killed: it may have acted.
    #[error("{program} did not finish within {timeout:?}")]
    TimedOut {
        /// The program.
        program: String,
        /// Its bound.
        timeout: Duration,
    },
}

/// Runs Slurm commands.
///
/// # Assumptions
/// Every call is bounded: it returns [`CommandFailure::TimedOut`] rather
/// than wait forever.
#[async_trait]
pub trait SlurmCli: Send + Sync + 'static {
    /// Runs `tool` with `args`.
    async fn run(&self, tool: Tool, args: &[String]) -> Result<CommandOutput, CommandFailure>;

    /// The command that starts a job step (`srun`), with the environment the
    /// other tools get. The caller spawns it and owns the child.
    fn step_command(&self, args: &[String]) -> Command;
}

/// The real tools, from `PATH`, with `SLURM_CONF` set when configured.
#[derive(Clone, Debug)]
pub struct SystemCli {
    slurm_conf: Option<PathBuf>,
    timeout: Duration,
}

/// The most output kept from one command.
const OUTPUT_BYTES_MAX: u64 = 4 * 1024 * 1024;

impl SystemCli {
    /// The tools with `slurm_conf` (or their default) and `timeout` per call.
    pub fn new(slurm_conf: Option<PathBuf>, timeout: Duration) -> Self {
        SystemCli {
            slurm_conf,
            timeout,
        }
    }

    fn command(&self, program: &str) -> Command {
        let mut command = Command::new(program);
        if let Some(conf) = &self.slurm_conf {
            command.env("SLURM_CONF", conf);
        }
        command
    }
}

#[async_trait]
impl SlurmCli for SystemCli {
    async fn run(&self, tool: Tool, args: &[String]) -> Result<CommandOutput, CommandFailure> {
        let program = tool.program();
        let mut child = self
            .command(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| CommandFailure::NotStarted(format!("{program}: {e}")))?;
        let mut stdout = child.stdout.take();
        let mut stderr = child.stderr.take();
        let finished = async {
            let mut out = Vec::new();
            let mut err = Vec::new();
            let read_out = async {
                if let Some(s) = stdout.as_mut() {
                    let _ = s.take(OUTPUT_BYTES_MAX).read_to_end(&mut out).await;
                }
            };
            let read_err = async {
                if let Some(s) = stderr.as_mut() {
                    let _ = s.take(OUTPUT_BYTES_MAX).read_to_end(&mut err).await;
                }
            };
            tokio::join!(read_out, read_err);
            let status = child.wait().await;
            (status, out, err)
        };
        match tokio::time::timeout(self.timeout, finished).await {
            Ok((Ok(status), out, err)) => Ok(CommandOutput {
                success: status.success(),
                stdout: String::from_utf8_lossy(&out).into_owned(),
                stderr: String::from_utf8_lossy(&err).into_owned(),
            }),
            Ok((Err(e), _, _)) => Err(CommandFailure::NotStarted(format!(
                "{program}: cannot wait for it: {e}"
            ))),
            // The child is killed when dropped (kill_on_drop).
            Err(_) => Err(CommandFailure::TimedOut {
                program: program.to_owned(),
                timeout: self.timeout,
            }),
        }
    }

    fn step_command(&self, args: &[String]) -> Command {
        let mut command = self.command("srun");
        command.args(args);
        command
    }
}
