//! Flow steering (`ibv_create_flow`): rules that pick which raw packet QPs receive a frame,
//! and which UD QPs receive a copy of a RoCEv2 UD datagram.
//!
//! For each received frame, NORMAL rules are tried by priority (lowest value first). All
//! matching rules of the first priority that has a match take the frame: a DROP rule discards
//! it, the others deliver it to their QP (once per QP), with the rule's tag. The search stops
//! there unless every matching rule has `DONT_TRAP`. A frame no NORMAL rule took goes to the
//! MC_DEFAULT rules if it is multicast, and to the ALL_DEFAULT rules. SNIFFER rules get every
//! frame, including the ones this host sends. Nothing reaches a raw QP without a rule.
//!
//! Rules on UD QPs (`UdFlows`, one table per device) see the RoCEv2 UD datagrams the device
//! receives (over UDP or from a QP of this process), as the Ethernet frame they arrived in as
//! far as the device knows it (`FrameHeaders::roce_datagram`: addresses, UDP ports, IPv4 or
//! IPv6 ethertype, destination MAC the interface's or the group's; no source MAC or VLAN tag).
//! The same selection picks rules, but a UD rule adds a copy: the QP the destination QPN names
//! (or the multicast group's members) still receives the datagram, and each QP gets one copy.
//! The copy is an ordinary UD receive: Q_Key, state and receive queue checks apply. UD
//! sniffers see received datagrams only; ALL_DEFAULT rules get the datagrams no NORMAL rule
//! took, MC_DEFAULT rules those of them sent to a multicast group.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;
use softverbs_engine::steering::{FlowSpec, FrameHeaders};
use softverbs_engine::transport::RxMeta;
use softverbs_engine::types::QpType;
use softverbs_engine::{Error, Result};
use softverbs_wire::opcode::Transport;
use softverbs_wire::packet::ParsedPacket;

use crate::counters::Counters;
use crate::qp::Qp;
use crate::raw::require_cap_net_raw;

/// `enum ibv_flow_attr_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlowType {
    /// `IBV_FLOW_ATTR_NORMAL`: frames that match the specs.
    Normal,
    /// `IBV_FLOW_ATTR_ALL_DEFAULT`: frames no NORMAL rule took.
    AllDefault,
    /// `IBV_FLOW_ATTR_MC_DEFAULT`: multicast frames no NORMAL rule took.
    McDefault,
    /// `IBV_FLOW_ATTR_SNIFFER`: every frame of the port, both directions.
    Sniffer,
}

impl FlowType {
    /// From the C value.
    pub fn from_raw(v: u32) -> Option<Self> {
        Some(match v {
            0 => Self::Normal,
            1 => Self::AllDefault,
            2 => Self::McDefault,
            3 => Self::Sniffer,
            _ => return None,
        })
    }
}

/// `IBV_FLOW_ATTR_FLAGS_DONT_TRAP`.
pub const FLOW_FLAG_DONT_TRAP: u32 = 1 << 1;
/// `IBV_FLOW_ATTR_FLAGS_EGRESS`.
pub const FLOW_FLAG_EGRESS: u32 = 1 << 2;

/// What `ibv_create_flow` asks for, with the specs already decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlowAttr {
    /// Rule type.
    pub flow_type: FlowType,
    /// Lower values are tried first.
    pub priority: u16,
    /// Port number (1).
    pub port: u8,
    /// `ibv_flow_flags`.
    pub flags: u32,
    /// Header specs; all must match.
    pub specs: Vec<FlowSpec>,
    /// `IBV_FLOW_SPEC_ACTION_TAG`: the tag receive completions carry.
    pub tag: Option<u32>,
    /// `IBV_FLOW_SPEC_ACTION_DROP`.
    pub drop: bool,
}

/// Largest flow tag (mlx5 takes 24 bits).
pub const MAX_FLOW_TAG: u32 = 0xFF_FFFF;

#[derive(Debug)]
struct Rule {
    id: u64,
    attr: FlowAttr,
    qp: Arc<Qp>,
    /// `IBV_FLOW_SPEC_ACTION_COUNT`: counts the frames the rule takes.
    counters: Option<Arc<Counters>>,
}

impl Rule {
    fn matches(&self, h: &FrameHeaders) -> bool {
        self.attr.specs.iter().all(|s| s.matches(h))
    }

    fn count(&self, len: usize) {
        if let Some(c) = &self.counters {
            c.count(len);
        }
    }

    /// Counts the frame, and hands it to the QP unless an earlier rule already did.
    fn deliver(&self, frame: &[u8], done: &mut Vec<*const Qp>) {
        self.count(frame.len());
        let p = Arc::as_ptr(&self.qp);
        if !done.contains(&p) {
            done.push(p);
            self.qp.handle_frame(frame, self.attr.tag.unwrap_or(0));
        }
    }
}

/// The rules that take one packet: its sniffers, and the other rules that took it, each with
/// whether it delivers (false: a DROP rule).
type Selection = (Vec<Arc<Rule>>, Vec<(Arc<Rule>, bool)>);

/// The rules of one device, sorted by priority.
#[derive(Debug, Default)]
pub(crate) struct Steering {
    rules: RwLock<Vec<Arc<Rule>>>,
}

static NEXT_FLOW: AtomicU64 = AtomicU64::new(1);

impl Steering {
    /// Hands a frame to the QPs the rules pick. `outgoing` frames (sent by this host) only go
    /// to sniffers.
    pub(crate) fn steer(&self, frame: &[u8], outgoing: bool) {
        let Some(h) = FrameHeaders::parse(frame) else {
            return;
        };
        let (sniffers, taken) = self.select(&h, outgoing);
        let mut done = Vec::new();
        for r in &sniffers {
            r.deliver(frame, &mut done);
        }
        done.clear();
        for (r, deliver) in &taken {
            if *deliver {
                r.deliver(frame, &mut done);
            } else {
                r.count(frame.len());
            }
        }
    }

    /// The rules a packet with headers `h` goes to: every sniffer; unless `outgoing`, the
    /// matching NORMAL rules of the first priority with a match (and of later ones past
    /// DONT_TRAP rules), or, if none matched, the ALL_DEFAULT rules and, for a multicast
    /// destination, the MC_DEFAULT ones.
    fn select(&self, h: &FrameHeaders, outgoing: bool) -> Selection {
        let rules = self.rules.read().clone();
        let sniffers = rules
            .iter()
            .filter(|r| r.attr.flow_type == FlowType::Sniffer)
            .cloned()
            .collect();
        let mut taken = Vec::new();
        if outgoing {
            return (sniffers, taken);
        }
        let normal: Vec<&Arc<Rule>> = rules
            .iter()
            .filter(|r| r.attr.flow_type == FlowType::Normal)
            .collect();
        for group in normal.chunk_by(|a, b| a.attr.priority == b.attr.priority) {
            let hits: Vec<&&Arc<Rule>> = group.iter().filter(|r| r.matches(h)).collect();
            if hits.is_empty() {
                continue;
            }
            taken.extend(hits.iter().map(|r| (Arc::clone(r), !r.attr.drop)));
            if !hits.iter().all(|r| r.attr.flags & FLOW_FLAG_DONT_TRAP != 0) {
                break;
            }
        }
        if taken.is_empty() {
            taken.extend(
                rules
                    .iter()
                    .filter(|r| {
                        r.attr.flow_type == FlowType::AllDefault
                            || (r.attr.flow_type == FlowType::McDefault && h.is_multicast())
                    })
                    .map(|r| (r.clone(), true)),
            );
        }
        (sniffers, taken)
    }

    fn is_empty(&self) -> bool {
        self.rules.read().is_empty()
    }

    fn insert(&self, rule: Arc<Rule>) {
        let mut rules = self.rules.write();
        // Stable: equal priorities keep their creation order.
        let at = rules.partition_point(|r| r.attr.priority <= rule.attr.priority);
        rules.insert(at, rule);
    }

    fn remove(&self, id: u64) -> bool {
        let mut rules = self.rules.write();
        let before = rules.len();
        rules.retain(|r| r.id != id);
        rules.len() != before
    }
}

/// The flow rules of a device's UD QPs. They match the outer headers of received RoCEv2 UD
/// datagrams and add their QPs to the ones the datagram's destination QPN addresses.
#[derive(Debug, Default)]
pub(crate) struct UdFlows {
    steering: Steering,
    /// The interface's MAC, the destination of unicast datagrams (set with the first rule).
    mac: parking_lot::Mutex<[u8; 6]>,
}

impl UdFlows {
    /// Adds to `targets` (the QPs the datagram is addressed to) the QPs whose rules take a
    /// received UD datagram, once each: sniffers, then NORMAL or default rules as for raw
    /// frames (see [`Steering::select`]). `ports` are its UDP source and destination ports;
    /// `len` (the RoCE bytes, BTH to ICRC) is what a rule's counters add.
    /// Non-UD packets, and every packet while no UD rule exists, cost one check.
    pub(crate) fn steer(
        &self,
        pkt: &ParsedPacket<'_>,
        meta: &RxMeta,
        ports: (u16, u16),
        len: usize,
        targets: &mut Vec<Arc<Qp>>,
    ) {
        if pkt.opcode().transport() != Transport::Ud || self.steering.is_empty() {
            return;
        }
        let h = FrameHeaders::roce_datagram(
            *self.mac.lock(),
            SocketAddr::new(meta.sgid.to_ip(), ports.0),
            SocketAddr::new(meta.dgid.to_ip(), ports.1),
            meta.traffic_class,
            meta.hop_limit,
        );
        let (sniffers, taken) = self.steering.select(&h, false);
        // UD rules never drop (refused at creation), so every rule taken delivers.
        for r in sniffers.iter().chain(taken.iter().map(|(r, _)| r)) {
            r.count(len);
            if !targets.iter().any(|q| Arc::ptr_eq(q, &r.qp)) {
                targets.push(r.qp.clone());
            }
        }
    }
}

/// A flow steering rule attached to a QP (`ibv_create_flow`). The QP cannot be destroyed
/// (EBUSY) while the rule exists.
#[derive(Debug)]
pub struct Flow {
    rule: Arc<Rule>,
    destroyed: parking_lot::Mutex<bool>,
}

impl Flow {
    /// `ibv_create_flow`: raw packet and UD QPs (other types: EINVAL, as the kernel does),
    /// CAP_NET_RAW (EPERM), port 1, DONT_TRAP only on NORMAL rules, EGRESS rules are not
    /// offered (EOPNOTSUPP). On a UD QP the rule matches received RoCEv2 UD datagrams by
    /// their outer headers (see the module documentation); TAG and DROP actions are
    /// EOPNOTSUPP there.
    pub fn create(qp: &Arc<Qp>, attr: &FlowAttr) -> Result<Arc<Self>> {
        Self::create_counted(qp, attr, None)
    }

    /// `ibv_create_flow` with an `IBV_FLOW_SPEC_ACTION_COUNT` spec: as [`Flow::create`], and
    /// every frame the rule takes (delivers or drops) is counted in `counters`, which must
    /// belong to the QP's device (EINVAL) and cannot get more points while bound.
    pub fn create_counted(
        qp: &Arc<Qp>,
        attr: &FlowAttr,
        counters: Option<&Arc<Counters>>,
    ) -> Result<Arc<Self>> {
        let ud = match qp.qp_type() {
            QpType::RawPacket => false,
            QpType::Ud => true,
            t => {
                return Err(Error::invalid(format!(
                    "flows attach to UD or raw packet QPs, not {t}"
                )))
            }
        };
        if attr.port != 1 {
            return Err(Error::invalid(format!("port {} does not exist", attr.port)));
        }
        if attr.flags & !(FLOW_FLAG_DONT_TRAP | FLOW_FLAG_EGRESS) != 0 {
            return Err(Error::invalid(format!("unknown flow flags {:#x}", attr.flags)));
        }
        if attr.flags & FLOW_FLAG_EGRESS != 0 {
            return Err(Error::not_supported("egress flows"));
        }
        if attr.flags & FLOW_FLAG_DONT_TRAP != 0 && attr.flow_type != FlowType::Normal {
            return Err(Error::invalid(
                "IBV_FLOW_ATTR_FLAGS_DONT_TRAP is only for NORMAL rules",
            ));
        }
        if attr.flow_type != FlowType::Normal && (!attr.specs.is_empty() || attr.drop) {
            return Err(Error::invalid("only NORMAL rules take specs or a DROP action"));
        }
        if attr.drop && attr.tag.is_some() {
            return Err(Error::invalid("a rule cannot both drop and tag"));
        }
        if attr.tag.is_some_and(|t| t > MAX_FLOW_TAG) {
            return Err(Error::invalid(format!("flow tag exceeds {MAX_FLOW_TAG:#x}")));
        }
        if counters.is_some_and(|c| !c.context().device().eq(qp.context().device())) {
            return Err(Error::invalid("the counters belong to another device"));
        }
        if ud && attr.tag.is_some() {
            return Err(Error::not_supported(
                "flow tags on UD QPs: a UD receive completion carries no flow tag",
            ));
        }
        if ud && attr.drop {
            return Err(Error::not_supported(
                "DROP rules on UD QPs: UD rules add copies of a datagram, never take it away",
            ));
        }
        require_cap_net_raw("ibv_create_flow")?;
        let port = if ud {
            None
        } else {
            Some(
                qp.raw_port()
                    .ok_or_else(|| Error::invalid("the QP has no packet port"))?,
            )
        };
        if let Some(c) = counters {
            c.bind()?;
        }
        if let Err(e) = qp.uses().acquire("queue pair") {
            if let Some(c) = counters {
                c.unbind();
            }
            return Err(e);
        }
        let rule = Arc::new(Rule {
            id: NEXT_FLOW.fetch_add(1, Ordering::Relaxed),
            attr: attr.clone(),
            qp: qp.clone(),
            counters: counters.cloned(),
        });
        match port {
            Some(port) => port.steering.insert(rule.clone()),
            None => {
                let device = qp.context().device();
                let flows = &device.node().ud_flows;
                *flows.mac.lock() = device.mac();
                flows.steering.insert(rule.clone());
            }
        }
        Ok(Arc::new(Self {
            rule,
            destroyed: parking_lot::Mutex::new(false),
        }))
    }

    /// The rule.
    pub fn attr(&self) -> &FlowAttr {
        &self.rule.attr
    }

    /// The QP the rule steers to.
    pub fn qp(&self) -> &Arc<Qp> {
        &self.rule.qp
    }

    /// `ibv_destroy_flow`: EINVAL if already destroyed.
    pub fn destroy(&self) -> Result<()> {
        let mut d = self.destroyed.lock();
        if *d {
            return Err(Error::invalid("the flow has already been destroyed"));
        }
        *d = true;
        match self.rule.qp.raw_port() {
            Some(port) => port.steering.remove(self.rule.id),
            None => self
                .rule
                .qp
                .context()
                .device()
                .node()
                .ud_flows
                .steering
                .remove(self.rule.id),
        };
        if let Some(c) = &self.rule.counters {
            c.unbind();
        }
        self.rule.qp.uses().release();
        Ok(())
    }
}

impl Drop for Flow {
    fn drop(&mut self) {
        if !*self.destroyed.lock() {
            let _ = self.destroy();
        }
    }
}
