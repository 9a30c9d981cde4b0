//! Shared objects: `ibv_import_device` on a duplicate of `ibv_context.cmd_fd`, and
//! `ibv_import_pd`/`ibv_import_mr` with their `unimport` counterparts.
//!
//! `cmd_fd` is a descriptor the core context owns (a memfd naming its object table, see
//! `softverbs_device::Context::cmd_fd`); importing a duplicate gives a second context over the
//! same objects. An import only wraps the shared object: `unimport` frees the wrapper, while
//! `ibv_dealloc_pd`/`ibv_dereg_mr` on any wrapper destroys the object for every sharer.

use std::ffi::c_int;
use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd};

use softverbs_device::Context;
use softverbs_engine::Errno;

use crate::abi::*;
use crate::dm::mr_box;
use crate::fail_null;
use crate::verbs::{errno_of, new_context, outer, sv_device, SvPd};

const EINVAL: c_int = Errno::EINVAL as c_int;

/// `ibv_import_device`: a context over the objects of the context whose `cmd_fd` `fd`
/// duplicates; the new context owns `fd` (closed by `ibv_close_device`). EINVAL if `fd` is not
/// such a descriptor (or negative), ENODEV if its objects live in another process.
pub(crate) unsafe extern "C" fn import_device(fd: c_int) -> *mut ibv_context {
    if fd < 0 {
        return fail_null(EINVAL);
    }
    // SAFETY: the caller hands the descriptor over (ibv_import_device(3)); on failure it is
    // given back untouched with `into_raw_fd` below.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    match Context::import(owned) {
        Ok(core) => new_context(sv_device(core.device()).cast(), core),
        Err((e, fd)) => {
            let _ = fd.into_raw_fd();
            fail_null(errno_of(&e))
        }
    }
}

/// `ibv_import_pd`: EINVAL if `handle` names no live PD of the context's shared objects.
pub(crate) unsafe extern "C" fn import_pd(ctx: *mut ibv_context, handle: u32) -> *mut ibv_pd {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { crate::verbs::context(ctx) }) else {
        return fail_null(EINVAL);
    };
    match c.core.import_pd(handle) {
        Ok(core) => Box::into_raw(Box::new(SvPd {
            pd: ibv_pd {
                context: ctx,
                handle: core.handle(),
            },
            core,
            parent: None,
        }))
        .cast(),
        Err(e) => fail_null(errno_of(&e)),
    }
}

/// `ibv_unimport_pd`: frees this context's wrapper only.
pub(crate) unsafe extern "C" fn unimport_pd(pd: *mut ibv_pd) {
    if !pd.is_null() {
        // SAFETY: a live PD box of this library, which the caller gives up.
        drop(unsafe { Box::from_raw(pd.cast::<SvPd>()) });
    }
}

/// `ibv_import_mr`: the MR `handle` names, registered on (the PD behind) `pd`; its `addr` is
/// NULL, as the man page says. EINVAL if there is no such MR.
pub(crate) unsafe extern "C" fn import_mr(pd: *mut ibv_pd, handle: u32) -> *mut ibv_mr {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(p) = (unsafe { outer::<SvPd, _>(pd) }) else {
        return fail_null(EINVAL);
    };
    match p.core.import_mr(handle) {
        Ok(core) => mr_box(pd, core),
        Err(e) => fail_null(errno_of(&e)),
    }
}

/// `ibv_unimport_mr`: frees this context's wrapper only.
pub(crate) unsafe extern "C" fn unimport_mr(mr: *mut ibv_mr) {
    if !mr.is_null() {
        // SAFETY: a live MR box of this library, which the caller gives up.
        drop(unsafe { Box::from_raw(mr.cast::<crate::verbs::SvMr>()) });
    }
}
