//! `repr(C)` mirrors of the `<infiniband/verbs.h>` structures (rdma-core 44), field for field.
//!
//! Function pointers the library never calls or fills are kept as opaque `*const c_void` slots of
//! the same size. `tests` in `lib.rs` checks every size and offset against the system header.
#![allow(non_camel_case_types, non_snake_case)]
// Each item names its C definition; the fields are the header's, one for one, so the header
// documents them.
#![allow(missing_docs)]
// The mirrors spell out C type names, as the header does, rather than `Self`.
#![allow(clippy::use_self)]

use std::ffi::{c_char, c_int, c_uint, c_void};

/// `pthread_mutex_t` (40 bytes on x86_64 glibc); all-zero is `PTHREAD_MUTEX_INITIALIZER`.
#[repr(C, align(8))]
#[derive(Clone, Copy)]
pub struct pthread_mutex_t(pub [u8; 40]);

/// `pthread_cond_t` (48 bytes); all-zero is `PTHREAD_COND_INITIALIZER`.
#[repr(C, align(8))]
#[derive(Clone, Copy)]
pub struct pthread_cond_t(pub [u8; 48]);

/// `IBV_SYSFS_NAME_MAX`.
pub const IBV_SYSFS_NAME_MAX: usize = 64;
/// `IBV_SYSFS_PATH_MAX`.
pub const IBV_SYSFS_PATH_MAX: usize = 256;

/// `struct _ibv_device_ops`.
#[repr(C)]
pub struct _ibv_device_ops {
    pub _dummy1: *const c_void,
    pub _dummy2: *const c_void,
}

/// `struct ibv_device`.
#[repr(C)]
pub struct ibv_device {
    pub _ops: _ibv_device_ops,
    pub node_type: c_int,
    pub transport_type: c_int,
    pub name: [c_char; IBV_SYSFS_NAME_MAX],
    pub dev_name: [c_char; IBV_SYSFS_NAME_MAX],
    pub dev_path: [c_char; IBV_SYSFS_PATH_MAX],
    pub ibdev_path: [c_char; IBV_SYSFS_PATH_MAX],
}

/// The type of `ibv_context_ops.poll_cq`: `ibv_poll_cq`.
pub type PollCqFn = unsafe extern "C" fn(*mut ibv_cq, c_int, *mut ibv_wc) -> c_int;
/// The type of `ibv_context_ops.req_notify_cq`: `ibv_req_notify_cq`.
pub type ReqNotifyFn = unsafe extern "C" fn(*mut ibv_cq, c_int) -> c_int;
/// The type of `ibv_context_ops.post_srq_recv`: `ibv_post_srq_recv`.
pub type PostSrqRecvFn = unsafe extern "C" fn(*mut ibv_srq, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int;
/// The type of `ibv_context_ops.post_send`: `ibv_post_send`.
pub type PostSendFn = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> c_int;
/// The type of `ibv_context_ops.post_recv`: `ibv_post_recv`.
pub type PostRecvFn = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int;

/// `struct ibv_context_ops`.
#[repr(C)]
pub struct ibv_context_ops {
    pub _compat_query_device: Option<unsafe extern "C" fn(*mut ibv_context, *mut ibv_device_attr) -> c_int>,
    pub _compat_query_port: Option<unsafe extern "C" fn(*mut ibv_context, u8, *mut ibv_port_attr) -> c_int>,
    pub _compat_alloc_pd: *const c_void,
    pub _compat_dealloc_pd: *const c_void,
    pub _compat_reg_mr: *const c_void,
    pub _compat_rereg_mr: *const c_void,
    pub _compat_dereg_mr: *const c_void,
    pub alloc_mw: *const c_void,
    pub bind_mw: *const c_void,
    pub dealloc_mw: *const c_void,
    pub _compat_create_cq: *const c_void,
    pub poll_cq: Option<PollCqFn>,
    pub req_notify_cq: Option<ReqNotifyFn>,
    pub _compat_cq_event: *const c_void,
    pub _compat_resize_cq: *const c_void,
    pub _compat_destroy_cq: *const c_void,
    pub _compat_create_srq: *const c_void,
    pub _compat_modify_srq: *const c_void,
    pub _compat_query_srq: *const c_void,
    pub _compat_destroy_srq: *const c_void,
    pub post_srq_recv: Option<PostSrqRecvFn>,
    pub _compat_create_qp: *const c_void,
    pub _compat_query_qp: *const c_void,
    pub _compat_modify_qp: *const c_void,
    pub _compat_destroy_qp: *const c_void,
    pub post_send: Option<PostSendFn>,
    pub post_recv: Option<PostRecvFn>,
    pub _compat_create_ah: *const c_void,
    pub _compat_destroy_ah: *const c_void,
    pub _compat_attach_mcast: *const c_void,
    pub _compat_detach_mcast: *const c_void,
    pub _compat_async_event: *const c_void,
}

/// `struct ibv_context`.
#[repr(C)]
pub struct ibv_context {
    pub device: *mut ibv_device,
    pub ops: ibv_context_ops,
    pub cmd_fd: c_int,
    pub async_fd: c_int,
    pub num_comp_vectors: c_int,
    pub mutex: pthread_mutex_t,
    pub abi_compat: *mut c_void,
}

/// The type of `verbs_context.query_port`: `ibv_query_port` with the caller's struct size.
pub type QueryPortFn = unsafe extern "C" fn(*mut ibv_context, u8, *mut ibv_port_attr, usize) -> c_int;
/// The type of `verbs_context.create_cq_ex`: `ibv_create_cq_ex`.
pub type CreateCqExFn = unsafe extern "C" fn(*mut ibv_context, *mut ibv_cq_init_attr_ex) -> *mut ibv_cq_ex;
/// The type of `verbs_context.query_device_ex`: `ibv_query_device_ex` with the caller's struct size.
pub type QueryDeviceExFn = unsafe extern "C" fn(
    *mut ibv_context,
    *const ibv_query_device_ex_input,
    *mut ibv_device_attr_ex,
    usize,
) -> c_int;
/// The type of `verbs_context.create_qp_ex`: `ibv_create_qp_ex`.
pub type CreateQpExFn = unsafe extern "C" fn(*mut ibv_context, *mut ibv_qp_init_attr_ex) -> *mut ibv_qp;
/// The type of `verbs_context.get_srq_num`: `ibv_get_srq_num`.
pub type GetSrqNumFn = unsafe extern "C" fn(*mut ibv_srq, *mut u32) -> c_int;
/// The type of `verbs_context.create_srq_ex`: `ibv_create_srq_ex`.
pub type CreateSrqExFn = unsafe extern "C" fn(*mut ibv_context, *mut ibv_srq_init_attr_ex) -> *mut ibv_srq;
/// The type of `verbs_context.open_xrcd`: `ibv_open_xrcd`.
pub type OpenXrcdFn = unsafe extern "C" fn(*mut ibv_context, *mut ibv_xrcd_init_attr) -> *mut ibv_xrcd;
/// The type of `verbs_context.close_xrcd`: `ibv_close_xrcd`.
pub type CloseXrcdFn = unsafe extern "C" fn(*mut ibv_xrcd) -> c_int;
/// The type of `verbs_context.open_qp`: `ibv_open_qp`.
pub type OpenQpFn = unsafe extern "C" fn(*mut ibv_context, *mut ibv_qp_open_attr) -> *mut ibv_qp;
/// The type of `ibv_qp_ex.wr_atomic_write`: `ibv_wr_atomic_write`.
pub type WrAtomicWriteFn = unsafe extern "C" fn(*mut ibv_qp_ex, u32, u64, *const c_void);
/// The type of `verbs_context.advise_mr`: `ibv_advise_mr`.
pub type AdviseMrFn = unsafe extern "C" fn(*mut ibv_pd, u32, u32, *mut ibv_sge, u32) -> c_int;
/// The type of `verbs_context.query_rt_values`: `ibv_query_rt_values_ex`.
pub type QueryRtValuesFn = unsafe extern "C" fn(*mut ibv_context, *mut ibv_values_ex) -> c_int;

/// `struct timespec` (64-bit Linux).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct timespec {
    pub tv_sec: i64,
    pub tv_nsec: i64,
}

/// `struct ibv_values_ex` (`ibv_query_rt_values_ex`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_values_ex {
    pub comp_mask: u32,
    pub raw_clock: timespec,
}

/// `struct verbs_context`.
#[repr(C)]
pub struct verbs_context {
    pub query_port: Option<QueryPortFn>,
    pub advise_mr: Option<AdviseMrFn>,
    pub alloc_null_mr: *const c_void,
    pub read_counters: *const c_void,
    pub attach_counters_point_flow: *const c_void,
    pub create_counters: *const c_void,
    pub destroy_counters: *const c_void,
    pub reg_dm_mr: *const c_void,
    pub alloc_dm: *const c_void,
    pub free_dm: *const c_void,
    pub modify_flow_action_esp: *const c_void,
    pub destroy_flow_action: *const c_void,
    pub create_flow_action_esp: *const c_void,
    pub modify_qp_rate_limit: *const c_void,
    pub alloc_parent_domain: *const c_void,
    pub dealloc_td: *const c_void,
    pub alloc_td: *const c_void,
    pub modify_cq: *const c_void,
    pub post_srq_ops: Option<PostSrqOpsFn>,
    pub destroy_rwq_ind_table: *const c_void,
    pub create_rwq_ind_table: *const c_void,
    pub destroy_wq: *const c_void,
    pub modify_wq: *const c_void,
    pub create_wq: *const c_void,
    pub query_rt_values: Option<QueryRtValuesFn>,
    pub create_cq_ex: Option<CreateCqExFn>,
    pub priv_: *mut c_void,
    pub query_device_ex: Option<QueryDeviceExFn>,
    pub ibv_destroy_flow: *const c_void,
    pub ABI_placeholder2: *const c_void,
    pub ibv_create_flow: *const c_void,
    pub ABI_placeholder1: *const c_void,
    pub open_qp: Option<OpenQpFn>,
    pub create_qp_ex: Option<CreateQpExFn>,
    pub get_srq_num: Option<GetSrqNumFn>,
    pub create_srq_ex: Option<CreateSrqExFn>,
    pub open_xrcd: Option<OpenXrcdFn>,
    pub close_xrcd: Option<CloseXrcdFn>,
    pub _ABI_placeholder3: u64,
    pub sz: usize,
    pub context: ibv_context,
}

/// `struct ibv_device_attr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_device_attr {
    pub fw_ver: [c_char; 64],
    pub node_guid: u64,
    pub sys_image_guid: u64,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_qp: c_int,
    pub max_qp_wr: c_int,
    pub device_cap_flags: c_uint,
    pub max_sge: c_int,
    pub max_sge_rd: c_int,
    pub max_cq: c_int,
    pub max_cqe: c_int,
    pub max_mr: c_int,
    pub max_pd: c_int,
    pub max_qp_rd_atom: c_int,
    pub max_ee_rd_atom: c_int,
    pub max_res_rd_atom: c_int,
    pub max_qp_init_rd_atom: c_int,
    pub max_ee_init_rd_atom: c_int,
    pub atomic_cap: c_uint,
    pub max_ee: c_int,
    pub max_rdd: c_int,
    pub max_mw: c_int,
    pub max_raw_ipv6_qp: c_int,
    pub max_raw_ethy_qp: c_int,
    pub max_mcast_grp: c_int,
    pub max_mcast_qp_attach: c_int,
    pub max_total_mcast_qp_attach: c_int,
    pub max_ah: c_int,
    pub max_fmr: c_int,
    pub max_map_per_fmr: c_int,
    pub max_srq: c_int,
    pub max_srq_wr: c_int,
    pub max_srq_sge: c_int,
    pub max_pkeys: u16,
    pub local_ca_ack_delay: u8,
    pub phys_port_cnt: u8,
}

/// `struct ibv_odp_per_transport_caps`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_odp_per_transport_caps {
    pub rc_odp_caps: u32,
    pub uc_odp_caps: u32,
    pub ud_odp_caps: u32,
}

/// `struct ibv_odp_caps`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_odp_caps {
    pub general_caps: u64,
    pub per_transport_caps: ibv_odp_per_transport_caps,
}

/// `struct ibv_tso_caps`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_tso_caps {
    pub max_tso: u32,
    pub supported_qpts: u32,
}

/// `struct ibv_rss_caps`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_rss_caps {
    pub supported_qpts: u32,
    pub max_rwq_indirection_tables: u32,
    pub max_rwq_indirection_table_size: u32,
    pub rx_hash_fields_mask: u64,
    pub rx_hash_function: u8,
}

/// `struct ibv_packet_pacing_caps`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_packet_pacing_caps {
    pub qp_rate_limit_min: u32,
    pub qp_rate_limit_max: u32,
    pub supported_qpts: u32,
}

/// `struct ibv_tm_caps`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_tm_caps {
    pub max_rndv_hdr_size: u32,
    pub max_num_tags: u32,
    pub flags: u32,
    pub max_ops: u32,
    pub max_sge: u32,
}

/// `struct ibv_cq_moderation_caps`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_cq_moderation_caps {
    pub max_cq_count: u16,
    pub max_cq_period: u16,
}

/// `struct ibv_pci_atomic_caps`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_pci_atomic_caps {
    pub fetch_add: u16,
    pub swap: u16,
    pub compare_swap: u16,
}

/// `struct ibv_device_attr_ex`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_device_attr_ex {
    pub orig_attr: ibv_device_attr,
    pub comp_mask: u32,
    pub odp_caps: ibv_odp_caps,
    pub completion_timestamp_mask: u64,
    pub hca_core_clock: u64,
    pub device_cap_flags_ex: u64,
    pub tso_caps: ibv_tso_caps,
    pub rss_caps: ibv_rss_caps,
    pub max_wq_type_rq: u32,
    pub packet_pacing_caps: ibv_packet_pacing_caps,
    pub raw_packet_caps: u32,
    pub tm_caps: ibv_tm_caps,
    pub cq_mod_caps: ibv_cq_moderation_caps,
    pub max_dm_size: u64,
    pub pci_atomic_caps: ibv_pci_atomic_caps,
    pub xrc_odp_caps: u32,
    pub phys_port_cnt_ex: u32,
}

/// `struct ibv_query_device_ex_input`.
#[repr(C)]
pub struct ibv_query_device_ex_input {
    pub comp_mask: u32,
}

/// `struct ibv_port_attr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_port_attr {
    pub state: c_uint,
    pub max_mtu: c_uint,
    pub active_mtu: c_uint,
    pub gid_tbl_len: c_int,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub link_layer: u8,
    pub flags: u8,
    pub port_cap_flags2: u16,
}

/// Bytes of `struct _compat_ibv_port_attr`: `ibv_port_attr` without `port_cap_flags2`.
pub const COMPAT_PORT_ATTR_SIZE: usize = 48;

/// `union ibv_gid`: 16 bytes, aligned as its `__be64` members.
#[repr(C, align(8))]
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub struct ibv_gid {
    pub raw: [u8; 16],
}

/// `struct ibv_global_route`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_global_route {
    pub dgid: ibv_gid,
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

/// `struct ibv_ah_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_ah_attr {
    pub grh: ibv_global_route,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

/// `struct ibv_qp_cap`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_qp_cap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

/// `struct ibv_qp_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_qp_attr {
    pub qp_state: c_uint,
    pub cur_qp_state: c_uint,
    pub path_mtu: c_uint,
    pub path_mig_state: c_uint,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: c_uint,
    pub cap: ibv_qp_cap,
    pub ah_attr: ibv_ah_attr,
    pub alt_ah_attr: ibv_ah_attr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

/// `struct ibv_qp_init_attr`.
#[repr(C)]
pub struct ibv_qp_init_attr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub cap: ibv_qp_cap,
    pub qp_type: c_uint,
    pub sq_sig_all: c_int,
}

/// `struct ibv_rx_hash_conf`.
#[repr(C)]
pub struct ibv_rx_hash_conf {
    pub rx_hash_function: u8,
    pub rx_hash_key_len: u8,
    pub rx_hash_key: *mut u8,
    pub rx_hash_fields_mask: u64,
}

/// `struct ibv_qp_init_attr_ex`.
#[repr(C)]
pub struct ibv_qp_init_attr_ex {
    pub qp_context: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub cap: ibv_qp_cap,
    pub qp_type: c_uint,
    pub sq_sig_all: c_int,
    pub comp_mask: u32,
    pub pd: *mut ibv_pd,
    pub xrcd: *mut ibv_xrcd,
    pub create_flags: u32,
    pub max_tso_header: u16,
    pub rwq_ind_tbl: *mut c_void,
    pub rx_hash_conf: ibv_rx_hash_conf,
    pub source_qpn: u32,
    pub send_ops_flags: u64,
}

/// `IBV_QP_INIT_ATTR_PD`.
pub const IBV_QP_INIT_ATTR_PD: u32 = 1;
/// `IBV_QP_INIT_ATTR_XRCD`.
pub const IBV_QP_INIT_ATTR_XRCD: u32 = 1 << 1;
/// `IBV_QP_INIT_ATTR_CREATE_FLAGS`.
pub const IBV_QP_INIT_ATTR_CREATE_FLAGS: u32 = 1 << 2;
/// `IBV_QP_INIT_ATTR_SEND_OPS_FLAGS`.
pub const IBV_QP_INIT_ATTR_SEND_OPS_FLAGS: u32 = 1 << 6;

/// `struct ibv_sge`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// `struct ibv_send_wr_rdma`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_send_wr_rdma {
    pub remote_addr: u64,
    pub rkey: u32,
}

/// `struct ibv_send_wr_atomic`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_send_wr_atomic {
    pub remote_addr: u64,
    pub compare_add: u64,
    pub swap: u64,
    pub rkey: u32,
}

/// `struct ibv_send_wr_ud`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_send_wr_ud {
    pub ah: *mut ibv_ah,
    pub remote_qpn: u32,
    pub remote_qkey: u32,
}

/// `union ibv_send_wr_wr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union ibv_send_wr_wr {
    pub rdma: ibv_send_wr_rdma,
    pub atomic: ibv_send_wr_atomic,
    pub ud: ibv_send_wr_ud,
}

/// `struct ibv_mw_bind_info`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_mw_bind_info {
    pub mr: *mut ibv_mr,
    pub addr: u64,
    pub length: u64,
    pub mw_access_flags: c_uint,
}

/// `struct ibv_send_wr_bind_mw`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_send_wr_bind_mw {
    pub mw: *mut c_void,
    pub rkey: u32,
    pub bind_info: ibv_mw_bind_info,
}

/// `struct ibv_send_wr_tso`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_send_wr_tso {
    pub hdr: *mut c_void,
    pub hdr_sz: u16,
    pub mss: u16,
}

/// `union ibv_send_wr_ext`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union ibv_send_wr_ext {
    pub bind_mw: ibv_send_wr_bind_mw,
    pub tso: ibv_send_wr_tso,
}

/// `struct ibv_send_wr`.
#[repr(C)]
pub struct ibv_send_wr {
    pub wr_id: u64,
    pub next: *mut ibv_send_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
    pub opcode: c_uint,
    pub send_flags: c_uint,
    /// `imm_data` (big-endian) or `invalidate_rkey`.
    pub imm_data: u32,
    pub wr: ibv_send_wr_wr,
    /// `qp_type.xrc.remote_srqn`.
    pub remote_srqn: u32,
    pub ext: ibv_send_wr_ext,
}

/// `struct ibv_recv_wr`.
#[repr(C)]
pub struct ibv_recv_wr {
    pub wr_id: u64,
    pub next: *mut ibv_recv_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
}

/// `struct ibv_wc`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_wc {
    pub wr_id: u64,
    pub status: c_uint,
    pub opcode: c_uint,
    pub vendor_err: u32,
    pub byte_len: u32,
    /// `imm_data` (big-endian) or `invalidated_rkey`.
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: c_uint,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

/// `struct ibv_pd`.
#[repr(C)]
pub struct ibv_pd {
    pub context: *mut ibv_context,
    pub handle: u32,
}

/// `struct ibv_mr`.
#[repr(C)]
pub struct ibv_mr {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

/// `struct ibv_comp_channel`.
#[repr(C)]
pub struct ibv_comp_channel {
    pub context: *mut ibv_context,
    pub fd: c_int,
    pub refcnt: c_int,
}

/// `struct ibv_cq`.
#[repr(C)]
pub struct ibv_cq {
    pub context: *mut ibv_context,
    pub channel: *mut ibv_comp_channel,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub comp_events_completed: u32,
    pub async_events_completed: u32,
}

/// `struct ibv_poll_cq_attr`.
#[repr(C)]
pub struct ibv_poll_cq_attr {
    pub comp_mask: u32,
}

/// A `struct ibv_cq_ex` reader (`read_opcode`, `read_byte_len`, ...) returning `R`.
pub type CqExFn<R> = unsafe extern "C" fn(*mut ibv_cq_ex) -> R;

/// `struct ibv_cq_ex`.
#[repr(C)]
pub struct ibv_cq_ex {
    pub context: *mut ibv_context,
    pub channel: *mut ibv_comp_channel,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub comp_events_completed: u32,
    pub async_events_completed: u32,
    pub comp_mask: u32,
    pub status: c_uint,
    pub wr_id: u64,
    pub start_poll: Option<unsafe extern "C" fn(*mut ibv_cq_ex, *mut ibv_poll_cq_attr) -> c_int>,
    pub next_poll: Option<CqExFn<c_int>>,
    pub end_poll: Option<CqExFn<()>>,
    pub read_opcode: Option<CqExFn<c_uint>>,
    pub read_vendor_err: Option<CqExFn<u32>>,
    pub read_byte_len: Option<CqExFn<u32>>,
    pub read_imm_data: Option<CqExFn<u32>>,
    pub read_qp_num: Option<CqExFn<u32>>,
    pub read_src_qp: Option<CqExFn<u32>>,
    pub read_wc_flags: Option<CqExFn<c_uint>>,
    pub read_slid: Option<CqExFn<u32>>,
    pub read_sl: Option<CqExFn<u8>>,
    pub read_dlid_path_bits: Option<CqExFn<u8>>,
    pub read_completion_ts: Option<CqExFn<u64>>,
    pub read_cvlan: Option<CqExFn<u16>>,
    pub read_flow_tag: Option<CqExFn<u32>>,
    pub read_tm_info: Option<unsafe extern "C" fn(*mut ibv_cq_ex, *mut ibv_wc_tm_info)>,
    pub read_completion_wallclock_ns: Option<CqExFn<u64>>,
}

/// `struct ibv_cq_init_attr_ex`.
#[repr(C)]
pub struct ibv_cq_init_attr_ex {
    pub cqe: u32,
    pub cq_context: *mut c_void,
    pub channel: *mut ibv_comp_channel,
    pub comp_vector: u32,
    pub wc_flags: u64,
    pub comp_mask: u32,
    pub flags: u32,
    pub parent_domain: *mut ibv_pd,
}

/// `struct ibv_srq_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_srq_attr {
    pub max_wr: u32,
    pub max_sge: u32,
    pub srq_limit: u32,
}

/// `struct ibv_srq_init_attr`.
#[repr(C)]
pub struct ibv_srq_init_attr {
    pub srq_context: *mut c_void,
    pub attr: ibv_srq_attr,
}

/// `struct ibv_tm_cap`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_tm_cap {
    pub max_num_tags: u32,
    pub max_ops: u32,
}

/// `struct ibv_srq_init_attr_ex`.
#[repr(C)]
pub struct ibv_srq_init_attr_ex {
    pub srq_context: *mut c_void,
    pub attr: ibv_srq_attr,
    pub comp_mask: u32,
    pub srq_type: c_uint,
    pub pd: *mut ibv_pd,
    pub xrcd: *mut ibv_xrcd,
    pub cq: *mut ibv_cq,
    pub tm_cap: ibv_tm_cap,
}

/// `IBV_SRQ_INIT_ATTR_TYPE`.
pub const IBV_SRQ_INIT_ATTR_TYPE: u32 = 1;
/// `IBV_SRQ_INIT_ATTR_PD`.
pub const IBV_SRQ_INIT_ATTR_PD: u32 = 1 << 1;
/// `IBV_SRQT_BASIC`.
pub const IBV_SRQT_BASIC: u32 = 0;
/// `IBV_SRQT_XRC`.
pub const IBV_SRQT_XRC: u32 = 1;
/// `IBV_SRQ_INIT_ATTR_XRCD`.
pub const IBV_SRQ_INIT_ATTR_XRCD: u32 = 1 << 2;
/// `IBV_SRQ_INIT_ATTR_CQ`.
pub const IBV_SRQ_INIT_ATTR_CQ: u32 = 1 << 3;
/// `IBV_SRQ_INIT_ATTR_TM`.
pub const IBV_SRQ_INIT_ATTR_TM: u32 = 1 << 4;
/// `IBV_SRQT_TM`.
pub const IBV_SRQT_TM: u32 = 2;
/// `IBV_WC_EX_WITH_TM_INFO`.
pub const IBV_WC_EX_WITH_TM_INFO: u64 = 1 << 10;

/// The type of `verbs_context.post_srq_ops`: `ibv_post_srq_ops`.
pub type PostSrqOpsFn = unsafe extern "C" fn(*mut ibv_srq, *mut ibv_ops_wr, *mut *mut ibv_ops_wr) -> c_int;

/// `struct ibv_ops_wr_add`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_ops_wr_add {
    pub recv_wr_id: u64,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
    pub tag: u64,
    pub mask: u64,
}

/// `struct ibv_ops_wr_tm`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_ops_wr_tm {
    pub unexpected_cnt: u32,
    pub handle: u32,
    pub add: ibv_ops_wr_add,
}

/// `struct ibv_ops_wr`.
#[repr(C)]
pub struct ibv_ops_wr {
    pub wr_id: u64,
    pub next: *mut ibv_ops_wr,
    pub opcode: c_uint,
    pub flags: c_int,
    pub tm: ibv_ops_wr_tm,
}

/// `struct ibv_wc_tm_info`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_wc_tm_info {
    pub tag: u64,
    pub priv_: u32,
}

/// `struct ibv_srq`.
#[repr(C)]
pub struct ibv_srq {
    pub context: *mut ibv_context,
    pub srq_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub handle: u32,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub events_completed: u32,
}

/// `struct ibv_qp`.
#[repr(C)]
pub struct ibv_qp {
    pub context: *mut ibv_context,
    pub qp_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub handle: u32,
    pub qp_num: u32,
    pub state: c_uint,
    pub qp_type: c_uint,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub events_completed: u32,
}

/// `struct ibv_data_buf`.
#[repr(C)]
pub struct ibv_data_buf {
    pub addr: *mut c_void,
    pub length: usize,
}

/// A `struct ibv_qp_ex` work-request setter (`wr_set_*`, ...) taking `A`.
pub type QpExFn<A> = unsafe extern "C" fn(*mut ibv_qp_ex, A);

/// `struct ibv_qp_ex`.
#[repr(C)]
pub struct ibv_qp_ex {
    pub qp_base: ibv_qp,
    pub comp_mask: u64,
    pub wr_id: u64,
    pub wr_flags: c_uint,
    pub wr_atomic_cmp_swp: Option<unsafe extern "C" fn(*mut ibv_qp_ex, u32, u64, u64, u64)>,
    pub wr_atomic_fetch_add: Option<unsafe extern "C" fn(*mut ibv_qp_ex, u32, u64, u64)>,
    pub wr_bind_mw: *const c_void,
    pub wr_local_inv: *const c_void,
    pub wr_rdma_read: Option<unsafe extern "C" fn(*mut ibv_qp_ex, u32, u64)>,
    pub wr_rdma_write: Option<unsafe extern "C" fn(*mut ibv_qp_ex, u32, u64)>,
    pub wr_rdma_write_imm: Option<unsafe extern "C" fn(*mut ibv_qp_ex, u32, u64, u32)>,
    pub wr_send: Option<unsafe extern "C" fn(*mut ibv_qp_ex)>,
    pub wr_send_imm: Option<QpExFn<u32>>,
    pub wr_send_inv: Option<QpExFn<u32>>,
    pub wr_send_tso: *const c_void,
    pub wr_set_ud_addr: Option<unsafe extern "C" fn(*mut ibv_qp_ex, *mut ibv_ah, u32, u32)>,
    pub wr_set_xrc_srqn: Option<QpExFn<u32>>,
    pub wr_set_inline_data: Option<unsafe extern "C" fn(*mut ibv_qp_ex, *mut c_void, usize)>,
    pub wr_set_inline_data_list: Option<unsafe extern "C" fn(*mut ibv_qp_ex, usize, *const ibv_data_buf)>,
    pub wr_set_sge: Option<unsafe extern "C" fn(*mut ibv_qp_ex, u32, u64, u32)>,
    pub wr_set_sge_list: Option<unsafe extern "C" fn(*mut ibv_qp_ex, usize, *const ibv_sge)>,
    pub wr_start: Option<unsafe extern "C" fn(*mut ibv_qp_ex)>,
    pub wr_complete: Option<unsafe extern "C" fn(*mut ibv_qp_ex) -> c_int>,
    pub wr_abort: Option<unsafe extern "C" fn(*mut ibv_qp_ex)>,
    pub wr_atomic_write: Option<WrAtomicWriteFn>,
}

/// `struct ibv_ah`.
#[repr(C)]
pub struct ibv_ah {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub handle: u32,
}

/// `struct ibv_xrcd`.
#[repr(C)]
pub struct ibv_xrcd {
    pub context: *mut ibv_context,
}

/// `struct ibv_xrcd_init_attr`.
#[repr(C)]
pub struct ibv_xrcd_init_attr {
    pub comp_mask: u32,
    pub fd: c_int,
    pub oflags: c_int,
}

/// `IBV_XRCD_INIT_ATTR_FD`.
pub const IBV_XRCD_INIT_ATTR_FD: u32 = 1;
/// `IBV_XRCD_INIT_ATTR_OFLAGS`.
pub const IBV_XRCD_INIT_ATTR_OFLAGS: u32 = 1 << 1;
/// `IBV_XRCD_INIT_ATTR_RESERVED`.
pub const IBV_XRCD_INIT_ATTR_RESERVED: u32 = 1 << 2;

/// `struct ibv_qp_open_attr`.
#[repr(C)]
pub struct ibv_qp_open_attr {
    pub comp_mask: u32,
    pub qp_num: u32,
    pub xrcd: *mut ibv_xrcd,
    pub qp_context: *mut c_void,
    pub qp_type: c_uint,
}

/// `IBV_QP_OPEN_ATTR_NUM`.
pub const IBV_QP_OPEN_ATTR_NUM: u32 = 1;
/// `IBV_QP_OPEN_ATTR_XRCD`.
pub const IBV_QP_OPEN_ATTR_XRCD: u32 = 1 << 1;
/// `IBV_QP_OPEN_ATTR_CONTEXT`.
pub const IBV_QP_OPEN_ATTR_CONTEXT: u32 = 1 << 2;
/// `IBV_QP_OPEN_ATTR_TYPE`.
pub const IBV_QP_OPEN_ATTR_TYPE: u32 = 1 << 3;
/// `IBV_QP_OPEN_ATTR_RESERVED`.
pub const IBV_QP_OPEN_ATTR_RESERVED: u32 = 1 << 4;
/// `IBV_QPS_UNKNOWN`: the state of a QP handle from `ibv_open_qp` until it is queried.
pub const IBV_QPS_UNKNOWN: c_uint = 7;

/// `union ibv_async_event_element`.
#[repr(C)]
pub union ibv_async_event_element {
    pub cq: *mut ibv_cq,
    pub qp: *mut ibv_qp,
    pub srq: *mut ibv_srq,
    pub wq: *mut c_void,
    pub port_num: c_int,
}

/// `struct ibv_async_event`.
#[repr(C)]
pub struct ibv_async_event {
    pub element: ibv_async_event_element,
    pub event_type: c_uint,
}

/// `struct ibv_gid_entry`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_gid_entry {
    pub gid: ibv_gid,
    pub gid_index: u32,
    pub port_num: u32,
    pub gid_type: u32,
    pub ndev_ifindex: u32,
}

/// `struct ibv_mw`.
#[repr(C)]
pub struct ibv_mw {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub rkey: u32,
    pub handle: u32,
    pub mw_type: c_uint,
}

/// `struct ibv_dm`.
#[repr(C)]
pub struct ibv_dm {
    pub context: *mut ibv_context,
    pub memcpy_to_dm: *const c_void,
    pub memcpy_from_dm: *const c_void,
    pub comp_mask: u32,
    pub handle: u32,
}

/// `struct ibv_wq`.
#[repr(C)]
pub struct ibv_wq {
    pub context: *mut ibv_context,
    pub wq_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub cq: *mut ibv_cq,
    pub wq_num: u32,
    pub handle: u32,
    pub state: c_uint,
    pub wq_type: c_uint,
    pub post_recv: *const c_void,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub events_completed: u32,
    pub comp_mask: u32,
}
