//! Devices, contexts and the control verbs.
//!
//! Every C object handed out is the first field of a `repr(C)` box defined here (`SvPd`,
//! `SvCq`, ...), next to the `Arc` of its core object; converting a C pointer back is a cast.
//! Contexts are the exception: the `ibv_context` is the last field of a `verbs_context`, which
//! is the first field of `SvContext`.
//!
//! Return conventions follow the man pages: object constructors return NULL and set `errno`;
//! `ibv_query_gid`, `ibv_get_cq_event`, `ibv_get_async_event` and `ibv_init_ah_from_wc`
//! return -1 and set `errno`; the others return the errno value.

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::mem::{offset_of, size_of};
use std::ptr::{addr_of_mut, null_mut};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use softverbs_device::qp::{QpInitAttr, SendRequest};
use softverbs_device::{
    device_list, Ah, AsyncEvent, CompChannel, Context, Cq, Device, DeviceAttr, EventElement, Mr, Pd,
    PortAttr, Qp, Srq,
};
use softverbs_engine::types::{
    AccessFlags, AhAttr, EventType, Gid, GlobalRoute, MigState, Mtu, QpAttr, QpAttrMask, QpCap, QpState,
    QpType, SrqAttr, WcFlags, WcOpcode, WcStatus, WorkCompletion,
};
use softverbs_engine::{Errno, Error};

use crate::abi::*;
use crate::memory::RawMemory;
use crate::{datapath, fail_minus_one, fail_null, set_errno};

const EINVAL: c_int = Errno::EINVAL as c_int;
const EOPNOTSUPP: c_int = Errno::EOPNOTSUPP as c_int;
const ENOSYS: c_int = Errno::ENOSYS as c_int;
const ENODATA: c_int = libc::ENODATA;
/// `sizeof(struct verbs_context)`, what rdma-core stores in `sz`.
const VERBS_CONTEXT_SIZE: usize = size_of::<verbs_context>();
/// `IBV_GID_TYPE_ROCE_V2` of `enum ibv_gid_type` (the `ibv_gid_entry` enum).
const GID_ENTRY_TYPE_ROCE_V2: u32 = 2;
/// `IBV_GID_TYPE_SYSFS_ROCE_V2` of `enum ibv_gid_type_sysfs` (what `ibv_query_gid_type` gives).
const GID_SYSFS_TYPE_ROCE_V2: c_uint = 1;

// ---------------------------------------------------------------------------------------------
// The C objects.

/// An `ibv_device` followed by the pointer slot of rdma-core's `struct verbs_device`, which
/// provider libraries read (`is_mlx5_dev()`): it points at `DEVICE_OPS_TAG`, never at theirs.
#[repr(C)]
pub(crate) struct SvDevice {
    dev: ibv_device,
    ops: *const c_void,
    core: Device,
}

/// What `SvDevice::ops` points at.
static DEVICE_OPS_TAG: [u8; 8] = *b"softvrbs";

#[repr(C)]
pub(crate) struct SvContext {
    vctx: verbs_context,
    pub(crate) core: Arc<Context>,
}

#[repr(C)]
pub(crate) struct SvPd {
    pd: ibv_pd,
    pub(crate) core: Arc<Pd>,
}

#[repr(C)]
pub(crate) struct SvMr {
    mr: ibv_mr,
    /// Replaced by `ibv_rereg_mr`.
    core: Mutex<Arc<Mr>>,
}

#[repr(C)]
pub(crate) struct SvChannel {
    ch: ibv_comp_channel,
    core: Arc<CompChannel>,
}

/// Every CQ is an `ibv_cq_ex` (a superset of `ibv_cq`), so `ibv_cq_ex_to_cq` and the plain
/// verbs work on CQs from either constructor.
#[repr(C)]
pub(crate) struct SvCq {
    pub(crate) cq: ibv_cq_ex,
    pub(crate) core: Arc<Cq>,
    /// The completion `start_poll`/`next_poll` fetched, read by the `read_*` accessors.
    pub(crate) cur: Cell<WorkCompletion>,
}

#[repr(C)]
pub(crate) struct SvSrq {
    srq: ibv_srq,
    pub(crate) core: Arc<Srq>,
}

/// Every QP is an `ibv_qp_ex`, so `ibv_qp_to_qp_ex` works on any QP.
#[repr(C)]
pub(crate) struct SvQp {
    pub(crate) qp: ibv_qp_ex,
    pub(crate) core: Arc<Qp>,
    pub(crate) sq_sig_all: bool,
    /// Work requests built with `ibv_wr_*` between `wr_start` and `wr_complete`.
    pub(crate) batch: Mutex<WrBatch>,
}

/// The extended work-request API's pending list.
#[derive(Debug, Default)]
pub(crate) struct WrBatch {
    pub(crate) reqs: Vec<SendRequest>,
    /// The first error a `wr_*` call found; `wr_complete` returns it.
    pub(crate) error: Option<c_int>,
}

#[repr(C)]
pub(crate) struct SvAh {
    ah: ibv_ah,
    pub(crate) core: Arc<Ah>,
}

// ---------------------------------------------------------------------------------------------
// From C pointers back to the boxes.

/// The box whose first field `p` points at, or `None` for NULL.
///
/// # Safety
/// `p` must be NULL or a pointer this library handed out as the first field of an `S` that has
/// not been freed.
pub(crate) unsafe fn outer<'a, S, C>(p: *mut C) -> Option<&'a S> {
    // SAFETY: per the contract, `p` points at the start of a live `S`.
    (!p.is_null()).then(|| unsafe { &*p.cast::<S>() })
}

/// Destroys a C object this library boxed: runs `destroy` on the object behind `p` and, if the
/// core agrees (no EBUSY), frees the box. EINVAL for NULL.
///
/// # Safety
/// `p` must be NULL or point at the start of a live `S` made by `Box::into_raw`, which the
/// caller gives up on success.
unsafe fn destroy_boxed<S, C>(p: *mut C, destroy: impl FnOnce(&S) -> softverbs_engine::Result<()>) -> c_int {
    // SAFETY: the caller's contract.
    let Some(obj) = (unsafe { outer::<S, _>(p) }) else {
        return EINVAL;
    };
    match destroy(obj) {
        // SAFETY: made by `Box::into_raw`; the caller gives it up.
        Ok(()) => {
            drop(unsafe { Box::from_raw(p.cast::<S>()) });
            0
        }
        Err(e) => errno_of(&e),
    }
}

/// The `SvContext` of an `ibv_context`.
///
/// # Safety
/// `ctx` must be NULL or a context returned by `ibv_open_device` and not yet closed.
pub(crate) unsafe fn context<'a>(ctx: *mut ibv_context) -> Option<&'a SvContext> {
    if ctx.is_null() {
        return None;
    }
    // SAFETY: every context we hand out is the `context` field of a `verbs_context` at the start
    // of an `SvContext`, so stepping back by the field offset stays inside that allocation.
    Some(unsafe {
        &*ctx
            .cast::<u8>()
            .sub(offset_of!(verbs_context, context))
            .cast::<SvContext>()
    })
}

fn errno_of(e: &Error) -> c_int {
    e.errno()
}

// ---------------------------------------------------------------------------------------------
// Devices.

/// Every device ever listed, by name. Devices live for the whole process, so a device pointer
/// stays valid after `ibv_free_device_list`, as with rdma-core.
fn device_registry() -> &'static Mutex<HashMap<String, usize>> {
    static REGISTRY: OnceLock<Mutex<HashMap<String, usize>>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

fn copy_str(dst: &mut [c_char], s: &str) {
    let max = dst.len() - 1;
    for (d, b) in dst.iter_mut().zip(s.bytes().take(max)) {
        *d = b as c_char;
    }
}

fn sv_device(core: &Device) -> *mut SvDevice {
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
        None => 0,
    }
}

/// `ibv_get_device_index`: the interface index, which is stable and unique per device.
pub(crate) unsafe extern "C" fn get_device_index(dev: *mut ibv_device) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    match unsafe { outer::<SvDevice, _>(dev) } {
        Some(d) => d.core.ifindex() as c_int,
        None => -1,
    }
}

/// `ibv_open_device`.
pub(crate) unsafe extern "C" fn open_device(dev: *mut ibv_device) -> *mut ibv_context {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(d) = (unsafe { outer::<SvDevice, _>(dev) }) else {
        return fail_null(EINVAL);
    };
    let core = match Context::open(&d.core) {
        Ok(c) => c,
        Err(e) => return fail_null(errno_of(&e)),
    };
    let ops = ibv_context_ops {
        _compat_query_device: Some(query_device),
        _compat_query_port: Some(query_port_compat),
        _compat_alloc_pd: std::ptr::null(),
        _compat_dealloc_pd: std::ptr::null(),
        _compat_reg_mr: std::ptr::null(),
        _compat_rereg_mr: std::ptr::null(),
        _compat_dereg_mr: std::ptr::null(),
        alloc_mw: std::ptr::null(),
        bind_mw: std::ptr::null(),
        dealloc_mw: std::ptr::null(),
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
        advise_mr: null,
        alloc_null_mr: null,
        read_counters: null,
        attach_counters_point_flow: null,
        create_counters: null,
        destroy_counters: null,
        reg_dm_mr: null,
        alloc_dm: null,
        free_dm: null,
        modify_flow_action_esp: null,
        destroy_flow_action: null,
        create_flow_action_esp: null,
        modify_qp_rate_limit: null,
        alloc_parent_domain: null,
        dealloc_td: null,
        alloc_td: null,
        modify_cq: null,
        post_srq_ops: null,
        destroy_rwq_ind_table: null,
        create_rwq_ind_table: null,
        destroy_wq: null,
        modify_wq: null,
        create_wq: null,
        query_rt_values: null,
        create_cq_ex: Some(datapath::create_cq_ex),
        priv_: null_mut(),
        query_device_ex: Some(query_device_ex),
        ibv_destroy_flow: null,
        ABI_placeholder2: null,
        ibv_create_flow: null,
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
            cmd_fd: -1,
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
        return EINVAL;
    };
    c.core.close();
    // SAFETY: the SvContext was made by `Box::into_raw` in `open_device`; the caller gives it up.
    drop(unsafe { Box::from_raw((c as *const SvContext).cast_mut()) });
    0
}

// ---------------------------------------------------------------------------------------------
// Queries.

fn device_attr_c(a: &DeviceAttr) -> ibv_device_attr {
    let mut fw_ver = [0 as c_char; 64];
    copy_str(&mut fw_ver, &a.fw_ver);
    let i = |v: u32| v.min(i32::MAX as u32) as c_int;
    ibv_device_attr {
        fw_ver,
        node_guid: a.node_guid.to_be(),
        sys_image_guid: a.sys_image_guid.to_be(),
        max_mr_size: a.max_mr_size,
        page_size_cap: a.page_size_cap,
        vendor_id: a.vendor_id,
        vendor_part_id: a.vendor_part_id,
        hw_ver: a.hw_ver,
        max_qp: i(a.max_qp),
        max_qp_wr: i(a.max_qp_wr),
        device_cap_flags: a.device_cap_flags,
        max_sge: i(a.max_sge),
        max_sge_rd: i(a.max_sge_rd),
        max_cq: i(a.max_cq),
        max_cqe: i(a.max_cqe),
        max_mr: i(a.max_mr),
        max_pd: i(a.max_pd),
        max_qp_rd_atom: i(a.max_qp_rd_atom),
        max_ee_rd_atom: i(a.max_ee_rd_atom),
        max_res_rd_atom: i(a.max_res_rd_atom),
        max_qp_init_rd_atom: i(a.max_qp_init_rd_atom),
        max_ee_init_rd_atom: i(a.max_ee_init_rd_atom),
        atomic_cap: a.atomic_cap.raw(),
        max_ee: i(a.max_ee),
        max_rdd: i(a.max_rdd),
        max_mw: i(a.max_mw),
        max_raw_ipv6_qp: i(a.max_raw_ipv6_qp),
        max_raw_ethy_qp: i(a.max_raw_ethy_qp),
        max_mcast_grp: i(a.max_mcast_grp),
        max_mcast_qp_attach: i(a.max_mcast_qp_attach),
        max_total_mcast_qp_attach: i(a.max_total_mcast_qp_attach),
        max_ah: i(a.max_ah),
        max_fmr: i(a.max_fmr),
        max_map_per_fmr: i(a.max_map_per_fmr),
        max_srq: i(a.max_srq),
        max_srq_wr: i(a.max_srq_wr),
        max_srq_sge: i(a.max_srq_sge),
        max_pkeys: a.max_pkeys,
        local_ca_ack_delay: a.local_ca_ack_delay,
        phys_port_cnt: a.phys_port_cnt,
    }
}

/// `ibv_query_device`.
pub(crate) unsafe extern "C" fn query_device(ctx: *mut ibv_context, attr: *mut ibv_device_attr) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { context(ctx) }) else {
        return EINVAL;
    };
    if attr.is_null() {
        return EINVAL;
    }
    // SAFETY: the caller passes a writable `struct ibv_device_attr`.
    unsafe { attr.write(device_attr_c(&c.core.query_device())) };
    0
}

/// The `query_device_ex` op behind the `ibv_query_device_ex` inline wrapper.
unsafe extern "C" fn query_device_ex(
    ctx: *mut ibv_context,
    input: *const ibv_query_device_ex_input,
    attr: *mut ibv_device_attr_ex,
    attr_size: usize,
) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { context(ctx) }) else {
        return EINVAL;
    };
    // SAFETY: `input` is NULL or a readable input struct.
    if !input.is_null() && unsafe { (*input).comp_mask } != 0 {
        return EINVAL;
    }
    if attr.is_null() || attr_size < size_of::<ibv_device_attr>() {
        return EINVAL;
    }
    let orig = device_attr_c(&c.core.query_device());
    // SAFETY: all-zero is a valid `ibv_device_attr_ex` (integers and plain structs only).
    let mut ex: ibv_device_attr_ex = unsafe { std::mem::zeroed() };
    ex.orig_attr = orig;
    ex.device_cap_flags_ex = u64::from(orig.device_cap_flags);
    ex.phys_port_cnt_ex = u32::from(orig.phys_port_cnt);
    let n = attr_size.min(size_of::<ibv_device_attr_ex>());
    // SAFETY: the caller's buffer holds `attr_size` bytes; we copy at most that many.
    unsafe {
        std::ptr::copy_nonoverlapping(
            (&ex as *const ibv_device_attr_ex).cast::<u8>(),
            attr.cast::<u8>(),
            n,
        );
    };
    0
}

fn port_attr_c(p: &PortAttr) -> ibv_port_attr {
    ibv_port_attr {
        state: p.state.raw(),
        max_mtu: p.max_mtu.raw(),
        active_mtu: p.active_mtu.raw(),
        gid_tbl_len: p.gid_tbl_len as c_int,
        port_cap_flags: p.port_cap_flags,
        max_msg_sz: p.max_msg_sz,
        bad_pkey_cntr: p.bad_pkey_cntr,
        qkey_viol_cntr: p.qkey_viol_cntr,
        pkey_tbl_len: p.pkey_tbl_len,
        lid: p.lid,
        sm_lid: p.sm_lid,
        lmc: p.lmc,
        max_vl_num: p.max_vl_num,
        sm_sl: p.sm_sl,
        subnet_timeout: p.subnet_timeout,
        init_type_reply: p.init_type_reply,
        active_width: p.active_width,
        active_speed: p.active_speed,
        phys_state: p.phys_state,
        link_layer: p.link_layer,
        flags: p.flags,
        port_cap_flags2: p.port_cap_flags2,
    }
}

/// Writes at most `len` bytes of the port attributes.
unsafe fn query_port_into(ctx: *mut ibv_context, port: u8, attr: *mut ibv_port_attr, len: usize) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { context(ctx) }) else {
        return EINVAL;
    };
    if attr.is_null() {
        return EINVAL;
    }
    match c.core.query_port(port) {
        Ok(p) => {
            let a = port_attr_c(&p);
            let n = len.min(size_of::<ibv_port_attr>());
            // SAFETY: the caller's buffer holds at least `len` bytes.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    (&a as *const ibv_port_attr).cast::<u8>(),
                    attr.cast::<u8>(),
                    n,
                );
            };
            0
        }
        Err(e) => errno_of(&e),
    }
}

/// `ibv_query_port@@IBVERBS_1.1`: the buffer is the 48-byte `struct _compat_ibv_port_attr`.
pub(crate) unsafe extern "C" fn query_port_compat(
    ctx: *mut ibv_context,
    port: u8,
    attr: *mut ibv_port_attr,
) -> c_int {
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    unsafe { query_port_into(ctx, port, attr, COMPAT_PORT_ATTR_SIZE) }
}

/// The `query_port` op of `verbs_context`, behind the `ibv_query_port` inline wrapper.
unsafe extern "C" fn query_port_ex(
    ctx: *mut ibv_context,
    port: u8,
    attr: *mut ibv_port_attr,
    len: usize,
) -> c_int {
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    unsafe { query_port_into(ctx, port, attr, len) }
}

/// `ibv_query_gid`: 0, or -1 with errno.
pub(crate) unsafe extern "C" fn query_gid(
    ctx: *mut ibv_context,
    port: u8,
    index: c_int,
    gid: *mut ibv_gid,
) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { context(ctx) }) else {
        return fail_minus_one(EINVAL);
    };
    if gid.is_null() {
        return fail_minus_one(EINVAL);
    }
    match c.core.query_gid(port, index) {
        Ok(g) => {
            // SAFETY: the caller passes a writable `union ibv_gid`.
            unsafe { gid.write(ibv_gid { raw: g.0 }) };
            0
        }
        Err(e) => fail_minus_one(errno_of(&e)),
    }
}

/// `ibv_query_gid_type` (IBVERBS_PRIVATE_34): the sysfs GID type; 0, or -1 with errno.
pub(crate) unsafe extern "C" fn query_gid_type(
    ctx: *mut ibv_context,
    port: u8,
    index: c_uint,
    ty: *mut c_uint,
) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { context(ctx) }) else {
        return fail_minus_one(EINVAL);
    };
    match c.core.query_gid(port, index.min(i32::MAX as u32) as i32) {
        Ok(_) if !ty.is_null() => {
            // SAFETY: the caller passes a writable enum.
            unsafe { ty.write(GID_SYSFS_TYPE_ROCE_V2) };
            0
        }
        Ok(_) => fail_minus_one(EINVAL),
        Err(e) => fail_minus_one(errno_of(&e)),
    }
}

fn gid_entry(c: &SvContext, port: u8, index: u32, gid: Gid) -> ibv_gid_entry {
    ibv_gid_entry {
        gid: ibv_gid { raw: gid.0 },
        gid_index: index,
        port_num: u32::from(port),
        gid_type: GID_ENTRY_TYPE_ROCE_V2,
        ndev_ifindex: c.core.device().ifindex(),
    }
}

/// `_ibv_query_gid_ex`: 0 or an errno (ENODATA for an empty entry).
pub(crate) unsafe extern "C" fn query_gid_ex(
    ctx: *mut ibv_context,
    port: u32,
    index: u32,
    entry: *mut ibv_gid_entry,
    flags: u32,
    entry_size: usize,
) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { context(ctx) }) else {
        return EINVAL;
    };
    if flags != 0 || entry.is_null() || entry_size < size_of::<ibv_gid_entry>() {
        return EINVAL;
    }
    let Ok(port) = u8::try_from(port) else {
        return EINVAL;
    };
    match c.core.query_gid(port, index.min(i32::MAX as u32) as i32) {
        Ok(g) if g.is_zero() => ENODATA,
        Ok(g) => {
            // SAFETY: the caller's entry holds at least `sizeof(struct ibv_gid_entry)` bytes.
            unsafe { entry.write(gid_entry(c, port, index, g)) };
            0
        }
        Err(e) => errno_of(&e),
    }
}

/// `_ibv_query_gid_table`: the number of valid entries written, or a negative errno.
pub(crate) unsafe extern "C" fn query_gid_table(
    ctx: *mut ibv_context,
    entries: *mut ibv_gid_entry,
    max_entries: usize,
    flags: u32,
    entry_size: usize,
) -> isize {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { context(ctx) }) else {
        return -(EINVAL as isize);
    };
    if flags != 0 || entries.is_null() || entry_size < size_of::<ibv_gid_entry>() {
        return -(EINVAL as isize);
    }
    let table = c.core.device().gid_table();
    let valid: Vec<(usize, Gid)> = table
        .iter()
        .copied()
        .enumerate()
        .filter(|(_, g)| !g.is_zero())
        .collect();
    if valid.len() > max_entries {
        return -(EINVAL as isize);
    }
    for (n, (i, g)) in valid.iter().enumerate() {
        // SAFETY: the caller's array has `max_entries` entries of `entry_size` bytes each.
        unsafe {
            entries
                .cast::<u8>()
                .add(n * entry_size)
                .cast::<ibv_gid_entry>()
                .write_unaligned(gid_entry(c, 1, *i as u32, *g));
        }
    }
    valid.len() as isize
}

/// `ibv_query_pkey`: 0, or -1 with errno.
pub(crate) unsafe extern "C" fn query_pkey(
    ctx: *mut ibv_context,
    port: u8,
    index: c_int,
    pkey: *mut u16,
) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { context(ctx) }) else {
        return fail_minus_one(EINVAL);
    };
    match c.core.query_pkey(port, index) {
        Ok(k) if !pkey.is_null() => {
            // SAFETY: the caller passes a writable `__be16`.
            unsafe { pkey.write(k.to_be()) };
            0
        }
        Ok(_) => fail_minus_one(EINVAL),
        Err(e) => fail_minus_one(errno_of(&e)),
    }
}

/// `ibv_get_pkey_index`: the index, or -1 with errno.
pub(crate) unsafe extern "C" fn get_pkey_index(ctx: *mut ibv_context, port: u8, pkey: u16) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { context(ctx) }) else {
        return fail_minus_one(EINVAL);
    };
    match c.core.pkey_index(port, u16::from_be(pkey)) {
        Ok(i) => c_int::from(i),
        Err(e) => fail_minus_one(errno_of(&e)),
    }
}

/// `ibv_get_sysfs_path`.
pub(crate) extern "C" fn get_sysfs_path() -> *const c_char {
    c"/sys".as_ptr()
}

/// `ibv_read_sysfs_file`: reads `dir/file` into `buf`, dropping a trailing newline; the
/// length, or -1 if it cannot be read (our devices have no sysfs entries).
pub(crate) unsafe extern "C" fn read_sysfs_file(
    dir: *const c_char,
    file: *const c_char,
    buf: *mut c_char,
    size: usize,
) -> c_int {
    if dir.is_null() || file.is_null() || buf.is_null() || size == 0 {
        return fail_minus_one(EINVAL);
    }
    // SAFETY: the caller passes NUL-terminated strings.
    let (dir, file) = unsafe { (CStr::from_ptr(dir), CStr::from_ptr(file)) };
    let path = format!("{}/{}", dir.to_string_lossy(), file.to_string_lossy());
    let data = match std::fs::read(&path) {
        Ok(d) => d,
        Err(e) => return fail_minus_one(e.raw_os_error().unwrap_or(libc::ENOENT)),
    };
    let mut n = data.len().min(size - 1);
    if n > 0 && data[n - 1] == b'\n' {
        n -= 1;
    }
    // SAFETY: `buf` holds `size` bytes and `n < size`.
    unsafe {
        std::ptr::copy_nonoverlapping(data.as_ptr(), buf.cast::<u8>(), n);
        *buf.add(n) = 0;
    }
    n as c_int
}

/// `ibv_read_ibdev_sysfs_file` (IBVERBS_PRIVATE_34): our devices have no sysfs directory.
pub(crate) extern "C" fn read_ibdev_sysfs_file(_buf: *mut c_char, _size: usize, _dev: *mut c_void) -> c_int {
    fail_minus_one(libc::ENOENT)
}

// ---------------------------------------------------------------------------------------------
// Protection domains and memory regions.

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
            });
            Box::into_raw(b).cast()
        }
        Err(e) => fail_null(errno_of(&e)),
    }
}

/// `ibv_dealloc_pd`: EBUSY while anything uses the PD.
pub(crate) unsafe extern "C" fn dealloc_pd(pd: *mut ibv_pd) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    unsafe { destroy_boxed::<SvPd, _>(pd, |p| p.core.dealloc()) }
}

unsafe fn reg(pd: *mut ibv_pd, addr: *mut c_void, length: usize, iova: u64, access: c_int) -> *mut ibv_mr {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(p) = (unsafe { outer::<SvPd, _>(pd) }) else {
        return fail_null(EINVAL);
    };
    let backing = Arc::new(RawMemory::new(addr.cast(), length as u64));
    match Mr::register_iova(&p.core, backing, addr as u64, iova, access as u32) {
        Ok(core) => {
            let mr = ibv_mr {
                // SAFETY: `pd` is live (checked above); read its context pointer.
                context: unsafe { (*pd).context },
                pd,
                addr,
                length,
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
        Err(e) => fail_null(errno_of(&e)),
    }
}

/// `ibv_reg_mr`.
pub(crate) unsafe extern "C" fn reg_mr(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    access: c_int,
) -> *mut ibv_mr {
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    unsafe { reg(pd, addr, length, addr as u64, access) }
}

/// `ibv_reg_mr_iova`.
pub(crate) unsafe extern "C" fn reg_mr_iova(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: c_int,
) -> *mut ibv_mr {
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    unsafe { reg(pd, addr, length, iova, access) }
}

/// `ibv_reg_mr_iova2`.
pub(crate) unsafe extern "C" fn reg_mr_iova2(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: c_uint,
) -> *mut ibv_mr {
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    unsafe { reg(pd, addr, length, iova, access as c_int) }
}

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
    let (backing, base, iova): (Arc<dyn softverbs_device::MemoryBacking>, u64, u64) =
        if flags & CHANGE_TRANSLATION != 0 {
            (
                Arc::new(RawMemory::new(addr.cast(), length as u64)),
                addr as u64,
                addr as u64,
            )
        } else {
            (core.backing().clone(), core.addr(), core.iova())
        };
    let access = if flags & CHANGE_ACCESS != 0 {
        access as u32
    } else {
        core.access().bits()
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

/// `ibv_dereg_mr`.
pub(crate) unsafe extern "C" fn dereg_mr(mr: *mut ibv_mr) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    unsafe { destroy_boxed::<SvMr, _>(mr, |m| m.core.lock().unwrap_or_else(|p| p.into_inner()).dereg()) }
}

// ---------------------------------------------------------------------------------------------
// Completion channels and CQs.

/// `ibv_create_comp_channel`.
pub(crate) unsafe extern "C" fn create_comp_channel(ctx: *mut ibv_context) -> *mut ibv_comp_channel {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { context(ctx) }) else {
        return fail_null(EINVAL);
    };
    match CompChannel::create(&c.core) {
        Ok(core) => {
            let ch = ibv_comp_channel {
                context: ctx,
                fd: core.fd(),
                refcnt: 0,
            };
            Box::into_raw(Box::new(SvChannel { ch, core })).cast()
        }
        Err(e) => fail_null(errno_of(&e)),
    }
}

/// `ibv_destroy_comp_channel`: EBUSY while a CQ uses it.
pub(crate) unsafe extern "C" fn destroy_comp_channel(ch: *mut ibv_comp_channel) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    unsafe { destroy_boxed::<SvChannel, _>(ch, |c| c.core.destroy()) }
}

/// The `refcnt` field of a channel, updated atomically.
///
/// # Safety
/// `ch` must be a live channel of this library.
unsafe fn channel_refcnt<'a>(ch: *mut ibv_comp_channel) -> &'a AtomicI32 {
    // SAFETY: `refcnt` is an aligned `int` inside the live channel; all updates are atomic.
    unsafe { AtomicI32::from_ptr(addr_of_mut!((*ch).refcnt)) }
}

/// Creates a CQ box; shared by `ibv_create_cq` and the `create_cq_ex` op.
pub(crate) unsafe fn new_cq(
    ctx: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    comp_vector: c_int,
) -> Result<*mut SvCq, c_int> {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let c = unsafe { context(ctx) }.ok_or(EINVAL)?;
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let ch = unsafe { outer::<SvChannel, _>(channel) };
    let core = Cq::create(&c.core, cqe, ch.map(|c| &c.core), comp_vector).map_err(|e| errno_of(&e))?;
    let cq = ibv_cq_ex {
        context: ctx,
        channel,
        cq_context,
        handle: core.handle(),
        cqe: core.cqe() as c_int,
        mutex: pthread_mutex_t([0; 40]),
        cond: pthread_cond_t([0; 48]),
        comp_events_completed: 0,
        async_events_completed: 0,
        comp_mask: 0,
        status: 0,
        wr_id: 0,
        start_poll: None,
        next_poll: None,
        end_poll: None,
        read_opcode: None,
        read_vendor_err: None,
        read_byte_len: None,
        read_imm_data: None,
        read_qp_num: None,
        read_src_qp: None,
        read_wc_flags: None,
        read_slid: None,
        read_sl: None,
        read_dlid_path_bits: None,
        read_completion_ts: None,
        read_cvlan: None,
        read_flow_tag: None,
        read_tm_info: std::ptr::null(),
        read_completion_wallclock_ns: None,
    };
    let b = Box::into_raw(Box::new(SvCq {
        cq,
        core,
        cur: Cell::new(WorkCompletion::default()),
    }));
    if !channel.is_null() {
        // SAFETY: `channel` is a live channel (its core object was found above); `refcnt` counts
        // its CQs, as rdma-core keeps it.
        unsafe { channel_refcnt(channel).fetch_add(1, Ordering::Relaxed) };
    }
    // SAFETY: `b` is live; the core CQ remembers its box for `ibv_get_cq_event` and async events.
    unsafe { (*b).core.set_user_data(b as u64) };
    datapath::install_cq_ex_ops(b);
    Ok(b)
}

/// `ibv_create_cq`.
pub(crate) unsafe extern "C" fn create_cq(
    ctx: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    comp_vector: c_int,
) -> *mut ibv_cq {
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    match unsafe { new_cq(ctx, cqe, cq_context, channel, comp_vector) } {
        Ok(b) => b.cast(),
        Err(e) => fail_null(e),
    }
}

/// `ibv_resize_cq`.
pub(crate) unsafe extern "C" fn resize_cq(cq: *mut ibv_cq, cqe: c_int) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { outer::<SvCq, _>(cq) }) else {
        return EINVAL;
    };
    match c.core.resize(cqe) {
        Ok(n) => {
            // SAFETY: `cq` is live; update its public size.
            unsafe { (*cq).cqe = n as c_int };
            0
        }
        Err(e) => errno_of(&e),
    }
}

/// `ibv_destroy_cq`: EBUSY while a QP uses it; waits for its events to be acknowledged.
pub(crate) unsafe extern "C" fn destroy_cq(cq: *mut ibv_cq) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { outer::<SvCq, _>(cq) }) else {
        return EINVAL;
    };
    match c.core.destroy() {
        Ok(()) => {
            let channel = c.cq.channel;
            if !channel.is_null() {
                // SAFETY: a channel outlives its CQs (destroying it is EBUSY while they exist).
                unsafe { channel_refcnt(channel).fetch_sub(1, Ordering::Relaxed) };
            }
            // SAFETY: made by `Box::into_raw` in `new_cq`; the caller gives it up.
            drop(unsafe { Box::from_raw(cq.cast::<SvCq>()) });
            0
        }
        Err(e) => errno_of(&e),
    }
}

/// `ibv_get_cq_event`: 0, or -1 with errno (EAGAIN on a non-blocking channel fd).
pub(crate) unsafe extern "C" fn get_cq_event(
    ch: *mut ibv_comp_channel,
    cq: *mut *mut ibv_cq,
    cq_context: *mut *mut c_void,
) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { outer::<SvChannel, _>(ch) }) else {
        return fail_minus_one(EINVAL);
    };
    match c.core.get_cq_event(None) {
        Ok(core) => {
            let p = core.user_data() as *mut SvCq;
            // SAFETY: the user data is the CQ's live box (a CQ is destroyed only after its
            // delivered events are acknowledged); the out-pointers are writable.
            unsafe {
                if !cq.is_null() {
                    *cq = p.cast();
                }
                if !cq_context.is_null() {
                    *cq_context = (*p).cq.cq_context;
                }
            }
            0
        }
        Err(e) => fail_minus_one(errno_of(&e)),
    }
}

/// Adds `n` to a `u32` field under the object's `pthread` mutex and signals its condition, as
/// rdma-core does for the `*_events_completed` counters.
unsafe fn bump_locked(mutex: *mut pthread_mutex_t, cond: *mut pthread_cond_t, field: *mut u32, n: u32) {
    // SAFETY: the fields belong to a live object; the mutex and condition were zero-initialised,
    // which is the glibc static initialiser.
    unsafe {
        libc::pthread_mutex_lock(mutex.cast());
        *field = (*field).wrapping_add(n);
        libc::pthread_cond_signal(cond.cast());
        libc::pthread_mutex_unlock(mutex.cast());
    }
}

/// `ibv_ack_cq_events`.
pub(crate) unsafe extern "C" fn ack_cq_events(cq: *mut ibv_cq, n: c_uint) {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { outer::<SvCq, _>(cq) }) else {
        return;
    };
    c.core.ack_events(n);
    // SAFETY: `cq` is live.
    unsafe {
        bump_locked(
            addr_of_mut!((*cq).mutex),
            addr_of_mut!((*cq).cond),
            addr_of_mut!((*cq).comp_events_completed),
            n,
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Shared receive queues.

pub(crate) unsafe fn new_srq(
    pd: *mut ibv_pd,
    srq_context: *mut c_void,
    attr: *mut ibv_srq_attr,
) -> Result<*mut SvSrq, c_int> {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let p = unsafe { outer::<SvPd, _>(pd) }.ok_or(EINVAL)?;
    if attr.is_null() {
        return Err(EINVAL);
    }
    // SAFETY: `attr` is a readable and writable `struct ibv_srq_attr`.
    let a = unsafe { *attr };
    let core = Srq::create(
        &p.core,
        &SrqAttr {
            max_wr: a.max_wr,
            max_sge: a.max_sge,
            srq_limit: a.srq_limit,
        },
    )
    .map_err(|e| errno_of(&e))?;
    let actual = core.query();
    // SAFETY: as above; ibv_create_srq(3) returns the actual sizes in the caller's attributes.
    unsafe {
        (*attr).max_wr = actual.max_wr;
        (*attr).max_sge = actual.max_sge;
    }
    let srq = ibv_srq {
        // SAFETY: `pd` is live.
        context: unsafe { (*pd).context },
        srq_context,
        pd,
        handle: core.handle(),
        mutex: pthread_mutex_t([0; 40]),
        cond: pthread_cond_t([0; 48]),
        events_completed: 0,
    };
    let b = Box::into_raw(Box::new(SvSrq { srq, core }));
    // SAFETY: `b` is live.
    unsafe { (*b).core.set_user_data(b as u64) };
    Ok(b)
}

/// `ibv_create_srq`.
pub(crate) unsafe extern "C" fn create_srq(pd: *mut ibv_pd, init: *mut ibv_srq_init_attr) -> *mut ibv_srq {
    if init.is_null() {
        return fail_null(EINVAL);
    }
    // SAFETY: `init` is a live `struct ibv_srq_init_attr`.
    let (ctx, attr) = unsafe { ((*init).srq_context, addr_of_mut!((*init).attr)) };
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    match unsafe { new_srq(pd, ctx, attr) } {
        Ok(b) => b.cast(),
        Err(e) => fail_null(e),
    }
}

/// The `create_srq_ex` op: basic SRQs only (XRC and tag-matching SRQs are EOPNOTSUPP).
unsafe extern "C" fn create_srq_ex(_ctx: *mut ibv_context, init: *mut ibv_srq_init_attr_ex) -> *mut ibv_srq {
    if init.is_null() {
        return fail_null(EINVAL);
    }
    // SAFETY: `init` is a live `struct ibv_srq_init_attr_ex`.
    let (mask, ty, pd, srq_ctx, attr) = unsafe {
        (
            (*init).comp_mask,
            (*init).srq_type,
            (*init).pd,
            (*init).srq_context,
            addr_of_mut!((*init).attr),
        )
    };
    if mask & IBV_SRQ_INIT_ATTR_PD == 0 {
        return fail_null(EINVAL);
    }
    if mask & !(IBV_SRQ_INIT_ATTR_PD | IBV_SRQ_INIT_ATTR_TYPE) != 0
        || (mask & IBV_SRQ_INIT_ATTR_TYPE != 0 && ty != IBV_SRQT_BASIC)
    {
        return fail_null(EOPNOTSUPP);
    }
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    match unsafe { new_srq(pd, srq_ctx, attr) } {
        Ok(b) => b.cast(),
        Err(e) => fail_null(e),
    }
}

/// `ibv_modify_srq`.
pub(crate) unsafe extern "C" fn modify_srq(srq: *mut ibv_srq, attr: *mut ibv_srq_attr, mask: c_int) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(s) = (unsafe { outer::<SvSrq, _>(srq) }) else {
        return EINVAL;
    };
    if attr.is_null() {
        return EINVAL;
    }
    // SAFETY: `attr` is readable.
    let a = unsafe { *attr };
    match s.core.modify(
        &SrqAttr {
            max_wr: a.max_wr,
            max_sge: a.max_sge,
            srq_limit: a.srq_limit,
        },
        mask as u32,
    ) {
        Ok(()) => 0,
        Err(e) => errno_of(&e),
    }
}

/// `ibv_query_srq`.
pub(crate) unsafe extern "C" fn query_srq(srq: *mut ibv_srq, attr: *mut ibv_srq_attr) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(s) = (unsafe { outer::<SvSrq, _>(srq) }) else {
        return EINVAL;
    };
    if attr.is_null() {
        return EINVAL;
    }
    let a = s.core.query();
    // SAFETY: `attr` is writable.
    unsafe {
        attr.write(ibv_srq_attr {
            max_wr: a.max_wr,
            max_sge: a.max_sge,
            srq_limit: a.srq_limit,
        });
    };
    0
}

/// `ibv_destroy_srq`.
pub(crate) unsafe extern "C" fn destroy_srq(srq: *mut ibv_srq) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    unsafe { destroy_boxed::<SvSrq, _>(srq, |s| s.core.destroy()) }
}

/// The `get_srq_num` op: XRC SRQs are not offered.
unsafe extern "C" fn get_srq_num(_srq: *mut ibv_srq, _num: *mut u32) -> c_int {
    EOPNOTSUPP
}

/// The `open_xrcd` op: XRC is not offered.
unsafe extern "C" fn open_xrcd(_ctx: *mut ibv_context, _attr: *mut c_void) -> *mut ibv_xrcd {
    fail_null(EOPNOTSUPP)
}

/// The `close_xrcd` op (called without a NULL check by `ibv_close_xrcd`).
unsafe extern "C" fn close_xrcd(_xrcd: *mut ibv_xrcd) -> c_int {
    EOPNOTSUPP
}

/// The `open_qp` op: shareable XRC QPs are not offered.
unsafe extern "C" fn open_qp(_ctx: *mut ibv_context, _attr: *mut c_void) -> *mut ibv_qp {
    fail_null(EOPNOTSUPP)
}

// ---------------------------------------------------------------------------------------------
// Queue pairs.

fn ah_attr_c(a: &AhAttr) -> ibv_ah_attr {
    ibv_ah_attr {
        grh: ibv_global_route {
            dgid: ibv_gid { raw: a.grh.dgid.0 },
            flow_label: a.grh.flow_label,
            sgid_index: a.grh.sgid_index,
            hop_limit: a.grh.hop_limit,
            traffic_class: a.grh.traffic_class,
        },
        dlid: a.dlid,
        sl: a.sl,
        src_path_bits: a.src_path_bits,
        static_rate: a.static_rate,
        is_global: u8::from(a.is_global),
        port_num: a.port_num,
    }
}

fn ah_attr_core(a: &ibv_ah_attr) -> AhAttr {
    AhAttr {
        grh: GlobalRoute {
            dgid: Gid(a.grh.dgid.raw),
            flow_label: a.grh.flow_label,
            sgid_index: a.grh.sgid_index,
            hop_limit: a.grh.hop_limit,
            traffic_class: a.grh.traffic_class,
        },
        dlid: a.dlid,
        sl: a.sl,
        src_path_bits: a.src_path_bits,
        static_rate: a.static_rate,
        is_global: a.is_global != 0,
        port_num: a.port_num,
    }
}

fn cap_c(c: &QpCap) -> ibv_qp_cap {
    ibv_qp_cap {
        max_send_wr: c.max_send_wr,
        max_recv_wr: c.max_recv_wr,
        max_send_sge: c.max_send_sge,
        max_recv_sge: c.max_recv_sge,
        max_inline_data: c.max_inline_data,
    }
}

fn cap_core(c: &ibv_qp_cap) -> QpCap {
    QpCap {
        max_send_wr: c.max_send_wr,
        max_recv_wr: c.max_recv_wr,
        max_send_sge: c.max_send_sge,
        max_recv_sge: c.max_recv_sge,
        max_inline_data: c.max_inline_data,
    }
}

/// Converts the attributes named by `mask`; an enum value out of range in a masked field is
/// EINVAL, fields outside the mask are ignored.
fn qp_attr_core(a: &ibv_qp_attr, mask: QpAttrMask) -> Result<QpAttr, c_int> {
    fn pick<T>(v: Option<T>, masked: bool, default: T) -> Result<T, c_int> {
        match v {
            Some(v) => Ok(v),
            None if masked => Err(EINVAL),
            None => Ok(default),
        }
    }
    let d = QpAttr::default();
    Ok(QpAttr {
        qp_state: pick(
            QpState::from_raw(a.qp_state),
            mask.contains(QpAttrMask::STATE),
            d.qp_state,
        )?,
        cur_qp_state: pick(
            QpState::from_raw(a.cur_qp_state),
            mask.contains(QpAttrMask::CUR_STATE),
            d.cur_qp_state,
        )?,
        path_mtu: pick(
            Mtu::from_raw(a.path_mtu),
            mask.contains(QpAttrMask::PATH_MTU),
            d.path_mtu,
        )?,
        path_mig_state: pick(
            MigState::from_raw(a.path_mig_state),
            mask.contains(QpAttrMask::PATH_MIG_STATE),
            d.path_mig_state,
        )?,
        qkey: a.qkey,
        rq_psn: a.rq_psn,
        sq_psn: a.sq_psn,
        dest_qp_num: a.dest_qp_num,
        qp_access_flags: AccessFlags::from_bits_retain(a.qp_access_flags),
        cap: cap_core(&a.cap),
        ah_attr: ah_attr_core(&a.ah_attr),
        alt_ah_attr: ah_attr_core(&a.alt_ah_attr),
        pkey_index: a.pkey_index,
        alt_pkey_index: a.alt_pkey_index,
        en_sqd_async_notify: a.en_sqd_async_notify != 0,
        sq_draining: a.sq_draining != 0,
        max_rd_atomic: a.max_rd_atomic,
        max_dest_rd_atomic: a.max_dest_rd_atomic,
        min_rnr_timer: a.min_rnr_timer,
        port_num: a.port_num,
        timeout: a.timeout,
        retry_cnt: a.retry_cnt,
        rnr_retry: a.rnr_retry,
        alt_port_num: a.alt_port_num,
        alt_timeout: a.alt_timeout,
        rate_limit: a.rate_limit,
    })
}

fn qp_attr_c(a: &QpAttr) -> ibv_qp_attr {
    ibv_qp_attr {
        qp_state: a.qp_state.raw(),
        cur_qp_state: a.cur_qp_state.raw(),
        path_mtu: a.path_mtu.raw(),
        path_mig_state: a.path_mig_state.raw(),
        qkey: a.qkey,
        rq_psn: a.rq_psn,
        sq_psn: a.sq_psn,
        dest_qp_num: a.dest_qp_num,
        qp_access_flags: a.qp_access_flags.bits(),
        cap: cap_c(&a.cap),
        ah_attr: ah_attr_c(&a.ah_attr),
        alt_ah_attr: ah_attr_c(&a.alt_ah_attr),
        pkey_index: a.pkey_index,
        alt_pkey_index: a.alt_pkey_index,
        en_sqd_async_notify: u8::from(a.en_sqd_async_notify),
        sq_draining: u8::from(a.sq_draining),
        max_rd_atomic: a.max_rd_atomic,
        max_dest_rd_atomic: a.max_dest_rd_atomic,
        min_rnr_timer: a.min_rnr_timer,
        port_num: a.port_num,
        timeout: a.timeout,
        retry_cnt: a.retry_cnt,
        rnr_retry: a.rnr_retry,
        alt_port_num: a.alt_port_num,
        alt_timeout: a.alt_timeout,
        rate_limit: a.rate_limit,
    }
}

/// What `ibv_create_qp` and the `create_qp_ex` op share.
pub(crate) struct NewQp {
    pub(crate) pd: *mut ibv_pd,
    pub(crate) qp_context: *mut c_void,
    pub(crate) send_cq: *mut ibv_cq,
    pub(crate) recv_cq: *mut ibv_cq,
    pub(crate) srq: *mut ibv_srq,
    pub(crate) cap: *mut ibv_qp_cap,
    pub(crate) qp_type: c_uint,
    pub(crate) sq_sig_all: bool,
}

/// Creates a QP box and writes the actual capabilities back into `n.cap`.
pub(crate) unsafe fn new_qp(n: &NewQp) -> Result<*mut SvQp, c_int> {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let pd = unsafe { outer::<SvPd, _>(n.pd) }.ok_or(EINVAL)?;
    let qp_type = match n.qp_type {
        9 | 10 => return Err(EOPNOTSUPP), // IBV_QPT_XRC_SEND, IBV_QPT_XRC_RECV
        t => QpType::from_raw(t).ok_or(EOPNOTSUPP)?,
    };
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let send_cq = unsafe { outer::<SvCq, _>(n.send_cq) }.ok_or(EINVAL)?;
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let recv_cq = unsafe { outer::<SvCq, _>(n.recv_cq) }.ok_or(EINVAL)?;
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let srq = unsafe { outer::<SvSrq, _>(n.srq) };
    if n.cap.is_null() {
        return Err(EINVAL);
    }
    // SAFETY: `cap` is a readable and writable `struct ibv_qp_cap` inside the init attributes.
    let cap = cap_core(unsafe { &*n.cap });
    let init = QpInitAttr {
        qp_type,
        send_cq: Some(send_cq.core.clone()),
        recv_cq: Some(recv_cq.core.clone()),
        srq: srq.map(|s| s.core.clone()),
        cap,
        sq_sig_all: n.sq_sig_all,
    };
    let core = Qp::create(&pd.core, &init).map_err(|e| errno_of(&e))?;
    // SAFETY: as above.
    unsafe { n.cap.write(cap_c(&core.cap())) };
    let qp = ibv_qp {
        // SAFETY: `pd` is live.
        context: unsafe { (*n.pd).context },
        qp_context: n.qp_context,
        pd: n.pd,
        send_cq: n.send_cq,
        recv_cq: n.recv_cq,
        srq: n.srq,
        handle: core.handle(),
        qp_num: core.qpn(),
        state: QpState::Reset.raw(),
        qp_type: n.qp_type,
        mutex: pthread_mutex_t([0; 40]),
        cond: pthread_cond_t([0; 48]),
        events_completed: 0,
    };
    let b = Box::into_raw(Box::new(SvQp {
        qp: datapath::qp_ex(qp),
        core,
        sq_sig_all: n.sq_sig_all,
        batch: Mutex::new(WrBatch::default()),
    }));
    // SAFETY: `b` is live.
    unsafe { (*b).core.set_user_data(b as u64) };
    Ok(b)
}

/// `ibv_create_qp`.
pub(crate) unsafe extern "C" fn create_qp(pd: *mut ibv_pd, init: *mut ibv_qp_init_attr) -> *mut ibv_qp {
    if init.is_null() {
        return fail_null(EINVAL);
    }
    // SAFETY: `init` is a live `struct ibv_qp_init_attr`.
    let n = unsafe {
        NewQp {
            pd,
            qp_context: (*init).qp_context,
            send_cq: (*init).send_cq,
            recv_cq: (*init).recv_cq,
            srq: (*init).srq,
            cap: addr_of_mut!((*init).cap),
            qp_type: (*init).qp_type,
            sq_sig_all: (*init).sq_sig_all != 0,
        }
    };
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    match unsafe { new_qp(&n) } {
        Ok(b) => b.cast(),
        Err(e) => fail_null(e),
    }
}

/// `ibv_modify_qp`: 0 or an errno; nothing changes on error.
pub(crate) unsafe extern "C" fn modify_qp(qp: *mut ibv_qp, attr: *mut ibv_qp_attr, mask: c_int) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(q) = (unsafe { outer::<SvQp, _>(qp) }) else {
        return EINVAL;
    };
    if attr.is_null() {
        return EINVAL;
    }
    let mask = QpAttrMask::from_bits_retain(mask as u32);
    // SAFETY: `attr` is a readable `struct ibv_qp_attr`.
    let a = match qp_attr_core(unsafe { &*attr }, mask) {
        Ok(a) => a,
        Err(e) => return e,
    };
    match q.core.modify(&a, mask) {
        Ok(()) => {
            // SAFETY: `qp` is live; keep the public state in step, as rdma-core does.
            unsafe { (*qp).state = q.core.state().raw() };
            0
        }
        Err(e) => errno_of(&e),
    }
}

/// `ibv_query_qp`: every attribute, and the creation attributes.
pub(crate) unsafe extern "C" fn query_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    _mask: c_int,
    init: *mut ibv_qp_init_attr,
) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(q) = (unsafe { outer::<SvQp, _>(qp) }) else {
        return EINVAL;
    };
    if attr.is_null() || init.is_null() {
        return EINVAL;
    }
    let a = q.core.query();
    // SAFETY: `qp` is live and the out-pointers are writable.
    unsafe {
        attr.write(qp_attr_c(&a));
        (*qp).state = a.qp_state.raw();
        init.write(ibv_qp_init_attr {
            qp_context: (*qp).qp_context,
            send_cq: (*qp).send_cq,
            recv_cq: (*qp).recv_cq,
            srq: (*qp).srq,
            cap: cap_c(&q.core.cap()),
            qp_type: (*qp).qp_type,
            sq_sig_all: c_int::from(q.sq_sig_all),
        });
    }
    0
}

/// `ibv_destroy_qp`.
pub(crate) unsafe extern "C" fn destroy_qp(qp: *mut ibv_qp) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    unsafe { destroy_boxed::<SvQp, _>(qp, |q| q.core.destroy()) }
}

/// `ibv_query_qp_data_in_order`: the device places data in order, whole messages at a time.
pub(crate) extern "C" fn query_qp_data_in_order(_qp: *mut ibv_qp, _op: c_uint, flags: u32) -> c_int {
    const RETURN_CAPS: u32 = 1;
    const WHOLE_MSG: c_int = 1;
    const ALIGNED_128_BYTES: c_int = 2;
    if flags & RETURN_CAPS != 0 {
        WHOLE_MSG | ALIGNED_128_BYTES
    } else {
        1
    }
}

/// `ibv_attach_mcast`.
pub(crate) unsafe extern "C" fn attach_mcast(qp: *mut ibv_qp, gid: *const ibv_gid, lid: u16) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(q) = (unsafe { outer::<SvQp, _>(qp) }) else {
        return EINVAL;
    };
    if gid.is_null() {
        return EINVAL;
    }
    // SAFETY: `gid` is a readable `union ibv_gid`.
    match q.core.attach_mcast(&Gid(unsafe { (*gid).raw }), lid) {
        Ok(()) => 0,
        Err(e) => errno_of(&e),
    }
}

/// `ibv_detach_mcast`.
pub(crate) unsafe extern "C" fn detach_mcast(qp: *mut ibv_qp, gid: *const ibv_gid, lid: u16) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(q) = (unsafe { outer::<SvQp, _>(qp) }) else {
        return EINVAL;
    };
    if gid.is_null() {
        return EINVAL;
    }
    // SAFETY: `gid` is a readable `union ibv_gid`.
    match q.core.detach_mcast(&Gid(unsafe { (*gid).raw }), lid) {
        Ok(()) => 0,
        Err(e) => errno_of(&e),
    }
}

// ---------------------------------------------------------------------------------------------
// Address handles.

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

fn wc_core(wc: &ibv_wc) -> WorkCompletion {
    WorkCompletion {
        wr_id: wc.wr_id,
        status: WcStatus::from_raw(wc.status).unwrap_or(WcStatus::GeneralErr),
        opcode: WcOpcode::from_raw(wc.opcode).unwrap_or(WcOpcode::Recv),
        vendor_err: wc.vendor_err,
        byte_len: wc.byte_len,
        imm_data: wc.imm_data,
        qp_num: wc.qp_num,
        src_qp: wc.src_qp,
        wc_flags: WcFlags::from_bits_truncate(wc.wc_flags),
        pkey_index: wc.pkey_index,
        slid: wc.slid,
        sl: wc.sl,
        dlid_path_bits: wc.dlid_path_bits,
        solicited: false,
    }
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

// ---------------------------------------------------------------------------------------------
// Async events.

/// `ibv_get_async_event`: 0, or -1 with errno (EAGAIN if `async_fd` is non-blocking).
pub(crate) unsafe extern "C" fn get_async_event(ctx: *mut ibv_context, event: *mut ibv_async_event) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { context(ctx) }) else {
        return fail_minus_one(EINVAL);
    };
    if event.is_null() {
        return fail_minus_one(EINVAL);
    }
    let ev = match c.core.get_async_event(None) {
        Ok(ev) => ev,
        Err(e) => return fail_minus_one(errno_of(&e)),
    };
    let element = match &ev.element {
        EventElement::Cq(cq) => ibv_async_event_element {
            cq: cq.user_data() as *mut ibv_cq,
        },
        EventElement::Qp(qp) => ibv_async_event_element {
            qp: qp.user_data() as *mut ibv_qp,
        },
        EventElement::Srq(srq) => ibv_async_event_element {
            srq: srq.user_data() as *mut ibv_srq,
        },
        EventElement::Port(p) => ibv_async_event_element {
            port_num: c_int::from(*p),
        },
        EventElement::Device => ibv_async_event_element { port_num: 0 },
    };
    // SAFETY: `event` is writable.
    unsafe {
        event.write(ibv_async_event {
            element,
            event_type: ev.event_type.raw(),
        });
    };
    0
}

/// `ibv_ack_async_event`.
pub(crate) unsafe extern "C" fn ack_async_event(event: *mut ibv_async_event) {
    if event.is_null() {
        return;
    }
    // SAFETY: `event` is the event `ibv_get_async_event` filled.
    let (element, raw_type) = unsafe { (std::ptr::read(&(*event).element), (*event).event_type) };
    let Some(event_type) = EventType::from_raw(raw_type) else {
        return;
    };
    use EventType as E;
    match event_type {
        E::CqErr => {
            // SAFETY: a CQ event's element is the CQ box, alive until the event is acknowledged.
            let cq = unsafe { element.cq };
            // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
            if let Some(c) = unsafe { outer::<SvCq, _>(cq) } {
                c.core.context().ack_async_event(&AsyncEvent {
                    element: EventElement::Cq(c.core.clone()),
                    event_type,
                });
                // SAFETY: `cq` is live.
                unsafe {
                    bump_locked(
                        addr_of_mut!((*cq).mutex),
                        addr_of_mut!((*cq).cond),
                        addr_of_mut!((*cq).async_events_completed),
                        1,
                    );
                }
            }
        }
        E::QpFatal
        | E::QpReqErr
        | E::QpAccessErr
        | E::CommEst
        | E::SqDrained
        | E::PathMig
        | E::PathMigErr
        | E::QpLastWqeReached => {
            // SAFETY: a QP event's element is the QP box, alive until the event is acknowledged.
            let qp = unsafe { element.qp };
            // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
            if let Some(q) = unsafe { outer::<SvQp, _>(qp) } {
                q.core.context().ack_async_event(&AsyncEvent {
                    element: EventElement::Qp(q.core.clone()),
                    event_type,
                });
                // SAFETY: `qp` is live.
                unsafe {
                    bump_locked(
                        addr_of_mut!((*qp).mutex),
                        addr_of_mut!((*qp).cond),
                        addr_of_mut!((*qp).events_completed),
                        1,
                    );
                }
            }
        }
        E::SrqErr | E::SrqLimitReached => {
            // SAFETY: an SRQ event's element is the SRQ box, alive until acknowledged.
            let srq = unsafe { element.srq };
            // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
            if let Some(s) = unsafe { outer::<SvSrq, _>(srq) } {
                s.core.pd().context().ack_async_event(&AsyncEvent {
                    element: EventElement::Srq(s.core.clone()),
                    event_type,
                });
                // SAFETY: `srq` is live.
                unsafe {
                    bump_locked(
                        addr_of_mut!((*srq).mutex),
                        addr_of_mut!((*srq).cond),
                        addr_of_mut!((*srq).events_completed),
                        1,
                    );
                }
            }
        }
        _ => {}
    }
}

// ---------------------------------------------------------------------------------------------
// Calls that answer "not supported".

/// `ibv_resolve_eth_l2_from_gid`: RoCE v2 is routed over UDP; there is no L2 to resolve.
pub(crate) extern "C" fn resolve_eth_l2_from_gid(
    _ctx: *mut ibv_context,
    _attr: *mut ibv_ah_attr,
    _mac: *mut u8,
    _vid: *mut u16,
) -> c_int {
    EOPNOTSUPP
}

/// Pointer-returning verbs that are not offered: NULL with EOPNOTSUPP.
pub(crate) extern "C" fn null_eopnotsupp() -> *mut c_void {
    fail_null(EOPNOTSUPP)
}

/// Errno-returning verbs that are not offered.
pub(crate) extern "C" fn eopnotsupp() -> c_int {
    EOPNOTSUPP
}

/// Calls with nothing to do.
pub(crate) extern "C" fn nothing() {}

/// The rdma-core 1.0 compatibility entry points take pre-1.1 structures, which no program
/// built against a current header passes: NULL with ENOSYS.
pub(crate) extern "C" fn compat_null() -> *mut c_void {
    fail_null(ENOSYS)
}

/// As [`compat_null`], for the int-returning ones: -1 with ENOSYS.
pub(crate) extern "C" fn compat_fail() -> c_int {
    set_errno(ENOSYS);
    -1
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each C object is the first field of its box, and a device is followed by the 8-byte
    /// `verbs_device.ops` slot providers read.
    #[test]
    fn boxes_start_with_their_c_object() {
        assert_eq!(offset_of!(SvDevice, dev), 0);
        assert_eq!(offset_of!(SvDevice, ops), 664);
        assert_eq!(offset_of!(SvContext, vctx), 0);
        assert_eq!(
            offset_of!(SvContext, vctx) + offset_of!(verbs_context, context),
            320
        );
        assert_eq!(offset_of!(SvPd, pd), 0);
        assert_eq!(offset_of!(SvMr, mr), 0);
        assert_eq!(offset_of!(SvChannel, ch), 0);
        assert_eq!(offset_of!(SvCq, cq), 0);
        assert_eq!(offset_of!(SvSrq, srq), 0);
        assert_eq!(offset_of!(SvQp, qp), 0);
        assert_eq!(offset_of!(SvAh, ah), 0);
        assert_eq!(VERBS_CONTEXT_SIZE, 648);
    }

    #[test]
    fn qp_attr_enums_are_checked_only_when_masked() {
        let mut a = ibv_qp_attr {
            qp_state: 99,
            path_mtu: 42,
            ..Default::default()
        };
        assert_eq!(qp_attr_core(&a, QpAttrMask::STATE).unwrap_err(), EINVAL);
        assert!(qp_attr_core(&a, QpAttrMask::QKEY).is_ok());
        a.qp_state = QpState::Init.raw();
        assert_eq!(
            qp_attr_core(&a, QpAttrMask::STATE | QpAttrMask::PATH_MTU).unwrap_err(),
            EINVAL
        );
        let core = qp_attr_core(&a, QpAttrMask::STATE).unwrap();
        assert_eq!(core.qp_state, QpState::Init);
        assert_eq!(qp_attr_c(&core).qp_state, QpState::Init.raw());
    }
}
