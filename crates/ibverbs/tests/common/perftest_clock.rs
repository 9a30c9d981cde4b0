//! perftest's calibration of the CPU's cycle counter against `gettimeofday`: it times short
//! busy waits, and a preemption on a loaded machine spoils the fit whatever the verbs library
//! does (it prints "Correlation coefficient r^2: ... < 0.9" and "Can't produce a report" and
//! exits). Such a run says nothing about softverbs, so the tests that run perftest start it
//! again, a bounded number of times. Shared by the C library's and the connection manager's
//! tests.
#![allow(dead_code, unreachable_pub)] // each test binary uses a subset

use std::process::Output;

/// What perftest prints when its calibration failed.
pub const PERFTEST_CLOCK_FAILURE: &str = "Correlation coefficient r^2";

/// How many times a perftest run whose calibration failed is started again.
pub const PERFTEST_ATTEMPTS: usize = 3;

/// Whether a perftest program exited because its calibration failed.
pub fn perftest_clock_failed(o: &Output) -> bool {
    let failed = |b: &[u8]| String::from_utf8_lossy(b).contains(PERFTEST_CLOCK_FAILURE);
    !o.status.success() && (failed(&o.stdout) || failed(&o.stderr))
}
