use proptest::prelude::*;

use super::*;
use crate::types::{GlobalRoute, QpCap};
use std::net::Ipv4Addr;

const GIDS: [Gid; 2] = [
    Gid([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 127, 0, 0, 1]),
    Gid::ZERO,
];

fn limits() -> PortLimits<'static> {
    PortLimits {
        phys_port_cnt: 1,
        pkey_tbl_len: 1,
        gid_table: &GIDS,
        max_mtu: Mtu::Mtu4096,
        max_qp_init_rd_atom: 16,
        max_qp_rd_atom: 16,
    }
}

/// An attribute block whose every value is acceptable.
fn good_attr(next: QpState) -> QpAttr {
    QpAttr {
        qp_state: next,
        port_num: 1,
        qkey: 0x1111_1111,
        qp_access_flags: AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        path_mtu: Mtu::Mtu1024,
        dest_qp_num: 0x12,
        rq_psn: 0x12_3456,
        sq_psn: 0x65_4321,
        max_dest_rd_atomic: 4,
        max_rd_atomic: 4,
        min_rnr_timer: 12,
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        ah_attr: AhAttr {
            grh: GlobalRoute {
                dgid: Gid::from(Ipv4Addr::new(127, 0, 0, 1)),
                hop_limit: 64,
                ..Default::default()
            },
            is_global: true,
            port_num: 1,
            ..Default::default()
        },
        cap: QpCap::default(),
        ..QpAttr::default()
    }
}

/// The IBTA transition graph, written independently of `transition_masks`.
fn ibta_allows(t: QpType, from: QpState, to: QpState) -> bool {
    use QpState::*;
    if t == QpType::RawPacket {
        // The kernel's table has no SQD or SQE rows for raw packet QPs.
        return matches!(
            (from, to),
            (_, Reset) | (_, Err) | (Reset, Init) | (Init, Init) | (Init, Rtr) | (Rtr, Rts) | (Rts, Rts)
        );
    }
    matches!(
        (from, to),
        (_, Reset)
            | (_, Err)
            | (Reset, Init)
            | (Init, Init)
            | (Init, Rtr)
            | (Rtr, Rts)
            | (Rts, Rts)
            | (Rts, Sqd)
            | (Sqd, Sqd)
            | (Sqd, Rts)
    ) || (from == Sqe && to == Rts && !t.is_reliable())
}

/// The "Required attributes" tables of ibv_modify_qp(3), as printed in the man page.
fn man_page_required(t: QpType, to: QpState) -> QpAttrMask {
    use QpAttrMask as M;
    match (t, to) {
        (QpType::Ud, QpState::Init) => M::STATE | M::PKEY_INDEX | M::PORT | M::QKEY,
        (QpType::Ud, QpState::Rtr) => M::STATE,
        (QpType::Ud, QpState::Rts) => M::STATE | M::SQ_PSN,
        (QpType::Uc | QpType::Rc | QpType::XrcSend | QpType::XrcRecv, QpState::Init) => {
            M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS
        }
        // verbs-extended.md section 1 (the kernel's qp_state_table).
        (QpType::XrcSend, QpState::Rtr) => M::STATE | M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN,
        (QpType::XrcRecv, QpState::Rtr) => {
            M::STATE
                | M::AV
                | M::PATH_MTU
                | M::DEST_QPN
                | M::RQ_PSN
                | M::MAX_DEST_RD_ATOMIC
                | M::MIN_RNR_TIMER
        }
        (QpType::XrcSend, QpState::Rts) => {
            M::STATE | M::SQ_PSN | M::MAX_QP_RD_ATOMIC | M::RETRY_CNT | M::RNR_RETRY | M::TIMEOUT
        }
        (QpType::XrcRecv, QpState::Rts) => M::STATE | M::SQ_PSN | M::TIMEOUT,
        (QpType::Uc, QpState::Rtr) => M::STATE | M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN,
        (QpType::Rc, QpState::Rtr) => {
            M::STATE
                | M::AV
                | M::PATH_MTU
                | M::DEST_QPN
                | M::RQ_PSN
                | M::MAX_DEST_RD_ATOMIC
                | M::MIN_RNR_TIMER
        }
        (QpType::Uc, QpState::Rts) => M::STATE | M::SQ_PSN,
        (QpType::RawPacket, QpState::Init) => M::STATE | M::PORT,
        (QpType::RawPacket, _) => M::STATE,
        (QpType::Rc, QpState::Rts) => {
            M::STATE | M::SQ_PSN | M::MAX_QP_RD_ATOMIC | M::RETRY_CNT | M::RNR_RETRY | M::TIMEOUT
        }
        _ => unreachable!(),
    }
}

#[test]
fn ibv_modify_qp_man_page_minimal_sequences_succeed() {
    for &t in QpType::ALL {
        let mut attr = QpAttr::default();
        for next in [QpState::Init, QpState::Rtr, QpState::Rts] {
            let mask = man_page_required(t, next);
            let req = good_attr(next);
            let got = validate_modify(t, attr.qp_state, &req, mask, &limits()).unwrap();
            assert_eq!(got, next);
            apply_modify(&mut attr, &req, mask, got);
            assert_eq!(attr.qp_state, next);
        }
    }
}

#[test]
fn ibv_modify_qp_missing_attribute_is_named() {
    use QpAttrMask as M;
    let mask = man_page_required(QpType::Rc, QpState::Rtr) - M::AV;
    let err = validate_modify(
        QpType::Rc,
        QpState::Init,
        &good_attr(QpState::Rtr),
        mask,
        &limits(),
    )
    .unwrap_err();
    assert_eq!(
        err,
        ModifyQpError::MissingAttributes {
            qp_type: QpType::Rc,
            from: QpState::Init,
            to: QpState::Rtr,
            missing: M::AV
        }
    );
    assert!(err.to_string().contains("IBV_QP_AV"), "{err}");
}

#[test]
fn ibv_modify_qp_value_errors_name_the_attribute() {
    use QpAttrMask as M;
    let cases: Vec<(QpAttr, QpAttrMask, &str)> = vec![
        (
            QpAttr {
                port_num: 2,
                ..good_attr(QpState::Init)
            },
            M::PORT,
            "IBV_QP_PORT",
        ),
        (
            QpAttr {
                pkey_index: 1,
                ..good_attr(QpState::Init)
            },
            M::PKEY_INDEX,
            "IBV_QP_PKEY_INDEX",
        ),
        (
            QpAttr {
                qp_access_flags: AccessFlags::ON_DEMAND,
                ..good_attr(QpState::Init)
            },
            M::ACCESS_FLAGS,
            "IBV_QP_ACCESS_FLAGS",
        ),
    ];
    for (attr, bad, name) in cases {
        let mask = man_page_required(QpType::Rc, QpState::Init);
        let err = validate_modify(QpType::Rc, QpState::Reset, &attr, mask, &limits()).unwrap_err();
        assert!(
            matches!(err, ModifyQpError::InvalidValue { attr, .. } if attr == bad),
            "{err}"
        );
        assert!(err.to_string().contains(name), "{err}");
    }
    let rtr = man_page_required(QpType::Rc, QpState::Rtr);
    let mut a = good_attr(QpState::Rtr);
    a.ah_attr.is_global = false;
    assert!(validate_modify(QpType::Rc, QpState::Init, &a, rtr, &limits())
        .unwrap_err()
        .to_string()
        .contains("IBV_QP_AV"));
    let mut a = good_attr(QpState::Rtr);
    a.ah_attr.grh.sgid_index = 1; // an empty GID entry
    assert!(validate_modify(QpType::Rc, QpState::Init, &a, rtr, &limits()).is_err());
    let mut a = good_attr(QpState::Rtr);
    a.max_dest_rd_atomic = 17;
    let e = validate_modify(QpType::Rc, QpState::Init, &a, rtr, &limits()).unwrap_err();
    assert!(e.to_string().contains("IBV_QP_MAX_DEST_RD_ATOMIC"), "{e}");
    let mut a = good_attr(QpState::Rtr);
    a.dest_qp_num = 1 << 24;
    assert!(validate_modify(QpType::Rc, QpState::Init, &a, rtr, &limits())
        .unwrap_err()
        .to_string()
        .contains("DEST_QPN"));
    let rts = man_page_required(QpType::Rc, QpState::Rts);
    for (a, name) in [
        (
            QpAttr {
                timeout: 32,
                ..good_attr(QpState::Rts)
            },
            "IBV_QP_TIMEOUT",
        ),
        (
            QpAttr {
                retry_cnt: 8,
                ..good_attr(QpState::Rts)
            },
            "IBV_QP_RETRY_CNT",
        ),
        (
            QpAttr {
                rnr_retry: 8,
                ..good_attr(QpState::Rts)
            },
            "IBV_QP_RNR_RETRY",
        ),
        (
            QpAttr {
                max_rd_atomic: 200,
                ..good_attr(QpState::Rts)
            },
            "IBV_QP_MAX_QP_RD_ATOMIC",
        ),
    ] {
        let e = validate_modify(QpType::Rc, QpState::Rtr, &a, rts, &limits()).unwrap_err();
        assert!(e.to_string().contains(name), "{e}");
    }
}

#[test]
fn cur_state_must_match() {
    let mut a = good_attr(QpState::Rts);
    a.cur_qp_state = QpState::Sqd;
    let e = validate_modify(
        QpType::Ud,
        QpState::Rts,
        &a,
        QpAttrMask::STATE | QpAttrMask::CUR_STATE,
        &limits(),
    );
    assert!(matches!(e, Err(ModifyQpError::CurrentStateMismatch { .. })));
    a.cur_qp_state = QpState::Rts;
    assert_eq!(
        validate_modify(
            QpType::Ud,
            QpState::Rts,
            &a,
            QpAttrMask::STATE | QpAttrMask::CUR_STATE,
            &limits()
        ),
        Ok(QpState::Rts)
    );
}

#[test]
fn unknown_mask_bits_rejected() {
    let e = validate_modify(
        QpType::Rc,
        QpState::Reset,
        &good_attr(QpState::Reset),
        QpAttrMask::from_bits_retain(1 << 21),
        &limits(),
    );
    assert_eq!(e, Err(ModifyQpError::UnknownMaskBits(1 << 21)));
}

#[test]
fn reset_clears_attributes_but_not_caps() {
    let mut attr = QpAttr {
        cap: QpCap {
            max_send_wr: 8,
            ..Default::default()
        },
        ..good_attr(QpState::Rts)
    };
    apply_modify(&mut attr, &QpAttr::default(), QpAttrMask::STATE, QpState::Reset);
    assert_eq!(attr.qp_state, QpState::Reset);
    assert_eq!(attr.dest_qp_num, 0);
    assert_eq!(attr.cap.max_send_wr, 8);
}

#[test]
fn psns_are_truncated_to_24_bits() {
    let mut attr = QpAttr::default();
    let req = QpAttr {
        sq_psn: 0xFF12_3456,
        rq_psn: 0x0100_0001,
        ..QpAttr::default()
    };
    apply_modify(
        &mut attr,
        &req,
        QpAttrMask::SQ_PSN | QpAttrMask::RQ_PSN,
        QpState::Rts,
    );
    assert_eq!((attr.sq_psn, attr.rq_psn), (0x12_3456, 1));
}

/// A flow label wider than 20 bits is accepted and kept as its low 20 bits, as hardware does.
#[test]
fn flow_labels_are_truncated_to_20_bits() {
    let rtr = man_page_required(QpType::Rc, QpState::Rtr);
    let mut req = good_attr(QpState::Rtr);
    req.ah_attr.grh.flow_label = 0xFFFF_FFFF;
    let next = validate_modify(QpType::Rc, QpState::Init, &req, rtr, &limits()).unwrap();
    let mut attr = good_attr(QpState::Init);
    apply_modify(&mut attr, &req, rtr, next);
    assert_eq!(attr.ah_attr.grh.flow_label, 0xF_FFFF);
    req.ah_attr.grh.flow_label = 0x12_3456;
    apply_modify(&mut attr, &req, rtr, next);
    assert_eq!(attr.ah_attr.grh.flow_label, 0x2_3456);
}

fn arb_state() -> impl Strategy<Value = QpState> {
    prop::sample::select(QpState::ALL.to_vec())
}

fn arb_type() -> impl Strategy<Value = QpType> {
    prop::sample::select(QpType::ALL.to_vec())
}

proptest! {
    /// The table agrees with the IBTA transition graph for every (type, from, to).
    #[test]
    fn table_matches_ibta_graph(t in arb_type(), from in arb_state(), to in arb_state()) {
        prop_assert_eq!(transition_masks(t, from, to).is_some(), ibta_allows(t, from, to));
    }

    /// For a legal transition: exactly the required set (plus any optional subset without the
    /// unsupported alternate path) succeeds; dropping a required bit or adding a foreign bit fails
    /// and the error names that bit.
    #[test]
    fn masks_are_enforced(t in arb_type(), from in arb_state(), to in arb_state(), pick in any::<u32>(), extra_bit in 0u32..26) {
        let Some(m) = transition_masks(t, from, to) else { return Ok(()) };
        let optional = QpAttrMask::from_bits_truncate(m.optional.bits() & pick)
            - QpAttrMask::ALT_PATH - QpAttrMask::CUR_STATE;
        let mut attr = good_attr(to);
        attr.cur_qp_state = from;
        let mask = QpAttrMask::STATE | m.required | optional;
        prop_assert_eq!(validate_modify(t, from, &attr, mask, &limits()), Ok(to));

        for bit in m.required.iter() {
            let e = validate_modify(t, from, &attr, mask - bit, &limits());
            let missing_named = matches!(e, Err(ModifyQpError::MissingAttributes { missing, .. }) if missing == bit);
            prop_assert!(missing_named);
        }
        let foreign = QpAttrMask::from_bits_truncate(1 << extra_bit);
        if !foreign.is_empty() && !(m.required | m.optional | QpAttrMask::STATE).contains(foreign) {
            let e = validate_modify(t, from, &attr, mask | foreign, &limits());
            let unexpected_named = matches!(e, Err(ModifyQpError::UnexpectedAttributes { unexpected, .. }) if unexpected == foreign);
            prop_assert!(unexpected_named);
        }
    }

    /// Random walks: a state machine driven by random requests only ever takes IBTA edges, and a
    /// rejected request never changes anything.
    #[test]
    fn random_walks_follow_the_graph(t in arb_type(), steps in prop::collection::vec((arb_state(), any::<u32>()), 1..40)) {
        let mut attr = QpAttr::default();
        for (to, raw_mask) in steps {
            let mask = QpAttrMask::from_bits_truncate(raw_mask) | QpAttrMask::STATE;
            let before = attr;
            match validate_modify(t, attr.qp_state, &good_attr(to), mask, &limits()) {
                Ok(next) => {
                    prop_assert!(ibta_allows(t, before.qp_state, next));
                    apply_modify(&mut attr, &good_attr(to), mask, next);
                    prop_assert_eq!(attr.qp_state, next);
                }
                Err(_) => prop_assert_eq!(attr, before),
            }
        }
    }

    /// Reset and Err are reachable from anywhere with the state alone.
    #[test]
    fn reset_and_error_always_reachable(t in arb_type(), from in arb_state()) {
        for to in [QpState::Reset, QpState::Err] {
            prop_assert_eq!(validate_modify(t, from, &good_attr(to), QpAttrMask::STATE, &limits()), Ok(to));
        }
    }
}

#[test]
fn xrc_initiator_and_target_have_their_own_required_sets() {
    use QpAttrMask as M;
    let rtr = good_attr(QpState::Rtr);
    // The initiator never responds: no responder resources or RNR timer to give.
    let ini_rtr = M::STATE | M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN;
    assert_eq!(
        validate_modify(QpType::XrcSend, QpState::Init, &rtr, ini_rtr, &limits()),
        Ok(QpState::Rtr)
    );
    let e = validate_modify(QpType::XrcRecv, QpState::Init, &rtr, ini_rtr, &limits()).unwrap_err();
    assert!(
        matches!(e, ModifyQpError::MissingAttributes { missing, .. }
            if missing == M::MAX_DEST_RD_ATOMIC | M::MIN_RNR_TIMER),
        "{e}"
    );
    // The target never sends requests: RTS needs only SQ_PSN and TIMEOUT, and refuses the
    // requester's retry counts.
    let rts = good_attr(QpState::Rts);
    let tgt_rts = M::STATE | M::SQ_PSN | M::TIMEOUT;
    assert_eq!(
        validate_modify(QpType::XrcRecv, QpState::Rtr, &rts, tgt_rts, &limits()),
        Ok(QpState::Rts)
    );
    let e = validate_modify(
        QpType::XrcRecv,
        QpState::Rtr,
        &rts,
        tgt_rts | M::RETRY_CNT,
        &limits(),
    )
    .unwrap_err();
    assert!(
        matches!(e, ModifyQpError::UnexpectedAttributes { unexpected, .. } if unexpected == M::RETRY_CNT)
    );
    let e = validate_modify(QpType::XrcSend, QpState::Rtr, &rts, tgt_rts, &limits()).unwrap_err();
    assert!(matches!(e, ModifyQpError::MissingAttributes { .. }), "{e}");
    // The kernel drops the other half's attributes before checking, as callers pass RC sets.
    let rc_rtr = man_page_required(QpType::Rc, QpState::Rtr);
    assert_eq!(effective_mask(QpType::XrcSend, rc_rtr), ini_rtr);
    let rc_rts = man_page_required(QpType::Rc, QpState::Rts);
    assert_eq!(effective_mask(QpType::XrcRecv, rc_rts), tgt_rts);
    assert_eq!(effective_mask(QpType::Rc, rc_rts), rc_rts);
    // Like RC, neither half has an SQE state.
    for t in [QpType::XrcSend, QpType::XrcRecv] {
        assert!(transition_masks(t, QpState::Sqe, QpState::Rts).is_none());
        assert_eq!(
            t.to_string(),
            if t == QpType::XrcSend {
                "XRC_SEND"
            } else {
                "XRC_RECV"
            }
        );
    }
}

#[test]
fn raw_packet_rows_need_only_the_port_then_the_state() {
    use QpAttrMask as M;
    let t = QpType::RawPacket;
    let mut attr = good_attr(QpState::Init);
    let e = validate_modify(t, QpState::Reset, &attr, M::STATE, &limits()).unwrap_err();
    assert!(matches!(e, ModifyQpError::MissingAttributes { missing, .. } if missing == M::PORT));
    let e = validate_modify(t, QpState::Reset, &attr, M::STATE | M::PORT | M::QKEY, &limits()).unwrap_err();
    assert!(matches!(e, ModifyQpError::UnexpectedAttributes { unexpected, .. } if unexpected == M::QKEY));
    assert_eq!(
        validate_modify(t, QpState::Reset, &attr, M::STATE | M::PORT, &limits()).unwrap(),
        QpState::Init
    );
    attr.qp_state = QpState::Rtr;
    assert_eq!(
        validate_modify(t, QpState::Init, &attr, M::STATE, &limits()).unwrap(),
        QpState::Rtr
    );
    assert!(validate_modify(t, QpState::Init, &attr, M::STATE | M::AV, &limits()).is_err());
    attr.qp_state = QpState::Rts;
    assert_eq!(
        validate_modify(t, QpState::Rtr, &attr, M::STATE, &limits()).unwrap(),
        QpState::Rts
    );
    assert!(validate_modify(t, QpState::Rtr, &attr, M::STATE | M::SQ_PSN, &limits()).is_err());
    attr.qp_state = QpState::Sqd;
    assert!(validate_modify(t, QpState::Rts, &attr, M::STATE, &limits()).is_err());
}
