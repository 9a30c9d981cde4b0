//! The engine's notion of time: a monotonic instant supplied by the caller.

use std::ops::{Add, Sub};
use std::time::Duration;

/// A point in time, in nanoseconds since an arbitrary epoch chosen by the driver. The engine
/// never reads a clock: every entry point takes `now`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Instant(pub u64);

impl Instant {
    /// The epoch.
    pub const ZERO: Self = Self(0);

    /// Nanoseconds since the epoch.
    pub fn as_nanos(self) -> u64 {
        self.0
    }

    /// Time from `earlier` to `self`, or zero if `earlier` is later.
    pub fn saturating_since(self, earlier: Self) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

impl Add<Duration> for Instant {
    type Output = Self;
    fn add(self, d: Duration) -> Self {
        Self(
            self.0
                .saturating_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)),
        )
    }
}

impl Sub for Instant {
    type Output = Duration;
    fn sub(self, other: Self) -> Duration {
        self.saturating_since(other)
    }
}
