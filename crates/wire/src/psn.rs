//! 24-bit packet sequence numbers.

use core::cmp::Ordering;
use core::fmt;
use core::ops::{Add, AddAssign, Sub, SubAssign};

use crate::field::MASK_24;

/// A 24-bit packet sequence number that wraps.
///
/// Comparison is wrap-aware with a half window of 2^23, as rxe's
/// `psn_compare`: `a` is before `b` when `(a - b) mod 2^24` is at least
/// 2^23. The relation is not transitive over the whole space, so `Psn`
/// deliberately implements neither `PartialOrd` nor `Ord` (sorting with it
/// would be wrong); use [`Psn::wrapping_cmp`] and friends instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Psn(u32);

impl Psn {
    /// Mask of the 24 significant bits.
    pub const MASK: u32 = MASK_24;
    /// The number of distinct PSNs.
    pub const MODULUS: u32 = 1 << 24;
    /// Half the sequence space: the comparison window.
    pub const HALF: u32 = 1 << 23;
    /// PSN 0.
    pub const ZERO: Self = Self(0);
    /// The largest PSN, 0xFFFFFF.
    pub const MAX: Self = Self(MASK_24);

    /// Makes a PSN from the low 24 bits of `value`; higher bits are dropped.
    pub const fn new(value: u32) -> Self {
        Self(value & MASK_24)
    }

    /// The PSN as a number in `0..2^24`.
    pub const fn value(self) -> u32 {
        self.0
    }

    /// `self + n` modulo 2^24.
    pub const fn wrapping_add(self, n: u32) -> Self {
        Self::new(self.0.wrapping_add(n))
    }

    /// `self - n` modulo 2^24.
    pub const fn wrapping_sub(self, n: u32) -> Self {
        Self::new(self.0.wrapping_sub(n))
    }

    /// The following PSN.
    pub const fn next(self) -> Self {
        self.wrapping_add(1)
    }

    /// Steps forward from `self` to `later`, modulo 2^24.
    pub const fn distance(self, later: Self) -> u32 {
        later.0.wrapping_sub(self.0) & MASK_24
    }

    /// Signed wrap-aware difference `self - other`, in `-2^23..2^23`.
    ///
    /// Shifting the 24-bit difference into the top of an `i32` makes the
    /// sign bit the window test, exactly as rxe does.
    pub const fn diff(self, other: Self) -> i32 {
        (self.0.wrapping_sub(other.0) << 8) as i32 >> 8
    }

    /// Wrap-aware ordering of `self` relative to `other`.
    pub const fn wrapping_cmp(self, other: Self) -> Ordering {
        let d = self.diff(other);
        if d < 0 {
            Ordering::Less
        } else if d > 0 {
            Ordering::Greater
        } else {
            Ordering::Equal
        }
    }

    /// Whether `self` comes strictly before `other`.
    pub const fn is_before(self, other: Self) -> bool {
        self.diff(other) < 0
    }

    /// Whether `self` comes strictly after `other`.
    pub const fn is_after(self, other: Self) -> bool {
        self.diff(other) > 0
    }

    /// Whether `self` lies in the inclusive wrap-aware range `first..=last`.
    pub const fn in_range(self, first: Self, last: Self) -> bool {
        first.distance(self) <= first.distance(last)
    }
}

impl Add<u32> for Psn {
    type Output = Self;
    fn add(self, n: u32) -> Self {
        self.wrapping_add(n)
    }
}

impl AddAssign<u32> for Psn {
    fn add_assign(&mut self, n: u32) {
        *self = *self + n;
    }
}

impl Sub<u32> for Psn {
    type Output = Self;
    fn sub(self, n: u32) -> Self {
        self.wrapping_sub(n)
    }
}

impl SubAssign<u32> for Psn {
    fn sub_assign(&mut self, n: u32) {
        *self = *self - n;
    }
}

impl From<Psn> for u32 {
    fn from(psn: Psn) -> Self {
        psn.0
    }
}

impl fmt::Display for Psn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl fmt::LowerHex for Psn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::LowerHex::fmt(&self.0, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::string::ToString;

    fn psn() -> impl Strategy<Value = Psn> {
        (0..Psn::MODULUS).prop_map(Psn::new)
    }

    #[test]
    fn wraps() {
        assert_eq!(Psn::MAX + 1, Psn::ZERO);
        assert_eq!(Psn::ZERO - 1, Psn::MAX);
        assert_eq!(Psn::new(0x1_000_005), Psn::new(5));
        assert!(Psn::MAX.is_before(Psn::ZERO));
        assert!(Psn::ZERO.is_after(Psn::MAX));
        assert_eq!(Psn::ZERO.distance(Psn::MAX), Psn::MASK);
        assert_eq!(Psn::MAX.distance(Psn::new(2)), 3);
        assert_eq!(Psn::new(3).diff(Psn::MAX), 4);
        assert!(Psn::new(2).in_range(Psn::MAX, Psn::new(3)));
        assert!(!Psn::new(4).in_range(Psn::MAX, Psn::new(3)));
        assert_eq!(Psn::new(42).to_string(), "42");
    }

    #[test]
    fn half_window_edge_matches_rxe() {
        // rxe's (s32)((a - b) << 8) calls a distance of exactly 2^23
        // "before" in both directions.
        let a = Psn::ZERO;
        let b = a + Psn::HALF;
        assert!(a.is_before(b));
        assert!(b.is_before(a));
        assert!(a.is_before(b - 1));
        assert!((b + 1).is_before(a), "past half the space the order flips");
    }

    proptest! {
        #[test]
        fn add_sub_inverse(a in psn(), n in any::<u32>()) {
            prop_assert_eq!(a + n - n, a);
            prop_assert!((a + n).value() < Psn::MODULUS);
        }

        #[test]
        fn distance_matches_add(a in psn(), n in 0..Psn::MODULUS) {
            prop_assert_eq!(a.distance(a + n), n);
        }

        #[test]
        fn diff_within_window(a in psn(), n in 0..Psn::HALF) {
            let b = a + n;
            prop_assert_eq!(b.diff(a), n as i32);
            prop_assert_eq!(a.diff(b), -(n as i32));
            prop_assert_eq!(a.wrapping_cmp(b), if n == 0 { Ordering::Equal } else { Ordering::Less });
        }

        #[test]
        fn antisymmetric_off_the_edge(a in psn(), b in psn()) {
            prop_assume!(a.distance(b) != Psn::HALF);
            prop_assert_eq!(a.wrapping_cmp(b), b.wrapping_cmp(a).reverse());
            prop_assert_eq!(a.is_before(b), b.is_after(a));
            prop_assert_eq!(a == b, a.wrapping_cmp(b) == Ordering::Equal);
        }

        #[test]
        fn order_is_translation_invariant(a in psn(), b in psn(), k in any::<u32>()) {
            prop_assert_eq!((a + k).wrapping_cmp(b + k), a.wrapping_cmp(b));
        }

        #[test]
        fn transitive_within_a_window(a in psn(), x in 0..Psn::HALF / 2, y in 0..Psn::HALF / 2) {
            // Three PSNs inside one half window are totally ordered.
            let (b, c) = (a + x, a + x + y);
            prop_assert!(!a.is_after(b) && !b.is_after(c) && !a.is_after(c));
        }
    }
}
