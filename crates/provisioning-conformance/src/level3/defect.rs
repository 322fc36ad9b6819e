//! The check that a Level 3 battery's counts bite: one trace, run once
//! clean ([`assert_clean_run`]) and once with a deliberate defect of the
//! world that leaks a lease while everyone's bookkeeping says it is gone
//! ([`assert_leak_caught`]): only the world's own count of what is live
//! can see the leak, and G23 must.

use std::sync::Arc;

use super::substrate::{Level3Substrate, Level3World};
use crate::trace::Trace;
use crate::{GuaranteeId, Mode, RunOptions, cluster_driver, run_trace};

fn parse(trace: &str) -> Trace {
    trace.parse().expect("the trace parses")
}

/// Runs `trace` in fair mode on a clean substrate of `context`.
///
/// # Panics
/// When the run breaks a guarantee or does not converge.
pub fn assert_clean_run<W: Level3World>(context: &Arc<W::Context>, trace: &str) {
    let clean = run_trace(
        Level3Substrate::<W>::new(context.clone()),
        &cluster_driver,
        &parse(trace),
        RunOptions::new(Mode::Fair),
    );
    assert_eq!(clean.violation, None);
    assert!(clean.converged);
}

/// Runs `trace` in fair mode on a substrate of `context` with `defect`,
/// which leaves `what` (a process, a claim, a job) behind a destroy.
///
/// # Panics
/// Unless the run breaks "converged leaks nothing" (G23) naming `leaked`.
pub fn assert_leak_caught<W: Level3World>(
    context: &Arc<W::Context>,
    defect: W::Defect,
    trace: &str,
    what: &str,
    leaked: &str,
) {
    let leaky = run_trace(
        Level3Substrate::<W>::with_defect(context.clone(), Some(defect)),
        &cluster_driver,
        &parse(trace),
        RunOptions::new(Mode::Fair),
    );
    let violation = leaky
        .violation
        .unwrap_or_else(|| panic!("{what} left behind by a destroy must break a guarantee"));
    assert_eq!(
        violation.guarantee,
        GuaranteeId::ConvergedLeaksNothing,
        "{violation:?}"
    );
    assert!(violation.detail.contains(leaked), "{violation:?}");
}
