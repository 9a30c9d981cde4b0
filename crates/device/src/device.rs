//! The software device: what `ibv_get_device_list` returns, and the state shared by every
//! context opened on it in this process (resource accounting, key and QP-number tables).

use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use softverbs_engine::types::{AtomicCap, Gid, Mtu, PortState};
use softverbs_engine::{Error, Result};

use crate::config::{Config, Limits};
use crate::netif::{self, Interface};
use crate::qp::Qp;
use crate::stats::CounterSnapshot;

/// The fabric the devices of this crate are on: its endpoints are QPs.
pub(crate) type Fabric = crate::fabric::Fabric<Qp>;
/// A device's endpoint on the fabric.
pub(crate) type Node = crate::fabric::Node<Qp>;
/// A device's hold on its node.
pub(crate) type NodeHandle = crate::fabric::NodeHandle<Qp>;

/// Number of entries in every port's GID table. Unused entries read as zero.
pub const GID_TABLE_LEN: usize = 16;
/// Number of entries in the P_Key table; entry 0 holds the default full-membership key.
pub const PKEY_TABLE_LEN: u16 = 1;
/// The default P_Key.
pub const DEFAULT_PKEY: u16 = 0xFFFF;
/// Worst-case RoCEv2 header bytes, which the netdev MTU must leave room for (as rxe).
pub const ROCE_HEADER_ALLOWANCE: u32 = 80;
/// The device's vendor id: none assigned, as rxe reports.
pub const VENDOR_ID: u32 = 0x00FF_FFFF;

/// `IBV_DEVICE_*` capability bits this device honours.
pub mod cap_flags {
    /// Bad P_Key counter.
    pub const BAD_PKEY_CNTR: u32 = 1 << 1;
    /// Bad Q_Key counter.
    pub const BAD_QKEY_CNTR: u32 = 1 << 2;
    /// UD address vectors must name the QP's port.
    pub const UD_AV_PORT_ENFORCE: u32 = 1 << 6;
    /// `IBV_QP_CUR_STATE` is honoured.
    pub const CURR_QP_STATE_MOD: u32 = 1 << 7;
    /// Port-active events.
    pub const PORT_ACTIVE_EVENT: u32 = 1 << 10;
    /// `sys_image_guid` is valid.
    pub const SYS_IMAGE_GUID: u32 = 1 << 11;
    /// RC QPs send RNR NAKs.
    pub const RC_RNR_NAK_GEN: u32 = 1 << 12;
    /// SRQs can be resized.
    pub const SRQ_RESIZE: u32 = 1 << 13;
    /// Memory windows.
    pub const MEM_WINDOW: u32 = 1 << 17;
    /// Type 2B memory windows (bound to a QP).
    pub const MEM_WINDOW_TYPE_2B: u32 = 1 << 24;
    /// XRC domains, XRC SRQs and XRC_SEND/XRC_RECV QPs.
    pub const XRC: u32 = 1 << 20;
    /// `IBV_DEVICE_MANAGED_FLOW_STEERING`: `ibv_create_flow` works (raw packet QPs).
    pub const MANAGED_FLOW_STEERING: u32 = 1 << 29;
}

/// Random bits from the kernel.
fn random_u32() -> u32 {
    let mut b = [0u8; 4];
    getrandom::getrandom(&mut b).expect("the kernel's random source is available");
    u32::from_ne_bytes(b)
}

/// `IBV_PORT_IP_BASED_GIDS`.
pub const PORT_IP_BASED_GIDS: u32 = 1 << 26;

/// `struct ibv_device_attr`: one field per C field, named as in C (`ibv_query_device(3)`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceAttr {
    /// Firmware version string.
    pub fw_ver: String,
    /// Node GUID (the number whose big-endian bytes are the GUID).
    pub node_guid: u64,
    /// System image GUID.
    pub sys_image_guid: u64,
    /// Largest memory region, in bytes.
    pub max_mr_size: u64,
    /// Page sizes supported (a bit per size).
    pub page_size_cap: u64,
    /// IEEE vendor ID.
    pub vendor_id: u32,
    /// Vendor part ID.
    pub vendor_part_id: u32,
    /// Hardware version.
    pub hw_ver: u32,
    /// Most QPs.
    pub max_qp: u32,
    /// Most outstanding WRs per send or receive queue.
    pub max_qp_wr: u32,
    /// `IBV_DEVICE_*` capability bits.
    pub device_cap_flags: u32,
    /// Most scatter/gather elements per WR (non-RDMA-READ).
    pub max_sge: u32,
    /// Most scatter/gather elements per RDMA READ WR.
    pub max_sge_rd: u32,
    /// Most CQs.
    pub max_cq: u32,
    /// Most entries per CQ.
    pub max_cqe: u32,
    /// Most memory regions.
    pub max_mr: u32,
    /// Most protection domains.
    pub max_pd: u32,
    /// Most outstanding RDMA READs and atomics a QP can receive (responder resources).
    pub max_qp_rd_atom: u32,
    /// As `max_qp_rd_atom`, per EE context (none: 0).
    pub max_ee_rd_atom: u32,
    /// Most responder resources for RDMA READs and atomics on the device.
    pub max_res_rd_atom: u32,
    /// Most outstanding RDMA READs and atomics a QP can initiate.
    pub max_qp_init_rd_atom: u32,
    /// As `max_qp_init_rd_atom`, per EE context (none: 0).
    pub max_ee_init_rd_atom: u32,
    /// Atomicity guarantee of atomic operations.
    pub atomic_cap: AtomicCap,
    /// Most EE contexts (none: 0).
    pub max_ee: u32,
    /// Most reliable datagram domains (none: 0).
    pub max_rdd: u32,
    /// Most memory windows.
    pub max_mw: u32,
    /// Most raw IPv6 datagram QPs.
    pub max_raw_ipv6_qp: u32,
    /// Most raw Ethertype datagram QPs.
    pub max_raw_ethy_qp: u32,
    /// Most multicast groups.
    pub max_mcast_grp: u32,
    /// Most QPs per multicast group.
    pub max_mcast_qp_attach: u32,
    /// Most QP attachments to multicast groups, over all groups.
    pub max_total_mcast_qp_attach: u32,
    /// Most address handles.
    pub max_ah: u32,
    /// Most fast memory regions (none: 0).
    pub max_fmr: u32,
    /// Most remaps per fast memory region (none: 0).
    pub max_map_per_fmr: u32,
    /// Most SRQs.
    pub max_srq: u32,
    /// Most outstanding WRs per SRQ.
    pub max_srq_wr: u32,
    /// Most scatter/gather elements per SRQ WR.
    pub max_srq_sge: u32,
    /// Size of the P_Key table.
    pub max_pkeys: u16,
    /// Local CA ACK delay (4.096 us * 2^n).
    pub local_ca_ack_delay: u8,
    /// Number of ports.
    pub phys_port_cnt: u8,
}

/// `struct ibv_port_attr`: one field per C field, named as in C (`ibv_query_port(3)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortAttr {
    /// Logical port state.
    pub state: PortState,
    /// Largest MTU the port supports.
    pub max_mtu: Mtu,
    /// MTU in use: the largest payload of a packet.
    pub active_mtu: Mtu,
    /// Size of the GID table.
    pub gid_tbl_len: u32,
    /// `IBV_PORT_*` capability bits.
    pub port_cap_flags: u32,
    /// Largest message, in bytes.
    pub max_msg_sz: u32,
    /// Packets dropped for a bad P_Key.
    pub bad_pkey_cntr: u32,
    /// Packets dropped for a Q_Key violation.
    pub qkey_viol_cntr: u32,
    /// Size of the P_Key table.
    pub pkey_tbl_len: u16,
    /// Base LID (unused on RoCE: 0).
    pub lid: u16,
    /// LID of the subnet manager (unused on RoCE: 0).
    pub sm_lid: u16,
    /// LID mask control (unused on RoCE: 0).
    pub lmc: u8,
    /// Most virtual lanes.
    pub max_vl_num: u8,
    /// Service level of the subnet manager.
    pub sm_sl: u8,
    /// Subnet propagation delay (4.096 us * 2^n).
    pub subnet_timeout: u8,
    /// Init type reply of the subnet manager.
    pub init_type_reply: u8,
    /// Active link width (`IBV_WIDTH_*`).
    pub active_width: u8,
    /// Active link speed (`IBV_SPEED_*`).
    pub active_speed: u8,
    /// Physical port state (5: link up).
    pub phys_state: u8,
    /// Link layer (`IBV_LINK_LAYER_ETHERNET` for RoCE).
    pub link_layer: u8,
    /// `IBV_QPF_*` port flags.
    pub flags: u8,
    /// `IBV_PORT_*2` capability bits.
    pub port_cap_flags2: u16,
}

/// Countable resources, each limited by a [`Limits`] field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Resource {
    Pd,
    Mr,
    Cq,
    Qp,
    Srq,
    Ah,
    Mw,
}

impl Resource {
    const COUNT: usize = 7;

    fn limit(self, l: &Limits) -> u32 {
        match self {
            Self::Pd => l.max_pd,
            Self::Mr => l.max_mr,
            Self::Cq => l.max_cq,
            Self::Qp => l.max_qp,
            Self::Srq => l.max_srq,
            Self::Ah => l.max_ah,
            Self::Mw => l.max_mw,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Pd => "max_pd",
            Self::Mr => "max_mr",
            Self::Cq => "max_cq",
            Self::Qp => "max_qp",
            Self::Srq => "max_srq",
            Self::Ah => "max_ah",
            Self::Mw => "max_mw",
        }
    }
}

/// Multicast attachments of the whole device.
#[derive(Debug, Default)]
pub(crate) struct McastTable {
    pub(crate) groups: HashMap<Gid, HashSet<u32>>,
    pub(crate) total: u32,
    /// This device's entries in the host's membership registry, one per group.
    joined: HashMap<Gid, crate::mcast::Membership>,
}

impl McastTable {
    /// Attaches QP `qpn` to `group`; the first QP of a group makes this process (UDP slot
    /// `slot`, device `ifindex`) a member for other processes of the host.
    pub(crate) fn attach(&mut self, group: Gid, qpn: u32, base_port: u16, slot: u8, ifindex: u32) {
        let members = self.groups.entry(group).or_default();
        if members.is_empty() && slot != 0 {
            if let Some(m) = crate::mcast::join(base_port, &group, slot, ifindex) {
                self.joined.insert(group, m);
            }
        }
        members.insert(qpn);
        self.total += 1;
    }

    /// Detaches QP `qpn` from `group` (which it was attached to); the last QP of a group ends
    /// the membership.
    pub(crate) fn detach(&mut self, group: &Gid, qpn: u32) {
        if let Some(m) = self.groups.get_mut(group) {
            m.remove(&qpn);
            if m.is_empty() {
                self.groups.remove(group);
                self.joined.remove(group);
            }
        }
        self.total -= 1;
    }
}

/// State shared by every context of one device in this process.
#[derive(Debug)]
pub(crate) struct Shared {
    counts: [AtomicU32; Resource::COUNT],
    /// Bytes of device memory allocated.
    dm_bytes: AtomicU64,
    keys: Mutex<HashSet<u32>>,
    mw_indices: Mutex<HashSet<u32>>,
    pub(crate) node: NodeHandle,
    /// The packet socket of raw QPs, while one exists.
    pub(crate) raw: crate::raw::RawSlot,
    /// Live RSS indirection tables.
    pub(crate) ind_tables: AtomicU32,
    xrc_domains: crate::xrc::DomainTable,
}

impl Shared {
    fn new(name: &str, gids: &[Gid], ifindex: u32, fabric: &Arc<Fabric>) -> Self {
        Self {
            counts: Default::default(),
            dm_bytes: AtomicU64::new(0),
            keys: Mutex::new(HashSet::new()),
            mw_indices: Mutex::new(HashSet::new()),
            node: fabric.add_node(crate::stats::NodeCounters::new(name), gids, ifindex),
            raw: Default::default(),
            ind_tables: AtomicU32::new(0),
            xrc_domains: Default::default(),
        }
    }
}

/// One software RDMA device (one per network interface). Cheap to clone.
#[derive(Debug, Clone)]
pub struct Device {
    inner: Arc<DeviceInner>,
}

#[derive(Debug)]
struct DeviceInner {
    name: String,
    netdev: String,
    ifindex: u32,
    mac: [u8; 6],
    guid: u64,
    attr: DeviceAttr,
    port: PortAttr,
    gids: [Gid; GID_TABLE_LEN],
    config: Config,
    shared: Shared,
}

impl PartialEq for Device {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl Eq for Device {}

impl Device {
    /// Builds the device of one interface, on the process's fabric. Fails with ENOMEM when the
    /// process has no fabric and cannot start one (its thread limit is reached).
    pub fn from_interface(ifc: &Interface, config: &Config) -> Result<Self> {
        Ok(Self::on_fabric(ifc, config, &registry()?.fabric))
    }

    /// Builds the device of one interface on `fabric`.
    pub(crate) fn on_fabric(ifc: &Interface, config: &Config, fabric: &Arc<Fabric>) -> Self {
        let guid = node_guid(ifc);
        let limits = config.limits;
        let attr = DeviceAttr {
            fw_ver: env!("CARGO_PKG_VERSION").to_string(),
            node_guid: guid,
            sys_image_guid: guid,
            max_mr_size: limits.max_mr_size,
            page_size_cap: 0xFFFF_F000,
            vendor_id: VENDOR_ID,
            vendor_part_id: 0,
            hw_ver: 0,
            max_qp: limits.max_qp,
            max_qp_wr: limits.max_qp_wr,
            device_cap_flags: cap_flags::BAD_PKEY_CNTR
                | cap_flags::BAD_QKEY_CNTR
                | cap_flags::CURR_QP_STATE_MOD
                | cap_flags::SYS_IMAGE_GUID
                | cap_flags::RC_RNR_NAK_GEN
                | cap_flags::SRQ_RESIZE
                | cap_flags::XRC
                | cap_flags::UD_AV_PORT_ENFORCE
                | cap_flags::MEM_WINDOW
                | cap_flags::MEM_WINDOW_TYPE_2B
                | cap_flags::MANAGED_FLOW_STEERING,
            max_sge: limits.max_sge,
            max_sge_rd: limits.max_sge,
            max_cq: limits.max_cq,
            max_cqe: limits.max_cqe,
            max_mr: limits.max_mr,
            max_pd: limits.max_pd,
            max_qp_rd_atom: u32::from(limits.max_qp_rd_atom),
            max_ee_rd_atom: 0,
            max_res_rd_atom: u32::from(limits.max_qp_rd_atom).saturating_mul(limits.max_qp),
            max_qp_init_rd_atom: u32::from(limits.max_qp_init_rd_atom),
            max_ee_init_rd_atom: 0,
            atomic_cap: AtomicCap::Hca,
            max_ee: 0,
            max_rdd: 0,
            max_mw: limits.max_mw,
            max_raw_ipv6_qp: 0,
            max_raw_ethy_qp: 0,
            max_mcast_grp: limits.max_mcast_grp,
            max_mcast_qp_attach: limits.max_mcast_qp_attach,
            max_total_mcast_qp_attach: limits.max_total_mcast_qp_attach,
            max_ah: limits.max_ah,
            max_fmr: 0,
            max_map_per_fmr: 0,
            max_srq: limits.max_srq,
            max_srq_wr: limits.max_srq_wr,
            max_srq_sge: limits.max_srq_sge,
            max_pkeys: PKEY_TABLE_LEN,
            local_ca_ack_delay: 15,
            phys_port_cnt: 1,
        };
        let active_mtu = if ifc.loopback {
            Mtu::Mtu4096
        } else {
            Mtu::largest_within(ifc.mtu.saturating_sub(ROCE_HEADER_ALLOWANCE)).unwrap_or(Mtu::Mtu256)
        };
        let state = if ifc.running {
            PortState::Active
        } else {
            PortState::Down
        };
        let gids = gid_table(&ifc.addrs);
        let port = PortAttr {
            state,
            max_mtu: Mtu::Mtu4096,
            active_mtu,
            gid_tbl_len: GID_TABLE_LEN as u32,
            port_cap_flags: PORT_IP_BASED_GIDS,
            max_msg_sz: 1 << 31,
            bad_pkey_cntr: 0,
            qkey_viol_cntr: 0,
            pkey_tbl_len: PKEY_TABLE_LEN,
            lid: 0,
            sm_lid: 0,
            lmc: 0,
            max_vl_num: 1,
            sm_sl: 0,
            subnet_timeout: 0,
            init_type_reply: 0,
            active_width: 1,                             // 1X
            active_speed: 32,                            // EDR: 25 Gbit/s per lane
            phys_state: if ifc.running { 5 } else { 3 }, // LinkUp / Disabled
            link_layer: softverbs_engine::types::LINK_LAYER_ETHERNET,
            flags: 0,
            port_cap_flags2: 0,
        };
        Self {
            inner: Arc::new(DeviceInner {
                name: format!("sv_{}", ifc.name),
                netdev: ifc.name.clone(),
                ifindex: ifc.index,
                mac: ifc.mac.unwrap_or_default(),
                guid,
                attr,
                port,
                gids,
                config: config.clone(),
                shared: Shared::new(&format!("sv_{}", ifc.name), &gids, ifc.index, fabric),
            }),
        }
    }

    /// The device name (`ibv_get_device_name`): `sv_` followed by the interface name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The network interface this device runs on.
    pub fn netdev(&self) -> &str {
        &self.inner.netdev
    }

    /// The kernel index of the network interface.
    pub fn ifindex(&self) -> u32 {
        self.inner.ifindex
    }

    /// The interface's MAC address (zeros on a link without one, such as loopback).
    pub fn mac(&self) -> [u8; 6] {
        self.inner.mac
    }

    /// The node GUID (`ibv_get_device_guid`), as a host-order number whose big-endian bytes are
    /// the EUI-64.
    pub fn guid(&self) -> u64 {
        self.inner.guid
    }

    /// Device attributes (`ibv_query_device`).
    pub fn attr(&self) -> &DeviceAttr {
        &self.inner.attr
    }

    /// Port attributes (`ibv_query_port`) of port 1, the only port.
    pub fn port_attr(&self) -> &PortAttr {
        &self.inner.port
    }

    /// The port's GID table; unused entries are zero.
    pub fn gid_table(&self) -> &[Gid; GID_TABLE_LEN] {
        &self.inner.gids
    }

    /// The configuration the device was built with.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// The enforced limits.
    pub fn limits(&self) -> &Limits {
        &self.inner.config.limits
    }

    pub(crate) fn shared(&self) -> &Shared {
        &self.inner.shared
    }

    /// Takes one unit of `r`, or fails with ENOMEM naming the limit.
    pub(crate) fn acquire(&self, r: Resource) -> Result<()> {
        let limit = r.limit(self.limits());
        self.shared().counts[r as usize]
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            })
            .map(drop)
            .map_err(|n| Error::no_resources(format!("{} ({limit}) reached with {n} in use", r.name())))
    }

    /// Returns one unit of `r`.
    pub(crate) fn release(&self, r: Resource) {
        self.shared().counts[r as usize].fetch_sub(1, Ordering::AcqRel);
    }

    /// Takes `len` bytes of device memory, or fails with ENOMEM when `max_dm_size` would be
    /// exceeded.
    pub(crate) fn acquire_dm_bytes(&self, len: u64) -> Result<()> {
        let limit = self.limits().max_dm_size;
        self.shared()
            .dm_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                n.checked_add(len).filter(|&t| t <= limit)
            })
            .map(drop)
            .map_err(|n| {
                Error::no_resources(format!(
                    "max_dm_size ({limit}) reached: {n} bytes in use, {len} more requested"
                ))
            })
    }

    /// Returns `len` bytes of device memory.
    pub(crate) fn release_dm_bytes(&self, len: u64) {
        self.shared().dm_bytes.fetch_sub(len, Ordering::AcqRel);
    }

    /// How many of `r` are in use.
    #[cfg(test)]
    pub(crate) fn in_use(&self, r: Resource) -> u32 {
        self.shared().counts[r as usize].load(Ordering::Acquire)
    }

    /// A fresh memory-region key: random (so a peer cannot guess one) and unique on this
    /// device. Region keys have the top bit clear and window keys have it set, so the two
    /// never collide (as rxe keeps their index ranges apart).
    pub(crate) fn alloc_key(&self) -> u32 {
        let mut keys = self.shared().keys.lock();
        loop {
            let key = random_u32() & 0x7FFF_FFFF;
            // 0 and all-ones are reserved: they are what uninitialised or invalid keys look like.
            if key != 0 && key != u32::MAX && keys.insert(key) {
                return key;
            }
        }
    }

    /// Releases a memory key.
    pub(crate) fn free_key(&self, key: u32) {
        self.shared().keys.lock().remove(&key);
    }

    /// A fresh memory-window key: a random index (bits 8..32, top bit set), unique among the
    /// device's windows, with a random tag.
    pub(crate) fn alloc_mw_key(&self) -> u32 {
        let mut indices = self.shared().mw_indices.lock();
        loop {
            let key = random_u32() | 0x8000_0000;
            // All-ones is reserved, as for region keys.
            if key | 0xFF != u32::MAX && indices.insert(key >> 8) {
                return key;
            }
        }
    }

    /// Releases a memory-window key (any tag).
    pub(crate) fn free_mw_key(&self, key: u32) {
        self.shared().mw_indices.lock().remove(&(key >> 8));
    }

    /// A fresh QP number, unique among live QPs of this process; ENOMEM when none is left.
    pub(crate) fn alloc_qpn(&self) -> Result<u32> {
        self.node()
            .fabric()
            .alloc_qpn(self.config().udp_port, self.config().udp_slots)
    }

    /// The UDP driver of this process as (slot, own UDP port, whether it holds the standard
    /// port); `None` before the first QP is created, or if no port could be bound.
    pub fn udp_status(&self) -> Option<(u8, u16, bool)> {
        self.node().fabric().udp_status()
    }

    /// Datagrams with the forwarding header that this process dropped because they did not come
    /// from the holder of the standard RoCE port (forgeries by other local senders).
    pub fn forged_forwards(&self) -> u64 {
        self.node().fabric().forged_forwards()
    }

    /// Releases a QP number.
    pub(crate) fn free_qpn(&self, qpn: u32) {
        self.node().fabric().free_qpn(qpn);
    }

    /// The XRC domains of this device in this process, by inode.
    pub(crate) fn xrc_domains(&self) -> &crate::xrc::DomainTable {
        &self.shared().xrc_domains
    }

    /// The device's endpoint on the fabric.
    pub(crate) fn node(&self) -> &Arc<Node> {
        &self.shared().node
    }

    /// Packet counters of this device.
    pub fn counters(&self) -> CounterSnapshot {
        self.node().counters.snapshot()
    }
}

/// The RoCE v2 GID table of an interface: IPv6 link-local addresses first (as the kernel puts the
/// default GID at index 0), then IPv4 addresses mapped into IPv6, then the other IPv6 addresses.
pub fn gid_table(addrs: &[IpAddr]) -> [Gid; GID_TABLE_LEN] {
    let is_link_local = |ip: &IpAddr| matches!(ip, IpAddr::V6(v6) if (v6.segments()[0] & 0xffc0) == 0xfe80);
    let mut ordered: Vec<IpAddr> = addrs.iter().copied().filter(is_link_local).collect();
    ordered.extend(addrs.iter().copied().filter(IpAddr::is_ipv4));
    ordered.extend(
        addrs
            .iter()
            .copied()
            .filter(|ip| ip.is_ipv6() && !is_link_local(ip)),
    );
    let mut table = [Gid::ZERO; GID_TABLE_LEN];
    for (slot, ip) in table.iter_mut().zip(ordered) {
        *slot = Gid::from_ip(ip);
    }
    table
}

/// The node GUID: the EUI-64 of the interface's MAC (as RoCE devices derive it), or, for links
/// without a MAC such as loopback, a stable hash of the host's identity and the interface name.
fn node_guid(ifc: &Interface) -> u64 {
    match ifc.mac {
        Some(mac) if mac != [0; 6] => {
            u64::from_be_bytes([mac[0] ^ 0x02, mac[1], mac[2], 0xff, 0xfe, mac[3], mac[4], mac[5]])
        }
        _ => {
            let host = std::fs::read_to_string("/etc/machine-id").unwrap_or_default();
            let mut h = std::collections::hash_map::DefaultHasher::new();
            host.trim().hash(&mut h);
            ifc.name.hash(&mut h);
            // A locally administered EUI-64 (U/L bit set after the flip), so it never collides
            // with one derived from a real MAC.
            (h.finish() & !0xFF00_0000_0000_0000) | 0x0200_0000_0000_0000
        }
    }
}

/// Discovers the devices for `config`: one per interface with an IP address, loopback included,
/// ordered by interface index.
pub fn discover(config: &Config) -> Result<Vec<Device>> {
    let mut list = Vec::new();
    for ifc in netif::interfaces()? {
        if let Some(names) = &config.interfaces {
            if !names.iter().any(|n| n == &ifc.name) {
                continue;
            }
        }
        list.push(Device::from_interface(&ifc, config)?);
    }
    Ok(list)
}

/// What the process's devices share: the fabric between them (created here, with the first
/// device, and owned by every device's node) and the devices by name.
struct Registry {
    fabric: Arc<Fabric>,
    devices: Mutex<HashMap<String, Device>>,
}

/// The process's registry, made with the first device. Fails with ENOMEM while the fabric's
/// progress thread cannot be started (the thread limit): the next call tries again.
fn registry() -> Result<&'static Registry> {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    static MAKING: Mutex<()> = Mutex::new(());
    if let Some(r) = REGISTRY.get() {
        return Ok(r);
    }
    let _making = MAKING.lock();
    if let Some(r) = REGISTRY.get() {
        return Ok(r);
    }
    let fabric = Fabric::new()
        .map_err(|e| Error::no_resources(format!("cannot start the fabric's progress thread: {e}")))?;
    crate::capture::start_from_env(fabric.tap());
    // Under `MAKING`, after the check above: nothing else initializes it.
    Ok(REGISTRY.get_or_init(|| Registry {
        fabric,
        devices: Mutex::new(HashMap::new()),
    }))
}

/// The packet-capture hook of the process's fabric, if it has one.
pub(crate) fn process_tap() -> Option<&'static crate::capture::Tap> {
    registry().ok().map(|r| r.fabric.tap())
}

/// The UDP slot of this process, as [`Device::udp_status`] gives it, for code that names
/// processes by slot without a device at hand (the XRC relay). A slot is the process's, not a
/// device's: every device's node is on the registry's one fabric.
pub(crate) fn process_udp_status() -> Option<(u8, u16, bool)> {
    registry().ok()?.fabric.udp_status()
}

/// The process-wide devices for the environment's configuration (`ibv_get_device_list`).
///
/// A device keeps its identity for the life of the process, so that resource limits and memory
/// keys are shared by every context opened on it; interfaces that appear later are added.
pub fn device_list() -> Result<Vec<Device>> {
    let config = Config::from_env()?;
    let fresh = discover(&config)?;
    let mut known = registry()?.devices.lock();
    Ok(fresh
        .into_iter()
        .map(|d| {
            known
                .entry(d.name().to_string())
                .and_modify(|old| {
                    if old.config() != &config {
                        *old = d.clone();
                    }
                })
                .or_insert(d)
                .clone()
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    fn ifc(name: &str, mtu: u32, loopback: bool, addrs: Vec<IpAddr>) -> Interface {
        Interface {
            name: name.into(),
            index: 7,
            running: true,
            loopback,
            mtu,
            mac: Some([0x02, 0x11, 0x22, 0x33, 0x44, 0x55]),
            addrs,
        }
    }

    #[test]
    fn gid_order_link_local_then_ipv4_then_ipv6() {
        let ll: Ipv6Addr = "fe80::1".parse().unwrap();
        let global: Ipv6Addr = "fd00::2".parse().unwrap();
        let v4 = Ipv4Addr::new(192, 0, 2, 2);
        let t = gid_table(&[IpAddr::V6(global), IpAddr::V4(v4), IpAddr::V6(ll)]);
        assert_eq!(t[0], Gid::from(ll));
        assert_eq!(t[1], Gid::from(v4));
        assert_eq!(t[2], Gid::from(global));
        assert!(t[3..].iter().all(|g| g.is_zero()));
    }

    #[test]
    fn active_mtu_follows_netdev_mtu() {
        let cfg = Config::default();
        let d = Device::from_interface(
            &ifc("eth9", 1500, false, vec![IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1))]),
            &cfg,
        )
        .unwrap();
        assert_eq!(d.port_attr().active_mtu, Mtu::Mtu1024);
        let d = Device::from_interface(
            &ifc("eth9", 9000, false, vec![IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1))]),
            &cfg,
        )
        .unwrap();
        assert_eq!(d.port_attr().active_mtu, Mtu::Mtu4096);
        let d = Device::from_interface(
            &ifc("lo", 65536, true, vec![IpAddr::V4(Ipv4Addr::LOCALHOST)]),
            &cfg,
        )
        .unwrap();
        assert_eq!(d.port_attr().active_mtu, Mtu::Mtu4096);
        assert_eq!(d.port_attr().max_mtu, Mtu::Mtu4096);
    }

    #[test]
    fn guid_is_eui64_of_mac() {
        let d = Device::from_interface(
            &ifc("eth9", 1500, false, vec![IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1))]),
            &Config::default(),
        )
        .unwrap();
        assert_eq!(d.guid(), 0x0011_22ff_fe33_4455);
        assert_eq!(d.name(), "sv_eth9");
    }

    #[test]
    fn resource_limits_are_enforced() {
        let mut cfg = Config::default();
        cfg.limits.max_pd = 2;
        let d = Device::from_interface(
            &ifc("x", 1500, false, vec![IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1))]),
            &cfg,
        )
        .unwrap();
        d.acquire(Resource::Pd).unwrap();
        d.acquire(Resource::Pd).unwrap();
        let e = d.acquire(Resource::Pd).unwrap_err();
        assert_eq!(e.errno(), 12);
        assert!(e.to_string().contains("max_pd"));
        d.release(Resource::Pd);
        d.acquire(Resource::Pd).unwrap();
        assert_eq!(d.in_use(Resource::Pd), 2);
    }

    #[test]
    fn keys_and_qpns_are_unique() {
        let d = Device::from_interface(
            &ifc("x", 1500, false, vec![IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1))]),
            &Config::default(),
        )
        .unwrap();
        let keys: HashSet<u32> = (0..1000).map(|_| d.alloc_key()).collect();
        assert_eq!(keys.len(), 1000);
        let qpns: HashSet<u32> = (0..1000).map(|_| d.alloc_qpn().unwrap()).collect();
        assert_eq!(qpns.len(), 1000);
        assert!(qpns.iter().all(|&q| (0x11..0xFF_FFFF).contains(&q)));
    }

    #[test]
    fn discovery_always_finds_loopback() {
        let list = discover(&Config::default()).unwrap();
        let lo = list.iter().find(|d| d.netdev() == "lo").expect("loopback device");
        assert_eq!(lo.name(), "sv_lo");
        assert!(!lo.gid_table()[0].is_zero(), "the first GID must be usable");
        let only_lo = discover(&Config {
            interfaces: Some(vec!["lo".into()]),
            ..Config::default()
        })
        .unwrap();
        assert_eq!(only_lo.len(), 1);
    }
}
