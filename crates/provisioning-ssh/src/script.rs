//! The shell scripts the plugin runs on hosts (POSIX `sh`, with `flock` and
//! `setsid` from util-linux). Each prints one verdict word as its last line
//! of output; `$root` (the claim root) is set before each.
//!
//! Layout on a host:
//!
//! ```text
//! {claim_root}/.lock                       flock(1) taken while claiming
//! {claim_root}/{run}/{node}/a{attempt}/    the claim: one slot (mkdir)
//!     session/                             the bootstrap session (mkdir)
//!     session/pid                          the agent: leader of its session and group
//!     session/order                        its boot order (0600), removed once read
//!     session/status                       its stages, one JSON line each
//!     session/log                          the agent's and the workload's output
//! {claim_root}/.agents/{sha256}            the agent executable, by content hash
//! ```

use crate::ssh::quote;

/// Prints `PRESENT` or `ABSENT` for the claim at `path`.
pub(crate) fn probe(path: &str) -> String {
    format!(
        "if [ -d \"$root\"/{p} ]; then echo PRESENT; else echo ABSENT; fi\n",
        p = quote(path)
    )
}

/// Claims a slot for `path` unless the host's claims already fill `slots`:
/// `CREATED`, `ADOPTED` (the claim exists), `FULL n`, or a refusal
/// (`NOFLOCK`, `NOROOT`, `BUSY`, `CLAIMFAILED`) that claimed nothing.
pub(crate) fn claim(path: &str, slots: u32) -> String {
    let parent = path.rsplit_once('/').map_or(path, |(parent, _)| parent);
    format!(
        r#"command -v flock >/dev/null 2>&1 || {{ echo NOFLOCK; exit 4; }}
mkdir -p "$root" || {{ echo NOROOT; exit 5; }}
exec 9>>"$root/.lock"
flock -w 20 9 || {{ echo BUSY; exit 3; }}
claim="$root"/{p}
if [ -d "$claim" ]; then echo ADOPTED; exit 0; fi
used=$(find "$root" -mindepth 3 -maxdepth 3 -type d | wc -l)
if [ "$used" -ge {slots} ]; then echo "FULL $used"; exit 0; fi
mkdir -p "$root"/{parent} && mkdir "$claim" || {{ echo CLAIMFAILED; exit 6; }}
echo CREATED
"#,
        p = quote(path),
        parent = quote(parent),
    )
}

/// The shell function `stop_session DIR`: stops the process group recorded
/// in `DIR/session/pid` (`TERM`, a bounded wait, then `KILL`) and removes
/// the session directory.
const STOP_SESSION: &str = r#"stop_session() {
  if [ -f "$1/session/pid" ]; then
    p=$(cat "$1/session/pid")
    case "$p" in
      ''|*[!0-9]*) ;;
      *)
        kill -s TERM -- "-$p" 2>/dev/null || kill -s TERM "$p" 2>/dev/null
        i=0
        while { kill -s 0 -- "-$p" || kill -s 0 "$p"; } 2>/dev/null && [ "$i" -lt 50 ]; do sleep 0.1; i=$((i+1)); done
        kill -s KILL -- "-$p" 2>/dev/null
        kill -s KILL "$p" 2>/dev/null
        ;;
    esac
  fi
  rm -rf "$1/session"
}
"#;

/// Stops the session of the claim at `path`: `STOPPED` or `ABSENT`.
pub(crate) fn stop_session(path: &str) -> String {
    format!(
        "{STOP_SESSION}claim=\"$root\"/{p}\n[ -d \"$claim\" ] || {{ echo ABSENT; exit 0; }}\nstop_session \"$claim\"\necho STOPPED\n",
        p = quote(path)
    )
}

/// Stops the claim's processes and removes it: `DESTROYED` or `ABSENT`.
pub(crate) fn release(path: &str) -> String {
    let mut parents = Vec::new();
    let mut rest = path;
    while let Some((parent, _)) = rest.rsplit_once('/') {
        parents.push(format!("\"$root\"/{}", quote(parent)));
        rest = parent;
    }
    format!(
        r#"{STOP_SESSION}claim="$root"/{p}
[ -d "$claim" ] || {{ echo ABSENT; exit 0; }}
stop_session "$claim"
rm -rf "$claim" || {{ echo RMFAILED; exit 6; }}
rmdir {parents} 2>/dev/null
echo DESTROYED
"#,
        p = quote(path),
        parents = parents.join(" "),
    )
}

/// Lists the claims of `run` as `CLAIM {node}/a{attempt}` lines, with a
/// trailing ` session` when the claim has a bootstrap session (an agent was
/// started for it), then `END`.
pub(crate) fn list(run: &str) -> String {
    format!(
        r#"if cd "$root"/{r} 2>/dev/null; then
  for d in */a*; do
    [ -d "$d" ] || continue
    if [ -d "$d/session" ]; then echo "CLAIM $d session"; else echo "CLAIM $d"; fi
  done
fi
echo END
"#,
        r = quote(run)
    )
}

/// The line that ends the boot order's here-document. A boot order is one
/// line of JSON, which starts with `{`, so it can never be this line.
const ORDER_END: &str = "PROVISIONING_BOOT_ORDER_END";

/// What [`boot`] starts: the installed agent and its boot order.
pub(crate) struct Boot<'a> {
    /// The agent executable on the host.
    pub(crate) agent: &'a str,
    /// Its leading arguments (`["agent"]` for the `provision` binary).
    pub(crate) args: &'a [String],
    /// Verify commands run (with `env`) before anything is started.
    pub(crate) verify_commands: &'a [String],
    /// Their environment.
    pub(crate) env: &'a std::collections::BTreeMap<String, String>,
    /// Extra environment of the agent itself (its re-join window, …).
    pub(crate) agent_env: &'a [(&'a str, String)],
    /// The boot order, one line of JSON (it carries the credential).
    pub(crate) order: &'a str,
}

/// The bootstrap of the claim at `path`, one script sent on standard input
/// (so neither the credential nor the boot's commands and environment ever
/// reach a command line): `NOTFOUND` without the claim, `ADOPTED` when a
/// session exists, `NOAGENT` when the agent is not installed,
/// `VERIFYFAILED n` when verify command `n` (from 1) failed, `FAILED` when
/// the order could not be written (nothing started in those cases), else
/// `STARTED`: the agent runs detached (it starts a session of its own) with
/// its boot order in a `0600` file of the session that it removes once
/// read, and its pid in `session/pid`.
pub(crate) fn boot(path: &str, boot: &Boot<'_>) -> String {
    let mut script = format!(
        "claim=\"$root\"/{p}; a={a}\n\
         [ -d \"$claim\" ] || {{ echo NOTFOUND; exit 0; }}\n\
         if [ -d \"$claim/session\" ]; then echo ADOPTED; exit 0; fi\n\
         [ -x \"$a\" ] || {{ echo NOAGENT; exit 0; }}\n",
        p = quote(path),
        a = quote(boot.agent),
    );
    let mut assignments = String::new();
    for (name, value) in boot.env {
        if is_shell_name(name) {
            assignments.push_str(&format!("{name}={} ", quote(value)));
        }
    }
    for (number, command) in boot.verify_commands.iter().enumerate() {
        script.push_str(&format!(
            "{assignments}sh -c {} </dev/null >/dev/null || {{ echo \"VERIFYFAILED {}\"; exit 0; }}\n",
            quote(command),
            number + 1
        ));
    }
    let mut launch = String::new();
    for (name, value) in boot.agent_env {
        launch.push_str(&format!("{name}={} ", quote(value)));
    }
    launch.push_str("\"$a\"");
    for arg in boot.args {
        launch.push(' ');
        launch.push_str(&quote(arg));
    }
    script.push_str(&format!(
        r#"mkdir "$claim/session" 2>/dev/null || {{ echo ADOPTED; exit 0; }}
s="$claim/session"
if ! (umask 077; cat >"$s/order" <<'{ORDER_END}'
{order}
{ORDER_END}
); then rm -rf "$s"; echo FAILED; exit 6; fi
PROVISION_AGENT_BOOT_FILE="$s/order" PROVISION_AGENT_STATUS_FILE="$s/status" {launch} </dev/null >"$s/log" 2>&1 &
echo $! >"$s/pid"
echo STARTED
"#,
        order = boot.order.trim(),
    ));
    script
}

/// Prints the last lines of the session's status file and log of the claim
/// at `path`, then `END` (nothing when there is no session).
pub(crate) fn session_report(path: &str) -> String {
    format!(
        r#"s="$root"/{p}/session
if [ -f "$s/status" ]; then tail -n 5 "$s/status" | sed 's/^/STATUS /'; fi
if [ -f "$s/log" ]; then tail -n 5 "$s/log" | sed 's/^/LOG /'; fi
echo END
"#,
        p = quote(path)
    )
}

/// Whether `name` can be `export`ed by a POSIX shell.
fn is_shell_name(name: &str) -> bool {
    name.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Prints `PRESENT` when the agent `$root/.agents/{hash}` is installed,
/// else `ABSENT`.
pub(crate) fn agent_present(hash: &str) -> String {
    format!(
        "if [ -x \"$root\"/.agents/{h} ]; then echo PRESENT; else echo ABSENT; fi\n",
        h = quote(hash)
    )
}

/// A `sh -c` script (its standard input is the file) that installs an agent
/// binary as `$root/.agents/{hash}` unless it is there: `PRESENT`,
/// `INSTALLED`, or `MISMATCH`/`FAILED` (nothing installed). The file is
/// written beside its final name and renamed into place only after its hash
/// checked out, so a broken upload never leaves a runnable file.
pub(crate) fn install_agent(root: &str, hash: &str) -> String {
    format!(
        r#"root={r}; dir="$root/.agents"; f="$dir/{hash}"
if [ -x "$f" ]; then cat >/dev/null; echo PRESENT; exit 0; fi
mkdir -p "$dir" || {{ echo FAILED; exit 6; }}
tmp="$f.part.$$"
if ! cat >"$tmp"; then rm -f "$tmp"; echo FAILED; exit 6; fi
got=$(sha256sum "$tmp" | cut -d' ' -f1)
if [ "$got" != {hash} ]; then rm -f "$tmp"; echo MISMATCH; exit 7; fi
chmod 0755 "$tmp" && mv -f "$tmp" "$f" || {{ rm -f "$tmp"; echo FAILED; exit 6; }}
echo INSTALLED
"#,
        r = quote(root),
    )
}
