//! The shrinker: makes a failing trace short enough to read.
//!
//! Three moves, repeated until none helps or the budget is spent:
//! 1. **truncation** — a violation found at input `n` does not need the
//!    inputs after it (tried once, first);
//! 2. **span deletion** — remove a block of inputs, halving the block size
//!    down to single inputs (so single-input deletion is its last round);
//! 3. **simplification** — replace an input with a simpler variant
//!    ([`crate::trace::Input::simplifications`]) and drop header edges and jitter.
//!
//! A candidate is accepted only when it fails with the *same* guarantee id:
//! shrinking never trades one bug for another.

use crate::guarantee::{GuaranteeId, Phase, Violation};
use crate::trace::{Trace, TraceHeader};

/// The default number of candidate evaluations a shrink may spend.
pub const DEFAULT_SHRINK_BUDGET: usize = 600;

/// The most full passes over the three moves.
pub const MAX_SHRINK_PASSES: usize = 16;

/// The result of a shrink.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shrunk {
    /// The smallest failing trace found.
    pub trace: Trace,
    /// Its violation (same guarantee as the original).
    pub violation: Violation,
    /// How many candidates were evaluated.
    pub evaluations: usize,
    /// Whether the budget ran out before a fixed point.
    pub budget_exhausted: bool,
}

struct Search<'a> {
    target: GuaranteeId,
    budget: usize,
    evaluations: usize,
    fails: &'a mut dyn FnMut(&Trace) -> Option<Violation>,
    best: Trace,
    violation: Violation,
}

impl Search<'_> {
    fn exhausted(&self) -> bool {
        self.evaluations >= self.budget
    }

    /// Evaluates `candidate`; keeps it when it fails the same guarantee.
    fn try_candidate(&mut self, candidate: Trace) -> bool {
        if self.exhausted() {
            return false;
        }
        self.evaluations += 1;
        match (self.fails)(&candidate) {
            Some(violation) if violation.guarantee == self.target => {
                self.best = candidate;
                self.violation = violation;
                true
            }
            _ => false,
        }
    }

    fn truncate(&mut self) {
        if let Phase::Input(index) = self.violation.phase {
            if index + 1 < self.best.inputs.len() {
                let mut candidate = self.best.clone();
                candidate.inputs.truncate(index + 1);
                self.try_candidate(candidate);
            }
        }
    }

    fn delete_spans(&mut self) -> bool {
        let mut improved = false;
        let mut span = (self.best.inputs.len() / 2).max(1);
        loop {
            let mut start = 0;
            while start < self.best.inputs.len() && !self.exhausted() {
                let end = (start + span).min(self.best.inputs.len());
                let mut candidate = self.best.clone();
                candidate.inputs.drain(start..end);
                if self.try_candidate(candidate) {
                    improved = true;
                } else {
                    start += span;
                }
            }
            if span == 1 || self.exhausted() {
                return improved;
            }
            span /= 2;
        }
    }

    fn simplify_header(&mut self) -> bool {
        let header = &self.best.header;
        let plain = TraceHeader {
            seed: header.seed,
            ..TraceHeader::default()
        };
        if *header == plain {
            return false;
        }
        let mut candidate = self.best.clone();
        candidate.header = plain;
        self.try_candidate(candidate)
    }

    fn simplify_inputs(&mut self) -> bool {
        let mut improved = false;
        let mut index = 0;
        while index < self.best.inputs.len() && !self.exhausted() {
            for simpler in self.best.inputs[index].simplifications() {
                let mut candidate = self.best.clone();
                candidate.inputs[index] = simpler;
                if self.try_candidate(candidate) {
                    improved = true;
                    break;
                }
            }
            index += 1;
        }
        improved
    }
}

/// Shrinks `trace`, which fails with `violation`, spending at most `budget`
/// evaluations of `fails` (which runs a candidate and returns its first
/// violation, if any).
pub fn shrink(
    trace: &Trace,
    violation: &Violation,
    budget: usize,
    fails: &mut dyn FnMut(&Trace) -> Option<Violation>,
) -> Shrunk {
    let mut search = Search {
        target: violation.guarantee,
        budget,
        evaluations: 0,
        fails,
        best: trace.clone(),
        violation: violation.clone(),
    };
    search.truncate();
    for _ in 0..MAX_SHRINK_PASSES {
        let mut improved = search.delete_spans();
        improved |= search.simplify_header();
        improved |= search.simplify_inputs();
        if !improved || search.exhausted() {
            break;
        }
    }
    Shrunk {
        budget_exhausted: search.exhausted(),
        evaluations: search.evaluations,
        trace: search.best,
        violation: search.violation,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{Fault, FaultTarget, Input, WorkStep};

    fn violation(guarantee: GuaranteeId, index: usize) -> Violation {
        Violation {
            guarantee,
            phase: Phase::Input(index),
            detail: String::new(),
        }
    }

    /// A fake property: fails G08 when a `release` comes after a hang
    /// script; otherwise fails G02 when the trace holds a `run lifo`.
    fn property(trace: &Trace) -> Option<Violation> {
        let hang = trace.inputs.iter().position(|i| {
            matches!(
                i,
                Input::Script {
                    fault: Fault::Hang,
                    ..
                }
            )
        });
        let release = hang.and_then(|hang| {
            trace.inputs[hang..]
                .iter()
                .position(|i| *i == Input::Release)
                .map(|offset| hang + offset)
        });
        if let Some(release) = release {
            return Some(violation(GuaranteeId::NoDoubleCreate, release));
        }
        trace
            .inputs
            .contains(&Input::Run(WorkStep::Lifo))
            .then(|| violation(GuaranteeId::Correlation, 0))
    }

    #[test]
    fn shrinking_keeps_only_the_inputs_the_failure_needs() {
        let mut inputs = vec![Input::Tick { millis: 5 }; 40];
        inputs[7] = Input::Script {
            target: FaultTarget::Any,
            fault: Fault::Hang,
        };
        inputs[23] = Input::Release;
        let trace = Trace::new(inputs);
        let first = property(&trace).unwrap();
        let shrunk = shrink(&trace, &first, 500, &mut property);
        assert_eq!(
            shrunk.trace.inputs,
            [
                Input::Script {
                    target: FaultTarget::Any,
                    fault: Fault::Hang
                },
                Input::Release
            ]
        );
        assert_eq!(shrunk.violation.guarantee, GuaranteeId::NoDoubleCreate);
        assert!(!shrunk.budget_exhausted);
    }

    #[test]
    fn candidates_failing_another_guarantee_are_refused() {
        let hang = Input::Script {
            target: FaultTarget::Any,
            fault: Fault::Hang,
        };
        let trace = Trace::new(vec![Input::Run(WorkStep::Lifo), hang, Input::Release]);
        // Shrinking for G08 must keep the hang and the release and may drop
        // the `run lifo`.
        let first = property(&trace).unwrap();
        assert_eq!(first.guarantee, GuaranteeId::NoDoubleCreate);
        let shrunk = shrink(&trace, &first, 500, &mut property);
        assert_eq!(shrunk.trace.inputs, [hang, Input::Release]);
        // Shrinking the same trace for G02 (reported at the end of a run, so
        // nothing is truncated) refuses every candidate that fails G08 first.
        let mut seen = Vec::new();
        let mut recording = |t: &Trace| {
            let verdict = property(t);
            seen.push(verdict.as_ref().map(|v| v.guarantee));
            verdict
        };
        let g02 = Violation {
            guarantee: GuaranteeId::Correlation,
            phase: Phase::End,
            detail: String::new(),
        };
        let shrunk = shrink(&trace, &g02, 500, &mut recording);
        assert_eq!(shrunk.trace.inputs, [Input::Run(WorkStep::Lifo)]);
        assert_eq!(shrunk.violation.guarantee, GuaranteeId::Correlation);
        assert!(
            seen.contains(&Some(GuaranteeId::NoDoubleCreate)),
            "a G08 candidate was evaluated and refused: {seen:?}"
        );
    }

    #[test]
    fn the_budget_bounds_the_work() {
        let trace = Trace::new(vec![Input::Release; 64]);
        let always = Violation {
            guarantee: GuaranteeId::Correlation,
            phase: Phase::End,
            detail: String::new(),
        };
        let mut calls = 0;
        let mut counting = |t: &Trace| {
            calls += 1;
            (t.inputs.len() > 10).then(|| always.clone())
        };
        let shrunk = shrink(&trace, &always, 5, &mut counting);
        assert_eq!(shrunk.evaluations, 5);
        assert!(shrunk.budget_exhausted);
        assert_eq!(calls, 5);
    }
}
