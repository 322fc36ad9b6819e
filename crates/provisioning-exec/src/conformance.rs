//! The seam contract suite against a provider program, and the JUnit form
//! of its report and of the battery's.
//!
//! [`run_contract_suite_against`] runs the conformance kit's
//! [`run_contract_suite`] with a fresh process of the program per contract,
//! its test hooks (`inject_fault`, `lose_node`) as the [`ContractFaults`]
//! and tokio's sleep as the pause; [`junit_xml`] renders the report, and
//! [`junit_xml_with_battery`] the report and a
//! [battery](crate::battery::run_battery_against) outcome together.

use std::sync::Arc;
use std::time::Duration;

use provisioning::RunId;
use provisioning_conformance::contract::{
    ContractFaults, ContractReport, ContractSubject, ContractVerdict, run_contract_suite,
};

use crate::battery::BatteryOutcome;
use crate::{ExecConfig, ExecError, ExecPlugin};

/// The run the suite's nodes belong to.
pub const CONFORMANCE_RUN: &str = "conformance";

/// The default bound on the whole suite.
pub const DEFAULT_SUITE_TIMEOUT: Duration = Duration::from_secs(600);

/// Runs the seam contract suite against the program of `config`, starting a
/// fresh process of it for every contract.
///
/// # Caveats
/// Every call is bounded by the config's call timeout, and each contract
/// makes a bounded number of calls, so the suite ends; bound it further with
/// `tokio::time::timeout` if needed.
pub async fn run_contract_suite_against(config: &ExecConfig) -> ContractReport {
    run_contract_suite(|| {
        let config = config.clone();
        async move {
            let plugin = Arc::new(ExecPlugin::start(config).await?);
            let faults: Arc<dyn ContractFaults> = plugin.clone();
            Ok::<_, ExecError>(
                ContractSubject::new(plugin, RunId::new(CONFORMANCE_RUN))
                    .with_faults(faults)
                    .with_pause(Arc::new(|d| Box::pin(tokio::time::sleep(d)))),
            )
        }
    })
    .await
}

/// The report as a JUnit XML document: one test suite, one test case per
/// contract, `<failure>` for a broken contract and `<skipped>` for one that
/// could not be checked.
pub fn junit_xml(report: &ContractReport) -> String {
    junit_document(report, None)
}

/// [`junit_xml`] with a second test suite, `battery`, holding one test case
/// for the battery: `<failure>` with the shrunk failure when it failed (or
/// could not run), `<skipped>` with the reason when the program lacks the
/// hooks, and the report's summary as `<system-out>`.
pub fn junit_xml_with_battery(report: &ContractReport, battery: &BatteryOutcome) -> String {
    junit_document(report, Some(battery))
}

fn junit_document(report: &ContractReport, battery: Option<&BatteryOutcome>) -> String {
    let mut xml = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    xml.push_str(&format!(
        "<testsuites>\n  <testsuite name=\"seam-contract\" package=\"{}\" tests=\"{}\" failures=\"{}\" errors=\"0\" skipped=\"{}\">\n",
        escape(&report.kind),
        report.results.len(),
        report.failed().len(),
        report.skipped().len()
    ));
    for result in &report.results {
        let name = escape(result.contract.name());
        let class = format!("seam-contract.{}", escape(&report.kind));
        match &result.verdict {
            ContractVerdict::Passed => {
                xml.push_str(&format!(
                    "    <testcase name=\"{name}\" classname=\"{class}\"/>\n"
                ));
            }
            ContractVerdict::Failed(why) => xml.push_str(&format!(
                "    <testcase name=\"{name}\" classname=\"{class}\">\n      <failure message=\"{}\">{}</failure>\n    </testcase>\n",
                escape(why),
                escape(why)
            )),
            ContractVerdict::Skipped(why) => xml.push_str(&format!(
                "    <testcase name=\"{name}\" classname=\"{class}\">\n      <skipped message=\"{}\"/>\n    </testcase>\n",
                escape(why)
            )),
        }
    }
    xml.push_str("  </testsuite>\n");
    if let Some(battery) = battery {
        xml.push_str(&junit_battery_suite(&report.kind, battery));
    }
    xml.push_str("</testsuites>\n");
    xml
}

fn junit_battery_suite(kind: &str, battery: &BatteryOutcome) -> String {
    let class = format!("battery.{}", escape(kind));
    let (name, failed, skipped, body) = match battery {
        BatteryOutcome::Ran { report, .. } => {
            let name = format!(
                "{} trace evaluations, {} fair tails converged",
                report.traces, report.converged
            );
            let body = match report.failures.first() {
                Some(failure) => format!(
                    "      <failure message=\"{}\">{}</failure>\n",
                    escape(&format!(
                        "{} {}: {}",
                        failure.guarantee(),
                        failure.mode.name(),
                        failure.violation.detail
                    )),
                    escape(&failure.to_string())
                ),
                None => String::new(),
            };
            let out = format!(
                "      <system-out>{}</system-out>\n",
                escape(&report.to_string())
            );
            (name, !report.passed(), false, body + &out)
        }
        BatteryOutcome::Skipped(why) => (
            "battery".to_owned(),
            false,
            true,
            format!("      <skipped message=\"{}\"/>\n", escape(why)),
        ),
        BatteryOutcome::Broken(why) => (
            "battery".to_owned(),
            true,
            false,
            format!(
                "      <failure message=\"{}\">{}</failure>\n",
                escape(why),
                escape(why)
            ),
        ),
    };
    format!(
        "  <testsuite name=\"battery\" package=\"{}\" tests=\"1\" failures=\"{}\" errors=\"0\" skipped=\"{}\">\n    <testcase name=\"{}\" classname=\"{class}\">\n{body}    </testcase>\n  </testsuite>\n",
        escape(kind),
        u8::from(failed),
        u8::from(skipped),
        escape(&name)
    )
}

/// Escapes text for XML attributes and content; drops characters XML 1.0
/// cannot carry.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            '\n' => out.push_str("&#10;"),
            '\t' | '\r' => out.push(' '),
            c if (c as u32) < 0x20 => {}
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use provisioning_conformance::contract::{Contract, ContractResult};

    use super::*;

    #[test]
    fn the_junit_report_has_one_case_per_contract_with_failures_and_skips_escaped() {
        let report = ContractReport {
            kind: "exec".to_owned(),
            results: vec![
                ContractResult {
                    contract: Contract::CreateTwiceAdopts,
                    verdict: ContractVerdict::Passed,
                },
                ContractResult {
                    contract: Contract::ListIsExact,
                    verdict: ContractVerdict::Failed("a <b> & \"c\"\u{1}".to_owned()),
                },
                ContractResult {
                    contract: Contract::CleanupFaultsRetry,
                    verdict: ContractVerdict::Skipped("no hook".to_owned()),
                },
            ],
        };
        let xml = junit_xml(&report);
        assert!(
            xml.contains("tests=\"3\" failures=\"1\" errors=\"0\" skipped=\"1\""),
            "{xml}"
        );
        assert!(
            xml.contains("<testcase name=\"create-twice-adopts\""),
            "{xml}"
        );
        assert!(
            xml.contains("a &lt;b&gt; &amp; &quot;c&quot;</failure>"),
            "{xml}"
        );
        assert!(xml.contains("<skipped message=\"no hook\"/>"), "{xml}");
        assert!(!xml.contains('\u{1}'));
        let with = junit_xml_with_battery(
            &report,
            &BatteryOutcome::Skipped("no <live> hook".to_owned()),
        );
        assert!(with.contains("<testsuite name=\"battery\""), "{with}");
        assert!(
            with.contains("<skipped message=\"no &lt;live&gt; hook\"/>"),
            "{with}"
        );
        let broken = junit_xml_with_battery(&report, &BatteryOutcome::Broken("gone".to_owned()));
        assert!(
            broken.contains("tests=\"1\" failures=\"1\" errors=\"0\" skipped=\"0\""),
            "{broken}"
        );
        assert!(broken.trim_end().ends_with("</testsuites>"), "{broken}");
    }
}
