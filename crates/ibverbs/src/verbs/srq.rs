//! Shared receive queues.

use std::ffi::{c_int, c_void};
use std::ptr::addr_of_mut;
use std::sync::Arc;

use softverbs_device::Srq;

use super::{destroy_boxed, errno_of, outer, srq_attr_c, srq_attr_core, SvPd, SvSrq, EINVAL, EOPNOTSUPP};
use crate::abi::*;
use crate::{fail, fail_null};

/// Creates an SRQ box and writes the actual sizes back into `attr`; shared by
/// `ibv_create_srq` and the `create_srq_ex` op.
pub(crate) unsafe fn new_srq(
    pd: *mut ibv_pd,
    srq_context: *mut c_void,
    attr: *mut ibv_srq_attr,
) -> Result<*mut SvSrq, c_int> {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let p = unsafe { outer::<SvPd, _>(pd) }.ok_or(EINVAL)?;
    if attr.is_null() {
        return Err(EINVAL);
    }
    // SAFETY: `attr` is a readable and writable `struct ibv_srq_attr`.
    let a = unsafe { *attr };
    // SAFETY: `pd` is a live PD of this library (checked above).
    let queue = unsafe { crate::domain::recv_queue(pd, a.max_wr, a.max_sge, crate::domain::RES_SRQ) }?;
    let core = Srq::create(&p.core, &srq_attr_core(&a)).map_err(|e| errno_of(&e))?;
    // SAFETY: as above; ibv_create_srq(3) returns the actual sizes in the caller's attributes.
    Ok(unsafe { box_srq(pd, srq_context, &mut *attr, core, queue) })
}

/// Boxes a created core SRQ for C, writing its actual `max_wr` and `max_sge` into `attr`.
///
/// # Safety
/// `pd` is a live PD of this library.
pub(crate) unsafe fn box_srq(
    pd: *mut ibv_pd,
    srq_context: *mut c_void,
    attr: &mut ibv_srq_attr,
    core: Arc<Srq>,
    queue: Option<crate::domain::RecvQueue>,
) -> *mut SvSrq {
    let actual = core.query();
    attr.max_wr = actual.max_wr;
    attr.max_sge = actual.max_sge;
    let srq = ibv_srq {
        // SAFETY: `pd` is live (the caller's contract).
        context: unsafe { (*pd).context },
        srq_context,
        pd,
        handle: core.handle(),
        mutex: pthread_mutex_t([0; 40]),
        cond: pthread_cond_t([0; 48]),
        events_completed: 0,
    };
    let b = Box::into_raw(Box::new(SvSrq { srq, core, queue }));
    // SAFETY: `b` was just allocated and is live.
    unsafe { (*b).core.set_user_data(b as u64) };
    b
}

/// `ibv_create_srq`.
pub(crate) unsafe extern "C" fn create_srq(pd: *mut ibv_pd, init: *mut ibv_srq_init_attr) -> *mut ibv_srq {
    if init.is_null() {
        return fail_null(EINVAL);
    }
    // SAFETY: `init` is a live `struct ibv_srq_init_attr`.
    let (ctx, attr) = unsafe { ((*init).srq_context, addr_of_mut!((*init).attr)) };
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    match unsafe { new_srq(pd, ctx, attr) } {
        Ok(b) => b.cast(),
        Err(e) => fail_null(e),
    }
}

/// The `create_srq_ex` op: basic, XRC and tag-matching SRQs.
pub(crate) unsafe extern "C" fn create_srq_ex(
    _ctx: *mut ibv_context,
    init: *mut ibv_srq_init_attr_ex,
) -> *mut ibv_srq {
    if init.is_null() {
        return fail_null(EINVAL);
    }
    // SAFETY: `init` is a live `struct ibv_srq_init_attr_ex`.
    let (mask, ty, pd, srq_ctx, attr) = unsafe {
        (
            (*init).comp_mask,
            (*init).srq_type,
            (*init).pd,
            (*init).srq_context,
            addr_of_mut!((*init).attr),
        )
    };
    if mask & IBV_SRQ_INIT_ATTR_TYPE != 0 && ty == IBV_SRQT_XRC {
        // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
        return match unsafe { super::new_xrc_srq(init) } {
            Ok(b) => b.cast(),
            Err(e) => fail_null(e),
        };
    }
    if mask & IBV_SRQ_INIT_ATTR_TYPE != 0 && ty == IBV_SRQT_TM {
        // SAFETY: `init` is live and follows the verbs API contract.
        return unsafe { crate::tm::create_tm_srq(init) };
    }
    if mask & IBV_SRQ_INIT_ATTR_PD == 0 {
        return fail_null(EINVAL);
    }
    if mask & !(IBV_SRQ_INIT_ATTR_PD | IBV_SRQ_INIT_ATTR_TYPE) != 0
        || (mask & IBV_SRQ_INIT_ATTR_TYPE != 0 && ty != IBV_SRQT_BASIC)
    {
        return fail_null(EOPNOTSUPP);
    }
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    match unsafe { new_srq(pd, srq_ctx, attr) } {
        Ok(b) => b.cast(),
        Err(e) => fail_null(e),
    }
}

/// `ibv_modify_srq`.
pub(crate) unsafe extern "C" fn modify_srq(srq: *mut ibv_srq, attr: *mut ibv_srq_attr, mask: c_int) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(s) = (unsafe { outer::<SvSrq, _>(srq) }) else {
        return fail(EINVAL);
    };
    if attr.is_null() {
        return fail(EINVAL);
    }
    // SAFETY: `attr` is readable.
    let a = unsafe { *attr };
    match s.core.modify(&srq_attr_core(&a), mask as u32) {
        Ok(()) => 0,
        Err(e) => fail(errno_of(&e)),
    }
}

/// `ibv_query_srq`.
pub(crate) unsafe extern "C" fn query_srq(srq: *mut ibv_srq, attr: *mut ibv_srq_attr) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(s) = (unsafe { outer::<SvSrq, _>(srq) }) else {
        return fail(EINVAL);
    };
    if attr.is_null() {
        return fail(EINVAL);
    }
    let a = s.core.query();
    // SAFETY: `attr` is writable.
    unsafe {
        attr.write(srq_attr_c(&a));
    };
    0
}

/// `ibv_destroy_srq`.
pub(crate) unsafe extern "C" fn destroy_srq(srq: *mut ibv_srq) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    unsafe { destroy_boxed::<SvSrq, _>(srq, |s| s.core.destroy()) }
}

/// The `get_srq_num` op (`ibv_get_srq_num`): the 24-bit SRQ number.
pub(crate) unsafe extern "C" fn get_srq_num(srq: *mut ibv_srq, num: *mut u32) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(s) = (unsafe { outer::<SvSrq, _>(srq) }) else {
        return fail(EINVAL);
    };
    if num.is_null() {
        return fail(EINVAL);
    }
    // SAFETY: `num` is writable.
    unsafe { num.write(s.core.srq_num()) };
    0
}
