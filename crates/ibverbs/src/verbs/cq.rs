//! Completion channels and completion queues (the control side; polling is in `datapath`).

use std::cell::Cell;
use std::ffi::{c_int, c_uint, c_void};
use std::ptr::addr_of_mut;
use std::sync::atomic::{AtomicI32, Ordering};

use softverbs_device::{CompChannel, Cq};
use softverbs_engine::types::WorkCompletion;

use super::{bump_locked, context, destroy_boxed, errno_of, outer, SvChannel, SvCq, EINVAL};
use crate::abi::*;
use crate::{datapath, fail, fail_minus_one, fail_null};

/// `ibv_create_comp_channel`.
pub(crate) unsafe extern "C" fn create_comp_channel(ctx: *mut ibv_context) -> *mut ibv_comp_channel {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { context(ctx) }) else {
        return fail_null(EINVAL);
    };
    match CompChannel::create(&c.core) {
        Ok(core) => {
            let ch = ibv_comp_channel {
                context: ctx,
                fd: core.fd(),
                refcnt: 0,
            };
            Box::into_raw(Box::new(SvChannel { ch, core })).cast()
        }
        Err(e) => fail_null(errno_of(&e)),
    }
}

/// `ibv_destroy_comp_channel`: EBUSY while a CQ uses it.
pub(crate) unsafe extern "C" fn destroy_comp_channel(ch: *mut ibv_comp_channel) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    unsafe { destroy_boxed::<SvChannel, _>(ch, |c| c.core.destroy()) }
}

/// The `refcnt` field of a channel, updated atomically.
///
/// # Safety
/// `ch` must be a live channel of this library.
pub(crate) unsafe fn channel_refcnt<'a>(ch: *mut ibv_comp_channel) -> &'a AtomicI32 {
    // SAFETY: `refcnt` is an aligned `int` inside the live channel; all updates are atomic.
    unsafe { AtomicI32::from_ptr(addr_of_mut!((*ch).refcnt)) }
}

/// Creates a CQ box; shared by `ibv_create_cq` and the `create_cq_ex` op.
pub(crate) unsafe fn new_cq(
    ctx: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    comp_vector: c_int,
) -> Result<*mut SvCq, c_int> {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let c = unsafe { context(ctx) }.ok_or(EINVAL)?;
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let ch = unsafe { outer::<SvChannel, _>(channel) };
    let core = Cq::create(&c.core, cqe, ch.map(|c| &c.core), comp_vector).map_err(|e| errno_of(&e))?;
    let cq = ibv_cq_ex {
        context: ctx,
        channel,
        cq_context,
        handle: core.handle(),
        cqe: core.cqe() as c_int,
        mutex: pthread_mutex_t([0; 40]),
        cond: pthread_cond_t([0; 48]),
        comp_events_completed: 0,
        async_events_completed: 0,
        comp_mask: 0,
        status: 0,
        wr_id: 0,
        start_poll: None,
        next_poll: None,
        end_poll: None,
        read_opcode: None,
        read_vendor_err: None,
        read_byte_len: None,
        read_imm_data: None,
        read_qp_num: None,
        read_src_qp: None,
        read_wc_flags: None,
        read_slid: None,
        read_sl: None,
        read_dlid_path_bits: None,
        read_completion_ts: None,
        read_cvlan: None,
        read_flow_tag: None,
        read_tm_info: None,
        read_completion_wallclock_ns: None,
    };
    let b = Box::into_raw(Box::new(SvCq {
        cq,
        core,
        cur: Cell::new(WorkCompletion::default()),
        ring: None,
    }));
    if !channel.is_null() {
        // SAFETY: `channel` is a live channel (its core object was found above); `refcnt` counts
        // its CQs, as rdma-core keeps it.
        unsafe { channel_refcnt(channel).fetch_add(1, Ordering::Relaxed) };
    }
    // SAFETY: `b` is live; the core CQ remembers its box for `ibv_get_cq_event` and async events.
    unsafe { (*b).core.set_user_data(b as u64) };
    datapath::install_cq_ex_ops(b);
    Ok(b)
}

/// `ibv_create_cq`.
pub(crate) unsafe extern "C" fn create_cq(
    ctx: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    comp_vector: c_int,
) -> *mut ibv_cq {
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    match unsafe { new_cq(ctx, cqe, cq_context, channel, comp_vector) } {
        Ok(b) => b.cast(),
        Err(e) => fail_null(e),
    }
}

/// `ibv_resize_cq`.
pub(crate) unsafe extern "C" fn resize_cq(cq: *mut ibv_cq, cqe: c_int) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { outer::<SvCq, _>(cq) }) else {
        return fail(EINVAL);
    };
    match c.core.resize(cqe) {
        Ok(n) => {
            // SAFETY: `cq` is live; update its public size.
            unsafe { (*cq).cqe = n as c_int };
            0
        }
        Err(e) => fail(errno_of(&e)),
    }
}

/// `ibv_destroy_cq`: EBUSY while a QP uses it; waits for its events to be acknowledged.
pub(crate) unsafe extern "C" fn destroy_cq(cq: *mut ibv_cq) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { outer::<SvCq, _>(cq) }) else {
        return fail(EINVAL);
    };
    match c.core.destroy() {
        Ok(()) => {
            let channel = c.cq.channel;
            if !channel.is_null() {
                // SAFETY: a channel outlives its CQs (destroying it is EBUSY while they exist).
                unsafe { channel_refcnt(channel).fetch_sub(1, Ordering::Relaxed) };
            }
            // SAFETY: made by `Box::into_raw` in `new_cq`; the caller gives it up.
            drop(unsafe { Box::from_raw(cq.cast::<SvCq>()) });
            0
        }
        Err(e) => fail(errno_of(&e)),
    }
}

/// `ibv_get_cq_event`: 0, or -1 with errno (EAGAIN on a non-blocking channel fd).
pub(crate) unsafe extern "C" fn get_cq_event(
    ch: *mut ibv_comp_channel,
    cq: *mut *mut ibv_cq,
    cq_context: *mut *mut c_void,
) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { outer::<SvChannel, _>(ch) }) else {
        return fail_minus_one(EINVAL);
    };
    match c.core.get_cq_event(None) {
        Ok(core) => {
            let p = core.user_data() as *mut SvCq;
            // SAFETY: the user data is the CQ's live box (a CQ is destroyed only after its
            // delivered events are acknowledged); the out-pointers are writable.
            unsafe {
                if !cq.is_null() {
                    *cq = p.cast();
                }
                if !cq_context.is_null() {
                    *cq_context = (*p).cq.cq_context;
                }
            }
            0
        }
        Err(e) => fail_minus_one(errno_of(&e)),
    }
}

/// `ibv_ack_cq_events`.
pub(crate) unsafe extern "C" fn ack_cq_events(cq: *mut ibv_cq, n: c_uint) {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { outer::<SvCq, _>(cq) }) else {
        return;
    };
    c.core.ack_events(n);
    // SAFETY: `cq` is live.
    unsafe {
        bump_locked(
            addr_of_mut!((*cq).mutex),
            addr_of_mut!((*cq).cond),
            addr_of_mut!((*cq).comp_events_completed),
            n,
        );
    }
}
