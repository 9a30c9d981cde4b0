//! The export table: every symbol and version node of rdma-core 44's `libibverbs.so.1`.
//!
//! rustc links a `cdylib` with its own anonymous version script, so `#[no_mangle]` exports
//! would come out unversioned. Instead each entry point is a private Rust function, and for each
//! exported `name@@NODE` (default) or `name@NODE` (hidden compatibility version) an assembler
//! trampoline `__svx_<name>_<node>: jmp <function>` is given that versioned name with `.symver`.
//! The trampolines are local symbols, so the library exports exactly the versioned names.
//! `build.rs` declares the nodes in a version script; the absolute node symbols
//! (`IBVERBS_1.0@@IBVERBS_1.0`, ...) that GNU ld would emit are defined here too, as lld does
//! not emit them.
//!
//! Unit tests are linked as executables without the version script, so none of this is
//! assembled under `cfg(test)`.

use std::ffi::c_int;

#[cfg(not(test))]
use crate::datapath as d;
use crate::verbs as v;

/// `verbs_allow_disassociate_destroy` (IBVERBS_PRIVATE_34): a `bool` providers read.
#[used]
static ALLOW_DISASSOCIATE_DESTROY: u8 = 0;

/// The `ibv_cmd_*` and `execute_ioctl` kernel-command helpers of IBVERBS_PRIVATE_34: there is
/// no kernel device behind this library.
extern "C" fn cmd_eopnotsupp() -> c_int {
    v::eopnotsupp()
}

macro_rules! exports {
    ($($name:literal $sep:literal $node:literal => $f:path;)*) => {
        $(
            #[cfg(not(test))]
            std::arch::global_asm!(
                ".pushsection .text",
                concat!(".globl __svx_", $name, "_", $node),
                concat!(".type __svx_", $name, "_", $node, ", @function"),
                concat!("__svx_", $name, "_", $node, ":"),
                "jmp {f}",
                concat!(".symver __svx_", $name, "_", $node, ", ", $name, $sep, $node),
                ".popsection",
                f = sym $f,
            );
        )*
    };
}

macro_rules! nodes {
    ($($node:literal)*) => {
        $(
            #[cfg(not(test))]
            std::arch::global_asm!(
                concat!(".globl __svx_node_", $node),
                concat!(".type __svx_node_", $node, ", @object"),
                concat!(".set __svx_node_", $node, ", 0"),
                concat!(".symver __svx_node_", $node, ", ", $node, "@@", $node),
            );
        )*
    };
}

nodes! {
    "IBVERBS_1.0" "IBVERBS_1.1" "IBVERBS_1.5" "IBVERBS_1.6" "IBVERBS_1.7" "IBVERBS_1.8"
    "IBVERBS_1.9" "IBVERBS_1.10" "IBVERBS_1.11" "IBVERBS_1.12" "IBVERBS_1.13" "IBVERBS_1.14"
    "IBVERBS_PRIVATE_34" "SOFTVERBS_PRIVATE_1"
}

#[cfg(not(test))]
std::arch::global_asm!(
    ".globl __svx_verbs_allow_disassociate_destroy",
    ".type __svx_verbs_allow_disassociate_destroy, @object",
    ".size __svx_verbs_allow_disassociate_destroy, 1",
    ".set __svx_verbs_allow_disassociate_destroy, {o}",
    ".symver __svx_verbs_allow_disassociate_destroy, verbs_allow_disassociate_destroy@@IBVERBS_PRIVATE_34",
    o = sym ALLOW_DISASSOCIATE_DESTROY,
);

// IBVERBS_1.0: nine defaults, and the hidden 1.0 versions of the verbs whose structures changed
// in 1.1.
exports! {
    "ibv_copy_path_rec_from_kern" "@@" "IBVERBS_1.0" => v::nothing;
    "ibv_copy_path_rec_to_kern" "@@" "IBVERBS_1.0" => v::nothing;
    "ibv_copy_qp_attr_from_kern" "@@" "IBVERBS_1.0" => v::nothing;
    "ibv_create_comp_channel" "@@" "IBVERBS_1.0" => v::create_comp_channel;
    "ibv_destroy_comp_channel" "@@" "IBVERBS_1.0" => v::destroy_comp_channel;
    "ibv_get_sysfs_path" "@@" "IBVERBS_1.0" => v::get_sysfs_path;
    "ibv_rate_to_mult" "@@" "IBVERBS_1.0" => crate::ibv_rate_to_mult;
    "ibv_read_sysfs_file" "@@" "IBVERBS_1.0" => v::read_sysfs_file;
    "mult_to_ibv_rate" "@@" "IBVERBS_1.0" => crate::mult_to_ibv_rate;

    "ibv_ack_async_event" "@" "IBVERBS_1.0" => v::compat_fail;
    "ibv_ack_cq_events" "@" "IBVERBS_1.0" => v::compat_fail;
    "ibv_alloc_pd" "@" "IBVERBS_1.0" => v::compat_null;
    "ibv_attach_mcast" "@" "IBVERBS_1.0" => v::compat_fail;
    "ibv_close_device" "@" "IBVERBS_1.0" => v::compat_fail;
    "ibv_create_ah" "@" "IBVERBS_1.0" => v::compat_null;
    "ibv_create_cq" "@" "IBVERBS_1.0" => v::compat_null;
    "ibv_create_qp" "@" "IBVERBS_1.0" => v::compat_null;
    "ibv_create_srq" "@" "IBVERBS_1.0" => v::compat_null;
    "ibv_dealloc_pd" "@" "IBVERBS_1.0" => v::compat_fail;
    "ibv_dereg_mr" "@" "IBVERBS_1.0" => v::compat_fail;
    "ibv_destroy_ah" "@" "IBVERBS_1.0" => v::compat_fail;
    "ibv_destroy_cq" "@" "IBVERBS_1.0" => v::compat_fail;
    "ibv_destroy_qp" "@" "IBVERBS_1.0" => v::compat_fail;
    "ibv_destroy_srq" "@" "IBVERBS_1.0" => v::compat_fail;
    "ibv_detach_mcast" "@" "IBVERBS_1.0" => v::compat_fail;
    "ibv_free_device_list" "@" "IBVERBS_1.0" => v::compat_fail;
    "ibv_get_async_event" "@" "IBVERBS_1.0" => v::compat_fail;
    "ibv_get_cq_event" "@" "IBVERBS_1.0" => v::compat_fail;
    "ibv_get_device_guid" "@" "IBVERBS_1.0" => v::compat_fail;
    "ibv_get_device_list" "@" "IBVERBS_1.0" => v::compat_null;
    "ibv_get_device_name" "@" "IBVERBS_1.0" => v::compat_null;
    "ibv_modify_qp" "@" "IBVERBS_1.0" => v::compat_fail;
    "ibv_modify_srq" "@" "IBVERBS_1.0" => v::compat_fail;
    "ibv_open_device" "@" "IBVERBS_1.0" => v::compat_null;
    "ibv_query_device" "@" "IBVERBS_1.0" => v::compat_fail;
    "ibv_query_gid" "@" "IBVERBS_1.0" => v::compat_fail;
    "ibv_query_pkey" "@" "IBVERBS_1.0" => v::compat_fail;
    "ibv_query_port" "@" "IBVERBS_1.0" => v::compat_fail;
    "ibv_query_qp" "@" "IBVERBS_1.0" => v::compat_fail;
    "ibv_query_srq" "@" "IBVERBS_1.0" => v::compat_fail;
    "ibv_reg_mr" "@" "IBVERBS_1.0" => v::compat_null;
    "ibv_resize_cq" "@" "IBVERBS_1.0" => v::compat_fail;
}

// IBVERBS_1.1: the verbs as every current program calls them.
exports! {
    "ibv_ack_async_event" "@@" "IBVERBS_1.1" => v::ack_async_event;
    "ibv_ack_cq_events" "@@" "IBVERBS_1.1" => v::ack_cq_events;
    "ibv_alloc_pd" "@@" "IBVERBS_1.1" => v::alloc_pd;
    "ibv_attach_mcast" "@@" "IBVERBS_1.1" => v::attach_mcast;
    "ibv_close_device" "@@" "IBVERBS_1.1" => v::close_device;
    "ibv_copy_ah_attr_from_kern" "@@" "IBVERBS_1.1" => v::nothing;
    "ibv_create_ah" "@@" "IBVERBS_1.1" => v::create_ah;
    "ibv_create_ah_from_wc" "@@" "IBVERBS_1.1" => v::create_ah_from_wc;
    "ibv_create_cq" "@@" "IBVERBS_1.1" => v::create_cq;
    "ibv_create_qp" "@@" "IBVERBS_1.1" => v::create_qp;
    "ibv_create_srq" "@@" "IBVERBS_1.1" => v::create_srq;
    "ibv_dealloc_pd" "@@" "IBVERBS_1.1" => v::dealloc_pd;
    "ibv_dereg_mr" "@@" "IBVERBS_1.1" => v::dereg_mr;
    "ibv_destroy_ah" "@@" "IBVERBS_1.1" => v::destroy_ah;
    "ibv_destroy_cq" "@@" "IBVERBS_1.1" => v::destroy_cq;
    "ibv_destroy_qp" "@@" "IBVERBS_1.1" => v::destroy_qp;
    "ibv_destroy_srq" "@@" "IBVERBS_1.1" => v::destroy_srq;
    "ibv_detach_mcast" "@@" "IBVERBS_1.1" => v::detach_mcast;
    "ibv_dofork_range" "@@" "IBVERBS_1.1" => crate::ibv_fork_range;
    "ibv_dontfork_range" "@@" "IBVERBS_1.1" => crate::ibv_fork_range;
    "ibv_event_type_str" "@@" "IBVERBS_1.1" => crate::ibv_event_type_str;
    "ibv_fork_init" "@@" "IBVERBS_1.1" => crate::ibv_fork_init;
    "ibv_free_device_list" "@@" "IBVERBS_1.1" => v::free_device_list;
    "ibv_get_async_event" "@@" "IBVERBS_1.1" => v::get_async_event;
    "ibv_get_cq_event" "@@" "IBVERBS_1.1" => v::get_cq_event;
    "ibv_get_device_guid" "@@" "IBVERBS_1.1" => v::get_device_guid;
    "ibv_get_device_list" "@@" "IBVERBS_1.1" => v::get_device_list;
    "ibv_get_device_name" "@@" "IBVERBS_1.1" => v::get_device_name;
    "ibv_init_ah_from_wc" "@@" "IBVERBS_1.1" => v::init_ah_from_wc;
    "ibv_modify_qp" "@@" "IBVERBS_1.1" => v::modify_qp;
    "ibv_modify_srq" "@@" "IBVERBS_1.1" => v::modify_srq;
    "ibv_node_type_str" "@@" "IBVERBS_1.1" => crate::ibv_node_type_str;
    "ibv_open_device" "@@" "IBVERBS_1.1" => v::open_device;
    "ibv_port_state_str" "@@" "IBVERBS_1.1" => crate::ibv_port_state_str;
    "ibv_query_device" "@@" "IBVERBS_1.1" => v::query_device;
    "ibv_query_gid" "@@" "IBVERBS_1.1" => v::query_gid;
    "ibv_query_pkey" "@@" "IBVERBS_1.1" => v::query_pkey;
    "ibv_query_port" "@@" "IBVERBS_1.1" => v::query_port_compat;
    "ibv_query_qp" "@@" "IBVERBS_1.1" => v::query_qp;
    "ibv_query_srq" "@@" "IBVERBS_1.1" => v::query_srq;
    "ibv_rate_to_mbps" "@@" "IBVERBS_1.1" => crate::ibv_rate_to_mbps;
    "ibv_reg_mr" "@@" "IBVERBS_1.1" => v::reg_mr;
    "ibv_rereg_mr" "@@" "IBVERBS_1.1" => v::rereg_mr;
    "ibv_resize_cq" "@@" "IBVERBS_1.1" => v::resize_cq;
    "ibv_resolve_eth_l2_from_gid" "@@" "IBVERBS_1.1" => v::resolve_eth_l2_from_gid;
    "ibv_wc_status_str" "@@" "IBVERBS_1.1" => crate::ibv_wc_status_str;
    "mbps_to_ibv_rate" "@@" "IBVERBS_1.1" => crate::mbps_to_ibv_rate;
    "ibv_register_driver" "@" "IBVERBS_1.1" => v::nothing;
}

// IBVERBS_1.5 to 1.14.
exports! {
    "ibv_get_pkey_index" "@@" "IBVERBS_1.5" => v::get_pkey_index;
    "ibv_qp_to_qp_ex" "@@" "IBVERBS_1.6" => d::qp_ex::qp_to_qp_ex;
    "ibv_reg_mr_iova" "@@" "IBVERBS_1.7" => v::reg_mr_iova;
    "ibv_reg_mr_iova2" "@@" "IBVERBS_1.8" => v::reg_mr_iova2;
    "ibv_get_device_index" "@@" "IBVERBS_1.9" => v::get_device_index;
    "ibv_import_device" "@@" "IBVERBS_1.10" => crate::import::import_device;
    "ibv_import_mr" "@@" "IBVERBS_1.10" => crate::import::import_mr;
    "ibv_import_pd" "@@" "IBVERBS_1.10" => crate::import::import_pd;
    "ibv_query_ece" "@@" "IBVERBS_1.10" => v::eopnotsupp;
    "ibv_set_ece" "@@" "IBVERBS_1.10" => v::eopnotsupp;
    "ibv_unimport_mr" "@@" "IBVERBS_1.10" => crate::import::unimport_mr;
    "ibv_unimport_pd" "@@" "IBVERBS_1.10" => crate::import::unimport_pd;
    "_ibv_query_gid_ex" "@@" "IBVERBS_1.11" => v::query_gid_ex;
    "_ibv_query_gid_table" "@@" "IBVERBS_1.11" => v::query_gid_table;
    "ibv_reg_dmabuf_mr" "@@" "IBVERBS_1.12" => v::null_eopnotsupp;
    "ibv_import_dm" "@@" "IBVERBS_1.13" => crate::dm::import_dm;
    "ibv_is_fork_initialized" "@@" "IBVERBS_1.13" => crate::ibv_is_fork_initialized;
    "ibv_unimport_dm" "@@" "IBVERBS_1.13" => crate::dm::unimport_dm;
    "ibv_query_qp_data_in_order" "@@" "IBVERBS_1.14" => v::query_qp_data_in_order;
}

// IBVERBS_PRIVATE_34: the provider interface. Providers (libmlx5, libefa) link against it and
// register themselves from their constructors; with no kernel device, every command fails
// with EOPNOTSUPP and registration is ignored.
exports! {
    "__ioctl_final_num_attrs" "@@" "IBVERBS_PRIVATE_34" => v::nothing;
    "__verbs_log" "@@" "IBVERBS_PRIVATE_34" => v::nothing;
    "_verbs_init_and_alloc_context" "@@" "IBVERBS_PRIVATE_34" => v::null_eopnotsupp;
    "execute_ioctl" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_query_gid_type" "@@" "IBVERBS_PRIVATE_34" => v::query_gid_type;
    "ibv_read_ibdev_sysfs_file" "@@" "IBVERBS_PRIVATE_34" => v::read_ibdev_sysfs_file;
    "verbs_init_cq" "@@" "IBVERBS_PRIVATE_34" => v::nothing;
    "verbs_open_device" "@@" "IBVERBS_PRIVATE_34" => v::null_eopnotsupp;
    "verbs_register_driver_34" "@@" "IBVERBS_PRIVATE_34" => v::nothing;
    "verbs_set_ops" "@@" "IBVERBS_PRIVATE_34" => v::nothing;
    "verbs_uninit_context" "@@" "IBVERBS_PRIVATE_34" => v::nothing;
    "ibv_cmd_advise_mr" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_alloc_dm" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_alloc_mw" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_alloc_pd" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_attach_mcast" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_close_xrcd" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_create_ah" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_create_counters" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_create_cq" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_create_cq_ex" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_create_flow" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_create_flow_action_esp" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_create_qp" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_create_qp_ex" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_create_qp_ex2" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_create_rwq_ind_table" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_create_srq" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_create_srq_ex" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_create_wq" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_dealloc_mw" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_dealloc_pd" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_dereg_mr" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_destroy_ah" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_destroy_counters" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_destroy_cq" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_destroy_flow" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_destroy_flow_action" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_destroy_qp" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_destroy_rwq_ind_table" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_destroy_srq" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_destroy_wq" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_detach_mcast" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_free_dm" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_get_context" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_modify_cq" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_modify_flow_action_esp" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_modify_qp" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_modify_qp_ex" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_modify_srq" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_modify_wq" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_open_qp" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_open_xrcd" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_poll_cq" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_post_recv" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_post_send" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_post_srq_recv" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_query_context" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_query_device_any" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_query_mr" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_query_port" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_query_qp" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_query_srq" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_read_counters" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_reg_dm_mr" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_reg_dmabuf_mr" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_reg_mr" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_req_notify_cq" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_rereg_mr" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
    "ibv_cmd_resize_cq" "@@" "IBVERBS_PRIVATE_34" => cmd_eopnotsupp;
}

// SOFTVERBS_PRIVATE_1: the connection manager's entry table, for crates/rdmacm's librdmacm.so.1.
exports! {
    "softverbs_rdmacm_ops" "@@" "SOFTVERBS_PRIVATE_1" => crate::cm::ops;
}
