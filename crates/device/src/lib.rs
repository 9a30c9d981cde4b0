//! The softverbs software RDMA device.
//!
//! This crate is the core object model behind both front ends: the safe Rust API (`softverbs`)
//! and the drop-in C library. Every verb is implemented here once, on thread-safe objects
//! (`Arc<Pd>`, `Arc<Cq>`, `Arc<Qp>`, ...) that hold what they depend on. Each object has an
//! explicit `destroy`/`dealloc` that enforces the man pages' teardown rules (EBUSY while in use,
//! waiting for event acknowledgements), and a `Drop` that cleans up if it was never called.
//!
//! Devices are discovered from the host's network interfaces ([`device_list`]); see [`config`]
//! for the environment variables that override the defaults.

pub mod attr_ex;
pub mod cm;
pub mod config;
pub mod context;
pub mod counters;
pub mod cq;
pub mod cq_moderation;
pub mod device;
pub mod dm;
pub mod domain;
mod driver;
pub mod fabric;
pub mod flow;
mod held;
mod local;
mod mcast;
pub mod mem;
pub mod mw;
pub mod netif;
pub mod null_mr;
mod pace;
pub mod pd;
pub mod qp;
pub mod rate_limit;
pub mod raw;
mod remote;
pub mod rsocket;
mod shm;
pub mod stats;
mod sync;
pub mod tm;
mod udp;
mod ufile;
pub mod wq;
pub mod xrc;
mod xrc_relay;

pub use attr_ex::{DeviceAttrEx, OdpCaps};
pub use config::{Config, Limits};
pub use context::{AsyncEvent, Context, EventElement};
pub use counters::{CounterDesc, Counters};
pub use cq::{CompChannel, Cq, CqOverrun, Timestamps};
pub use cq_moderation::Moderation;
pub use device::{device_list, discover, Device, DeviceAttr, PortAttr};
pub use dm::Dm;
pub use domain::{DomainUse, ParentDomain, Td};
pub use flow::{Flow, FlowAttr, FlowType};
pub use mem::{AtomicBuffer, MemoryBacking, Unmapped};
pub use mw::{Mw, Type1Bind};
pub use pd::{Ah, Mr, Pd, ReregError, Translation};
pub use qp::{PostError, Qp, QpInitAttr, Srq, SrqKind};
pub use raw::{has_cap_net_raw, TsoCaps};
pub use stats::{device_wide, host_counters, CounterSnapshot, ProcessCounters};
pub use wq::{RssCaps, RwqIndTable, RxHashConf, Wq, WqState};
pub use xrc::{XrcDomain, Xrcd};
