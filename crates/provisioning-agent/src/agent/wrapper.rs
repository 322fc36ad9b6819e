//! The wrapper role: runs one shell command so that it dies with its agent.
//!
//! The agent cannot set a parent-death signal in a child without `unsafe`
//! code between fork and exec, so it starts this same binary instead. The
//! wrapper switches to the boot's user when one is set, arms its own
//! parent-death signal (after the switch, which would clear it), checks that
//! its parent is still the agent that started it, and replaces itself with
//! `/bin/sh -c`. The signal survives `exec`, so the shell dies with the agent.

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::process::ExitCode;

use nix::sys::prctl;
use nix::sys::signal::Signal;
use nix::unistd::{Gid, Uid, getppid, setgid, setgroups, setuid};

use super::env;

/// The exit code when the wrapper itself fails (as `env` and `timeout` do).
const EXIT_WRAPPER_FAILED: u8 = 125;

/// The exit code when the shell cannot be executed.
const EXIT_NO_SHELL: u8 = 127;

/// The shell every command runs in.
const SHELL: &str = "/bin/sh";

/// `$0` of the shell command, as seen in `ps`.
const SHELL_COMMAND_NAME: &str = "provision-workload";

/// Writes a line to standard error, ignoring a broken pipe: the wrapper
/// must never panic on its way out.
fn complain(message: String) {
    let _ = writeln!(std::io::stderr(), "provision workload wrapper: {message}");
}

/// Switches to the user and group named in the environment, if any.
fn switch_user() -> Result<(), String> {
    let id = |name: &str| -> Result<Option<u32>, String> {
        match std::env::var(name) {
            Ok(value) => value
                .parse()
                .map(Some)
                .map_err(|_| format!("bad {name}: {value:?}")),
            Err(_) => Ok(None),
        }
    };
    let (Some(uid), Some(gid)) = (id(env::WORKLOAD_UID)?, id(env::WORKLOAD_GID)?) else {
        return Ok(());
    };
    let gid = Gid::from_raw(gid);
    // Supplementary groups first, then the group, then the user: each step
    // needs the privileges the next one gives up.
    setgroups(&[gid]).map_err(|error| format!("cannot set groups: {error}"))?;
    setgid(gid).map_err(|error| format!("cannot switch to group {gid}: {error}"))?;
    setuid(Uid::from_raw(uid)).map_err(|error| format!("cannot switch to user {uid}: {error}"))
}

pub(super) fn run() -> ExitCode {
    if let Err(error) = switch_user() {
        complain(error);
        return ExitCode::from(EXIT_WRAPPER_FAILED);
    }
    if let Err(error) = prctl::set_pdeathsig(Signal::SIGKILL) {
        complain(format!("cannot arm the parent-death signal: {error}"));
        return ExitCode::from(EXIT_WRAPPER_FAILED);
    }
    let expected = std::env::var(env::WORKLOAD_PARENT_PID)
        .ok()
        .and_then(|pid| pid.parse::<i32>().ok());
    if expected != Some(getppid().as_raw()) {
        complain("the agent that started it is gone".to_owned());
        return ExitCode::from(EXIT_WRAPPER_FAILED);
    }
    let Ok(command) = std::env::var(env::WORKLOAD_COMMAND) else {
        complain(format!("{} is not set", env::WORKLOAD_COMMAND));
        return ExitCode::from(EXIT_WRAPPER_FAILED);
    };
    let args: Vec<String> = match std::env::var(env::WORKLOAD_ARGS) {
        Ok(json) => match serde_json::from_str(&json) {
            Ok(args) => args,
            Err(error) => {
                complain(format!("bad {}: {error}", env::WORKLOAD_ARGS));
                return ExitCode::from(EXIT_WRAPPER_FAILED);
            }
        },
        Err(_) => Vec::new(),
    };
    let error = std::process::Command::new(SHELL)
        .arg("-c")
        .arg(command)
        .arg(SHELL_COMMAND_NAME)
        .args(args)
        .env_remove(env::ROLE)
        .env_remove(env::WORKLOAD_COMMAND)
        .env_remove(env::WORKLOAD_ARGS)
        .env_remove(env::WORKLOAD_PARENT_PID)
        .env_remove(env::WORKLOAD_UID)
        .env_remove(env::WORKLOAD_GID)
        .exec();
    complain(format!("cannot run {SHELL}: {error}"));
    ExitCode::from(EXIT_NO_SHELL)
}
