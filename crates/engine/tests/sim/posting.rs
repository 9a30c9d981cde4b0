//! Posting work requests.

use softverbs_engine::types::{Mtu, RecvWr};
use softverbs_engine::wr::{SendLimits, SendWr};

use super::{QpId, Sim};

impl Sim {
    /// `ibv_post_send`: checked like the device checks it, then queued and the QP driven.
    pub fn post_send(&mut self, id: QpId, wr: SendWr) {
        let qp = self.qp(id);
        let limits = SendLimits {
            qp_type: qp.engine.config().qp_type,
            max_send_sge: 16,
            max_inline_data: 4096,
            max_msg_sz: 1 << 31,
            ud_mtu: qp.attr.path_mtu.bytes().max(Mtu::Mtu4096.bytes()),
            max_rd_atomic: qp
                .attr
                .max_rd_atomic
                .max(u8::from(!qp.engine.config().qp_type.is_reliable())),
            max_tso_header: 0,
        };
        wr.check(&limits)
            .unwrap_or_else(|e| panic!("post_send {id:?}: {e}"));
        self.post_send_unchecked(id, wr);
    }

    pub fn post_send_unchecked(&mut self, id: QpId, wr: SendWr) {
        self.qp_mut(id).engine.post_send(wr);
        self.pump(id);
    }

    /// Work the driver posts for itself ([`QpEngine::post_internal`]).
    pub fn post_internal(&mut self, id: QpId, wr: SendWr) {
        self.qp_mut(id).engine.post_internal(wr);
        self.pump(id);
    }

    /// `ibv_post_recv` on the QP's own receive queue.
    pub fn post_recv(&mut self, id: QpId, wr: RecvWr) {
        self.qp_mut(id).engine.post_recv(wr);
        self.pump(id);
    }

    /// `ibv_post_srq_recv`.
    pub fn post_srq_recv(&mut self, node: usize, srq: usize, wr: RecvWr) {
        self.nodes[node].srqs[srq].queue.push_back(wr);
    }
}
