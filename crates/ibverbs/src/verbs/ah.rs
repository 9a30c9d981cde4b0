//! Address handles, also built from a received completion.

use std::ffi::c_int;
use std::ptr::null_mut;

use softverbs_device::Ah;

use super::{ah_attr_c, ah_attr_core, context, destroy_boxed, errno_of, outer, wc_core, SvAh, SvPd, EINVAL};
use crate::abi::*;
use crate::{fail_minus_one, fail_null};

/// `ibv_create_ah`.
pub(crate) unsafe extern "C" fn create_ah(pd: *mut ibv_pd, attr: *mut ibv_ah_attr) -> *mut ibv_ah {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(p) = (unsafe { outer::<SvPd, _>(pd) }) else {
        return fail_null(EINVAL);
    };
    if attr.is_null() {
        return fail_null(EINVAL);
    }
    // SAFETY: `attr` is a readable `struct ibv_ah_attr`.
    match Ah::create(&p.core, &ah_attr_core(unsafe { &*attr })) {
        Ok(core) => {
            // SAFETY: `pd` is live.
            let ah = ibv_ah {
                // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
                context: unsafe { (*pd).context },
                pd,
                handle: core.handle(),
            };
            Box::into_raw(Box::new(SvAh { ah, core })).cast()
        }
        Err(e) => fail_null(errno_of(&e)),
    }
}

/// `ibv_destroy_ah`.
pub(crate) unsafe extern "C" fn destroy_ah(ah: *mut ibv_ah) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    unsafe { destroy_boxed::<SvAh, _>(ah, |a| a.core.destroy()) }
}

/// `ibv_init_ah_from_wc`: 0, or -1 with errno.
pub(crate) unsafe extern "C" fn init_ah_from_wc(
    ctx: *mut ibv_context,
    port: u8,
    wc: *mut ibv_wc,
    grh: *mut u8,
    attr: *mut ibv_ah_attr,
) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { context(ctx) }) else {
        return fail_minus_one(EINVAL);
    };
    if wc.is_null() || attr.is_null() {
        return fail_minus_one(EINVAL);
    }
    // SAFETY: `wc` is a readable `struct ibv_wc`.
    let wc = wc_core(unsafe { &*wc });
    let grh_bytes: &[u8] = if grh.is_null() {
        &[]
    } else {
        // SAFETY: ibv_init_ah_from_wc(3): `grh` points at the 40-byte GRH area of the buffer.
        unsafe { std::slice::from_raw_parts(grh, softverbs_device::context::GRH_LEN) }
    };
    match c.core.init_ah_from_wc(port, &wc, grh_bytes) {
        Ok(a) => {
            // SAFETY: `attr` is writable.
            unsafe { attr.write(ah_attr_c(&a)) };
            0
        }
        Err(e) => fail_minus_one(errno_of(&e)),
    }
}

/// `ibv_create_ah_from_wc`.
pub(crate) unsafe extern "C" fn create_ah_from_wc(
    pd: *mut ibv_pd,
    wc: *mut ibv_wc,
    grh: *mut u8,
    port: u8,
) -> *mut ibv_ah {
    if pd.is_null() {
        return fail_null(EINVAL);
    }
    let mut attr = ibv_ah_attr::default();
    // SAFETY: `pd` is live; its context is the one to resolve against.
    let ctx = unsafe { (*pd).context };
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    if unsafe { init_ah_from_wc(ctx, port, wc, grh, &mut attr) } != 0 {
        return null_mut();
    }
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    unsafe { create_ah(pd, &mut attr) }
}
