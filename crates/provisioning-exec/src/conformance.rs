//! The seam contract suite against a provider program, and its JUnit form.
//!
//! [`run_contract_suite_against`] runs the conformance kit's
//! [`run_contract_suite`] with a fresh process of the program per contract,
//! its test hooks (`inject_fault`, `lose_node`) as the [`ContractFaults`]
//! and tokio's sleep as the pause; [`junit_xml`] renders the report.

use std::sync::Arc;
use std::time::Duration;

use provisioning::RunId;
use provisioning_conformance::contract::{
    ContractFaults, ContractReport, ContractSubject, ContractVerdict, run_contract_suite,
};

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
    xml.push_str("  </testsuite>\n</testsuites>\n");
    xml
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
    }
}
