//! Flow steering (`ibv_create_flow`): rules that pick which raw packet QPs receive a frame.
//!
//! For each received frame, NORMAL rules are tried by priority (lowest value first). All
//! matching rules of the first priority that has a match take the frame: a DROP rule discards
//! it, the others deliver it to their QP (once per QP), with the rule's tag. The search stops
//! there unless every matching rule has `DONT_TRAP`. A frame no NORMAL rule took goes to the
//! MC_DEFAULT rules if it is multicast, and to the ALL_DEFAULT rules. SNIFFER rules get every
//! frame, including the ones this host sends. Nothing reaches a raw QP without a rule.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;
use softverbs_engine::steering::{FlowSpec, FrameHeaders};
use softverbs_engine::types::QpType;
use softverbs_engine::{Error, Result};

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
}

impl Rule {
    fn matches(&self, h: &FrameHeaders) -> bool {
        self.attr.specs.iter().all(|s| s.matches(h))
    }

    fn deliver(&self, frame: &[u8], done: &mut Vec<*const Qp>) {
        let p = Arc::as_ptr(&self.qp);
        if !done.contains(&p) {
            done.push(p);
            self.qp.handle_frame(frame, self.attr.tag.unwrap_or(0));
        }
    }
}

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
        let rules = self.rules.read().clone();
        let mut done = Vec::new();
        for r in rules.iter().filter(|r| r.attr.flow_type == FlowType::Sniffer) {
            r.deliver(frame, &mut done);
        }
        if outgoing {
            return;
        }
        done.clear();
        let mut taken = false;
        let normal: Vec<&Arc<Rule>> = rules
            .iter()
            .filter(|r| r.attr.flow_type == FlowType::Normal)
            .collect();
        for group in normal.chunk_by(|a, b| a.attr.priority == b.attr.priority) {
            let hits: Vec<&&Arc<Rule>> = group.iter().filter(|r| r.matches(&h)).collect();
            if hits.is_empty() {
                continue;
            }
            taken = true;
            for r in &hits {
                if !r.attr.drop {
                    r.deliver(frame, &mut done);
                }
            }
            if !hits.iter().all(|r| r.attr.flags & FLOW_FLAG_DONT_TRAP != 0) {
                break;
            }
        }
        if taken {
            return;
        }
        for r in rules.iter().filter(|r| {
            r.attr.flow_type == FlowType::AllDefault
                || (r.attr.flow_type == FlowType::McDefault && h.is_multicast())
        }) {
            r.deliver(frame, &mut done);
        }
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

/// A flow steering rule attached to a QP (`ibv_create_flow`). The QP cannot be destroyed
/// (EBUSY) while the rule exists.
#[derive(Debug)]
pub struct Flow {
    rule: Arc<Rule>,
    destroyed: parking_lot::Mutex<bool>,
}

impl Flow {
    /// `ibv_create_flow`: raw packet QPs only (UD QPs have no Ethernet steering here:
    /// EOPNOTSUPP; RC/UC: EINVAL), CAP_NET_RAW (EPERM), port 1, DONT_TRAP only on NORMAL rules,
    /// EGRESS rules are not offered (EOPNOTSUPP).
    pub fn create(qp: &Arc<Qp>, attr: &FlowAttr) -> Result<Arc<Self>> {
        match qp.qp_type() {
            QpType::RawPacket => {}
            QpType::Ud => {
                return Err(Error::not_supported(
                    "flow steering of UD QPs: UD traffic arrives over UDP, not as Ethernet frames",
                ))
            }
            t => {
                return Err(Error::invalid(format!(
                    "flows attach to UD or raw packet QPs, not {t}"
                )))
            }
        }
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
        require_cap_net_raw("ibv_create_flow")?;
        let port = qp
            .raw_port()
            .ok_or_else(|| Error::invalid("the QP has no packet port"))?;
        qp.uses().acquire("queue pair")?;
        let rule = Arc::new(Rule {
            id: NEXT_FLOW.fetch_add(1, Ordering::Relaxed),
            attr: attr.clone(),
            qp: qp.clone(),
        });
        port.steering.insert(rule.clone());
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
        if let Some(port) = self.rule.qp.raw_port() {
            port.steering.remove(self.rule.id);
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
