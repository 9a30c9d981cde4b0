//! Queue pairs: creation, state changes, queries and multicast attachment.

use std::ffi::{c_int, c_uint, c_void};
use std::ptr::addr_of_mut;
use std::sync::{Arc, Mutex};

use softverbs_device::qp::QpInitAttr;
use softverbs_device::Qp;
use softverbs_engine::types::{Gid, QpAttrMask, QpState, QpType};

use super::{
    cap_c, cap_core, context, destroy_boxed, errno_of, outer, qp_attr_c, qp_attr_core, SvCq, SvPd, SvQp,
    SvSrq, WrBatch, EINVAL, EOPNOTSUPP,
};
use crate::abi::*;
use crate::{datapath, fail, fail_null};

/// What `ibv_create_qp` and the `create_qp_ex` op share.
pub(crate) struct NewQp {
    pub(crate) pd: *mut ibv_pd,
    pub(crate) qp_context: *mut c_void,
    pub(crate) send_cq: *mut ibv_cq,
    pub(crate) recv_cq: *mut ibv_cq,
    pub(crate) srq: *mut ibv_srq,
    pub(crate) cap: *mut ibv_qp_cap,
    pub(crate) qp_type: c_uint,
    pub(crate) sq_sig_all: bool,
    /// `max_tso_header` (from `ibv_create_qp_ex`), 0 otherwise.
    pub(crate) max_tso_header: u16,
}

/// Creates a QP box and writes the actual capabilities back into `n.cap`.
pub(crate) unsafe fn new_qp(n: &NewQp) -> Result<*mut SvQp, c_int> {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let pd = unsafe { outer::<SvPd, _>(n.pd) }.ok_or(EINVAL)?;
    let qp_type = match QpType::from_raw(n.qp_type) {
        // An XRC_RECV QP has no PD: it comes from `create_qp_ex` with an XRC domain.
        Some(QpType::XrcRecv) => return Err(EINVAL),
        Some(t) => t,
        None => return Err(EOPNOTSUPP),
    };
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let send_cq = unsafe { outer::<SvCq, _>(n.send_cq) }.ok_or(EINVAL)?;
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let recv_cq = unsafe { outer::<SvCq, _>(n.recv_cq) };
    // An XRC_SEND QP receives nothing; the others need a receive CQ.
    if recv_cq.is_none() && qp_type != QpType::XrcSend {
        return Err(EINVAL);
    }
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let srq = unsafe { outer::<SvSrq, _>(n.srq) };
    if n.cap.is_null() {
        return Err(EINVAL);
    }
    // SAFETY: `cap` is a readable and writable `struct ibv_qp_cap` inside the init attributes.
    let cap = cap_core(unsafe { &*n.cap });
    let queues = match &pd.parent {
        // SAFETY: `n.pd` is the live parent domain `parent` belongs to.
        Some(parent) => Some(unsafe { crate::domain::qp_queues(n.pd, parent, &cap) }?),
        None => None,
    };
    let init = QpInitAttr {
        qp_type,
        send_cq: Some(send_cq.core.clone()),
        recv_cq: recv_cq.map(|c| c.core.clone()),
        srq: srq.map(|s| s.core.clone()),
        cap,
        sq_sig_all: n.sq_sig_all,
        max_tso_header: n.max_tso_header,
    };
    // The QP belongs to the context the C PD handle is in (an imported PD's is the importer's).
    // SAFETY: `pd` is live, and so is the context it names.
    let ctx = unsafe { context(pd.pd.context) }.ok_or(EINVAL)?;
    let core = Qp::create_in(&ctx.core, &pd.core, &init).map_err(|e| errno_of(&e))?;
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    Ok(unsafe { box_qp(n, core, queues) })
}

/// Boxes a created core QP for C and writes its actual capabilities into `n.cap`; `queues` are
/// its buffers from a parent domain's allocator, if any.
///
/// # Safety
/// `n.pd` is a live PD of this library and `n.cap` a writable `struct ibv_qp_cap`.
pub(crate) unsafe fn box_qp(n: &NewQp, core: Arc<Qp>, queues: Option<crate::domain::QpQueues>) -> *mut SvQp {
    // SAFETY: as above.
    unsafe { n.cap.write(cap_c(&core.cap())) };
    let qp = ibv_qp {
        // SAFETY: `pd` is live.
        context: unsafe { (*n.pd).context },
        qp_context: n.qp_context,
        pd: n.pd,
        send_cq: n.send_cq,
        recv_cq: n.recv_cq,
        srq: n.srq,
        handle: core.handle(),
        qp_num: core.qpn(),
        state: QpState::Reset.raw(),
        qp_type: n.qp_type,
        mutex: pthread_mutex_t([0; 40]),
        cond: pthread_cond_t([0; 48]),
        events_completed: 0,
    };
    let b = Box::into_raw(Box::new(SvQp {
        qp: datapath::qp_ex(qp),
        core,
        sq_sig_all: n.sq_sig_all,
        batch: Mutex::new(WrBatch::default()),
        opened_via: None,
        queues,
    }));
    // SAFETY: `b` is live.
    unsafe { (*b).core.set_user_data(b as u64) };
    b
}

/// `ibv_create_qp`.
pub(crate) unsafe extern "C" fn create_qp(pd: *mut ibv_pd, init: *mut ibv_qp_init_attr) -> *mut ibv_qp {
    if init.is_null() {
        return fail_null(EINVAL);
    }
    // SAFETY: `init` is a live `struct ibv_qp_init_attr`.
    let n = unsafe {
        NewQp {
            pd,
            qp_context: (*init).qp_context,
            send_cq: (*init).send_cq,
            recv_cq: (*init).recv_cq,
            srq: (*init).srq,
            cap: addr_of_mut!((*init).cap),
            qp_type: (*init).qp_type,
            sq_sig_all: (*init).sq_sig_all != 0,
            max_tso_header: 0,
        }
    };
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    match unsafe { new_qp(&n) } {
        Ok(b) => b.cast(),
        Err(e) => fail_null(e),
    }
}

/// `ibv_modify_qp`: 0 or an errno; nothing changes on error.
pub(crate) unsafe extern "C" fn modify_qp(qp: *mut ibv_qp, attr: *mut ibv_qp_attr, mask: c_int) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(q) = (unsafe { outer::<SvQp, _>(qp) }) else {
        return fail(EINVAL);
    };
    if attr.is_null() {
        return fail(EINVAL);
    }
    let mask = QpAttrMask::from_bits_retain(mask as u32);
    // SAFETY: `attr` is a readable `struct ibv_qp_attr`.
    let a = match qp_attr_core(unsafe { &*attr }, mask) {
        Ok(a) => a,
        Err(e) => return fail(e),
    };
    match q.core.modify(&a, mask) {
        Ok(()) => {
            // SAFETY: `qp` is live; keep the public state in step, as rdma-core does.
            unsafe { (*qp).state = q.core.state().raw() };
            0
        }
        Err(e) => fail(errno_of(&e)),
    }
}

/// `ibv_query_qp`: every attribute, and the creation attributes.
pub(crate) unsafe extern "C" fn query_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    _mask: c_int,
    init: *mut ibv_qp_init_attr,
) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(q) = (unsafe { outer::<SvQp, _>(qp) }) else {
        return fail(EINVAL);
    };
    if attr.is_null() || init.is_null() {
        return fail(EINVAL);
    }
    let a = q.core.query();
    // SAFETY: `qp` is live and the out-pointers are writable.
    unsafe {
        attr.write(qp_attr_c(&a));
        (*qp).state = a.qp_state.raw();
        init.write(ibv_qp_init_attr {
            qp_context: (*qp).qp_context,
            send_cq: (*qp).send_cq,
            recv_cq: (*qp).recv_cq,
            srq: (*qp).srq,
            cap: cap_c(&q.core.cap()),
            qp_type: (*qp).qp_type,
            sq_sig_all: c_int::from(q.sq_sig_all),
        });
    }
    0
}

/// `ibv_destroy_qp`.
pub(crate) unsafe extern "C" fn destroy_qp(qp: *mut ibv_qp) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    unsafe {
        destroy_boxed::<SvQp, _>(qp, |q| match &q.opened_via {
            // A handle from `ibv_open_qp` closes only itself.
            Some(x) => q.core.close_opened(x, q as *const SvQp as u64),
            None => q.core.destroy(),
        })
    }
}

/// `ibv_query_qp_data_in_order`: the device places data in order, whole messages at a time.
pub(crate) extern "C" fn query_qp_data_in_order(_qp: *mut ibv_qp, _op: c_uint, flags: u32) -> c_int {
    const RETURN_CAPS: u32 = 1;
    const WHOLE_MSG: c_int = 1;
    const ALIGNED_128_BYTES: c_int = 2;
    if flags & RETURN_CAPS != 0 {
        WHOLE_MSG | ALIGNED_128_BYTES
    } else {
        1
    }
}

/// `ibv_attach_mcast`.
pub(crate) unsafe extern "C" fn attach_mcast(qp: *mut ibv_qp, gid: *const ibv_gid, lid: u16) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(q) = (unsafe { outer::<SvQp, _>(qp) }) else {
        return fail(EINVAL);
    };
    if gid.is_null() {
        return fail(EINVAL);
    }
    // SAFETY: `gid` is a readable `union ibv_gid`.
    match q.core.attach_mcast(&Gid(unsafe { (*gid).raw }), lid) {
        Ok(()) => 0,
        Err(e) => fail(errno_of(&e)),
    }
}

/// `ibv_detach_mcast`.
pub(crate) unsafe extern "C" fn detach_mcast(qp: *mut ibv_qp, gid: *const ibv_gid, lid: u16) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(q) = (unsafe { outer::<SvQp, _>(qp) }) else {
        return fail(EINVAL);
    };
    if gid.is_null() {
        return fail(EINVAL);
    }
    // SAFETY: `gid` is a readable `union ibv_gid`.
    match q.core.detach_mcast(&Gid(unsafe { (*gid).raw }), lid) {
        Ok(()) => 0,
        Err(e) => fail(errno_of(&e)),
    }
}
