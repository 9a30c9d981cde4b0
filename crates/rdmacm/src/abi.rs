//! `repr(C)` mirrors of the `<rdma/rdma_cma.h>` structures. Verbs objects (`ibv_context`,
//! `ibv_qp`, ...) are opaque pointers here: they belong to `libibverbs.so.1`.
#![allow(non_camel_case_types, missing_docs)] // the C names; each field is documented in rdma_cma.h

use std::ffi::{c_char, c_int, c_void};

use libc::{
    fd_set, iovec, msghdr, nfds_t, off_t, pollfd, sockaddr, sockaddr_storage, socklen_t, ssize_t, timeval,
};

/// `union ibv_gid`, as raw bytes with the alignment of its `__be64` view.
#[repr(C, align(8))]
#[derive(Clone, Copy)]
pub struct ibv_gid {
    pub raw: [u8; 16],
}

/// `struct ibv_global_route`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_global_route {
    pub dgid: ibv_gid,
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

/// `struct ibv_ah_attr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_ah_attr {
    pub grh: ibv_global_route,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

/// `struct ibv_ece`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_ece {
    pub vendor_id: u32,
    pub options: u32,
    pub comp_mask: u32,
}

/// `struct rdma_ib_addr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct rdma_ib_addr {
    pub sgid: ibv_gid,
    pub dgid: ibv_gid,
    pub pkey: u16,
}

/// `struct rdma_addr`: the source and destination addresses (each a `sockaddr_storage`
/// union in C) and the GIDs.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct rdma_addr {
    pub src_addr: sockaddr_storage,
    pub dst_addr: sockaddr_storage,
    pub addr: rdma_ib_addr,
}

/// `struct rdma_route`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct rdma_route {
    pub addr: rdma_addr,
    pub path_rec: *mut c_void,
    pub num_paths: c_int,
}

/// `struct rdma_event_channel`.
#[repr(C)]
pub struct rdma_event_channel {
    pub fd: c_int,
}

/// `struct rdma_cm_id` (416 bytes).
#[repr(C)]
pub struct rdma_cm_id {
    pub verbs: *mut c_void,
    pub channel: *mut rdma_event_channel,
    pub context: *mut c_void,
    pub qp: *mut c_void,
    pub route: rdma_route,
    pub ps: c_int,
    pub port_num: u8,
    pub event: *mut rdma_cm_event,
    pub send_cq_channel: *mut c_void,
    pub send_cq: *mut c_void,
    pub recv_cq_channel: *mut c_void,
    pub recv_cq: *mut c_void,
    pub srq: *mut c_void,
    pub pd: *mut c_void,
    pub qp_type: c_int,
}

/// `struct rdma_conn_param`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct rdma_conn_param {
    pub private_data: *const c_void,
    pub private_data_len: u8,
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub flow_control: u8,
    pub retry_count: u8,
    pub rnr_retry_count: u8,
    pub srq: u8,
    pub qp_num: u32,
}

/// `struct rdma_ud_param`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct rdma_ud_param {
    pub private_data: *const c_void,
    pub private_data_len: u8,
    pub ah_attr: ibv_ah_attr,
    pub qp_num: u32,
    pub qkey: u32,
}

/// The `param` union of `struct rdma_cm_event`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union rdma_cm_event_param {
    pub conn: rdma_conn_param,
    pub ud: rdma_ud_param,
}

/// `struct rdma_cm_event`.
#[repr(C)]
pub struct rdma_cm_event {
    pub id: *mut rdma_cm_id,
    pub listen_id: *mut rdma_cm_id,
    pub event: c_int,
    pub status: c_int,
    pub param: rdma_cm_event_param,
}

/// `struct rdma_addrinfo`.
#[repr(C)]
pub struct rdma_addrinfo {
    pub ai_flags: c_int,
    pub ai_family: c_int,
    pub ai_qp_type: c_int,
    pub ai_port_space: c_int,
    pub ai_src_len: socklen_t,
    pub ai_dst_len: socklen_t,
    pub ai_src_addr: *mut sockaddr,
    pub ai_dst_addr: *mut sockaddr,
    pub ai_src_canonname: *mut c_char,
    pub ai_dst_canonname: *mut c_char,
    pub ai_route_len: usize,
    pub ai_route: *mut c_void,
    pub ai_connect_len: usize,
    pub ai_connect: *mut c_void,
    pub ai_next: *mut Self,
}

/// `struct rdma_cm_join_mc_attr_ex`.
#[repr(C)]
pub struct rdma_cm_join_mc_attr_ex {
    pub comp_mask: u32,
    pub join_flags: u32,
    pub addr: *mut sockaddr,
}

/// The private entry table `libibverbs.so.1` of this workspace exports as
/// `softverbs_rdmacm_ops@@SOFTVERBS_PRIVATE_1` (a function returning a pointer to it). The
/// connection manager must run in the one copy of the core inside `libibverbs.so.1`, beside the
/// `ibv_*` objects the ids refer to, so `librdmacm.so.1` forwards these calls there. This file
/// is compiled into both libraries, so both see one definition.
#[repr(C)]
pub struct RdmacmOps {
    /// `size_of::<RdmacmOps>()` of the library that filled it: a mismatch means the two
    /// libraries come from different builds.
    pub size: usize,
    pub create_event_channel: unsafe extern "C" fn() -> *mut rdma_event_channel,
    pub destroy_event_channel: unsafe extern "C" fn(*mut rdma_event_channel),
    pub create_id:
        unsafe extern "C" fn(*mut rdma_event_channel, *mut *mut rdma_cm_id, *mut c_void, c_int) -> c_int,
    pub destroy_id: unsafe extern "C" fn(*mut rdma_cm_id) -> c_int,
    pub bind_addr: unsafe extern "C" fn(*mut rdma_cm_id, *mut sockaddr) -> c_int,
    pub resolve_addr: unsafe extern "C" fn(*mut rdma_cm_id, *mut sockaddr, *mut sockaddr, c_int) -> c_int,
    pub resolve_route: unsafe extern "C" fn(*mut rdma_cm_id, c_int) -> c_int,
    pub listen: unsafe extern "C" fn(*mut rdma_cm_id, c_int) -> c_int,
    pub connect: unsafe extern "C" fn(*mut rdma_cm_id, *mut rdma_conn_param) -> c_int,
    pub accept: unsafe extern "C" fn(*mut rdma_cm_id, *mut rdma_conn_param) -> c_int,
    pub reject: unsafe extern "C" fn(*mut rdma_cm_id, *const c_void, u8) -> c_int,
    pub disconnect: unsafe extern "C" fn(*mut rdma_cm_id) -> c_int,
    pub establish: unsafe extern "C" fn(*mut rdma_cm_id) -> c_int,
    pub notify: unsafe extern "C" fn(*mut rdma_cm_id, c_int) -> c_int,
    pub get_cm_event: unsafe extern "C" fn(*mut rdma_event_channel, *mut *mut rdma_cm_event) -> c_int,
    pub ack_cm_event: unsafe extern "C" fn(*mut rdma_cm_event) -> c_int,
    pub create_qp: unsafe extern "C" fn(*mut rdma_cm_id, *mut c_void, *mut c_void) -> c_int,
    pub create_qp_ex: unsafe extern "C" fn(*mut rdma_cm_id, *mut c_void) -> c_int,
    pub destroy_qp: unsafe extern "C" fn(*mut rdma_cm_id),
    pub create_srq: unsafe extern "C" fn(*mut rdma_cm_id, *mut c_void, *mut c_void) -> c_int,
    pub destroy_srq: unsafe extern "C" fn(*mut rdma_cm_id),
    pub init_qp_attr: unsafe extern "C" fn(*mut rdma_cm_id, *mut c_void, *mut c_int) -> c_int,
    pub set_option: unsafe extern "C" fn(*mut rdma_cm_id, c_int, c_int, *mut c_void, usize) -> c_int,
    pub migrate_id: unsafe extern "C" fn(*mut rdma_cm_id, *mut rdma_event_channel) -> c_int,
    pub get_devices: unsafe extern "C" fn(*mut c_int) -> *mut *mut c_void,
    pub free_devices: unsafe extern "C" fn(*mut *mut c_void),
    pub join_multicast: unsafe extern "C" fn(*mut rdma_cm_id, *mut sockaddr, *mut c_void) -> c_int,
    pub leave_multicast: unsafe extern "C" fn(*mut rdma_cm_id, *mut sockaddr) -> c_int,
    /// `rdma_join_multicast_ex` with the group and whether the join is send-only.
    pub join_multicast_ex: unsafe extern "C" fn(*mut rdma_cm_id, *mut sockaddr, c_int, *mut c_void) -> c_int,
    pub getaddrinfo: unsafe extern "C" fn(
        *const c_char,
        *const c_char,
        *const rdma_addrinfo,
        *mut *mut rdma_addrinfo,
    ) -> c_int,
    pub freeaddrinfo: unsafe extern "C" fn(*mut rdma_addrinfo),
    pub create_ep:
        unsafe extern "C" fn(*mut *mut rdma_cm_id, *mut rdma_addrinfo, *mut c_void, *mut c_void) -> c_int,
    pub destroy_ep: unsafe extern "C" fn(*mut rdma_cm_id),
    pub get_request: unsafe extern "C" fn(*mut rdma_cm_id, *mut *mut rdma_cm_id) -> c_int,
    pub create_srq_ex: unsafe extern "C" fn(*mut rdma_cm_id, *mut c_void) -> c_int,
    pub reject_ece: unsafe extern "C" fn(*mut rdma_cm_id, *const c_void, u8) -> c_int,
    pub set_local_ece: unsafe extern "C" fn(*mut rdma_cm_id, *mut ibv_ece) -> c_int,
    pub get_remote_ece: unsafe extern "C" fn(*mut rdma_cm_id, *mut ibv_ece) -> c_int,
    // rsockets (`<rdma/rsocket.h>`), with their C signatures; `rfcntl` takes its one
    // argument as an int.
    pub rsocket: unsafe extern "C" fn(c_int, c_int, c_int) -> c_int,
    pub rbind: unsafe extern "C" fn(c_int, *const sockaddr, socklen_t) -> c_int,
    pub rlisten: unsafe extern "C" fn(c_int, c_int) -> c_int,
    pub raccept: unsafe extern "C" fn(c_int, *mut sockaddr, *mut socklen_t) -> c_int,
    pub rconnect: unsafe extern "C" fn(c_int, *const sockaddr, socklen_t) -> c_int,
    pub rshutdown: unsafe extern "C" fn(c_int, c_int) -> c_int,
    pub rclose: unsafe extern "C" fn(c_int) -> c_int,
    pub rrecv: unsafe extern "C" fn(c_int, *mut c_void, usize, c_int) -> ssize_t,
    pub rrecvfrom:
        unsafe extern "C" fn(c_int, *mut c_void, usize, c_int, *mut sockaddr, *mut socklen_t) -> ssize_t,
    pub rrecvmsg: unsafe extern "C" fn(c_int, *mut msghdr, c_int) -> ssize_t,
    pub rsend: unsafe extern "C" fn(c_int, *const c_void, usize, c_int) -> ssize_t,
    pub rsendto:
        unsafe extern "C" fn(c_int, *const c_void, usize, c_int, *const sockaddr, socklen_t) -> ssize_t,
    pub rsendmsg: unsafe extern "C" fn(c_int, *const msghdr, c_int) -> ssize_t,
    pub rread: unsafe extern "C" fn(c_int, *mut c_void, usize) -> ssize_t,
    pub rreadv: unsafe extern "C" fn(c_int, *const iovec, c_int) -> ssize_t,
    pub rwrite: unsafe extern "C" fn(c_int, *const c_void, usize) -> ssize_t,
    pub rwritev: unsafe extern "C" fn(c_int, *const iovec, c_int) -> ssize_t,
    pub rpoll: unsafe extern "C" fn(*mut pollfd, nfds_t, c_int) -> c_int,
    pub rselect: unsafe extern "C" fn(c_int, *mut fd_set, *mut fd_set, *mut fd_set, *mut timeval) -> c_int,
    pub rgetpeername: unsafe extern "C" fn(c_int, *mut sockaddr, *mut socklen_t) -> c_int,
    pub rgetsockname: unsafe extern "C" fn(c_int, *mut sockaddr, *mut socklen_t) -> c_int,
    pub rsetsockopt: unsafe extern "C" fn(c_int, c_int, c_int, *const c_void, socklen_t) -> c_int,
    pub rgetsockopt: unsafe extern "C" fn(c_int, c_int, c_int, *mut c_void, *mut socklen_t) -> c_int,
    pub rfcntl: unsafe extern "C" fn(c_int, c_int, c_int) -> c_int,
    pub riomap: unsafe extern "C" fn(c_int, *mut c_void, usize, c_int, c_int, off_t) -> off_t,
    pub riounmap: unsafe extern "C" fn(c_int, *mut c_void, usize) -> c_int,
    pub riowrite: unsafe extern "C" fn(c_int, *const c_void, usize, off_t, c_int) -> usize,
}
