//! Seeds and randomness.

/// xoshiro256**, seeded through splitmix64. (A bare splitmix64 counter is not enough here: a
/// retry loop that draws the same number of values per round walks the counter in a fixed
/// stride, and the outputs at such strides can correlate, so one packet was "corrupted" on
/// every retransmission.)
#[derive(Debug, Clone)]
pub struct Rng([u64; 4]);

impl Rng {
    pub fn new(seed: u64) -> Self {
        let mut sm = seed;
        let mut next = || {
            sm = sm.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = sm;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Self([next(), next(), next(), next()])
    }

    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.0;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// True with probability `pct` percent.
    pub fn chance(&mut self, pct: f64) -> bool {
        pct > 0.0 && (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * 100.0 < pct
    }

    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }

    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        self.fill(&mut v);
        v
    }
}

/// The seed override from `SOFTVERBS_SIM_SEED`, if set.
pub fn seed_override() -> Option<u64> {
    let s = std::env::var("SOFTVERBS_SIM_SEED").ok()?;
    let s = s.trim();
    let v = match s.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => s.parse(),
    };
    Some(v.unwrap_or_else(|_| panic!("SOFTVERBS_SIM_SEED={s} is not a number")))
}

/// The seeds a multi-seed test runs: `defaults`, or just the override.
pub fn seeds(defaults: &[u64]) -> Vec<u64> {
    match seed_override() {
        Some(s) => vec![s],
        None => defaults.to_vec(),
    }
}
