//! The Slurm tools as the plugin under test runs them: the real tools on
//! the testbed, with the fault of the call in progress applied to one of
//! its commands.
//!
//! The backend runs each plugin call inside [`with_fault`]; the fault rides
//! a task-local value, so it reaches the commands of that call only — never
//! those of a call polled next to it, nor the plugin's background loss
//! watch. The first command that the fault fits takes it:
//!
//! | Fault | Command | What really happens |
//! |---|---|---|
//! | `definite` | the call's first | it runs against the testbed's closed controller port: a connect failure before anything was sent |
//! | `ambiguous-undone` | the call's first | it runs against the closed port with Slurm's default retries and is killed by a 0.5 s time-out while still retrying: its outcome is unknown to the plugin, and nothing was done |
//! | `ambiguous-done` | the call's acting one (`sbatch`, `scancel`; a lookup's `squeue`) | it runs for real; its reply is thrown away as if it had timed out |
//! | `hang` | the call's first | it is started and stopped at once with `SIGSTOP`; `SIGCONT` when the trace releases it (or the teardown does) |

use std::path::Path;
use std::process::Stdio;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use provisioning::OperationId;
use provisioning_conformance::trace::Fault;
use provisioning_slurm::{CommandFailure, CommandOutput, SlurmCli, SystemCli, Tool};
use tokio::io::AsyncReadExt;

use super::shared::{Shared, SlurmShared};

/// The bound on one command that is not faulted.
pub(crate) const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

/// The time-out that kills a command still retrying to connect.
const RETRYING_TIMEOUT: Duration = Duration::from_millis(500);

/// How often a stopped command looks whether it was released.
const HOLD_POLL_INTERVAL: Duration = Duration::from_millis(2);

/// The longest a command stays stopped (a safety bound: the trace or the
/// teardown releases it long before).
const HOLD_WAIT_MAX: Duration = Duration::from_secs(120);

/// The most output kept from a stopped command.
const OUTPUT_BYTES_MAX: u64 = 4 * 1024 * 1024;

/// The fault of one call, until one of its commands takes it.
#[derive(Debug)]
pub(crate) struct CallFault {
    op: OperationId,
    fault: Mutex<Option<Fault>>,
    /// The command an `ambiguous-done` fault is meant for.
    acting: Tool,
}

impl CallFault {
    /// `fault` for call `op`, whose acting command is `acting`.
    pub(crate) fn new(op: OperationId, fault: Fault, acting: Tool) -> Arc<Self> {
        Arc::new(CallFault {
            op,
            fault: Mutex::new(Some(fault)),
            acting,
        })
    }

    /// Whether no command took the fault.
    pub(crate) fn untaken(&self) -> bool {
        self.fault
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
    }

    fn take_for(&self, tool: Tool) -> Option<Fault> {
        let mut fault = self.fault.lock().unwrap_or_else(PoisonError::into_inner);
        match *fault {
            Some(Fault::AmbiguousDone) if tool != self.acting => None,
            _ => fault.take(),
        }
    }
}

tokio::task_local! {
    static CALL: Arc<CallFault>;
}

/// Runs `call` with `fault` applied to its commands.
pub(crate) async fn with_fault<F: std::future::Future>(
    fault: Option<Arc<CallFault>>,
    call: F,
) -> F::Output {
    match fault {
        Some(fault) => CALL.scope(fault, call).await,
        None => call.await,
    }
}

/// The plugin's tools. See the module docs.
pub(crate) struct L3Cli {
    real: SystemCli,
    closed: SystemCli,
    retrying: SystemCli,
    conf: std::path::PathBuf,
    shared: Arc<Shared>,
}

impl L3Cli {
    /// The tools on `conf`, with faults against `closed` (fails at once)
    /// and `slow_closed` (retries).
    pub(crate) fn new(conf: &Path, closed: &Path, slow_closed: &Path, shared: Arc<Shared>) -> Self {
        L3Cli {
            real: SystemCli::new(Some(conf.to_owned()), COMMAND_TIMEOUT),
            closed: SystemCli::new(Some(closed.to_owned()), COMMAND_TIMEOUT),
            retrying: SystemCli::new(Some(slow_closed.to_owned()), RETRYING_TIMEOUT),
            conf: conf.to_owned(),
            shared,
        }
    }

    /// Runs `tool` stopped until its hang is released.
    async fn run_stopped(
        &self,
        op: OperationId,
        tool: Tool,
        args: &[String],
    ) -> Result<CommandOutput, CommandFailure> {
        let program = tool.program();
        let mut child = tokio::process::Command::new(program)
            .args(args)
            .env("SLURM_CONF", &self.conf)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| CommandFailure::NotStarted(format!("{program}: {e}")))?;
        let Some(pid) = child.id() else {
            return Err(CommandFailure::NotStarted(format!("{program}: no pid")));
        };
        signal(pid, Signal::SIGSTOP);
        let serial = self.shared.hang_on(op, pid);
        let release = Release {
            shared: &self.shared,
            serial,
        };
        let deadline = Instant::now() + HOLD_WAIT_MAX;
        while !self.shared.released(serial) && Instant::now() < deadline {
            tokio::time::sleep(HOLD_POLL_INTERVAL).await;
        }
        drop(release);
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
            (child.wait().await, out, err)
        };
        match tokio::time::timeout(COMMAND_TIMEOUT, finished).await {
            Ok((Ok(status), out, err)) => Ok(CommandOutput {
                success: status.success(),
                stdout: String::from_utf8_lossy(&out).into_owned(),
                stderr: String::from_utf8_lossy(&err).into_owned(),
            }),
            Ok((Err(e), _, _)) => Err(CommandFailure::NotStarted(format!(
                "{program}: cannot wait for it: {e}"
            ))),
            Err(_) => Err(CommandFailure::TimedOut {
                program: program.to_owned(),
                timeout: COMMAND_TIMEOUT,
            }),
        }
    }
}

/// Continues a stopped command when its call ends without a release.
struct Release<'a> {
    shared: &'a Shared,
    serial: u64,
}

impl Drop for Release<'_> {
    fn drop(&mut self) {
        if let Some(hang) = self.shared.end_stop(self.serial) {
            signal(hang.what, Signal::SIGCONT);
        }
        self.shared.notify();
    }
}

/// Sends `signal` to `pid` (a process this test started); a process that
/// is gone already is no error.
pub(crate) fn signal(pid: u32, signal: Signal) {
    if let Ok(pid) = i32::try_from(pid) {
        let _ = kill(Pid::from_raw(pid), signal);
    }
}

#[async_trait]
impl SlurmCli for L3Cli {
    async fn run(&self, tool: Tool, args: &[String]) -> Result<CommandOutput, CommandFailure> {
        let call = CALL.try_with(Arc::clone).ok();
        let Some((call, fault)) = call.and_then(|c| c.take_for(tool).map(|f| (c, f))) else {
            return self.real.run(tool, args).await;
        };
        match fault {
            Fault::Definite => {
                let outcome = self.closed.run(tool, args).await;
                self.shared.applied(|f| f.connect_failures += 1);
                outcome
            }
            Fault::AmbiguousUndone => {
                let outcome = self.retrying.run(tool, args).await;
                self.shared.applied(|f| f.command_timeouts += 1);
                outcome
            }
            Fault::AmbiguousDone => {
                let _ = self.real.run(tool, args).await;
                self.shared.applied(|f| f.replies_lost += 1);
                Err(CommandFailure::TimedOut {
                    program: tool.program().to_owned(),
                    timeout: COMMAND_TIMEOUT,
                })
            }
            Fault::Hang => self.run_stopped(call.op, tool, args).await,
            Fault::Succeed | Fault::NotReady | Fault::Panic => self.real.run(tool, args).await,
        }
    }

    fn step_command(&self, args: &[String]) -> tokio::process::Command {
        self.real.step_command(args)
    }
}
