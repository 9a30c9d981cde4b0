//! Device memory: `ibv_alloc_dm`, `ibv_free_dm`, the `memcpy_{to,from}_dm` pointers the inline
//! `ibv_memcpy_*` call, `ibv_reg_dm_mr`, and `ibv_import_dm`/`ibv_unimport_dm`.

use std::ffi::{c_int, c_uint, c_void};
use std::sync::{Arc, Mutex};

use softverbs_device::{Dm, Mr};
use softverbs_engine::Errno;

use crate::abi::*;
use crate::verbs::{context, destroy_boxed, errno_of, outer, SvMr, SvPd};
use crate::{fail, fail_null};

const EINVAL: c_int = Errno::EINVAL as c_int;

/// `IBV_DM_MASK_HANDLE`: `ibv_dm.handle` is valid.
const DM_MASK_HANDLE: u32 = 1;

/// `struct ibv_alloc_dm_attr`.
#[repr(C)]
pub(crate) struct ibv_alloc_dm_attr {
    pub(crate) length: usize,
    pub(crate) log_align_req: u32,
    pub(crate) comp_mask: u32,
}

#[repr(C)]
pub(crate) struct SvDm {
    dm: ibv_dm,
    core: Arc<Dm>,
}

/// `verbs_context.alloc_dm`.
pub(crate) const ALLOC_DM: *const c_void = alloc_dm as *const c_void;
/// `verbs_context.free_dm`.
pub(crate) const FREE_DM: *const c_void = free_dm as *const c_void;
/// `verbs_context.reg_dm_mr`.
pub(crate) const REG_DM_MR: *const c_void = reg_dm_mr as *const c_void;

type MemcpyToFn = unsafe extern "C" fn(*mut ibv_dm, u64, *const c_void, usize) -> c_int;
type MemcpyFromFn = unsafe extern "C" fn(*mut c_void, *mut ibv_dm, u64, usize) -> c_int;

fn boxed(ctx: *mut ibv_context, core: Arc<Dm>) -> *mut ibv_dm {
    let dm = ibv_dm {
        context: ctx,
        memcpy_to_dm: memcpy_to_dm as MemcpyToFn as *const c_void,
        memcpy_from_dm: memcpy_from_dm as MemcpyFromFn as *const c_void,
        comp_mask: DM_MASK_HANDLE,
        handle: core.handle(),
    };
    Box::into_raw(Box::new(SvDm { dm, core })).cast()
}

/// `ibv_alloc_dm`: EINVAL for a NULL attribute, unknown `comp_mask` bits, a zero or too large
/// length or alignment; ENOMEM when `max_dm_size` is used up.
unsafe extern "C" fn alloc_dm(ctx: *mut ibv_context, attr: *mut ibv_alloc_dm_attr) -> *mut ibv_dm {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { context(ctx) }) else {
        return fail_null(EINVAL);
    };
    if attr.is_null() {
        return fail_null(EINVAL);
    }
    // SAFETY: `attr` is a readable `struct ibv_alloc_dm_attr`.
    let a = unsafe { &*attr };
    if a.comp_mask != 0 {
        return fail_null(EINVAL);
    }
    match Dm::alloc(&c.core, a.length as u64, a.log_align_req) {
        Ok(core) => boxed(ctx, core),
        Err(e) => fail_null(errno_of(&e)),
    }
}

/// `ibv_free_dm`: EBUSY while a memory region uses it.
unsafe extern "C" fn free_dm(dm: *mut ibv_dm) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    unsafe { destroy_boxed::<SvDm, _>(dm, |d| d.core.free()) }
}

/// `ibv_dm.memcpy_to_dm`: 0 or EINVAL (range outside the DM, NULL source).
unsafe extern "C" fn memcpy_to_dm(dm: *mut ibv_dm, offset: u64, host: *const c_void, length: usize) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(d) = (unsafe { outer::<SvDm, _>(dm) }) else {
        return fail(EINVAL);
    };
    if length == 0 {
        return 0;
    }
    if host.is_null() {
        return fail(EINVAL);
    }
    // SAFETY: the caller's host buffer holds `length` readable bytes (ibv_memcpy_to_dm(3)).
    let src = unsafe { std::slice::from_raw_parts(host.cast::<u8>(), length) };
    match d.core.memcpy_to(offset, src) {
        Ok(()) => 0,
        Err(e) => fail(errno_of(&e)),
    }
}

/// `ibv_dm.memcpy_from_dm`: 0 or EINVAL (range outside the DM, NULL destination).
unsafe extern "C" fn memcpy_from_dm(host: *mut c_void, dm: *mut ibv_dm, offset: u64, length: usize) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(d) = (unsafe { outer::<SvDm, _>(dm) }) else {
        return fail(EINVAL);
    };
    if length == 0 {
        return 0;
    }
    if host.is_null() {
        return fail(EINVAL);
    }
    // SAFETY: the caller's host buffer holds `length` writable bytes (ibv_memcpy_from_dm(3)).
    let dst = unsafe { std::slice::from_raw_parts_mut(host.cast::<u8>(), length) };
    match d.core.memcpy_from(offset, dst) {
        Ok(()) => 0,
        Err(e) => fail(errno_of(&e)),
    }
}

/// An `SvMr` box for a region `ibv_reg_dm_mr` or `ibv_import_mr` made; `addr` is NULL (zero
/// based, or not applicable to an imported region).
pub(crate) fn mr_box(pd: *mut ibv_pd, core: Arc<Mr>) -> *mut ibv_mr {
    let mr = ibv_mr {
        // SAFETY: `pd` is a live PD (its box was found by the caller); read its context.
        context: unsafe { (*pd).context },
        pd,
        addr: std::ptr::null_mut(),
        length: core.length() as usize,
        handle: core.handle(),
        lkey: core.lkey(),
        rkey: core.rkey(),
    };
    Box::into_raw(Box::new(SvMr {
        mr,
        core: Mutex::new(core),
    }))
    .cast()
}

/// `ibv_reg_dm_mr`: EINVAL without `IBV_ACCESS_ZERO_BASED`, for a range outside the DM or a
/// NULL PD or DM.
unsafe extern "C" fn reg_dm_mr(
    pd: *mut ibv_pd,
    dm: *mut ibv_dm,
    offset: u64,
    length: usize,
    access: c_uint,
) -> *mut ibv_mr {
    // SAFETY: the caller passes NULL or live objects of this library (the verbs API contract).
    let (Some(p), Some(d)) = (unsafe { outer::<SvPd, _>(pd) }, unsafe { outer::<SvDm, _>(dm) }) else {
        return fail_null(EINVAL);
    };
    match Mr::register_dm(&p.core, &d.core, offset, length as u64, access) {
        Ok(core) => mr_box(pd, core),
        Err(e) => fail_null(errno_of(&e)),
    }
}

/// `ibv_import_dm`: EINVAL if `handle` names no DM of the context's shared objects.
pub(crate) unsafe extern "C" fn import_dm(ctx: *mut ibv_context, handle: u32) -> *mut ibv_dm {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { context(ctx) }) else {
        return fail_null(EINVAL);
    };
    match c.core.import_dm(handle) {
        Ok(core) => boxed(ctx, core),
        Err(e) => fail_null(errno_of(&e)),
    }
}

/// `ibv_unimport_dm`: frees this context's wrapper only; the DM stays for the other sharers.
pub(crate) unsafe extern "C" fn unimport_dm(dm: *mut ibv_dm) {
    if !dm.is_null() {
        // SAFETY: a live DM box of this library, which the caller gives up.
        drop(unsafe { Box::from_raw(dm.cast::<SvDm>()) });
    }
}
