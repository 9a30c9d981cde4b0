//! Send rate limiting (`ibv_modify_qp_rate_limit`, `IBV_QP_RATE_LIMIT`): a token bucket per QP
//! that holds the next frame back until the bucket has room for it.

use std::time::Duration;

use crate::time::Instant;

/// `packet_pacing_caps.qp_rate_limit_min` in kbit/s.
pub const QP_RATE_LIMIT_MIN: u32 = 1;
/// `packet_pacing_caps.qp_rate_limit_max` in kbit/s (100 Gbit/s).
pub const QP_RATE_LIMIT_MAX: u32 = 100_000_000;
/// `typical_pkt_sz` 0: the port MTU plus the Ethernet header.
pub const DEFAULT_TYPICAL_PKT_SZ: u32 = 1514;

/// The shaping of one QP's sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimit {
    /// Kbit/s; never 0 here (0 means no limit, i.e. no [`TokenBucket`]).
    pub rate_kbps: u32,
    /// Largest burst in bytes (0: one typical packet).
    pub max_burst_sz: u32,
    /// Typical packet size in bytes (0: [`DEFAULT_TYPICAL_PKT_SZ`]).
    pub typical_pkt_sz: u16,
}

/// A token bucket in bytes, refilled at the rate and capped at the burst size. A frame goes
/// when the bucket holds its size (or is full, for frames beyond the burst size, which then
/// leave it in debt): over any interval the bytes sent exceed rate × time by at most a burst.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    bytes_per_sec: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    /// A full bucket for `limit` at `now`.
    pub fn new(limit: RateLimit, now: Instant) -> Self {
        let typical = match limit.typical_pkt_sz {
            0 => DEFAULT_TYPICAL_PKT_SZ,
            t => u32::from(t),
        };
        let burst = f64::from(if limit.max_burst_sz == 0 {
            typical
        } else {
            limit.max_burst_sz
        });
        Self {
            bytes_per_sec: f64::from(limit.rate_kbps) * 1000.0 / 8.0,
            burst,
            tokens: burst,
            last: now,
        }
    }

    /// Charges a frame of `len` bytes and returns `None` if it may go at `now`; otherwise
    /// returns when it may (nothing is charged).
    pub fn admit(&mut self, now: Instant, len: usize) -> Option<Instant> {
        let elapsed = now.saturating_since(self.last).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.bytes_per_sec).min(self.burst);
        self.last = now;
        let need = (len as f64).min(self.burst);
        if self.tokens >= need {
            self.tokens -= len as f64;
            return None;
        }
        let wait = (need - self.tokens) / self.bytes_per_sec;
        // Rounded up so that the bucket has room when the caller comes back.
        Some(now + Duration::from_nanos((wait * 1e9).ceil() as u64 + 1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_run_rate_matches_the_limit() {
        // 8 Mbit/s = 1 MB/s, burst 10 kB: 1000-byte frames sent as soon as admitted.
        let mut b = TokenBucket::new(
            RateLimit {
                rate_kbps: 8000,
                max_burst_sz: 10_000,
                typical_pkt_sz: 1000,
            },
            Instant::ZERO,
        );
        let mut now = Instant::ZERO;
        let mut sent = 0u64;
        while sent < 1_010_000 {
            match b.admit(now, 1000) {
                None => sent += 1000,
                Some(t) => {
                    assert!(t > now);
                    now = t;
                }
            }
        }
        // 1 MB beyond the initial burst takes one second.
        let secs = now.as_nanos() as f64 / 1e9;
        assert!((0.99..1.01).contains(&secs), "{secs}");
    }

    #[test]
    fn frames_beyond_the_burst_still_go_and_leave_debt() {
        let mut b = TokenBucket::new(
            RateLimit {
                rate_kbps: 8,
                max_burst_sz: 100,
                typical_pkt_sz: 0,
            },
            Instant::ZERO,
        );
        assert_eq!(b.admit(Instant::ZERO, 1000), None);
        // 900 bytes of debt plus 100 for the next frame's bucket room, at 1000 B/s.
        let t = b.admit(Instant::ZERO, 100).unwrap();
        assert!((t.as_nanos() as f64 / 1e9 - 1.0).abs() < 1e-6);
        assert_eq!(b.admit(t, 100), None);
    }
}
