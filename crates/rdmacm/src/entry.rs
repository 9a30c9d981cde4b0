//! The entry points of `librdmacm.so.1`.
//!
//! The connection-manager and rsocket calls are forwarded to the table `libibverbs.so.1`
//! exports ([`RdmacmOps`]), and fail with -1 (or NULL) and ENOSYS when it is absent. Answered
//! here: [`rdma_event_str`] and the port getters, which read the caller's `rdma_cm_id`.

use std::ffi::{c_char, c_int, c_void};

use libc::{fd_set, msghdr, nfds_t, off_t, pollfd, size_t, sockaddr, socklen_t, ssize_t, timeval};

use std::mem::size_of;
use std::sync::OnceLock;

use crate::abi::*;
use crate::{fail, set_errno};

/// An entry point with no translation yet: -1 and ENOSYS.
fn enosys() -> c_int {
    fail(libc::ENOSYS)
}

/// The names `rdma_event_str` gives, indexed by `enum rdma_cm_event_type`.
const EVENT_NAMES: [&std::ffi::CStr; 16] = [
    c"RDMA_CM_EVENT_ADDR_RESOLVED",
    c"RDMA_CM_EVENT_ADDR_ERROR",
    c"RDMA_CM_EVENT_ROUTE_RESOLVED",
    c"RDMA_CM_EVENT_ROUTE_ERROR",
    c"RDMA_CM_EVENT_CONNECT_REQUEST",
    c"RDMA_CM_EVENT_CONNECT_RESPONSE",
    c"RDMA_CM_EVENT_CONNECT_ERROR",
    c"RDMA_CM_EVENT_UNREACHABLE",
    c"RDMA_CM_EVENT_REJECTED",
    c"RDMA_CM_EVENT_ESTABLISHED",
    c"RDMA_CM_EVENT_DISCONNECTED",
    c"RDMA_CM_EVENT_DEVICE_REMOVAL",
    c"RDMA_CM_EVENT_MULTICAST_JOIN",
    c"RDMA_CM_EVENT_MULTICAST_ERROR",
    c"RDMA_CM_EVENT_ADDR_CHANGE",
    c"RDMA_CM_EVENT_TIMEWAIT_EXIT",
];

/// `rdma_event_str`: the event's name, or "UNKNOWN EVENT".
pub(crate) extern "C" fn rdma_event_str(event: c_int) -> *const c_char {
    usize::try_from(event)
        .ok()
        .and_then(|i| EVENT_NAMES.get(i))
        .map_or(c"UNKNOWN EVENT".as_ptr(), |s| s.as_ptr())
}

/// The port of a `sockaddr_storage` in network order (0 for families without one).
fn port_of(addr: &libc::sockaddr_storage) -> u16 {
    match c_int::from(addr.ss_family) {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a `sockaddr_in`, which it is large and
            // aligned enough for.
            unsafe { (*(addr as *const _ as *const libc::sockaddr_in)).sin_port }
        }
        libc::AF_INET6 => {
            // SAFETY: as above, for `sockaddr_in6`.
            unsafe { (*(addr as *const _ as *const libc::sockaddr_in6)).sin6_port }
        }
        _ => 0,
    }
}

/// `rdma_get_src_port`: the source port of the id's route, in network order.
///
/// # Safety
/// `id` is a valid `rdma_cm_id`.
pub(crate) unsafe extern "C" fn rdma_get_src_port(id: *mut rdma_cm_id) -> u16 {
    // SAFETY: the caller passes a valid id (librdmacm does not check it either).
    port_of(unsafe { &(*id).route.addr.src_addr })
}

/// `rdma_get_dst_port`: the destination port of the id's route, in network order.
///
/// # Safety
/// `id` is a valid `rdma_cm_id`.
pub(crate) unsafe extern "C" fn rdma_get_dst_port(id: *mut rdma_cm_id) -> u16 {
    // SAFETY: the caller passes a valid id.
    port_of(unsafe { &(*id).route.addr.dst_addr })
}

/// The connection manager's table in `libibverbs.so.1` (`softverbs_rdmacm_ops`), looked up
/// once; `None` under a `libibverbs.so.1` without it (rdma-core's).
fn ops() -> Option<&'static RdmacmOps> {
    static OPS: OnceLock<usize> = OnceLock::new();
    let p = *OPS.get_or_init(|| {
        // SAFETY: dlopen/dlsym with NUL-terminated names; the handle is kept for the process
        // (the library stays loaded), and the symbol, if present, is a function of the
        // signature below, which this workspace's libibverbs.so.1 defines.
        unsafe {
            let h = libc::dlopen(c"libibverbs.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL);
            if h.is_null() {
                return 0;
            }
            let f = libc::dlsym(h, c"softverbs_rdmacm_ops".as_ptr());
            if f.is_null() {
                return 0;
            }
            let f: extern "C" fn() -> *const RdmacmOps = std::mem::transmute(f);
            let t = f();
            if t.is_null() || (*t).size != size_of::<RdmacmOps>() {
                return 0;
            }
            t as usize
        }
    });
    // SAFETY: a table in static storage of the loaded libibverbs.so.1.
    (p != 0).then(|| unsafe { &*(p as *const RdmacmOps) })
}

/// Forwards an entry point to the table, or fails with -1 and ENOSYS without one.
macro_rules! forward {
    ($($name:ident($($arg:ident: $ty:ty),*) -> $ret:ty = $field:ident;)*) => {
        $(
            #[doc = concat!("`", stringify!($name), "`, run by the connection manager in `libibverbs.so.1`.")]
            pub(crate) unsafe extern "C" fn $name($($arg: $ty),*) -> $ret {
                match ops() {
                    // SAFETY: the caller's arguments satisfy the librdmacm API contract, which is
                    // what the implementation requires.
                    Some(o) => unsafe { (o.$field)($($arg),*) },
                    None => enosys() as $ret,
                }
            }
        )*
    };
}

forward! {
    rdma_create_id(channel: *mut rdma_event_channel, id: *mut *mut rdma_cm_id, context: *mut c_void, ps: c_int) -> c_int = create_id;
    rdma_destroy_id(id: *mut rdma_cm_id) -> c_int = destroy_id;
    rdma_bind_addr(id: *mut rdma_cm_id, addr: *mut sockaddr) -> c_int = bind_addr;
    rdma_resolve_addr(id: *mut rdma_cm_id, src: *mut sockaddr, dst: *mut sockaddr, timeout_ms: c_int) -> c_int = resolve_addr;
    rdma_resolve_route(id: *mut rdma_cm_id, timeout_ms: c_int) -> c_int = resolve_route;
    rdma_listen(id: *mut rdma_cm_id, backlog: c_int) -> c_int = listen;
    rdma_connect(id: *mut rdma_cm_id, param: *mut rdma_conn_param) -> c_int = connect;
    rdma_accept(id: *mut rdma_cm_id, param: *mut rdma_conn_param) -> c_int = accept;
    rdma_reject(id: *mut rdma_cm_id, data: *const c_void, len: u8) -> c_int = reject;
    rdma_disconnect(id: *mut rdma_cm_id) -> c_int = disconnect;
    rdma_establish(id: *mut rdma_cm_id) -> c_int = establish;
    rdma_notify(id: *mut rdma_cm_id, event: c_int) -> c_int = notify;
    rdma_get_cm_event(channel: *mut rdma_event_channel, event: *mut *mut rdma_cm_event) -> c_int = get_cm_event;
    rdma_ack_cm_event(event: *mut rdma_cm_event) -> c_int = ack_cm_event;
    rdma_create_qp(id: *mut rdma_cm_id, pd: *mut c_void, attr: *mut c_void) -> c_int = create_qp;
    rdma_create_qp_ex(id: *mut rdma_cm_id, attr: *mut c_void) -> c_int = create_qp_ex;
    rdma_create_srq(id: *mut rdma_cm_id, pd: *mut c_void, attr: *mut c_void) -> c_int = create_srq;
    rdma_init_qp_attr(id: *mut rdma_cm_id, attr: *mut c_void, mask: *mut c_int) -> c_int = init_qp_attr;
    rdma_set_option(id: *mut rdma_cm_id, level: c_int, optname: c_int, optval: *mut c_void, optlen: size_t) -> c_int = set_option;
    rdma_migrate_id(id: *mut rdma_cm_id, channel: *mut rdma_event_channel) -> c_int = migrate_id;
    rdma_join_multicast(id: *mut rdma_cm_id, addr: *mut sockaddr, context: *mut c_void) -> c_int = join_multicast;
    rdma_leave_multicast(id: *mut rdma_cm_id, addr: *mut sockaddr) -> c_int = leave_multicast;
    rdma_create_ep(id: *mut *mut rdma_cm_id, res: *mut rdma_addrinfo, pd: *mut c_void, qp_init_attr: *mut c_void) -> c_int = create_ep;
    rdma_get_request(listen: *mut rdma_cm_id, id: *mut *mut rdma_cm_id) -> c_int = get_request;
    rdma_getaddrinfo(node: *const c_char, service: *const c_char, hints: *const rdma_addrinfo, res: *mut *mut rdma_addrinfo) -> c_int = getaddrinfo;
}

/// `rdma_join_multicast_ex`: the address (`RDMA_CM_JOIN_MC_ATTR_ADDRESS`) and join flags
/// (`RDMA_CM_JOIN_MC_ATTR_JOIN_FLAGS`: full member 0, send-only full member 1) are required, as
/// in librdmacm; other flags are EINVAL.
///
/// # Safety
/// `id` is a live id and `attr` a valid attribute block.
pub(crate) unsafe extern "C" fn rdma_join_multicast_ex(
    id: *mut rdma_cm_id,
    attr: *mut rdma_cm_join_mc_attr_ex,
    context: *mut c_void,
) -> c_int {
    let Some(o) = ops() else {
        return enosys();
    };
    // SAFETY: NULL or the caller's valid attribute block.
    let Some(a) = (unsafe { attr.as_ref() }) else {
        return fail(libc::EINVAL);
    };
    const ADDRESS: u32 = 1;
    const JOIN_FLAGS: u32 = 2;
    if a.comp_mask & (ADDRESS | JOIN_FLAGS) != (ADDRESS | JOIN_FLAGS)
        || a.comp_mask & !3 != 0
        || a.join_flags > 1
    {
        return fail(libc::EINVAL);
    }
    // SAFETY: the caller's arguments, with the checked fields.
    unsafe { (o.join_multicast_ex)(id, a.addr, a.join_flags as c_int, context) }
}

/// `rdma_destroy_ep`.
pub(crate) unsafe extern "C" fn rdma_destroy_ep(id: *mut rdma_cm_id) {
    if let Some(o) = ops() {
        // SAFETY: `id` is an id the table made, given up.
        unsafe { (o.destroy_ep)(id) }
    }
}

/// `rdma_freeaddrinfo`.
pub(crate) unsafe extern "C" fn rdma_freeaddrinfo(res: *mut rdma_addrinfo) {
    if let Some(o) = ops() {
        // SAFETY: `res` is NULL or a list `rdma_getaddrinfo` made.
        unsafe { (o.freeaddrinfo)(res) }
    }
}

/// `rdma_create_event_channel` (NULL and ENOSYS without the table).
pub(crate) extern "C" fn rdma_create_event_channel() -> *mut rdma_event_channel {
    match ops() {
        // SAFETY: no arguments; the table's function is sound to call.
        Some(o) => unsafe { (o.create_event_channel)() },
        None => {
            set_errno(libc::ENOSYS);
            std::ptr::null_mut()
        }
    }
}

/// `rdma_get_devices` (NULL and ENOSYS without the table).
pub(crate) unsafe extern "C" fn rdma_get_devices(num: *mut c_int) -> *mut *mut c_void {
    match ops() {
        // SAFETY: `num` is NULL or the caller's out pointer.
        Some(o) => unsafe { (o.get_devices)(num) },
        None => {
            set_errno(libc::ENOSYS);
            std::ptr::null_mut()
        }
    }
}

/// `rdma_destroy_event_channel`.
pub(crate) unsafe extern "C" fn rdma_destroy_event_channel(ch: *mut rdma_event_channel) {
    if let Some(o) = ops() {
        // SAFETY: `ch` is a channel the table made (no other kind can exist).
        unsafe { (o.destroy_event_channel)(ch) }
    }
}

/// `rdma_destroy_qp`.
pub(crate) unsafe extern "C" fn rdma_destroy_qp(id: *mut rdma_cm_id) {
    if let Some(o) = ops() {
        // SAFETY: `id` is an id the table made.
        unsafe { (o.destroy_qp)(id) }
    }
}

/// `rdma_free_devices`.
pub(crate) unsafe extern "C" fn rdma_free_devices(list: *mut *mut c_void) {
    if let Some(o) = ops() {
        // SAFETY: `list` came from `rdma_get_devices`.
        unsafe { (o.free_devices)(list) }
    }
}

/// `rdma_destroy_srq`.
pub(crate) unsafe extern "C" fn rdma_destroy_srq(id: *mut rdma_cm_id) {
    if let Some(o) = ops() {
        // SAFETY: `id` is an id the table made.
        unsafe { (o.destroy_srq)(id) }
    }
}

/// `rdma_create_srq_ex`.
pub(crate) unsafe extern "C" fn rdma_create_srq_ex(id: *mut rdma_cm_id, attr: *mut c_void) -> c_int {
    match ops() {
        // SAFETY: forwarded with the caller's arguments, which the table checks.
        Some(o) => unsafe { (o.create_srq_ex)(id, attr) },
        None => enosys(),
    }
}

/// `rdma_reject_ece`.
pub(crate) unsafe extern "C" fn rdma_reject_ece(id: *mut rdma_cm_id, data: *const c_void, len: u8) -> c_int {
    match ops() {
        // SAFETY: forwarded with the caller's arguments, which the table checks.
        Some(o) => unsafe { (o.reject_ece)(id, data, len) },
        None => enosys(),
    }
}

/// `rdma_set_local_ece`.
pub(crate) unsafe extern "C" fn rdma_set_local_ece(id: *mut rdma_cm_id, ece: *mut ibv_ece) -> c_int {
    match ops() {
        // SAFETY: forwarded with the caller's arguments, which the table checks.
        Some(o) => unsafe { (o.set_local_ece)(id, ece) },
        None => enosys(),
    }
}

/// `rdma_get_remote_ece`.
pub(crate) unsafe extern "C" fn rdma_get_remote_ece(id: *mut rdma_cm_id, ece: *mut ibv_ece) -> c_int {
    match ops() {
        // SAFETY: forwarded with the caller's arguments, which the table checks.
        Some(o) => unsafe { (o.get_remote_ece)(id, ece) },
        None => enosys(),
    }
}

forward! {
    rsocket(domain: c_int, ty: c_int, protocol: c_int) -> c_int = rsocket;
    rbind(s: c_int, addr: *const sockaddr, len: socklen_t) -> c_int = rbind;
    rlisten(s: c_int, backlog: c_int) -> c_int = rlisten;
    raccept(s: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int = raccept;
    rconnect(s: c_int, addr: *const sockaddr, len: socklen_t) -> c_int = rconnect;
    rshutdown(s: c_int, how: c_int) -> c_int = rshutdown;
    rclose(s: c_int) -> c_int = rclose;
    rrecv(s: c_int, buf: *mut c_void, len: size_t, flags: c_int) -> ssize_t = rrecv;
    rrecvfrom(s: c_int, buf: *mut c_void, len: size_t, flags: c_int, src: *mut sockaddr, alen: *mut socklen_t) -> ssize_t = rrecvfrom;
    rrecvmsg(s: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t = rrecvmsg;
    rsend(s: c_int, buf: *const c_void, len: size_t, flags: c_int) -> ssize_t = rsend;
    rsendto(s: c_int, buf: *const c_void, len: size_t, flags: c_int, dst: *const sockaddr, alen: socklen_t) -> ssize_t = rsendto;
    rsendmsg(s: c_int, msg: *const msghdr, flags: c_int) -> ssize_t = rsendmsg;
    rread(s: c_int, buf: *mut c_void, count: size_t) -> ssize_t = rread;
    rreadv(s: c_int, iov: *const libc::iovec, n: c_int) -> ssize_t = rreadv;
    rwrite(s: c_int, buf: *const c_void, count: size_t) -> ssize_t = rwrite;
    rwritev(s: c_int, iov: *const libc::iovec, n: c_int) -> ssize_t = rwritev;
    rpoll(fds: *mut pollfd, n: nfds_t, timeout: c_int) -> c_int = rpoll;
    rselect(n: c_int, r: *mut fd_set, w: *mut fd_set, e: *mut fd_set, timeout: *mut timeval) -> c_int = rselect;
    rgetpeername(s: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int = rgetpeername;
    rgetsockname(s: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int = rgetsockname;
    rsetsockopt(s: c_int, level: c_int, name: c_int, val: *const c_void, len: socklen_t) -> c_int = rsetsockopt;
    rgetsockopt(s: c_int, level: c_int, name: c_int, val: *mut c_void, len: *mut socklen_t) -> c_int = rgetsockopt;
    riomap(s: c_int, buf: *mut c_void, len: size_t, prot: c_int, flags: c_int, offset: off_t) -> off_t = riomap;
    riounmap(s: c_int, buf: *mut c_void, len: size_t) -> c_int = riounmap;
    riowrite(s: c_int, buf: *const c_void, count: size_t, offset: off_t, flags: c_int) -> size_t = riowrite;
}

/// `rfcntl(socket, cmd, ...)`: C passes the one optional argument as an int (F_SETFL's
/// flags); reading it for commands that take none is harmless on the System V ABI, where
/// variadic integer arguments travel in the same registers as fixed ones.
pub(crate) unsafe extern "C" fn rfcntl(s: c_int, cmd: c_int, arg: c_int) -> c_int {
    match ops() {
        // SAFETY: forwarded with the caller's arguments, which the table checks.
        Some(o) => unsafe { (o.rfcntl)(s, cmd, arg) },
        None => enosys(),
    }
}
