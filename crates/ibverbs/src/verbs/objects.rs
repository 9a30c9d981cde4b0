//! The C objects: each is the first field of a Rust-owned `repr(C)` box next to the `Arc` of its
//! core object, and the casts from C pointers back to those boxes.

use std::cell::Cell;
use std::ffi::{c_int, c_void};
use std::mem::{offset_of, size_of};
use std::sync::{Arc, Mutex};

use softverbs_device::qp::SendRequest;
use softverbs_device::{Ah, CompChannel, Context, Cq, Device, Mr, Pd, Qp, Srq};
use softverbs_engine::types::WorkCompletion;

use super::{errno_of, EINVAL};
use crate::abi::*;
use crate::fail;

/// `sizeof(struct verbs_context)`, what rdma-core stores in `sz`.
pub(crate) const VERBS_CONTEXT_SIZE: usize = size_of::<verbs_context>();

/// An `ibv_device` followed by the pointer slot of rdma-core's `struct verbs_device`, which
/// provider libraries read (`is_mlx5_dev()`): it points at `DEVICE_OPS_TAG`, never at theirs.
#[repr(C)]
pub(crate) struct SvDevice {
    pub(crate) dev: ibv_device,
    pub(crate) ops: *const c_void,
    pub(crate) core: Device,
}

/// What `SvDevice::ops` points at.
pub(crate) static DEVICE_OPS_TAG: [u8; 8] = *b"softvrbs";

#[repr(C)]
pub(crate) struct SvContext {
    pub(crate) vctx: verbs_context,
    pub(crate) core: Arc<Context>,
}

/// A PD, or a parent domain (then `core` is its inner PD and `parent` says how to allocate).
#[repr(C)]
pub(crate) struct SvPd {
    pub(crate) pd: ibv_pd,
    pub(crate) core: Arc<Pd>,
    pub(crate) parent: Option<crate::domain::Parent>,
}

#[repr(C)]
pub(crate) struct SvMr {
    pub(crate) mr: ibv_mr,
    /// Replaced by `ibv_rereg_mr`.
    pub(crate) core: Mutex<Arc<Mr>>,
}

#[repr(C)]
pub(crate) struct SvChannel {
    pub(crate) ch: ibv_comp_channel,
    pub(crate) core: Arc<CompChannel>,
}

/// Every CQ is an `ibv_cq_ex` (a superset of `ibv_cq`), so `ibv_cq_ex_to_cq` and the plain
/// verbs work on CQs from either constructor.
#[repr(C)]
pub(crate) struct SvCq {
    pub(crate) cq: ibv_cq_ex,
    pub(crate) core: Arc<Cq>,
    /// The completion `start_poll`/`next_poll` fetched, read by the `read_*` accessors.
    pub(crate) cur: Cell<WorkCompletion>,
    /// For a CQ created through a parent domain: its poll ring, from the domain's allocator.
    pub(crate) ring: Option<crate::domain::CqRing>,
}

#[repr(C)]
pub(crate) struct SvSrq {
    pub(crate) srq: ibv_srq,
    pub(crate) core: Arc<Srq>,
    /// Its receive queue buffer from a parent domain's allocator, if created through one.
    pub(crate) queue: Option<crate::domain::RecvQueue>,
}

/// Every QP is an `ibv_qp_ex`, so `ibv_qp_to_qp_ex` works on any QP.
#[repr(C)]
pub(crate) struct SvQp {
    pub(crate) qp: ibv_qp_ex,
    pub(crate) core: Arc<Qp>,
    pub(crate) sq_sig_all: bool,
    /// Work requests built with `ibv_wr_*` between `wr_start` and `wr_complete`.
    pub(crate) batch: Mutex<WrBatch>,
    /// A handle from `ibv_open_qp`: the XRC domain handle it was opened through.
    pub(crate) opened_via: Option<Arc<softverbs_device::Xrcd>>,
    /// For a QP created through a parent domain: its queue buffers, from the domain's allocator.
    pub(crate) queues: Option<crate::domain::QpQueues>,
}

/// The extended work-request API's pending list.
#[derive(Debug, Default)]
pub(crate) struct WrBatch {
    pub(crate) reqs: Vec<SendRequest>,
    /// The first error a `wr_*` call found; `wr_complete` returns it.
    pub(crate) error: Option<c_int>,
}

#[repr(C)]
pub(crate) struct SvAh {
    pub(crate) ah: ibv_ah,
    pub(crate) core: Arc<Ah>,
}

/// The box whose first field `p` points at, or `None` for NULL.
///
/// # Safety
/// `p` must be NULL or a pointer this library handed out as the first field of an `S` that has
/// not been freed.
pub(crate) unsafe fn outer<'a, S, C>(p: *mut C) -> Option<&'a S> {
    // SAFETY: per the contract, `p` points at the start of a live `S`.
    (!p.is_null()).then(|| unsafe { &*p.cast::<S>() })
}

/// Destroys a C object this library boxed: runs `destroy` on the object behind `p` and, if the
/// core agrees (no EBUSY), frees the box. EINVAL for NULL.
///
/// # Safety
/// `p` must be NULL or point at the start of a live `S` made by `Box::into_raw`, which the
/// caller gives up on success.
pub(crate) unsafe fn destroy_boxed<S, C>(
    p: *mut C,
    destroy: impl FnOnce(&S) -> softverbs_engine::Result<()>,
) -> c_int {
    // SAFETY: the caller's contract.
    let Some(obj) = (unsafe { outer::<S, _>(p) }) else {
        return fail(EINVAL);
    };
    match destroy(obj) {
        // SAFETY: made by `Box::into_raw`; the caller gives it up.
        Ok(()) => {
            drop(unsafe { Box::from_raw(p.cast::<S>()) });
            0
        }
        Err(e) => fail(errno_of(&e)),
    }
}

/// The `SvContext` of an `ibv_context`.
///
/// # Safety
/// `ctx` must be NULL or a context returned by `ibv_open_device` and not yet closed.
pub(crate) unsafe fn context<'a>(ctx: *mut ibv_context) -> Option<&'a SvContext> {
    if ctx.is_null() {
        return None;
    }
    // SAFETY: every context we hand out is the `context` field of a `verbs_context` at the start
    // of an `SvContext`, so stepping back by the field offset stays inside that allocation.
    Some(unsafe {
        &*ctx
            .cast::<u8>()
            .sub(offset_of!(verbs_context, context))
            .cast::<SvContext>()
    })
}

/// Adds `n` to a `u32` field under the object's `pthread` mutex and signals its condition, as
/// rdma-core does for the `*_events_completed` counters.
pub(crate) unsafe fn bump_locked(
    mutex: *mut pthread_mutex_t,
    cond: *mut pthread_cond_t,
    field: *mut u32,
    n: u32,
) {
    // SAFETY: the fields belong to a live object; the mutex and condition were zero-initialised,
    // which is the glibc static initialiser.
    unsafe {
        libc::pthread_mutex_lock(mutex.cast());
        *field = (*field).wrapping_add(n);
        libc::pthread_cond_signal(cond.cast());
        libc::pthread_mutex_unlock(mutex.cast());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each C object is the first field of its box, and a device is followed by the 8-byte
    /// `verbs_device.ops` slot providers read.
    #[test]
    fn boxes_start_with_their_c_object() {
        assert_eq!(offset_of!(SvDevice, dev), 0);
        assert_eq!(offset_of!(SvDevice, ops), 664);
        assert_eq!(offset_of!(SvContext, vctx), 0);
        assert_eq!(
            offset_of!(SvContext, vctx) + offset_of!(verbs_context, context),
            320
        );
        assert_eq!(offset_of!(SvPd, pd), 0);
        assert_eq!(offset_of!(SvMr, mr), 0);
        assert_eq!(offset_of!(SvChannel, ch), 0);
        assert_eq!(offset_of!(SvCq, cq), 0);
        assert_eq!(offset_of!(SvSrq, srq), 0);
        assert_eq!(offset_of!(SvQp, qp), 0);
        assert_eq!(offset_of!(SvAh, ah), 0);
        assert_eq!(VERBS_CONTEXT_SIZE, 648);
    }
}
