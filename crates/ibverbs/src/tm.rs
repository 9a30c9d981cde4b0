//! Tag matching in the C ABI: `ibv_create_srq_ex` with `IBV_SRQT_TM`, the `post_srq_ops` op
//! behind the inline `ibv_post_srq_ops`, `ibv_wc_read_tm_info` and `tm_caps` of
//! `ibv_query_device_ex`. The semantics are the core's (`softverbs_device::tm`); this module
//! only translates.

use std::ffi::c_int;
use std::ptr::addr_of_mut;

use softverbs_device::Srq;
use softverbs_engine::tm::{OpsFlags, SrqOp, SrqOpKind, TmCap, TmCaps};
use softverbs_engine::types::{Sge, SrqAttr};
use softverbs_engine::Errno;

use crate::abi::*;
use crate::verbs::{errno_of, outer, SvCq, SvPd, SvSrq};
use crate::{fail, fail_null};

const EINVAL: c_int = Errno::EINVAL as c_int;

/// `ibv_tm_caps` of a device.
pub(crate) fn tm_caps_c(c: &TmCaps) -> ibv_tm_caps {
    ibv_tm_caps {
        max_rndv_hdr_size: c.max_rndv_hdr_size,
        max_num_tags: c.max_num_tags,
        flags: c.flags.bits(),
        max_ops: c.max_ops,
        max_sge: c.max_sge,
    }
}

/// `ibv_create_srq_ex` for `IBV_SRQT_TM`: the mask must hold `TYPE|PD|CQ|TM` and nothing
/// else (EINVAL), the CQ must be given.
///
/// # Safety
/// `init` must be a live `struct ibv_srq_init_attr_ex` whose pointers follow the verbs API
/// contract.
pub(crate) unsafe fn create_tm_srq(init: *mut ibv_srq_init_attr_ex) -> *mut ibv_srq {
    const NEEDED: u32 =
        IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_PD | IBV_SRQ_INIT_ATTR_CQ | IBV_SRQ_INIT_ATTR_TM;
    // SAFETY: `init` is a live `struct ibv_srq_init_attr_ex`.
    let (mask, pd, cq, srq_context, tm, attr) = unsafe {
        (
            (*init).comp_mask,
            (*init).pd,
            (*init).cq,
            (*init).srq_context,
            (*init).tm_cap,
            addr_of_mut!((*init).attr),
        )
    };
    if mask != NEEDED {
        return fail_null(EINVAL);
    }
    // SAFETY: the caller passes NULL or live objects of this library (the verbs API contract).
    let (Some(p), Some(c)) = (unsafe { outer::<SvPd, _>(pd) }, unsafe { outer::<SvCq, _>(cq) }) else {
        return fail_null(EINVAL);
    };
    // SAFETY: `attr` points into the caller's live struct.
    let a = unsafe { *attr };
    // SAFETY: `pd` is a live PD of this library (checked above).
    let queue = match unsafe { crate::domain::recv_queue(pd, a.max_wr, a.max_sge, crate::domain::RES_SRQ) } {
        Ok(q) => q,
        Err(e) => return fail_null(e),
    };
    let core = match Srq::create_tm(
        &p.core,
        &SrqAttr {
            max_wr: a.max_wr,
            max_sge: a.max_sge,
            srq_limit: a.srq_limit,
        },
        &c.core,
        TmCap {
            max_num_tags: tm.max_num_tags,
            max_ops: tm.max_ops,
        },
    ) {
        Ok(s) => s,
        Err(e) => return fail_null(errno_of(&e)),
    };
    // SAFETY: as above; the actual sizes go back into the caller's attributes.
    unsafe { crate::verbs::box_srq(pd, srq_context, &mut *attr, core, queue) }.cast()
}

/// One `ibv_ops_wr`, or EINVAL for an unknown opcode or a bad scatter list.
///
/// # Safety
/// `w.tm.add.sg_list` must point at `num_sge` readable `ibv_sge`s for an ADD.
unsafe fn op_core(w: &ibv_ops_wr) -> Result<SrqOp, c_int> {
    let flags = OpsFlags::from_bits(w.flags as u32).ok_or(EINVAL)?;
    let kind = match w.opcode {
        0 => {
            let a = &w.tm.add;
            if a.num_sge < 0 || (a.num_sge > 0 && a.sg_list.is_null()) {
                return Err(EINVAL);
            }
            let sg_list = if a.num_sge == 0 {
                Vec::new()
            } else {
                // SAFETY: the caller's list holds `num_sge` entries.
                unsafe { std::slice::from_raw_parts(a.sg_list, a.num_sge as usize) }
                    .iter()
                    .map(|s| Sge {
                        addr: s.addr,
                        length: s.length,
                        lkey: s.lkey,
                    })
                    .collect()
            };
            SrqOpKind::Add {
                recv_wr_id: a.recv_wr_id,
                sg_list,
                tag: a.tag,
                mask: a.mask,
            }
        }
        1 => SrqOpKind::Del { handle: w.tm.handle },
        2 => SrqOpKind::Sync,
        _ => return Err(EINVAL),
    };
    Ok(SrqOp {
        wr_id: w.wr_id,
        kind,
        flags,
        unexpected_cnt: w.tm.unexpected_cnt,
    })
}

/// The `post_srq_ops` op: performs the list in order; the handle of each `IBV_WR_TAG_ADD`
/// goes to its `tm.handle`; on failure `*bad_op` names the first operation not performed.
pub(crate) unsafe extern "C" fn post_srq_ops(
    srq: *mut ibv_srq,
    wr: *mut ibv_ops_wr,
    bad: *mut *mut ibv_ops_wr,
) -> c_int {
    let set_bad = |p: *mut ibv_ops_wr| {
        if !bad.is_null() {
            // SAFETY: `bad` is writable.
            unsafe { *bad = p };
        }
    };
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(s) = (unsafe { outer::<SvSrq, _>(srq) }) else {
        set_bad(wr);
        return fail(EINVAL);
    };
    let (mut ops, mut ptrs) = (Vec::new(), Vec::new());
    let mut conv_err = None;
    let mut p = wr;
    while !p.is_null() {
        // SAFETY: `p` is an operation of the caller's list.
        let w = unsafe { &*p };
        // SAFETY: the caller's list follows the verbs API contract.
        match unsafe { op_core(w) } {
            Ok(op) => {
                ops.push(op);
                ptrs.push(p);
            }
            Err(e) => {
                conv_err = Some((p, e));
                break;
            }
        }
        p = w.next;
    }
    let (handles, result) = s.core.post_ops(&ops);
    for (i, h) in handles.iter().enumerate() {
        if matches!(ops[i].kind, SrqOpKind::Add { .. }) {
            // SAFETY: `ptrs[i]` is a live operation of the caller's list.
            unsafe { (*ptrs[i]).tm.handle = *h };
        }
    }
    let (bad_op, err) = match result {
        Ok(()) => match conv_err {
            Some(x) => x,
            None => return 0,
        },
        Err(e) => (ptrs[e.index], e.error.errno()),
    };
    set_bad(bad_op);
    fail(err)
}

/// `ibv_wc_read_tm_info`: the TMH's tag and `app_ctx` of the current completion.
pub(crate) unsafe extern "C" fn read_tm_info(cq: *mut ibv_cq_ex, info: *mut ibv_wc_tm_info) {
    // SAFETY: the pointer is a live CQ of this library, as the verbs API requires.
    let wc = unsafe { crate::datapath::current_wc(cq) };
    if !info.is_null() {
        // SAFETY: `info` is writable.
        unsafe {
            info.write(ibv_wc_tm_info {
                tag: wc.tm_info.tag,
                priv_: wc.tm_info.priv_data,
            });
        }
    }
}
