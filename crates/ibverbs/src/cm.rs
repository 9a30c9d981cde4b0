//! The connection manager's C entry points, reached by `librdmacm.so.1` through the private
//! table `softverbs_rdmacm_ops@@SOFTVERBS_PRIVATE_1`.
//!
//! They live here because the ids' `verbs`, `pd`, `qp` and CQ fields must be this library's
//! objects, and the core QP behind an `ibv_qp` is what the CM core moves through its states: a
//! second copy of the core in `librdmacm.so.1` would have its own devices and QP tables. Each C
//! object is a `repr(C)` box whose first field is the struct C sees and which holds the core
//! `Arc`, as for the verbs; the semantics are `softverbs_device::cm`'s.

// The mirrors are defined once, in crates/rdmacm, and compiled into both libraries.
#[path = "../../rdmacm/src/abi.rs"]
#[allow(dead_code, unreachable_pub)]
mod rdmacm_abi;

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::mem::size_of;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::sync::{Arc, Mutex, OnceLock};

use softverbs_device::cm as ccm;
use softverbs_engine::types::{Gid, QpState};

use crate::abi::{ibv_context, ibv_pd, ibv_qp, ibv_qp_attr, ibv_qp_init_attr};
use crate::verbs::{self as v, errno_of, outer, SvQp};
use crate::{fail_minus_one, fail_null, set_errno};
use rdmacm_abi::*;

/// `struct rdma_event_channel` and its core channel.
#[repr(C)]
struct SvCmChannel {
    ch: rdma_event_channel,
    core: Arc<ccm::EventChannel>,
}

/// `struct rdma_cm_id` and its core id.
#[repr(C)]
struct SvCmId {
    id: rdma_cm_id,
    core: Arc<ccm::CmId>,
    /// The contexts given to `rdma_join_multicast` per group GID: the MULTICAST_JOIN and
    /// MULTICAST_ERROR events carry them in `param.ud.private_data`, as in librdmacm.
    mc_contexts: Vec<(Gid, usize)>,
    /// For a listener made by `rdma_create_ep`: the PD and QP attributes `rdma_get_request`
    /// gives the ids it returns.
    qp_init: Option<(usize, ibv_qp_init_attr)>,
}

/// `struct rdma_cm_event`, the core event (acknowledged when the box is freed) and the private
/// data `param.conn.private_data` points at.
#[repr(C)]
struct SvCmEvent {
    ev: rdma_cm_event,
    core: ccm::CmEvent,
    private: Vec<u8>,
}

/// Address-keyed maps from core objects to their C boxes (pointers stored as `usize`).
#[derive(Default)]
struct Maps {
    /// Core id → `SvCmId`.
    ids: HashMap<usize, usize>,
    /// Core channel → `SvCmChannel`.
    channels: HashMap<usize, usize>,
    /// Device name → the `ibv_context` this library opened for the CM (`rdma_get_devices`).
    contexts: HashMap<String, usize>,
    /// `ibv_context` → the PD `rdma_create_qp` uses when given none.
    pds: HashMap<usize, usize>,
    /// `ibv_context` → the XRC domain `rdma_create_srq_ex` uses when given none.
    xrcds: HashMap<usize, usize>,
}

fn maps() -> std::sync::MutexGuard<'static, Maps> {
    static MAPS: OnceLock<Mutex<Maps>> = OnceLock::new();
    MAPS.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

fn key<T>(a: &Arc<T>) -> usize {
    Arc::as_ptr(a) as usize
}

/// The context of `dev` this library keeps open for CM ids, opened on first use.
fn context_for(dev: &softverbs_device::Device) -> *mut ibv_context {
    if let Some(&c) = maps().contexts.get(dev.name()) {
        return c as *mut ibv_context;
    }
    let sv = v::sv_device(dev);
    // SAFETY: `sv` is a live device box of this library's registry (never freed).
    let ctx = unsafe { v::open_device(sv.cast()) };
    if ctx.is_null() {
        return ctx;
    }
    let mut m = maps();
    // Another thread may have opened one meanwhile: keep the first, as ids already point at it.
    if let Some(&c) = m.contexts.get(dev.name()) {
        // SAFETY: `ctx` was just opened and nothing else refers to it.
        unsafe { v::close_device(ctx) };
        return c as *mut ibv_context;
    }
    m.contexts.insert(dev.name().to_string(), ctx as usize);
    ctx
}

/// A C address as a socket address (IPv4 or IPv6).
///
/// # Safety
/// `sa` is NULL or points at a `sockaddr` of its family's size.
pub(crate) unsafe fn sock_addr(sa: *const libc::sockaddr) -> Option<SocketAddr> {
    if sa.is_null() {
        return None;
    }
    // SAFETY: the caller's pointer is a valid sockaddr; the family says which struct it is.
    unsafe {
        match c_int::from((*sa).sa_family) {
            libc::AF_INET => {
                let s = &*sa.cast::<libc::sockaddr_in>();
                Some(SocketAddr::V4(SocketAddrV4::new(
                    Ipv4Addr::from(u32::from_be(s.sin_addr.s_addr)),
                    u16::from_be(s.sin_port),
                )))
            }
            libc::AF_INET6 => {
                let s = &*sa.cast::<libc::sockaddr_in6>();
                Some(SocketAddr::V6(SocketAddrV6::new(
                    Ipv6Addr::from(s.sin6_addr.s6_addr),
                    u16::from_be(s.sin6_port),
                    s.sin6_flowinfo,
                    s.sin6_scope_id,
                )))
            }
            _ => None,
        }
    }
}

/// Writes `addr` into a `sockaddr_storage`.
pub(crate) fn store_addr(out: &mut libc::sockaddr_storage, addr: Option<SocketAddr>) {
    // SAFETY: all-zero is a valid sockaddr_storage.
    *out = unsafe { std::mem::zeroed() };
    match addr {
        Some(SocketAddr::V4(a)) => {
            let s = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from(*a.ip()).to_be(),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: a sockaddr_in fits in, and is less aligned than, a sockaddr_storage.
            unsafe { std::ptr::write((out as *mut libc::sockaddr_storage).cast(), s) };
        }
        Some(SocketAddr::V6(a)) => {
            // SAFETY: all-zero is a valid sockaddr_in6.
            let mut s: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
            s.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            s.sin6_port = a.port().to_be();
            s.sin6_addr.s6_addr = a.ip().octets();
            s.sin6_flowinfo = a.flowinfo();
            s.sin6_scope_id = a.scope_id();
            // SAFETY: as above, for sockaddr_in6.
            unsafe { std::ptr::write((out as *mut libc::sockaddr_storage).cast(), s) };
        }
        None => {}
    }
}

/// Brings the C id's public fields up to date with the core id: device context, port,
/// addresses and GIDs.
fn refresh(b: &mut SvCmId) {
    let core = &b.core;
    if let Some(dev) = core.device() {
        if b.id.verbs.is_null() {
            b.id.verbs = context_for(&dev).cast();
        }
        b.id.port_num = core.port_num();
        let sgid = dev
            .gid_table()
            .get(usize::from(core.sgid_index()))
            .copied()
            .unwrap_or(Gid([0; 16]));
        b.id.route.addr.addr.sgid.raw = sgid.0;
    }
    let (src, dst) = (core.src_addr(), core.dst_addr());
    store_addr(&mut b.id.route.addr.src_addr, src);
    store_addr(&mut b.id.route.addr.dst_addr, dst);
    if let Some(d) = dst {
        b.id.route.addr.addr.dgid.raw = Gid::from_ip(d.ip()).0;
        b.id.route.num_paths = 1;
    }
    b.id.route.addr.addr.pkey = 0xffff_u16.to_be();
}

/// The C box of core id `core`, made (reporting to `channel`, with `context`) if it has none.
fn c_id(core: &Arc<ccm::CmId>, channel: *mut rdma_event_channel, context: *mut c_void) -> *mut SvCmId {
    // One lock over the lookup and the insertion: two threads reading events of one new id
    // must get the same box.
    let mut m = maps();
    if let Some(&p) = m.ids.get(&key(core)) {
        return p as *mut SvCmId;
    }
    let ps = c_int::from(core.port_space().value());
    let qp_type = if ps == 0x0111 || ps == 0x0002 { 4 } else { 2 }; // IBV_QPT_UD : IBV_QPT_RC
                                                                    // SAFETY: all-zero is a valid rdma_cm_id (null pointers, empty addresses).
    let mut id: rdma_cm_id = unsafe { std::mem::zeroed() };
    id.channel = channel;
    id.context = context;
    id.ps = ps;
    id.qp_type = qp_type;
    let p = Box::into_raw(Box::new(SvCmId {
        id,
        core: core.clone(),
        mc_contexts: Vec::new(),
        qp_init: None,
    }));
    m.ids.insert(key(core), p as usize);
    p
}

/// The box of a C id.
///
/// # Safety
/// `id` is NULL or an id this library made and has not destroyed.
unsafe fn id_box<'a>(id: *mut rdma_cm_id) -> Option<&'a mut SvCmId> {
    // SAFETY: the id is the first field of its `repr(C)` box.
    unsafe { id.cast::<SvCmId>().as_mut() }
}

fn result(r: softverbs_engine::Result<()>) -> c_int {
    match r {
        Ok(()) => 0,
        Err(e) => fail_minus_one(errno_of(&e)),
    }
}

unsafe extern "C" fn create_event_channel() -> *mut rdma_event_channel {
    match ccm::EventChannel::new() {
        Ok(core) => {
            let fd = core.fd();
            let k = key(&core);
            let p = Box::into_raw(Box::new(SvCmChannel {
                ch: rdma_event_channel { fd },
                core,
            }));
            maps().channels.insert(k, p as usize);
            p.cast()
        }
        Err(e) => fail_null(errno_of(&e)),
    }
}

unsafe extern "C" fn destroy_event_channel(ch: *mut rdma_event_channel) {
    if ch.is_null() {
        return;
    }
    // SAFETY: the channel is the first field of a box this library made.
    let b = unsafe { Box::from_raw(ch.cast::<SvCmChannel>()) };
    maps().channels.remove(&key(&b.core));
}

/// The core channel behind a C channel.
///
/// # Safety
/// `ch` is a live channel of this library.
unsafe fn channel_core(ch: *mut rdma_event_channel) -> Option<Arc<ccm::EventChannel>> {
    // SAFETY: as the function's contract says.
    unsafe { ch.cast::<SvCmChannel>().as_ref() }.map(|c| c.core.clone())
}

unsafe extern "C" fn create_id(
    ch: *mut rdma_event_channel,
    out: *mut *mut rdma_cm_id,
    context: *mut c_void,
    ps: c_int,
) -> c_int {
    if out.is_null() {
        return fail_minus_one(libc::EINVAL);
    }
    let Some(space) = u16::try_from(ps).ok().and_then(ccm::PortSpace::from_value) else {
        return fail_minus_one(libc::EINVAL);
    };
    // SAFETY: `ch` is NULL or a channel of this library (the API contract).
    let chan = unsafe { channel_core(ch) };
    match ccm::CmId::create(chan.as_ref(), space) {
        Ok(core) => {
            let b = c_id(&core, ch, context);
            // SAFETY: `out` is the caller's valid out pointer.
            unsafe { *out = b.cast() };
            0
        }
        Err(e) => fail_minus_one(errno_of(&e)),
    }
}

unsafe extern "C" fn destroy_id(id: *mut rdma_cm_id) -> c_int {
    if id.is_null() {
        return fail_minus_one(libc::EINVAL);
    }
    // The core drops the id's undelivered events and waits until the delivered ones are
    // acknowledged; only then is the box unreachable. Freed earlier, a thread still reading an
    // event of this id would get a fresh box without the caller's context.
    // SAFETY: the id is the first field of a live box this library made.
    unsafe { (*id.cast::<SvCmId>()).core.destroy() };
    // SAFETY: as above; the caller gives the id up.
    let b = unsafe { Box::from_raw(id.cast::<SvCmId>()) };
    maps().ids.remove(&key(&b.core));
    0
}

unsafe extern "C" fn bind_addr(id: *mut rdma_cm_id, addr: *mut libc::sockaddr) -> c_int {
    // SAFETY: the API contract: a live id and a valid address.
    let (Some(b), Some(a)) = (unsafe { id_box(id) }, unsafe { sock_addr(addr) }) else {
        return fail_minus_one(libc::EINVAL);
    };
    let r = b.core.bind_addr(a);
    refresh(b);
    result(r)
}

unsafe extern "C" fn resolve_addr(
    id: *mut rdma_cm_id,
    src: *mut libc::sockaddr,
    dst: *mut libc::sockaddr,
    timeout_ms: c_int,
) -> c_int {
    // SAFETY: the API contract: a live id, valid addresses (src may be NULL).
    let (Some(b), Some(d)) = (unsafe { id_box(id) }, unsafe { sock_addr(dst) }) else {
        return fail_minus_one(libc::EINVAL);
    };
    // SAFETY: as above.
    let s = unsafe { sock_addr(src) };
    let r = b.core.resolve_addr(s, d, timeout_ms.max(0) as u32);
    refresh(b);
    result(r)
}

unsafe extern "C" fn resolve_route(id: *mut rdma_cm_id, timeout_ms: c_int) -> c_int {
    // SAFETY: the API contract: a live id.
    let Some(b) = (unsafe { id_box(id) }) else {
        return fail_minus_one(libc::EINVAL);
    };
    let r = b.core.resolve_route(timeout_ms.max(0) as u32);
    refresh(b);
    result(r)
}

unsafe extern "C" fn listen(id: *mut rdma_cm_id, backlog: c_int) -> c_int {
    // SAFETY: the API contract: a live id.
    let Some(b) = (unsafe { id_box(id) }) else {
        return fail_minus_one(libc::EINVAL);
    };
    let r = b.core.listen(backlog);
    refresh(b);
    result(r)
}

/// A C `rdma_conn_param` as the core's. NULL asks, as in librdmacm, for the device's maximum
/// RDMA READ resources (the core lowers them to what the peer offers) and 7 retries.
///
/// # Safety
/// `p` is NULL or valid, with `private_data_len` readable bytes at `private_data`.
unsafe fn conn_param(p: *const rdma_conn_param) -> ccm::ConnParam {
    // SAFETY: the function's contract.
    let Some(p) = (unsafe { p.as_ref() }) else {
        return ccm::ConnParam {
            responder_resources: 0xFF,
            initiator_depth: 0xFF,
            retry_count: 7,
            rnr_retry_count: 7,
            ..ccm::ConnParam::default()
        };
    };
    let private_data = if p.private_data.is_null() || p.private_data_len == 0 {
        Vec::new()
    } else {
        // SAFETY: the caller says `private_data_len` bytes are readable there.
        unsafe { std::slice::from_raw_parts(p.private_data.cast::<u8>(), usize::from(p.private_data_len)) }
            .to_vec()
    };
    ccm::ConnParam {
        private_data,
        responder_resources: p.responder_resources,
        initiator_depth: p.initiator_depth,
        flow_control: p.flow_control,
        retry_count: p.retry_count,
        rnr_retry_count: p.rnr_retry_count,
        srq: p.srq,
        qp_num: p.qp_num,
    }
}

unsafe extern "C" fn connect(id: *mut rdma_cm_id, p: *mut rdma_conn_param) -> c_int {
    // SAFETY: the API contract: a live id and a valid (or NULL) parameter block.
    let (Some(b), param) = (unsafe { id_box(id) }, unsafe { conn_param(p) }) else {
        return fail_minus_one(libc::EINVAL);
    };
    result(b.core.connect(&param))
}

unsafe extern "C" fn accept(id: *mut rdma_cm_id, p: *mut rdma_conn_param) -> c_int {
    // SAFETY: as for `connect`.
    let (Some(b), param) = (unsafe { id_box(id) }, unsafe { conn_param(p) }) else {
        return fail_minus_one(libc::EINVAL);
    };
    result(b.core.accept(&param))
}

unsafe extern "C" fn reject(id: *mut rdma_cm_id, data: *const c_void, len: u8) -> c_int {
    // SAFETY: the API contract: a live id.
    let Some(b) = (unsafe { id_box(id) }) else {
        return fail_minus_one(libc::EINVAL);
    };
    // SAFETY: the caller gives `len` readable bytes at `data`.
    result(b.core.reject(unsafe { private_slice(data, len) }))
}

/// The caller's `len` bytes of private data at `data` (none for NULL).
///
/// # Safety
/// `data` is NULL or points at `len` readable bytes that outlive the returned slice's use.
unsafe fn private_slice<'a>(data: *const c_void, len: u8) -> &'a [u8] {
    if data.is_null() || len == 0 {
        &[]
    } else {
        // SAFETY: the caller's guarantee.
        unsafe { std::slice::from_raw_parts(data.cast::<u8>(), usize::from(len)) }
    }
}

/// `rdma_reject_ece`: a rejection with reason 35 (the offered ECE values are refused).
unsafe extern "C" fn reject_ece(id: *mut rdma_cm_id, data: *const c_void, len: u8) -> c_int {
    // SAFETY: the API contract: a live id.
    let Some(b) = (unsafe { id_box(id) }) else {
        return fail_minus_one(libc::EINVAL);
    };
    // SAFETY: the caller gives `len` readable bytes at `data`.
    result(b.core.reject_ece(unsafe { private_slice(data, len) }))
}

/// `rdma_set_local_ece`: for ids whose QP the application manages itself (EINVAL with a QP of
/// the id, a zero vendor ID or an unknown `comp_mask`, as librdmacm).
unsafe extern "C" fn set_local_ece(id: *mut rdma_cm_id, ece: *mut ibv_ece) -> c_int {
    // SAFETY: the API contract: a live id and a readable `ibv_ece` (or NULL).
    let (Some(b), Some(e)) = (unsafe { id_box(id) }, unsafe { ece.as_ref() }) else {
        return fail_minus_one(libc::EINVAL);
    };
    if !b.id.qp.is_null() || e.vendor_id == 0 || e.comp_mask != 0 {
        return fail_minus_one(libc::EINVAL);
    }
    b.core.set_local_ece(ccm::Ece {
        vendor_id: e.vendor_id,
        options: e.options,
    });
    0
}

/// `rdma_get_remote_ece`: the peer's ECE values (EINVAL for an id with a QP of its own).
unsafe extern "C" fn get_remote_ece(id: *mut rdma_cm_id, ece: *mut ibv_ece) -> c_int {
    // SAFETY: the API contract: a live id and a writable `ibv_ece` (or NULL).
    let (Some(b), Some(e)) = (unsafe { id_box(id) }, unsafe { ece.as_mut() }) else {
        return fail_minus_one(libc::EINVAL);
    };
    if !b.id.qp.is_null() {
        return fail_minus_one(libc::EINVAL);
    }
    let r = b.core.remote_ece();
    *e = ibv_ece {
        vendor_id: r.vendor_id,
        options: r.options,
        comp_mask: 0,
    };
    0
}

unsafe extern "C" fn disconnect(id: *mut rdma_cm_id) -> c_int {
    // SAFETY: the API contract: a live id.
    let Some(b) = (unsafe { id_box(id) }) else {
        return fail_minus_one(libc::EINVAL);
    };
    result(b.core.disconnect())
}

unsafe extern "C" fn establish(id: *mut rdma_cm_id) -> c_int {
    // SAFETY: the API contract: a live id.
    let Some(b) = (unsafe { id_box(id) }) else {
        return fail_minus_one(libc::EINVAL);
    };
    result(b.core.establish())
}

unsafe extern "C" fn notify(id: *mut rdma_cm_id, event: c_int) -> c_int {
    // SAFETY: the API contract: a live id.
    let Some(b) = (unsafe { id_box(id) }) else {
        return fail_minus_one(libc::EINVAL);
    };
    // Only IBV_EVENT_COMM_EST (1) means anything to the CM, as in librdmacm.
    if event != 1 {
        return 0;
    }
    result(b.core.notify_established())
}

unsafe extern "C" fn get_cm_event(ch: *mut rdma_event_channel, out: *mut *mut rdma_cm_event) -> c_int {
    // SAFETY: the API contract: a live channel of this library.
    let Some(chan) = (unsafe { channel_core(ch) }) else {
        return fail_minus_one(libc::EINVAL);
    };
    if out.is_null() {
        return fail_minus_one(libc::EINVAL);
    }
    let core = match chan.get_event(None) {
        Ok(e) => e,
        Err(e) => return fail_minus_one(errno_of(&e)),
    };
    let listen = core
        .listen_id
        .as_ref()
        .map(|l| maps().ids.get(&key(l)).copied().unwrap_or(0) as *mut SvCmId);
    let (channel, context) = match listen {
        // SAFETY: a listener's box lives until its id is destroyed, which waits for this event's
        // acknowledgement.
        Some(lp) if !lp.is_null() => unsafe { ((*lp).id.channel, (*lp).id.context) },
        _ => (ch, std::ptr::null_mut()),
    };
    let idp = c_id(&core.id, channel, context);
    // SAFETY: `idp` is a live id box; events of one id are handled by one reader at a time.
    refresh(unsafe { &mut *idp });
    // SAFETY: all-zero is a valid rdma_cm_event.
    let mut ev: rdma_cm_event = unsafe { std::mem::zeroed() };
    ev.id = idp.cast();
    ev.listen_id = listen.unwrap_or(std::ptr::null_mut()).cast();
    ev.event = core.event as c_int;
    ev.status = core.status;
    let private = match &core.param {
        ccm::EventParam::Conn(c) => {
            ev.param.conn = rdma_conn_param {
                private_data: std::ptr::null(),
                private_data_len: c.private_data.len().min(255) as u8,
                responder_resources: c.responder_resources,
                initiator_depth: c.initiator_depth,
                flow_control: c.flow_control,
                retry_count: c.retry_count,
                rnr_retry_count: c.rnr_retry_count,
                srq: c.srq,
                qp_num: c.qp_num,
            };
            c.private_data.clone()
        }
        ccm::EventParam::Ud(u) => {
            let ah = v::ah_attr_c(&u.ah_attr);
            ev.param.ud = rdma_ud_param {
                private_data: std::ptr::null(),
                private_data_len: u.private_data.len().min(255) as u8,
                // SAFETY: both are `struct ibv_ah_attr` mirrors of one layout (checked against
                // verbs.h and rdma_cma.h by the two crates' layout tests).
                ah_attr: unsafe { std::mem::transmute::<crate::abi::ibv_ah_attr, ibv_ah_attr>(ah) },
                qp_num: u.qp_num,
                qkey: u.qkey,
            };
            if matches!(
                core.event,
                ccm::CmEventType::MulticastJoin | ccm::CmEventType::MulticastError
            ) {
                // SAFETY: `idp` is a live id box.
                let ctxs = unsafe { &(*idp).mc_contexts };
                if let Some((_, c)) = ctxs.iter().find(|(g, _)| *g == u.ah_attr.grh.dgid) {
                    ev.param.ud.private_data = *c as *const c_void;
                }
                Vec::new()
            } else {
                u.private_data.clone()
            }
        }
        ccm::EventParam::None => Vec::new(),
    };
    let mut b = Box::new(SvCmEvent { ev, core, private });
    if !b.private.is_empty() {
        // The pointer is the same in both union arms; it points into the box's own vector.
        b.ev.param.conn.private_data = b.private.as_ptr().cast();
    }
    let p = Box::into_raw(b);
    // SAFETY: `idp` is a live id box.
    unsafe { (*idp).id.event = p.cast() };
    // SAFETY: `out` is the caller's valid out pointer.
    unsafe { *out = p.cast() };
    0
}

unsafe extern "C" fn ack_cm_event(ev: *mut rdma_cm_event) -> c_int {
    if ev.is_null() {
        return fail_minus_one(libc::EINVAL);
    }
    // SAFETY: the event is the first field of a box `get_cm_event` made; the caller gives it up.
    let b = unsafe { Box::from_raw(ev.cast::<SvCmEvent>()) };
    if let Some(&p) = maps().ids.get(&key(&b.core.id)) {
        let idp = p as *mut SvCmId;
        // SAFETY: a live id box; its `event` is cleared only if it still names this event.
        unsafe {
            if (*idp).id.event == ev {
                (*idp).id.event = std::ptr::null_mut();
            }
        }
    }
    b.core.ack();
    0
}

/// The PD `rdma_create_qp` uses on `ctx` when given none (allocated once per context).
fn default_pd(ctx: *mut ibv_context) -> *mut ibv_pd {
    if let Some(&p) = maps().pds.get(&(ctx as usize)) {
        return p as *mut ibv_pd;
    }
    // SAFETY: `ctx` is a context this library opened and keeps open.
    let pd = unsafe { v::alloc_pd(ctx) };
    if !pd.is_null() {
        maps().pds.insert(ctx as usize, pd as usize);
    }
    pd
}

unsafe extern "C" fn create_qp(id: *mut rdma_cm_id, pd: *mut c_void, attr: *mut c_void) -> c_int {
    // SAFETY: the API contract: a live id and a valid `ibv_qp_init_attr`.
    let (Some(b), Some(init)) = (unsafe { id_box(id) }, unsafe {
        attr.cast::<ibv_qp_init_attr>().as_mut()
    }) else {
        return fail_minus_one(libc::EINVAL);
    };
    let mut pd = pd.cast::<ibv_pd>();
    if pd.is_null() {
        if b.id.verbs.is_null() {
            return fail_minus_one(libc::EINVAL);
        }
        pd = default_pd(b.id.verbs.cast());
        if pd.is_null() {
            return -1;
        }
    }
    // SAFETY: `pd` is a PD of this library (the caller's, or the default one).
    if !b.id.verbs.is_null() && unsafe { (*pd).context } != b.id.verbs.cast() {
        return fail_minus_one(libc::EINVAL);
    }
    if !ensure_cqs(b, &mut init.send_cq, &mut init.recv_cq, &init.cap) {
        return -1;
    }
    // SAFETY: `pd` and `init` are valid, as above.
    let qp = unsafe { v::create_qp(pd, init) };
    adopt_qp(b, qp, pd)
}

/// Makes the CQs the caller left out, each with its completion channel, as librdmacm does
/// (`rdma_get_send_comp`/`rdma_get_recv_comp` wait on them); false (errno set) on failure.
fn ensure_cqs(
    b: &mut SvCmId,
    send_cq: &mut *mut crate::abi::ibv_cq,
    recv_cq: &mut *mut crate::abi::ibv_cq,
    cap: &crate::abi::ibv_qp_cap,
) -> bool {
    ensure_cq(b, true, send_cq, cap.max_send_wr) && ensure_cq(b, false, recv_cq, cap.max_recv_wr)
}

/// Makes the id's send or receive CQ (`depth` entries, with its completion channel) if `slot`
/// is NULL, and puts it there; false (errno set) on failure.
fn ensure_cq(b: &mut SvCmId, send: bool, slot: &mut *mut crate::abi::ibv_cq, depth: u32) -> bool {
    if !slot.is_null() {
        return true;
    }
    let ctx = b.id.verbs.cast::<ibv_context>();
    // SAFETY: `ctx` is this library's open context.
    let ch = unsafe { v::create_comp_channel(ctx) };
    if ch.is_null() {
        return false;
    }
    // SAFETY: as above, with the channel just made.
    let cq = unsafe { v::create_cq(ctx, depth.max(1) as c_int, b as *mut SvCmId as *mut c_void, ch, 0) };
    if cq.is_null() {
        // SAFETY: the channel was just made and has no CQ.
        unsafe { v::destroy_comp_channel(ch) };
        return false;
    }
    *slot = cq;
    if send {
        b.id.send_cq_channel = ch.cast();
        b.id.send_cq = cq.cast();
    } else {
        b.id.recv_cq_channel = ch.cast();
        b.id.recv_cq = cq.cast();
    }
    true
}

/// Makes `qp` (just created, or NULL with errno set) the id's QP, moved as librdmacm does.
fn adopt_qp(b: &mut SvCmId, qp: *mut ibv_qp, pd: *mut ibv_pd) -> c_int {
    if qp.is_null() {
        return -1;
    }
    // SAFETY: `qp` was just made by this library: the first field of an `SvQp`.
    let core = match unsafe { outer::<SvQp, _>(qp.cast::<crate::abi::ibv_qp_ex>()) } {
        Some(q) => q.core.clone(),
        None => return fail_minus_one(libc::EINVAL),
    };
    if let Err(e) = b.core.attach_qp(&core) {
        // SAFETY: the QP was made above and nothing else refers to it yet.
        unsafe { v::destroy_qp(qp) };
        return fail_minus_one(errno_of(&e));
    }
    b.id.qp = qp.cast();
    b.id.pd = pd.cast();
    0
}

/// `rdma_create_qp_ex`: as `rdma_create_qp`, from `ibv_qp_init_attr_ex` (its PD, or the
/// default one when `IBV_QP_INIT_ATTR_PD` is not set).
unsafe extern "C" fn create_qp_ex(id: *mut rdma_cm_id, attr: *mut c_void) -> c_int {
    // SAFETY: the API contract: a live id and a valid `ibv_qp_init_attr_ex`.
    let (Some(b), Some(a)) = (unsafe { id_box(id) }, unsafe {
        attr.cast::<crate::abi::ibv_qp_init_attr_ex>().as_mut()
    }) else {
        return fail_minus_one(libc::EINVAL);
    };
    if b.id.verbs.is_null() {
        return fail_minus_one(libc::EINVAL);
    }
    if a.comp_mask & crate::abi::IBV_QP_INIT_ATTR_PD == 0 || a.pd.is_null() {
        a.pd = default_pd(b.id.verbs.cast());
        if a.pd.is_null() {
            return -1;
        }
        a.comp_mask |= crate::abi::IBV_QP_INIT_ATTR_PD;
    }
    // SAFETY: `a.pd` is a PD of this library.
    if unsafe { (*a.pd).context } != b.id.verbs.cast() {
        return fail_minus_one(libc::EINVAL);
    }
    let cap = a.cap;
    if !ensure_cqs(b, &mut a.send_cq, &mut a.recv_cq, &cap) {
        return -1;
    }
    let pd = a.pd;
    // SAFETY: the context and attributes are valid, as above.
    let qp = unsafe { crate::datapath::create_qp_ex(b.id.verbs.cast(), a) };
    adopt_qp(b, qp, pd)
}

unsafe extern "C" fn destroy_qp(id: *mut rdma_cm_id) {
    // SAFETY: the API contract: a live id.
    let Some(b) = (unsafe { id_box(id) }) else {
        return;
    };
    b.core.detach_qp();
    let qp = std::mem::replace(&mut b.id.qp, std::ptr::null_mut()).cast::<ibv_qp>();
    if !qp.is_null() {
        // SAFETY: the id's QP was made by `create_qp` and the id no longer refers to it.
        unsafe { v::destroy_qp(qp) };
    }
    destroy_cqs(b);
}

/// Destroys the CQs and completion channels made for the id (by `ensure_cq`).
fn destroy_cqs(b: &mut SvCmId) {
    for cq in [
        std::mem::replace(&mut b.id.send_cq, std::ptr::null_mut()),
        std::mem::replace(&mut b.id.recv_cq, std::ptr::null_mut()),
    ] {
        if !cq.is_null() {
            // SAFETY: CQs `create_qp` made for the id, used by nothing else now.
            unsafe { v::destroy_cq(cq.cast()) };
        }
    }
    for ch in [
        std::mem::replace(&mut b.id.send_cq_channel, std::ptr::null_mut()),
        std::mem::replace(&mut b.id.recv_cq_channel, std::ptr::null_mut()),
    ] {
        if !ch.is_null() {
            // SAFETY: their CQs were destroyed just above.
            unsafe { v::destroy_comp_channel(ch.cast()) };
        }
    }
}

unsafe extern "C" fn init_qp_attr(id: *mut rdma_cm_id, attr: *mut c_void, mask: *mut c_int) -> c_int {
    // SAFETY: the API contract: a live id and valid out pointers.
    let (Some(b), Some(out), Some(m)) = (
        unsafe { id_box(id) },
        unsafe { attr.cast::<ibv_qp_attr>().as_mut() },
        unsafe { mask.as_mut() },
    ) else {
        return fail_minus_one(libc::EINVAL);
    };
    let state = match out.qp_state {
        1 => QpState::Init,
        2 => QpState::Rtr,
        3 => QpState::Rts,
        _ => return fail_minus_one(libc::EINVAL),
    };
    match b.core.init_qp_attr(state) {
        Ok((a, am)) => {
            *out = v::qp_attr_c(&a);
            *m = am.bits() as c_int;
            0
        }
        Err(e) => fail_minus_one(errno_of(&e)),
    }
}

unsafe extern "C" fn set_option(
    id: *mut rdma_cm_id,
    level: c_int,
    name: c_int,
    val: *mut c_void,
    len: usize,
) -> c_int {
    // SAFETY: the API contract: a live id.
    let Some(b) = (unsafe { id_box(id) }) else {
        return fail_minus_one(libc::EINVAL);
    };
    if val.is_null() {
        return fail_minus_one(libc::EINVAL);
    }
    match (level, name) {
        // RDMA_OPTION_ID_TOS and RDMA_OPTION_ID_ACK_TIMEOUT: a uint8_t.
        (0, 0) | (0, 3) if len == 1 => {
            // SAFETY: `len` readable bytes at `val`.
            let x = unsafe { *val.cast::<u8>() };
            if name == 0 {
                b.core.set_tos(x);
            } else {
                b.core.set_ack_timeout(x);
            }
            0
        }
        // RDMA_OPTION_ID_REUSEADDR and AFONLY: an int, accepted (ports are not reused across
        // ids here, and every IPv6 id is IPv6-only).
        (0, 1) | (0, 2) if len == size_of::<c_int>() => 0,
        (0, _) | (1, _) => fail_minus_one(libc::EINVAL),
        _ => fail_minus_one(libc::ENOSYS),
    }
}

unsafe extern "C" fn migrate_id(id: *mut rdma_cm_id, ch: *mut rdma_event_channel) -> c_int {
    // SAFETY: the API contract: a live id and a channel of this library (or NULL).
    let (Some(b), chan) = (unsafe { id_box(id) }, unsafe { channel_core(ch) }) else {
        return fail_minus_one(libc::EINVAL);
    };
    let r = b.core.migrate(chan.as_ref());
    if r.is_ok() {
        b.id.channel = ch;
    }
    result(r)
}

unsafe extern "C" fn get_devices(num: *mut c_int) -> *mut *mut c_void {
    let list = match softverbs_device::device_list() {
        Ok(l) => l,
        Err(e) => return fail_null(errno_of(&e)),
    };
    let ctxs: Vec<*mut ibv_context> = list.iter().map(context_for).filter(|c| !c.is_null()).collect();
    // SAFETY: calloc of a NULL-terminated array; freed by `free_devices`.
    let arr = unsafe { libc::calloc(ctxs.len() + 1, size_of::<*mut c_void>()) }.cast::<*mut c_void>();
    if arr.is_null() {
        return fail_null(libc::ENOMEM);
    }
    for (i, c) in ctxs.iter().enumerate() {
        // SAFETY: `i` is within the array just allocated.
        unsafe { *arr.add(i) = c.cast() };
    }
    if !num.is_null() {
        // SAFETY: the caller's out pointer.
        unsafe { *num = ctxs.len() as c_int };
    }
    arr
}

unsafe extern "C" fn free_devices(list: *mut *mut c_void) {
    // SAFETY: an array `get_devices` allocated (the contexts stay open, as in librdmacm).
    unsafe { libc::free(list.cast()) };
}

unsafe extern "C" fn join_multicast(
    id: *mut rdma_cm_id,
    addr: *mut libc::sockaddr,
    context: *mut c_void,
) -> c_int {
    // SAFETY: the caller's arguments, passed on.
    unsafe { join_multicast_ex(id, addr, 0, context) }
}

unsafe extern "C" fn join_multicast_ex(
    id: *mut rdma_cm_id,
    addr: *mut libc::sockaddr,
    send_only: c_int,
    context: *mut c_void,
) -> c_int {
    // SAFETY: the API contract: a live id and a valid address.
    let (Some(b), Some(a)) = (unsafe { id_box(id) }, unsafe { sock_addr(addr) }) else {
        return fail_minus_one(libc::EINVAL);
    };
    let gid = Gid::from_ip(a.ip());
    b.mc_contexts.retain(|(g, _)| *g != gid);
    b.mc_contexts.push((gid, context as usize));
    let r = b.core.join_multicast_ex(a.ip(), send_only != 0);
    if r.is_err() {
        b.mc_contexts.retain(|(g, _)| *g != gid);
    }
    result(r)
}

unsafe extern "C" fn leave_multicast(id: *mut rdma_cm_id, addr: *mut libc::sockaddr) -> c_int {
    // SAFETY: the API contract: a live id and a valid address.
    let (Some(b), Some(a)) = (unsafe { id_box(id) }, unsafe { sock_addr(addr) }) else {
        return fail_minus_one(libc::EINVAL);
    };
    let gid = Gid::from_ip(a.ip());
    b.mc_contexts.retain(|(g, _)| *g != gid);
    result(b.core.leave_multicast(a.ip()))
}

/// An `rdma_addrinfo` with the addresses it points at.
#[repr(C)]
struct SvAddrInfo {
    ai: rdma_addrinfo,
    src: libc::sockaddr_storage,
    dst: libc::sockaddr_storage,
}

pub(crate) fn sockaddr_len(a: &SocketAddr) -> libc::socklen_t {
    (if a.is_ipv4() {
        size_of::<libc::sockaddr_in>()
    } else {
        size_of::<libc::sockaddr_in6>()
    }) as libc::socklen_t
}

unsafe extern "C" fn getaddrinfo(
    node: *const std::ffi::c_char,
    service: *const std::ffi::c_char,
    hints: *const rdma_addrinfo,
    res: *mut *mut rdma_addrinfo,
) -> c_int {
    if res.is_null() || (node.is_null() && service.is_null() && hints.is_null()) {
        return fail_minus_one(libc::EINVAL);
    }
    // SAFETY: NULL or NUL-terminated strings (the API contract).
    let text =
        |p: *const std::ffi::c_char| unsafe { p.as_ref() }.map(|_| unsafe { std::ffi::CStr::from_ptr(p) });
    let (node, service) = (text(node), text(service));
    let (Ok(node), Ok(service)) = (
        node.map(|n| n.to_str()).transpose(),
        service.map(|s| s.to_str()).transpose(),
    ) else {
        return libc::EAI_NONAME;
    };
    let mut h = ccm::AddrHints::default();
    // SAFETY: NULL or a valid hints structure.
    if let Some(hi) = unsafe { hints.as_ref() } {
        h.flags = hi.ai_flags as u32;
        h.family = hi.ai_family;
        h.qp_type =
            softverbs_engine::types::QpType::from_raw(hi.ai_qp_type as _).filter(|_| hi.ai_qp_type != 0);
        h.port_space = u16::try_from(hi.ai_port_space)
            .ok()
            .and_then(ccm::PortSpace::from_value);
        // SAFETY: NULL or a valid address of `ai_src_len` bytes.
        h.src = unsafe { sock_addr(hi.ai_src_addr) };
        // SAFETY: NULL or a valid address of `ai_dst_len` bytes.
        h.dst = unsafe { sock_addr(hi.ai_dst_addr) };
    }
    let list = match ccm::getaddrinfo(node, service, &h) {
        Ok(l) => l,
        Err(e) => return e,
    };
    let mut head: *mut rdma_addrinfo = std::ptr::null_mut();
    for a in list.iter().rev() {
        // SAFETY: all-zero is valid for every field (null pointers, zero lengths).
        let mut b: Box<SvAddrInfo> = Box::new(unsafe { std::mem::zeroed() });
        b.ai.ai_flags = a.flags as c_int;
        b.ai.ai_family = a.family;
        b.ai.ai_qp_type = a.qp_type as c_int;
        b.ai.ai_port_space = c_int::from(a.port_space.value());
        if let Some(s) = a.src {
            store_addr(&mut b.src, Some(s));
            b.ai.ai_src_len = sockaddr_len(&s);
            b.ai.ai_src_addr = (&mut b.src as *mut libc::sockaddr_storage).cast();
        }
        if let Some(d) = a.dst {
            store_addr(&mut b.dst, Some(d));
            b.ai.ai_dst_len = sockaddr_len(&d);
            b.ai.ai_dst_addr = (&mut b.dst as *mut libc::sockaddr_storage).cast();
        }
        b.ai.ai_next = head;
        head = Box::into_raw(b).cast();
    }
    // SAFETY: the caller's out pointer.
    unsafe { *res = head };
    0
}

unsafe extern "C" fn freeaddrinfo(mut res: *mut rdma_addrinfo) {
    while !res.is_null() {
        // SAFETY: every node of the list is the first field of a box `getaddrinfo` made.
        let b = unsafe { Box::from_raw(res.cast::<SvAddrInfo>()) };
        res = b.ai.ai_next;
    }
}

unsafe extern "C" fn create_ep(
    out: *mut *mut rdma_cm_id,
    res: *mut rdma_addrinfo,
    pd: *mut c_void,
    init: *mut c_void,
) -> c_int {
    // SAFETY: the API contract: a valid out pointer and address information.
    let Some(r) = (unsafe { res.as_ref() }) else {
        return fail_minus_one(libc::EINVAL);
    };
    if out.is_null() {
        return fail_minus_one(libc::EINVAL);
    }
    let mut id = std::ptr::null_mut();
    // SAFETY: no channel (a synchronous id) and a valid out pointer.
    if unsafe {
        create_id(
            std::ptr::null_mut(),
            &mut id,
            std::ptr::null_mut(),
            r.ai_port_space,
        )
    } != 0
    {
        return -1;
    }
    let passive = r.ai_flags & 1 != 0; // RAI_PASSIVE
                                       // SAFETY: `id` was just made; the addresses are the caller's valid ones.
    let rc = unsafe {
        if passive {
            bind_addr(id, r.ai_src_addr)
        } else {
            match resolve_addr(id, r.ai_src_addr, r.ai_dst_addr, 2000) {
                0 => resolve_route(id, 2000),
                e => e,
            }
        }
    };
    if rc != 0 {
        let e = std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EINVAL);
        // SAFETY: `id` is ours and unused elsewhere.
        unsafe { destroy_id(id) };
        return fail_minus_one(e);
    }
    // SAFETY: `init` is NULL or a valid `ibv_qp_init_attr` (the API contract).
    if let Some(attr) = unsafe { init.cast::<ibv_qp_init_attr>().as_mut() } {
        // The QP type comes from the address information, as in librdmacm.
        attr.qp_type = r.ai_qp_type as std::ffi::c_uint;
        if passive {
            // SAFETY: `id` is a live box; the attributes are plain data, copied.
            unsafe { (*id.cast::<SvCmId>()).qp_init = Some((pd as usize, std::ptr::read(attr))) };
        } else {
            // SAFETY: as above; `create_qp` writes the CQs it makes into the caller's attr.
            if unsafe { create_qp(id, pd, init) } != 0 {
                let e = std::io::Error::last_os_error()
                    .raw_os_error()
                    .unwrap_or(libc::EINVAL);
                // SAFETY: `id` is ours and unused elsewhere.
                unsafe { destroy_id(id) };
                return fail_minus_one(e);
            }
        }
    }
    // SAFETY: the caller's out pointer.
    unsafe { *out = id };
    0
}

unsafe extern "C" fn destroy_ep(id: *mut rdma_cm_id) {
    // SAFETY: the API contract: a live id, given up.
    unsafe {
        if !id.is_null() && !(*id).qp.is_null() {
            destroy_qp(id);
        }
        destroy_id(id);
    }
}

unsafe extern "C" fn get_request(listen: *mut rdma_cm_id, out: *mut *mut rdma_cm_id) -> c_int {
    // SAFETY: the API contract: a live listening id and a valid out pointer.
    let Some(l) = (unsafe { id_box(listen) }) else {
        return fail_minus_one(libc::EINVAL);
    };
    if out.is_null() {
        return fail_minus_one(libc::EINVAL);
    }
    let core = match l.core.get_request() {
        Ok(c) => c,
        Err(e) => return fail_minus_one(errno_of(&e)),
    };
    let idp = c_id(&core, l.id.channel, l.id.context);
    // SAFETY: a live id box, not yet known to the caller.
    let b = unsafe { &mut *idp };
    refresh(b);
    if let Some((pd, attr)) = &l.qp_init {
        // SAFETY: a copy of the listener's attributes, and its PD (or NULL: the default).
        let mut attr = unsafe { std::ptr::read(attr) };
        // SAFETY: as above.
        if unsafe {
            create_qp(
                idp.cast(),
                *pd as *mut c_void,
                (&mut attr as *mut ibv_qp_init_attr).cast(),
            )
        } != 0
        {
            let e = std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EINVAL);
            // SAFETY: the new id is ours alone.
            unsafe { destroy_id(idp.cast()) };
            return fail_minus_one(e);
        }
    }
    // SAFETY: the caller's out pointer.
    unsafe { *out = idp.cast() };
    0
}

/// `rdma_create_srq`: an SRQ in `pd` (the device's default PD when NULL) kept in `id->srq`.
unsafe extern "C" fn create_srq(id: *mut rdma_cm_id, pd: *mut c_void, attr: *mut c_void) -> c_int {
    // SAFETY: the API contract: a live id and a valid `ibv_srq_init_attr`.
    let Some(b) = (unsafe { id_box(id) }) else {
        return fail_minus_one(libc::EINVAL);
    };
    if b.id.verbs.is_null() || attr.is_null() || !b.id.srq.is_null() {
        return fail_minus_one(libc::EINVAL);
    }
    let mut pd = pd.cast::<ibv_pd>();
    if pd.is_null() {
        pd = default_pd(b.id.verbs.cast());
        if pd.is_null() {
            return -1;
        }
    }
    // SAFETY: `pd` is a PD of this library and `attr` the caller's valid attributes.
    let srq = unsafe { v::create_srq(pd, attr.cast()) };
    if srq.is_null() {
        return -1;
    }
    b.id.srq = srq.cast();
    if b.id.pd.is_null() {
        b.id.pd = pd.cast();
    }
    0
}

/// The XRC domain `rdma_create_srq_ex` uses on `ctx` when given none (opened once per
/// context, with no file: private to this process).
fn default_xrcd(ctx: *mut ibv_context) -> *mut crate::abi::ibv_xrcd {
    if let Some(&x) = maps().xrcds.get(&(ctx as usize)) {
        return x as *mut crate::abi::ibv_xrcd;
    }
    let mut attr = crate::abi::ibv_xrcd_init_attr {
        comp_mask: crate::abi::IBV_XRCD_INIT_ATTR_FD | crate::abi::IBV_XRCD_INIT_ATTR_OFLAGS,
        fd: -1,
        oflags: libc::O_CREAT,
    };
    // SAFETY: `ctx` is a context this library opened and keeps open; `attr` is valid.
    let xrcd = unsafe { crate::verbs::open_xrcd(ctx, &mut attr) };
    if !xrcd.is_null() {
        maps().xrcds.insert(ctx as usize, xrcd as usize);
    }
    xrcd
}

/// `rdma_create_srq_ex`: as `rdma_create_srq` from `ibv_srq_init_attr_ex`, filling in what the
/// mask leaves out as librdmacm does: the type (XRC for an `IBV_QPT_XRC_RECV` id, else basic),
/// the id's PD (or the default one) and, for XRC, a domain and a completion queue.
unsafe extern "C" fn create_srq_ex(id: *mut rdma_cm_id, attr: *mut c_void) -> c_int {
    use crate::abi::{
        IBV_SRQT_BASIC, IBV_SRQT_XRC, IBV_SRQ_INIT_ATTR_CQ, IBV_SRQ_INIT_ATTR_PD, IBV_SRQ_INIT_ATTR_TYPE,
        IBV_SRQ_INIT_ATTR_XRCD,
    };
    // SAFETY: the API contract: a live id and a valid `ibv_srq_init_attr_ex`.
    let (Some(b), Some(a)) = (unsafe { id_box(id) }, unsafe {
        attr.cast::<crate::abi::ibv_srq_init_attr_ex>().as_mut()
    }) else {
        return fail_minus_one(libc::EINVAL);
    };
    if b.id.verbs.is_null() || !b.id.srq.is_null() {
        return fail_minus_one(libc::EINVAL);
    }
    let ctx = b.id.verbs.cast::<ibv_context>();
    if a.comp_mask & IBV_SRQ_INIT_ATTR_TYPE == 0 {
        a.srq_type = if b.id.qp_type as u32 == softverbs_engine::types::QpType::XrcRecv.raw() {
            IBV_SRQT_XRC
        } else {
            IBV_SRQT_BASIC
        };
        a.comp_mask |= IBV_SRQ_INIT_ATTR_TYPE;
    }
    if a.srq_type == IBV_SRQT_XRC {
        if a.comp_mask & IBV_SRQ_INIT_ATTR_XRCD == 0 {
            a.xrcd = default_xrcd(ctx);
            if a.xrcd.is_null() {
                return -1;
            }
            a.comp_mask |= IBV_SRQ_INIT_ATTR_XRCD;
        }
        if a.comp_mask & IBV_SRQ_INIT_ATTR_CQ == 0 {
            let mut cq = b.id.recv_cq.cast::<crate::abi::ibv_cq>();
            if !ensure_cq(b, false, &mut cq, a.attr.max_wr) {
                return -1;
            }
            a.cq = cq;
            a.comp_mask |= IBV_SRQ_INIT_ATTR_CQ;
        }
    }
    if a.comp_mask & IBV_SRQ_INIT_ATTR_PD == 0 || a.pd.is_null() {
        a.pd = if b.id.pd.is_null() {
            default_pd(ctx)
        } else {
            b.id.pd.cast()
        };
        if a.pd.is_null() {
            return -1;
        }
        a.comp_mask |= IBV_SRQ_INIT_ATTR_PD;
    }
    // SAFETY: the context and attributes are valid, as above.
    let srq = unsafe { crate::verbs::create_srq_ex(ctx, a) };
    if srq.is_null() {
        return -1;
    }
    b.id.srq = srq.cast();
    if b.id.pd.is_null() {
        b.id.pd = a.pd.cast();
    }
    0
}

/// `rdma_destroy_srq`: destroys `id->srq`, and the id's CQs when it has no QP.
unsafe extern "C" fn destroy_srq(id: *mut rdma_cm_id) {
    // SAFETY: the API contract: a live id.
    let Some(b) = (unsafe { id_box(id) }) else {
        return;
    };
    let srq = std::mem::replace(&mut b.id.srq, std::ptr::null_mut());
    if !srq.is_null() {
        // SAFETY: the SRQ `create_srq` made, no longer referred to by the id.
        unsafe { v::destroy_srq(srq.cast()) };
    }
    // As librdmacm: the id's CQs go with it (an XRC SRQ's receive CQ), unless a QP uses them.
    if b.id.qp.is_null() {
        destroy_cqs(b);
    }
}

static OPS: RdmacmOps = RdmacmOps {
    size: size_of::<RdmacmOps>(),
    create_event_channel,
    destroy_event_channel,
    create_id,
    destroy_id,
    bind_addr,
    resolve_addr,
    resolve_route,
    listen,
    connect,
    accept,
    reject,
    disconnect,
    establish,
    notify,
    get_cm_event,
    ack_cm_event,
    create_qp,
    create_qp_ex,
    destroy_qp,
    create_srq,
    destroy_srq,
    init_qp_attr,
    set_option,
    migrate_id,
    get_devices,
    free_devices,
    join_multicast,
    leave_multicast,
    join_multicast_ex,
    getaddrinfo,
    freeaddrinfo,
    create_ep,
    destroy_ep,
    get_request,
    create_srq_ex,
    reject_ece,
    set_local_ece,
    get_remote_ece,
    rsocket: crate::rsocket::rsocket,
    rbind: crate::rsocket::rbind,
    rlisten: crate::rsocket::rlisten,
    raccept: crate::rsocket::raccept,
    rconnect: crate::rsocket::rconnect,
    rshutdown: crate::rsocket::rshutdown,
    rclose: crate::rsocket::rclose,
    rrecv: crate::rsocket::rrecv,
    rrecvfrom: crate::rsocket::rrecvfrom,
    rrecvmsg: crate::rsocket::rrecvmsg,
    rsend: crate::rsocket::rsend,
    rsendto: crate::rsocket::rsendto,
    rsendmsg: crate::rsocket::rsendmsg,
    rread: crate::rsocket::rread,
    rreadv: crate::rsocket::rreadv,
    rwrite: crate::rsocket::rwrite,
    rwritev: crate::rsocket::rwritev,
    rpoll: crate::rsocket::rpoll,
    rselect: crate::rsocket::rselect,
    rgetpeername: crate::rsocket::rgetpeername,
    rgetsockname: crate::rsocket::rgetsockname,
    rsetsockopt: crate::rsocket::rsetsockopt,
    rgetsockopt: crate::rsocket::rgetsockopt,
    rfcntl: crate::rsocket::rfcntl,
    riomap: crate::rsocket::riomap,
    riounmap: crate::rsocket::riounmap,
    riowrite: crate::rsocket::riowrite,
};

/// `softverbs_rdmacm_ops@@SOFTVERBS_PRIVATE_1`: the table `librdmacm.so.1` forwards to.
pub(crate) extern "C" fn ops() -> *const RdmacmOps {
    set_errno(0);
    &OPS
}
