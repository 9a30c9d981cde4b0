//! The completion clock in C: `ibv_query_rt_values_ex`, the `ibv_wc_read_completion_ts` and
//! `_wallclock_ns` readers of the extended CQ, and the extended device attributes
//! (`ibv_query_device_ex`: capability bits, on-demand paging and the clock).

use std::ffi::c_int;

use softverbs_device::attr_ex::raw_clock;
use softverbs_device::DeviceAttrEx;

use crate::abi::{ibv_context, ibv_cq_ex, ibv_device_attr_ex, ibv_values_ex};

/// `IBV_VALUES_MASK_RAW_CLOCK`.
const VALUES_MASK_RAW_CLOCK: u32 = 1;

/// The `query_rt_values` op behind the inline `ibv_query_rt_values_ex`: the raw completion
/// clock, as mlx5 reports it (`tv_sec` 0, `tv_nsec` the counter). Bits of `comp_mask` that were
/// not filled are cleared. 0 or an errno.
pub(crate) unsafe extern "C" fn query_rt_values(ctx: *mut ibv_context, values: *mut ibv_values_ex) -> c_int {
    if ctx.is_null() || values.is_null() {
        return crate::fail(libc::EINVAL);
    }
    // SAFETY: `values` is a writable `struct ibv_values_ex` (the verbs API contract).
    let v = unsafe { &mut *values };
    if v.comp_mask & VALUES_MASK_RAW_CLOCK != 0 {
        v.raw_clock.tv_sec = 0;
        v.raw_clock.tv_nsec = raw_clock() as i64;
        v.comp_mask = VALUES_MASK_RAW_CLOCK;
    } else {
        v.comp_mask = 0;
    }
    0
}

/// `ibv_wc_read_completion_ts`: the completion clock when the current completion was queued.
pub(crate) unsafe extern "C" fn read_completion_ts(cq: *mut ibv_cq_ex) -> u64 {
    // SAFETY: called by the `ibv_wc_read_*` inline on a CQ of this library during a poll.
    unsafe { crate::datapath::current(cq) }.timestamp
}

/// `ibv_wc_read_completion_wallclock_ns`: the wall clock when the current completion was
/// queued.
pub(crate) unsafe extern "C" fn read_completion_wallclock_ns(cq: *mut ibv_cq_ex) -> u64 {
    // SAFETY: as in `read_completion_ts`.
    unsafe { crate::datapath::current(cq) }.wallclock_ns
}

/// Fills the extended fields of `ibv_query_device_ex`.
pub(crate) fn fill_device_attr_ex(ex: &mut ibv_device_attr_ex, a: &DeviceAttrEx) {
    ex.device_cap_flags_ex = a.device_cap_flags_ex;
    ex.completion_timestamp_mask = a.completion_timestamp_mask;
    ex.hca_core_clock = a.hca_core_clock;
    ex.odp_caps.general_caps = a.odp_caps.general_caps;
    ex.odp_caps.per_transport_caps.rc_odp_caps = a.odp_caps.rc_odp_caps;
    ex.odp_caps.per_transport_caps.uc_odp_caps = a.odp_caps.uc_odp_caps;
    ex.odp_caps.per_transport_caps.ud_odp_caps = a.odp_caps.ud_odp_caps;
    ex.xrc_odp_caps = a.odp_caps.xrc_odp_caps;
}
