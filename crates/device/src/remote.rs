//! Payloads left in the sending process's memory (shared-memory carrier): the receiving side.
//!
//! A packet from another process of this host may carry, instead of its payload, where the
//! payload is in the sender's memory ([`RemoteRef`]). The engine handles such a packet like any
//! other; when it places the payload into a region whose memory a copy can reach
//! ([`MemoryBacking::host_addr`]), [`Deferring`] only notes the copy. The node copies everything
//! a batch noted at once ([`Pending::flush`], one `process_vm_readv` per run of contiguous
//! bytes: a whole message's packets usually merge into one), before it sends the batch's ACKs
//! and makes its completions visible. Any other access to memory through [`Deferring`] first
//! copies what is pending, so the engine never sees memory older than the packets it handled.
//!
//! A copy that fails (the sender died, or freed memory it had posted) loses data the engine
//! has already accepted, so the receiving QP fails: it sends none of the batch's packets (no
//! ACK for bytes that did not land), its completions of the batch are flushed in error and it
//! moves to the error state (`IBV_EVENT_QP_FATAL`), as after a CQ overrun.

use std::cell::RefCell;
use std::sync::Arc;

use softverbs_engine::memory::{AtomicOp, ExternalPayload, KeyRef, MemError, Memory, MwBind};
use softverbs_engine::transport::{ExternalRanges, MAX_EXTERNAL_RANGES};

use crate::mem::{KeyTable, MemoryBacking};
use crate::pd::Mr;

/// Whether other processes of this user may copy out of this one, as payloads left in memory
/// need: the kernel allows `process_vm_readv` on a dumpable process of the same user unless
/// Yama restricts tracing to descendants (`kernel.yama.ptrace_scope` >= 1, Ubuntu's default),
/// in which case a peer could not read us and payloads travel as bytes.
pub(crate) fn peers_may_read_us() -> bool {
    static ALLOWED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ALLOWED.get_or_init(|| {
        let yama = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope").ok();
        let dumpable = nix::sys::prctl::get_dumpable().unwrap_or(false);
        may_be_read(yama.as_deref(), dumpable)
    })
}

/// [`peers_may_read_us`] from the Yama setting (if Yama is there) and our dumpable flag.
fn may_be_read(yama_scope: Option<&str>, dumpable: bool) -> bool {
    dumpable && yama_scope.is_none_or(|s| s.trim() == "0")
}

/// Where a received packet's payload is: ranges of process `pid`'s memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RemoteRef {
    /// The sending process.
    pub(crate) pid: u32,
    /// The payload's ranges there.
    pub(crate) ranges: ExternalRanges,
}

impl RemoteRef {
    /// The pieces `offset..offset + len` of the payload, as (address, length) in the sender.
    fn pieces(&self, mut offset: u64, mut len: u64, out: &mut Pieces) {
        for &(addr, l) in self.ranges.ranges() {
            let l = u64::from(l);
            if len == 0 {
                break;
            }
            if offset >= l {
                offset -= l;
                continue;
            }
            let take = (l - offset).min(len);
            out.push((addr + offset, take as usize));
            len -= take;
            offset = 0;
        }
    }

    /// Whether the ranges add up to a payload of `len` bytes.
    pub(crate) fn is_consistent(&self) -> bool {
        let sum: u64 = self.ranges.ranges().iter().map(|r| u64::from(r.1)).sum();
        sum == u64::from(self.ranges.len)
    }
}

/// Up to [`MAX_EXTERNAL_RANGES`] (address, length) pieces, without allocating.
#[derive(Debug, Default)]
struct Pieces {
    items: [(u64, usize); MAX_EXTERNAL_RANGES],
    len: usize,
}

impl Pieces {
    fn push(&mut self, piece: (u64, usize)) {
        self.items[self.len] = piece;
        self.len += 1;
    }

    fn as_slice(&self) -> &[(u64, usize)] {
        &self.items[..self.len]
    }
}

/// One received payload, as the engine sees it.
#[derive(Debug)]
pub(crate) struct RemotePayload {
    pub(crate) at: RemoteRef,
    /// The receiving QP (a failed copy fails it).
    pub(crate) qpn: u32,
}

impl ExternalPayload for RemotePayload {
    fn len(&self) -> u64 {
        u64::from(self.at.ranges.len)
    }

    fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), MemError> {
        let mut pieces = Pieces::default();
        self.at.pieces(offset, dst.len() as u64, &mut pieces);
        softverbs_shm::read_from_process(self.at.pid as i32, dst, pieces.as_slice())
            .map_err(|_| MemError::Unmapped)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// A copy noted for later.
#[derive(Debug)]
struct CopyOp {
    qpn: u32,
    mr: Arc<Mr>,
    backing: Arc<dyn MemoryBacking>,
    /// Destination offset in `backing`.
    offset: u64,
    len: u64,
    pid: u32,
    /// Source pieces in the sender, in order.
    remote: Vec<(u64, usize)>,
}

/// Where a noted copy goes and comes from.
struct CopyTo<'a> {
    qpn: u32,
    mr: &'a Arc<Mr>,
    backing: &'a Arc<dyn MemoryBacking>,
    offset: u64,
    len: u64,
    pid: u32,
    remote: &'a [(u64, usize)],
}

impl CopyOp {
    /// Appends `next` if it continues this copy on both sides.
    fn merge(&mut self, next: &CopyTo<'_>) -> bool {
        let contiguous_here = Arc::ptr_eq(&self.mr, next.mr)
            && Arc::ptr_eq(&self.backing, next.backing)
            && self.offset + self.len == next.offset;
        if self.qpn != next.qpn || self.pid != next.pid || !contiguous_here || self.remote.len() >= 1000 {
            return false;
        }
        for &(a, l) in next.remote {
            match self.remote.last_mut() {
                Some(last) if last.0 + last.1 as u64 == a => last.1 += l,
                _ => self.remote.push((a, l)),
            }
        }
        self.len += next.len;
        true
    }
}

/// The copies a batch of packets noted, and the QPs whose copies failed.
#[derive(Debug, Default)]
pub(crate) struct Pending {
    ops: RefCell<Vec<CopyOp>>,
    /// The region the last copy went to, by the key that named it and whether that was its
    /// rkey (a region's key, not a window's): the next packet of a message names it again.
    last_region: RefCell<Option<(u32, bool, Arc<Mr>)>>,
    failed: RefCell<Vec<u32>>,
    /// Copies (and failures) made early, before another access to memory.
    settled: std::cell::Cell<u64>,
    settled_failures: std::cell::Cell<u64>,
}

impl Pending {
    fn note(&self, to: &CopyTo<'_>) {
        let mut ops = self.ops.borrow_mut();
        if let Some(last) = ops.last_mut() {
            if last.merge(to) {
                return;
            }
        }
        ops.push(CopyOp {
            qpn: to.qpn,
            mr: to.mr.clone(),
            backing: to.backing.clone(),
            offset: to.offset,
            len: to.len,
            pid: to.pid,
            remote: to.remote.to_vec(),
        });
    }

    /// Does every noted copy. A region deregistered (or given other memory) since, or a
    /// source that cannot be read, fails the copy and its QP ([`Pending::take_failed`]).
    ///
    /// Returns how many copies were made since the last call and how many of them failed.
    pub(crate) fn flush(&self) -> (u64, u64) {
        let (done, failures) = self.copy_all();
        (
            done + self.settled.take(),
            failures + self.settled_failures.take(),
        )
    }

    fn copy_all(&self) -> (u64, u64) {
        let ops = std::mem::take(&mut *self.ops.borrow_mut());
        let (mut done, mut failures) = (0, 0);
        for op in ops {
            // Under the region's mapping lock, which deregistration waits for.
            let map = op.mr.mapping().read();
            let ok = op.mr.is_registered()
                && Arc::ptr_eq(&map.backing, &op.backing)
                && op
                    .backing
                    .copy_from_process(op.offset, op.len, op.pid as i32, &op.remote)
                    .is_ok();
            drop(map);
            done += 1;
            if !ok {
                failures += 1;
                tracing::warn!(
                    qpn = op.qpn,
                    pid = op.pid,
                    len = op.len,
                    "payload copy from the sender failed"
                );
                let mut failed = self.failed.borrow_mut();
                if !failed.contains(&op.qpn) {
                    failed.push(op.qpn);
                }
            }
        }
        (done, failures)
    }

    /// Whether copies wait.
    pub(crate) fn is_empty(&self) -> bool {
        self.ops.borrow().is_empty()
    }

    /// QPs whose copies failed since the last call.
    pub(crate) fn take_failed(&self) -> Vec<u32> {
        std::mem::take(&mut *self.failed.borrow_mut())
    }

    fn settle(&self) {
        if !self.is_empty() {
            let (done, failures) = self.copy_all();
            self.settled.set(self.settled.get() + done);
            self.settled_failures.set(self.settled_failures.get() + failures);
        }
    }
}

/// The memory a QP's engine uses while it handles received packets: `mem`, with payloads from
/// other processes copied late (see the module).
pub(crate) struct Deferring<'a> {
    /// What the engine would use otherwise (the key table, or the XRC relay's view).
    pub(crate) mem: &'a dyn Memory,
    /// This process's key table.
    pub(crate) keys: &'a KeyTable,
    pub(crate) pending: &'a Pending,
}

impl Deferring<'_> {
    /// [`KeyTable::place_for_copy`], skipping the key lookup when the key names the region
    /// the previous copy went to.
    fn place(&self, key: KeyRef, addr: u64, len: u64) -> Result<crate::mem::CopyPlace, MemError> {
        let remote = key.access.is_remote();
        let cached = self
            .pending
            .last_region
            .borrow()
            .as_ref()
            .filter(|(k, r, _)| *k == key.key && *r == remote)
            .map(|(_, _, mr)| mr.clone());
        if let Some(mr) = cached {
            if mr.is_registered() {
                let (backing, offset) = self.keys.place_in(&mr, key, addr, len)?;
                return Ok((mr, backing, offset));
            }
        }
        let place = self.keys.place_for_copy(key, addr, len)?;
        let region_key = if remote { place.0.rkey() } else { place.0.lkey() };
        if region_key == key.key {
            *self.pending.last_region.borrow_mut() = Some((key.key, remote, place.0.clone()));
        }
        Ok(place)
    }
}

impl Memory for Deferring<'_> {
    fn read(&self, key: KeyRef, addr: u64, dst: &mut [u8]) -> Result<(), MemError> {
        self.pending.settle();
        self.mem.read(key, addr, dst)
    }

    fn write(&self, key: KeyRef, addr: u64, src: &[u8]) -> Result<(), MemError> {
        self.pending.settle();
        self.mem.write(key, addr, src)
    }

    fn check(&self, key: KeyRef, addr: u64, len: u64) -> Result<(), MemError> {
        self.mem.check(key, addr, len)
    }

    fn atomic(&self, key: KeyRef, addr: u64, op: AtomicOp) -> Result<u64, MemError> {
        self.pending.settle();
        self.mem.atomic(key, addr, op)
    }

    fn bind_mw(&self, qpn: u32, pd: u32, bind: &MwBind) -> Result<(), MemError> {
        self.pending.settle();
        self.mem.bind_mw(qpn, pd, bind)
    }

    fn invalidate(&self, qpn: u32, pd: u32, rkey: u32) -> Result<(), MemError> {
        self.pending.settle();
        self.mem.invalidate(qpn, pd, rkey)
    }

    fn flush(&self, key: KeyRef, addr: u64, len: u64, whole_region: bool) -> Result<(), MemError> {
        self.pending.settle();
        self.mem.flush(key, addr, len, whole_region)
    }

    fn locate(&self, key: KeyRef, addr: u64, len: u64) -> Result<Option<u64>, MemError> {
        self.mem.locate(key, addr, len)
    }

    fn write_external(
        &self,
        key: KeyRef,
        addr: u64,
        src: &dyn ExternalPayload,
        offset: u64,
        len: u64,
    ) -> Result<(), MemError> {
        if let Some(p) = src.as_any().downcast_ref::<RemotePayload>() {
            // A region of this process that a copy can fill: note the copy.
            if let Ok((mr, backing, at)) = self.place(key, addr, len) {
                if backing.host_addr().is_some() {
                    let mut remote = Pieces::default();
                    p.at.pieces(offset, len, &mut remote);
                    self.pending.note(&CopyTo {
                        qpn: p.qpn,
                        mr: &mr,
                        backing: &backing,
                        offset: at,
                        len,
                        pid: p.at.pid,
                        remote: remote.as_slice(),
                    });
                    return Ok(());
                }
            }
        }
        // Anything else (another process's SRQ through the XRC relay, memory without a host
        // address, a key that fails its checks) goes the ordinary way, with its errors.
        self.pending.settle();
        self.mem.write_external(key, addr, src, offset, len)
    }
}

/// The whole packet for `data` (sent with an empty payload) and its payload at `ext` in this
/// process's memory: for a carrier that needs the bytes. `None` if the memory cannot be read
/// (the packet is then lost, as on a network; the requester resends).
pub(crate) fn materialize(data: &[u8], ext: &ExternalRanges) -> Option<Vec<u8>> {
    materialize_from(std::process::id(), data, ext)
}

/// [`materialize`] with the payload in process `pid` (a packet received with its payload left
/// in its sender, for a packet capture).
pub(crate) fn materialize_from(pid: u32, data: &[u8], ext: &ExternalRanges) -> Option<Vec<u8>> {
    let parsed = softverbs_wire::RocePacket::parse(data).ok()?;
    let mut repr = parsed.repr;
    repr.payload_len = ext.len as usize;
    repr.bth.pad_count = softverbs_wire::pad_count_for(repr.payload_len);
    let mut out = vec![0u8; repr.buffer_len()];
    repr.emit(&mut out).ok()?;
    let pieces: Vec<(u64, usize)> = ext.ranges().iter().map(|&(a, l)| (a, l as usize)).collect();
    let payload = repr.payload_mut(&mut out).ok()?;
    softverbs_shm::read_from_process(pid as i32, payload, &pieces).ok()?;
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::context::Context;
    use crate::mem::AtomicBuffer;
    use crate::pd::Pd;
    use softverbs_engine::memory::Access;

    /// IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE.
    const WRITABLE: u32 = 1 | 2;

    fn region(len: usize) -> (Arc<Context>, Arc<Mr>, Arc<AtomicBuffer>) {
        let cfg = Config {
            interfaces: Some(vec!["lo".into()]),
            ..Config::default()
        };
        let dev = crate::device::discover(&cfg).unwrap().remove(0);
        let ctx = Context::open(&dev).unwrap();
        let pd = Pd::alloc(&ctx).unwrap();
        let buf = Arc::new(AtomicBuffer::new(len));
        let mr = Mr::register(&pd, buf.clone(), buf.addr(), WRITABLE).unwrap();
        (ctx, mr, buf)
    }

    /// The memory a QP's engine would use on `ctx`'s device, noting copies in `pending`.
    fn deferring<'a>(ctx: &'a Context, pending: &'a Pending) -> Deferring<'a> {
        let keys = &ctx.device().node().keys;
        Deferring {
            mem: keys,
            keys,
            pending,
        }
    }

    fn key(mr: &Mr) -> KeyRef {
        KeyRef {
            key: mr.rkey(),
            pd: mr.pd().handle(),
            qpn: 0x11,
            access: Access::RemoteWrite,
        }
    }

    fn source(pid: u32, src: &[u8]) -> RemotePayload {
        let mut ranges = ExternalRanges::default();
        // Two pieces, to exercise the gather.
        let half = src.len() / 2;
        assert!(ranges.push(src.as_ptr() as u64, half as u32));
        assert!(ranges.push(
            src.as_ptr() as u64 + half as u64 + 1,
            (src.len() - half - 1) as u32
        ));
        RemotePayload {
            at: RemoteRef { pid, ranges },
            qpn: 0x11,
        }
    }

    #[test]
    fn payloads_stay_in_memory_only_where_peers_may_read_them() {
        assert!(may_be_read(None, true), "no Yama: the same user may read us");
        assert!(may_be_read(Some("0\n"), true));
        assert!(!may_be_read(Some("1\n"), true), "descendants only");
        assert!(!may_be_read(Some("3"), true));
        assert!(!may_be_read(None, false), "a non-dumpable process cannot be read");
    }

    #[test]
    fn copies_wait_for_the_flush_and_merge() {
        let (ctx, mr, buf) = region(8192);
        let pending = Pending::default();
        let mem = deferring(&ctx, &pending);
        let src: Vec<u8> = (0..4097u32).map(|i| (i % 251) as u8).collect();
        let p = source(std::process::id(), &src);
        // Two packets' worth that continue each other: one copy.
        let first = 1000;
        mem.write_external(key(&mr), buf.addr() + 10, &p, 0, first)
            .unwrap();
        mem.write_external(key(&mr), buf.addr() + 10 + first, &p, first, p.len() - first)
            .unwrap();
        assert!(
            buf.to_vec().iter().all(|&b| b == 0),
            "nothing copied before the flush"
        );
        assert_eq!(pending.flush(), (1, 0));
        let mut expect = src[..2048].to_vec();
        expect.extend_from_slice(&src[2049..]);
        assert_eq!(&buf.to_vec()[10..10 + expect.len()], &expect[..]);
        assert!(pending.take_failed().is_empty());
    }

    #[test]
    fn another_access_copies_what_is_pending_first() {
        let (ctx, mr, buf) = region(4096);
        let pending = Pending::default();
        let mem = deferring(&ctx, &pending);
        let src = vec![0xABu8; 2001];
        let p = source(std::process::id(), &src);
        mem.write_external(key(&mr), buf.addr(), &p, 0, p.len()).unwrap();
        let mut got = [0u8; 8];
        let read_key = KeyRef {
            access: Access::LocalRead,
            key: mr.lkey(),
            ..key(&mr)
        };
        mem.read(read_key, buf.addr(), &mut got).unwrap();
        assert_eq!(got, [0xAB; 8], "the read sees the copied payload");
        assert_eq!(pending.flush(), (1, 0), "counted once, by the flush");
    }

    #[test]
    fn a_local_key_never_serves_a_remote_access() {
        let (ctx, mr, buf) = region(4096);
        let pending = Pending::default();
        let mem = deferring(&ctx, &pending);
        let src = vec![5u8; 2001];
        let p = source(std::process::id(), &src);
        let local = KeyRef {
            key: mr.lkey(),
            access: Access::LocalWrite,
            ..key(&mr)
        };
        mem.write_external(local, buf.addr(), &p, 0, p.len()).unwrap();
        // The same key value, now as an rkey: not the region's rkey, so refused.
        let forged = KeyRef {
            key: mr.lkey(),
            ..key(&mr)
        };
        assert_eq!(
            mem.write_external(forged, buf.addr(), &p, 0, p.len()),
            Err(MemError::BadKey)
        );
        assert_eq!(pending.flush(), (1, 0), "only the local copy");
    }

    /// A dead process's pid.
    fn dead_pid() -> u32 {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        pid
    }

    #[test]
    fn a_failed_copy_fails_the_receive_and_the_qp() {
        use crate::cq::Cq;
        use crate::qp::{Qp, QpInitAttr};
        use softverbs_engine::types::{
            AhAttr, EventType, GlobalRoute, Mtu, QpAttr, QpAttrMask, QpCap, QpState, QpType, RecvWr, Sge,
            WcStatus, WorkCompletion,
        };
        use softverbs_wire::{BthRepr, Opcode, PacketRepr, Psn};

        let (ctx, mr, buf) = region(8192);
        let cq = Cq::create(&ctx, 8, None, 0).unwrap();
        let qp = Qp::create(
            &mr.pd(),
            &QpInitAttr {
                qp_type: QpType::Rc,
                send_cq: Some(cq.clone()),
                recv_cq: Some(cq.clone()),
                srq: None,
                cap: QpCap {
                    max_send_wr: 4,
                    max_recv_wr: 4,
                    max_send_sge: 1,
                    max_recv_sge: 1,
                    max_inline_data: 0,
                },
                sq_sig_all: false,
                max_tso_header: 0,
            },
        )
        .unwrap();
        let gids = ctx.device().gid_table();
        let sgid = gids.iter().position(|g| !g.is_zero()).unwrap();
        let init = QpAttr {
            qp_state: QpState::Init,
            port_num: 1,
            qp_access_flags: softverbs_engine::types::AccessFlags::REMOTE_WRITE,
            ..QpAttr::default()
        };
        qp.modify(
            &init,
            QpAttrMask::STATE | QpAttrMask::PORT | QpAttrMask::PKEY_INDEX | QpAttrMask::ACCESS_FLAGS,
        )
        .unwrap();
        let rtr = QpAttr {
            qp_state: QpState::Rtr,
            path_mtu: Mtu::Mtu4096,
            dest_qp_num: 0x99,
            rq_psn: 0,
            ah_attr: AhAttr {
                grh: GlobalRoute {
                    dgid: gids[sgid],
                    sgid_index: sgid as u8,
                    hop_limit: 64,
                    ..Default::default()
                },
                is_global: true,
                port_num: 1,
                ..Default::default()
            },
            ..QpAttr::default()
        };
        qp.modify(
            &rtr,
            QpAttrMask::STATE
                | QpAttrMask::AV
                | QpAttrMask::PATH_MTU
                | QpAttrMask::DEST_QPN
                | QpAttrMask::RQ_PSN
                | QpAttrMask::MAX_DEST_RD_ATOMIC
                | QpAttrMask::MIN_RNR_TIMER,
        )
        .unwrap();
        qp.post_recv(&[RecvWr {
            wr_id: 77,
            sg_list: vec![Sge {
                addr: buf.addr(),
                length: 4096,
                lkey: mr.lkey(),
            }],
        }])
        .unwrap();
        // A SEND ONLY whose 3,000 bytes are said to be in a process that is gone.
        let mut bth = BthRepr::new(Opcode::RcSendOnly, qp.qpn(), Psn::new(0));
        // Asks for an ACK, which must not be sent.
        bth.ack_req = true;
        let repr = PacketRepr::new(bth, 0);
        let mut data = vec![0u8; repr.buffer_len()];
        repr.emit(&mut data).unwrap();
        let mut ranges = ExternalRanges::default();
        assert!(ranges.push(0x10_0000, 3000));
        let node = ctx.device().node();
        let meta = softverbs_engine::transport::RxMeta {
            sgid: gids[sgid],
            dgid: gids[sgid],
            traffic_class: 0,
            hop_limit: 64,
        };
        let sent_before = ctx.device().counters().tx_packets;
        node.inject(
            &data,
            meta,
            Some(RemoteRef {
                pid: dead_pid(),
                ranges,
            }),
        );
        let fabric = node.fabric().clone();
        fabric.drive(fabric.now());
        let mut wc = [WorkCompletion::default(); 4];
        let n = cq.poll(&mut wc);
        assert_eq!(n, 1, "{:?}", &wc[..n]);
        assert_eq!((wc[0].wr_id, wc[0].status), (77, WcStatus::WrFlushErr));
        assert_eq!(qp.query().qp_state, QpState::Err);
        // The first packet in RTR establishes communication; then the QP fails.
        let events: Vec<EventType> = (0..2)
            .map(|_| {
                ctx.get_async_event(Some(std::time::Duration::from_secs(5)))
                    .unwrap()
                    .event_type
            })
            .collect();
        assert_eq!(events, [EventType::CommEst, EventType::QpFatal]);
        let c = ctx.device().counters();
        assert_eq!((c.rx_payload_copies, c.rx_payload_copy_failures), (1, 1));
        assert_eq!(c.tx_packets, sent_before, "no ACK for bytes that did not land");
        assert!(buf.to_vec().iter().all(|&b| b == 0), "nothing was placed");
    }

    #[test]
    fn a_copy_from_a_dead_process_or_into_a_deregistered_region_fails_the_qp() {
        let (ctx, mr, buf) = region(4096);
        let pending = Pending::default();
        let mem = deferring(&ctx, &pending);
        let src = vec![1u8; 3001];
        let p = source(dead_pid(), &src);
        mem.write_external(key(&mr), buf.addr(), &p, 0, p.len()).unwrap();
        assert_eq!(pending.flush(), (1, 1));
        assert_eq!(pending.take_failed(), vec![0x11]);
        // Noted, then the region is deregistered before the flush: nothing lands in it.
        let p = source(std::process::id(), &src);
        mem.write_external(key(&mr), buf.addr(), &p, 0, p.len()).unwrap();
        mr.dereg().unwrap();
        assert_eq!(pending.flush(), (1, 1));
        assert!(
            buf.to_vec().iter().all(|&b| b == 0),
            "the deregistered region is untouched"
        );
    }
}
