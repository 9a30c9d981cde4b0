//! The RDMA side of one process: its QPs, CQs and memory region, and the burst they run.

use std::time::Instant;

use softverbs::{
    AccessFlags, AhAttr, CompletionQueue, Context, Gid, GlobalRoute, MemoryRegion, Mtu, Payload,
    ProtectionDomain, QpAttr, QpAttrMask, QpCap, QpInit, QpState, QpType, QueuePair, RecvWr, RemoteAddr,
    SendFlags, SendOp, SendRequest, WcOpcode, WcStatus, WorkCompletion,
};

use super::{ScaleArgs, ScaleOp};
use crate::endpoint::{pattern, pattern_byte, split_wr_id, wr_id, Info};
use crate::error::{bail, Error, Result};
use crate::procs::open_device;

/// What a QP's burst sends where.
#[derive(Debug, Clone, Copy)]
pub(super) struct Target {
    /// The partner's memory region (WRITE target).
    pub(super) addr: u64,
    pub(super) rkey: u32,
    /// The slot index in the partner's `dst` area this QP's messages land in.
    pub(super) slot: usize,
}

/// The resources of one process: QPs sharing two CQs and one memory region laid out as
/// `src` (one `size`-byte slot per QP, a pattern) then `dst` (one slot per QP, zeroed).
pub(super) struct Rig {
    _ctx: Context,
    _pd: ProtectionDomain,
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
    pub(super) mr: MemoryRegion,
    pub(super) qps: Vec<QueuePair>,
    pub(super) gid: Gid,
    gid_index: u8,
    pub(super) mtu: Mtu,
    size: usize,
    iters: u32,
    depth: u32,
    op: ScaleOp,
    pub(super) seed: u8,
    pub(super) ack_timeout: u8,
}

impl Rig {
    /// Everything but the QPs: context, PD, the two shared CQs sized for `nqps` QPs, the region.
    pub(super) fn new(args: &ScaleArgs, nqps: usize, seed: u8) -> Result<Self> {
        let (ctx, gid, gid_index) = open_device(&args.device)?;
        let attr = ctx.query_device();
        if nqps as u64 > u64::from(attr.max_qp) {
            bail!(
                "{nqps} QPs exceed the device's max_qp {} (raise it with SOFTVERBS_LIMITS=max_qp=N)",
                attr.max_qp
            );
        }
        let mtu = ctx.query_port(1)?.active_mtu;
        let pd = ctx.alloc_pd()?;
        let cqe = |per_qp: u32| -> Result<i32> {
            let n = (nqps as u64 * u64::from(per_qp)).max(1);
            if n > u64::from(attr.max_cqe) {
                bail!(
                    "a shared CQ of {n} entries exceeds max_cqe {} (lower --depth or raise it with \
                     SOFTVERBS_LIMITS=max_cqe=N)",
                    attr.max_cqe
                );
            }
            Ok(n as i32)
        };
        let send_cq = ctx.create_cq(cqe(args.depth)?, None, 0)?;
        let recv_depth = recv_depth(args);
        let recv_cq = ctx.create_cq(cqe(recv_depth.max(1))?, None, 0)?;
        let size = args.size as usize;
        let len = 2 * nqps * size;
        let mr = pd.register(
            len,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        )?;
        mr.write(0, &pattern(seed, nqps * size))?;
        mr.write(nqps * size, &vec![0u8; nqps * size])?;
        Ok(Self {
            _ctx: ctx,
            _pd: pd,
            send_cq,
            recv_cq,
            mr,
            qps: Vec::with_capacity(nqps),
            gid,
            gid_index,
            mtu,
            size,
            iters: args.iters,
            depth: args.depth,
            op: args.test,
            seed,
            ack_timeout: ack_timeout(args, nqps as u64),
        })
    }

    /// Creates the QPs (RESET state).
    pub(super) fn create_qps(&mut self, n: usize, recv_depth: u32) -> Result<()> {
        let mut init = QpInit::new(QpType::Rc, &self.send_cq);
        init.recv_cq = &self.recv_cq;
        init.cap = QpCap {
            max_send_wr: self.depth,
            max_recv_wr: recv_depth.max(1),
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        for i in 0..n {
            let qp = self
                ._pd
                .create_qp(&init)
                .map_err(|e| Error::msg(format!("creating QP {i}: {e}")))?;
            self.qps.push(qp);
        }
        Ok(())
    }

    fn slot_len(&self) -> usize {
        self.mr.len() / 2
    }

    /// Brings QP `q` to RTS connected to `dest` (QP number, PSN) at `dgid`; its own PSN is `psn`.
    pub(super) fn connect(&self, q: usize, psn: u32, dest: (u32, u32), dgid: Gid, mtu: Mtu) -> Result<()> {
        let qp = &self.qps[q];
        qp.modify(
            &QpAttr {
                qp_state: QpState::Init,
                port_num: 1,
                qp_access_flags: AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
                ..Default::default()
            },
            QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS,
        )?;
        qp.modify(
            &QpAttr {
                qp_state: QpState::Rtr,
                path_mtu: mtu,
                dest_qp_num: dest.0,
                rq_psn: dest.1,
                max_dest_rd_atomic: 1,
                min_rnr_timer: 1,
                ah_attr: AhAttr {
                    grh: GlobalRoute {
                        dgid,
                        sgid_index: self.gid_index,
                        hop_limit: 64,
                        ..Default::default()
                    },
                    is_global: true,
                    port_num: 1,
                    ..Default::default()
                },
                ..Default::default()
            },
            QpAttrMask::STATE
                | QpAttrMask::AV
                | QpAttrMask::PATH_MTU
                | QpAttrMask::DEST_QPN
                | QpAttrMask::RQ_PSN
                | QpAttrMask::MAX_DEST_RD_ATOMIC
                | QpAttrMask::MIN_RNR_TIMER,
        )?;
        qp.modify(
            &QpAttr {
                qp_state: QpState::Rts,
                sq_psn: psn,
                timeout: self.ack_timeout,
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
        )?;
        Ok(())
    }

    /// This side's endpoint for the peer process.
    pub(super) fn info(&self, psns: &[u32]) -> Info {
        Info {
            gid: self.gid,
            addr: self.mr.addr(),
            rkey: self.mr.rkey(),
            len: self.mr.len() as u64,
            mtu: self.mtu.bytes(),
            qps: self.qps.iter().zip(psns).map(|(q, &p)| (q.qp_num(), p)).collect(),
        }
    }

    /// Posts one receive WR for QP `q` into its `dst` slot.
    fn post_recv(&self, q: usize) -> Result<()> {
        let off = self.slot_len() + q * self.size;
        let sge = self.mr.sge(off..off + self.size)?;
        self.qps[q].post_recv(&[RecvWr {
            wr_id: q as u64,
            sg_list: vec![sge],
        }])?;
        Ok(())
    }

    /// Posts message `k` of QP `q` to `t`.
    fn post_send(&self, q: usize, k: u64, t: &Target) -> Result<()> {
        let off = q * self.size;
        let sge = self.mr.sge(off..off + self.size)?;
        let op = match self.op {
            ScaleOp::Write => SendOp::Write {
                remote: RemoteAddr {
                    addr: t.addr + (self.slot_len() + t.slot * self.size) as u64,
                    rkey: t.rkey,
                },
                imm: None,
            },
            ScaleOp::Send => SendOp::Send {
                imm: None,
                invalidate: None,
            },
        };
        self.qps[q].post_send(&[SendRequest {
            wr_id: wr_id(q, k),
            op,
            flags: SendFlags::SIGNALED,
            payload: Payload::Sges(vec![sge]),
            ud: None,
            xrc_srqn: None,
        }])?;
        Ok(())
    }

    /// Every QP sends `iters` messages to its target, at most `depth` outstanding; with SEND,
    /// also consumes the `iters` messages each QP receives. Every completion must be a success
    /// of the right kind and length. Returns (messages sent, seconds).
    fn burst(&self, targets: &[Target], deadline: Instant) -> Result<(u64, f64)> {
        let n = self.qps.len();
        let iters = u64::from(self.iters);
        let mut posted = vec![0u64; n];
        let mut sent = vec![0u64; n];
        let mut received = vec![0u64; n];
        let want = n as u64 * iters;
        let (mut sent_total, mut recv_total) = (0u64, 0u64);
        let recv_want = if self.op == ScaleOp::Send { want } else { 0 };
        let t0 = Instant::now();
        for (q, t) in targets.iter().enumerate() {
            while posted[q] < iters.min(u64::from(self.depth)) {
                self.post_send(q, posted[q], t)?;
                posted[q] += 1;
            }
        }
        let mut wcs = vec![WorkCompletion::default(); 512];
        let mut spins = 0u32;
        while sent_total < want || recv_total < recv_want {
            let mut progressed = false;
            let got = self.send_cq.poll(&mut wcs);
            for wc in &wcs[..got] {
                check(wc, send_opcode(self.op), 0)?;
                let (q, k) = split_wr_id(wc.wr_id);
                if q >= n || k != sent[q] {
                    bail!(
                        "completion for QP {q} message {k} out of order (expected {})",
                        sent.get(q).copied().unwrap_or(0)
                    );
                }
                sent[q] += 1;
                sent_total += 1;
                if posted[q] < iters {
                    self.post_send(q, posted[q], &targets[q])?;
                    posted[q] += 1;
                }
            }
            progressed |= got > 0;
            if recv_want > 0 {
                let got = self.recv_cq.poll(&mut wcs);
                for wc in &wcs[..got] {
                    check(wc, WcOpcode::Recv, self.size)?;
                    let q = wc.wr_id as usize;
                    if q >= n {
                        bail!("receive completion with a bad id {}", wc.wr_id);
                    }
                    received[q] += 1;
                    recv_total += 1;
                    // Keep the queue as deep as it started while more messages come.
                    if received[q] + u64::from(recv_depth_of(self.depth)) <= iters {
                        self.post_recv(q)?;
                    }
                }
                progressed |= got > 0;
            }
            if progressed {
                spins = 0;
            } else {
                spins += 1;
                if spins % 1024 == 0 {
                    if Instant::now() > deadline {
                        bail!(
                            "timed out: {sent_total} of {want} sends and {recv_total} of {recv_want} \
                             receives completed"
                        );
                    }
                    std::thread::yield_now();
                }
            }
        }
        let secs = t0.elapsed().as_secs_f64();
        if let Some(q) = (0..n).find(|&q| sent[q] != iters || (recv_want > 0 && received[q] != iters)) {
            bail!(
                "QP {q}: {} sends and {} receives completed, expected {iters}",
                sent[q],
                received[q]
            );
        }
        Ok((sent_total, secs))
    }

    /// Checks every `dst` slot against what its sender sent: slot `r` holds the `peer_seed`
    /// pattern at the sender's `src` slot `from(r)`. Returns the number of slots checked.
    pub(super) fn verify(&self, peer_seed: u8, from: impl Fn(usize) -> usize) -> Result<usize> {
        let n = self.qps.len();
        let mut got = vec![0u8; n * self.size];
        self.mr.read(self.slot_len(), &mut got)?;
        for r in 0..n {
            let s = from(r);
            for j in 0..self.size {
                let want = pattern_byte(peer_seed, s * self.size + j);
                let g = got[r * self.size + j];
                if g != want {
                    bail!("data of QP {r}: byte {j} is {g:#04x}, expected {want:#04x}");
                }
            }
        }
        Ok(n)
    }

    /// Transport counters summed over the QPs: (packets sent, retransmitted, ACK timeouts,
    /// RNR NAKs received, sequence NAKs received, duplicates, receive drops).
    pub(super) fn counters(&self) -> [u64; 7] {
        self.qps.iter().fold([0; 7], |mut a, qp| {
            let c = qp.counters();
            for (x, y) in a.iter_mut().zip([
                c.tx_packets,
                c.retransmits,
                c.timeouts,
                c.rnr_naks_received,
                c.seq_naks_received,
                c.duplicates,
                c.rx_dropped,
            ]) {
                *x += y;
            }
            a
        })
    }

    /// [`Rig::burst`], with the transport counters in the error if it fails.
    pub(super) fn burst_explained(&self, targets: &[Target], deadline: Instant) -> Result<(u64, f64)> {
        self.burst(targets, deadline).map_err(|e| {
            let c = self.counters();
            Error::msg(format!(
                "{e} (over all QPs: {} packets sent, {} retransmitted, {} ACK timeouts, {} RNR NAKs, \
                 {} sequence NAKs, {} duplicates, {} receive drops)",
                c[0], c[1], c[2], c[3], c[4], c[5], c[6]
            ))
        })
    }

    /// Posts the initial receive WRs (SEND bursts).
    pub(super) fn post_initial_recvs(&self) -> Result<()> {
        if self.op == ScaleOp::Send {
            let k = recv_depth_of(self.depth).min(self.iters);
            for q in 0..self.qps.len() {
                for _ in 0..k {
                    self.post_recv(q)?;
                }
            }
        }
        Ok(())
    }
}

/// The ACK timeout exponent: `--ack-timeout`, or one that allows 10 us for each of the
/// messages `qps` QPs (over all processes) keep in flight, and at least 67 ms.
pub(super) fn ack_timeout(args: &ScaleArgs, qps: u64) -> u8 {
    args.ack_timeout.unwrap_or_else(|| {
        let need_us = qps.saturating_mul(u64::from(args.depth)).saturating_mul(10);
        (14..31)
            .find(|&t| (4.096 * (1u64 << t) as f64) >= need_us as f64)
            .unwrap_or(31)
    })
}

/// Receive WRs kept posted per QP for SEND: twice the send depth, so that a sender whose
/// previous messages completed rarely finds the receiver not yet topped up (it would meet an
/// RNR NAK and retry, which is correct but slow).
fn recv_depth_of(depth: u32) -> u32 {
    depth.saturating_mul(2)
}

pub(super) fn recv_depth(args: &ScaleArgs) -> u32 {
    match args.test {
        ScaleOp::Send => recv_depth_of(args.depth),
        ScaleOp::Write => 0,
    }
}

/// The completion opcode of a burst's sends.
fn send_opcode(op: ScaleOp) -> WcOpcode {
    match op {
        ScaleOp::Write => WcOpcode::RdmaWrite,
        ScaleOp::Send => WcOpcode::Send,
    }
}

/// A completion must be a success of `opcode`; receives must carry `len` bytes.
fn check(wc: &WorkCompletion, opcode: WcOpcode, len: usize) -> Result<()> {
    if wc.status != WcStatus::Success {
        bail!(
            "work request {:#x} of QP {:#x} completed with {:?}",
            wc.wr_id,
            wc.qp_num,
            wc.status
        );
    }
    if wc.opcode != opcode {
        bail!("completion opcode {:?}, expected {opcode:?}", wc.opcode);
    }
    if opcode == WcOpcode::Recv && wc.byte_len as usize != len {
        bail!("received {} bytes, expected {len}", wc.byte_len);
    }
    Ok(())
}

/// A random 24-bit PSN per QP.
pub(super) fn psns(n: usize) -> Vec<u32> {
    use std::collections::hash_map::RandomState;
    use std::hash::{BuildHasher, Hasher};
    let s = RandomState::new();
    (0..n)
        .map(|i| {
            let mut h = s.build_hasher();
            h.write_usize(i);
            (h.finish() & 0xFF_FFFF) as u32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use clap::Parser;

    use super::*;
    use crate::procs::free_base_port;

    /// The only test of this crate's library that opens a device: it points the process at a
    /// private UDP port range and the loopback interface before the first device listing.
    fn args(qps: u32, test: ScaleOp) -> ScaleArgs {
        static ENV: std::sync::Once = std::sync::Once::new();
        ENV.call_once(|| {
            std::env::set_var("SOFTVERBS_INTERFACES", "lo");
            std::env::set_var("SOFTVERBS_UDP_PORT", free_base_port(2).unwrap().to_string());
            std::env::set_var("SOFTVERBS_UDP_SLOTS", "1");
        });
        ScaleArgs::parse_from(["softverbs-scale", "-q", &qps.to_string(), "-n", "3", "-s", "40"])
            .with_test(test)
    }

    impl ScaleArgs {
        fn with_test(mut self, test: ScaleOp) -> Self {
            self.test = test;
            self
        }
    }

    /// A pair-connected rig of `n` QPs after a burst of `op`.
    fn rig_after_burst(n: usize, op: ScaleOp) -> Rig {
        let a = args(n as u32, op);
        let mut rig = Rig::new(&a, n, 0x11).unwrap();
        rig.create_qps(n, recv_depth(&a)).unwrap();
        let psn = psns(n);
        let (gid, mtu) = (rig.gid, rig.mtu);
        for q in 0..n {
            rig.connect(q, psn[q], (rig.qps[q ^ 1].qp_num(), psn[q ^ 1]), gid, mtu)
                .unwrap();
        }
        rig.post_initial_recvs().unwrap();
        let targets: Vec<Target> = (0..n)
            .map(|q| Target {
                addr: rig.mr.addr(),
                rkey: rig.mr.rkey(),
                slot: q ^ 1,
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs(60);
        let (msgs, _) = rig.burst(&targets, deadline).unwrap();
        assert_eq!(msgs, 3 * n as u64);
        rig
    }

    #[test]
    fn verification_catches_one_wrong_byte() {
        for op in [ScaleOp::Write, ScaleOp::Send] {
            let rig = rig_after_burst(6, op);
            assert_eq!(rig.verify(0x11, |r| r ^ 1).unwrap(), 6);
            // Slots read as if each QP had received its own data: wrong everywhere.
            assert!(rig.verify(0x11, |r| r).is_err());
            let off = rig.slot_len() + 5 * 40 + 39;
            let mut b = [0u8];
            rig.mr.read(off, &mut b).unwrap();
            rig.mr.write(off, &[b[0] ^ 1]).unwrap();
            let e = rig.verify(0x11, |r| r ^ 1).unwrap_err();
            assert!(e.message().contains("QP 5: byte 39"), "{e}");
        }
    }

    #[test]
    fn a_burst_to_a_bad_rkey_fails_instead_of_counting() {
        let a = args(2, ScaleOp::Write);
        let mut rig = Rig::new(&a, 2, 0x22).unwrap();
        rig.create_qps(2, 0).unwrap();
        let psn = psns(2);
        let (gid, mtu) = (rig.gid, rig.mtu);
        for q in 0..2 {
            rig.connect(q, psn[q], (rig.qps[q ^ 1].qp_num(), psn[q ^ 1]), gid, mtu)
                .unwrap();
        }
        let bad = Target {
            addr: rig.mr.addr(),
            rkey: rig.mr.rkey() ^ 0x100,
            slot: 1,
        };
        let e = rig
            .burst(&[bad, bad], Instant::now() + Duration::from_secs(60))
            .unwrap_err();
        assert!(e.message().contains("completed with"), "{e}");
    }
}
