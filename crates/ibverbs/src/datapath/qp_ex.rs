//! The extended QP work-request API (`ibv_wr_*`): a batch of work requests built between
//! `ibv_wr_start` and `ibv_wr_complete`.

use super::*;

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
        Payload::Inline(unsafe { inline_bytes(&list, Vec::new()) })
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
    let mut v = Vec::new();
    // SAFETY: the caller passes `n` readable SGEs.
    let list = unsafe { scratch::append_sges(&mut v, list, n) }.map(|()| v);
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
