//! Protection domains.

use std::ffi::c_int;

use softverbs_device::Pd;

use super::{context, destroy_boxed, errno_of, SvPd, EINVAL};
use crate::abi::*;
use crate::fail_null;

/// `ibv_alloc_pd`.
pub(crate) unsafe extern "C" fn alloc_pd(ctx: *mut ibv_context) -> *mut ibv_pd {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { context(ctx) }) else {
        return fail_null(EINVAL);
    };
    match Pd::alloc(&c.core) {
        Ok(core) => {
            let b = Box::new(SvPd {
                pd: ibv_pd {
                    context: ctx,
                    handle: core.handle(),
                },
                core,
                parent: None,
            });
            Box::into_raw(b).cast()
        }
        Err(e) => fail_null(errno_of(&e)),
    }
}

/// `ibv_dealloc_pd`: EBUSY while anything uses the PD. On a parent domain it deallocates the
/// parent domain (EBUSY while its CQs or QPs exist), not the inner PD.
pub(crate) unsafe extern "C" fn dealloc_pd(pd: *mut ibv_pd) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    unsafe {
        destroy_boxed::<SvPd, _>(pd, |p| match &p.parent {
            Some(parent) => parent.core.dealloc(),
            None => p.core.dealloc(),
        })
    }
}
