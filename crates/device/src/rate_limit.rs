//! Packet pacing (`ibv_modify_qp_rate_limit`, `IBV_QP_RATE_LIMIT`) of raw packet QPs: what is
//! accepted; the shaping itself is the engine's token bucket.

use softverbs_engine::pacing::{RateLimit, QP_RATE_LIMIT_MAX, QP_RATE_LIMIT_MIN};
use softverbs_engine::types::QpType;
use softverbs_engine::{Error, Result};

/// `packet_pacing_caps` of `ibv_query_device_ex`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PacketPacingCaps {
    /// Lowest rate limit in kbit/s.
    pub qp_rate_limit_min: u32,
    /// Highest rate limit in kbit/s.
    pub qp_rate_limit_max: u32,
    /// `1 << IBV_QPT_*` of the QP types that can be paced: raw packet QPs.
    pub supported_qpts: u32,
}

/// The pacing this device offers.
pub const PACKET_PACING_CAPS: PacketPacingCaps = PacketPacingCaps {
    qp_rate_limit_min: QP_RATE_LIMIT_MIN,
    qp_rate_limit_max: QP_RATE_LIMIT_MAX,
    supported_qpts: 1 << 8,
};

/// EINVAL unless `rate_kbps` is 0 (no limit) or within the caps.
pub(crate) fn check_rate(rate_kbps: u32) -> Result<()> {
    if rate_kbps != 0 && !(QP_RATE_LIMIT_MIN..=QP_RATE_LIMIT_MAX).contains(&rate_kbps) {
        return Err(Error::invalid(format!(
            "rate_limit {rate_kbps} kbps is outside {QP_RATE_LIMIT_MIN}..={QP_RATE_LIMIT_MAX}"
        )));
    }
    Ok(())
}

/// The checks of `ibv_modify_qp_rate_limit` (as mlx5 and the kernel): a raw packet QP in RTS
/// (the limit is an RTS->RTS attribute), a rate within the caps or 0, and burst or packet
/// size only with a rate.
pub(crate) fn check(
    qp_type: QpType,
    in_rts: bool,
    rate_kbps: u32,
    max_burst_sz: u32,
    typical_pkt_sz: u16,
) -> Result<()> {
    if qp_type != QpType::RawPacket {
        return Err(Error::invalid(format!(
            "rate limits apply to raw packet QPs, not {qp_type}"
        )));
    }
    if !in_rts {
        return Err(Error::invalid("a rate limit is set on a QP in RTS"));
    }
    check_rate(rate_kbps)?;
    if rate_kbps == 0 && (max_burst_sz != 0 || typical_pkt_sz != 0) {
        return Err(Error::invalid(
            "max_burst_sz and typical_pkt_sz need a rate_limit",
        ));
    }
    Ok(())
}

/// The engine's shaping for a checked request (`None`: unlimited).
pub(crate) fn limit(rate_kbps: u32, max_burst_sz: u32, typical_pkt_sz: u16) -> Option<RateLimit> {
    (rate_kbps != 0).then_some(RateLimit {
        rate_kbps,
        max_burst_sz,
        typical_pkt_sz,
    })
}
