//! The requester: turns send WQEs into request packets, segmented at the path MTU.

use softverbs_wire::{
    AtomicEthRepr, BthRepr, DethRepr, FethRepr, IethRepr, ImmDtRepr, Opcode, PacketRepr, Position, Psn,
    RethRepr, Transport, XrcEthRepr,
};

use super::external::{build_external, locate_gather, EXTERNAL_MIN_MESSAGE, EXTERNAL_MIN_PACKET};
use super::recovery::Recovery;
use super::{ack_timeout, Dest, QpEngine, Transmit, WorkQueue, ACK_REQ_EVERY};
use crate::memory::{Access, KeyRef, MemError, Memory};
use crate::time::Instant;
use crate::types::{QpState, QpType, SendFlags, WcStatus, WorkCompletion};
use crate::wr::{FlushSelect, Payload, SendOp};

/// Requester and completer state of a QP.
#[derive(Debug, Default)]
pub(crate) struct Requester {
    /// PSN for the next WQE started.
    pub(crate) next_psn: Psn,
    /// Index in the send queue of the WQE being sent.
    pub(crate) send_idx: usize,
    /// Oldest PSN not yet acknowledged.
    pub(crate) unacked: Psn,
    /// READ/atomic WQEs started and not completed.
    pub(crate) outstanding_rd: u32,
    pub(crate) retry_cnt: u8,
    pub(crate) retry_left: u8,
    pub(crate) rnr_retry: u8,
    pub(crate) rnr_left: u8,
    /// Packets sent since the last one with AckReq.
    pub(crate) since_ackreq: u32,
    pub(crate) retransmit_at: Option<Instant>,
    /// Waiting out an RNR NAK until then.
    pub(crate) rnr_until: Option<Instant>,
    /// PSN to resume at when the RNR wait ends.
    pub(crate) rnr_psn: Psn,
    pub(crate) drain_notify: bool,
    /// One past the highest PSN ever sent, to tell retransmissions apart.
    pub(crate) sent_high: Psn,
    /// One past the highest PSN a response may carry: every request packet sent, and all the
    /// PSNs of a READ whose request was sent (its responses use them). A response beyond it
    /// answers nothing this QP sent (a stale or forged one) and must not move the window.
    pub(crate) resp_high: Psn,
    /// The PSN the last retry went back to, until progress is made. A second trigger for the
    /// same PSN (a duplicated NAK, more responses past the same hole) is then ignored instead of
    /// spending the retry budget and resending again.
    pub(crate) retry_psn: Option<Psn>,
    /// The highest PSN an ACK or NAK acknowledged (the responder executed everything up to it).
    pub(crate) acked_psn: Option<Psn>,
    /// Number of WQEs with `rereq` set (so the common case skips looking for them).
    pub(crate) rereq_pending: u32,
    /// Round-trip estimate, retransmission timer and congestion window.
    pub(crate) rec: Recovery,
    /// A SEND or WRITE packet to resend on its own before anything else: the go-back-N under
    /// way resends from it, and a new NAK for it says that resend was lost too.
    pub(crate) resend_hole: Option<Psn>,
    /// When to resend the hole of a NAKed go-back-N again if it still has not arrived (the
    /// NAK proved a loss, so this timer runs at the round trip's pace).
    pub(crate) hole_at: Option<Instant>,
    /// Resends of the hole since the last progress (each doubles the wait).
    pub(crate) hole_attempt: u32,
    /// When to probe the tail of the flight: resend its last packet, asking for an
    /// acknowledgement, if nothing was acknowledged by then (see `recovery::probe_timeout`).
    pub(crate) probe_at: Option<Instant>,
    /// The packet to send as that probe, once it is due.
    pub(crate) probe: Option<Psn>,
    /// Probes sent since the last progress (each doubles the wait for the next one).
    pub(crate) probe_attempt: u32,
    /// A sequence NAK that may answer a probe, and when to act on it: a probe sent from one
    /// core can overtake packets another core queued earlier (the kernel's per-CPU backlogs),
    /// so its NAK waits a round trip for an acknowledgement past the hole before the go-back-N.
    pub(crate) probe_nak: Option<(Psn, Instant)>,
}

impl Requester {
    pub(crate) fn reset(&mut self, sq_psn: Psn, retry_cnt: u8, rnr_retry: u8) {
        let adaptive = self.rec.adaptive;
        *self = Self {
            next_psn: sq_psn,
            unacked: sq_psn,
            sent_high: sq_psn,
            resp_high: sq_psn,
            retry_cnt,
            retry_left: retry_cnt,
            rnr_retry,
            rnr_left: rnr_retry,
            ..Self::default()
        };
        self.rec.adaptive = adaptive;
    }

    /// New retry budgets (SQD->RTS); the remaining counts restart from them.
    pub(crate) fn set_budgets(&mut self, retry_cnt: u8, rnr_retry: u8) {
        self.retry_cnt = retry_cnt;
        self.retry_left = retry_cnt;
        self.rnr_retry = rnr_retry;
        self.rnr_left = rnr_retry;
    }
}

/// Number of packets (or PSNs) a message of `len` bytes takes at `mtu`.
pub(crate) fn packets(len: u64, mtu: u32) -> u32 {
    u32::try_from(len.div_ceil(u64::from(mtu)).max(1)).unwrap_or(u32::MAX)
}

/// Copies `dst.len()` bytes starting `offset` bytes into the gather list.
pub(crate) fn gather(
    mem: &dyn Memory,
    (pd, qpn): (u32, u32),
    payload: &Payload,
    offset: u64,
    dst: &mut [u8],
) -> Result<(), MemError> {
    if dst.is_empty() {
        // Nothing to copy (a zero-length message, or a READ/atomic request): touch no key.
        return Ok(());
    }
    match payload {
        Payload::Inline(b) => {
            let start = offset as usize;
            dst.copy_from_slice(&b[start..start + dst.len()]);
            Ok(())
        }
        Payload::Headed { header, sges } => {
            // The header, then the gather list, as one byte stream.
            let start = (offset as usize).min(header.len());
            let n = (header.len() - start).min(dst.len());
            dst[..n].copy_from_slice(&header[start..start + n]);
            let rest = offset.saturating_sub(header.len() as u64);
            gather(mem, (pd, qpn), &Payload::Sges(sges.clone()), rest, &mut dst[n..])
        }
        Payload::Sges(sges) => {
            let mut skip = offset;
            let mut done = 0;
            for sge in sges {
                let len = u64::from(sge.length);
                if skip >= len {
                    skip -= len;
                    continue;
                }
                let take = ((len - skip) as usize).min(dst.len() - done);
                let key = KeyRef {
                    key: sge.lkey,
                    pd,
                    qpn,
                    access: Access::LocalRead,
                };
                mem.read(key, sge.addr + skip, &mut dst[done..done + take])?;
                done += take;
                skip = 0;
                if done == dst.len() {
                    break;
                }
            }
            // The message's length is its gather list's, so nothing is left; were anything,
            // it must not carry what the buffer held before (buffers are reused unzeroed).
            dst[done..].fill(0);
            Ok(())
        }
    }
}

/// Builds a packet: headers from `repr`, payload filled by `fill`.
pub(crate) fn build(
    repr: &PacketRepr,
    dest: Dest,
    fill: impl FnOnce(&mut [u8]) -> Result<(), MemError>,
) -> Result<Transmit, MemError> {
    let mut data = super::buffers::take(repr.buffer_len());
    // The repr is built by the engine from its own table; emitting it cannot fail.
    repr.emit(&mut data).expect("engine-built packet");
    fill(repr.payload_mut(&mut data).expect("engine-built packet"))?;
    Ok(Transmit {
        dest,
        data,
        external: None,
    })
}

impl QpEngine {
    pub(crate) fn path_dest(&self) -> Dest {
        let ah = &self.attr.ah_attr;
        Dest {
            dgid: ah.grh.dgid,
            sgid_index: ah.grh.sgid_index,
            traffic_class: ah.grh.traffic_class,
            hop_limit: ah.grh.hop_limit,
            flow_label: ah.grh.flow_label,
        }
    }

    /// Starts the retransmission timer: the measured timeout (see `recovery`), bounded by
    /// the configured one; none if the configured timeout is 0 (infinite).
    pub(crate) fn arm_retransmit(&mut self, now: Instant) {
        let rto = ack_timeout(self.attr.timeout).map(|c| self.req.rec.rto(c));
        self.req.retransmit_at = rto.map(|rto| now + rto);
        // Well before the timer, one packet asks whether the flight arrived: a lost ACK or a
        // lost tail of the window otherwise idles the link until the timer fires.
        if self.req.probe_attempt == 0 {
            self.arm_probe(now);
        }
    }

    /// Starts the wait for the next tail probe: the probe timeout, doubled per probe already
    /// sent in this stall; none once that would reach the retransmission timer.
    pub(crate) fn arm_probe(&mut self, now: Instant) {
        let attempt = self.req.probe_attempt.min(16);
        self.req.probe_at = self
            .req
            .rec
            .probe_timeout()
            .map(|p| now + p.saturating_mul(1 << attempt))
            .filter(|at| self.req.retransmit_at.is_some_and(|r| *at < r));
    }

    /// Nothing may be sent now, yet requests wait for an answer: make sure a timer will look
    /// at them. A go-back-N (or the end of an RNR wait) stops the retransmission timer and
    /// counts on the resent packets to start it again; when the window forbids sending them
    /// (it is held back by a READ in front whose responses were asked for again and lost), no
    /// packet, no answer and no timer would come, and the QP would wait forever. The expiry
    /// then asks for the missing responses (see `handle_timeout`).
    fn arm_if_stuck(&mut self, now: Instant) {
        if self.cfg.qp_type.is_reliable()
            && self.req.retransmit_at.is_none()
            && self.req.rnr_until.is_none()
            && matches!(self.state, QpState::Rts | QpState::Sqd)
            && self.has_outstanding()
        {
            self.arm_retransmit(now);
        }
    }

    /// Starts the wait after which the hole of the NAKed go-back-N under way is resent again.
    pub(crate) fn arm_hole(&mut self, now: Instant) {
        let rto = ack_timeout(self.attr.timeout).map(|c| self.req.rec.rto(c));
        self.req.hole_at = rto
            .and_then(|rto| self.req.rec.hole_timeout(self.req.hole_attempt, rto))
            .map(|t| now + t);
    }

    pub(crate) fn mtu(&self) -> u32 {
        self.attr.path_mtu.bytes()
    }

    fn transport(&self) -> Transport {
        match self.cfg.qp_type {
            QpType::Rc => Transport::Rc,
            QpType::Uc => Transport::Uc,
            // Raw QPs build no transport headers (see `generate_raw`).
            QpType::Ud | QpType::RawPacket => Transport::Ud,
            QpType::XrcSend | QpType::XrcRecv => Transport::Xrc,
        }
    }

    /// The response opcode of this QP's transport for an RC one (XRC targets answer with the
    /// XRC twins).
    pub(crate) fn response_opcode(&self, rc: Opcode) -> Opcode {
        rc.on_transport(self.transport()).unwrap_or(rc)
    }

    /// Index of the WQE the requester sends from next: `send_idx`, skipping WQEs that need no
    /// packet (a READ or atomic whose response already arrived while an earlier WQE was being
    /// retried).
    pub(crate) fn next_send_index(&self) -> usize {
        let mut idx = self.req.send_idx;
        while self.sq.get(idx).is_some_and(|w| w.fully_sent()) {
            idx += 1;
        }
        idx
    }

    /// Whether the requester has a packet it may send now.
    pub(crate) fn can_start_or_continue(&self) -> bool {
        if self.req.rnr_until.is_some() {
            return false;
        }
        let idx = self.next_send_index();
        let Some(w) = self.sq.get(idx) else { return false };
        match self.state {
            QpState::Rts => {}
            // SQD finishes the message in progress but starts no new one.
            QpState::Sqd if w.started => {}
            _ => return false,
        }
        if !self.cfg.qp_type.is_reliable() {
            return true;
        }
        if w.started {
            let psn = self.wqe_packet_psn(idx);
            return self.req.unacked.distance(psn) < self.req.rec.window();
        }
        if w.wr.flags.contains(SendFlags::FENCE) && self.req.outstanding_rd > 0 {
            return false;
        }
        if w.wr.op.is_read_or_atomic() && self.req.outstanding_rd >= u32::from(self.attr.max_rd_atomic.max(1))
        {
            return false;
        }
        self.req.unacked.distance(self.req.next_psn) < self.req.rec.window()
    }

    /// PSN of the next request packet of WQE `idx`.
    fn wqe_packet_psn(&self, idx: usize) -> Psn {
        let w = &self.sq[idx];
        if w.wr.op.is_read_or_atomic() {
            // A READ resumed part-way starts at its first missing response.
            w.resume_psn()
        } else {
            w.first_psn + w.next_pkt
        }
    }

    /// A READ or atomic before the send position whose responses are to be asked for again.
    fn pending_rerequest(&self) -> Option<usize> {
        if self.req.rereq_pending == 0
            || self.req.rnr_until.is_some()
            || !matches!(self.state, QpState::Rts | QpState::Sqd)
        {
            return None;
        }
        let end = self.next_send_index().min(self.sq.len());
        self.sq.range(..end).position(|w| w.rereq && w.outstanding())
    }

    /// Generates at most one request packet into `out`.
    pub(crate) fn generate(&mut self, now: Instant, mem: &dyn Memory) {
        if self.cfg.qp_type == QpType::RawPacket {
            return self.generate_raw(now, mem);
        }
        // A hole to resend on its own (see `resend_hole`): the packet at that PSN, with the
        // pass's position kept.
        let probing = self.req.resend_hole.is_none() && self.req.probe.is_some();
        let single = self
            .req
            .resend_hole
            .take()
            .or_else(|| self.req.probe.take())
            .and_then(|psn| {
                let idx = self.wqe_index_of(psn)?;
                let w = &mut self.sq[idx];
                let saved = w.next_pkt;
                w.next_pkt = w.first_psn.distance(psn);
                Some((idx, saved))
            });
        let (idx, rerequest) = match (single, self.pending_rerequest()) {
            (Some((idx, _)), _) => (idx, true),
            (None, Some(idx)) => (idx, true),
            (None, None) if self.can_start_or_continue() => (self.next_send_index(), false),
            (None, None) => {
                self.arm_if_stuck(now);
                return;
            }
        };
        let mtu = if self.cfg.qp_type == QpType::Ud {
            u32::MAX
        } else {
            self.mtu()
        };
        if !rerequest && self.sq[idx].wr.op.is_local() {
            self.execute_local(idx, mem);
            return;
        }
        if single.is_some() {
        } else if rerequest {
            self.sq[idx].rereq = false;
            self.req.rereq_pending -= 1;
        } else {
            self.req.send_idx = idx;
            let w = &mut self.sq[idx];
            if !w.started {
                w.started = true;
                w.npsn = if self.cfg.qp_type == QpType::Ud || w.wr.op.is_atomic() {
                    1
                } else {
                    packets(w.len, mtu)
                };
                w.first_psn = self.req.next_psn;
                self.req.next_psn += w.npsn;
                if w.wr.op.is_read_or_atomic() {
                    self.req.outstanding_rd += 1;
                }
            }
            // A full pass over a READ asks for every response still missing.
            w.req_end = w.npsn;
        }
        let psn = self.wqe_packet_psn(idx);
        let resent = psn.is_before(self.req.sent_high);
        if probing {
            // A copy of the newest packet, only to draw an answer: not a retransmission.
            self.counters.tail_probes += 1;
        } else if resent {
            self.counters.retransmits += 1;
            self.req.rec.on_resend(psn);
        } else {
            self.req.sent_high = psn + 1;
        }
        let w = &self.sq[idx];
        let resp_end = if w.wr.op.is_read_or_atomic() {
            w.first_psn + w.npsn
        } else {
            psn + 1
        };
        if resp_end.is_after(self.req.resp_high) {
            self.req.resp_high = resp_end;
        }
        let pkt_index = w.next_pkt;
        let total = w.request_packets();
        let position = match (
            pkt_index == 0 || w.wr.op.is_read_or_atomic(),
            pkt_index + 1 >= total,
        ) {
            (true, true) => Position::Only,
            (true, false) => Position::First,
            (false, true) => Position::Last,
            (false, false) => Position::Middle,
        };
        let is_last = matches!(position, Position::Last | Position::Only);
        let dest_qpn = match (self.cfg.qp_type, &w.wr.ud) {
            (QpType::Ud, Some(ud)) => ud.qpn,
            _ => self.attr.dest_qp_num,
        };
        let offset = u64::from(pkt_index) * u64::from(mtu);
        let transport = self.transport();
        let (opcode, payload_len) = match w.wr.op {
            SendOp::Send { imm, invalidate } => {
                let op = Opcode::send(transport, position, imm.is_some(), invalidate.is_some());
                (op, (w.len - offset.min(w.len)).min(u64::from(mtu)))
            }
            SendOp::Write { imm, .. } => (
                Opcode::write(transport, position, imm.is_some()),
                (w.len - offset.min(w.len)).min(u64::from(mtu)),
            ),
            SendOp::Read { .. } => (Opcode::RcReadRequest.on_transport(transport), 0),
            SendOp::CompareSwap { .. } => (Opcode::RcCompareSwap.on_transport(transport), 0),
            SendOp::FetchAdd { .. } => (Opcode::RcFetchAdd.on_transport(transport), 0),
            // Executed by `execute_local` above, never sent.
            SendOp::BindMw(_) | SendOp::LocalInv { .. } => (None, 0),
            // Raw packet QPs only, which never get here (`generate_raw`).
            SendOp::Tso { .. } => (None, 0),
            // RC only (checked at post time): XRC has no twin of these extensions.
            SendOp::AtomicWrite { .. } => (Opcode::RcAtomicWrite.on_transport(transport), 8),
            SendOp::Flush { .. } => (Opcode::RcFlush.on_transport(transport), 0),
        };
        let Some(opcode) = opcode else {
            // Unreachable for checked WRs (the opcode table covers every legal combination).
            self.fail_wqe(idx, WcStatus::LocQpOpErr);
            return;
        };
        let mut bth = BthRepr::new(opcode, dest_qpn, psn);
        bth.solicited = is_last && w.wr.flags.contains(SendFlags::SOLICITED);
        let mut repr = PacketRepr::new(bth, payload_len as usize);
        if transport == Transport::Xrc {
            // Every XRC request names the SRQ at the target (checked at post time).
            repr.xrceth = Some(XrcEthRepr {
                srqn: w.wr.xrc_srqn.unwrap_or(0),
            });
        }
        match w.wr.op {
            SendOp::Send { imm, invalidate } => {
                if is_last {
                    repr.imm_dt = imm.map(|v| ImmDtRepr {
                        imm_data: u32::from_be(v),
                    });
                    repr.ieth = invalidate.map(|rkey| IethRepr { rkey });
                }
            }
            SendOp::Write { remote, imm } => {
                if matches!(position, Position::First | Position::Only) {
                    repr.reth = Some(RethRepr {
                        va: remote.addr,
                        rkey: remote.rkey,
                        dma_len: w.len as u32,
                    });
                }
                if is_last {
                    repr.imm_dt = imm.map(|v| ImmDtRepr {
                        imm_data: u32::from_be(v),
                    });
                }
            }
            SendOp::Read { remote } => {
                // From the first missing response to the end of what this request asks for.
                let start = (u64::from(w.resp_pkts) * u64::from(mtu)).min(w.len);
                let end = (u64::from(w.req_end) * u64::from(mtu)).min(w.len);
                repr.reth = Some(RethRepr {
                    // The application's address, unchecked here: the responder checks the
                    // range (and refuses one that wraps).
                    va: remote.addr.wrapping_add(start),
                    rkey: remote.rkey,
                    dma_len: end.saturating_sub(start) as u32,
                });
            }
            SendOp::CompareSwap {
                remote,
                compare,
                swap,
            } => {
                repr.atomic_eth = Some(AtomicEthRepr {
                    va: remote.addr,
                    rkey: remote.rkey,
                    swap_add: swap,
                    compare,
                });
            }
            SendOp::FetchAdd { remote, add } => {
                repr.atomic_eth = Some(AtomicEthRepr {
                    va: remote.addr,
                    rkey: remote.rkey,
                    swap_add: add,
                    compare: 0,
                });
            }
            SendOp::BindMw(_) | SendOp::LocalInv { .. } | SendOp::Tso { .. } => {}
            SendOp::AtomicWrite { remote, .. } => {
                repr.reth = Some(RethRepr {
                    va: remote.addr,
                    rkey: remote.rkey,
                    dma_len: 8,
                });
            }
            SendOp::Flush {
                remote,
                len,
                placement,
                select,
            } => {
                repr.feth = Some(FethRepr {
                    placement,
                    selectivity: match select {
                        FlushSelect::Range => softverbs_wire::feth::SELECT_RANGE,
                        FlushSelect::Mr => softverbs_wire::feth::SELECT_MR,
                    },
                });
                repr.reth = Some(RethRepr {
                    va: remote.addr,
                    rkey: remote.rkey,
                    dma_len: len,
                });
            }
        }
        let dest = match (self.cfg.qp_type, &w.wr.ud) {
            (QpType::Ud, Some(ud)) => {
                let qkey = if ud.qkey & 0x8000_0000 != 0 {
                    self.attr.qkey
                } else {
                    ud.qkey
                };
                repr.deth = Some(DethRepr {
                    qkey,
                    src_qpn: self.cfg.qpn,
                });
                Dest {
                    dgid: ud.dgid,
                    sgid_index: ud.sgid_index,
                    traffic_class: ud.traffic_class,
                    hop_limit: ud.hop_limit,
                    flow_label: ud.flow_label,
                }
            }
            _ => self.path_dest(),
        };
        if self.cfg.qp_type.is_reliable() {
            self.req.since_ackreq += 1;
            // Often enough that a small window is acknowledged before it fills, and always on
            // the packet that fills it.
            let window = self.req.rec.window();
            let every = ACK_REQ_EVERY.min(window / 4).max(1);
            let fills = self.req.unacked.distance(psn + 1) >= window;
            let sample = self.req.rec.wants_sample();
            if is_last || fills || sample || single.is_some() || self.req.since_ackreq >= every {
                repr.bth.ack_req = true;
                self.req.since_ackreq = 0;
                if !rerequest {
                    self.req.rec.on_send(now, psn);
                }
            }
        }
        // A large SEND or WRITE may leave its payload where it is (see `external`).
        let external = match (&w.wr.op, &w.wr.payload) {
            (SendOp::Send { .. } | SendOp::Write { .. }, Payload::Sges(sges))
                if self.external_payloads
                    && payload_len as usize >= EXTERNAL_MIN_PACKET
                    && w.len >= EXTERNAL_MIN_MESSAGE =>
            {
                locate_gather(mem, (self.cfg.pd, self.cfg.qpn), sges, offset, payload_len)
            }
            _ => None,
        };
        let built = match external {
            Some(ranges) => Ok(build_external(&repr, dest, ranges)),
            None => build(&repr, dest, |buf| match w.wr.op {
                // The value travels in the WQE, as rxe keeps it: no local key is involved.
                SendOp::AtomicWrite { value, .. } => {
                    buf.copy_from_slice(&value);
                    Ok(())
                }
                _ => gather(mem, (self.cfg.pd, self.cfg.qpn), &w.wr.payload, offset, buf),
            }),
        };
        let tx = match built {
            Ok(tx) => tx,
            Err(e) => {
                self.fail_wqe(idx, e.local_status());
                return;
            }
        };
        self.push_out(tx);
        self.counters.tx_packets += 1;
        if let Some((idx, saved)) = single {
            self.sq[idx].next_pkt = saved;
        }
        if rerequest {
            if self.req.retransmit_at.is_none() {
                self.arm_retransmit(now);
            }
            return;
        }
        let w = &mut self.sq[idx];
        w.next_pkt += 1;
        let fully_sent = w.fully_sent();
        match self.cfg.qp_type {
            QpType::Rc | QpType::XrcSend | QpType::XrcRecv => {
                if fully_sent {
                    self.req.send_idx += 1;
                }
                if self.req.retransmit_at.is_none() {
                    if self.req.retry_psn.is_none() {
                        // The first packet in flight after an idle spell: a stall, if one
                        // comes, is counted from here.
                        self.req.rec.on_progress(now);
                    }
                    self.arm_retransmit(now);
                }
            }
            // Unreliable: the WQE is done once its last packet is out.
            QpType::Uc | QpType::Ud | QpType::RawPacket => {
                if fully_sent {
                    let w = self.sq.pop_front().expect("sending the front WQE");
                    self.req.unacked = self.req.next_psn;
                    self.complete_send(&w, WcStatus::Success);
                    self.check_drained();
                }
            }
        }
    }

    /// Executes the bind or local invalidate at `idx`, which the requester has reached: it
    /// takes no PSN and sends nothing, but completes in posting order like every WQE. A failed
    /// bind completes with `IBV_WC_MW_BIND_ERR`, a failed invalidate with
    /// `IBV_WC_LOC_QP_OP_ERR`, and the QP moves to ERR (as rxe).
    fn execute_local(&mut self, idx: usize, mem: &dyn Memory) {
        let (qpn, pd) = (self.cfg.qpn, self.cfg.pd);
        self.req.send_idx = idx;
        let next_psn = self.req.next_psn;
        let w = &mut self.sq[idx];
        w.started = true;
        w.npsn = 0;
        w.first_psn = next_psn;
        let result = match w.wr.op {
            SendOp::BindMw(bind) => mem.bind_mw(qpn, pd, &bind).map_err(|_| WcStatus::MwBindErr),
            SendOp::LocalInv { rkey } => mem.invalidate(qpn, pd, rkey).map_err(|_| WcStatus::LocQpOpErr),
            _ => unreachable!("only local operations are executed here"),
        };
        if let Err(status) = result {
            self.fail_wqe(idx, status);
            return;
        }
        self.sq[idx].done = true;
        match self.cfg.qp_type {
            QpType::Rc | QpType::XrcSend | QpType::XrcRecv => {
                self.req.send_idx += 1;
                // Completions leave in posting order: it completes now only if nothing before
                // it waits for an acknowledgement; otherwise the ACK that finishes those does.
                while self.sq.front().is_some_and(|w| w.done) {
                    self.pop_completed();
                }
            }
            // Unreliable: done at once (binds are refused on UD and raw QPs at post time).
            QpType::Uc | QpType::Ud | QpType::RawPacket => {
                let w = self.sq.pop_front().expect("executing the front WQE");
                self.complete_send(&w, WcStatus::Success);
            }
        }
        self.check_drained();
    }

    /// Completes a send WQE, with a completion if signaled or unsuccessful.
    pub(crate) fn complete_send(&mut self, w: &super::SendWqe, status: WcStatus) {
        let signaled = self.cfg.sq_sig_all || w.wr.flags.contains(SendFlags::SIGNALED) || w.internal;
        if signaled || status != WcStatus::Success {
            let mut wc = WorkCompletion::error(w.wr.wr_id, status, w.wr.op.wc_opcode(), self.cfg.qpn);
            if status == WcStatus::Success {
                wc.byte_len = w.len as u32;
            }
            let queue = if w.internal {
                WorkQueue::Internal
            } else {
                WorkQueue::Send
            };
            self.push_cqe(queue, wc);
        }
    }

    /// Fails WQE `idx` (and so the QP): the QP moves to ERR, and the flush completes the WQE
    /// with `status` and everything else with `IBV_WC_WR_FLUSH_ERR`, in posting order.
    pub(crate) fn fail_wqe(&mut self, idx: usize, status: WcStatus) {
        if let Some(w) = self.sq.get_mut(idx) {
            w.failed = Some(status);
        }
        self.enter_error();
    }
}
