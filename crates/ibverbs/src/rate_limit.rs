//! `ibv_modify_qp_rate_limit` (the `modify_qp_rate_limit` op of `verbs_context`).

use std::ffi::c_int;

use crate::abi::ibv_qp;
use crate::fail;
use crate::verbs::{errno_of, outer, SvQp, EINVAL};

/// `struct ibv_qp_rate_limit_attr`.
#[repr(C)]
pub(crate) struct ibv_qp_rate_limit_attr {
    rate_limit: u32,
    max_burst_sz: u32,
    typical_pkt_sz: u16,
    comp_mask: u32,
}

const _: () = assert!(std::mem::size_of::<ibv_qp_rate_limit_attr>() == 16);

/// The `modify_qp_rate_limit` op: EINVAL for a non-zero `comp_mask` (as mlx5) and for what the
/// core refuses; returns the errno, as the inline wrapper passes it on.
pub(crate) unsafe extern "C" fn modify_qp_rate_limit(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_rate_limit_attr,
) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(q) = (unsafe { outer::<SvQp, _>(qp) }) else {
        return fail(EINVAL);
    };
    if attr.is_null() {
        return fail(EINVAL);
    }
    // SAFETY: `attr` is a readable `struct ibv_qp_rate_limit_attr` (checked non-NULL).
    let a = unsafe { attr.read() };
    if a.comp_mask != 0 {
        return fail(EINVAL);
    }
    match q
        .core
        .modify_rate_limit(a.rate_limit, a.max_burst_sz, a.typical_pkt_sz)
    {
        Ok(()) => 0,
        Err(e) => fail(errno_of(&e)),
    }
}
