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

// ---------------------------------------------------------------------------------------------
// The extended CQ.

/// The box of an `ibv_cq_ex`.
unsafe fn cq_ex<'a>(cq: *mut ibv_cq_ex) -> &'a SvCq {
    // SAFETY: every `ibv_cq_ex` this library hands out is the first field of a live `SvCq`,
    // and the extended pollers are only installed there.
    unsafe { outer::<SvCq, _>(cq) }.expect("the CQ pollers are called with their own CQ")
}

/// Takes the next completion into `cur` and the public `status`/`wr_id`; ENOENT if none.
unsafe fn poll_one(cq: *mut ibv_cq_ex) -> c_int {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    let c = unsafe { cq_ex(cq) };
    let mut one = [WorkCompletion::default()];
    let got = match &c.ring {
        // A parent domain's CQ stages its completions in the allocated ring here too.
        Some(ring) => crate::domain::poll_through_ring(c, ring, 1, |_, w| one[0] = *w),
        None => c.core.poll(&mut one),
    };
    if got == 0 {
        return ENOENT;
    }
    c.cur.set(one[0]);
    // SAFETY: `cq` is live; these two fields are read directly by the inline wrappers.
    unsafe {
        (*cq).status = one[0].status.raw();
        (*cq).wr_id = one[0].wr_id;
    }
    0
}

unsafe extern "C" fn start_poll(cq: *mut ibv_cq_ex, _attr: *mut ibv_poll_cq_attr) -> c_int {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    unsafe { poll_one(cq) }
}

unsafe extern "C" fn next_poll(cq: *mut ibv_cq_ex) -> c_int {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    unsafe { poll_one(cq) }
}

unsafe extern "C" fn end_poll(_cq: *mut ibv_cq_ex) {}

/// The completion the extended CQ's readers report.
pub(crate) unsafe fn current(cq: *mut ibv_cq_ex) -> WorkCompletion {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    unsafe { cur(cq) }
}

unsafe fn cur(cq: *mut ibv_cq_ex) -> WorkCompletion {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    unsafe { cq_ex(cq) }.cur.get()
}

/// The completion `start_poll`/`next_poll` fetched, for readers defined elsewhere.
///
/// # Safety
/// `cq` must be a live extended CQ of this library.
pub(crate) unsafe fn current_wc(cq: *mut ibv_cq_ex) -> WorkCompletion {
    // SAFETY: as the caller guarantees.
    unsafe { cur(cq) }
}

unsafe extern "C" fn read_opcode(cq: *mut ibv_cq_ex) -> c_uint {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    unsafe { cur(cq) }.opcode.raw()
}
unsafe extern "C" fn read_vendor_err(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    unsafe { cur(cq) }.vendor_err
}
unsafe extern "C" fn read_byte_len(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    unsafe { cur(cq) }.byte_len
}
unsafe extern "C" fn read_imm_data(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    unsafe { cur(cq) }.imm_data
}
unsafe extern "C" fn read_qp_num(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    unsafe { cur(cq) }.qp_num
}
unsafe extern "C" fn read_src_qp(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    unsafe { cur(cq) }.src_qp
}
unsafe extern "C" fn read_wc_flags(cq: *mut ibv_cq_ex) -> c_uint {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    unsafe { cur(cq) }.wc_flags.bits()
}
unsafe extern "C" fn read_slid(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    u32::from(unsafe { cur(cq) }.slid)
}
unsafe extern "C" fn read_sl(cq: *mut ibv_cq_ex) -> u8 {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    unsafe { cur(cq) }.sl
}
unsafe extern "C" fn read_dlid_path_bits(cq: *mut ibv_cq_ex) -> u8 {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    unsafe { cur(cq) }.dlid_path_bits
}
unsafe extern "C" fn read_flow_tag(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    unsafe { cur(cq) }.flow_tag
}

/// Fills the extended pollers of a new CQ.
pub(crate) fn install_cq_ex_ops(b: *mut SvCq) {
    // SAFETY: `b` is the live box `new_cq` just made, not yet shared.
    let cq = unsafe { &mut (*b).cq };
    cq.start_poll = Some(start_poll);
    cq.next_poll = Some(next_poll);
    cq.end_poll = Some(end_poll);
    cq.read_opcode = Some(read_opcode);
    cq.read_vendor_err = Some(read_vendor_err);
    cq.read_byte_len = Some(read_byte_len);
    cq.read_imm_data = Some(read_imm_data);
    cq.read_qp_num = Some(read_qp_num);
    cq.read_src_qp = Some(read_src_qp);
    cq.read_wc_flags = Some(read_wc_flags);
    cq.read_slid = Some(read_slid);
    cq.read_sl = Some(read_sl);
    cq.read_dlid_path_bits = Some(read_dlid_path_bits);
    cq.read_flow_tag = Some(read_flow_tag);
    cq.read_completion_ts = Some(crate::clock::read_completion_ts);
    cq.read_completion_wallclock_ns = Some(crate::clock::read_completion_wallclock_ns);
}

/// The `create_cq_ex` op: the standard completion fields and the completion timestamps (raw
/// and wall clock) and flow tags; tag matching and parent domains are EOPNOTSUPP.
pub(crate) unsafe extern "C" fn create_cq_ex(
    ctx: *mut ibv_context,
    attr: *mut ibv_cq_init_attr_ex,
) -> *mut ibv_cq_ex {
    if attr.is_null() {
        return fail_null(EINVAL);
    }
    // SAFETY: `attr` is a readable `struct ibv_cq_init_attr_ex`.
    let a = unsafe { &*attr };
    if a.comp_mask & !(CQ_INIT_ATTR_MASK_FLAGS | CQ_INIT_ATTR_MASK_PD) != 0
        || a.wc_flags
            & !(WC_STANDARD_FLAGS | WC_TIMESTAMP_FLAGS | WC_EX_WITH_FLOW_TAG | IBV_WC_EX_WITH_TM_INFO)
            != 0
    {
        return fail_null(EOPNOTSUPP);
    }
    let cqe = c_int::try_from(a.cqe).unwrap_or(c_int::MAX);
    let vector = c_int::try_from(a.comp_vector).unwrap_or(c_int::MAX);
    let ring = if a.comp_mask & CQ_INIT_ATTR_MASK_PD != 0 {
        let single =
            a.comp_mask & CQ_INIT_ATTR_MASK_FLAGS != 0 && a.flags & CREATE_CQ_ATTR_SINGLE_THREADED != 0;
        // SAFETY: the caller passes NULL or a live PD of this library (the verbs API contract).
        let made = unsafe { crate::domain::parent_of(a.parent_domain) }
            // SAFETY: `parent_domain` is the live parent domain just found.
            .and_then(|p| unsafe { crate::domain::cq_ring(ctx, a.parent_domain, p, a.cqe, single) });
        match made {
            Ok(r) => Some(r),
            Err(e) => return fail_null(e),
        }
    } else {
        None
    };
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    match unsafe { verbs::new_cq(ctx, cqe, a.cq_context, a.channel, vector) } {
        Ok(b) => {
            // SAFETY: `b` is live; record which fields the caller asked for, and its poll ring.
            unsafe {
                (*b).cq.comp_mask = a.comp_mask;
                (*b).ring = ring;
            }
            // SAFETY: `b` is live and not yet shared.
            unsafe { &(*b).core }.set_timestamps(softverbs_device::Timestamps {
                raw: a.wc_flags & (1 << 7) != 0,
                wallclock: a.wc_flags & (1 << 11) != 0,
            });
            if a.wc_flags & IBV_WC_EX_WITH_TM_INFO != 0 {
                // SAFETY: as above, and not yet shared.
                unsafe { (*b).cq.read_tm_info = Some(crate::tm::read_tm_info) };
            }
            b.cast()
        }
        Err(e) => fail_null(e),
    }
}

// ---------------------------------------------------------------------------------------------
// The extended QP.

/// An `ibv_qp_ex` around `qp` with the `ibv_wr_*` entry points filled.
pub(crate) fn qp_ex(qp: ibv_qp) -> ibv_qp_ex {
    ibv_qp_ex {
        qp_base: qp,
        comp_mask: 0,
        wr_id: 0,
        wr_flags: 0,
        wr_atomic_cmp_swp: Some(wr_atomic_cmp_swp),
        wr_atomic_fetch_add: Some(wr_atomic_fetch_add),
        wr_bind_mw: verbs::wr_bind_mw as *const c_void,
        wr_local_inv: verbs::wr_local_inv as *const c_void,
        wr_rdma_read: Some(wr_rdma_read),
        wr_rdma_write: Some(wr_rdma_write),
        wr_rdma_write_imm: Some(wr_rdma_write_imm),
        wr_send: Some(wr_send),
        wr_send_imm: Some(wr_send_imm),
        wr_send_inv: Some(wr_send_inv),
        wr_send_tso: std::ptr::null(),
        wr_set_ud_addr: Some(wr_set_ud_addr),
        wr_set_xrc_srqn: Some(wr_set_xrc_srqn),
        wr_set_inline_data: Some(wr_set_inline_data),
        wr_set_inline_data_list: Some(wr_set_inline_data_list),
        wr_set_sge: Some(wr_set_sge),
        wr_set_sge_list: Some(wr_set_sge_list),
        wr_start: Some(wr_start),
        wr_complete: Some(wr_complete),
        wr_abort: Some(wr_abort),
        wr_atomic_write: Some(wr_atomic_write),
    }
}

/// The box and the locked batch of an `ibv_qp_ex`.
unsafe fn batch<'a>(qpx: *mut ibv_qp_ex) -> Option<(&'a SvQp, MutexGuard<'a, WrBatch>)> {
    // SAFETY: every `ibv_qp_ex` is the first field of a live `SvQp`.
    let q = unsafe { outer::<SvQp, _>(qpx) }?;
    Some((q, q.batch.lock().unwrap_or_else(|p| p.into_inner())))
}

/// As [`push`], for a builder whose arguments may be invalid: the error is returned by
/// `wr_complete`.
pub(crate) unsafe fn push_op(qpx: *mut ibv_qp_ex, op: Result<SendOp, c_int>) {
    match op {
        // SAFETY: the caller's contract.
        Ok(op) => unsafe { push(qpx, op) },
        Err(e) => {
            // SAFETY: the caller's contract.
            if let Some((_, mut b)) = unsafe { batch(qpx) } {
                b.error.get_or_insert(e);
            }
        }
    }
}

/// Starts a new work request with the `wr_id` and `wr_flags` the caller set on `qpx`.
unsafe fn push(qpx: *mut ibv_qp_ex, op: SendOp) {
    // SAFETY: `qpx` is live; read the two public fields the caller sets before each builder.
    let (wr_id, flags) = unsafe { ((*qpx).wr_id, (*qpx).wr_flags) };
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    if let Some((_, mut b)) = unsafe { batch(qpx) } {
        b.reqs.push(SendRequest {
            wr_id,
            op,
            flags: SendFlags::from_bits_truncate(flags),
            payload: Payload::Sges(Vec::new()),
            ud: None,
            xrc_srqn: None,
        });
    }
}

/// Applies `f` to the work request being built; a setter without a builder is EINVAL at
/// `wr_complete`.
unsafe fn last(qpx: *mut ibv_qp_ex, f: impl FnOnce(&SvQp, &mut SendRequest) -> Result<(), c_int>) {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    if let Some((q, mut b)) = unsafe { batch(qpx) } {
        let r = match b.reqs.last_mut() {
            Some(req) => f(q, req),
            None => Err(EINVAL),
        };
        if let Err(e) = r {
            b.error.get_or_insert(e);
        }
    }
}

fn set_data(req: &mut SendRequest, list: Vec<Sge>) {
    req.payload = if req.flags.contains(SendFlags::INLINE) && !req.op.is_read_or_atomic() {
        // SAFETY: with IBV_SEND_INLINE the SGEs name the caller's readable data.
        Payload::Inline(unsafe { inline_bytes(&list) })
    } else {
        Payload::Sges(list)
    };
}

unsafe extern "C" fn wr_start(qpx: *mut ibv_qp_ex) {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    if let Some((_, mut b)) = unsafe { batch(qpx) } {
        *b = WrBatch::default();
    }
}

unsafe extern "C" fn wr_abort(qpx: *mut ibv_qp_ex) {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    unsafe { wr_start(qpx) };
}

unsafe extern "C" fn wr_complete(qpx: *mut ibv_qp_ex) -> c_int {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    let Some((q, mut b)) = (unsafe { batch(qpx) }) else {
        return fail(EINVAL);
    };
    let WrBatch { mut reqs, error } = std::mem::take(&mut *b);
    drop(b);
    if let Some(e) = error {
        return fail(e);
    }
    if let Some(queues) = &q.queues {
        queues.stage_send(&mut reqs);
    }
    match q.core.post_send(&reqs) {
        Ok(()) => 0,
        Err(e) => fail(e.error.errno()),
    }
}

unsafe extern "C" fn wr_send(qpx: *mut ibv_qp_ex) {
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    unsafe {
        push(
            qpx,
            SendOp::Send {
                imm: None,
                invalidate: None,
            },
        );
    };
}

unsafe extern "C" fn wr_send_imm(qpx: *mut ibv_qp_ex, imm: u32) {
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    unsafe {
        push(
            qpx,
            SendOp::Send {
                imm: Some(imm),
                invalidate: None,
            },
        );
    };
}

unsafe extern "C" fn wr_send_inv(qpx: *mut ibv_qp_ex, rkey: u32) {
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    unsafe {
        push(
            qpx,
            SendOp::Send {
                imm: None,
                invalidate: Some(rkey),
            },
        );
    };
}

unsafe extern "C" fn wr_rdma_write(qpx: *mut ibv_qp_ex, rkey: u32, addr: u64) {
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    unsafe {
        push(
            qpx,
            SendOp::Write {
                remote: RemoteAddr { addr, rkey },
                imm: None,
            },
        );
    };
}

unsafe extern "C" fn wr_rdma_write_imm(qpx: *mut ibv_qp_ex, rkey: u32, addr: u64, imm: u32) {
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    unsafe {
        push(
            qpx,
            SendOp::Write {
                remote: RemoteAddr { addr, rkey },
                imm: Some(imm),
            },
        );
    };
}

unsafe extern "C" fn wr_rdma_read(qpx: *mut ibv_qp_ex, rkey: u32, addr: u64) {
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    unsafe {
        push(
            qpx,
            SendOp::Read {
                remote: RemoteAddr { addr, rkey },
            },
        );
    };
}

unsafe extern "C" fn wr_atomic_cmp_swp(qpx: *mut ibv_qp_ex, rkey: u32, addr: u64, compare: u64, swap: u64) {
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    unsafe {
        push(
            qpx,
            SendOp::CompareSwap {
                remote: RemoteAddr { addr, rkey },
                compare,
                swap,
            },
        );
    };
}

unsafe extern "C" fn wr_atomic_fetch_add(qpx: *mut ibv_qp_ex, rkey: u32, addr: u64, add: u64) {
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    unsafe {
        push(
            qpx,
            SendOp::FetchAdd {
                remote: RemoteAddr { addr, rkey },
                add,
            },
        );
    };
}

/// `ibv_wr_atomic_write`: stores the 8 bytes at `value` at the remote address, atomically.
unsafe extern "C" fn wr_atomic_write(qpx: *mut ibv_qp_ex, rkey: u32, addr: u64, value: *const c_void) {
    let mut bytes = [0u8; 8];
    if !value.is_null() {
        // SAFETY: `value` points at the caller's 8 readable bytes (ibv_wr_post(3)).
        unsafe { std::ptr::copy_nonoverlapping(value.cast::<u8>(), bytes.as_mut_ptr(), 8) };
    }
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    unsafe {
        push(
            qpx,
            SendOp::AtomicWrite {
                remote: RemoteAddr { addr, rkey },
                value: bytes,
            },
        );
    };
    if value.is_null() {
        // SAFETY: as above.
        unsafe { last(qpx, |_, _| Err(EINVAL)) };
    }
}

unsafe extern "C" fn wr_set_sge(qpx: *mut ibv_qp_ex, lkey: u32, addr: u64, length: u32) {
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    unsafe {
        last(qpx, |_, req| {
            set_data(req, vec![Sge { addr, length, lkey }]);
            Ok(())
        });
    }
}

unsafe extern "C" fn wr_set_sge_list(qpx: *mut ibv_qp_ex, n: usize, list: *const ibv_sge) {
    let n = c_int::try_from(n).unwrap_or(-1);
    // SAFETY: the caller passes `n` readable SGEs.
    let list = unsafe { sges(list, n) };
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    unsafe {
        last(qpx, |_, req| {
            set_data(req, list?);
            Ok(())
        });
    }
}

unsafe extern "C" fn wr_set_inline_data(qpx: *mut ibv_qp_ex, addr: *mut c_void, length: usize) {
    // SAFETY: ibv_wr_set_inline_data(3): `addr` names `length` readable bytes.
    let data = unsafe { copy_in(addr as u64, length) };
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    unsafe {
        last(qpx, |_, req| {
            req.payload = Payload::Inline(data);
            Ok(())
        });
    }
}

unsafe extern "C" fn wr_set_inline_data_list(qpx: *mut ibv_qp_ex, n: usize, bufs: *const ibv_data_buf) {
    let mut data = Vec::new();
    if n > 0 && !bufs.is_null() {
        // SAFETY: the caller passes `n` readable buffer descriptors naming readable bytes.
        for b in unsafe { std::slice::from_raw_parts(bufs, n) } {
            // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
            data.extend_from_slice(&unsafe { copy_in(b.addr as u64, b.length) });
        }
    }
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    unsafe {
        last(qpx, |_, req| {
            req.payload = Payload::Inline(data);
            Ok(())
        });
    }
}

unsafe extern "C" fn wr_set_ud_addr(qpx: *mut ibv_qp_ex, ah: *mut ibv_ah, remote_qpn: u32, remote_qkey: u32) {
    // SAFETY: `ah` is NULL or an address handle of this library.
    let ah = unsafe { outer::<SvAh, _>(ah) };
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    unsafe {
        last(qpx, |_, req| {
            let ah = ah.ok_or(EINVAL)?;
            req.ud = Some(UdAddress {
                ah: ah.core.clone(),
                remote_qpn,
                remote_qkey,
            });
            Ok(())
        });
    }
}

unsafe extern "C" fn wr_set_xrc_srqn(qpx: *mut ibv_qp_ex, srqn: u32) {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    unsafe {
        last(qpx, |q, req| {
            // Only an XRC initiator addresses SRQs.
            if q.core.qp_type() != QpType::XrcSend {
                return Err(EINVAL);
            }
            req.xrc_srqn = Some(srqn);
            Ok(())
        });
    }
}

/// The `create_qp_ex` op: RC, UC, UD and XRC_SEND QPs with the `ibv_wr_*` operations of
/// `SUPPORTED_SEND_OPS`, and XRC_RECV QPs on an XRC domain; RSS, TSO and creation flags are
/// EOPNOTSUPP.
pub(crate) unsafe extern "C" fn create_qp_ex(
    ctx: *mut ibv_context,
    attr: *mut ibv_qp_init_attr_ex,
) -> *mut ibv_qp {
    if attr.is_null() {
        return fail_null(EINVAL);
    }
    // SAFETY: `attr` is a live `struct ibv_qp_init_attr_ex`.
    let a = unsafe { &mut *attr };
    let known = IBV_QP_INIT_ATTR_PD
        | IBV_QP_INIT_ATTR_XRCD
        | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS
        | IBV_QP_INIT_ATTR_CREATE_FLAGS;
    if a.qp_type == QpType::XrcRecv.raw() && a.comp_mask & !known == 0 {
        // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
        return match unsafe { verbs::new_xrc_recv_qp(ctx, a) } {
            Ok(b) => b.cast(),
            Err(e) => fail_null(e),
        };
    }
    if a.comp_mask & IBV_QP_INIT_ATTR_PD == 0 {
        return fail_null(EINVAL);
    }
    if a.comp_mask & (crate::raw::QP_INIT_ATTR_IND_TABLE | crate::raw::QP_INIT_ATTR_RX_HASH) != 0 {
        // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
        return unsafe { crate::raw::create_rss_qp(a) };
    }
    const MAX_TSO_HEADER: u32 = 1 << 3;
    let known = known | MAX_TSO_HEADER;
    if a.comp_mask & !known != 0
        || (a.comp_mask & IBV_QP_INIT_ATTR_CREATE_FLAGS != 0 && a.create_flags != 0)
        || (a.comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS != 0 && a.send_ops_flags & !SUPPORTED_SEND_OPS != 0)
    {
        return fail_null(EOPNOTSUPP);
    }
    let n = NewQp {
        pd: a.pd,
        qp_context: a.qp_context,
        send_cq: a.send_cq,
        recv_cq: a.recv_cq,
        srq: a.srq,
        cap: &mut a.cap,
        qp_type: a.qp_type,
        sq_sig_all: a.sq_sig_all != 0,
        max_tso_header: if a.comp_mask & MAX_TSO_HEADER != 0 {
            a.max_tso_header
        } else {
            0
        },
    };
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    match unsafe { verbs::new_qp(&n) } {
        Ok(b) => {
            // SAFETY: `b` is live.
            unsafe { (*b).qp.comp_mask = u64::from(a.comp_mask) };
            b.cast()
        }
        Err(e) => fail_null(e),
    }
}

/// `ibv_qp_to_qp_ex`: every QP here is an `ibv_qp_ex`.
pub(crate) extern "C" fn qp_to_qp_ex(qp: *mut ibv_qp) -> *mut ibv_qp_ex {
    if qp.is_null() {
        set_errno(EINVAL);
        return null_mut();
    }
    qp.cast()
}
