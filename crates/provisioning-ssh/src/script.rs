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
//!     session/pid                          leader of its process group
//!     session/log                          the workload's output
//! ```

use provisioning::BootParams;

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
        kill -s TERM -- "-$p" 2>/dev/null
        i=0
        while kill -s 0 -- "-$p" 2>/dev/null && [ "$i" -lt 30 ]; do sleep 0.1; i=$((i+1)); done
        kill -s KILL -- "-$p" 2>/dev/null
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

/// Lists the claims of `run` as `CLAIM {node}/a{attempt}` lines, then `END`.
pub(crate) fn list(run: &str) -> String {
    format!(
        r#"if cd "$root"/{r} 2>/dev/null; then
  for d in */a*; do [ -d "$d" ] && echo "CLAIM $d"; done
fi
echo END
"#,
        r = quote(run)
    )
}

/// Starts the bootstrap session of the claim at `path`: `ADOPTED` when it
/// runs, `NOTFOUND` without the claim, `VERIFYFAILED n` when verify command
/// `n` (from 1) failed (nothing started), else `STARTED` with the workload
/// running detached in a session of its own.
pub(crate) fn start_session(path: &str, boot: &BootParams) -> String {
    let mut script = format!(
        "claim=\"$root\"/{p}\n[ -d \"$claim\" ] || {{ echo NOTFOUND; exit 0; }}\n\
         if [ -d \"$claim/session\" ]; then echo ADOPTED; exit 0; fi\n",
        p = quote(path)
    );
    for (name, value) in &boot.env {
        let shell_name = name.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if shell_name {
            script.push_str(&format!("export {name}={}\n", quote(value)));
        }
    }
    for (number, command) in boot.verify_commands.iter().enumerate() {
        script.push_str(&format!(
            "sh -c {} </dev/null >/dev/null || {{ echo \"VERIFYFAILED {}\"; exit 0; }}\n",
            quote(command),
            number + 1
        ));
    }
    script.push_str("mkdir \"$claim/session\" || { echo SESSIONFAILED; exit 6; }\n");
    if !boot.start_command.is_empty() {
        script.push_str(&format!(
            "setsid sh -c 'echo $$ > \"$1\"; exec sh -c \"$2\"' sh \"$claim/session/pid\" {} </dev/null >\"$claim/session/log\" 2>&1 &\n\
             i=0; while [ ! -s \"$claim/session/pid\" ] && [ \"$i\" -lt 50 ]; do sleep 0.1; i=$((i+1)); done\n",
            quote(&boot.start_command)
        ));
    }
    script.push_str("echo STARTED\n");
    script
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

/// Starts the installed agent `agent` for the claim at `path` in remote boot
/// mode: the boot order (with its credential) is read from standard input
/// into a `0600` file of the session, which the agent removes once read;
/// the agent's pid (it leads its own session and group) goes to
/// `session/pid`, so `stop_session` stops it. Prints `STARTED`, `ADOPTED`
/// (a session exists), `NOTFOUND` (no claim) or `FAILED`.
pub(crate) fn launch_agent(root: &str, path: &str, agent: &str) -> String {
    format!(
        r#"root={r}; claim="$root"/{p}
if [ ! -d "$claim" ]; then cat >/dev/null; echo NOTFOUND; exit 0; fi
if ! mkdir "$claim/session" 2>/dev/null; then cat >/dev/null; echo ADOPTED; exit 0; fi
s="$claim/session"
if ! (umask 077; cat >"$s/order"); then rm -f "$s/order"; echo FAILED; exit 6; fi
PROVISION_AGENT_BOOT_FILE="$s/order" PROVISION_AGENT_STATUS_FILE="$s/status" {a} </dev/null >"$s/log" 2>&1 &
echo $! >"$s/pid"
echo STARTED
"#,
        r = quote(root),
        p = quote(path),
        a = quote(agent),
    )
}
