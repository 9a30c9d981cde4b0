//! Memory windows (`ibv_alloc_mw(3)`, `ibv_bind_mw(3)`): the state of one window and the rules
//! of binding, using and invalidating it, as pure functions over [`Window`].
//!
//! A window's rkey is a 24-bit index (bits 8..32), fixed for its life, and an 8-bit tag that
//! each bind replaces (`ibv_inc_rkey(3)`). Whoever keeps windows looks them up by index and
//! lets [`Window`] compare the whole key.

use crate::memory::{KeyRef, MemError};
use crate::types::AccessFlags;

/// `enum ibv_mw_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MwType {
    /// Type 1: bound with `ibv_bind_mw`, usable by any QP of its PD.
    Type1,
    /// Type 2 (2B): bound by a BIND_MW work request, usable only by the QP that bound it,
    /// released by LOCAL_INV or a peer's SEND with Invalidate.
    Type2,
}

impl MwType {
    /// From `IBV_MW_TYPE_1`/`IBV_MW_TYPE_2`.
    pub fn from_raw(raw: u32) -> Option<Self> {
        match raw {
            1 => Some(Self::Type1),
            2 => Some(Self::Type2),
            _ => None,
        }
    }

    /// The `IBV_MW_TYPE_*` value.
    pub fn raw(self) -> u32 {
        match self {
            Self::Type1 => 1,
            Self::Type2 => 2,
        }
    }
}

/// `ibv_inc_rkey(3)`: the same index with the next tag.
pub fn inc_rkey(rkey: u32) -> u32 {
    (rkey & !0xFF) | (rkey.wrapping_add(1) & 0xFF)
}

/// The index part of a window's key, which names the window.
pub fn key_index(rkey: u32) -> u32 {
    rkey >> 8
}

/// The access flags a window may be given.
pub const MW_ACCESS: AccessFlags = AccessFlags::REMOTE_READ
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_ATOMIC)
    .union(AccessFlags::ZERO_BASED);

/// A BIND_MW work request (`ibv_send_wr.bind_mw`, or what `ibv_bind_mw` posts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MwBind {
    /// A key of the window to bind: its index names the window.
    pub mw_rkey: u32,
    /// The window's rkey after the bind: its tag (low 8 bits) replaces the window's.
    pub new_rkey: u32,
    /// The lkey of the memory region to bind to (unused for a type 1 unbind, `length` 0).
    pub mr_lkey: u32,
    /// First byte of the window, in the region's I/O virtual addresses (as its rkey sees it).
    pub addr: u64,
    /// Length of the window; 0 unbinds a type 1 window.
    pub length: u64,
    /// `mw_access_flags`: remote rights and `IBV_ACCESS_ZERO_BASED`.
    pub access: AccessFlags,
}

/// What a bind needs to know about the region it names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MrInfo {
    /// The region's protection domain.
    pub pd: u32,
    /// Its access rights.
    pub access: AccessFlags,
    /// Its first byte as remote keys address it.
    pub iova: u64,
    /// Its length.
    pub length: u64,
}

/// Where a bound window points.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowTarget {
    /// The region's lkey.
    pub mr_lkey: u32,
    /// First byte, in the region's I/O virtual addresses.
    pub addr: u64,
    /// Length.
    pub length: u64,
    /// Remote rights (and `ZERO_BASED`).
    pub access: AccessFlags,
    /// The QP a type 2 window is bound to.
    pub qpn: Option<u32>,
}

/// One memory window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// Type.
    pub mw_type: MwType,
    /// Protection domain.
    pub pd: u32,
    /// Current rkey.
    pub rkey: u32,
    /// The binding; `None` while unbound (type 1) or free (type 2).
    pub target: Option<WindowTarget>,
}

impl Window {
    /// A new, unbound window.
    pub fn new(mw_type: MwType, pd: u32, rkey: u32) -> Self {
        Self {
            mw_type,
            pd,
            rkey,
            target: None,
        }
    }

    /// Checks a bind posted on QP `qpn` of protection domain `qp_pd`; `mr` describes the region
    /// `bind.mr_lkey` names (`None` if no live region has that key). Returns the binding to
    /// apply with [`Window::apply_bind`] (`None`: the window becomes unbound).
    ///
    /// The rules, as the IBTA numbers them: the region has `IBV_ACCESS_MW_BIND` (C10-73); a
    /// window with remote write or atomic rights needs a region with local write (C10-74); the
    /// window lies inside the region (C10-75); the region is in the window's PD. Type 1 windows
    /// are never zero-based (o10-36.2.2). Type 2 only: the QP's PD is the window's (C10-72), the
    /// bind names a region with a length (o10-37.2.40), and the window is free (o10-37.2.30).
    pub fn check_bind(
        &self,
        qpn: u32,
        qp_pd: u32,
        bind: &MwBind,
        mr: Option<&MrInfo>,
    ) -> Result<Option<WindowTarget>, MemError> {
        if !MW_ACCESS.contains(bind.access) {
            return Err(MemError::InvalidBind);
        }
        match self.mw_type {
            MwType::Type1 => {
                if bind.access.contains(AccessFlags::ZERO_BASED) {
                    return Err(MemError::InvalidBind);
                }
                if bind.length == 0 {
                    return Ok(None);
                }
            }
            MwType::Type2 => {
                if qp_pd != self.pd {
                    return Err(MemError::WrongPd);
                }
                if self.target.is_some() {
                    return Err(MemError::BadState);
                }
                if bind.length == 0 {
                    return Err(MemError::InvalidBind);
                }
            }
        }
        let mr = mr.ok_or(MemError::BadKey)?;
        if mr.pd != self.pd {
            return Err(MemError::WrongPd);
        }
        if !mr.access.contains(AccessFlags::MW_BIND) {
            return Err(MemError::NoAccess);
        }
        if bind
            .access
            .intersects(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC)
            && !mr.access.contains(AccessFlags::LOCAL_WRITE)
        {
            return Err(MemError::NoAccess);
        }
        let inside = bind.addr >= mr.iova
            && bind
                .addr
                .checked_add(bind.length)
                .is_some_and(|end| end <= mr.iova + mr.length);
        if !inside {
            return Err(MemError::OutOfRange);
        }
        Ok(Some(WindowTarget {
            mr_lkey: bind.mr_lkey,
            addr: bind.addr,
            length: bind.length,
            access: bind.access,
            qpn: (self.mw_type == MwType::Type2).then_some(qpn),
        }))
    }

    /// Applies a bind [`Window::check_bind`] accepted: the new tag and binding.
    pub fn apply_bind(&mut self, bind: &MwBind, target: Option<WindowTarget>) {
        self.rkey = (self.rkey & !0xFF) | (bind.new_rkey & 0xFF);
        self.target = target;
    }

    /// Checks that QP `qpn` of protection domain `pd` may invalidate this window through
    /// `rkey` (LOCAL_INV, or a SEND with Invalidate it received): the key is the window's
    /// current one, the window is a bound type 2 window (type 1 windows cannot be invalidated,
    /// o10-37.2.26) of that PD and bound to that QP.
    pub fn check_invalidate(&self, qpn: u32, pd: u32, rkey: u32) -> Result<(), MemError> {
        if rkey != self.rkey {
            return Err(MemError::BadKey);
        }
        if self.mw_type != MwType::Type2 {
            return Err(MemError::BadState);
        }
        let target = self.target.ok_or(MemError::BadState)?;
        if pd != self.pd {
            return Err(MemError::WrongPd);
        }
        if target.qpn != Some(qpn) {
            return Err(MemError::WrongQp);
        }
        Ok(())
    }

    /// Frees the window (after [`Window::check_invalidate`], or when it is deallocated).
    pub fn invalidate(&mut self) {
        self.target = None;
    }

    /// Resolves a remote access of `len` bytes at `addr` through this window: checks key, PD,
    /// QP (type 2), rights and bounds as for a region, and returns the region's lkey and the
    /// address in the region's I/O virtual addresses. A zero-based window takes `addr` as an
    /// offset into the window.
    pub fn resolve(&self, key: KeyRef, addr: u64, len: u64) -> Result<(u32, u64), MemError> {
        if !key.access.is_remote() || key.key != self.rkey {
            return Err(MemError::BadKey);
        }
        let target = self.target.ok_or(MemError::BadState)?;
        if key.pd != self.pd {
            return Err(MemError::WrongPd);
        }
        if target.qpn.is_some_and(|q| q != key.qpn) {
            return Err(MemError::WrongQp);
        }
        // A window grants only remote read, write and atomic access (never FLUSH).
        if !target.access.contains(key.access.required_flags()) {
            return Err(MemError::NoAccess);
        }
        let offset = if target.access.contains(AccessFlags::ZERO_BASED) {
            addr
        } else {
            addr.checked_sub(target.addr).ok_or(MemError::OutOfRange)?
        };
        if offset.checked_add(len).is_none_or(|end| end > target.length) {
            return Err(MemError::OutOfRange);
        }
        Ok((target.mr_lkey, target.addr + offset))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::Access;

    const RW: AccessFlags = AccessFlags::REMOTE_READ.union(AccessFlags::REMOTE_WRITE);

    fn mr() -> MrInfo {
        MrInfo {
            pd: 1,
            access: AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND,
            iova: 0x1000,
            length: 0x1000,
        }
    }

    fn bind(addr: u64, length: u64, access: AccessFlags) -> MwBind {
        MwBind {
            mw_rkey: 0x1234_5600,
            new_rkey: 0x1234_5601,
            mr_lkey: 7,
            addr,
            length,
            access,
        }
    }

    fn key(key: u32, qpn: u32, access: Access) -> KeyRef {
        KeyRef {
            key,
            pd: 1,
            qpn,
            access,
        }
    }

    #[test]
    fn inc_rkey_changes_only_the_tag() {
        assert_eq!(inc_rkey(0x1234_56FF), 0x1234_5600);
        assert_eq!(inc_rkey(0x1234_5601), 0x1234_5602);
    }

    #[test]
    fn bind_rules() {
        let w2 = Window::new(MwType::Type2, 1, 0x1234_5600);
        let ok = bind(0x1800, 0x100, RW);
        assert!(w2.check_bind(9, 1, &ok, Some(&mr())).unwrap().is_some());
        // C10-72, o10-37.2.40, C10-73, C10-74, C10-75, region PD.
        assert_eq!(w2.check_bind(9, 2, &ok, Some(&mr())), Err(MemError::WrongPd));
        assert_eq!(
            w2.check_bind(9, 1, &bind(0x1800, 0, RW), Some(&mr())),
            Err(MemError::InvalidBind)
        );
        let no_bind = MrInfo {
            access: AccessFlags::LOCAL_WRITE,
            ..mr()
        };
        assert_eq!(w2.check_bind(9, 1, &ok, Some(&no_bind)), Err(MemError::NoAccess));
        let read_only = MrInfo {
            access: AccessFlags::MW_BIND,
            ..mr()
        };
        assert_eq!(
            w2.check_bind(9, 1, &ok, Some(&read_only)),
            Err(MemError::NoAccess)
        );
        let r = bind(0x1800, 0x100, AccessFlags::REMOTE_READ);
        assert!(w2.check_bind(9, 1, &r, Some(&read_only)).is_ok());
        assert_eq!(
            w2.check_bind(9, 1, &bind(0x1F01, 0x100, RW), Some(&mr())),
            Err(MemError::OutOfRange)
        );
        assert_eq!(
            w2.check_bind(9, 1, &bind(0xFFF, 0x10, RW), Some(&mr())),
            Err(MemError::OutOfRange)
        );
        let other_pd = MrInfo { pd: 3, ..mr() };
        assert_eq!(w2.check_bind(9, 1, &ok, Some(&other_pd)), Err(MemError::WrongPd));
        assert_eq!(w2.check_bind(9, 1, &ok, None), Err(MemError::BadKey));
        assert_eq!(
            w2.check_bind(9, 1, &bind(0x1800, 0x100, AccessFlags::LOCAL_WRITE), Some(&mr())),
            Err(MemError::InvalidBind)
        );
        // o10-37.2.30: a bound type 2 window must be invalidated first.
        let mut bound = w2;
        let t = w2.check_bind(9, 1, &ok, Some(&mr())).unwrap();
        bound.apply_bind(&ok, t);
        assert_eq!(bound.rkey, 0x1234_5601);
        assert_eq!(bound.check_bind(9, 1, &ok, Some(&mr())), Err(MemError::BadState));
        // Type 1: rebinding and unbinding are allowed, zero-based is not.
        let mut w1 = Window::new(MwType::Type1, 1, 0x1234_5600);
        let t = w1.check_bind(9, 1, &ok, Some(&mr())).unwrap();
        w1.apply_bind(&ok, t);
        assert!(w1.check_bind(9, 1, &ok, Some(&mr())).is_ok());
        assert_eq!(w1.check_bind(9, 1, &bind(0, 0, RW), None), Ok(None));
        let zb = bind(0x1800, 0x100, RW | AccessFlags::ZERO_BASED);
        assert_eq!(w1.check_bind(9, 1, &zb, Some(&mr())), Err(MemError::InvalidBind));
        assert!(w2.check_bind(9, 1, &zb, Some(&mr())).is_ok());
    }

    #[test]
    fn access_through_a_window() {
        let mut w = Window::new(MwType::Type2, 1, 0x1234_5600);
        let b = bind(0x1800, 0x100, AccessFlags::REMOTE_WRITE);
        let t = w.check_bind(9, 1, &b, Some(&mr())).unwrap();
        assert_eq!(
            w.resolve(key(0x1234_5600, 9, Access::RemoteWrite), 0x1800, 1),
            Err(MemError::BadState)
        );
        w.apply_bind(&b, t);
        assert_eq!(
            w.resolve(key(0x1234_5601, 9, Access::RemoteWrite), 0x1810, 0x10),
            Ok((7, 0x1810))
        );
        assert_eq!(
            w.resolve(key(0x1234_5600, 9, Access::RemoteWrite), 0x1810, 1),
            Err(MemError::BadKey)
        );
        assert_eq!(
            w.resolve(key(0x1234_5601, 8, Access::RemoteWrite), 0x1810, 1),
            Err(MemError::WrongQp)
        );
        assert_eq!(
            w.resolve(key(0x1234_5601, 9, Access::RemoteRead), 0x1810, 1),
            Err(MemError::NoAccess)
        );
        assert_eq!(
            w.resolve(key(0x1234_5601, 9, Access::RemoteWrite), 0x18F0, 0x11),
            Err(MemError::OutOfRange)
        );
        assert_eq!(
            w.resolve(key(0x1234_5601, 9, Access::LocalWrite), 0x1810, 1),
            Err(MemError::BadKey)
        );
        let wrong_pd = KeyRef {
            pd: 2,
            ..key(0x1234_5601, 9, Access::RemoteWrite)
        };
        assert_eq!(w.resolve(wrong_pd, 0x1810, 1), Err(MemError::WrongPd));
        // Invalidation: the current key, the bound QP, the PD.
        assert_eq!(w.check_invalidate(9, 1, 0x1234_5600), Err(MemError::BadKey));
        assert_eq!(w.check_invalidate(8, 1, 0x1234_5601), Err(MemError::WrongQp));
        assert_eq!(w.check_invalidate(9, 2, 0x1234_5601), Err(MemError::WrongPd));
        w.check_invalidate(9, 1, 0x1234_5601).unwrap();
        w.invalidate();
        assert_eq!(w.check_invalidate(9, 1, 0x1234_5601), Err(MemError::BadState));
        assert_eq!(
            w.resolve(key(0x1234_5601, 9, Access::RemoteWrite), 0x1810, 1),
            Err(MemError::BadState)
        );
    }

    #[test]
    fn zero_based_windows_address_by_offset() {
        let mut w = Window::new(MwType::Type2, 1, 0x100);
        let b = bind(0x1800, 0x100, AccessFlags::REMOTE_READ | AccessFlags::ZERO_BASED);
        let t = w.check_bind(9, 1, &b, Some(&mr())).unwrap();
        w.apply_bind(&b, t);
        let k = key(0x101, 9, Access::RemoteRead);
        assert_eq!(w.resolve(k, 0x10, 0x20), Ok((7, 0x1810)));
        assert_eq!(w.resolve(k, 0xF0, 0x11), Err(MemError::OutOfRange));
        assert_eq!(w.resolve(k, 0x1800, 1), Err(MemError::OutOfRange));
    }

    #[test]
    fn type1_windows_are_not_invalidated() {
        let mut w = Window::new(MwType::Type1, 1, 0x100);
        let b = bind(0x1800, 0x100, AccessFlags::REMOTE_READ);
        let t = w.check_bind(9, 1, &b, Some(&mr())).unwrap();
        w.apply_bind(&b, t);
        assert_eq!(w.check_invalidate(9, 1, 0x101), Err(MemError::BadState));
        // Any QP of the PD may use a type 1 window.
        assert!(w.resolve(key(0x101, 4, Access::RemoteRead), 0x1800, 1).is_ok());
    }
}
