//! `ibv_rereg_mr`.

use std::ffi::{c_int, c_void};

use softverbs_device::{ReregError, Translation};

use super::{errno_of, outer, SvMr, SvPd, EINVAL};
use crate::abi::*;
use crate::fail_minus_one;
use crate::set_errno;

/// `IBV_REREG_MR_CHANGE_TRANSLATION`.
const CHANGE_TRANSLATION: c_int = 1;
/// `IBV_REREG_MR_CHANGE_PD`.
const CHANGE_PD: c_int = 2;
/// `IBV_REREG_MR_CHANGE_ACCESS`.
const CHANGE_ACCESS: c_int = 4;
/// `IBV_REREG_MR_ERR_INPUT`.
const ERR_INPUT: c_int = -1;
/// `IBV_REREG_MR_ERR_CMD`.
const ERR_CMD: c_int = -4;

/// `ibv_rereg_mr`: the core changes the region in place (`IBV_REREG_MR_CHANGE_*`), keeping the
/// `ibv_mr` and its keys; this updates the public fields. 0, or a negative
/// `IBV_REREG_MR_ERR_*` with errno set; on error the registration is unchanged.
pub(crate) unsafe extern "C" fn rereg_mr(
    mr: *mut ibv_mr,
    flags: c_int,
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    access: c_int,
) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(m) = (unsafe { outer::<SvMr, _>(mr) }) else {
        return fail_minus_one(EINVAL);
    };
    // SAFETY: with IBV_REREG_MR_CHANGE_PD the caller passes NULL or a live PD of this library.
    let new_pd = (flags & CHANGE_PD != 0)
        .then(|| unsafe { outer::<SvPd, _>(pd) })
        .flatten();
    let core = m.core.lock().unwrap_or_else(|p| p.into_inner());
    // The new memory is reached as the region's rights after the call say (on-demand paging
    // or not). A NULL address is no translation at all: the core reports the missing argument.
    let new_access = if flags & CHANGE_ACCESS != 0 {
        access as u32
    } else {
        core.access().bits()
    };
    let translation = (flags & CHANGE_TRANSLATION != 0 && !addr.is_null()).then(|| Translation {
        backing: crate::odp::backing(addr, length as u64, new_access),
        addr: addr as u64,
        iova: addr as u64,
    });
    match core.rereg(flags as u32, new_pd.map(|p| &p.core), translation, access as u32) {
        Ok(()) => {
            // SAFETY: `mr` is live; its public fields follow the new registration.
            unsafe {
                if new_pd.is_some() {
                    (*mr).pd = pd;
                }
                (*mr).addr = core.addr() as usize as *mut c_void;
                (*mr).length = core.length() as usize;
            }
            0
        }
        Err(ReregError::Input(e)) => {
            set_errno(errno_of(&e));
            ERR_INPUT
        }
        Err(ReregError::Command(e)) => {
            set_errno(errno_of(&e));
            ERR_CMD
        }
    }
}
