//! Creating and connecting QPs, CQs and SRQs.

use softverbs_engine::qp_state::{self, PortLimits};
use softverbs_engine::transport::{QpConfig, QpEngine};
use softverbs_engine::types::{AhAttr, Gid, GlobalRoute, Mtu, QpAttr, QpAttrMask, QpState, QpType};
use softverbs_engine::wr::UdDest;

use super::{ConnOpts, QpId, QpOpts, Sim, SimQp, Srq, XrcSrqInfo};

impl Sim {
    pub fn create_cq(&mut self, node: usize) -> usize {
        self.nodes[node].cqs.push(Vec::new());
        self.nodes[node].cqs.len() - 1
    }

    pub fn create_srq(&mut self, node: usize) -> usize {
        self.nodes[node].srqs.push(Srq::default());
        self.nodes[node].srqs.len() - 1
    }

    /// An XRC SRQ in domain `xrcd` with PD `pd`, completing on CQ `cq`; returns its index and
    /// its SRQ number.
    pub fn create_xrc_srq(&mut self, node: usize, xrcd: u32, pd: u32, cq: usize) -> (usize, u32) {
        let idx = self.nodes[node].srqs.len();
        let srqn = 0x400 + idx as u32;
        self.nodes[node].srqs.push(Srq {
            xrc: Some(XrcSrqInfo { srqn, xrcd, pd, cq }),
            ..Srq::default()
        });
        (idx, srqn)
    }

    /// An XRC target QP of domain `xrcd` (no PD, no CQs of its own).
    pub fn create_xrc_tgt(&mut self, node: usize, xrcd: u32) -> QpId {
        self.create_qp_with(
            node,
            QpType::XrcRecv,
            QpOpts {
                pd: 0,
                xrcd: Some(xrcd),
                ..QpOpts::default()
            },
        )
    }

    /// Creates a QP in RESET with its own send and receive CQs.
    pub fn create_qp(&mut self, node: usize, qp_type: QpType) -> QpId {
        self.create_qp_with(node, qp_type, QpOpts::default())
    }

    pub fn create_qp_with(&mut self, node: usize, qp_type: QpType, o: QpOpts) -> QpId {
        let send_cq = o.send_cq.unwrap_or_else(|| self.create_cq(node));
        let recv_cq = o.recv_cq.unwrap_or_else(|| self.create_cq(node));
        let n = &mut self.nodes[node];
        let qpn = n.next_qpn;
        n.next_qpn += 1;
        let cfg = QpConfig {
            qp_type,
            qpn,
            pd: o.pd,
            sq_sig_all: o.sq_sig_all,
            has_srq: o.srq.is_some(),
        };
        n.qps.insert(
            qpn,
            SimQp {
                engine: QpEngine::new(cfg),
                attr: QpAttr::default(),
                srq: o.srq,
                xrcd: o.xrcd,
                send_cq,
                recv_cq,
                events: Vec::new(),
                drops: Vec::new(),
                internal: Vec::new(),
                mcast: Vec::new(),
            },
        );
        QpId { node, qpn }
    }

    /// `ibv_modify_qp`: validated with the engine's state table against this node's port,
    /// applied, then handed to the engine. Panics if the modify is invalid.
    pub fn modify(&mut self, id: QpId, attr: &QpAttr, mask: QpAttrMask) {
        self.try_modify(id, attr, mask)
            .unwrap_or_else(|e| panic!("modify_qp {id:?}: {e}"));
    }

    pub fn try_modify(&mut self, id: QpId, attr: &QpAttr, mask: QpAttrMask) -> Result<(), String> {
        let now = self.now;
        let node = &mut self.nodes[id.node];
        let gids = [node.gid];
        let limits = PortLimits {
            phys_port_cnt: 1,
            pkey_tbl_len: 1,
            gid_table: &gids,
            max_mtu: Mtu::Mtu4096,
            max_qp_init_rd_atom: 16,
            max_qp_rd_atom: 16,
        };
        let qp = node.qps.get_mut(&id.qpn).expect("no such QP");
        let qp_type = qp.engine.config().qp_type;
        let next = qp_state::validate_modify(qp_type, qp.attr.qp_state, attr, mask, &limits)
            .map_err(|e| e.to_string())?;
        qp_state::apply_modify(&mut qp.attr, attr, mask, next);
        qp.engine.set_attr(now, &qp.attr);
        self.pump(id);
        Ok(())
    }

    /// Moves a QP to `state` with nothing else (ERR, RESET, SQD without notify, ...).
    pub fn set_state(&mut self, id: QpId, state: QpState) {
        let attr = QpAttr {
            qp_state: state,
            ..QpAttr::default()
        };
        self.modify(id, &attr, QpAttrMask::STATE);
    }

    /// RTS -> SQD, asking for `IBV_EVENT_SQ_DRAINED`.
    pub fn drain(&mut self, id: QpId) {
        let attr = QpAttr {
            qp_state: QpState::Sqd,
            en_sqd_async_notify: true,
            ..QpAttr::default()
        };
        self.modify(id, &attr, QpAttrMask::STATE | QpAttrMask::EN_SQD_ASYNC_NOTIFY);
    }

    /// RESET -> INIT -> RTR -> RTS for an RC or UC QP talking to `remote`.
    pub fn bring_up(&mut self, id: QpId, remote: QpId, o: &ConnOpts, sq_psn: u32, rq_psn: u32) {
        use QpAttrMask as M;
        let qp_type = self.qp(id).engine.config().qp_type;
        // Exactly the attributes each transition requires for this QP type.
        let required = |from, to| {
            M::STATE
                | qp_state::transition_masks(qp_type, from, to)
                    .expect("a defined transition")
                    .required
        };
        let init = QpAttr {
            qp_state: QpState::Init,
            pkey_index: 0,
            port_num: 1,
            qp_access_flags: o.access,
            ..QpAttr::default()
        };
        self.modify(id, &init, M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS);
        let rtr = QpAttr {
            qp_state: QpState::Rtr,
            path_mtu: o.mtu,
            dest_qp_num: remote.qpn,
            rq_psn,
            max_dest_rd_atomic: o.max_dest_rd_atomic,
            min_rnr_timer: o.min_rnr_timer,
            ah_attr: self.ah_to(remote.node),
            ..QpAttr::default()
        };
        self.modify(id, &rtr, required(QpState::Init, QpState::Rtr));
        let rts = QpAttr {
            qp_state: QpState::Rts,
            sq_psn,
            timeout: o.timeout,
            retry_cnt: o.retry_cnt,
            rnr_retry: o.rnr_retry,
            max_rd_atomic: o.max_rd_atomic,
            ..QpAttr::default()
        };
        self.modify(id, &rts, required(QpState::Rtr, QpState::Rts));
    }

    /// Connects two RC or UC QPs both ways: `a` sends from `o.psn_a`, `b` from `o.psn_b`.
    pub fn connect(&mut self, a: QpId, b: QpId, o: &ConnOpts) {
        self.bring_up(a, b, o, o.psn_a, o.psn_b);
        self.bring_up(b, a, o, o.psn_b, o.psn_a);
    }

    /// Two nodes and a connected pair of `qp_type` QPs between them.
    pub fn pair(seed: u64, qp_type: QpType, o: &ConnOpts) -> (Self, QpId, QpId) {
        let mut sim = Self::new(seed, 2);
        let a = sim.create_qp(0, qp_type);
        let b = sim.create_qp(1, qp_type);
        sim.connect(a, b, o);
        (sim, a, b)
    }

    /// A UD QP brought to RTS with Q_Key `qkey`.
    pub fn ud_up(&mut self, id: QpId, qkey: u32) {
        use QpAttrMask as M;
        let init = QpAttr {
            qp_state: QpState::Init,
            pkey_index: 0,
            port_num: 1,
            qkey,
            ..QpAttr::default()
        };
        self.modify(id, &init, M::STATE | M::PKEY_INDEX | M::PORT | M::QKEY);
        self.modify(
            id,
            &QpAttr {
                qp_state: QpState::Rtr,
                ..QpAttr::default()
            },
            M::STATE,
        );
        self.modify(
            id,
            &QpAttr {
                qp_state: QpState::Rts,
                sq_psn: 0,
                ..QpAttr::default()
            },
            M::STATE | M::SQ_PSN,
        );
    }

    /// An address vector from this fabric's node `node`'s GID (RoCE: a GRH with the GID).
    pub fn ah_to(&self, node: usize) -> AhAttr {
        AhAttr {
            grh: GlobalRoute {
                dgid: self.nodes[node].gid,
                flow_label: 0,
                sgid_index: 0,
                hop_limit: 64,
                traffic_class: 0,
            },
            is_global: true,
            port_num: 1,
            ..AhAttr::default()
        }
    }

    /// A UD destination for QP `to`.
    pub fn ud_dest(&self, to: QpId, qkey: u32) -> UdDest {
        UdDest {
            dgid: self.nodes[to.node].gid,
            sgid_index: 0,
            traffic_class: 0,
            hop_limit: 64,
            flow_label: 0,
            qpn: to.qpn,
            qkey,
        }
    }

    /// Attaches a UD QP to a multicast group (`ibv_attach_mcast`).
    pub fn attach_mcast(&mut self, id: QpId, mgid: Gid) {
        self.qp_mut(id).mcast.push(mgid);
    }
}
