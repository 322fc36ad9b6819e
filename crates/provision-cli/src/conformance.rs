//! `provision conformance --plugin "CMD ARGS…" [--seeds N] [--junit FILE]`:
//! the seam contract suite and the kit's battery (N seeds × both modes,
//! through the real adapter and the kit's oracle) against a provider program
//! that speaks the plugin protocol (`docs/plugin-protocol.md`).
//!
//! A fresh process of the program serves each contract and each harness run
//! of the battery. Both reports are printed; `--junit FILE` also writes them
//! as JUnit XML (two test suites). The exit code is 0 only when no contract
//! failed and the battery passed (skipped contracts, and a battery skipped
//! because the program lacks its hooks, are listed with their reason), 1
//! otherwise or when either did not end within its bound, 2 when the command
//! line is empty.
//!
//! `PROVISIONING_SEED`, `PROVISIONING_MODE`, `PROVISIONING_TRACE` and
//! `PROVISIONING_SEEDS` restrict the battery, so the reproduction line a
//! battery failure prints reruns exactly that case.

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use provisioning_exec::ExecConfig;
use provisioning_exec::battery::{BatteryOptions, BatteryOutcome, run_battery_against};
use provisioning_exec::conformance::{
    DEFAULT_SUITE_TIMEOUT, junit_xml_with_battery, run_contract_suite_against,
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

/// The default bound on the battery.
pub(crate) const DEFAULT_BATTERY_TIMEOUT: Duration = Duration::from_secs(900);

/// Runs the suite and a battery of `seeds` seeds per mode against `plugin`
/// and prints the reports.
pub(crate) async fn run(
    plugin: &str,
    seeds: usize,
    junit: Option<&Path>,
) -> anyhow::Result<ExitCode> {
    let outcome = check(plugin, seeds, junit, DEFAULT_SUITE_TIMEOUT).await?;
    print(&outcome.text);
    Ok(ExitCode::from(outcome.code))
}

/// Runs the battery on a thread of its own (it blocks, and runs runtimes of
/// its own), within `bound`.
async fn battery(
    config: &ExecConfig,
    plugin: &str,
    seeds: usize,
    bound: Duration,
) -> BatteryOutcome {
    if seeds == 0 {
        return BatteryOutcome::Skipped("--seeds 0".to_owned());
    }
    let options = BatteryOptions {
        seeds,
        reproduce_with: format!("provision conformance --plugin {plugin:?}"),
        env_overrides: true,
        ..BatteryOptions::default()
    };
    let config = config.clone();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let started = std::thread::Builder::new()
        .name("conformance-battery".to_owned())
        .spawn(move || {
            let _ = tx.send(run_battery_against(&config, &options));
        });
    if let Err(error) = started {
        return BatteryOutcome::Broken(format!("cannot start the battery's thread: {error}"));
    }
    match tokio::time::timeout(bound, rx).await {
        Ok(Ok(outcome)) => outcome,
        Ok(Err(_)) => BatteryOutcome::Broken("the battery stopped without a report".to_owned()),
        // The thread is left behind; the programs it started see their
        // stdin close when this process exits.
        Err(_) => BatteryOutcome::Broken(format!("did not finish within {}s", bound.as_secs())),
    }
}

/// Runs the suite and the battery against `plugin` within `bound` each;
/// writes JUnit XML to `junit` when given.
///
/// # Errors
/// When the JUnit file cannot be written.
pub(crate) async fn check(
    plugin: &str,
    seeds: usize,
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
    let battery = battery(&config, plugin, seeds, bound.max(DEFAULT_BATTERY_TIMEOUT)).await;
    if let Some(path) = junit {
        std::fs::write(path, junit_xml_with_battery(&report, &battery))
            .with_context(|| format!("cannot write the JUnit report {}", path.display()))?;
    }
    let code = if report.is_success() && battery.is_success() {
        0
    } else {
        EXIT_FAILURE
    };
    Ok(Outcome {
        code,
        text: format!("plugin: {plugin}\n{report}\n{battery}"),
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
        let outcome = check(&format!("python3 {DOUBLE}"), 8, Some(&junit), BOUND)
            .await
            .expect("the suite runs");
        assert_eq!(outcome.code, 0, "{}", outcome.text);
        assert!(
            outcome.text.contains("10 passed, 0 failed, 0 skipped"),
            "{}",
            outcome.text
        );
        assert!(
            outcome.text.contains("battery: SKIPPED"),
            "the double has no battery hooks: {}",
            outcome.text
        );
        let xml = std::fs::read_to_string(&junit).expect("the JUnit report is written");
        assert!(xml.contains("tests=\"10\" failures=\"0\""), "{xml}");
        assert!(xml.contains("<testsuite name=\"battery\""), "{xml}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn conformance_fails_a_double_that_creates_anew_naming_the_broken_contract() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let junit = dir.path().join("report.xml");
        let outcome = check(
            &format!("python3 {DOUBLE} --defect create-anew"),
            8,
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
        let outcome = check("  ", 8, None, BOUND).await.expect("no I/O");
        assert_eq!(outcome.code, EXIT_INVALID_INPUT, "{}", outcome.text);
    }

    #[tokio::test]
    async fn conformance_fails_a_program_that_cannot_be_started() {
        let outcome = check("/nonexistent/provider", 8, None, BOUND)
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
