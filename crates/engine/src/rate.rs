//! Static-rate conversions (`ibv_rate_to_mult(3)`, `ibv_rate_to_mbps`).

/// `IBV_RATE_MAX`: no rate limit.
pub const RATE_MAX: i32 = 0;

/// (enum value, multiple of 2.5 Gbit/s or -1, Mbit/s) for every `enum ibv_rate` value.
const RATES: [(i32, i32, i32); 24] = [
    (2, 1, 2500),       // 2.5 Gbit/s
    (5, 2, 5000),       // 5
    (3, 4, 10000),      // 10
    (6, 8, 20000),      // 20
    (4, 12, 30000),     // 30
    (7, 16, 40000),     // 40
    (8, 24, 60000),     // 60
    (9, 32, 80000),     // 80
    (10, 48, 120000),   // 120
    (11, -1, 14062),    // 14 (FDR10 lane rate, no 2.5G multiple)
    (12, -1, 56250),    // 56
    (13, -1, 112500),   // 112
    (14, -1, 168750),   // 168
    (15, -1, 25781),    // 25
    (16, -1, 103125),   // 100
    (17, -1, 206250),   // 200
    (18, -1, 309375),   // 300
    (19, 11, 28125),    // 28
    (20, 20, 53125),    // 50
    (21, 160, 425000),  // 400
    (22, 240, 637500),  // 600
    (23, -1, 850000),   // 800
    (24, -1, 1275000),  // 1200
    (RATE_MAX, -1, -1), // "max" has neither a multiple nor a speed
];

/// `ibv_rate_to_mult`: the multiple of 2.5 Gbit/s for a rate enum value, or -1.
pub fn rate_to_mult(rate: i32) -> i32 {
    RATES.iter().find(|r| r.0 == rate).map_or(-1, |r| r.1)
}

/// `mult_to_ibv_rate`: the rate enum value for a multiple of 2.5 Gbit/s, or `IBV_RATE_MAX`.
pub fn mult_to_rate(mult: i32) -> i32 {
    if mult <= 0 {
        return RATE_MAX;
    }
    RATES.iter().find(|r| r.1 == mult).map_or(RATE_MAX, |r| r.0)
}

/// `ibv_rate_to_mbps`: the speed of a rate enum value in Mbit/s, or -1.
pub fn rate_to_mbps(rate: i32) -> i32 {
    RATES.iter().find(|r| r.0 == rate).map_or(-1, |r| r.2)
}

/// `mbps_to_ibv_rate`: the rate enum value for an exact speed in Mbit/s, or `IBV_RATE_MAX`.
pub fn mbps_to_rate(mbps: i32) -> i32 {
    if mbps <= 0 {
        return RATE_MAX;
    }
    RATES.iter().find(|r| r.2 == mbps).map_or(RATE_MAX, |r| r.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn man_page_examples() {
        // ibv_rate_to_mult(3): IBV_RATE_5_GBPS (5) -> 2, and 2 -> IBV_RATE_5_GBPS.
        assert_eq!(rate_to_mult(5), 2);
        assert_eq!(mult_to_rate(2), 5);
        assert_eq!(rate_to_mbps(5), 5000);
        assert_eq!(mbps_to_rate(5000), 5);
    }

    #[test]
    fn round_trips_and_unknowns() {
        for &(rate, mult, mbps) in &RATES {
            if mult > 0 {
                assert_eq!(mult_to_rate(mult), rate);
                assert_eq!(rate_to_mult(rate), mult);
            }
            if mbps > 0 {
                assert_eq!(mbps_to_rate(mbps), rate);
            }
        }
        assert_eq!(rate_to_mult(99), -1);
        assert_eq!(rate_to_mult(RATE_MAX), -1);
        assert_eq!(mult_to_rate(3), RATE_MAX);
        assert_eq!(mult_to_rate(-4), RATE_MAX);
        assert_eq!(rate_to_mbps(-1), -1);
        assert_eq!(mbps_to_rate(12345), RATE_MAX);
    }
}
