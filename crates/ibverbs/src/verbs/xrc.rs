//! XRC: the `open_xrcd`, `close_xrcd` and `open_qp` ops, XRC SRQs for `create_srq_ex`, and
//! XRC_RECV QPs for `create_qp_ex`. The rules are the core's; this only translates.

use std::ffi::c_int;
use std::sync::{Arc, Mutex};

use softverbs_device::{Qp, Srq, Xrcd};
use softverbs_engine::types::{QpState, QpType};

use super::{context, destroy_boxed, errno_of, outer, srq_attr_core, SvCq, SvPd, SvQp, SvSrq, WrBatch};
use super::{EINVAL, EOPNOTSUPP};
use crate::abi::*;
use crate::{datapath, fail_null};

#[repr(C)]
pub(crate) struct SvXrcd {
    pub(crate) xrcd: ibv_xrcd,
    pub(crate) core: Arc<Xrcd>,
}

/// The `open_xrcd` op (`ibv_open_xrcd`): `FD` and `OFLAGS` are both required (EINVAL), unknown
/// mask bits are EOPNOTSUPP; `fd = -1` makes an anonymous domain.
pub(crate) unsafe extern "C" fn open_xrcd(
    ctx: *mut ibv_context,
    attr: *mut ibv_xrcd_init_attr,
) -> *mut ibv_xrcd {
    // SAFETY: the caller passes NULL or a context of this library (the verbs API contract).
    let Some(c) = (unsafe { context(ctx) }) else {
        return fail_null(EINVAL);
    };
    if attr.is_null() {
        return fail_null(EINVAL);
    }
    // SAFETY: `attr` is a readable `struct ibv_xrcd_init_attr`.
    let a = unsafe { &*attr };
    if a.comp_mask >= IBV_XRCD_INIT_ATTR_RESERVED {
        return fail_null(EOPNOTSUPP);
    }
    let both = IBV_XRCD_INIT_ATTR_FD | IBV_XRCD_INIT_ATTR_OFLAGS;
    if a.comp_mask & both != both {
        return fail_null(EINVAL);
    }
    let fd = (a.fd != -1).then_some(a.fd);
    match Xrcd::open(&c.core, fd, a.oflags) {
        Ok(core) => Box::into_raw(Box::new(SvXrcd {
            xrcd: ibv_xrcd { context: ctx },
            core,
        }))
        .cast(),
        Err(e) => fail_null(errno_of(&e)),
    }
}

/// The `close_xrcd` op (`ibv_close_xrcd`, which calls it without a NULL check): EBUSY while
/// SRQs or QPs use the handle.
pub(crate) unsafe extern "C" fn close_xrcd(xrcd: *mut ibv_xrcd) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    unsafe { destroy_boxed::<SvXrcd, _>(xrcd, |x| x.core.close()) }
}

/// An XRC SRQ for `create_srq_ex`: mask `TYPE|XRCD|CQ|PD`, each object given (EINVAL
/// otherwise). The actual sizes are written back, as for any SRQ.
pub(crate) unsafe fn new_xrc_srq(init: *mut ibv_srq_init_attr_ex) -> Result<*mut SvSrq, c_int> {
    // SAFETY: `init` is a live `struct ibv_srq_init_attr_ex` (checked non-NULL by the caller).
    let i = unsafe { &mut *init };
    let needed =
        IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_PD | IBV_SRQ_INIT_ATTR_XRCD | IBV_SRQ_INIT_ATTR_CQ;
    if i.comp_mask & !needed != 0 {
        return Err(EOPNOTSUPP);
    }
    if i.comp_mask != needed {
        return Err(EINVAL);
    }
    // SAFETY: the caller passes NULL or live objects of this library (the verbs API contract).
    let (pd, x, cq) = unsafe {
        (
            outer::<SvPd, _>(i.pd).ok_or(EINVAL)?,
            outer::<SvXrcd, _>(i.xrcd).ok_or(EINVAL)?,
            outer::<SvCq, _>(i.cq.cast::<ibv_cq_ex>()).ok_or(EINVAL)?,
        )
    };
    // SAFETY: `i.pd` is a live PD of this library (checked above).
    let queue =
        unsafe { crate::domain::recv_queue(i.pd, i.attr.max_wr, i.attr.max_sge, crate::domain::RES_SRQ) }?;
    let core =
        Srq::create_xrc(&pd.core, &x.core, &cq.core, &srq_attr_core(&i.attr)).map_err(|e| errno_of(&e))?;
    // SAFETY: `i.pd` is a live PD of this library (checked above).
    Ok(unsafe { super::box_srq(i.pd, i.srq_context, &mut i.attr, core, queue) })
}

/// The value of an XRC_RECV QP handle: no PD, CQs or SRQ.
fn xrc_recv_box(
    ctx: *mut ibv_context,
    core: Arc<Qp>,
    qp_context: *mut std::ffi::c_void,
    state: u32,
    opened_via: Option<Arc<Xrcd>>,
) -> SvQp {
    let qp = ibv_qp {
        context: ctx,
        qp_context,
        pd: std::ptr::null_mut(),
        send_cq: std::ptr::null_mut(),
        recv_cq: std::ptr::null_mut(),
        srq: std::ptr::null_mut(),
        handle: core.handle(),
        qp_num: core.qpn(),
        state,
        qp_type: QpType::XrcRecv.raw(),
        mutex: pthread_mutex_t([0; 40]),
        cond: pthread_cond_t([0; 48]),
        events_completed: 0,
    };
    SvQp {
        qp: datapath::qp_ex(qp),
        core,
        sq_sig_all: false,
        batch: Mutex::new(WrBatch::default()),
        opened_via,
        queues: None,
    }
}

/// An XRC_RECV QP for `create_qp_ex`: the mask names an XRC domain (EINVAL without one); the
/// capabilities written back are all zero.
pub(crate) unsafe fn new_xrc_recv_qp(
    ctx: *mut ibv_context,
    a: &mut ibv_qp_init_attr_ex,
) -> Result<*mut SvQp, c_int> {
    if a.comp_mask & IBV_QP_INIT_ATTR_XRCD == 0 {
        return Err(EINVAL);
    }
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let x = unsafe { outer::<SvXrcd, _>(a.xrcd) }.ok_or(EINVAL)?;
    let core = Qp::create_xrc_recv(&x.core).map_err(|e| errno_of(&e))?;
    a.cap = super::cap_c(&core.cap());
    let ctx = if ctx.is_null() { x.xrcd.context } else { ctx };
    let b = Box::into_raw(Box::new(xrc_recv_box(
        ctx,
        core,
        a.qp_context,
        QpState::Reset.raw(),
        None,
    )));
    // Async events about the QP name the creator's handle.
    // SAFETY: `b` is live.
    unsafe { (*b).core.set_user_data(b as u64) };
    Ok(b)
}

/// The `open_qp` op (`ibv_open_qp`): `NUM|XRCD|TYPE` are required (EINVAL); the handle's state
/// reads `IBV_QPS_UNKNOWN` and its PD and CQs are NULL. Destroying it closes only it.
pub(crate) unsafe extern "C" fn open_qp(ctx: *mut ibv_context, attr: *mut ibv_qp_open_attr) -> *mut ibv_qp {
    if attr.is_null() {
        return fail_null(EINVAL);
    }
    // SAFETY: `attr` is a readable `struct ibv_qp_open_attr`.
    let a = unsafe { &*attr };
    let needed = IBV_QP_OPEN_ATTR_NUM | IBV_QP_OPEN_ATTR_XRCD | IBV_QP_OPEN_ATTR_TYPE;
    if a.comp_mask >= IBV_QP_OPEN_ATTR_RESERVED || a.comp_mask & needed != needed {
        return fail_null(EINVAL);
    }
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(x) = (unsafe { outer::<SvXrcd, _>(a.xrcd) }) else {
        return fail_null(EINVAL);
    };
    let Some(qp_type) = QpType::from_raw(a.qp_type) else {
        return fail_null(EINVAL);
    };
    // The handle's async events carry its address as their token, so the box is allocated
    // before the QP is opened.
    let slot = Box::into_raw(Box::<SvQp>::new_uninit());
    match Qp::open(&x.core, a.qp_num, qp_type, slot as u64) {
        Ok(core) => {
            let qp_context = if a.comp_mask & IBV_QP_OPEN_ATTR_CONTEXT != 0 {
                a.qp_context
            } else {
                std::ptr::null_mut()
            };
            let ctx = if ctx.is_null() { x.xrcd.context } else { ctx };
            let value = xrc_recv_box(ctx, core, qp_context, IBV_QPS_UNKNOWN, Some(x.core.clone()));
            // SAFETY: `slot` is a fresh, suitably aligned allocation for an `SvQp`; writing it
            // initialises it, after which it is an ordinary boxed `SvQp`.
            unsafe { (*slot).write(value) };
            slot.cast()
        }
        Err(e) => {
            // SAFETY: `slot` came from `Box::into_raw` above and was never initialised or shared.
            drop(unsafe { Box::from_raw(slot) });
            fail_null(errno_of(&e))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::offset_of;

    #[test]
    fn the_xrcd_box_starts_with_its_c_object() {
        assert_eq!(offset_of!(SvXrcd, xrcd), 0);
    }
}
