//! The time type the core takes as input.
//!
//! The core never reads a clock. Callers pass a [`Timestamp`] — milliseconds
//! since an epoch of the caller's choosing (the host uses its start instant) —
//! and every deadline is computed with checked arithmetic, so time near the
//! top of the range yields an error instead of a panic or a wrap-around.

use std::fmt;
use std::time::Duration;

use thiserror::Error;

/// A point in time, in milliseconds since the caller's epoch.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(transparent)]
pub struct Timestamp(u64);

impl Timestamp {
    /// The epoch.
    pub const ZERO: Timestamp = Timestamp(0);
    /// The last representable instant.
    pub const MAX: Timestamp = Timestamp(u64::MAX);

    /// A timestamp `millis` milliseconds after the epoch.
    pub const fn from_millis(millis: u64) -> Self {
        Timestamp(millis)
    }

    /// Milliseconds since the epoch.
    pub const fn as_millis(self) -> u64 {
        self.0
    }

    /// `self + delay`, or an error when the sum does not fit.
    ///
    /// # Errors
    /// [`ClockSaturated`] when the result would pass [`Timestamp::MAX`].
    pub fn checked_add(self, delay: Duration) -> Result<Timestamp, ClockSaturated> {
        let delay_ms = duration_millis(delay).ok_or(ClockSaturated { at: self, delay })?;
        self.0
            .checked_add(delay_ms)
            .map(Timestamp)
            .ok_or(ClockSaturated { at: self, delay })
    }

    /// `self + delay`, clamped to [`Timestamp::MAX`].
    pub fn saturating_add(self, delay: Duration) -> Timestamp {
        let delay_ms = duration_millis(delay).unwrap_or(u64::MAX);
        Timestamp(self.0.saturating_add(delay_ms))
    }

    /// The time from `earlier` to `self`, or zero when `earlier` is later.
    pub fn saturating_duration_since(self, earlier: Timestamp) -> Duration {
        Duration::from_millis(self.0.saturating_sub(earlier.0))
    }

    /// Whether a deadline stored as `deadline` is due at `self`: due exactly at
    /// the deadline, never a tick earlier.
    pub fn reached(self, deadline: Timestamp) -> bool {
        self >= deadline
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "t+{}ms", self.0)
    }
}

/// Converts a duration to whole milliseconds, rounding sub-millisecond parts up
/// so that a non-zero delay never becomes zero.
fn duration_millis(delay: Duration) -> Option<u64> {
    let whole = u64::try_from(delay.as_millis()).ok()?;
    if delay.subsec_nanos() % 1_000_000 != 0 {
        whole.checked_add(1)
    } else {
        Some(whole)
    }
}

/// A deadline could not be represented: the clock is at the end of its range.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
#[error("clock saturated: {at} plus {delay:?} does not fit in a timestamp")]
pub struct ClockSaturated {
    /// The instant the delay was added to.
    pub at: Timestamp,
    /// The delay that did not fit.
    pub delay: Duration,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checked_add_near_the_maximum_is_an_error_not_a_panic() {
        let near = Timestamp::from_millis(u64::MAX - 5);
        assert_eq!(
            near.checked_add(Duration::from_millis(5)),
            Ok(Timestamp::MAX)
        );
        assert!(near.checked_add(Duration::from_millis(6)).is_err());
        assert!(Timestamp::ZERO.checked_add(Duration::MAX).is_err());
        assert_eq!(near.saturating_add(Duration::MAX), Timestamp::MAX);
    }

    #[test]
    fn sub_millisecond_delays_round_up() {
        let t = Timestamp::from_millis(10);
        assert_eq!(
            t.checked_add(Duration::from_micros(1)),
            Ok(Timestamp::from_millis(11))
        );
        assert_eq!(t.checked_add(Duration::ZERO), Ok(t));
    }

    #[test]
    fn a_deadline_is_reached_exactly_at_its_instant() {
        let deadline = Timestamp::from_millis(1_000);
        assert!(!Timestamp::from_millis(999).reached(deadline));
        assert!(Timestamp::from_millis(1_000).reached(deadline));
        assert_eq!(
            Timestamp::from_millis(5).saturating_duration_since(Timestamp::from_millis(9)),
            Duration::ZERO
        );
    }
}
