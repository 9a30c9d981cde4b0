//! On-demand paging: which backing a registration gets (explicit and implicit ODP regions are
//! reached fault-safely), and `ibv_advise_mr`.

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use softverbs_device::{MemoryBacking, Mr, Pd};
use softverbs_engine::types::{AccessFlags, Sge};
use softverbs_engine::Result;

use crate::abi::{ibv_pd, ibv_sge};
use crate::fail;
use crate::memory::{OdpMemory, RawMemory};
use crate::verbs::{errno_of, outer, SvPd};

/// The backing of `length` bytes at `addr`: fault-safe for an on-demand-paging region, whose
/// memory need not be mapped; direct otherwise (the application keeps it mapped).
pub(crate) fn backing(addr: *mut c_void, length: u64, access: u32) -> Arc<dyn MemoryBacking> {
    if access & AccessFlags::ON_DEMAND.bits() != 0 {
        Arc::new(OdpMemory::new(addr as u64, length))
    } else {
        Arc::new(RawMemory::new(addr.cast(), length))
    }
}

/// Registers `length` bytes at `addr`, remote peers addressing them from `iova`. NULL with
/// `SIZE_MAX` and `IBV_ACCESS_ON_DEMAND` is an implicit ODP region over the whole address
/// space, addressed by absolute virtual address (`ibv_reg_mr(3)`).
pub(crate) fn register(
    pd: &Arc<Pd>,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: u32,
) -> Result<Arc<Mr>> {
    let odp = access & AccessFlags::ON_DEMAND.bits() != 0;
    if odp && addr.is_null() && length == usize::MAX && iova == 0 {
        return Mr::register_implicit_odp(pd, Arc::new(OdpMemory::new(0, u64::MAX)), access);
    }
    Mr::register_iova(
        pd,
        backing(addr, length as u64, access),
        addr as u64,
        iova,
        access,
    )
}

/// The `advise_mr` op behind the inline `ibv_advise_mr`: 0, or an errno (also left in `errno`).
pub(crate) unsafe extern "C" fn advise_mr(
    pd: *mut ibv_pd,
    advice: u32,
    flags: u32,
    sg_list: *mut ibv_sge,
    num_sge: u32,
) -> c_int {
    // SAFETY: the caller passes NULL or a live PD of this library (the verbs API contract).
    let Some(p) = (unsafe { outer::<SvPd, _>(pd) }) else {
        return fail(libc::EINVAL);
    };
    let sges: Vec<Sge> = if sg_list.is_null() || num_sge == 0 {
        Vec::new()
    } else {
        // SAFETY: `sg_list` points at `num_sge` readable entries (the verbs API contract).
        unsafe { std::slice::from_raw_parts(sg_list, num_sge as usize) }
            .iter()
            .map(|s| Sge {
                addr: s.addr,
                length: s.length,
                lkey: s.lkey,
            })
            .collect()
    };
    match p.core.advise_mr(advice, flags, &sges) {
        Ok(()) => 0,
        Err(e) => fail(errno_of(&e)),
    }
}
