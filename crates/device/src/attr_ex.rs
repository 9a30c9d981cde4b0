//! The extended device attributes (`ibv_query_device_ex`): capability bits beyond the 32 of
//! `ibv_device_attr`, on-demand paging, and the completion clock (`ibv_query_rt_values_ex`).

use std::time::Duration;

use nix::time::{clock_gettime, ClockId};

/// Bits of `device_cap_flags_ex` above the 32 `ibv_device_attr` has (`IB_UVERBS_DEVICE_*`).
pub mod cap_flags_ex {
    /// `IB_UVERBS_DEVICE_FLUSH_GLOBAL`: FLUSH with the global-visibility placement type.
    pub const FLUSH_GLOBAL: u64 = 1 << 38;
    /// `IB_UVERBS_DEVICE_FLUSH_PERSISTENT`: FLUSH with the persistence placement type.
    pub const FLUSH_PERSISTENT: u64 = 1 << 39;
    /// `IB_UVERBS_DEVICE_ATOMIC_WRITE`: ATOMIC WRITE.
    pub const ATOMIC_WRITE: u64 = 1 << 40;
}

/// `enum ibv_odp_general_caps`.
pub mod odp {
    /// `IBV_ODP_SUPPORT`.
    pub const SUPPORT: u64 = 1;
    /// `IBV_ODP_SUPPORT_IMPLICIT`: a region over the whole address space.
    pub const SUPPORT_IMPLICIT: u64 = 1 << 1;
    /// `IBV_ODP_SUPPORT_SEND`.
    pub const SEND: u32 = 1;
    /// `IBV_ODP_SUPPORT_RECV`.
    pub const RECV: u32 = 1 << 1;
    /// `IBV_ODP_SUPPORT_WRITE`.
    pub const WRITE: u32 = 1 << 2;
    /// `IBV_ODP_SUPPORT_READ`.
    pub const READ: u32 = 1 << 3;
    /// `IBV_ODP_SUPPORT_ATOMIC`.
    pub const ATOMIC: u32 = 1 << 4;
    /// `IBV_ODP_SUPPORT_SRQ_RECV`.
    pub const SRQ_RECV: u32 = 1 << 5;
    /// `IBV_ODP_SUPPORT_FLUSH` (rdma-core after v44).
    pub const FLUSH: u32 = 1 << 6;
    /// `IBV_ODP_SUPPORT_ATOMIC_WRITE` (rdma-core after v44).
    pub const ATOMIC_WRITE: u32 = 1 << 7;
}

/// `struct ibv_odp_caps` plus `xrc_odp_caps`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OdpCaps {
    /// `general_caps`: [`odp::SUPPORT`], [`odp::SUPPORT_IMPLICIT`].
    pub general_caps: u64,
    /// What RC QPs may do on ODP regions.
    pub rc_odp_caps: u32,
    /// What UC QPs may do on ODP regions.
    pub uc_odp_caps: u32,
    /// What UD QPs may do on ODP regions.
    pub ud_odp_caps: u32,
    /// What XRC QPs may do on ODP regions.
    pub xrc_odp_caps: u32,
}

/// The extended device attributes this device reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceAttrEx {
    /// `device_cap_flags_ex`: the 32 basic bits plus [`cap_flags_ex`].
    pub device_cap_flags_ex: u64,
    /// `odp_caps` and `xrc_odp_caps`.
    pub odp_caps: OdpCaps,
    /// `completion_timestamp_mask`: the completion clock counts through all 64 bits.
    pub completion_timestamp_mask: u64,
    /// `hca_core_clock`: the completion clock's rate in kHz.
    pub hca_core_clock: u64,
    /// `cq_mod_caps`: the largest (`max_cq_count`, `max_cq_period`) `ibv_modify_cq` accepts.
    pub cq_mod_caps: (u16, u16),
    /// `packet_pacing_caps`: the send rate limits raw packet QPs take.
    pub packet_pacing_caps: crate::rate_limit::PacketPacingCaps,
}

/// The completion clock rate in kHz: one tick per nanosecond.
pub const HCA_CORE_CLOCK_KHZ: u64 = 1_000_000;

impl DeviceAttrEx {
    /// The attributes of a device whose basic capability bits are `device_cap_flags`.
    ///
    /// On-demand paging is honest here: the device never pins memory, it reaches registered
    /// memory through the current mapping on every access, and accesses to memory that is not
    /// mapped fail as protection errors instead of faulting (see the C library's backing). Every
    /// operation of every transport offered therefore works on ODP regions.
    pub fn new(device_cap_flags: u32) -> Self {
        let common = odp::SEND | odp::RECV | odp::SRQ_RECV;
        let rc = common | odp::WRITE | odp::READ | odp::ATOMIC | odp::FLUSH | odp::ATOMIC_WRITE;
        Self {
            device_cap_flags_ex: u64::from(device_cap_flags)
                | cap_flags_ex::FLUSH_GLOBAL
                | cap_flags_ex::FLUSH_PERSISTENT
                | cap_flags_ex::ATOMIC_WRITE,
            odp_caps: OdpCaps {
                general_caps: odp::SUPPORT | odp::SUPPORT_IMPLICIT,
                rc_odp_caps: rc,
                uc_odp_caps: common | odp::WRITE,
                ud_odp_caps: common,
                // XRC reaches memory as RC does; its receives are always an SRQ's.
                xrc_odp_caps: odp::SEND | odp::SRQ_RECV | odp::WRITE | odp::READ | odp::ATOMIC,
            },
            completion_timestamp_mask: u64::MAX,
            hca_core_clock: HCA_CORE_CLOCK_KHZ,
            cq_mod_caps: (
                crate::cq_moderation::MAX_CQ_COUNT,
                crate::cq_moderation::MAX_CQ_PERIOD,
            ),
            packet_pacing_caps: crate::rate_limit::PACKET_PACING_CAPS,
        }
    }
}

/// The completion clock: `CLOCK_MONOTONIC` in nanoseconds, so ticks at [`HCA_CORE_CLOCK_KHZ`].
pub fn raw_clock() -> u64 {
    clock_ns(ClockId::CLOCK_MONOTONIC)
}

/// The wall clock (`CLOCK_REALTIME`) in nanoseconds since the epoch.
pub fn wall_clock() -> u64 {
    clock_ns(ClockId::CLOCK_REALTIME)
}

fn clock_ns(id: ClockId) -> u64 {
    // Both clocks exist on every Linux system; a failure would be a broken kernel.
    let ts = clock_gettime(id).expect("clock_gettime");
    Duration::from(ts).as_nanos() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_raw_clock_advances_at_the_advertised_rate() {
        let (r0, w0) = (raw_clock(), wall_clock());
        std::thread::sleep(Duration::from_millis(20));
        let (r1, w1) = (raw_clock(), wall_clock());
        let ticks = r1 - r0;
        // kHz: ticks per millisecond.
        let ms = ticks / HCA_CORE_CLOCK_KHZ;
        assert!((20..2000).contains(&ms), "{ms} ms");
        let wall_ms = (w1 - w0) / 1_000_000;
        assert!(wall_ms.abs_diff(ms) < 50, "raw {ms} ms, wall {wall_ms} ms");
    }

    #[test]
    fn capabilities_are_consistent() {
        let a = DeviceAttrEx::new(0x1234);
        assert_eq!(a.device_cap_flags_ex & 0xFFFF_FFFF, 0x1234);
        assert_ne!(a.device_cap_flags_ex & cap_flags_ex::ATOMIC_WRITE, 0);
        assert_ne!(a.odp_caps.general_caps & odp::SUPPORT, 0);
        // ibv_rc_pingpong -o needs SEND and RECV on RC.
        assert_eq!(
            a.odp_caps.rc_odp_caps & (odp::SEND | odp::RECV),
            odp::SEND | odp::RECV
        );
        assert_ne!(a.completion_timestamp_mask, 0);
    }
}
