//! The user-data of an instance: a shell script (run by cloud-init at first
//! boot, or by the testbed) that writes the node agent's boot order to a
//! `0600` file and starts the agent in its remote boot mode, which dials the
//! controller's listener.
//!
//! # Caveat: the credential travels in user-data
//! The boot order holds the attempt's join credential. User-data is
//! readable by anyone on the instance who can reach the metadata service,
//! and by whoever may describe the instance's attributes. Until the
//! transport-security work brings a single-use bootstrap token
//! (design §23), the per-attempt credential is what travels: it admits
//! only this attempt's agent, never another node's, and dies with the
//! attempt.

use provisioning_agent::agent::env;

/// The heredoc terminator; a boot order is one JSON line, so it never
/// contains this line.
const ORDER_END: &str = "PROVISION_BOOT_ORDER_END";

/// The directory the script keeps its files in, below which each attempt
/// gets its own; `PROVISION_BOOT_DIR` overrides it (the testbed does).
pub const DEFAULT_BOOT_DIR: &str = "/var/lib/provision";

fn quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

/// The script for the attempt `attempt_dir` (`run/node/aN`) that starts
/// `agent` (with `args`) on `order` (the boot order's JSON, one line), with
/// the agent settings `agent_env`.
pub fn script(
    attempt_dir: &str,
    agent: &str,
    args: &[String],
    agent_env: &[(&str, String)],
    order: &str,
) -> String {
    debug_assert!(!order.contains('\n'), "a boot order is one JSON line");
    let mut exported = String::new();
    for (name, value) in agent_env {
        exported.push_str(&format!("export {name}={}\n", quote(value)));
    }
    let args: String = args.iter().map(|a| format!(" {}", quote(a))).collect();
    format!(
        "#!/bin/sh\n\
         # provision: starts the node agent of {attempt_dir}\n\
         set -eu\n\
         umask 077\n\
         dir=\"${{PROVISION_BOOT_DIR:-{DEFAULT_BOOT_DIR}}}\"/{dir}\n\
         mkdir -p \"$dir\"\n\
         cat > \"$dir/boot.json\" <<'{ORDER_END}'\n\
         {order}\n\
         {ORDER_END}\n\
         export {boot}=\"$dir/boot.json\"\n\
         export {status}=\"$dir/status\"\n\
         {exported}\
         exec {agent}{args} >>\"$dir/agent.log\" 2>&1\n",
        dir = quote(attempt_dir),
        boot = env::BOOT_FILE,
        status = env::STATUS_FILE,
        agent = quote(agent),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_script_writes_the_order_to_a_private_file_and_execs_the_agent() {
        let text = script(
            "demo/w-0/a1",
            "/usr/local/bin/provision-agent",
            &["it's".to_owned()],
            &[(env::REJOIN_WINDOW_MS, "5000".to_owned())],
            r#"{"run":"demo"}"#,
        );
        assert!(text.starts_with("#!/bin/sh\n"));
        assert!(text.contains("umask 077\n"));
        assert!(text.contains("\n{\"run\":\"demo\"}\nPROVISION_BOOT_ORDER_END\n"));
        assert!(text.contains("exec '/usr/local/bin/provision-agent' 'it'\\''s' >>"));
        assert!(text.contains("export PROVISION_AGENT_REJOIN_WINDOW_MS='5000'\n"));
    }
}
