//! Flow counters: the `create_counters`, `attach_counters_point_flow`, `read_counters` and
//! `destroy_counters` ops behind the inline wrappers of `<infiniband/verbs.h>`, and the
//! `IBV_FLOW_SPEC_ACTION_COUNT` spec of `ibv_create_flow`.

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use softverbs_device::{CounterDesc, Counters};

use crate::abi::ibv_context;
use crate::verbs::{context, destroy_boxed, errno_of, outer};
use crate::{fail, fail_null};

const EINVAL: c_int = libc::EINVAL;
/// `ENOTSUP`, which is `EOPNOTSUPP` on Linux.
const ENOTSUP: c_int = libc::EOPNOTSUPP;

/// `struct ibv_counters`.
#[repr(C)]
pub(crate) struct ibv_counters {
    context: *mut ibv_context,
}

/// `struct ibv_counters_init_attr`.
#[repr(C)]
pub(crate) struct ibv_counters_init_attr {
    comp_mask: u32,
}

/// `struct ibv_counter_attach_attr`.
#[repr(C)]
pub(crate) struct ibv_counter_attach_attr {
    counter_desc: u32,
    index: u32,
    comp_mask: u32,
}

#[repr(C)]
struct SvCounters {
    c: ibv_counters,
    core: Arc<Counters>,
}

/// The counters object behind a `struct ibv_counters *` of this library (NULL: none).
///
/// # Safety
/// `p` must be NULL or a live counters object of this library.
pub(crate) unsafe fn counters_of(p: *mut c_void) -> Option<Arc<Counters>> {
    // SAFETY: per the contract.
    unsafe { outer::<SvCounters, _>(p) }.map(|c| c.core.clone())
}

/// The `create_counters` op: EOPNOTSUPP for a `comp_mask` naming fields this library does
/// not know (as mlx5).
pub(crate) unsafe extern "C" fn create_counters(
    ctx: *mut ibv_context,
    attr: *mut ibv_counters_init_attr,
) -> *mut ibv_counters {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { context(ctx) }) else {
        return fail_null(EINVAL);
    };
    if attr.is_null() {
        return fail_null(EINVAL);
    }
    // SAFETY: `attr` is a readable `struct ibv_counters_init_attr` (checked non-NULL).
    if unsafe { (*attr).comp_mask } != 0 {
        return fail_null(libc::EOPNOTSUPP);
    }
    Box::into_raw(Box::new(SvCounters {
        c: ibv_counters { context: ctx },
        core: Counters::create(&c.core),
    }))
    .cast()
}

/// The `destroy_counters` op: EBUSY while a flow is bound.
pub(crate) unsafe extern "C" fn destroy_counters(counters: *mut ibv_counters) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    unsafe { destroy_boxed::<SvCounters, _>(counters, |c| c.core.destroy()) }
}

/// The `attach_counters_point_flow` op: only the static mode (`flow` NULL; ENOTSUP otherwise,
/// as mlx5), a zero `comp_mask` (EOPNOTSUPP), packet or byte descriptions (ENOTSUP); EBUSY
/// once the counters are bound to a flow.
pub(crate) unsafe extern "C" fn attach_counters_point_flow(
    counters: *mut ibv_counters,
    attr: *mut ibv_counter_attach_attr,
    flow: *mut c_void,
) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { outer::<SvCounters, _>(counters) }) else {
        return fail(EINVAL);
    };
    if attr.is_null() {
        return fail(EINVAL);
    }
    if !flow.is_null() {
        return fail(ENOTSUP);
    }
    // SAFETY: `attr` is a readable `struct ibv_counter_attach_attr` (checked non-NULL).
    let a = unsafe { attr.read() };
    if a.comp_mask != 0 {
        return fail(libc::EOPNOTSUPP);
    }
    let Some(desc) = CounterDesc::from_raw(a.counter_desc) else {
        return fail(ENOTSUP);
    };
    match c.core.attach_point(desc, a.index) {
        Ok(()) => 0,
        Err(e) => fail(errno_of(&e)),
    }
}

/// The `read_counters` op.
pub(crate) unsafe extern "C" fn read_counters(
    counters: *mut ibv_counters,
    values: *mut u64,
    ncounters: u32,
    flags: u32,
) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { outer::<SvCounters, _>(counters) }) else {
        return fail(EINVAL);
    };
    if values.is_null() && ncounters != 0 {
        return fail(EINVAL);
    }
    let out: &mut [u64] = if ncounters == 0 {
        &mut []
    } else {
        // SAFETY: the caller's array holds `ncounters` values (checked non-NULL).
        unsafe { std::slice::from_raw_parts_mut(values, ncounters as usize) }
    };
    match c.core.read(out, flags) {
        Ok(()) => 0,
        Err(e) => fail(errno_of(&e)),
    }
}
