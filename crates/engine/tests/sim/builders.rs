//! Options and WR builders.

use std::net::{IpAddr, Ipv4Addr};

use softverbs_engine::mw::MwBind;
use softverbs_engine::types::{
    AccessFlags, Gid, Mtu, QpType, RecvWr, SendFlags, Sge, WcStatus, WorkCompletion,
};
use softverbs_engine::wr::{Payload, RemoteAddr, SendOp, SendWr};

use super::{NetConfig, QpId, Sim};

#[derive(Debug, Clone, Copy)]
pub struct QpOpts {
    pub pd: u32,
    pub sq_sig_all: bool,
    pub srq: Option<usize>,
    pub send_cq: Option<usize>,
    pub recv_cq: Option<usize>,
    /// XRC target QPs: the XRC domain whose SRQs they serve.
    pub xrcd: Option<u32>,
}

impl Default for QpOpts {
    fn default() -> Self {
        Self {
            pd: 1,
            sq_sig_all: false,
            srq: None,
            send_cq: None,
            recv_cq: None,
            xrcd: None,
        }
    }
}

/// Connection attributes for RC and UC QPs.
#[derive(Debug, Clone, Copy)]
pub struct ConnOpts {
    pub mtu: Mtu,
    pub psn_a: u32,
    pub psn_b: u32,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub min_rnr_timer: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub access: AccessFlags,
}

impl Default for ConnOpts {
    fn default() -> Self {
        Self {
            mtu: Mtu::Mtu1024,
            psn_a: 0x1000,
            psn_b: 0x2000,
            // 4.096 us * 2^10 = 4.2 ms: far above the fabric's round trip.
            timeout: 10,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 1,
            max_rd_atomic: 16,
            max_dest_rd_atomic: 16,
            access: AccessFlags::LOCAL_WRITE
                | AccessFlags::REMOTE_WRITE
                | AccessFlags::REMOTE_READ
                | AccessFlags::REMOTE_ATOMIC,
        }
    }
}

/// Two connected RC QPs on a network losing `loss` % of packets (and corrupting a quarter as
/// many), with a short ACK timeout so that recovery is quick in virtual time.
pub fn lossy_pair(seed: u64, loss: f64, mtu: Mtu) -> (Sim, QpId, QpId) {
    let o = ConnOpts {
        mtu,
        timeout: 8,
        ..ConnOpts::default()
    };
    let (mut sim, a, b) = Sim::pair(seed, QpType::Rc, &o);
    sim.net = NetConfig {
        corrupt_pct: loss / 4.0,
        ..NetConfig::lossy(loss)
    };
    (sim, a, b)
}

/// Every right a region can have.
pub fn all_access() -> AccessFlags {
    AccessFlags::LOCAL_WRITE
        | AccessFlags::REMOTE_WRITE
        | AccessFlags::REMOTE_READ
        | AccessFlags::REMOTE_ATOMIC
}

pub fn recv(wr_id: u64, sges: Vec<Sge>) -> RecvWr {
    RecvWr { wr_id, sg_list: sges }
}

pub fn wr(wr_id: u64, op: SendOp, payload: Payload) -> SendWr {
    SendWr {
        wr_id,
        op,
        flags: SendFlags::SIGNALED,
        payload,
        ud: None,
        xrc_srqn: None,
    }
}

pub fn send(wr_id: u64, sges: Vec<Sge>) -> SendWr {
    wr(
        wr_id,
        SendOp::Send {
            imm: None,
            invalidate: None,
        },
        Payload::Sges(sges),
    )
}

pub fn write(wr_id: u64, remote: RemoteAddr, sges: Vec<Sge>) -> SendWr {
    wr(wr_id, SendOp::Write { remote, imm: None }, Payload::Sges(sges))
}

pub fn read(wr_id: u64, remote: RemoteAddr, sges: Vec<Sge>) -> SendWr {
    wr(wr_id, SendOp::Read { remote }, Payload::Sges(sges))
}

pub fn cmp_swp(wr_id: u64, remote: RemoteAddr, compare: u64, swap: u64, result: Sge) -> SendWr {
    wr(
        wr_id,
        SendOp::CompareSwap {
            remote,
            compare,
            swap,
        },
        Payload::Sges(vec![result]),
    )
}

pub fn bind_mw(wr_id: u64, bind: MwBind) -> SendWr {
    wr(wr_id, SendOp::BindMw(bind), Payload::Sges(Vec::new()))
}

pub fn local_inv(wr_id: u64, rkey: u32) -> SendWr {
    wr(wr_id, SendOp::LocalInv { rkey }, Payload::Sges(Vec::new()))
}

pub fn send_inv(wr_id: u64, rkey: u32, sges: Vec<Sge>) -> SendWr {
    wr(
        wr_id,
        SendOp::Send {
            imm: None,
            invalidate: Some(rkey),
        },
        Payload::Sges(sges),
    )
}

pub fn fetch_add(wr_id: u64, remote: RemoteAddr, add: u64, result: Sge) -> SendWr {
    wr(
        wr_id,
        SendOp::FetchAdd { remote, add },
        Payload::Sges(vec![result]),
    )
}

/// Asserts a completion's identity and status, with a readable message.
#[track_caller]
pub fn assert_wc(wc: &WorkCompletion, wr_id: u64, status: WcStatus) {
    assert_eq!((wc.wr_id, wc.status), (wr_id, status), "completion {wc:?}");
}

/// Asserts that `wcs` are exactly `ids`, in order, all successful.
#[track_caller]
pub fn assert_ok_in_order(wcs: &[WorkCompletion], ids: &[u64]) {
    let got: Vec<(u64, WcStatus)> = wcs.iter().map(|w| (w.wr_id, w.status)).collect();
    let want: Vec<(u64, WcStatus)> = ids.iter().map(|&i| (i, WcStatus::Success)).collect();
    assert_eq!(got, want);
}

/// An IPv4 multicast GID (`::ffff:224.x.y.z`).
pub fn mgid_v4(a: u8, b: u8, c: u8) -> Gid {
    Gid::from_ip(IpAddr::V4(Ipv4Addr::new(224, a, b, c)))
}
