//! softverbs: the libibverbs verbs API in safe Rust, on a built-in software RDMA device.
//!
//! Every host has devices with no configuration: one per network interface with an IP address,
//! loopback included. Objects hold what they depend on (a queue pair holds its protection domain
//! and completion queues, and so on), so a safe program cannot tear things down in an invalid
//! order, and dropping the last handle destroys the object. The names are those of
//! libibverbs, so its man pages (`ibv_create_qp(3)` and so on) describe what each call does;
//! each item here says which verb it is.
//!
//! # The verbs, by family
//!
//! | family | types and calls | example |
//! |---|---|---|
//! | devices | [`devices`], [`Device::open`], [`Context::query_device`], [`Context::query_port`], [`Context::query_gid`] | [below](#1-a-device-and-its-context) |
//! | protection domains, memory | [`Context::alloc_pd`], [`ProtectionDomain::register`], [`MemoryRegion`], [`HostBuffer`], [`DeviceMemory`] | [`MemoryRegion`] |
//! | completions | [`Context::create_cq`], [`CompletionQueue::poll`], [`CompletionChannel`], [`Context::create_cq_with_timestamps`] | [`CompletionChannel`] |
//! | queue pairs (RC, UC, UD) | [`ProtectionDomain::create_qp`], [`QueuePair::modify`], [`QueuePair::post_send`], [`QueuePair::post_recv`] | [`QueuePair`] (RC), [`CompletionChannel`] (UC), [`AddressHandle`] (UD) |
//! | address handles, multicast | [`ProtectionDomain::create_ah`], [`QueuePair::attach_mcast`] | [`AddressHandle`] |
//! | shared receive queues | [`ProtectionDomain::create_srq`], [`SharedReceiveQueue`] | [`SharedReceiveQueue`] |
//! | memory windows | [`ProtectionDomain::alloc_mw`], [`MemoryWindow::bind`] | [`MemoryWindow`] |
//! | XRC | [`Context::open_xrcd`], [`XrcDomain`] | [`XrcDomain`] |
//! | async events | [`Context::get_async_event`] | [`SharedReceiveQueue`] |
//! | connection manager (librdmacm) | [`cm::CmId`], [`cm::EventChannel`] | [`cm`] |
//! | rsockets | [`rsocket::RStream`], [`rsocket::RListener`], [`rsocket::RDatagram`] | [`rsocket`] |
//!
//! Less common verbs are here too: thread and parent domains ([`Context::alloc_td`]),
//! counters ([`Counters`]), CQ moderation ([`CompletionQueue::modify_moderation`]), tag
//! matching ([`ProtectionDomain::create_tm_srq`]), raw packet QPs, flow steering and RSS
//! ([`WorkQueue`], [`Flow`]), shared contexts ([`Context::import_shared`]).
//!
//! # From zero to an RDMA WRITE between two processes
//!
//! An RDMA WRITE puts bytes into another process's memory without that process doing
//! anything for it. The steps are always the same: open a device, allocate the resources,
//! tell the peer who you are, connect, post, and wait for the completion.
//!
//! ## 1. A device and its context
//!
//! [`devices`] lists the devices (`ibv_get_device_list`); softverbs makes one per network
//! interface (`sv_lo`, `sv_eth0`, ...; `SOFTVERBS_INTERFACES` narrows the list, and
//! [`Device::discover`] takes a [`Config`] instead of the environment). Opening one gives a
//! [`Context`], from which everything else is created. Each port has a table of GIDs, one
//! per IP address of the interface: RoCE names endpoints by GID.
//!
//! ```
//! use std::net::Ipv4Addr;
//! use softverbs::{devices, Gid, PortState};
//!
//! let list = devices()?;
//! let dev = list.iter().find(|d| d.netdev() == "lo").expect("a loopback device");
//! assert_eq!(dev.name(), "sv_lo");
//! let ctx = dev.open()?;
//! let attr = ctx.query_device();
//! assert!(attr.max_qp > 0 && attr.max_mr_size > 0);
//! let port = ctx.query_port(1)?;
//! assert_eq!(port.state, PortState::Active);
//! let gids: Vec<Gid> = (0..port.gid_tbl_len as i32).filter_map(|i| ctx.query_gid(1, i).ok()).collect();
//! assert!(gids.contains(&Gid::from(Ipv4Addr::LOCALHOST)), "{gids:?}");
//! assert_eq!(ctx.query_pkey(1, 0)?, 0xffff);
//! # Ok::<(), softverbs::Error>(())
//! ```
//!
//! ## 2. Resources
//!
//! A protection domain ([`Context::alloc_pd`]) groups what may be used together. In it,
//! register the memory the peer will write ([`ProtectionDomain::register`], with
//! [`AccessFlags::REMOTE_WRITE`]), create a completion queue ([`Context::create_cq`]) and a
//! reliable-connected queue pair ([`ProtectionDomain::create_qp`] with [`QpType::Rc`]).
//!
//! ## 3. Telling the peer who you are
//!
//! Before any RDMA traffic each side needs the other's QP number, first packet sequence
//! number (PSN) and GID, and the writer needs the target's address and rkey
//! ([`MemoryRegion::remote`]). rdma-core's `ibv_rc_pingpong` sends them over a TCP
//! connection, and so does the program below; the connection manager ([`cm`]) does this
//! exchange, and the connecting, for you.
//!
//! ## 4. Connecting
//!
//! [`QueuePair::modify`] moves the QP from RESET to INIT (port, and what the peer may do to
//! local memory), RTR (ready to receive: the peer's GID, QP number and PSN) and RTS (ready to
//! send: its own PSN, timeout and retries). [`QueuePair`] describes the states.
//!
//! ## 5. Posting and completing
//!
//! The writer posts a [`SendRequest`] with [`SendOp::Write`] naming its local bytes by
//! [`Sge`] ([`MemoryRegion::sge`]) and the target by [`RemoteAddr`]. Once the target has
//! acknowledged the data, a [`WorkCompletion`] appears on the writer's CQ
//! ([`CompletionQueue::poll`], or sleep on a [`CompletionChannel`]). A plain WRITE leaves no
//! trace at the target; a WRITE with immediate data also consumes a receive there, which is
//! how the target learns that the data has arrived.
//!
//! ## 6. The program
//!
//! `crates/verbs/examples/rdma_write.rs`: start the server, then the client with the address
//! the server prints (between hosts, start the server on an address of its host, such as
//! `0.0.0.0:7000`, and connect to that host; each side finds the device by the address its
//! TCP connection uses):
//!
//! ```text
//! $ cargo run --example rdma_write
//! listening on 127.0.0.1:40423
//! $ cargo run --example rdma_write -- --connect 127.0.0.1:40423     # in another terminal
//! wrote 43 bytes
//! ```
//!
//! The server then prints `received: hello from the other process, by RDMA WRITE`. The test
//! `crates/verbs/tests/guide.rs` runs this very program as two processes.
//!
#![doc = concat!("```no_run\n", include_str!("../examples/rdma_write.rs"), "```")]
//!
//! # Things worth knowing
//!
//! - **Errors** are [`Error`]s; [`Error::errno`] is the errno the C verb would set, as its
//!   man page lists them. A failed post ([`PostError`]) says which work request was refused.
//! - **Memory** registered through the safe API is reached through copying accessors
//!   ([`MemoryRegion::read`], [`MemoryRegion::write`]), never through slices, because the
//!   device writes it from its own threads at any time. Memory the program owns (a `Vec`,
//!   `Box<[u8]>`, `BytesMut` or a mapping) is registered without a copy and handed back on
//!   deregistration by [`zero_copy`], whose regions give slices while the device is kept out.
//! - **Async**: with the `tokio` feature, the `aio` module gives completion streams and work
//!   requests as futures that own their buffers until the completion.
//! - **Waiting** is bounded wherever a call can wait: the `_timeout` variants
//!   ([`CompletionChannel::get_cq_event_timeout`], [`Context::get_async_event_timeout`])
//!   give up with [`Error::WouldBlock`]. A peer that vanishes shows as error completions
//!   (`IBV_WC_RETRY_EXC_ERR`) after the QP's retries, not as a hang.
//! - **Processes and hosts**: each process has its own UDP port (a slot above 4791), so
//!   processes on a host reach each other with no setup, and hosts reach each other, and
//!   kernel Soft-RoCE or RoCE NICs, over RoCEv2. Processes of one user on one host use shared
//!   memory instead (`SOFTVERBS_SHM=0` turns that off).
//! - **C programs** use the same device through the drop-in `libibverbs.so.1` and
//!   `librdmacm.so.1` (crates `softverbs-ibverbs` and `softverbs-rdmacm`).

#[cfg(feature = "tokio")]
pub mod aio;
pub mod capture;
pub mod cm;
mod context;
mod counters;
mod cq;
mod device;
mod dm;
mod domain;
mod host;
mod pd;
mod qp;
mod raw;
pub mod rsocket;
mod xrc;
pub mod zero_copy;

pub use capture::{capture_stats, stop_capture, CaptureStats, PacketCapture};
pub use context::{AsyncEvent, AsyncEventTarget, Context};
pub use counters::{CounterDesc, Counters, READ_COUNTERS_PREFER_CACHED};
pub use cq::{CompletionChannel, CompletionQueue, CqEvent};
pub use device::{devices, fork_init, is_fork_initialized, Device, ForkStatus};
pub use dm::DeviceMemory;
pub use domain::ThreadDomain;
pub use host::HostBuffer;
pub use pd::{
    AddressHandle, ImplicitOdpRegion, MemoryRegion, MemoryWindow, MwBindInfo, ProtectionDomain, Rereg,
};
pub use qp::{QpInit, QueuePair, SharedReceiveQueue};
pub use raw::{Flow, RssQueuePair, RwqIndTable, WorkQueue};
pub use xrc::{XrcDomain, O_CREAT, O_EXCL};
pub use zero_copy::{BorrowedRegion, LocalMut, LocalRef, OwnedRegion, RegisterError, StableBuffer};

pub use softverbs_device::attr_ex::{cap_flags_ex, odp, HCA_CORE_CLOCK_KHZ};
pub use softverbs_device::config::{Config, Limits};
pub use softverbs_device::cq_moderation::{MAX_CQ_COUNT, MAX_CQ_PERIOD};
pub use softverbs_device::device::{DeviceAttr, PortAttr};
pub use softverbs_device::flow::{FlowAttr, FlowType, FLOW_FLAG_DONT_TRAP, FLOW_FLAG_EGRESS};
pub use softverbs_device::qp::{PostError, SendRequest, UdAddress};
pub use softverbs_device::wq::{RssCaps, RxHashConf, WqState};
pub use softverbs_device::{
    has_cap_net_raw, host_counters, CounterSnapshot, DeviceAttrEx, Moderation, OdpCaps, ProcessCounters,
    Timestamps, TsoCaps,
};

/// Device `name`'s counters summed over every process of this user in this network namespace
/// (each publishes its own on a counter board in shared memory), and how many processes use
/// the device. [`host_counters`] gives them process by process.
pub fn device_counters(name: &str) -> (usize, CounterSnapshot) {
    softverbs_device::device_wide(name)
}
pub use softverbs_engine::mw::{inc_rkey, MwBind, MwType};
pub use softverbs_engine::rate::{mbps_to_rate, mult_to_rate, rate_to_mbps, rate_to_mult};
pub use softverbs_engine::steering::{
    toeplitz, EthFilter, FlowSpec, FrameHeaders, Ipv4Filter, Ipv6Filter, PortFilter, RxHashFields,
    RX_HASH_FUNC_TOEPLITZ,
};
pub use softverbs_engine::tm::{OpsFlags, SrqOp, SrqOpKind, TmCap, TmCapFlags, TmCaps, TmInfo};
pub use softverbs_engine::transport::QpCounters;
pub use softverbs_engine::types::{
    AccessFlags, AhAttr, AtomicCap, EventType, Gid, GlobalRoute, MigState, Mtu, PortState, QpAttr,
    QpAttrMask, QpCap, QpState, QpType, RecvWr, SendFlags, Sge, SrqAttr, SrqAttrMask, WcFlags, WcOpcode,
    WcStatus, WorkCompletion,
};
pub use softverbs_engine::wr::{FlushSelect, Payload, RemoteAddr, SendOp, FLUSH_GLOBAL, FLUSH_PERSISTENT};
pub use softverbs_engine::{Error, Result};
