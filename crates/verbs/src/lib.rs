//! softverbs: the libibverbs verbs API in safe Rust, on a built-in software RDMA device.
//!
//! Every host has devices with no configuration: one per network interface with an IP address,
//! loopback included. Objects hold what they depend on (a queue pair holds its protection domain
//! and completion queues, and so on), so a safe program cannot tear things down in an invalid
//! order, and dropping the last handle destroys the object.
//!
//! ```
//! use softverbs::{devices, AccessFlags};
//!
//! let dev = devices()?.into_iter().find(|d| d.netdev() == "lo").expect("loopback device");
//! let ctx = dev.open()?;
//! let port = ctx.query_port(1)?;
//! assert_eq!(port.state, softverbs::PortState::Active);
//! let pd = ctx.alloc_pd()?;
//! let mr = pd.register(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
//! assert_ne!(mr.lkey(), mr.rkey());
//! let cq = ctx.create_cq(16, None, 0)?;
//! assert!(cq.cqe() >= 16);
//! # Ok::<(), softverbs::Error>(())
//! ```

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
