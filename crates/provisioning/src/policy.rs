//! Retry policy: backoff, operation timeouts and the endpoint probe interval.

use std::time::Duration;

use crate::id::NodeAttemptId;

/// How long the driver waits before retrying, and how long operations may run.
///
/// Backoff is exponential per node: the `n`-th consecutive failure waits
/// `backoff_initial * 2^(n-1)`, capped at `backoff_max`. With a non-zero
/// `jitter_per_mille`, up to that fraction of the delay is taken off, by an
/// amount derived deterministically from the attempt id — the core reads no
/// randomness. A failed cleanup step (cancelling a session, destroying a
/// lease) waits at most `cleanup_backoff_max`: it is retried against a
/// provider that may answer again at any moment (a partition heals), and the
/// slot's replacement waits for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// The delay after the first failure.
    pub backoff_initial: Duration,
    /// The largest delay.
    pub backoff_max: Duration,
    /// The largest fraction of a delay jitter removes, in thousandths (0–1000).
    pub jitter_per_mille: u16,
    /// How long an operation may stay pending before it times out.
    pub operation_timeout: Duration,
    /// How long to wait before probing an endpoint that was not ready.
    pub endpoint_probe_interval: Duration,
    /// How long a node the journal held as ready may take, after a
    /// controller restart, for its agent to re-join the new controller;
    /// past it the node is lost and replaced.
    pub rejoin_window: Duration,
    /// The largest delay before a failed cleanup step is tried again.
    pub cleanup_backoff_max: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            backoff_initial: Duration::from_secs(1),
            backoff_max: Duration::from_secs(60),
            jitter_per_mille: 0,
            operation_timeout: Duration::from_secs(30),
            endpoint_probe_interval: Duration::from_secs(1),
            rejoin_window: Duration::from_secs(60),
            cleanup_backoff_max: Duration::from_secs(2),
        }
    }
}

impl RetryPolicy {
    /// The undithered delay after `failures` consecutive failures
    /// (`failures == 0` gives zero).
    pub fn base_backoff(&self, failures: u32) -> Duration {
        if failures == 0 {
            return Duration::ZERO;
        }
        let doublings = failures - 1;
        let factor = 1u32.checked_shl(doublings).unwrap_or(0);
        if factor == 0 {
            return self.backoff_max;
        }
        self.backoff_initial
            .checked_mul(factor)
            .map_or(self.backoff_max, |d| d.min(self.backoff_max))
    }

    /// The delay after `failures` consecutive failures of `attempt`, jitter
    /// applied. Deterministic: the same inputs give the same delay.
    pub fn backoff(&self, failures: u32, attempt: NodeAttemptId) -> Duration {
        let base = self.base_backoff(failures);
        let per_mille = u128::from(self.jitter_per_mille.min(1000));
        if per_mille == 0 || base.is_zero() {
            return base;
        }
        // `unit / 2^32` is a fraction in [0, 1); the reduction is at most
        // `per_mille / 1000` of the base delay. Durations are below 2^94 ns,
        // so neither product can overflow a u128.
        let unit = u128::from(mix64(attempt.get()) >> 32);
        let base_nanos = base.as_nanos();
        let reduction = ((base_nanos * per_mille / 1000) * unit) >> 32;
        let nanos = base_nanos - reduction;
        Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
    }

    /// The delay before a cleanup step of `attempt` that failed (the
    /// `failures`-th consecutive failure) is tried again: the
    /// [backoff](Self::backoff), at most `cleanup_backoff_max`.
    pub fn cleanup_backoff(&self, failures: u32, attempt: NodeAttemptId) -> Duration {
        self.backoff(failures, attempt)
            .min(self.cleanup_backoff_max)
    }
}

/// A fixed bit mixer (the SplitMix64 finaliser), used to derive jitter.
fn mix64(value: u64) -> u64 {
    let mut z = value.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(policy: &RetryPolicy, failures: u32, expected_ms: u64) {
        assert_eq!(
            policy.base_backoff(failures),
            Duration::from_millis(expected_ms),
            "failures = {failures}"
        );
    }

    #[test]
    fn a_failed_cleanup_step_waits_the_backoff_up_to_its_own_cap() {
        let policy = RetryPolicy::default();
        let attempt = NodeAttemptId::from_raw(7);
        assert_eq!(policy.cleanup_backoff(1, attempt), Duration::from_secs(1));
        assert_eq!(policy.cleanup_backoff(2, attempt), Duration::from_secs(2));
        for failures in [3, 6, 40] {
            assert!(policy.backoff(failures, attempt) > policy.cleanup_backoff_max);
            assert_eq!(
                policy.cleanup_backoff(failures, attempt),
                policy.cleanup_backoff_max
            );
        }
    }

    #[test]
    fn backoff_doubles_from_the_initial_delay_up_to_the_cap() {
        let policy = RetryPolicy::default();
        check(&policy, 0, 0);
        check(&policy, 1, 1_000);
        check(&policy, 2, 2_000);
        check(&policy, 3, 4_000);
        check(&policy, 6, 32_000);
        check(&policy, 7, 60_000);
        check(&policy, 8, 60_000);
    }

    #[test]
    fn backoff_overflow_yields_the_cap() {
        let policy = RetryPolicy {
            backoff_initial: Duration::from_secs(u64::MAX / 2),
            backoff_max: Duration::from_secs(7),
            ..RetryPolicy::default()
        };
        check(&policy, 3, 7_000);
        check(&RetryPolicy::default(), 33, 60_000);
        check(&RetryPolicy::default(), u32::MAX, 60_000);
    }

    #[test]
    fn jitter_is_deterministic_per_attempt_and_bounded() {
        let policy = RetryPolicy {
            jitter_per_mille: 500,
            ..RetryPolicy::default()
        };
        let a = NodeAttemptId::from_raw(7);
        let b = NodeAttemptId::from_raw(8);
        assert_eq!(policy.backoff(3, a), policy.backoff(3, a));
        assert_ne!(policy.backoff(3, a), policy.backoff(3, b));
        for raw in 0..200 {
            let d = policy.backoff(3, NodeAttemptId::from_raw(raw));
            assert!(
                d <= Duration::from_secs(4) && d >= Duration::from_secs(2),
                "{d:?}"
            );
        }
        let none = RetryPolicy::default();
        assert_eq!(none.backoff(3, a), Duration::from_secs(4));
    }
}
