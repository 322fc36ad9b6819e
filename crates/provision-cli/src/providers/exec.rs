//! `provider = "exec"`: a provider program in any language, speaking the
//! JSON-lines protocol of `docs/plugin-protocol.md` (`provisioning-exec`).
//!
//! ```toml
//! [providers.exec]
//! command = ["python3", "provider.py"]
//! call_timeout_secs = 30        # optional: a reply later than this is ambiguous
//! ```

#[cfg(test)]
use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

use provisioning::RunId;
use provisioning_agent::RunSecret;
use provisioning_runtime::PluginEntry;
use serde::Deserialize;
use toml::Spanned;
use toml::de::DeValue;

use super::{ConfiguredProvider, PluginStart, ProviderMemo, ProviderModule};
use crate::located::{Locator, ShapeFileError};

/// The provider kind a `[providers.exec]` program serves.
const KIND: &str = "exec";

/// The provider-program module.
pub(super) struct Exec;

/// `[providers.exec]` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileExecProvider {
    command: Vec<String>,
    #[serde(default)]
    call_timeout_secs: Option<u64>,
}

/// `[providers.exec]`: the program and its call timeout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ExecSettings {
    /// The program and its arguments.
    pub(crate) command: Vec<String>,
    /// How long one call may wait for its reply.
    pub(crate) call_timeout: Option<Duration>,
}

impl ProviderModule for Exec {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn needs_table(&self) -> bool {
        true
    }

    fn configure(
        &self,
        at: &Locator<'_>,
        _run_id: &RunId,
        table: Option<Spanned<DeValue<'_>>>,
    ) -> Result<Arc<dyn ConfiguredProvider>, ShapeFileError> {
        let spanned: Spanned<FileExecProvider> = super::read_table(at, KIND, table)?;
        let exec = spanned.get_ref();
        if exec.command.first().is_none_or(|c| c.trim().is_empty()) {
            return Err(at.error(
                Some(spanned.span()),
                Some("providers.exec.command".to_owned()),
                "command must name the provider program, e.g. [\"python3\", \"provider.py\"]",
            ));
        }
        if exec.call_timeout_secs == Some(0) {
            return Err(at.error(
                Some(spanned.span()),
                Some("providers.exec.call_timeout_secs".to_owned()),
                "call_timeout_secs must be at least 1",
            ));
        }
        Ok(Arc::new(ExecSettings {
            command: exec.command.clone(),
            call_timeout: exec.call_timeout_secs.map(Duration::from_secs),
        }))
    }
}

impl ConfiguredProvider for ExecSettings {
    fn start<'a>(
        &'a self,
        _run_id: &'a RunId,
        _secret: RunSecret,
        _memo: &'a ProviderMemo,
    ) -> PluginStart<'a> {
        Box::pin(start_exec(self))
    }

    #[cfg(test)]
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The plugin of a `[providers.exec]` program: started at once, so a program
/// that cannot run is an error before anything else starts.
///
/// # Errors
/// When the program cannot be started or fails its handshake.
async fn start_exec(settings: &ExecSettings) -> anyhow::Result<PluginEntry> {
    let (command, args) = settings
        .command
        .split_first()
        .ok_or_else(|| anyhow::anyhow!("[providers.exec] names no command"))?;
    let mut config =
        provisioning_exec::ExecConfig::new(command.clone(), args.iter().cloned()).with_kind(KIND);
    if let Some(timeout) = settings.call_timeout {
        config = config.with_call_timeout(timeout);
    }
    let plugin = provisioning_exec::ExecPlugin::start(config)
        .await
        .map_err(|e| anyhow::anyhow!("provider program {command}: {e}"))?;
    tracing::info!(program = %command, "exec provider started");
    Ok(PluginEntry::new(Arc::new(plugin)))
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::shape_file::{ShapeSource, parse};

    fn parse_text(text: &str) -> Result<ShapeSource, ShapeFileError> {
        parse(Path::new("shape.toml"), text, &super::super::kinds())
    }

    #[test]
    fn an_exec_table_names_its_program_and_serves_exec_groups() {
        let text = "run = \"r\"\n[providers.exec]\ncommand = [\"python3\", \"p.py\"]\ncall_timeout_secs = 7\n[[group]]\nid = \"w\"\ncount = 2\nprovider = \"exec\"\n";
        let source = parse_text(text).expect("valid");
        let exec = source.settings::<ExecSettings>().expect("exec settings");
        assert_eq!(exec.command, ["python3", "p.py"]);
        assert_eq!(exec.call_timeout, Some(Duration::from_secs(7)));
        assert_eq!(source.groups[0].template.provider, KIND);
    }

    #[test]
    fn an_empty_exec_command_or_timeout_is_refused_at_the_table() {
        let text = "run = \"r\"\n[providers.exec]\ncommand = []\n";
        assert_eq!(
            parse_text(text).unwrap_err().to_string(),
            "shape.toml:2:1: field `providers.exec.command`: command must name the provider program, e.g. [\"python3\", \"provider.py\"]"
        );
        let text = "run = \"r\"\n[providers.exec]\ncommand = [\"x\"]\ncall_timeout_secs = 0\n";
        assert_eq!(
            parse_text(text).unwrap_err().to_string(),
            "shape.toml:2:1: field `providers.exec.call_timeout_secs`: call_timeout_secs must be at least 1"
        );
        let text = "run = \"r\"\n[providers.exec]\ncommand = [\"x\"]\ncmd = 1\n";
        assert_eq!(
            parse_text(text).unwrap_err().to_string(),
            "shape.toml:4:1: field `providers.exec.cmd`: unknown field `cmd`, expected `command` or `call_timeout_secs`"
        );
    }
}
