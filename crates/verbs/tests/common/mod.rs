//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub(crate) mod cm;
pub(crate) mod netns;
pub(crate) mod pcap;

use softverbs::*;
use std::net::Ipv4Addr;

/// This process's counters of the loopback device (those of every test of the binary).
pub(crate) fn lo_counters() -> CounterSnapshot {
    host_counters()
        .into_iter()
        .find(|p| p.pid == std::process::id())
        .and_then(|p| p.devices.into_iter().find(|(n, _)| n == "sv_lo"))
        .map(|(_, c)| c)
        .expect("this process's sv_lo counters")
}

/// A context on the loopback device, which every host has.
pub(crate) fn lo() -> Context {
    devices()
        .unwrap()
        .into_iter()
        .find(|d| d.netdev() == "lo")
        .expect("a loopback device")
        .open()
        .unwrap()
}

/// A context on a fresh loopback device with the given limits.
pub(crate) fn lo_with(limits: &str) -> Context {
    let mut config = Config {
        interfaces: Some(vec!["lo".into()]),
        ..Config::default()
    };
    config.limits.apply_list(limits).unwrap();
    Device::discover(&config).unwrap().remove(0).open().unwrap()
}

/// An address vector to 127.0.0.1 through GID index `sgid`.
pub(crate) fn ah_attr(ctx: &Context) -> AhAttr {
    let sgid = (0..16)
        .find(|&i| ctx.query_gid(1, i).unwrap() == Gid::from(Ipv4Addr::LOCALHOST))
        .unwrap();
    AhAttr {
        grh: GlobalRoute {
            dgid: Gid::from(Ipv4Addr::LOCALHOST),
            sgid_index: sgid as u8,
            hop_limit: 64,
            ..Default::default()
        },
        is_global: true,
        port_num: 1,
        ..Default::default()
    }
}

/// Moves `qp` through INIT, RTR and RTS with the minimal attributes of ibv_modify_qp(3).
pub(crate) fn to_rts(ctx: &Context, qp: &QueuePair, dest: u32) {
    to_init(qp);
    to_rtr(ctx, qp, dest);
    let (attr, mask) = match qp.qp_type() {
        QpType::Rc => (
            QpAttr {
                qp_state: QpState::Rts,
                sq_psn: 1,
                timeout: 14,
                retry_cnt: 7,
                rnr_retry: 7,
                max_rd_atomic: 1,
                ..Default::default()
            },
            QpAttrMask::STATE
                | QpAttrMask::SQ_PSN
                | QpAttrMask::TIMEOUT
                | QpAttrMask::RETRY_CNT
                | QpAttrMask::RNR_RETRY
                | QpAttrMask::MAX_QP_RD_ATOMIC,
        ),
        _ => (
            QpAttr {
                qp_state: QpState::Rts,
                sq_psn: 1,
                ..Default::default()
            },
            QpAttrMask::STATE | QpAttrMask::SQ_PSN,
        ),
    };
    qp.modify(&attr, mask).unwrap();
}

pub(crate) fn to_init(qp: &QueuePair) {
    let mut attr = QpAttr {
        qp_state: QpState::Init,
        port_num: 1,
        pkey_index: 0,
        ..Default::default()
    };
    let mut mask = QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT;
    if qp.qp_type() == QpType::Ud {
        attr.qkey = 0x1111_1111;
        mask |= QpAttrMask::QKEY;
    } else {
        attr.qp_access_flags = AccessFlags::REMOTE_WRITE;
        mask |= QpAttrMask::ACCESS_FLAGS;
    }
    qp.modify(&attr, mask).unwrap();
}

pub(crate) fn to_rtr(ctx: &Context, qp: &QueuePair, dest: u32) {
    let (attr, mask) = match qp.qp_type() {
        QpType::Ud => (
            QpAttr {
                qp_state: QpState::Rtr,
                ..Default::default()
            },
            QpAttrMask::STATE,
        ),
        t => {
            let attr = QpAttr {
                qp_state: QpState::Rtr,
                ah_attr: ah_attr(ctx),
                path_mtu: Mtu::Mtu1024,
                dest_qp_num: dest,
                rq_psn: 1,
                max_dest_rd_atomic: 1,
                min_rnr_timer: 12,
                ..Default::default()
            };
            let mut mask = QpAttrMask::STATE
                | QpAttrMask::AV
                | QpAttrMask::PATH_MTU
                | QpAttrMask::DEST_QPN
                | QpAttrMask::RQ_PSN;
            if t == QpType::Rc {
                mask |= QpAttrMask::MAX_DEST_RD_ATOMIC | QpAttrMask::MIN_RNR_TIMER;
            }
            (attr, mask)
        }
    };
    qp.modify(&attr, mask).unwrap();
}

pub(crate) fn to_err(qp: &QueuePair) {
    qp.modify(
        &QpAttr {
            qp_state: QpState::Err,
            ..Default::default()
        },
        QpAttrMask::STATE,
    )
    .unwrap();
}

/// Receive WRs `ids` of `len` bytes each, into `mr`.
pub(crate) fn recv_wrs(mr: &MemoryRegion, ids: std::ops::Range<u64>, len: usize) -> Vec<RecvWr> {
    ids.map(|id| RecvWr {
        wr_id: id,
        sg_list: vec![mr.sge(0..len).unwrap()],
    })
    .collect()
}

/// Polls everything currently in `cq`.
pub(crate) fn drain(cq: &CompletionQueue) -> Vec<WorkCompletion> {
    let mut out = Vec::new();
    let mut wc = [WorkCompletion::default(); 8];
    loop {
        let n = cq.poll(&mut wc);
        out.extend_from_slice(&wc[..n]);
        if n == 0 {
            return out;
        }
    }
}

/// The connection parameters of [`connect_rc`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct RcPath {
    pub(crate) access: AccessFlags,
    pub(crate) mtu: Mtu,
    /// First PSN in both directions.
    pub(crate) psn: u32,
    /// `max_rd_atomic` and `max_dest_rd_atomic`.
    pub(crate) rd_atomic: u8,
    pub(crate) timeout: u8,
    pub(crate) retry_cnt: u8,
}

/// Moves an RC `qp` through INIT, RTR (to `dest` on 127.0.0.1) and RTS with `path`.
pub(crate) fn connect_rc(ctx: &Context, qp: &QueuePair, dest: u32, path: &RcPath) {
    qp.modify(
        &QpAttr {
            qp_state: QpState::Init,
            port_num: 1,
            qp_access_flags: path.access,
            ..Default::default()
        },
        QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS,
    )
    .unwrap();
    qp.modify(
        &QpAttr {
            qp_state: QpState::Rtr,
            path_mtu: path.mtu,
            dest_qp_num: dest,
            rq_psn: path.psn,
            max_dest_rd_atomic: path.rd_atomic,
            min_rnr_timer: 1,
            ah_attr: ah_attr(ctx),
            ..Default::default()
        },
        QpAttrMask::STATE
            | QpAttrMask::AV
            | QpAttrMask::PATH_MTU
            | QpAttrMask::DEST_QPN
            | QpAttrMask::RQ_PSN
            | QpAttrMask::MAX_DEST_RD_ATOMIC
            | QpAttrMask::MIN_RNR_TIMER,
    )
    .unwrap();
    qp.modify(
        &QpAttr {
            qp_state: QpState::Rts,
            sq_psn: path.psn,
            timeout: path.timeout,
            retry_cnt: path.retry_cnt,
            rnr_retry: 7,
            max_rd_atomic: path.rd_atomic,
            ..Default::default()
        },
        QpAttrMask::STATE
            | QpAttrMask::SQ_PSN
            | QpAttrMask::TIMEOUT
            | QpAttrMask::RETRY_CNT
            | QpAttrMask::RNR_RETRY
            | QpAttrMask::MAX_QP_RD_ATOMIC,
    )
    .unwrap();
}

/// A base UDP port whose first slots are free now, so that a multi-process test does not depend
/// on which other softverbs processes run on the host (they use the standard 4791 range). Set
/// it as `SOFTVERBS_UDP_PORT` before any device exists; child processes inherit it.
pub(crate) fn free_base_port() -> u16 {
    let free = |port: u16| {
        std::net::UdpSocket::bind(("0.0.0.0", port)).is_ok()
            && std::net::UdpSocket::bind(("::", port)).is_ok()
    };
    let seed = std::process::id() as u16;
    (0..1000u16)
        .map(|i| 20_000 + (seed.wrapping_add(i.wrapping_mul(97)) % 40_000))
        .find(|&base| (base..base + 8).all(free))
        .expect("a free range of UDP ports")
}

/// RESET -> INIT -> RTR -> RTS of an XRC QP with exactly the attributes the kernel's state
/// table requires for its half.
pub(crate) fn xrc_up(ctx: &Context, qp: &QueuePair, dest: u32) {
    let tgt = qp.qp_type() == QpType::XrcRecv;
    qp.modify(
        &QpAttr {
            qp_state: QpState::Init,
            port_num: 1,
            qp_access_flags: AccessFlags::REMOTE_WRITE
                | AccessFlags::REMOTE_READ
                | AccessFlags::REMOTE_ATOMIC,
            ..Default::default()
        },
        QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS,
    )
    .unwrap();
    let mut mask =
        QpAttrMask::STATE | QpAttrMask::AV | QpAttrMask::PATH_MTU | QpAttrMask::DEST_QPN | QpAttrMask::RQ_PSN;
    if tgt {
        mask |= QpAttrMask::MAX_DEST_RD_ATOMIC | QpAttrMask::MIN_RNR_TIMER;
    }
    qp.modify(
        &QpAttr {
            qp_state: QpState::Rtr,
            ah_attr: ah_attr(ctx),
            path_mtu: Mtu::Mtu1024,
            dest_qp_num: dest,
            rq_psn: 1,
            max_dest_rd_atomic: 4,
            min_rnr_timer: 12,
            ..Default::default()
        },
        mask,
    )
    .unwrap();
    let mut mask = QpAttrMask::STATE | QpAttrMask::SQ_PSN | QpAttrMask::TIMEOUT;
    if !tgt {
        mask |= QpAttrMask::RETRY_CNT | QpAttrMask::RNR_RETRY | QpAttrMask::MAX_QP_RD_ATOMIC;
    }
    qp.modify(
        &QpAttr {
            qp_state: QpState::Rts,
            sq_psn: 1,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 4,
            ..Default::default()
        },
        mask,
    )
    .unwrap();
}

/// A copy of the running test program that any user may run, removed on drop: the checkout (and
/// so the program) may lie in a directory only its owner may enter, and tests run parts of
/// themselves as other users.
pub(crate) struct ProgramCopy(pub(crate) std::path::PathBuf);

impl ProgramCopy {
    pub(crate) fn of_this_program() -> Self {
        use std::os::unix::fs::PermissionsExt;
        let exe = std::env::current_exe().unwrap();
        let name = exe.file_name().unwrap().to_owned();
        let dir = std::env::temp_dir().join(format!(
            "softverbs-{}-{}",
            name.to_string_lossy(),
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).expect("a directory for the copy");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let copy = dir.join(name);
        std::fs::copy(&exe, &copy).expect("copy this program");
        std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755)).unwrap();
        Self(copy)
    }
}

impl Drop for ProgramCopy {
    fn drop(&mut self) {
        if let Some(dir) = self.0.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// The next completion of `cq`, polled for at most 20 s.
pub(crate) fn wait_one(cq: &CompletionQueue) -> WorkCompletion {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let mut wc = [WorkCompletion::default(); 1];
    loop {
        if cq.poll(&mut wc) == 1 {
            return wc[0];
        }
        assert!(std::time::Instant::now() < deadline, "no completion within 20 s");
        std::thread::yield_now();
    }
}
