//! Taking completions and events.

use softverbs_engine::types::{EventType, WorkCompletion};

use super::{QpId, Sim};

impl Sim {
    /// Takes every completion from CQ `cq` of `node`.
    pub fn take_cq(&mut self, node: usize, cq: usize) -> Vec<WorkCompletion> {
        std::mem::take(&mut self.nodes[node].cqs[cq])
    }

    pub fn take_send_cq(&mut self, id: QpId) -> Vec<WorkCompletion> {
        let cq = self.qp(id).send_cq;
        self.take_cq(id.node, cq)
    }

    pub fn take_recv_cq(&mut self, id: QpId) -> Vec<WorkCompletion> {
        let cq = self.qp(id).recv_cq;
        self.take_cq(id.node, cq)
    }

    pub fn cq_len(&self, node: usize, cq: usize) -> usize {
        self.nodes[node].cqs[cq].len()
    }

    pub fn send_cq_len(&self, id: QpId) -> usize {
        self.cq_len(id.node, self.qp(id).send_cq)
    }

    pub fn recv_cq_len(&self, id: QpId) -> usize {
        self.cq_len(id.node, self.qp(id).recv_cq)
    }

    pub fn take_events(&mut self, id: QpId) -> Vec<EventType> {
        std::mem::take(&mut self.qp_mut(id).events)
    }
}
