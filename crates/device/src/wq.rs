//! Receive work queues and indirection tables for receive-side scaling (`ibv_create_wq`,
//! `ibv_create_rwq_ind_table`): an RSS QP hashes each frame steered to it and hands it to one
//! WQ of its table, which scatters it into its own receive WQEs and completes on its own CQ.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use softverbs_engine::steering::{toeplitz, FrameHeaders, RxHashFields};
use softverbs_engine::transport::receive_frame;
use softverbs_engine::types::{RecvWr, WcOpcode, WcStatus, WorkCompletion};
use softverbs_engine::{Error, Result};

use crate::context::Context;
use crate::cq::Cq;
use crate::pd::Pd;
use crate::qp::PostError;
use crate::sync::UseCount;

/// `enum ibv_wq_state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WqState {
    /// `IBV_WQS_RESET`: receives nothing; posted WQEs are discarded on entry.
    Reset = 0,
    /// `IBV_WQS_RDY`: receives.
    Rdy = 1,
    /// `IBV_WQS_ERR`: posted WQEs complete flushed.
    Err = 2,
}

impl WqState {
    /// From the C value (`IBV_WQS_UNKNOWN` and others are `None`).
    pub fn from_raw(v: u32) -> Option<Self> {
        Some(match v {
            0 => Self::Reset,
            1 => Self::Rdy,
            2 => Self::Err,
            _ => return None,
        })
    }
}

/// Largest `log_ind_tbl_size` (`rss_caps.max_rwq_indirection_table_size` is 1 << this).
pub const MAX_LOG_IND_TBL_SIZE: u32 = 8;
/// Most indirection tables per device (`rss_caps.max_rwq_indirection_tables`).
pub const MAX_IND_TABLES: u32 = 64;
/// Length of the Toeplitz key an RSS QP takes.
pub const RSS_KEY_LEN: usize = 40;

#[derive(Debug)]
struct WqInner {
    state: WqState,
    queue: VecDeque<RecvWr>,
}

/// A receive work queue (`ibv_create_wq` with `IBV_WQT_RQ`).
#[derive(Debug)]
pub struct Wq {
    pd: Arc<Pd>,
    cq: Arc<Cq>,
    wq_num: u32,
    max_wr: u32,
    max_sge: u32,
    inner: Mutex<WqInner>,
    uses: UseCount,
    user_data: AtomicU64,
}

impl Wq {
    /// `ibv_create_wq`: `max_wr` 1..=max_qp_wr (rounded up to a power of two), `max_sge` up to
    /// max_sge; the CQ must belong to the PD's context. Starts in RESET.
    pub fn create(pd: &Arc<Pd>, cq: &Arc<Cq>, max_wr: u32, max_sge: u32) -> Result<Arc<Self>> {
        let ctx = pd.context();
        let limits = *ctx.device().limits();
        if !Arc::ptr_eq(cq.context(), ctx) {
            return Err(Error::invalid("the CQ belongs to another context"));
        }
        if max_wr == 0 || max_wr > limits.max_qp_wr {
            return Err(Error::invalid(format!(
                "max_wr {max_wr} is outside 1..={}",
                limits.max_qp_wr
            )));
        }
        if max_sge > limits.max_sge {
            return Err(Error::invalid(format!(
                "max_sge {max_sge} exceeds {}",
                limits.max_sge
            )));
        }
        let wq_num = ctx.device().alloc_qpn()?;
        if let Err(e) = pd.uses().acquire("protection domain") {
            ctx.device().free_qpn(wq_num);
            return Err(e);
        }
        if let Err(e) = cq.uses().acquire("completion queue") {
            pd.uses().release();
            ctx.device().free_qpn(wq_num);
            return Err(e);
        }
        Ok(Arc::new(Self {
            pd: pd.clone(),
            cq: cq.clone(),
            wq_num,
            max_wr: max_wr.next_power_of_two().min(limits.max_qp_wr),
            max_sge: max_sge.max(1),
            inner: Mutex::new(WqInner {
                state: WqState::Reset,
                queue: VecDeque::new(),
            }),
            uses: UseCount::default(),
            user_data: AtomicU64::new(0),
        }))
    }

    /// The WQ number (receive completions carry it as `qp_num`).
    pub fn wq_num(&self) -> u32 {
        self.wq_num
    }

    /// The PD.
    pub fn pd(&self) -> &Arc<Pd> {
        &self.pd
    }

    /// The CQ.
    pub fn cq(&self) -> &Arc<Cq> {
        &self.cq
    }

    /// Actual `(max_wr, max_sge)`.
    pub fn caps(&self) -> (u32, u32) {
        (self.max_wr, self.max_sge)
    }

    /// The state.
    pub fn state(&self) -> WqState {
        self.inner.lock().state
    }

    /// A value the front end may associate with the WQ (`wq_context`).
    pub fn user_data(&self) -> u64 {
        self.user_data.load(Ordering::Relaxed)
    }

    /// Sets [`Wq::user_data`].
    pub fn set_user_data(&self, v: u64) {
        self.user_data.store(v, Ordering::Relaxed);
    }

    /// `ibv_modify_wq`: RESET->RDY, RDY->RESET, any->ERR, ERR->RESET. `cur_state`, if given,
    /// must be the current state. Entering RESET discards posted WQEs; entering ERR flushes them.
    pub fn modify(&self, state: WqState, cur_state: Option<WqState>) -> Result<()> {
        let mut inner = self.inner.lock();
        let from = inner.state;
        if cur_state.is_some_and(|c| c != from) {
            return Err(Error::invalid(format!(
                "curr_wq_state is {cur_state:?} but the WQ is {from:?}"
            )));
        }
        let legal = matches!(
            (from, state),
            (WqState::Reset, WqState::Rdy)
                | (WqState::Rdy, WqState::Reset)
                | (WqState::Rdy, WqState::Rdy)
                | (_, WqState::Err)
                | (WqState::Err, WqState::Reset)
                | (WqState::Reset, WqState::Reset)
        );
        if !legal {
            return Err(Error::invalid(format!(
                "a WQ cannot move from {from:?} to {state:?}"
            )));
        }
        inner.state = state;
        let flushed: Vec<RecvWr> = match state {
            WqState::Reset => {
                inner.queue.clear();
                Vec::new()
            }
            WqState::Err if from != WqState::Err => inner.queue.drain(..).collect(),
            _ => Vec::new(),
        };
        drop(inner);
        for wr in flushed {
            self.push(WorkCompletion::error(
                wr.wr_id,
                WcStatus::WrFlushErr,
                WcOpcode::Recv,
                self.wq_num,
            ));
        }
        Ok(())
    }

    fn push(&self, wc: WorkCompletion) {
        if self.cq.push(wc).is_err() {
            tracing::warn!(wq = self.wq_num, "CQ overrun: the WQ moves to the error state");
            self.inner.lock().state = WqState::Err;
        }
    }

    /// `wq->post_recv` (`ibv_post_wq_recv`): queues WRs in order, stopping at the first that
    /// cannot be posted. In ERR they complete at once as flushed.
    pub fn post_recv(&self, wrs: &[RecvWr]) -> Result<(), PostError> {
        let mut inner = self.inner.lock();
        for (index, wr) in wrs.iter().enumerate() {
            if wr.sg_list.len() > self.max_sge as usize {
                return Err(PostError {
                    index,
                    error: Error::invalid(format!(
                        "num_sge {} exceeds max_sge {}",
                        wr.sg_list.len(),
                        self.max_sge
                    )),
                });
            }
            if inner.state == WqState::Err {
                self.push(WorkCompletion::error(
                    wr.wr_id,
                    WcStatus::WrFlushErr,
                    WcOpcode::Recv,
                    self.wq_num,
                ));
                continue;
            }
            if inner.queue.len() >= self.max_wr as usize {
                return Err(PostError {
                    index,
                    error: Error::no_resources(format!("the WQ is full ({} WRs)", self.max_wr)),
                });
            }
            inner.queue.push_back(wr.clone());
        }
        Ok(())
    }

    /// Posted WRs not yet consumed.
    pub fn len(&self) -> usize {
        self.inner.lock().queue.len()
    }

    /// Whether no WR is posted.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Delivers a frame into the next receive WQE (dropped unless RDY with a WQE posted). A
    /// receive error moves the WQ to ERR.
    pub(crate) fn deliver(&self, frame: &[u8], flow_tag: u32) {
        let mut inner = self.inner.lock();
        if inner.state != WqState::Rdy {
            return;
        }
        let Some(wr) = inner.queue.pop_front() else {
            return;
        };
        let keys = &self.pd.context().device().node().keys;
        let wc = receive_frame(keys, self.pd.handle(), self.wq_num, &wr, frame, flow_tag);
        let flushed: Vec<RecvWr> = if wc.status == WcStatus::Success {
            Vec::new()
        } else {
            inner.state = WqState::Err;
            inner.queue.drain(..).collect()
        };
        drop(inner);
        self.push(wc);
        for wr in flushed {
            self.push(WorkCompletion::error(
                wr.wr_id,
                WcStatus::WrFlushErr,
                WcOpcode::Recv,
                self.wq_num,
            ));
        }
    }

    fn teardown(&self) {
        self.pd.context().device().free_qpn(self.wq_num);
        self.pd.uses().release();
        self.cq.uses().release();
    }

    /// `ibv_destroy_wq`: EBUSY while an indirection table names it.
    pub fn destroy(&self) -> Result<()> {
        self.uses.retire("work queue")?;
        self.teardown();
        Ok(())
    }
}

impl Drop for Wq {
    fn drop(&mut self) {
        if !self.uses.is_retired() {
            self.teardown();
        }
    }
}

/// A receive WQ indirection table (`ibv_create_rwq_ind_table`).
#[derive(Debug)]
pub struct RwqIndTable {
    ctx: Arc<Context>,
    wqs: Vec<Arc<Wq>>,
    handle: u32,
    uses: UseCount,
}

impl RwqIndTable {
    /// `ibv_create_rwq_ind_table`: `wqs` holds exactly `1 << log_size` WQs of this context
    /// (a WQ may appear more than once).
    pub fn create(ctx: &Arc<Context>, log_size: u32, wqs: &[Arc<Wq>]) -> Result<Arc<Self>> {
        if log_size > MAX_LOG_IND_TBL_SIZE {
            return Err(Error::invalid(format!(
                "log_ind_tbl_size {log_size} exceeds {MAX_LOG_IND_TBL_SIZE}"
            )));
        }
        if wqs.len() != 1 << log_size {
            return Err(Error::invalid(format!(
                "the table needs {} WQs, {} given",
                1u32 << log_size,
                wqs.len()
            )));
        }
        if let Some(w) = wqs.iter().find(|w| !Arc::ptr_eq(w.pd.context(), ctx)) {
            return Err(Error::invalid(format!(
                "WQ {:#x} belongs to another context",
                w.wq_num
            )));
        }
        let device = ctx.device();
        let acquired = device
            .shared()
            .ind_tables
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < MAX_IND_TABLES).then_some(n + 1)
            })
            .map_err(|_| Error::no_resources(format!("{MAX_IND_TABLES} indirection tables exist")));
        acquired?;
        for (taken, w) in wqs.iter().enumerate() {
            if let Err(e) = w.uses.acquire("work queue") {
                wqs[..taken].iter().for_each(|w| w.uses.release());
                device.shared().ind_tables.fetch_sub(1, Ordering::AcqRel);
                return Err(e);
            }
        }
        Ok(Arc::new(Self {
            ctx: ctx.clone(),
            wqs: wqs.to_vec(),
            handle: ctx.next_handle(),
            uses: UseCount::default(),
        }))
    }

    /// The WQs, in table order.
    pub fn wqs(&self) -> &[Arc<Wq>] {
        &self.wqs
    }

    /// Handle (`ind_tbl_handle`).
    pub fn handle(&self) -> u32 {
        self.handle
    }

    /// The context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    pub(crate) fn uses(&self) -> &UseCount {
        &self.uses
    }

    fn teardown(&self) {
        self.wqs.iter().for_each(|w| w.uses.release());
        self.ctx
            .device()
            .shared()
            .ind_tables
            .fetch_sub(1, Ordering::AcqRel);
    }

    /// `ibv_destroy_rwq_ind_table`: EBUSY while an RSS QP uses it.
    pub fn destroy(&self) -> Result<()> {
        self.uses.retire("indirection table")?;
        self.teardown();
        Ok(())
    }
}

impl Drop for RwqIndTable {
    fn drop(&mut self) {
        if !self.uses.is_retired() {
            self.teardown();
        }
    }
}

/// `struct ibv_rx_hash_conf` of an RSS QP (Toeplitz only).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RxHashConf {
    /// The 40-byte key.
    pub key: Vec<u8>,
    /// Fields hashed.
    pub fields: RxHashFields,
}

impl RxHashConf {
    /// Checks `rx_hash_conf` as `ibv_create_qp_ex` does: Toeplitz, a 40-byte key, a consistent
    /// field set.
    pub fn new(function: u8, key: &[u8], fields: u64) -> Result<Self> {
        if function != softverbs_engine::steering::RX_HASH_FUNC_TOEPLITZ {
            return Err(Error::invalid(format!(
                "rx_hash_function {function} is not Toeplitz"
            )));
        }
        if key.len() != RSS_KEY_LEN {
            return Err(Error::invalid(format!(
                "rx_hash_key_len {} is not {RSS_KEY_LEN}",
                key.len()
            )));
        }
        Ok(Self {
            key: key.to_vec(),
            fields: RxHashFields::validate(fields).map_err(Error::invalid)?,
        })
    }

    /// The hash of a frame.
    pub fn hash(&self, h: &FrameHeaders) -> u32 {
        toeplitz(&self.key, &self.fields.input(h))
    }
}

/// What makes a raw QP an RSS QP: its table and hash.
#[derive(Debug)]
pub(crate) struct Rss {
    pub(crate) table: Arc<RwqIndTable>,
    pub(crate) hash: RxHashConf,
}

impl Rss {
    /// Hands the frame to the WQ its hash selects.
    pub(crate) fn deliver(&self, frame: &[u8], flow_tag: u32) {
        let Some(h) = FrameHeaders::parse(frame) else {
            return;
        };
        let wqs = &self.table.wqs;
        let i = self.hash.hash(&h) as usize & (wqs.len() - 1);
        wqs[i].deliver(frame, flow_tag);
    }
}

/// `struct ibv_rss_caps` and the related `ibv_device_attr_ex` fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RssCaps {
    /// QP types that can be RSS QPs (a bit per `ibv_qp_type`).
    pub supported_qpts: u32,
    /// `max_rwq_indirection_tables`.
    pub max_rwq_indirection_tables: u32,
    /// `max_rwq_indirection_table_size`.
    pub max_rwq_indirection_table_size: u32,
    /// `rx_hash_fields_mask`.
    pub rx_hash_fields_mask: u64,
    /// `rx_hash_function` (a bit per function).
    pub rx_hash_function: u8,
    /// `max_wq_type_rq`: most receive WQs.
    pub max_wq_type_rq: u32,
}

impl crate::device::Device {
    /// What RSS the device offers: raw packet QPs, Toeplitz over IPv4/IPv6 addresses and
    /// TCP/UDP ports.
    pub fn rss_caps(&self) -> RssCaps {
        RssCaps {
            supported_qpts: 1 << softverbs_engine::types::QpType::RawPacket.raw(),
            max_rwq_indirection_tables: MAX_IND_TABLES,
            max_rwq_indirection_table_size: 1 << MAX_LOG_IND_TBL_SIZE,
            rx_hash_fields_mask: RxHashFields::all().bits(),
            rx_hash_function: softverbs_engine::steering::RX_HASH_FUNC_TOEPLITZ,
            max_wq_type_rq: self.limits().max_qp,
        }
    }
}
