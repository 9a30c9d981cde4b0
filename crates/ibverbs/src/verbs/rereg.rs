//! `ibv_rereg_mr`.

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use softverbs_device::Mr;

use super::{errno_of, outer, SvMr, SvPd, EINVAL};
use crate::abi::*;
use crate::{fail_minus_one, set_errno};

/// `ibv_rereg_mr`: registers the region again with a new translation, PD and/or access
/// (`IBV_REREG_MR_CHANGE_*`), keeping the `ibv_mr` pointer; the keys change. 0, or a negative
/// `IBV_REREG_MR_ERR_*` with errno set; on error the old registration stays.
pub(crate) unsafe extern "C" fn rereg_mr(
    mr: *mut ibv_mr,
    flags: c_int,
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    access: c_int,
) -> c_int {
    const CHANGE_TRANSLATION: c_int = 1;
    const CHANGE_PD: c_int = 2;
    const CHANGE_ACCESS: c_int = 4;
    const ERR_INPUT: c_int = -1;
    const ERR_CMD: c_int = -3;
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(m) = (unsafe { outer::<SvMr, _>(mr) }) else {
        return fail_minus_one(EINVAL);
    };
    if flags == 0
        || flags & !(CHANGE_TRANSLATION | CHANGE_PD | CHANGE_ACCESS) != 0
        || (flags & CHANGE_TRANSLATION != 0 && (addr.is_null() || length == 0))
    {
        set_errno(EINVAL);
        return ERR_INPUT;
    }
    let new_pd_ptr = if flags & CHANGE_PD != 0 {
        pd
    } else {
        // SAFETY: `mr` is live.
        unsafe { (*mr).pd }
    };
    // SAFETY: the caller passes NULL or a live PD of this library (the verbs API contract).
    let Some(new_pd) = (unsafe { outer::<SvPd, _>(new_pd_ptr) }) else {
        set_errno(EINVAL);
        return ERR_INPUT;
    };
    let mut core = m.core.lock().unwrap_or_else(|p| p.into_inner());
    let access = if flags & CHANGE_ACCESS != 0 {
        access as u32
    } else {
        core.access().bits()
    };
    let (backing, base, iova): (Arc<dyn softverbs_device::MemoryBacking>, u64, u64) =
        if flags & CHANGE_TRANSLATION != 0 {
            (
                crate::odp::backing(addr, length as u64, access),
                addr as u64,
                addr as u64,
            )
        } else {
            (core.backing().clone(), core.addr(), core.iova())
        };
    let new = match Mr::register_iova(&new_pd.core, backing, base, iova, access) {
        Ok(n) => n,
        Err(e) => {
            set_errno(errno_of(&e));
            return ERR_CMD;
        }
    };
    if let Err(e) = core.dereg() {
        let _ = new.dereg();
        set_errno(errno_of(&e));
        return ERR_CMD;
    }
    // SAFETY: `mr` is live; update its public fields to the new registration.
    unsafe {
        (*mr).pd = new_pd_ptr;
        (*mr).addr = new.addr() as usize as *mut c_void;
        (*mr).length = new.length() as usize;
        (*mr).lkey = new.lkey();
        (*mr).rkey = new.rkey();
        (*mr).handle = new.handle();
    }
    *core = new;
    0
}
