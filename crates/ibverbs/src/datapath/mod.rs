//! The data path: the `ibv_context.ops` entries the inline `ibv_post_*`/`ibv_poll_cq`/
//! `ibv_req_notify_cq` call, the extended CQ (`ibv_cq_ex`: `start_poll`, `next_poll`,
//! `end_poll`, `read_*`) and the extended QP work-request API (`ibv_wr_*`).
//!
//! Work requests are translated into the core's [`SendRequest`]/[`RecvWr`]; inline data is
//! copied from the caller's addresses at post time. Failures set `*bad_wr` to the first work
//! request that was not posted and return its errno, as `ibv_post_send(3)` says, leaving it in
//! `errno` as well.

use std::ffi::{c_int, c_uint, c_void};
use std::ptr::null_mut;
use std::sync::MutexGuard;

use softverbs_device::qp::{SendRequest, UdAddress};
use softverbs_engine::types::{QpType, RecvWr, SendFlags, Sge, WorkCompletion};
use softverbs_engine::wr::{Payload, RemoteAddr, SendOp};
use softverbs_engine::Errno;

use crate::abi::*;
use crate::memory::copy_in;
use crate::verbs::{self, outer, NewQp, SvAh, SvCq, SvQp, SvSrq, WrBatch};
use crate::{fail, fail_null, set_errno};

const EINVAL: c_int = Errno::EINVAL as c_int;
const EOPNOTSUPP: c_int = Errno::EOPNOTSUPP as c_int;
const ENOENT: c_int = Errno::ENOENT as c_int;

/// `IBV_WC_STANDARD_FLAGS`: the `ibv_cq_ex` fields this device fills.
const WC_STANDARD_FLAGS: u64 = 0x7f;
/// `IBV_WC_EX_WITH_FLOW_TAG`.
const WC_EX_WITH_FLOW_TAG: u64 = 1 << 9;
/// `IBV_CQ_INIT_ATTR_MASK_FLAGS`.
const CQ_INIT_ATTR_MASK_FLAGS: u32 = 1;
/// `IBV_CQ_INIT_ATTR_MASK_PD`: `parent_domain` is set.
const CQ_INIT_ATTR_MASK_PD: u32 = 2;
/// `IBV_CREATE_CQ_ATTR_SINGLE_THREADED`.
const CREATE_CQ_ATTR_SINGLE_THREADED: u32 = 1;
/// The `IBV_QP_EX_WITH_*` operations the `ibv_wr_*` API offers here: all of rdma-core 44's
/// but TSO (0x3ff: WRITE .. SEND_WITH_INV, with LOCAL_INV and BIND_MW; ATOMIC WRITE is 1 << 12).
const SUPPORTED_SEND_OPS: u64 = 0x3ff | (1 << 12);
/// `IBV_WC_EX_WITH_COMPLETION_TIMESTAMP` and `_WALLCLOCK`.
const WC_TIMESTAMP_FLAGS: u64 = (1 << 7) | (1 << 11);

fn wc_c(w: &WorkCompletion) -> ibv_wc {
    ibv_wc {
        wr_id: w.wr_id,
        status: w.status.raw(),
        opcode: w.opcode.raw(),
        vendor_err: w.vendor_err,
        byte_len: w.byte_len,
        imm_data: w.imm_data,
        qp_num: w.qp_num,
        src_qp: w.src_qp,
        wc_flags: w.wc_flags.bits(),
        pkey_index: w.pkey_index,
        slid: w.slid,
        sl: w.sl,
        dlid_path_bits: w.dlid_path_bits,
    }
}

/// The scatter/gather list of a work request.
///
/// # Safety
/// `sg` must point at `n` readable `ibv_sge`s when `n > 0`.
unsafe fn sges(sg: *const ibv_sge, n: c_int) -> Result<Vec<Sge>, c_int> {
    if n < 0 || (n > 0 && sg.is_null()) {
        return Err(EINVAL);
    }
    if n == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: per the contract.
    let list = unsafe { std::slice::from_raw_parts(sg, n as usize) };
    Ok(list
        .iter()
        .map(|s| Sge {
            addr: s.addr,
            length: s.length,
            lkey: s.lkey,
        })
        .collect())
}

/// Inline data: the bytes the SGEs name, copied now.
///
/// # Safety
/// Every SGE must name readable memory (`ibv_post_send(3)`, `IBV_SEND_INLINE`).
unsafe fn inline_bytes(list: &[Sge]) -> Vec<u8> {
    let mut v = Vec::with_capacity(list.iter().map(|s| s.length as usize).sum());
    for s in list {
        // SAFETY: per the contract.
        v.extend_from_slice(&unsafe { copy_in(s.addr, s.length as usize) });
    }
    v
}

/// Translates one `ibv_send_wr`.
///
/// # Safety
/// `wr` must be a valid work request whose pointers are readable.
unsafe fn send_request(wr: &ibv_send_wr, qp_type: QpType) -> Result<SendRequest, c_int> {
    let flags = SendFlags::from_bits_truncate(wr.send_flags);
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    let list = unsafe { sges(wr.sg_list, wr.num_sge) }?;
    // SAFETY: each union member is plain integers (and a pointer for `ud`), valid for any bits.
    let (rdma, atomic, ud) = unsafe { (wr.wr.rdma, wr.wr.atomic, wr.wr.ud) };
    let remote = RemoteAddr {
        addr: rdma.remote_addr,
        rkey: rdma.rkey,
    };
    let op = match wr.opcode {
        0 => SendOp::Write { remote, imm: None },
        1 => SendOp::Write {
            remote,
            imm: Some(wr.imm_data),
        },
        2 => SendOp::Send {
            imm: None,
            invalidate: None,
        },
        3 => SendOp::Send {
            imm: Some(wr.imm_data),
            invalidate: None,
        },
        4 => SendOp::Read { remote },
        5 => SendOp::CompareSwap {
            remote: RemoteAddr {
                addr: atomic.remote_addr,
                rkey: atomic.rkey,
            },
            compare: atomic.compare_add,
            swap: atomic.swap,
        },
        6 => SendOp::FetchAdd {
            remote: RemoteAddr {
                addr: atomic.remote_addr,
                rkey: atomic.rkey,
            },
            add: atomic.compare_add,
        },
        9 => SendOp::Send {
            imm: None,
            invalidate: Some(wr.imm_data),
        },
        7 => SendOp::LocalInv { rkey: wr.imm_data },
        8 => {
            // SAFETY: with IBV_WR_BIND_MW the `bind_mw` member is the one the caller set.
            let b = unsafe { wr.ext.bind_mw };
            // SAFETY: its window and region are NULL or live objects (the verbs API contract).
            unsafe { verbs::bind_op(b.mw.cast(), b.rkey, &b.bind_info) }?
        }
        10 => {
            // SAFETY: `tso` is plain integers and a pointer, valid for any bits.
            let tso = unsafe { wr.ext.tso };
            if tso.hdr.is_null() && tso.hdr_sz != 0 {
                return Err(EINVAL);
            }
            // SAFETY: ibv_post_send(3): `wr.tso.hdr` names `hdr_sz` readable bytes.
            let header = unsafe { copy_in(tso.hdr as u64, usize::from(tso.hdr_sz)) };
            return Ok(SendRequest {
                wr_id: wr.wr_id,
                op: SendOp::Tso { mss: tso.mss },
                flags,
                payload: Payload::Headed { header, sges: list },
                ud: None,
                xrc_srqn: None,
            });
        }
        // DRIVER1 is a provider's; ATOMIC WRITE is offered through ibv_wr_atomic_write.
        11 | 15 => return Err(EOPNOTSUPP),
        _ => return Err(EINVAL),
    };
    let payload = if flags.contains(SendFlags::INLINE) && !op.is_read_or_atomic() {
        // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
        Payload::Inline(unsafe { inline_bytes(&list) })
    } else {
        Payload::Sges(list)
    };
    let ud = if qp_type == QpType::Ud {
        // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
        let ah = unsafe { outer::<SvAh, _>(ud.ah) }.ok_or(EINVAL)?;
        Some(UdAddress {
            ah: ah.core.clone(),
            remote_qpn: ud.remote_qpn,
            remote_qkey: ud.remote_qkey,
        })
    } else {
        None
    };
    Ok(SendRequest {
        wr_id: wr.wr_id,
        op,
        flags,
        payload,
        ud,
        xrc_srqn: (qp_type == QpType::XrcSend).then_some(wr.remote_srqn),
    })
}

/// The `post_send` op.
pub(crate) unsafe extern "C" fn post_send(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad: *mut *mut ibv_send_wr,
) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(q) = (unsafe { outer::<SvQp, _>(qp) }) else {
        return fail(EINVAL);
    };
    let qp_type = q.core.qp_type();
    let mut ptrs = Vec::new();
    let mut reqs = Vec::new();
    let mut conv_err = None;
    let mut p = wr;
    while !p.is_null() {
        // SAFETY: `p` is a work request of the caller's list.
        let w = unsafe { &*p };
        // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
        match unsafe { send_request(w, qp_type) } {
            Ok(r) => {
                ptrs.push(p);
                reqs.push(r);
            }
            Err(e) => {
                conv_err = Some((p, e));
                break;
            }
        }
        p = w.next;
    }
    if let Some(queues) = &q.queues {
        queues.stage_send(&mut reqs);
    }
    // Nothing translatable (the first WR is bad): post nothing, report that WR.
    let posted = if reqs.is_empty() {
        Ok(())
    } else {
        q.core.post_send(&reqs)
    };
    let (bad_wr, err) = match posted {
        Ok(()) => match conv_err {
            Some((p, e)) => (p, e),
            None => return 0,
        },
        Err(e) => (ptrs.get(e.index).copied().unwrap_or(wr), e.error.errno()),
    };
    if !bad.is_null() {
        // SAFETY: `bad` is writable.
        unsafe { *bad = bad_wr };
    }
    fail(err)
}

/// Translates a receive list; returns the WRs, their pointers, and the first untranslatable
/// WR with its errno.
pub(crate) unsafe fn recv_list(
    wr: *mut ibv_recv_wr,
) -> (
    Vec<RecvWr>,
    Vec<*mut ibv_recv_wr>,
    Option<(*mut ibv_recv_wr, c_int)>,
) {
    let (mut reqs, mut ptrs) = (Vec::new(), Vec::new());
    let mut p = wr;
    while !p.is_null() {
        // SAFETY: `p` is a work request of the caller's list.
        let w = unsafe { &*p };
        // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
        match unsafe { sges(w.sg_list, w.num_sge) } {
            Ok(sg_list) => {
                reqs.push(RecvWr {
                    wr_id: w.wr_id,
                    sg_list,
                });
                ptrs.push(p);
            }
            Err(e) => return (reqs, ptrs, Some((p, e))),
        }
        p = w.next;
    }
    (reqs, ptrs, None)
}

pub(crate) unsafe fn finish_recv(
    result: Result<(), softverbs_device::PostError>,
    ptrs: &[*mut ibv_recv_wr],
    conv_err: Option<(*mut ibv_recv_wr, c_int)>,
    bad: *mut *mut ibv_recv_wr,
) -> c_int {
    let (bad_wr, err) = match result {
        Ok(()) => match conv_err {
            Some(x) => x,
            None => return 0,
        },
        Err(e) => (
            ptrs.get(e.index)
                .copied()
                .or(conv_err.map(|c| c.0))
                .unwrap_or(std::ptr::null_mut()),
            e.error.errno(),
        ),
    };
    if !bad.is_null() {
        // SAFETY: `bad` is writable.
        unsafe { *bad = bad_wr };
    }
    fail(err)
}

/// The `post_recv` op.
pub(crate) unsafe extern "C" fn post_recv(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(q) = (unsafe { outer::<SvQp, _>(qp) }) else {
        return fail(EINVAL);
    };
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    let (mut reqs, ptrs, conv_err) = unsafe { recv_list(wr) };
    if let Some(queues) = &q.queues {
        queues.stage_recv(&mut reqs);
    }
    let result = q.core.post_recv(&reqs);
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    unsafe { finish_recv(result, &ptrs, conv_err, bad) }
}

/// The `post_srq_recv` op.
pub(crate) unsafe extern "C" fn post_srq_recv(
    srq: *mut ibv_srq,
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(s) = (unsafe { outer::<SvSrq, _>(srq) }) else {
        return fail(EINVAL);
    };
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    let (mut reqs, ptrs, conv_err) = unsafe { recv_list(wr) };
    if let Some(queue) = &s.queue {
        queue.stage_recv(&mut reqs);
    }
    let result = s.core.post_recv(&reqs);
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    unsafe { finish_recv(result, &ptrs, conv_err, bad) }
}

/// The `poll_cq` op: up to `n` completions, or a negative errno.
pub(crate) unsafe extern "C" fn poll_cq(cq: *mut ibv_cq, n: c_int, wc: *mut ibv_wc) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { outer::<SvCq, _>(cq) }) else {
        return -fail(EINVAL);
    };
    if n < 0 || (n > 0 && wc.is_null()) {
        return -fail(EINVAL);
    }
    let n = n as usize;
    if let Some(ring) = &c.ring {
        return crate::domain::poll_through_ring(c, ring, n, |i, w| {
            // SAFETY: the caller's array holds `n` entries and `i < n`.
            unsafe { wc.add(i).write(wc_c(w)) }
        }) as c_int;
    }
    let mut buf = [WorkCompletion::default(); 32];
    let mut total = 0;
    while total < n {
        let want = (n - total).min(buf.len());
        let got = c.core.poll(&mut buf[..want]);
        for (i, w) in buf[..got].iter().enumerate() {
            // SAFETY: the caller's array holds `n` entries and `total + i < n`.
            unsafe { wc.add(total + i).write(wc_c(w)) };
        }
        total += got;
        if got < want {
            break;
        }
    }
    total as c_int
}

/// The `req_notify_cq` op.
pub(crate) unsafe extern "C" fn req_notify_cq(cq: *mut ibv_cq, solicited_only: c_int) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    match unsafe { outer::<SvCq, _>(cq) } {
        Some(c) => match c.core.req_notify(solicited_only != 0) {
            Ok(()) => 0,
            Err(e) => fail(e.errno()),
        },
        None => fail(EINVAL),
    }
}

mod cq_ex;
pub(crate) mod qp_ex;

pub(crate) use cq_ex::{create_cq_ex, current, current_wc, install_cq_ex_ops};
pub(crate) use qp_ex::{create_qp_ex, push_op, qp_ex};
