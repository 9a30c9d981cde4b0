//! The export table: every symbol and version node of rdma-core 44's `librdmacm.so.1`.
//!
//! As in `crates/ibverbs`: rustc links a `cdylib` with its own anonymous version script, so each
//! entry point is a private Rust function and an assembler trampoline
//! `__svr_<name>: jmp <function>` is given the versioned name `<name>@@<node>` with `.symver`.
//! The trampolines are local symbols, so the library exports exactly the versioned names.
//! `build.rs` declares the nodes; the node symbols themselves (`RDMACM_1.0@@RDMACM_1.0`, ...)
//! are defined here, as lld does not emit them. Unit tests are linked without the version
//! script, so none of this is assembled under `cfg(test)`.

#[cfg(not(test))]
use crate::entry as e;

macro_rules! exports {
    ($($name:literal $node:literal => $f:path;)*) => {
        $(
            #[cfg(not(test))]
            std::arch::global_asm!(
                ".pushsection .text",
                concat!(".globl __svr_", $name),
                concat!(".type __svr_", $name, ", @function"),
                concat!("__svr_", $name, ":"),
                "jmp {f}",
                concat!(".symver __svr_", $name, ", ", $name, "@@", $node),
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
                concat!(".globl __svr_node_", $node),
                concat!(".type __svr_node_", $node, ", @object"),
                concat!(".set __svr_node_", $node, ", 0"),
                concat!(".symver __svr_node_", $node, ", ", $node, "@@", $node),
            );
        )*
    };
}

nodes! { "RDMACM_1.0" "RDMACM_1.1" "RDMACM_1.2" "RDMACM_1.3" }

exports! {
    "raccept" "RDMACM_1.0" => e::raccept;
    "rbind" "RDMACM_1.0" => e::rbind;
    "rclose" "RDMACM_1.0" => e::rclose;
    "rconnect" "RDMACM_1.0" => e::rconnect;
    "rdma_accept" "RDMACM_1.0" => e::rdma_accept;
    "rdma_ack_cm_event" "RDMACM_1.0" => e::rdma_ack_cm_event;
    "rdma_bind_addr" "RDMACM_1.0" => e::rdma_bind_addr;
    "rdma_connect" "RDMACM_1.0" => e::rdma_connect;
    "rdma_create_ep" "RDMACM_1.0" => e::rdma_create_ep;
    "rdma_create_event_channel" "RDMACM_1.0" => e::rdma_create_event_channel;
    "rdma_create_id" "RDMACM_1.0" => e::rdma_create_id;
    "rdma_create_qp" "RDMACM_1.0" => e::rdma_create_qp;
    "rdma_create_qp_ex" "RDMACM_1.0" => e::rdma_create_qp_ex;
    "rdma_create_srq" "RDMACM_1.0" => e::rdma_create_srq;
    "rdma_create_srq_ex" "RDMACM_1.0" => e::rdma_create_srq_ex;
    "rdma_destroy_ep" "RDMACM_1.0" => e::rdma_destroy_ep;
    "rdma_destroy_event_channel" "RDMACM_1.0" => e::rdma_destroy_event_channel;
    "rdma_destroy_id" "RDMACM_1.0" => e::rdma_destroy_id;
    "rdma_destroy_qp" "RDMACM_1.0" => e::rdma_destroy_qp;
    "rdma_destroy_srq" "RDMACM_1.0" => e::rdma_destroy_srq;
    "rdma_disconnect" "RDMACM_1.0" => e::rdma_disconnect;
    "rdma_establish" "RDMACM_1.2" => e::rdma_establish;
    "rdma_event_str" "RDMACM_1.0" => e::rdma_event_str;
    "rdma_free_devices" "RDMACM_1.0" => e::rdma_free_devices;
    "rdma_freeaddrinfo" "RDMACM_1.0" => e::rdma_freeaddrinfo;
    "rdma_get_cm_event" "RDMACM_1.0" => e::rdma_get_cm_event;
    "rdma_get_devices" "RDMACM_1.0" => e::rdma_get_devices;
    "rdma_get_dst_port" "RDMACM_1.0" => e::rdma_get_dst_port;
    "rdma_get_remote_ece" "RDMACM_1.3" => e::rdma_get_remote_ece;
    "rdma_get_request" "RDMACM_1.0" => e::rdma_get_request;
    "rdma_get_src_port" "RDMACM_1.0" => e::rdma_get_src_port;
    "rdma_getaddrinfo" "RDMACM_1.0" => e::rdma_getaddrinfo;
    "rdma_init_qp_attr" "RDMACM_1.2" => e::rdma_init_qp_attr;
    "rdma_join_multicast" "RDMACM_1.0" => e::rdma_join_multicast;
    "rdma_join_multicast_ex" "RDMACM_1.1" => e::rdma_join_multicast_ex;
    "rdma_leave_multicast" "RDMACM_1.0" => e::rdma_leave_multicast;
    "rdma_listen" "RDMACM_1.0" => e::rdma_listen;
    "rdma_migrate_id" "RDMACM_1.0" => e::rdma_migrate_id;
    "rdma_notify" "RDMACM_1.0" => e::rdma_notify;
    "rdma_reject" "RDMACM_1.0" => e::rdma_reject;
    "rdma_reject_ece" "RDMACM_1.3" => e::rdma_reject_ece;
    "rdma_resolve_addr" "RDMACM_1.0" => e::rdma_resolve_addr;
    "rdma_resolve_route" "RDMACM_1.0" => e::rdma_resolve_route;
    "rdma_set_local_ece" "RDMACM_1.3" => e::rdma_set_local_ece;
    "rdma_set_option" "RDMACM_1.0" => e::rdma_set_option;
    "rfcntl" "RDMACM_1.0" => e::rfcntl;
    "rgetpeername" "RDMACM_1.0" => e::rgetpeername;
    "rgetsockname" "RDMACM_1.0" => e::rgetsockname;
    "rgetsockopt" "RDMACM_1.0" => e::rgetsockopt;
    "riomap" "RDMACM_1.0" => e::riomap;
    "riounmap" "RDMACM_1.0" => e::riounmap;
    "riowrite" "RDMACM_1.0" => e::riowrite;
    "rlisten" "RDMACM_1.0" => e::rlisten;
    "rpoll" "RDMACM_1.0" => e::rpoll;
    "rread" "RDMACM_1.0" => e::rread;
    "rreadv" "RDMACM_1.0" => e::rreadv;
    "rrecv" "RDMACM_1.0" => e::rrecv;
    "rrecvfrom" "RDMACM_1.0" => e::rrecvfrom;
    "rrecvmsg" "RDMACM_1.0" => e::rrecvmsg;
    "rselect" "RDMACM_1.0" => e::rselect;
    "rsend" "RDMACM_1.0" => e::rsend;
    "rsendmsg" "RDMACM_1.0" => e::rsendmsg;
    "rsendto" "RDMACM_1.0" => e::rsendto;
    "rsetsockopt" "RDMACM_1.0" => e::rsetsockopt;
    "rshutdown" "RDMACM_1.0" => e::rshutdown;
    "rsocket" "RDMACM_1.0" => e::rsocket;
    "rwrite" "RDMACM_1.0" => e::rwrite;
    "rwritev" "RDMACM_1.0" => e::rwritev;
}
