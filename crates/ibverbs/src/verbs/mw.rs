//! Memory windows: the `alloc_mw`, `bind_mw` and `dealloc_mw` context ops that the inline
//! `ibv_alloc_mw`, `ibv_bind_mw` and `ibv_dealloc_mw` call, and the translation of BIND_MW and
//! LOCAL_INV work requests (`ibv_post_send`, `ibv_wr_bind_mw`, `ibv_wr_local_inv`).

use std::ffi::{c_int, c_uint};
use std::sync::Arc;

use softverbs_device::{Mw, Type1Bind};
use softverbs_engine::mw::MwBind;
use softverbs_engine::types::{AccessFlags, SendFlags};
use softverbs_engine::wr::SendOp;

use super::{destroy_boxed, errno_of, outer, SvMr, SvPd, SvQp, EINVAL};
use crate::abi::*;
use crate::{fail, fail_null};

/// `struct ibv_mw_bind`.
#[repr(C)]
pub(crate) struct ibv_mw_bind {
    pub(crate) wr_id: u64,
    pub(crate) send_flags: c_uint,
    pub(crate) bind_info: ibv_mw_bind_info,
}

#[repr(C)]
pub(crate) struct SvMw {
    pub(crate) mw: ibv_mw,
    pub(crate) core: Arc<Mw>,
}

/// The `alloc_mw` op.
pub(crate) unsafe extern "C" fn alloc_mw(pd: *mut ibv_pd, mw_type: c_uint) -> *mut ibv_mw {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(p) = (unsafe { outer::<SvPd, _>(pd) }) else {
        return fail_null(EINVAL);
    };
    match Mw::alloc(&p.core, mw_type) {
        Ok(core) => {
            let mw = ibv_mw {
                // SAFETY: `pd` is live (checked above); read its context pointer.
                context: unsafe { (*pd).context },
                pd,
                rkey: core.rkey(),
                handle: core.handle(),
                mw_type,
            };
            Box::into_raw(Box::new(SvMw { mw, core })).cast()
        }
        Err(e) => fail_null(errno_of(&e)),
    }
}

/// The `dealloc_mw` op: unbinds the window if bound and frees it.
pub(crate) unsafe extern "C" fn dealloc_mw(mw: *mut ibv_mw) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    unsafe { destroy_boxed::<SvMw, _>(mw, |m| m.core.dealloc()) }
}

/// The core region of a bind's `mr` (NULL: none).
///
/// # Safety
/// `mr` must be NULL or a live region of this library.
unsafe fn region(mr: *mut ibv_mr) -> Option<Arc<softverbs_device::Mr>> {
    // SAFETY: per the contract.
    unsafe { outer::<SvMr, _>(mr) }.map(|m| m.core.lock().unwrap_or_else(|p| p.into_inner()).clone())
}

/// The `bind_mw` op (type 1 windows; the inline `ibv_bind_mw` has checked the type and the
/// MR's PD): posts the bind and writes the window's new rkey into `mw->rkey`.
pub(crate) unsafe extern "C" fn bind_mw(qp: *mut ibv_qp, mw: *mut ibv_mw, bind: *mut ibv_mw_bind) -> c_int {
    // SAFETY: the caller passes NULL or live objects of this library (the verbs API contract).
    let (Some(q), Some(m)) = (unsafe { outer::<SvQp, _>(qp) }, unsafe { outer::<SvMw, _>(mw) }) else {
        return fail(EINVAL);
    };
    if bind.is_null() {
        return fail(EINVAL);
    }
    // SAFETY: `bind` is a readable `struct ibv_mw_bind`.
    let b = unsafe { &*bind };
    let req = Type1Bind {
        wr_id: b.wr_id,
        send_flags: SendFlags::from_bits_truncate(b.send_flags),
        // SAFETY: `bind_info.mr` is NULL or a live region (the verbs API contract).
        mr: unsafe { region(b.bind_info.mr) },
        addr: b.bind_info.addr,
        length: b.bind_info.length,
        access: b.bind_info.mw_access_flags,
    };
    match m.core.bind(&q.core, &req) {
        Ok(rkey) => {
            // SAFETY: `mw` is live; ibv_bind_mw(3) returns the new key in `mw->rkey`.
            unsafe { (*mw).rkey = rkey };
            0
        }
        Err(e) => fail(errno_of(&e)),
    }
}

/// The operation of a BIND_MW work request binding `mw` with `rkey` as `info` says.
///
/// # Safety
/// `mw` and `info.mr` must be NULL or live objects of this library.
pub(crate) unsafe fn bind_op(mw: *mut ibv_mw, rkey: u32, info: &ibv_mw_bind_info) -> Result<SendOp, c_int> {
    // SAFETY: per the contract.
    let m = unsafe { outer::<SvMw, _>(mw) }.ok_or(EINVAL)?;
    // SAFETY: per the contract.
    let mr_lkey = unsafe { region(info.mr) }.map_or(0, |r| r.lkey());
    Ok(SendOp::BindMw(MwBind {
        mw_rkey: m.core.rkey(),
        new_rkey: rkey,
        mr_lkey,
        addr: info.addr,
        length: info.length,
        access: AccessFlags::from_bits_retain(info.mw_access_flags),
    }))
}

/// `ibv_wr_bind_mw`.
pub(crate) unsafe extern "C" fn wr_bind_mw(
    qpx: *mut ibv_qp_ex,
    mw: *mut ibv_mw,
    rkey: u32,
    info: *const ibv_mw_bind_info,
) {
    let op = if info.is_null() {
        Err(EINVAL)
    } else {
        // SAFETY: `info` is readable and names NULL or live objects (the verbs API contract).
        unsafe { bind_op(mw, rkey, &*info) }
    };
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    unsafe { crate::datapath::push_op(qpx, op) };
}

/// `ibv_wr_local_inv`.
pub(crate) unsafe extern "C" fn wr_local_inv(qpx: *mut ibv_qp_ex, rkey: u32) {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    unsafe { crate::datapath::push_op(qpx, Ok(SendOp::LocalInv { rkey })) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn layouts_match_verbs_h() {
        assert_eq!(offset_of!(ibv_mw_bind, send_flags), 8);
        assert_eq!(offset_of!(ibv_mw_bind, bind_info), 16);
        assert_eq!(size_of::<ibv_mw_bind>(), 48);
        assert_eq!(offset_of!(SvMw, mw), 0);
    }
}
