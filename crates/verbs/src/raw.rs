//! Raw packet QPs: flow steering rules, receive work queues, indirection tables and RSS QPs.
//!
//! A raw packet QP is an ordinary [`QueuePair`] of type [`QpType::RawPacket`]: sends and
//! receives carry whole Ethernet frames. It receives only what a [`Flow`] steers to it. A flow
//! on a UD QP adds copies of received UD datagrams to what the QP receives by its number.

use std::sync::Arc;

use softverbs_device as core;
use softverbs_engine::types::RecvWr;
use softverbs_engine::Result;

use crate::context::Context;
use crate::cq::CompletionQueue;
use crate::pd::ProtectionDomain;
use crate::qp::{QpInit, QueuePair};
use crate::PostError;

#[derive(Debug)]
#[allow(dead_code)] // held only to keep the QP alive while its flow exists
enum FlowOwner {
    Qp(QueuePair),
    Rss(RssQueuePair),
}

/// A flow steering rule (`ibv_create_flow`); destroyed when dropped.
#[derive(Debug)]
pub struct Flow {
    core: Arc<core::Flow>,
    _owner: FlowOwner,
}

impl Drop for Flow {
    fn drop(&mut self) {
        let r = self.core.destroy();
        debug_assert!(r.is_ok(), "{r:?}");
    }
}

impl Flow {
    /// The rule.
    pub fn attr(&self) -> &core::FlowAttr {
        self.core.attr()
    }
}

impl QueuePair {
    /// `ibv_create_flow`: steers the frames the rule matches to this raw packet QP, or, on a UD
    /// QP, a copy of each received RoCEv2 UD datagram whose outer headers match (beside the QP
    /// it is addressed to; TAG and DROP actions are EOPNOTSUPP there). Needs CAP_NET_RAW
    /// (EPERM); other QP types are EINVAL.
    pub fn create_flow(&self, attr: &core::FlowAttr) -> Result<Flow> {
        Ok(Flow {
            core: core::Flow::create(&self.0.core, attr)?,
            _owner: FlowOwner::Qp(self.clone()),
        })
    }

    /// `ibv_modify_qp_rate_limit`: paces this raw packet QP's sends to `rate_kbps` (0:
    /// unlimited) in bursts of at most `max_burst_sz` bytes (0: one packet of `typical_pkt_sz`,
    /// 0: the port MTU). EINVAL for other QP types, outside RTS, for a rate beyond
    /// `packet_pacing_caps`, or a burst or packet size without a rate.
    pub fn modify_rate_limit(&self, rate_kbps: u32, max_burst_sz: u32, typical_pkt_sz: u16) -> Result<()> {
        self.0
            .core
            .modify_rate_limit(rate_kbps, max_burst_sz, typical_pkt_sz)
    }

    /// `ibv_create_flow` with an `IBV_FLOW_SPEC_ACTION_COUNT` spec: as
    /// [`QueuePair::create_flow`], and every frame the rule takes is counted in `counters`,
    /// which takes no more points from now on.
    pub fn create_flow_counted(&self, attr: &core::FlowAttr, counters: &crate::Counters) -> Result<Flow> {
        Ok(Flow {
            core: core::Flow::create_counted(&self.0.core, attr, Some(&counters.core))?,
            _owner: FlowOwner::Qp(self.clone()),
        })
    }
}

#[derive(Debug)]
struct WqInner {
    core: Arc<core::Wq>,
    _pd: ProtectionDomain,
    _cq: CompletionQueue,
}

impl Drop for WqInner {
    fn drop(&mut self) {
        let r = self.core.destroy();
        debug_assert!(r.is_ok(), "{r:?}");
    }
}

/// A receive work queue (`ibv_create_wq`, `IBV_WQT_RQ`). Cheap to clone; destroyed with its
/// last handle.
#[derive(Debug, Clone)]
pub struct WorkQueue(Arc<WqInner>);

impl ProtectionDomain {
    /// `ibv_create_qp_ex` with `IBV_QP_INIT_ATTR_MAX_TSO_HEADER`: a raw packet QP that can post
    /// `SendOp::Tso` work requests with headers of up to `max_tso_header` bytes.
    pub fn create_qp_tso(&self, init: &QpInit<'_>, max_tso_header: u16) -> Result<QueuePair> {
        QueuePair::create_with(self, init, max_tso_header)
    }

    /// `ibv_create_wq`: a receive WQ completing on `cq`, in the RESET state.
    pub fn create_wq(&self, cq: &CompletionQueue, max_wr: u32, max_sge: u32) -> Result<WorkQueue> {
        Ok(WorkQueue(Arc::new(WqInner {
            core: core::Wq::create(self.core(), cq.core(), max_wr, max_sge)?,
            _pd: self.clone(),
            _cq: cq.clone(),
        })))
    }

    /// `ibv_create_qp_ex` with `IBV_QP_INIT_ATTR_IND_TABLE | IBV_QP_INIT_ATTR_RX_HASH`: a
    /// receive-only raw packet QP spreading the frames its flows steer to it over the WQs of
    /// `table` by the Toeplitz hash of `hash`. Needs CAP_NET_RAW (EPERM).
    pub fn create_rss_qp(&self, table: &RwqIndTable, hash: core::RxHashConf) -> Result<RssQueuePair> {
        Ok(RssQueuePair(Arc::new(RssInner {
            core: core::Qp::create_rss(self.core(), &table.0.core, hash)?,
            _pd: self.clone(),
            _table: table.clone(),
        })))
    }
}

impl WorkQueue {
    /// The WQ number; receive completions carry it as `qp_num`.
    pub fn wq_num(&self) -> u32 {
        self.0.core.wq_num()
    }

    /// The state.
    pub fn state(&self) -> core::WqState {
        self.0.core.state()
    }

    /// Actual `(max_wr, max_sge)`.
    pub fn caps(&self) -> (u32, u32) {
        self.0.core.caps()
    }

    /// `ibv_modify_wq` (`IBV_WQ_ATTR_STATE`, and `IBV_WQ_ATTR_CURR_STATE` if `cur` is given).
    pub fn modify(&self, state: core::WqState, cur: Option<core::WqState>) -> Result<()> {
        self.0.core.modify(state, cur)
    }

    /// `ibv_post_wq_recv`.
    pub fn post_recv(&self, wrs: &[RecvWr]) -> Result<(), PostError> {
        self.0.core.post_recv(wrs)
    }
}

#[derive(Debug)]
struct TableInner {
    core: Arc<core::RwqIndTable>,
    _wqs: Vec<WorkQueue>,
}

impl Drop for TableInner {
    fn drop(&mut self) {
        let r = self.core.destroy();
        debug_assert!(r.is_ok(), "{r:?}");
    }
}

/// A receive WQ indirection table (`ibv_create_rwq_ind_table`).
#[derive(Debug, Clone)]
pub struct RwqIndTable(Arc<TableInner>);

impl Context {
    /// `ibv_create_rwq_ind_table`: exactly `1 << log_size` WQs (repeats allowed).
    pub fn create_rwq_ind_table(&self, log_size: u32, wqs: &[&WorkQueue]) -> Result<RwqIndTable> {
        let cores: Vec<Arc<core::Wq>> = wqs.iter().map(|w| w.0.core.clone()).collect();
        Ok(RwqIndTable(Arc::new(TableInner {
            core: core::RwqIndTable::create(self.core(), log_size, &cores)?,
            _wqs: wqs.iter().map(|w| (*w).clone()).collect(),
        })))
    }

    /// `ibv_query_device_ex`'s TSO capabilities.
    pub fn tso_caps(&self) -> core::TsoCaps {
        self.core().device().tso_caps()
    }

    /// `ibv_query_device_ex`'s RSS capabilities.
    pub fn rss_caps(&self) -> core::RssCaps {
        self.core().device().rss_caps()
    }
}

#[derive(Debug)]
struct RssInner {
    core: Arc<core::Qp>,
    _pd: ProtectionDomain,
    _table: RwqIndTable,
}

impl Drop for RssInner {
    fn drop(&mut self) {
        let r = self.core.destroy();
        debug_assert!(r.is_ok(), "{r:?}");
    }
}

/// A receive-only RSS QP (see [`ProtectionDomain::create_rss_qp`]).
#[derive(Debug, Clone)]
pub struct RssQueuePair(Arc<RssInner>);

impl RssQueuePair {
    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        self.0.core.qpn()
    }

    /// `ibv_create_flow` on the RSS QP.
    pub fn create_flow(&self, attr: &core::FlowAttr) -> Result<Flow> {
        Ok(Flow {
            core: core::Flow::create(&self.0.core, attr)?,
            _owner: FlowOwner::Rss(self.clone()),
        })
    }
}
