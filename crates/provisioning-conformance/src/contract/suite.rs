//! The suite runner: [`run_contract_suite`] runs every contract against a
//! fresh plugin from the factory; [`complete_without_runtime`] drives it
//! when no runtime is at hand.

use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::task::{Context, Poll, Waker};

use futures_util::FutureExt;

use super::report::{Contract, ContractReport, ContractResult, ContractVerdict};
use super::run::{ContractRun, Stop};
use super::subject::ContractSubject;
use crate::harness::panic_text;

/// How many polls [`complete_without_runtime`] spends before giving up.
pub const MAX_POLLS_WITHOUT_RUNTIME: usize = 1 << 16;

/// Runs every contract against a fresh plugin from `factory` each.
///
/// # Guarantees
/// Every contract in [`Contract::ALL`] gets exactly one verdict. A factory
/// error or a plugin panic fails that contract with its message; nothing
/// else stops the suite. After each contract the suite destroys every node
/// the plugin still lists for the run, then drops the subject.
///
/// # Assumptions
/// The factory returns a plugin with nothing attached and nothing live for
/// the subject's run. The suite uses group [`CONTRACT_GROUP`] and attempts
/// from 1 upwards.
///
/// # Caveats
/// Spawns nothing and reads no clock: await it on the runtime your plugin
/// needs, and bound it with that runtime's timeout.
pub async fn run_contract_suite<F, Fut, E>(mut factory: F) -> ContractReport
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<ContractSubject, E>>,
    E: fmt::Display,
{
    let mut report = ContractReport {
        kind: String::new(),
        results: Vec::with_capacity(Contract::ALL.len()),
    };
    for contract in Contract::ALL {
        let verdict = match factory().await {
            Ok(subject) => {
                report.kind = subject.plugin.kind().to_owned();
                let run = ContractRun::new(subject);
                let checked = AssertUnwindSafe(run.check(contract)).catch_unwind().await;
                let verdict = match checked {
                    Ok(Ok(())) => ContractVerdict::Passed,
                    Ok(Err(Stop::Failed(why))) => ContractVerdict::Failed(why),
                    Ok(Err(Stop::Skipped(why))) => ContractVerdict::Skipped(why),
                    Err(payload) => ContractVerdict::Failed(format!(
                        "the plugin panicked: {}",
                        panic_text(payload.as_ref())
                    )),
                };
                let _ = AssertUnwindSafe(run.teardown()).catch_unwind().await;
                verdict
            }
            Err(error) => ContractVerdict::Failed(format!("the factory failed: {error}")),
        };
        report.results.push(ContractResult { contract, verdict });
    }
    report
}

/// Polls `future` to completion without a runtime: for plugins whose calls
/// never wait (in-memory fakes). Returns `None` when it is still pending
/// after [`MAX_POLLS_WITHOUT_RUNTIME`] polls — it waits for something only a
/// runtime would deliver.
pub fn complete_without_runtime<F: Future>(future: F) -> Option<F::Output> {
    let mut future = std::pin::pin!(future);
    let mut context = Context::from_waker(Waker::noop());
    for _ in 0..MAX_POLLS_WITHOUT_RUNTIME {
        if let Poll::Ready(output) = future.as_mut().poll(&mut context) {
            return Some(output);
        }
    }
    None
}
