//! Device discovery and contexts: `ibv_get_device_list`, `ibv_open_device`, `ibv_close_device`.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void};
use std::mem::size_of;
use std::ptr::{addr_of_mut, null_mut};
use std::sync::{Arc, Mutex, OnceLock};

use softverbs_device::{device_list, Context, Device};

use super::{
    close_xrcd, context, copy_str, create_srq_ex, errno_of, get_srq_num, open_qp, open_xrcd, outer,
    query_device, query_device_ex, query_port_compat, query_port_ex, SvContext, SvDevice, DEVICE_OPS_TAG,
    EINVAL, VERBS_CONTEXT_SIZE,
};
use crate::abi::*;
use crate::{datapath, fail, fail_minus_one, fail_null, set_errno};

/// Every device ever listed, by name. Devices live for the whole process, so a device pointer
/// stays valid after `ibv_free_device_list`, as with rdma-core.
pub(crate) fn device_registry() -> &'static Mutex<HashMap<String, usize>> {
    static REGISTRY: OnceLock<Mutex<HashMap<String, usize>>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

/// The process-wide `SvDevice` of a core device, made on first sight.
pub(crate) fn sv_device(core: &Device) -> *mut SvDevice {
    let mut reg = device_registry().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(&p) = reg.get(core.name()) {
        return p as *mut SvDevice;
    }
    let mut dev = ibv_device {
        _ops: _ibv_device_ops {
            _dummy1: std::ptr::null(),
            _dummy2: std::ptr::null(),
        },
        node_type: 1,      // IBV_NODE_CA
        transport_type: 0, // IBV_TRANSPORT_IB
        name: [0; IBV_SYSFS_NAME_MAX],
        dev_name: [0; IBV_SYSFS_NAME_MAX],
        dev_path: [0; IBV_SYSFS_PATH_MAX],
        ibdev_path: [0; IBV_SYSFS_PATH_MAX],
    };
    copy_str(&mut dev.name, core.name());
    copy_str(&mut dev.dev_name, core.name());
    copy_str(
        &mut dev.dev_path,
        &format!("/sys/class/infiniband_verbs/{}", core.name()),
    );
    copy_str(
        &mut dev.ibdev_path,
        &format!("/sys/class/infiniband/{}", core.name()),
    );
    let p = Box::into_raw(Box::new(SvDevice {
        dev,
        ops: DEVICE_OPS_TAG.as_ptr().cast(),
        core: core.clone(),
    }));
    reg.insert(core.name().to_string(), p as usize);
    p
}

/// `ibv_get_device_list`.
pub(crate) unsafe extern "C" fn get_device_list(num: *mut c_int) -> *mut *mut ibv_device {
    softverbs_device::log::init_from_env();
    let list = match device_list() {
        Ok(l) => l,
        Err(e) => return fail_null(errno_of(&e)),
    };
    // SAFETY: calloc of n+1 pointers; checked for NULL below.
    let arr = unsafe { libc::calloc(list.len() + 1, size_of::<*mut ibv_device>()) }.cast::<*mut ibv_device>();
    if arr.is_null() {
        return fail_null(libc::ENOMEM);
    }
    for (i, d) in list.iter().enumerate() {
        // SAFETY: `arr` has `list.len() + 1` slots; the last stays NULL.
        unsafe { *arr.add(i) = sv_device(d).cast() };
    }
    if !num.is_null() {
        // SAFETY: the caller passes a writable int or NULL.
        unsafe { *num = list.len() as c_int };
    }
    arr
}

/// `ibv_free_device_list`.
pub(crate) unsafe extern "C" fn free_device_list(list: *mut *mut ibv_device) {
    // SAFETY: `list` came from `get_device_list`'s calloc (or is NULL, which free ignores).
    unsafe { libc::free(list.cast()) };
}

/// `ibv_get_device_name`.
pub(crate) unsafe extern "C" fn get_device_name(dev: *mut ibv_device) -> *const c_char {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    match unsafe { outer::<SvDevice, _>(dev) } {
        Some(d) => d.dev.name.as_ptr(),
        None => fail_null(EINVAL),
    }
}

/// `ibv_get_device_guid`: the node GUID in network byte order.
pub(crate) unsafe extern "C" fn get_device_guid(dev: *mut ibv_device) -> u64 {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    match unsafe { outer::<SvDevice, _>(dev) } {
        Some(d) => d.core.guid().to_be(),
        None => {
            set_errno(EINVAL);
            0
        }
    }
}

/// `ibv_get_device_index`: the interface index, which is stable and unique per device.
pub(crate) unsafe extern "C" fn get_device_index(dev: *mut ibv_device) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    match unsafe { outer::<SvDevice, _>(dev) } {
        Some(d) => d.core.ifindex() as c_int,
        None => fail_minus_one(EINVAL),
    }
}

/// `ibv_open_device`.
pub(crate) unsafe extern "C" fn open_device(dev: *mut ibv_device) -> *mut ibv_context {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(d) = (unsafe { outer::<SvDevice, _>(dev) }) else {
        return fail_null(EINVAL);
    };
    match Context::open(&d.core) {
        Ok(core) => new_context(dev, core),
        Err(e) => fail_null(errno_of(&e)),
    }
}

/// Boxes a `verbs_context` with every op this library offers around a core context; used by
/// `ibv_open_device` and `ibv_import_device`.
pub(crate) fn new_context(dev: *mut ibv_device, core: Arc<Context>) -> *mut ibv_context {
    let ops = ibv_context_ops {
        _compat_query_device: Some(query_device),
        _compat_query_port: Some(query_port_compat),
        _compat_alloc_pd: std::ptr::null(),
        _compat_dealloc_pd: std::ptr::null(),
        _compat_reg_mr: std::ptr::null(),
        _compat_rereg_mr: std::ptr::null(),
        _compat_dereg_mr: std::ptr::null(),
        alloc_mw: super::alloc_mw as *const c_void,
        bind_mw: super::bind_mw as *const c_void,
        dealloc_mw: super::dealloc_mw as *const c_void,
        _compat_create_cq: std::ptr::null(),
        poll_cq: Some(datapath::poll_cq),
        req_notify_cq: Some(datapath::req_notify_cq),
        _compat_cq_event: std::ptr::null(),
        _compat_resize_cq: std::ptr::null(),
        _compat_destroy_cq: std::ptr::null(),
        _compat_create_srq: std::ptr::null(),
        _compat_modify_srq: std::ptr::null(),
        _compat_query_srq: std::ptr::null(),
        _compat_destroy_srq: std::ptr::null(),
        post_srq_recv: Some(datapath::post_srq_recv),
        _compat_create_qp: std::ptr::null(),
        _compat_query_qp: std::ptr::null(),
        _compat_modify_qp: std::ptr::null(),
        _compat_destroy_qp: std::ptr::null(),
        post_send: Some(datapath::post_send),
        post_recv: Some(datapath::post_recv),
        _compat_create_ah: std::ptr::null(),
        _compat_destroy_ah: std::ptr::null(),
        _compat_attach_mcast: std::ptr::null(),
        _compat_detach_mcast: std::ptr::null(),
        _compat_async_event: std::ptr::null(),
    };
    let null = std::ptr::null();
    let vctx = verbs_context {
        query_port: Some(query_port_ex),
        advise_mr: Some(crate::odp::advise_mr),
        alloc_null_mr: super::alloc_null_mr as *const c_void,
        read_counters: crate::counters::read_counters as *const c_void,
        attach_counters_point_flow: crate::counters::attach_counters_point_flow as *const c_void,
        create_counters: crate::counters::create_counters as *const c_void,
        destroy_counters: crate::counters::destroy_counters as *const c_void,
        reg_dm_mr: crate::dm::REG_DM_MR,
        alloc_dm: crate::dm::ALLOC_DM,
        free_dm: crate::dm::FREE_DM,
        modify_flow_action_esp: null,
        destroy_flow_action: null,
        create_flow_action_esp: null,
        modify_qp_rate_limit: crate::rate_limit::modify_qp_rate_limit as *const c_void,
        alloc_parent_domain: crate::domain::ALLOC_PARENT_DOMAIN,
        dealloc_td: crate::domain::DEALLOC_TD,
        alloc_td: crate::domain::ALLOC_TD,
        modify_cq: crate::cq_moderation::modify_cq as *const c_void,
        post_srq_ops: Some(crate::tm::post_srq_ops),
        destroy_rwq_ind_table: crate::raw::destroy_rwq_ind_table as *const c_void,
        create_rwq_ind_table: crate::raw::create_rwq_ind_table as *const c_void,
        destroy_wq: crate::raw::destroy_wq as *const c_void,
        modify_wq: crate::raw::modify_wq as *const c_void,
        create_wq: crate::raw::create_wq as *const c_void,
        query_rt_values: Some(crate::clock::query_rt_values),
        create_cq_ex: Some(datapath::create_cq_ex),
        priv_: null_mut(),
        query_device_ex: Some(query_device_ex),
        ibv_destroy_flow: crate::raw::destroy_flow as *const c_void,
        ABI_placeholder2: null,
        ibv_create_flow: crate::raw::create_flow as *const c_void,
        ABI_placeholder1: null,
        open_qp: Some(open_qp),
        create_qp_ex: Some(datapath::create_qp_ex),
        get_srq_num: Some(get_srq_num),
        create_srq_ex: Some(create_srq_ex),
        open_xrcd: Some(open_xrcd),
        close_xrcd: Some(close_xrcd),
        _ABI_placeholder3: 0,
        sz: VERBS_CONTEXT_SIZE,
        context: ibv_context {
            device: dev,
            ops,
            cmd_fd: core.cmd_fd(),
            async_fd: core.async_fd(),
            num_comp_vectors: softverbs_device::cq::NUM_COMP_VECTORS as c_int,
            mutex: pthread_mutex_t([0; 40]),
            abi_compat: usize::MAX as *mut c_void,
        },
    };
    let b = Box::into_raw(Box::new(SvContext { vctx, core }));
    // SAFETY: `b` is the live allocation just made; take the address of its context field.
    unsafe { addr_of_mut!((*b).vctx.context) }
}

/// `ibv_close_device`.
pub(crate) unsafe extern "C" fn close_device(ctx: *mut ibv_context) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { context(ctx) }) else {
        return fail(EINVAL);
    };
    c.core.close();
    // SAFETY: the SvContext was made by `Box::into_raw` in `open_device`; the caller gives it up.
    drop(unsafe { Box::from_raw((c as *const SvContext).cast_mut()) });
    0
}
