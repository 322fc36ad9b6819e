//! `provision conformance --plugin "CMD ARGS…" [--junit FILE]`: the seam
//! contract suite against a provider program that speaks the plugin protocol
//! (`docs/plugin-protocol.md`).
//!
//! A fresh process of the program serves each contract. The report is
//! printed; `--junit FILE` also writes it as JUnit XML. The exit code is 0
//! only when no contract failed (skipped contracts are listed with their
//! reason), 1 when one failed or the suite did not end within its bound, 2
//! when the command line is empty.

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use provisioning_exec::ExecConfig;
use provisioning_exec::conformance::{
    DEFAULT_SUITE_TIMEOUT, junit_xml, run_contract_suite_against,
};

use crate::{EXIT_FAILURE, EXIT_INVALID_INPUT, print};

/// What one run of the suite found.
#[derive(Debug)]
pub(crate) struct Outcome {
    /// The exit code: 0, [`EXIT_FAILURE`] or [`EXIT_INVALID_INPUT`].
    pub(crate) code: u8,
    /// The report as printed.
    pub(crate) text: String,
}

/// Runs the suite against `plugin` and prints the report.
pub(crate) async fn run(plugin: &str, junit: Option<&Path>) -> anyhow::Result<ExitCode> {
    let outcome = check(plugin, junit, DEFAULT_SUITE_TIMEOUT).await?;
    print(&outcome.text);
    Ok(ExitCode::from(outcome.code))
}

/// Runs the suite against `plugin` within `bound`; writes JUnit XML to
/// `junit` when given.
///
/// # Errors
/// When the JUnit file cannot be written.
pub(crate) async fn check(
    plugin: &str,
    junit: Option<&Path>,
    bound: Duration,
) -> anyhow::Result<Outcome> {
    let config = match ExecConfig::from_command_line(plugin) {
        Ok(config) => config,
        Err(error) => {
            return Ok(Outcome {
                code: EXIT_INVALID_INPUT,
                text: format!("error: --plugin: {error}\n"),
            });
        }
    };
    let Ok(report) = tokio::time::timeout(bound, run_contract_suite_against(&config)).await else {
        return Ok(Outcome {
            code: EXIT_FAILURE,
            text: format!(
                "seam contract suite against {plugin:?}: did not finish within {}s\n",
                bound.as_secs()
            ),
        });
    };
    if let Some(path) = junit {
        std::fs::write(path, junit_xml(&report))
            .with_context(|| format!("cannot write the JUnit report {}", path.display()))?;
    }
    let code = if report.is_success() { 0 } else { EXIT_FAILURE };
    Ok(Outcome {
        code,
        text: format!("plugin: {plugin}\n{report}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOUBLE: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../provisioning-exec/tests/doubles/memory_provider.py"
    );

    /// A bound that only a hang reaches.
    const BOUND: Duration = Duration::from_secs(300);

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn conformance_passes_the_reference_double_with_exit_zero_and_a_junit_report() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let junit = dir.path().join("report.xml");
        let outcome = check(&format!("python3 {DOUBLE}"), Some(&junit), BOUND)
            .await
            .expect("the suite runs");
        assert_eq!(outcome.code, 0, "{}", outcome.text);
        assert!(
            outcome.text.contains("10 passed, 0 failed, 0 skipped"),
            "{}",
            outcome.text
        );
        let xml = std::fs::read_to_string(&junit).expect("the JUnit report is written");
        assert!(xml.contains("tests=\"10\" failures=\"0\""), "{xml}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn conformance_fails_a_double_that_creates_anew_naming_the_broken_contract() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let junit = dir.path().join("report.xml");
        let outcome = check(
            &format!("python3 {DOUBLE} --defect create-anew"),
            Some(&junit),
            BOUND,
        )
        .await
        .expect("the suite runs");
        assert_eq!(outcome.code, EXIT_FAILURE, "{}", outcome.text);
        assert!(
            outcome.text.contains("FAIL  create-twice-adopts"),
            "{}",
            outcome.text
        );
        let xml = std::fs::read_to_string(&junit).expect("the JUnit report is written");
        assert!(xml.contains("<failure"), "{xml}");
    }

    #[tokio::test]
    async fn conformance_refuses_an_empty_command_as_invalid_input() {
        let outcome = check("  ", None, BOUND).await.expect("no I/O");
        assert_eq!(outcome.code, EXIT_INVALID_INPUT, "{}", outcome.text);
    }

    #[tokio::test]
    async fn conformance_fails_a_program_that_cannot_be_started() {
        let outcome = check("/nonexistent/provider", None, BOUND)
            .await
            .expect("the suite runs");
        assert_eq!(outcome.code, EXIT_FAILURE, "{}", outcome.text);
        assert!(
            outcome.text.contains("the factory failed"),
            "{}",
            outcome.text
        );
    }
}
