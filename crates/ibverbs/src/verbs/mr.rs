//! Memory registration: `ibv_reg_mr` and its iova variants, `ibv_dereg_mr`.

use std::ffi::{c_int, c_uint, c_void};
use std::sync::Mutex;

use super::{destroy_boxed, errno_of, outer, SvMr, SvPd, EINVAL};
use crate::abi::*;
use crate::fail_null;

pub(crate) unsafe fn reg(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: c_int,
) -> *mut ibv_mr {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(p) = (unsafe { outer::<SvPd, _>(pd) }) else {
        return fail_null(EINVAL);
    };
    match crate::odp::register(&p.core, addr, length, iova, access as u32) {
        Ok(core) => {
            let mr = ibv_mr {
                // SAFETY: `pd` is live (checked above); read its context pointer.
                context: unsafe { (*pd).context },
                pd,
                addr,
                length,
                handle: core.handle(),
                lkey: core.lkey(),
                rkey: core.rkey(),
            };
            Box::into_raw(Box::new(SvMr {
                mr,
                core: Mutex::new(core),
            }))
            .cast()
        }
        Err(e) => fail_null(errno_of(&e)),
    }
}

/// `ibv_reg_mr`.
pub(crate) unsafe extern "C" fn reg_mr(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    access: c_int,
) -> *mut ibv_mr {
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    unsafe { reg(pd, addr, length, addr as u64, access) }
}

/// `ibv_reg_mr_iova`.
pub(crate) unsafe extern "C" fn reg_mr_iova(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: c_int,
) -> *mut ibv_mr {
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    unsafe { reg(pd, addr, length, iova, access) }
}

/// `ibv_reg_mr_iova2`.
pub(crate) unsafe extern "C" fn reg_mr_iova2(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: c_uint,
) -> *mut ibv_mr {
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    unsafe { reg(pd, addr, length, iova, access as c_int) }
}

/// `ibv_alloc_null_mr`: a region whose lkey discards what is written through it and reads as
/// zeros, anywhere; freed with `ibv_dereg_mr`. Its `addr` is NULL, its length the whole address
/// space, and its `rkey` 0: it is not exposed to remote peers.
pub(crate) unsafe extern "C" fn alloc_null_mr(pd: *mut ibv_pd) -> *mut ibv_mr {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(p) = (unsafe { outer::<SvPd, _>(pd) }) else {
        return fail_null(EINVAL);
    };
    match softverbs_device::pd::Mr::alloc_null(&p.core) {
        Ok(core) => {
            let mr = ibv_mr {
                // SAFETY: `pd` is live (checked above); read its context pointer.
                context: unsafe { (*pd).context },
                pd,
                addr: std::ptr::null_mut(),
                length: usize::MAX,
                handle: core.handle(),
                lkey: core.lkey(),
                rkey: 0,
            };
            Box::into_raw(Box::new(SvMr {
                mr,
                core: Mutex::new(core),
            }))
            .cast()
        }
        Err(e) => fail_null(errno_of(&e)),
    }
}

/// `ibv_dereg_mr`.
pub(crate) unsafe extern "C" fn dereg_mr(mr: *mut ibv_mr) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    unsafe { destroy_boxed::<SvMr, _>(mr, |m| m.core.lock().unwrap_or_else(|p| p.into_inner()).dereg()) }
}
