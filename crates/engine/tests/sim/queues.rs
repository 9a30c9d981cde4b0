//! Queues: SRQs, QPs and the nodes that hold them.

use std::collections::{BTreeMap, VecDeque};

use softverbs_engine::transport::{DropReason, QpEngine, RecvPlacement, RecvSource};
use softverbs_engine::types::{EventType, Gid, QpAttr, RecvWr, WorkCompletion};

use super::SimMemory;

/// A shared receive queue.
#[derive(Debug, Default)]
pub struct Srq {
    pub queue: VecDeque<RecvWr>,
    pub taken: u64,
    /// Chooses how a SEND is received from its first packet (as a tag-matching SRQ does);
    /// `None`: the next WQE takes the whole message.
    pub placer: Option<Placer>,
    /// An XRC SRQ: its number, XRC domain, PD and CQ.
    pub xrc: Option<XrcSrqInfo>,
}

/// What makes an SRQ an XRC SRQ.
#[derive(Debug, Clone, Copy)]
pub struct XrcSrqInfo {
    pub srqn: u32,
    pub xrcd: u32,
    pub pd: u32,
    pub cq: usize,
}

/// The SRQs of one XRC domain, as a target QP's receive source (the device's lookup by SRQN).
pub struct XrcDomainSrqs<'a> {
    pub srqs: &'a mut [Srq],
    pub xrcd: u32,
    pub selected: Option<usize>,
}

impl RecvSource for XrcDomainSrqs<'_> {
    fn take(&mut self) -> Option<RecvWr> {
        self.selected.and_then(|i| self.srqs[i].take())
    }

    fn put_back(&mut self, wr: RecvWr) {
        if let Some(i) = self.selected {
            self.srqs[i].put_back(wr);
        }
    }

    fn select_xrc_srq(&mut self, srqn: u32) -> Option<u32> {
        let xrcd = self.xrcd;
        let (i, info) = self
            .srqs
            .iter()
            .enumerate()
            .find_map(|(i, s)| s.xrc.filter(|x| x.srqn == srqn && x.xrcd == xrcd).map(|x| (i, x)))?;
        self.selected = Some(i);
        Some(info.pd)
    }
}

/// A [`RecvSource::take_send`] policy: first packet, whether it is the only one, the queue.
pub type Placer = fn(&[u8], bool, &mut VecDeque<RecvWr>) -> Option<RecvPlacement>;

impl RecvSource for Srq {
    fn take(&mut self) -> Option<RecvWr> {
        let wr = self.queue.pop_front();
        self.taken += u64::from(wr.is_some());
        wr
    }

    fn put_back(&mut self, wr: RecvWr) {
        self.taken -= 1;
        self.queue.push_front(wr);
    }

    fn take_send(&mut self, first: &[u8], only: bool) -> Option<RecvPlacement> {
        let Some(placer) = self.placer else {
            return self.take().map(RecvPlacement::plain);
        };
        let before = self.queue.len();
        let p = placer(first, only, &mut self.queue);
        self.taken += (before - self.queue.len()) as u64;
        p
    }
}

/// Names a QP: its node and number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct QpId {
    pub node: usize,
    pub qpn: u32,
}

/// A QP on a node: the engine plus what the device keeps around it.
#[derive(Debug)]
pub struct SimQp {
    pub engine: QpEngine,
    /// The attributes as the device keeps them (what `ibv_query_qp` returns).
    pub attr: QpAttr,
    pub srq: Option<usize>,
    /// XRC target: its XRC domain.
    pub xrcd: Option<u32>,
    pub send_cq: usize,
    pub recv_cq: usize,
    pub events: Vec<EventType>,
    pub drops: Vec<DropReason>,
    /// Multicast groups attached.
    pub mcast: Vec<Gid>,
    /// Completions handed back to the driver ([`WorkQueue::Internal`]).
    pub internal: Vec<WorkCompletion>,
}

/// One host with one GID.
#[derive(Debug)]
pub struct Node {
    pub gid: Gid,
    pub mem: SimMemory,
    pub qps: BTreeMap<u32, SimQp>,
    pub srqs: Vec<Srq>,
    pub cqs: Vec<Vec<WorkCompletion>>,
    /// A node that is down neither sends nor receives (the peer "vanished").
    pub up: bool,
    pub(super) next_qpn: u32,
    /// When the egress link is free again.
    pub(super) link_free: u64,
}
