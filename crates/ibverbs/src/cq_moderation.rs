//! `ibv_modify_cq` (the `modify_cq` op of `verbs_context`): CQ moderation.

use std::ffi::c_int;

use softverbs_device::Moderation;

use crate::fail;
use crate::verbs::{errno_of, outer, SvCq, EINVAL};

/// `struct ibv_moderate_cq`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct ibv_moderate_cq {
    /// Completions per event.
    pub cq_count: u16,
    /// Microseconds.
    pub cq_period: u16,
}

/// `struct ibv_modify_cq_attr`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct ibv_modify_cq_attr {
    /// `enum ibv_cq_attr_mask` bits.
    pub attr_mask: u32,
    /// Used with `IBV_CQ_MODERATE`.
    pub moderate: ibv_moderate_cq,
}

/// `IBV_CQ_MODERATE`.
const CQ_MODERATE: u32 = 1;

/// The `modify_cq` op: EINVAL for an empty or unknown `attr_mask` (as `ibv_cmd_modify_cq` and
/// the kernel check) or a period beyond `cq_mod_caps`; returns the errno, as the inline
/// `ibv_modify_cq` passes it on.
pub(crate) unsafe extern "C" fn modify_cq(
    cq: *mut crate::abi::ibv_cq,
    attr: *mut ibv_modify_cq_attr,
) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { outer::<SvCq, _>(cq) }) else {
        return fail(EINVAL);
    };
    if attr.is_null() {
        return fail(EINVAL);
    }
    // SAFETY: `attr` is a readable `struct ibv_modify_cq_attr` (checked non-NULL).
    let a = unsafe { attr.read() };
    if a.attr_mask == 0 || a.attr_mask & !CQ_MODERATE != 0 {
        return fail(EINVAL);
    }
    let m = Moderation {
        cq_count: a.moderate.cq_count,
        cq_period: a.moderate.cq_period,
    };
    match c.core.modify_moderation(m) {
        Ok(()) => 0,
        Err(e) => fail(errno_of(&e)),
    }
}
