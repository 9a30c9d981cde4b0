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
use crate::domain::StageRecv;
use crate::memory::{append_in, copy_in};
use crate::verbs::{self, outer, NewQp, SvAh, SvCq, SvQp, SvSrq, WrBatch};
use crate::{fail, fail_null, set_errno};

pub(crate) const EINVAL: c_int = Errno::EINVAL as c_int;
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

/// Inline data: the bytes the SGEs name, copied now (into `v`, which is empty).
///
/// # Safety
/// Every SGE must name readable memory (`ibv_post_send(3)`, `IBV_SEND_INLINE`).
unsafe fn inline_bytes(list: &[Sge], mut v: Vec<u8>) -> Vec<u8> {
    for s in list {
        // SAFETY: per the contract.
        unsafe { append_in(&mut v, s.addr, s.length as usize) };
    }
    v
}

/// Translates one `ibv_send_wr`.
///
/// # Safety
/// `wr` must be a valid work request whose pointers are readable.
unsafe fn send_request(
    wr: &ibv_send_wr,
    qp_type: QpType,
    scratch: &mut Scratch,
) -> Result<SendRequest, c_int> {
    let flags = SendFlags::from_bits_truncate(wr.send_flags);
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    let list = unsafe { scratch.sges(wr.sg_list, wr.num_sge) }?;
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
        let bytes = unsafe { inline_bytes(&list, scratch.bytes()) };
        scratch.keep_sges(list);
        Payload::Inline(bytes)
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
    let outcome = Scratch::with(|s| {
        let mut conv_err = None;
        let mut p = wr;
        while !p.is_null() {
            // SAFETY: `p` is a work request of the caller's list.
            let w = unsafe { &*p };
            // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
            match unsafe { send_request(w, qp_type, s) } {
                Ok(r) => {
                    s.send_ptrs.push(p);
                    s.sends.push(r);
                }
                Err(e) => {
                    conv_err = Some((p, e));
                    break;
                }
            }
            p = w.next;
        }
        if let Some(queues) = &q.queues {
            queues.stage_send(&mut s.sends);
        }
        // Nothing translatable (the first WR is bad): post nothing, report that WR.
        let posted = if s.sends.is_empty() {
            Ok(())
        } else {
            q.core.post_send(&s.sends)
        };
        match posted {
            Ok(()) => conv_err,
            Err(e) => Some((s.send_ptrs.get(e.index).copied().unwrap_or(wr), e.error.errno())),
        }
    });
    let Some((bad_wr, err)) = outcome else {
        return 0;
    };
    if !bad.is_null() {
        // SAFETY: `bad` is writable.
        unsafe { *bad = bad_wr };
    }
    fail(err)
}

/// Translates a receive list into `s.recvs` (and `s.recv_ptrs`); returns the first
/// untranslatable WR with its errno.
///
/// # Safety
/// `wr` must be NULL or a valid list of work requests whose pointers are readable.
unsafe fn recv_list(wr: *mut ibv_recv_wr, s: &mut Scratch) -> Option<(*mut ibv_recv_wr, c_int)> {
    let mut p = wr;
    while !p.is_null() {
        // SAFETY: `p` is a work request of the caller's list.
        let w = unsafe { &*p };
        // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
        match unsafe { s.sges(w.sg_list, w.num_sge) } {
            Ok(sg_list) => {
                s.recvs.push(RecvWr {
                    wr_id: w.wr_id,
                    sg_list,
                });
                s.recv_ptrs.push(p);
            }
            Err(e) => return Some((p, e)),
        }
        p = w.next;
    }
    None
}

/// Posts a receive list: translates it, passes it through `stage` (a parent domain's ring) if
/// there is one, hands it to `post`, and reports the outcome as `ibv_post_recv(3)` says.
///
/// # Safety
/// `wr` must be NULL or a valid list of work requests whose pointers are readable; `bad` must
/// be NULL or writable.
pub(crate) unsafe fn post_recv_list(
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
    stage: Option<&impl StageRecv>,
    post: impl FnOnce(&[RecvWr]) -> Result<(), softverbs_device::PostError>,
) -> c_int {
    Scratch::with(|s| {
        // SAFETY: per the contract.
        let conv_err = unsafe { recv_list(wr, s) };
        if let Some(stage) = stage {
            stage.stage_recv(&mut s.recvs);
        }
        let result = post(&s.recvs);
        // SAFETY: per the contract.
        unsafe { finish_recv(result, s, conv_err, bad) }
    })
}

/// Reports the outcome of a receive post of the requests in `s` as `ibv_post_recv(3)` says.
///
/// # Safety
/// `bad` must be NULL or writable.
unsafe fn finish_recv(
    result: Result<(), softverbs_device::PostError>,
    s: &Scratch,
    conv_err: Option<(*mut ibv_recv_wr, c_int)>,
    bad: *mut *mut ibv_recv_wr,
) -> c_int {
    let (bad_wr, err) = match result {
        Ok(()) => match conv_err {
            Some(x) => x,
            None => return 0,
        },
        Err(e) => (
            s.recv_ptrs
                .get(e.index)
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
    unsafe { post_recv_list(wr, bad, q.queues.as_ref(), |reqs| q.core.post_recv(reqs)) }
}

/// The `post_srq_recv` op.
pub(crate) unsafe extern "C" fn post_srq_recv(
    srq: *mut ibv_srq,
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(sq) = (unsafe { outer::<SvSrq, _>(srq) }) else {
        return fail(EINVAL);
    };
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    unsafe { post_recv_list(wr, bad, sq.queue.as_ref(), |reqs| sq.core.post_recv(reqs)) }
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
    c.core.poll_each(n, |i, w| {
        // SAFETY: the caller's array holds `n` entries and the core hands out at most `n`.
        unsafe { wc.add(i).write(wc_c(&w)) }
    }) as c_int
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
mod scratch;

pub(crate) use cq_ex::{create_cq_ex, current, current_wc, install_cq_ex_ops};
pub(crate) use qp_ex::{create_qp_ex, push_op, qp_ex};
pub(crate) use scratch::Scratch;
