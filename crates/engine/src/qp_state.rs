//! The IBTA QP state machine: which transitions exist, which attributes each one requires and
//! allows for each QP type, and what values each attribute may take.
//!
//! The table follows the IBTA specification (and the Linux kernel's `qp_state_table`, which both
//! rdma-core and every provider honour). Both front ends validate through [`validate_modify`], so
//! the Rust API and `ibv_modify_qp` accept and reject exactly the same requests.

use std::fmt;

use crate::types::{AccessFlags, AhAttr, Gid, MigState, Mtu, QpAttr, QpAttrMask, QpState, QpType};

/// Attributes a transition requires and allows, beyond `IBV_QP_STATE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransitionMasks {
    /// Attributes that must be present.
    pub required: QpAttrMask,
    /// Attributes that may be present.
    pub optional: QpAttrMask,
}

/// The attribute masks of `from -> to` for `qp_type`, or `None` if the IBTA forbids it.
pub fn transition_masks(qp_type: QpType, from: QpState, to: QpState) -> Option<TransitionMasks> {
    use QpAttrMask as M;
    use QpState::*;
    use QpType::*;

    let none = M::empty();
    let masks = |required: M, optional: M| Some(TransitionMasks { required, optional });
    if qp_type == RawPacket {
        return raw_transition_masks(from, to);
    }
    // XRC follows RC except where the kernel's `qp_state_table` gives the initiator or the
    // target its own set (`xrc` below).
    let by_type = |ud: M, uc: M, rc: M| match qp_type {
        Ud => ud,
        Uc => uc,
        Rc | RawPacket | XrcSend | XrcRecv => rc,
    };
    let xrc = |rc: M, ini: M, tgt: M| match qp_type {
        XrcSend => ini,
        XrcRecv => tgt,
        _ => rc,
    };

    match (from, to) {
        // Any state may be reset or put into error with nothing but the state.
        (_, Reset) | (_, Err) => masks(none, none),
        (Reset, Init) => masks(
            by_type(
                M::PKEY_INDEX | M::PORT | M::QKEY,
                M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS,
                M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS,
            ),
            none,
        ),
        (Init, Init) => masks(
            none,
            by_type(
                M::PKEY_INDEX | M::PORT | M::QKEY,
                M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS,
                M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS,
            ),
        ),
        (Init, Rtr) => masks(
            xrc(
                by_type(
                    none,
                    M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN,
                    M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN | M::MAX_DEST_RD_ATOMIC | M::MIN_RNR_TIMER,
                ),
                M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN,
                M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN | M::MAX_DEST_RD_ATOMIC | M::MIN_RNR_TIMER,
            ),
            by_type(
                M::PKEY_INDEX | M::QKEY,
                M::ALT_PATH | M::ACCESS_FLAGS | M::PKEY_INDEX,
                M::ALT_PATH | M::ACCESS_FLAGS | M::PKEY_INDEX,
            ),
        ),
        (Rtr, Rts) => masks(
            xrc(
                by_type(
                    M::SQ_PSN,
                    M::SQ_PSN,
                    M::SQ_PSN | M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::MAX_QP_RD_ATOMIC,
                ),
                M::SQ_PSN | M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::MAX_QP_RD_ATOMIC,
                M::SQ_PSN | M::TIMEOUT,
            ),
            xrc(
                by_type(
                    M::CUR_STATE | M::QKEY,
                    M::CUR_STATE | M::ALT_PATH | M::ACCESS_FLAGS | M::PATH_MIG_STATE,
                    M::CUR_STATE | M::ALT_PATH | M::ACCESS_FLAGS | M::MIN_RNR_TIMER | M::PATH_MIG_STATE,
                ),
                M::CUR_STATE | M::ALT_PATH | M::ACCESS_FLAGS | M::PATH_MIG_STATE,
                M::CUR_STATE | M::ALT_PATH | M::ACCESS_FLAGS | M::MIN_RNR_TIMER | M::PATH_MIG_STATE,
            ),
        ),
        (Rts, Rts) | (Sqd, Rts) => masks(
            none,
            xrc(
                by_type(
                    M::CUR_STATE | M::QKEY,
                    M::CUR_STATE | M::ACCESS_FLAGS | M::ALT_PATH | M::PATH_MIG_STATE,
                    M::CUR_STATE | M::ACCESS_FLAGS | M::ALT_PATH | M::PATH_MIG_STATE | M::MIN_RNR_TIMER,
                ),
                M::CUR_STATE | M::ACCESS_FLAGS | M::ALT_PATH | M::PATH_MIG_STATE,
                M::CUR_STATE | M::ACCESS_FLAGS | M::ALT_PATH | M::PATH_MIG_STATE | M::MIN_RNR_TIMER,
            ),
        ),
        (Rts, Sqd) => masks(none, M::EN_SQD_ASYNC_NOTIFY),
        (Sqd, Sqd) => masks(
            none,
            xrc(
                by_type(
                    M::PKEY_INDEX | M::QKEY,
                    M::AV | M::ALT_PATH | M::ACCESS_FLAGS | M::PKEY_INDEX | M::PATH_MIG_STATE,
                    M::PORT
                        | M::AV
                        | M::TIMEOUT
                        | M::RETRY_CNT
                        | M::RNR_RETRY
                        | M::MAX_QP_RD_ATOMIC
                        | M::MAX_DEST_RD_ATOMIC
                        | M::ALT_PATH
                        | M::ACCESS_FLAGS
                        | M::PKEY_INDEX
                        | M::MIN_RNR_TIMER
                        | M::PATH_MIG_STATE,
                ),
                M::PORT
                    | M::AV
                    | M::TIMEOUT
                    | M::RETRY_CNT
                    | M::RNR_RETRY
                    | M::MAX_QP_RD_ATOMIC
                    | M::ALT_PATH
                    | M::ACCESS_FLAGS
                    | M::PKEY_INDEX
                    | M::PATH_MIG_STATE,
                M::PORT
                    | M::AV
                    | M::TIMEOUT
                    | M::MAX_DEST_RD_ATOMIC
                    | M::ALT_PATH
                    | M::ACCESS_FLAGS
                    | M::PKEY_INDEX
                    | M::MIN_RNR_TIMER
                    | M::PATH_MIG_STATE,
            ),
        ),
        // SQE exists only for UC and UD: RC send errors take the QP to ERR.
        (Sqe, Rts) => match qp_type {
            Ud => masks(none, M::CUR_STATE | M::QKEY),
            Uc => masks(none, M::CUR_STATE | M::ACCESS_FLAGS),
            Rc | RawPacket | XrcSend | XrcRecv => None,
        },
        _ => None,
    }
}

/// The mask the state table is checked against for an `ibv_modify_qp` with `mask`: as the
/// kernel's `modify_qp_mask` does, an XRC initiator ignores the responder attributes
/// (`MAX_DEST_RD_ATOMIC`, `MIN_RNR_TIMER`) and an XRC target the requester ones
/// (`MAX_QP_RD_ATOMIC`, `RETRY_CNT`, `RNR_RETRY`), so programs that pass the RC set to both
/// (perftest does) work.
pub fn effective_mask(qp_type: QpType, mask: QpAttrMask) -> QpAttrMask {
    use QpAttrMask as M;
    match qp_type {
        QpType::XrcSend => mask - (M::MAX_DEST_RD_ATOMIC | M::MIN_RNR_TIMER),
        QpType::XrcRecv => mask - (M::MAX_QP_RD_ATOMIC | M::RETRY_CNT | M::RNR_RETRY),
        _ => mask,
    }
}

/// The raw packet rows of the kernel's table: RESET->INIT names the port, the other steps only
/// the state (a rate limit may be set from RTR on); a raw QP has no SQD or SQE.
fn raw_transition_masks(from: QpState, to: QpState) -> Option<TransitionMasks> {
    use QpAttrMask as M;
    use QpState::*;
    let masks = |required: M, optional: M| Some(TransitionMasks { required, optional });
    match (from, to) {
        (_, Reset) | (_, Err) => masks(M::empty(), M::empty()),
        (Reset, Init) => masks(M::PORT, M::empty()),
        (Init, Init) => masks(M::empty(), M::PORT),
        (Init, Rtr) => masks(M::empty(), M::empty()),
        (Rtr, Rts) | (Rts, Rts) => masks(M::empty(), M::RATE_LIMIT),
        _ => None,
    }
}

/// Why `ibv_modify_qp` rejected a request. Every variant is EINVAL and names what was wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ModifyQpError {
    /// The mask has bits that name no attribute.
    #[error("modify_qp: unknown attribute mask bits {0:#x}")]
    UnknownMaskBits(u32),
    /// The IBTA defines no such transition for this QP type.
    #[error("modify_qp: {qp_type} QP cannot move from {from} to {to} (IBV_QP_STATE)")]
    InvalidTransition {
        /// QP type.
        qp_type: QpType,
        /// Current state.
        from: QpState,
        /// Requested state.
        to: QpState,
    },
    /// `IBV_QP_CUR_STATE` named a state the QP is not in.
    #[error("modify_qp: IBV_QP_CUR_STATE says {given} but the QP is in {actual}")]
    CurrentStateMismatch {
        /// The state the caller assumed.
        given: QpState,
        /// The QP's state.
        actual: QpState,
    },
    /// Attributes the transition requires are missing.
    #[error("modify_qp: {qp_type} {from}->{to} requires {}", missing.names())]
    MissingAttributes {
        /// QP type.
        qp_type: QpType,
        /// Current state.
        from: QpState,
        /// Requested state.
        to: QpState,
        /// The required attributes not in the mask.
        missing: QpAttrMask,
    },
    /// Attributes the transition does not allow are present.
    #[error("modify_qp: {qp_type} {from}->{to} does not allow {}", unexpected.names())]
    UnexpectedAttributes {
        /// QP type.
        qp_type: QpType,
        /// Current state.
        from: QpState,
        /// Requested state.
        to: QpState,
        /// The attributes not allowed.
        unexpected: QpAttrMask,
    },
    /// An attribute has a value the device cannot accept.
    #[error("modify_qp: {}: {reason}", attr.names())]
    InvalidValue {
        /// The offending attribute.
        attr: QpAttrMask,
        /// Why its value is invalid.
        reason: String,
    },
}

/// What the device can accept, for the value checks.
#[derive(Debug, Clone, Copy)]
pub struct PortLimits<'a> {
    /// Number of physical ports (ports are numbered from 1).
    pub phys_port_cnt: u8,
    /// Length of the P_Key table.
    pub pkey_tbl_len: u16,
    /// The port's GID table; zero entries are unusable.
    pub gid_table: &'a [Gid],
    /// Largest path MTU.
    pub max_mtu: Mtu,
    /// `max_qp_init_rd_atom` of the device.
    pub max_qp_init_rd_atom: u8,
    /// `max_qp_rd_atom` of the device.
    pub max_qp_rd_atom: u8,
}

/// Remote access bits a QP may be given.
pub const QP_ACCESS_ALLOWED: AccessFlags = AccessFlags::LOCAL_WRITE
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_READ)
    .union(AccessFlags::REMOTE_ATOMIC)
    .union(AccessFlags::MW_BIND)
    .union(AccessFlags::FLUSH_GLOBAL)
    .union(AccessFlags::FLUSH_PERSISTENT);

fn invalid(attr: QpAttrMask, reason: impl fmt::Display) -> ModifyQpError {
    ModifyQpError::InvalidValue {
        attr,
        reason: reason.to_string(),
    }
}

/// Checks an address vector for RoCE: it names a valid port and a usable source GID and carries
/// a GRH (RoCE has no LIDs, so an AV without one cannot be routed). `attr` is the mask bit the
/// errors name (`IBV_QP_AV` or `IBV_QP_ALT_PATH`); AH creation reuses it with `IBV_QP_AV`.
pub fn check_ah_attr(ah: &AhAttr, limits: &PortLimits<'_>, attr: QpAttrMask) -> Result<(), ModifyQpError> {
    if ah.port_num == 0 || ah.port_num > limits.phys_port_cnt {
        return Err(invalid(
            attr,
            format_args!("ah_attr.port_num {} is not a port of this device", ah.port_num),
        ));
    }
    if !ah.is_global {
        return Err(invalid(
            attr,
            "ah_attr.is_global is 0, but RoCE needs a GRH (a destination GID)",
        ));
    }
    let idx = usize::from(ah.grh.sgid_index);
    match limits.gid_table.get(idx) {
        None => {
            return Err(invalid(
                attr,
                format_args!(
                    "ah_attr.grh.sgid_index {idx} is outside the GID table ({} entries)",
                    limits.gid_table.len()
                ),
            ))
        }
        Some(g) if g.is_zero() => {
            return Err(invalid(
                attr,
                format_args!("ah_attr.grh.sgid_index {idx} is an empty GID entry"),
            ))
        }
        Some(_) => {}
    }
    if ah.grh.dgid.is_zero() {
        return Err(invalid(attr, "ah_attr.grh.dgid is all zeros"));
    }
    if crate::rate::rate_to_mbps(i32::from(ah.static_rate)) < 0 && ah.static_rate != 0 {
        return Err(invalid(
            attr,
            format_args!("ah_attr.static_rate {} is not an ibv_rate", ah.static_rate),
        ));
    }
    Ok(())
}

/// Validates `ibv_modify_qp(qp, attr, mask)` on a QP of `qp_type` in state `current`.
///
/// Returns the state the QP moves to. Nothing is changed here: on error the caller must leave
/// the QP exactly as it was, as `ibv_modify_qp(3)` requires.
pub fn validate_modify(
    qp_type: QpType,
    current: QpState,
    attr: &QpAttr,
    mask: QpAttrMask,
    limits: &PortLimits<'_>,
) -> Result<QpState, ModifyQpError> {
    use QpAttrMask as M;

    let unknown = mask.bits() & !QpAttrMask::all().bits();
    if unknown != 0 {
        return Err(ModifyQpError::UnknownMaskBits(unknown));
    }
    if mask.contains(M::CUR_STATE) && attr.cur_qp_state != current {
        return Err(ModifyQpError::CurrentStateMismatch {
            given: attr.cur_qp_state,
            actual: current,
        });
    }
    let next = if mask.contains(M::STATE) {
        attr.qp_state
    } else {
        current
    };
    let Some(masks) = transition_masks(qp_type, current, next) else {
        return Err(ModifyQpError::InvalidTransition {
            qp_type,
            from: current,
            to: next,
        });
    };
    let missing = masks.required - mask;
    if !missing.is_empty() {
        return Err(ModifyQpError::MissingAttributes {
            qp_type,
            from: current,
            to: next,
            missing,
        });
    }
    let unexpected = mask - masks.required - masks.optional - M::STATE;
    if !unexpected.is_empty() {
        return Err(ModifyQpError::UnexpectedAttributes {
            qp_type,
            from: current,
            to: next,
            unexpected,
        });
    }

    if mask.contains(M::PORT) && (attr.port_num == 0 || attr.port_num > limits.phys_port_cnt) {
        return Err(invalid(
            M::PORT,
            format_args!("port_num {} is not a port of this device", attr.port_num),
        ));
    }
    if mask.contains(M::PKEY_INDEX) && attr.pkey_index >= limits.pkey_tbl_len {
        return Err(invalid(
            M::PKEY_INDEX,
            format_args!(
                "pkey_index {} is outside the P_Key table ({} entries)",
                attr.pkey_index, limits.pkey_tbl_len
            ),
        ));
    }
    if mask.contains(M::ACCESS_FLAGS) && !QP_ACCESS_ALLOWED.contains(attr.qp_access_flags) {
        return Err(invalid(
            M::ACCESS_FLAGS,
            format_args!(
                "qp_access_flags {:#x} has unknown bits",
                attr.qp_access_flags.bits()
            ),
        ));
    }
    if mask.contains(M::AV) {
        check_ah_attr(&attr.ah_attr, limits, M::AV)?;
        if qp_type != QpType::Ud && attr.ah_attr.grh.dgid.is_multicast() {
            return Err(invalid(
                M::AV,
                "a connected QP cannot have a multicast destination GID",
            ));
        }
    }
    if mask.contains(M::ALT_PATH) {
        return Err(invalid(
            M::ALT_PATH,
            "alternate paths are not supported (no IBV_DEVICE_AUTO_PATH_MIG)",
        ));
    }
    if mask.contains(M::PATH_MIG_STATE) && attr.path_mig_state != MigState::Migrated {
        return Err(invalid(
            M::PATH_MIG_STATE,
            "only IBV_MIG_MIGRATED is supported without alternate paths",
        ));
    }
    if mask.contains(M::PATH_MTU) && attr.path_mtu.raw() > limits.max_mtu.raw() {
        return Err(invalid(
            M::PATH_MTU,
            format_args!(
                "path_mtu {} exceeds the port's max_mtu {}",
                attr.path_mtu.bytes(),
                limits.max_mtu.bytes()
            ),
        ));
    }
    if mask.contains(M::TIMEOUT) && attr.timeout > 31 {
        return Err(invalid(
            M::TIMEOUT,
            format_args!("timeout {} exceeds 31", attr.timeout),
        ));
    }
    if mask.contains(M::RETRY_CNT) && attr.retry_cnt > 7 {
        return Err(invalid(
            M::RETRY_CNT,
            format_args!("retry_cnt {} exceeds 7", attr.retry_cnt),
        ));
    }
    if mask.contains(M::RNR_RETRY) && attr.rnr_retry > 7 {
        return Err(invalid(
            M::RNR_RETRY,
            format_args!("rnr_retry {} exceeds 7", attr.rnr_retry),
        ));
    }
    if mask.contains(M::MIN_RNR_TIMER) && attr.min_rnr_timer > 31 {
        return Err(invalid(
            M::MIN_RNR_TIMER,
            format_args!("min_rnr_timer {} exceeds 31", attr.min_rnr_timer),
        ));
    }
    if mask.contains(M::MAX_QP_RD_ATOMIC) && attr.max_rd_atomic > limits.max_qp_init_rd_atom {
        return Err(invalid(
            M::MAX_QP_RD_ATOMIC,
            format_args!(
                "max_rd_atomic {} exceeds max_qp_init_rd_atom {}",
                attr.max_rd_atomic, limits.max_qp_init_rd_atom
            ),
        ));
    }
    if mask.contains(M::MAX_DEST_RD_ATOMIC) && attr.max_dest_rd_atomic > limits.max_qp_rd_atom {
        return Err(invalid(
            M::MAX_DEST_RD_ATOMIC,
            format_args!(
                "max_dest_rd_atomic {} exceeds max_qp_rd_atom {}",
                attr.max_dest_rd_atomic, limits.max_qp_rd_atom
            ),
        ));
    }
    if mask.contains(M::DEST_QPN) && attr.dest_qp_num > 0xFF_FFFF {
        return Err(invalid(
            M::DEST_QPN,
            format_args!("dest_qp_num {:#x} exceeds 24 bits", attr.dest_qp_num),
        ));
    }
    Ok(next)
}

/// Applies an already validated modification to the QP's attributes.
///
/// PSNs are truncated to 24 bits, as hardware does. Moving to RESET returns every attribute
/// except the capabilities to its initial value.
pub fn apply_modify(qp_attr: &mut QpAttr, attr: &QpAttr, mask: QpAttrMask, next: QpState) {
    use QpAttrMask as M;

    if next == QpState::Reset {
        let cap = qp_attr.cap;
        *qp_attr = QpAttr {
            cap,
            ..QpAttr::default()
        };
        return;
    }
    let set = |m: M| mask.contains(m);
    // The drain notification belongs to the one RTS->SQD request that asks for it.
    qp_attr.en_sqd_async_notify = set(M::EN_SQD_ASYNC_NOTIFY) && attr.en_sqd_async_notify;
    if set(M::ACCESS_FLAGS) {
        qp_attr.qp_access_flags = attr.qp_access_flags;
    }
    if set(M::PKEY_INDEX) {
        qp_attr.pkey_index = attr.pkey_index;
    }
    if set(M::PORT) {
        qp_attr.port_num = attr.port_num;
    }
    if set(M::QKEY) {
        qp_attr.qkey = attr.qkey;
    }
    if set(M::AV) {
        qp_attr.ah_attr = attr.ah_attr.masked();
    }
    if set(M::PATH_MTU) {
        qp_attr.path_mtu = attr.path_mtu;
    }
    if set(M::TIMEOUT) {
        qp_attr.timeout = attr.timeout;
    }
    if set(M::RETRY_CNT) {
        qp_attr.retry_cnt = attr.retry_cnt;
    }
    if set(M::RNR_RETRY) {
        qp_attr.rnr_retry = attr.rnr_retry;
    }
    if set(M::RQ_PSN) {
        qp_attr.rq_psn = attr.rq_psn & 0xFF_FFFF;
    }
    if set(M::MAX_QP_RD_ATOMIC) {
        qp_attr.max_rd_atomic = attr.max_rd_atomic;
    }
    if set(M::MIN_RNR_TIMER) {
        qp_attr.min_rnr_timer = attr.min_rnr_timer;
    }
    if set(M::SQ_PSN) {
        qp_attr.sq_psn = attr.sq_psn & 0xFF_FFFF;
    }
    if set(M::MAX_DEST_RD_ATOMIC) {
        qp_attr.max_dest_rd_atomic = attr.max_dest_rd_atomic;
    }
    if set(M::PATH_MIG_STATE) {
        qp_attr.path_mig_state = attr.path_mig_state;
    }
    if set(M::DEST_QPN) {
        qp_attr.dest_qp_num = attr.dest_qp_num;
    }
    qp_attr.qp_state = next;
    qp_attr.cur_qp_state = next;
}

#[cfg(test)]
mod tests;
