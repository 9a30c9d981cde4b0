//! The RDMA side of one process: device choice, resources, and connecting RC QPs to the peer's.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::net::IpAddr;

use softverbs::{
    devices, AccessFlags, AhAttr, CompletionChannel, CompletionQueue, Context, Gid, GlobalRoute,
    MemoryRegion, Mtu, OwnedRegion, Payload, ProtectionDomain, QpAttr, QpAttrMask, QpInit, QpState, QpType,
    QueuePair, RecvWr, RemoteAddr, SendFlags, SendOp, SendRequest, Sge, WorkCompletion,
};

use crate::cli::{AtomicKind, Connection, Params, TestKind};
use crate::error::{bail, Error, Result};

/// Where things live in each side's one memory region (the same on both sides).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Layout {
    /// Data this side sends (a fixed pattern).
    pub(crate) src: usize,
    /// Where the peer's data lands (WRITE target, RECV buffer, READ destination).
    pub(crate) dst: usize,
    /// One 8-byte word per QP that the peer's atomics target.
    pub(crate) atomic: usize,
    /// One 8-byte word per QP receiving this side's atomic results.
    pub(crate) result: usize,
    /// Region length.
    pub(crate) len: usize,
    /// Largest message.
    pub(crate) max: usize,
}

impl Layout {
    fn new(max: usize, qps: usize) -> Self {
        let slot = max.div_ceil(64) * 64;
        let atomic = 2 * slot;
        let result = atomic + 8 * qps;
        Self {
            src: 0,
            dst: slot,
            atomic,
            result,
            len: result + 8 * qps,
            max,
        }
    }
}

/// This side's one memory region: allocated by the safe API (atomic words, reached through
/// copying accessors), or memory the program owns registered without a copy (`--zero-copy`).
#[derive(Debug)]
pub(crate) enum Region {
    Copying(MemoryRegion),
    Owned(OwnedRegion<memmap2::MmapMut>),
}

impl Region {
    /// `len` bytes holding `pattern` at `at`, registered with `access`.
    fn new(
        pd: &ProtectionDomain,
        zero_copy: bool,
        len: usize,
        access: AccessFlags,
        at: usize,
        pattern: &[u8],
    ) -> Result<Self> {
        if !zero_copy {
            let mr = pd.register(len, access)?;
            mr.write(at, pattern)?;
            return Ok(Self::Copying(mr));
        }
        let map = memmap2::MmapMut::map_anon(len).map_err(|e| Error::msg(format!("mmap: {e}")))?;
        let mut mr = pd.register_owned(map, access)?;
        // Filled in place: nothing else can reach the region before it is advertised.
        mr.local_mut()[at..at + pattern.len()].copy_from_slice(pattern);
        Ok(Self::Owned(mr))
    }
}

impl std::ops::Deref for Region {
    type Target = MemoryRegion;

    fn deref(&self) -> &MemoryRegion {
        match self {
            Self::Copying(mr) => mr,
            Self::Owned(mr) => mr,
        }
    }
}

/// Which end of the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    Client,
    Server,
}

impl Side {
    /// Seed of the data pattern this side sends.
    pub(crate) fn seed(self) -> u8 {
        match self {
            Self::Client => 0xA5,
            Self::Server => 0x3C,
        }
    }

    pub(crate) fn peer(self) -> Self {
        match self {
            Self::Client => Self::Server,
            Self::Server => Self::Client,
        }
    }
}

/// Byte `i` of the pattern with `seed`: varies with every byte, so misplaced data shows.
pub(crate) fn pattern_byte(seed: u8, i: usize) -> u8 {
    let x = (i as u32).wrapping_mul(0x9E37_79B1);
    ((x >> 24) as u8) ^ (i as u8) ^ seed
}

/// The first `len` bytes of the pattern with `seed`.
pub(crate) fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| pattern_byte(seed, i)).collect()
}

/// What one side tells the other (`EP` message).
#[derive(Debug, Clone)]
pub(crate) struct Info {
    pub(crate) gid: Gid,
    pub(crate) addr: u64,
    pub(crate) rkey: u32,
    pub(crate) len: u64,
    pub(crate) mtu: u32,
    /// (QP number, initial PSN) of each QP.
    pub(crate) qps: Vec<(u32, u32)>,
}

fn hex16(b: &[u8; 16]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex16(s: &str) -> Result<[u8; 16]> {
    if s.len() != 32 || !s.is_ascii() {
        bail!("bad GID {s:?}");
    }
    let mut out = [0u8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        *o =
            u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| Error::msg(format!("bad GID {s:?}")))?;
    }
    Ok(out)
}

impl Info {
    pub(crate) fn encode(&self) -> String {
        let qps: Vec<String> = self.qps.iter().map(|(n, p)| format!("{n:x}:{p:x}")).collect();
        format!(
            "gid={} addr={:x} rkey={:x} len={} mtu={} qps={}",
            hex16(&self.gid.0),
            self.addr,
            self.rkey,
            self.len,
            self.mtu,
            qps.join(",")
        )
    }

    pub(crate) fn decode(s: &str) -> Result<Self> {
        let mut info = Self {
            gid: Gid::ZERO,
            addr: 0,
            rkey: 0,
            len: 0,
            mtu: 0,
            qps: Vec::new(),
        };
        let bad = |what: &str| Error::msg(format!("bad {what} in the peer's endpoint: {s:?}"));
        for kv in s.split_whitespace() {
            let Some((k, v)) = kv.split_once('=') else {
                return Err(bad("field"));
            };
            match k {
                "gid" => info.gid = Gid(unhex16(v)?),
                "addr" => info.addr = u64::from_str_radix(v, 16).map_err(|_| bad("addr"))?,
                "rkey" => info.rkey = u32::from_str_radix(v, 16).map_err(|_| bad("rkey"))?,
                "len" => info.len = v.parse().map_err(|_| bad("len"))?,
                "mtu" => info.mtu = v.parse().map_err(|_| bad("mtu"))?,
                "qps" => {
                    for q in v.split(',') {
                        let (n, p) = q.split_once(':').ok_or_else(|| bad("qps"))?;
                        let n = u32::from_str_radix(n, 16).map_err(|_| bad("qpn"))?;
                        let p = u32::from_str_radix(p, 16).map_err(|_| bad("psn"))?;
                        info.qps.push((n, p));
                    }
                }
                _ => {}
            }
        }
        if info.gid.is_zero() || info.qps.is_empty() || info.mtu == 0 {
            return Err(bad("endpoint"));
        }
        Ok(info)
    }
}

/// A context on the chosen device with the source GID to use.
struct Chosen {
    ctx: Context,
    name: String,
    gid: Gid,
    gid_index: u8,
}

/// Picks the device and GID: `-d`/`-g` if given, else the GID equal to `local_ip` (the address
/// the TCP connection uses, so RDMA traffic takes the same path).
fn choose(device: Option<&str>, gid_index: Option<u32>, local_ip: IpAddr) -> Result<Chosen> {
    let all = devices()?;
    let candidates: Vec<_> = match device {
        Some(d) => all
            .into_iter()
            .filter(|x| x.name() == d || x.netdev() == d)
            .collect(),
        None => all,
    };
    if candidates.is_empty() {
        bail!(
            "no device {:?} (see SOFTVERBS_INTERFACES)",
            device.unwrap_or("at all")
        );
    }
    let want = Gid::from_ip(local_ip);
    let mut fallback = None;
    for dev in &candidates {
        let ctx = dev.open()?;
        let port = ctx.query_port(1)?;
        let gids: Vec<(u8, Gid)> = (0..port.gid_tbl_len.min(256))
            .filter_map(|i| ctx.query_gid(1, i as i32).ok().map(|g| (i as u8, g)))
            .filter(|(_, g)| !g.is_zero())
            .collect();
        let pick = match gid_index {
            Some(i) => gids.iter().find(|(j, _)| u32::from(*j) == i).copied(),
            None => gids.iter().find(|(_, g)| *g == want).copied(),
        };
        if let Some((gid_index, gid)) = pick {
            return Ok(Chosen {
                name: dev.name().to_string(),
                ctx,
                gid,
                gid_index,
            });
        }
        if device.is_some() && gid_index.is_none() && fallback.is_none() {
            // An explicit device without the connection's address: its first IPv4 GID, or
            // its first GID.
            let g = gids
                .iter()
                .find(|(_, g)| matches!(g.to_ip(), IpAddr::V4(_)))
                .or(gids.first())
                .copied();
            if let Some((gid_index, gid)) = g {
                fallback = Some(Chosen {
                    name: dev.name().to_string(),
                    ctx,
                    gid,
                    gid_index,
                });
            }
        }
    }
    if let Some(f) = fallback {
        return Ok(f);
    }
    match gid_index {
        Some(i) => bail!("no device has a GID at index {i}"),
        None => bail!("no device has the address {local_ip} the connection uses; choose one with -d/-g"),
    }
}

/// A random 24-bit initial PSN.
fn random_psn(salt: u64) -> u32 {
    let mut h = RandomState::new().build_hasher();
    h.write_u64(salt);
    h.write_u32(std::process::id());
    (h.finish() & 0xFF_FFFF) as u32
}

const REMOTE_ACCESS: AccessFlags = AccessFlags::REMOTE_WRITE
    .union(AccessFlags::REMOTE_READ)
    .union(AccessFlags::REMOTE_ATOMIC);

/// The resources of one side.
pub(crate) struct Endpoint {
    pub(crate) side: Side,
    pub(crate) device: String,
    pub(crate) ctx: Context,
    _pd: ProtectionDomain,
    pub(crate) cq: CompletionQueue,
    /// The completion channel of `cq` with `--use-event`.
    channel: Option<CompletionChannel>,
    pub(crate) qps: Vec<QueuePair>,
    pub(crate) psns: Vec<u32>,
    pub(crate) mr: Region,
    pub(crate) layout: Layout,
    pub(crate) gid: Gid,
    pub(crate) gid_index: u8,
    /// This side's port MTU, or the one asked for.
    pub(crate) mtu: Mtu,
    pub(crate) max_rd_atomic: u8,
    /// The pattern in `src`.
    pub(crate) src_pattern: Vec<u8>,
    /// Receive WRs posted and not yet consumed, per QP.
    pub(crate) recvs_posted: Vec<u32>,
    /// Receive requests kept for [`Endpoint::fill_recvs`].
    recv_wrs: Vec<RecvWr>,
    pub(crate) params: Params,
}

impl Endpoint {
    /// (request packets resent, retransmission timer expiries, tail probes) so far, over all
    /// QPs.
    pub(crate) fn resends(&self) -> (u64, u64, u64) {
        self.qps.iter().fold((0, 0, 0), |(r, t, p), qp| {
            let c = qp.counters();
            (r + c.retransmits, t + c.timeouts, p + c.tail_probes)
        })
    }

    pub(crate) fn create(
        side: Side,
        params: &Params,
        device: Option<&str>,
        gid_index: Option<u32>,
        local_ip: IpAddr,
    ) -> Result<Self> {
        let Chosen {
            ctx,
            name,
            gid,
            gid_index,
        } = choose(device, gid_index, local_ip)?;
        let attr = ctx.query_device();
        let port = ctx.query_port(1)?;
        let mtu = match params.mtu {
            0 => port.active_mtu,
            m => Mtu::largest_within(m).ok_or_else(|| Error::msg(format!("bad MTU {m}")))?,
        };
        if mtu.bytes() > port.max_mtu.bytes() {
            bail!(
                "MTU {} exceeds the port maximum {}",
                mtu.bytes(),
                port.max_mtu.bytes()
            );
        }
        let nq = params.qps as usize;
        let layout = Layout::new(params.max_size(), nq);
        let pd = ctx.alloc_pd()?;
        let cqe = u64::from(params.qps) * (u64::from(params.tx_depth) + 1 + u64::from(params.rx_depth)) + 16;
        let cqe = i32::try_from(cqe.min(u64::from(attr.max_cqe))).unwrap_or(i32::MAX);
        let channel = if params.use_event {
            Some(ctx.create_comp_channel()?)
        } else {
            None
        };
        let cq = ctx.create_cq(cqe, channel.as_ref(), 0)?;
        let qp_type = match params.connection {
            Connection::Rc => QpType::Rc,
            Connection::Uc => QpType::Uc,
        };
        let mut init = QpInit::new(qp_type, &cq);
        init.cap.max_send_wr = params.tx_depth + 1;
        init.cap.max_recv_wr = params.rx_depth;
        init.cap.max_inline_data = params.inline;
        let mut qps = Vec::with_capacity(nq);
        let mut psns = Vec::with_capacity(nq);
        for i in 0..nq {
            qps.push(pd.create_qp(&init)?);
            psns.push(random_psn(i as u64));
        }
        let src_pattern = pattern(side.seed(), layout.max);
        let mr = Region::new(
            &pd,
            params.zero_copy,
            layout.len,
            AccessFlags::LOCAL_WRITE | REMOTE_ACCESS,
            layout.src,
            &src_pattern,
        )?;
        let max_rd_atomic = params
            .tx_depth
            .min(attr.max_qp_init_rd_atom)
            .min(attr.max_qp_rd_atom)
            .clamp(1, 255) as u8;
        Ok(Self {
            side,
            device: name,
            ctx,
            _pd: pd,
            cq,
            channel,
            qps,
            psns,
            mr,
            layout,
            gid,
            gid_index,
            mtu,
            max_rd_atomic,
            src_pattern,
            recvs_posted: vec![0; nq],
            recv_wrs: Vec::new(),
            params: params.clone(),
        })
    }

    pub(crate) fn info(&self) -> Info {
        Info {
            gid: self.gid,
            addr: self.mr.addr(),
            rkey: self.mr.rkey(),
            len: self.mr.len() as u64,
            mtu: self.mtu.bytes(),
            qps: self
                .qps
                .iter()
                .zip(&self.psns)
                .map(|(q, &p)| (q.qp_num(), p))
                .collect(),
        }
    }

    /// Brings every QP to RTS, connected to the peer's QP of the same index.
    pub(crate) fn connect(&mut self, remote: &Info) -> Result<()> {
        if remote.qps.len() != self.qps.len() {
            bail!(
                "the peer has {} QPs, this side {}",
                remote.qps.len(),
                self.qps.len()
            );
        }
        if remote.len < self.layout.len as u64 {
            bail!("the peer's memory region is too small ({} bytes)", remote.len);
        }
        // Both sides use the smaller MTU.
        self.mtu = Mtu::largest_within(self.mtu.bytes().min(remote.mtu)).unwrap_or(Mtu::Mtu256);
        let max_dest_rd_atomic = self.ctx.query_device().max_qp_rd_atom.clamp(1, 255) as u8;
        let rc = self.params.connection == Connection::Rc;
        let access = if rc {
            REMOTE_ACCESS
        } else {
            AccessFlags::REMOTE_WRITE
        };
        // UC has no responder resources, RNR or retransmission attributes.
        let (rtr_extra, rts_extra) = if rc {
            (
                QpAttrMask::MAX_DEST_RD_ATOMIC | QpAttrMask::MIN_RNR_TIMER,
                QpAttrMask::TIMEOUT
                    | QpAttrMask::RETRY_CNT
                    | QpAttrMask::RNR_RETRY
                    | QpAttrMask::MAX_QP_RD_ATOMIC,
            )
        } else {
            (QpAttrMask::empty(), QpAttrMask::empty())
        };
        for ((qp, &psn), &(dest, rpsn)) in self.qps.iter().zip(&self.psns).zip(&remote.qps) {
            let init = QpAttr {
                qp_state: QpState::Init,
                port_num: 1,
                qp_access_flags: access,
                ..Default::default()
            };
            qp.modify(
                &init,
                QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS,
            )?;
            let rtr = QpAttr {
                qp_state: QpState::Rtr,
                path_mtu: self.mtu,
                dest_qp_num: dest,
                rq_psn: rpsn,
                max_dest_rd_atomic,
                // 0.01 ms: a receiver that runs out of receive WRs is back quickly.
                min_rnr_timer: 1,
                ah_attr: AhAttr {
                    grh: GlobalRoute {
                        dgid: remote.gid,
                        sgid_index: self.gid_index,
                        hop_limit: 64,
                        ..Default::default()
                    },
                    is_global: true,
                    port_num: 1,
                    ..Default::default()
                },
                ..Default::default()
            };
            qp.modify(
                &rtr,
                QpAttrMask::STATE
                    | QpAttrMask::AV
                    | QpAttrMask::PATH_MTU
                    | QpAttrMask::DEST_QPN
                    | QpAttrMask::RQ_PSN
                    | rtr_extra,
            )?;
            let rts = QpAttr {
                qp_state: QpState::Rts,
                sq_psn: psn,
                timeout: 14,
                retry_cnt: 7,
                rnr_retry: 7,
                max_rd_atomic: self.max_rd_atomic,
                ..Default::default()
            };
            qp.modify(&rts, QpAttrMask::STATE | QpAttrMask::SQ_PSN | rts_extra)?;
        }
        Ok(())
    }

    /// Polls the CQ into `wcs`. With a completion channel, an empty CQ is armed and the
    /// thread sleeps until the next completion event instead of returning 0.
    pub(crate) fn poll(&self, wcs: &mut [WorkCompletion]) -> Result<usize> {
        let n = self.cq.poll(wcs);
        let Some(ch) = &self.channel else { return Ok(n) };
        if n > 0 {
            return Ok(n);
        }
        self.cq.req_notify(false)?;
        // A completion may have come between the poll and the arming.
        let n = self.cq.poll(wcs);
        if n > 0 {
            return Ok(n);
        }
        // Bounded, so that callers polling for something else (a memory byte, the TCP
        // channel) get to look now and then.
        match ch.get_cq_event_timeout(Some(std::time::Duration::from_millis(1))) {
            Ok(ev) => ev.ack(),
            Err(softverbs::Error::WouldBlock) => {}
            Err(e) => return Err(e.into()),
        }
        Ok(self.cq.poll(wcs))
    }

    /// Tops the receive queue of QP `q` up to `depth` posted WRs, each taking a message of up
    /// to the largest size into `dst`.
    pub(crate) fn fill_recvs(&mut self, q: usize, depth: u32) -> Result<()> {
        let missing = depth.saturating_sub(self.recvs_posted[q]);
        if missing == 0 {
            return Ok(());
        }
        let sge = self.mr.sge(self.layout.dst..self.layout.dst + self.layout.max)?;
        // Built once and kept: every receive of a QP is the same.
        let wrs = &mut self.recv_wrs;
        for wr in wrs.iter_mut().take(missing as usize) {
            wr.wr_id = q as u64;
            wr.sg_list.clear();
            wr.sg_list.push(sge);
        }
        while wrs.len() < missing as usize {
            wrs.push(RecvWr {
                wr_id: q as u64,
                sg_list: vec![sge],
            });
        }
        self.qps[q].post_recv(&wrs[..missing as usize])?;
        self.recvs_posted[q] += missing;
        Ok(())
    }

    /// Zeroes the area the peer writes to (data and atomic words).
    pub(crate) fn clear_targets(&self, size: usize) -> Result<()> {
        self.mr.write(self.layout.dst, &vec![0u8; size])?;
        self.mr
            .write(self.layout.atomic, &vec![0u8; 8 * self.qps.len()])?;
        Ok(())
    }

    /// Puts the pattern back into byte `size - 1` of `src` (write latency's counter).
    pub(crate) fn restore_src(&self, size: usize) -> Result<()> {
        self.mr
            .write(self.layout.src + size - 1, &self.src_pattern[size - 1..size])?;
        Ok(())
    }

    /// The value of the atomic word of QP `q` (host order).
    pub(crate) fn atomic_word(&self, q: usize) -> Result<u64> {
        Ok(self.mr.read_u64(self.layout.atomic + 8 * q)?)
    }

    /// The last byte of the first `size` bytes of `dst` (write latency polls it).
    pub(crate) fn dst_last_byte(&self, size: usize) -> u8 {
        let mut b = [0u8; 1];
        // In bounds: size <= layout.max.
        let _ = self.mr.read(self.layout.dst + size - 1, &mut b);
        b[0]
    }

    /// Compares the first `size` bytes of `dst` with what the peer sends; `last` overrides
    /// the expected last byte (write latency's counter). `None` if they match.
    pub(crate) fn verify_dst(&self, size: usize, last: Option<u8>) -> Option<String> {
        let mut got = vec![0u8; size];
        if let Err(e) = self.mr.read(self.layout.dst, &mut got) {
            return Some(e.to_string());
        }
        let seed = self.side.peer().seed();
        for (i, &g) in got.iter().enumerate() {
            let want = match last {
                Some(v) if i == size - 1 => v,
                _ => pattern_byte(seed, i),
            };
            if g != want {
                return Some(format!("byte {i} of {size} is {g:#04x}, expected {want:#04x}"));
            }
        }
        None
    }

    /// The work request number `k` of QP `q` for a message of `size` bytes. `counter` replaces
    /// the last byte of the data (write latency).
    pub(crate) fn request(
        &self,
        remote: &Info,
        q: usize,
        k: u64,
        size: usize,
        signaled: bool,
        counter: Option<u8>,
    ) -> Result<SendRequest> {
        let mut wr = SendRequest {
            wr_id: 0,
            op: SendOp::Send {
                imm: None,
                invalidate: None,
            },
            flags: SendFlags::empty(),
            payload: Payload::Sges(Vec::new()),
            ud: None,
            xrc_srqn: None,
        };
        self.refill(&mut wr, remote, q, k, size, signaled, counter)?;
        Ok(wr)
    }

    /// Makes `wr` the work request [`Endpoint::request`] returns, keeping the memory its
    /// payload already has: as a tuned program (and perftest) does, the loops build their
    /// requests once, not one allocation per message.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn refill(
        &self,
        wr: &mut SendRequest,
        remote: &Info,
        q: usize,
        k: u64,
        size: usize,
        signaled: bool,
        counter: Option<u8>,
    ) -> Result<()> {
        let l = &self.layout;
        let p = &self.params;
        let mut flags = if signaled {
            SendFlags::SIGNALED
        } else {
            SendFlags::empty()
        };
        let rkey = remote.rkey;
        let data = |flags: &mut SendFlags| -> Result<Piece> {
            if size <= p.inline as usize {
                *flags |= SendFlags::INLINE;
                Ok(Piece::Inline)
            } else {
                if let Some(v) = counter {
                    self.mr.write(l.src + size - 1, &[v])?;
                }
                Ok(Piece::Sge(self.mr.sge(l.src..l.src + size)?))
            }
        };
        let (op, piece) = match p.test {
            TestKind::Send => (
                SendOp::Send {
                    imm: None,
                    invalidate: None,
                },
                data(&mut flags)?,
            ),
            TestKind::Write => {
                let remote = RemoteAddr {
                    addr: remote.addr + l.dst as u64,
                    rkey,
                };
                (SendOp::Write { remote, imm: None }, data(&mut flags)?)
            }
            TestKind::Read => {
                let remote = RemoteAddr {
                    addr: remote.addr + l.src as u64,
                    rkey,
                };
                (
                    SendOp::Read { remote },
                    Piece::Sge(self.mr.sge(l.dst..l.dst + size)?),
                )
            }
            TestKind::Atomic => {
                let remote = RemoteAddr {
                    addr: remote.addr + (l.atomic + 8 * q) as u64,
                    rkey,
                };
                let op = match p.atomic {
                    AtomicKind::FetchAdd => SendOp::FetchAdd { remote, add: 1 },
                    AtomicKind::CmpSwap => SendOp::CompareSwap {
                        remote,
                        compare: k,
                        swap: k + 1,
                    },
                };
                (
                    op,
                    Piece::Sge(self.mr.sge(l.result + 8 * q..l.result + 8 * q + 8)?),
                )
            }
        };
        wr.wr_id = wr_id(q, k);
        wr.op = op;
        wr.flags = flags;
        match (piece, &mut wr.payload) {
            (Piece::Sge(sge), Payload::Sges(list)) => {
                list.clear();
                list.push(sge);
            }
            (Piece::Sge(sge), other) => *other = Payload::Sges(vec![sge]),
            (Piece::Inline, payload) => {
                let mut bytes = match std::mem::replace(payload, Payload::Sges(Vec::new())) {
                    Payload::Inline(b) => b,
                    _ => Vec::new(),
                };
                bytes.clear();
                bytes.extend_from_slice(&self.src_pattern[..size]);
                if let Some(v) = counter {
                    bytes[size - 1] = v;
                }
                *payload = Payload::Inline(bytes);
            }
        }
        Ok(())
    }
}

/// Where a request's data is: inline (the pattern), or one SGE.
enum Piece {
    Inline,
    Sge(Sge),
}

/// Work request ids: the QP index above bit 48, the WR's number in the run below.
pub(crate) fn wr_id(q: usize, k: u64) -> u64 {
    ((q as u64) << 48) | (k & ((1 << 48) - 1))
}

/// Inverse of [`wr_id`].
pub(crate) fn split_wr_id(id: u64) -> (usize, u64) {
    ((id >> 48) as usize, id & ((1 << 48) - 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn info_round_trips() {
        let i = Info {
            gid: Gid::from(std::net::Ipv4Addr::LOCALHOST),
            addr: 0x7f00_1234_5678,
            rkey: 0xdead_beef,
            len: 1 << 20,
            mtu: 4096,
            qps: vec![(0x10011, 0xabcdef), (0x10012, 1)],
        };
        let d = Info::decode(&i.encode()).unwrap();
        assert_eq!(
            (d.gid, d.addr, d.rkey, d.len, d.mtu, d.qps.clone()),
            (i.gid, i.addr, i.rkey, i.len, i.mtu, i.qps)
        );
    }

    #[test]
    fn wr_ids_round_trip() {
        assert_eq!(split_wr_id(wr_id(3, 12345)), (3, 12345));
    }

    #[test]
    fn patterns_differ_per_side() {
        assert_ne!(pattern(Side::Client.seed(), 64), pattern(Side::Server.seed(), 64));
    }
}
