//! The responder: executes incoming requests, answers with ACKs, NAKs and responses, and keeps
//! the READ/atomic replay cache.

use std::collections::VecDeque;

use softverbs_wire::{
    AethRepr, AethSyndrome, AtomicAckEthRepr, BthRepr, NakCode, Opcode, PacketRepr, Position, Psn,
};

use super::completer::{scatter_sges, ScatterError};
use super::external::{
    build_external, ExternalRanges, Rx, RxData, EXTERNAL_MIN_MESSAGE, EXTERNAL_MIN_PACKET,
};
use super::grh::write_grh;
use super::requester::{build, packets};
use super::{DropReason, QpEngine, RecvPlacement, RecvSource, RxMeta, WorkQueue};
use crate::memory::{Access, AtomicOp, KeyRef, MemError, Memory};
use crate::time::Instant;
use crate::types::{
    AccessFlags, EventType, QpState, QpType, RecvWr, WcFlags, WcOpcode, WcStatus, WorkCompletion,
};
use crate::wr::{FLUSH_GLOBAL, FLUSH_PERSISTENT};

/// A message being received.
#[derive(Debug, Default)]
pub(crate) enum Progress {
    #[default]
    Idle,
    Send {
        place: RecvPlacement,
        offset: u64,
    },
    Write {
        va: u64,
        rkey: u32,
        total: u64,
        offset: u64,
    },
}

/// A responder resource: what is needed to answer a duplicate READ or atomic.
#[derive(Debug, Clone, Copy)]
pub(crate) enum RdResource {
    Read {
        first: Psn,
        last: Psn,
        va: u64,
        rkey: u32,
        len: u64,
        /// The PD the R_Key was checked against (an XRC target's varies by SRQ).
        pd: u32,
    },
    Atomic {
        psn: Psn,
        orig: u64,
    },
    /// An ATOMIC WRITE or FLUSH: answered again by an empty READ RESPONSE, never re-executed.
    Placement {
        psn: Psn,
        opcode: Opcode,
    },
}

/// Out-of-sequence packets past a hole, between sequence NAKs, after which the NAK is sent
/// again (in case it was lost).
const RENAK_EVERY: u32 = 32;

/// What the responder saw since its last NAK for a hole (a sequence NAK, or an RNR NAK,
/// behind which the packets already in flight arrive out of sequence too).
#[derive(Debug, Clone, Copy)]
pub(crate) struct NakWatch {
    highest: Psn,
    since: u32,
    /// The NAK was an RNR NAK: the requester resends from its PSN once its RNR timer ran out.
    rnr: bool,
}

#[derive(Debug, Default)]
pub(crate) struct Responder {
    pub(crate) epsn: Psn,
    pub(crate) msn: u32,
    /// Since the last sequence NAK (none sent while `None`): the highest out-of-sequence PSN
    /// seen and how many out-of-sequence packets came.
    pub(crate) nak: Option<NakWatch>,
    pub(crate) progress: Progress,
    pub(crate) resources: VecDeque<RdResource>,
    pub(crate) max_resources: usize,
    pub(crate) comm_est_sent: bool,
    /// UC: discarding the rest of a broken message.
    pub(crate) uc_dropping: bool,
    /// Duplicate SEND/WRITE packets received since the last new one.
    pub(crate) dup_run: u32,
    /// XRC target: the SRQ the packet being executed names, and that SRQ's PD.
    pub(crate) xrc: Option<XrcSelection>,
}

/// The XRC SRQ a request is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct XrcSelection {
    pub(crate) srqn: u32,
    pub(crate) pd: u32,
}

impl Responder {
    pub(crate) fn reset(&mut self, rq_psn: Psn, max_dest_rd_atomic: u8) {
        *self = Self {
            epsn: rq_psn,
            max_resources: usize::from(max_dest_rd_atomic),
            ..Self::default()
        };
    }

    pub(crate) fn take_in_progress_wqe(&mut self) -> Option<RecvPlacement> {
        match std::mem::take(&mut self.progress) {
            Progress::Send { place, .. } => Some(place),
            _ => None,
        }
    }
}

/// A run of duplicate SEND/WRITE packets draws an ACK on its first packet and every this many.
const DUP_ACK_EVERY: u32 = 16;

/// How a class C (fatal) responder error is reported.
struct Fatal {
    nak: NakCode,
    recv_status: WcStatus,
    event: EventType,
}

const INVALID_REQUEST: Fatal = Fatal {
    nak: NakCode::InvalidRequest,
    recv_status: WcStatus::RemInvReqErr,
    event: EventType::QpReqErr,
};
const ACCESS_ERROR: Fatal = Fatal {
    nak: NakCode::RemoteAccessError,
    recv_status: WcStatus::RemAccessErr,
    event: EventType::QpAccessErr,
};

impl QpEngine {
    /// The PD remote keys and receive buffers are checked against: an XRC target uses the PD
    /// of the SRQ the request names.
    pub(crate) fn resp_pd(&self) -> u32 {
        match self.resp.xrc {
            Some(x) if self.cfg.qp_type == QpType::XrcRecv => x.pd,
            _ => self.cfg.pd,
        }
    }

    /// Where receive completions go: an XRC target completes on the CQ of the SRQ the WQE came
    /// from.
    pub(crate) fn recv_queue(&self) -> WorkQueue {
        match self.resp.xrc {
            Some(x) if self.cfg.qp_type == QpType::XrcRecv => WorkQueue::XrcSrq(x.srqn),
            _ => WorkQueue::Recv,
        }
    }

    fn take_recv(&mut self, srq: &mut Option<&mut dyn RecvSource>) -> Option<RecvWr> {
        if self.cfg.has_srq || self.cfg.qp_type == QpType::XrcRecv {
            srq.as_deref_mut().and_then(RecvSource::take)
        } else {
            self.rq.pop_front()
        }
    }

    fn put_back_recv(&mut self, wqe: RecvWr, srq: &mut Option<&mut dyn RecvSource>) {
        if self.cfg.has_srq || self.cfg.qp_type == QpType::XrcRecv {
            if let Some(s) = srq.as_deref_mut() {
                s.put_back(wqe);
            }
        } else {
            self.rq.push_front(wqe);
        }
    }

    /// Handles a request packet (RC, UC or UD).
    pub(crate) fn handle_request(
        &mut self,
        now: Instant,
        pkt: &Rx<'_>,
        meta: &RxMeta,
        mem: &dyn Memory,
        mut srq: Option<&mut dyn RecvSource>,
    ) -> Result<(), DropReason> {
        let opcode = pkt.opcode();
        let transport_ok = matches!(
            (self.cfg.qp_type, opcode.transport()),
            (QpType::Rc, softverbs_wire::Transport::Rc)
                | (QpType::Uc, softverbs_wire::Transport::Uc)
                | (QpType::Ud, softverbs_wire::Transport::Ud)
                | (QpType::XrcRecv, softverbs_wire::Transport::Xrc)
        );
        if !transport_ok {
            return Err(DropReason::WrongTransport);
        }
        if !matches!(
            self.state,
            QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe
        ) {
            return Err(DropReason::NotReceiving);
        }
        // Either key may be the full member; the partition bits must match the default key.
        if pkt.repr.bth.pkey & 0x7FFF != 0x7FFF {
            self.counters.pkey_violations += 1;
            return Err(DropReason::BadPkey);
        }
        let result = match self.cfg.qp_type {
            QpType::Ud => self.ud_request(pkt, meta, mem, &mut srq),
            QpType::Uc => self.uc_request(pkt, mem, &mut srq),
            QpType::Rc | QpType::XrcRecv => self.rc_request(now, pkt, mem, &mut srq),
            // Unreachable: an initiator accepts no request (transport check above).
            QpType::XrcSend => Err(DropReason::WrongTransport),
            QpType::RawPacket => Err(DropReason::WrongTransport),
        };
        if result.is_ok() && self.state == QpState::Rtr && !self.resp.comm_est_sent {
            self.resp.comm_est_sent = true;
            self.events.push_back(EventType::CommEst);
        }
        result
    }

    fn ud_request(
        &mut self,
        pkt: &Rx<'_>,
        meta: &RxMeta,
        mem: &dyn Memory,
        srq: &mut Option<&mut dyn RecvSource>,
    ) -> Result<(), DropReason> {
        let Some(deth) = pkt.repr.deth else {
            return Err(DropReason::Malformed);
        };
        if deth.qkey != self.attr.qkey {
            self.counters.qkey_violations += 1;
            return Err(DropReason::BadQkey);
        }
        let Some(wqe) = self.take_recv(srq) else {
            return Err(DropReason::NoReceiveWqe);
        };
        let grh = write_grh(
            meta.sgid,
            meta.dgid,
            meta.traffic_class,
            meta.hop_limit,
            pkt.repr.buffer_len(),
        );
        let pd = (self.cfg.pd, self.cfg.qpn);
        let result = scatter_sges(mem, pd, &wqe.sg_list, 0, RxData::Bytes(&grh))
            .and_then(|()| scatter_sges(mem, pd, &wqe.sg_list, 40, pkt.data));
        let mut wc = WorkCompletion::error(wqe.wr_id, WcStatus::Success, WcOpcode::Recv, self.cfg.qpn);
        match result {
            Ok(()) => {
                wc.byte_len = (40 + pkt.data.len()) as u32;
                wc.src_qp = deth.src_qpn;
                wc.wc_flags = WcFlags::GRH;
                if let Some(imm) = pkt.repr.imm_dt {
                    wc.imm_data = imm.imm_data.to_be();
                    wc.wc_flags |= WcFlags::WITH_IMM;
                }
                wc.solicited = pkt.repr.bth.solicited;
            }
            Err(ScatterError::Length) => wc.status = WcStatus::LocLenErr,
            Err(ScatterError::Mem(e)) => wc.status = e.local_status(),
        }
        self.push_cqe(self.recv_queue(), wc);
        Ok(())
    }

    fn uc_request(
        &mut self,
        pkt: &Rx<'_>,
        mem: &dyn Memory,
        srq: &mut Option<&mut dyn RecvSource>,
    ) -> Result<(), DropReason> {
        let psn = pkt.repr.bth.psn;
        let opcode = pkt.opcode();
        if psn.is_before(self.resp.epsn) {
            // UC never retransmits, so an old PSN is a copy the network made: delivering it
            // would complete a receive twice.
            self.counters.duplicates += 1;
            return Err(DropReason::BadPsn);
        }
        if self.resp.uc_dropping || psn != self.resp.epsn {
            // A gap: whatever message was in progress is lost. Resynchronise on a new message.
            if let Some(p) = self.resp.take_in_progress_wqe() {
                self.put_back_recv(p.wqe, srq);
            }
            self.resp.progress = Progress::Idle;
            if !opcode.starts_message() {
                self.resp.uc_dropping = true;
                self.resp.epsn = psn + 1;
                return Err(DropReason::UcMessageDropped);
            }
            self.resp.uc_dropping = false;
            self.resp.epsn = psn;
        }
        match self.execute(pkt, mem, srq) {
            Ok(()) => {
                self.resp.epsn = psn + 1;
                Ok(())
            }
            Err(Outcome::Rnr) => {
                self.resp.uc_dropping = true;
                self.resp.epsn = psn + 1;
                Err(DropReason::NoReceiveWqe)
            }
            Err(Outcome::Fatal(f)) => {
                // UC drops a bad message silently; a receive it consumed is reused.
                if let Some(p) = self.resp.take_in_progress_wqe() {
                    if f.recv_status == WcStatus::LocLenErr {
                        let wc = p.completion(WcStatus::LocLenErr, WcFlags::empty(), self.cfg.qpn, 0);
                        self.push_cqe(p.queue, wc);
                    } else {
                        self.put_back_recv(p.wqe, srq);
                    }
                }
                self.resp.progress = Progress::Idle;
                self.resp.uc_dropping = true;
                self.resp.epsn = psn + 1;
                Err(DropReason::UcMessageDropped)
            }
            Err(Outcome::Sequence) => {
                if let Some(p) = self.resp.take_in_progress_wqe() {
                    self.put_back_recv(p.wqe, srq);
                }
                self.resp.progress = Progress::Idle;
                self.resp.uc_dropping = true;
                self.resp.epsn = psn + 1;
                Err(DropReason::UcMessageDropped)
            }
        }
    }

    fn rc_request(
        &mut self,
        _now: Instant,
        pkt: &Rx<'_>,
        mem: &dyn Memory,
        srq: &mut Option<&mut dyn RecvSource>,
    ) -> Result<(), DropReason> {
        let psn = pkt.repr.bth.psn;
        let epsn = self.resp.epsn;
        if psn.is_after(epsn) {
            self.resp.dup_run = 0;
            // Something was lost: NAK, then stay quiet while the rest of the window arrives,
            // unless the requester evidently started over without the missing packet getting
            // through (a PSN at or below one seen since the NAK: the resent packet was lost
            // too), asks for an acknowledgement (AckReq), or the NAK itself seems lost (a long
            // run of packets past the hole). Behind an RNR NAK, what was in flight arrives out
            // of sequence too; AckReqs there are not answered, since a sequence NAK would have
            // the requester resend at once and cut the receiver's RNR delay short (every packet
            // of a stream of one-packet messages asks).
            let renak = match &mut self.resp.nak {
                None => true,
                Some(w) if !psn.is_after(w.highest) || (pkt.repr.bth.ack_req && !w.rnr) => true,
                Some(w) => {
                    w.highest = psn;
                    w.since += 1;
                    w.since >= RENAK_EVERY
                }
            };
            if renak {
                self.resp.nak = Some(NakWatch {
                    highest: psn,
                    since: 0,
                    rnr: false,
                });
                self.counters.seq_naks_sent += 1;
                self.send_ack(AethSyndrome::Nak(NakCode::PsnSequenceError), epsn);
            }
            return Err(DropReason::BadPsn);
        }
        if psn.is_before(epsn) {
            self.counters.duplicates += 1;
            return self.rc_duplicate(pkt, mem);
        }
        self.resp.nak = None;
        self.resp.dup_run = 0;
        if self.cfg.qp_type == QpType::XrcRecv {
            // The SRQ must exist and belong to this target's XRC domain; its PD then governs
            // every key of the request and its CQ gets the completion.
            let srqn = pkt.repr.xrceth.map_or(0, |x| x.srqn);
            let selected = srq.as_deref_mut().and_then(|s| s.select_xrc_srq(srqn));
            match selected {
                Some(pd) => self.resp.xrc = Some(XrcSelection { srqn, pd }),
                None => {
                    // A message in progress stays charged to its own SRQ.
                    if matches!(self.resp.progress, Progress::Idle) {
                        self.resp.xrc = None;
                    }
                    self.rc_fatal(ACCESS_ERROR, psn);
                    return Ok(());
                }
            }
        }
        let opcode = pkt.opcode();
        let outcome = if opcode.is_read() {
            self.execute_read(pkt, mem)
        } else if opcode.is_atomic() {
            self.execute_atomic(pkt, mem)
        } else if opcode.is_atomic_write() || opcode.is_flush() {
            self.execute_placement(pkt, mem)
        } else {
            self.execute(pkt, mem, srq)
        };
        match outcome {
            Ok(()) => {
                if !opcode.uses_responder_resource() {
                    self.resp.epsn = psn + 1;
                    if pkt.repr.bth.ack_req {
                        self.send_ack(AethSyndrome::ACK_UNLIMITED, psn);
                    }
                }
                Ok(())
            }
            Err(Outcome::Rnr) => {
                self.send_ack(
                    AethSyndrome::RnrNak {
                        timer: self.attr.min_rnr_timer,
                    },
                    psn,
                );
                // The requester resends from here after its RNR timer: what it sent meanwhile
                // arrives out of sequence and needs no NAK of its own (one would have it resend
                // at once, cutting the receiver's delay short).
                self.resp.nak = Some(NakWatch {
                    highest: psn,
                    since: 0,
                    rnr: true,
                });
                Ok(())
            }
            Err(Outcome::Sequence) => {
                self.rc_fatal(INVALID_REQUEST, psn);
                Ok(())
            }
            Err(Outcome::Fatal(f)) => {
                self.rc_fatal(f, psn);
                Ok(())
            }
        }
    }

    /// A class C error: NAK the requester, complete the receive in progress with an error and
    /// move to ERR with the matching async event.
    fn rc_fatal(&mut self, f: Fatal, psn: Psn) {
        self.send_ack(AethSyndrome::Nak(f.nak), psn);
        if let Some(p) = self.resp.take_in_progress_wqe() {
            let wc = p.completion(f.recv_status, WcFlags::empty(), self.cfg.qpn, 0);
            self.push_cqe(p.queue, wc);
        }
        self.events.push_back(f.event);
        // The NAK must still leave: keep it across the flush.
        let naks: Vec<_> = self.out.drain(..).collect();
        self.enter_error();
        self.out.extend(naks);
    }

    /// Executes an in-sequence SEND or WRITE packet.
    fn execute(
        &mut self,
        pkt: &Rx<'_>,
        mem: &dyn Memory,
        srq: &mut Option<&mut dyn RecvSource>,
    ) -> Result<(), Outcome> {
        let opcode = pkt.opcode();
        let mtu = u64::from(self.mtu());
        let len = pkt.data.len() as u64;
        // Sequence: a FIRST/ONLY starts a message, MIDDLE/LAST continue one of the same kind.
        let continuing = matches!(
            (&self.resp.progress, opcode.is_send(), opcode.is_write()),
            (Progress::Send { .. }, true, _) | (Progress::Write { .. }, _, true)
        );
        let idle = matches!(self.resp.progress, Progress::Idle);
        if opcode.starts_message() != idle || (!opcode.starts_message() && !continuing) {
            return Err(Outcome::Sequence);
        }
        // Lengths: FIRST and MIDDLE carry exactly one MTU, LAST and ONLY at most one.
        let len_ok = if opcode.ends_message() {
            len <= mtu
        } else {
            len == mtu
        };
        if !len_ok {
            return Err(Outcome::Fatal(INVALID_REQUEST));
        }
        if opcode.is_write() {
            if !self.attr.qp_access_flags.contains(AccessFlags::REMOTE_WRITE) {
                return Err(Outcome::Fatal(INVALID_REQUEST));
            }
            if opcode.starts_message() {
                let reth = pkt.repr.reth.ok_or(Outcome::Fatal(INVALID_REQUEST))?;
                let total = u64::from(reth.dma_len);
                if total > 1 << 31 {
                    return Err(Outcome::Fatal(INVALID_REQUEST));
                }
                if total > 0 {
                    let key = KeyRef {
                        key: reth.rkey,
                        pd: self.resp_pd(),
                        qpn: self.cfg.qpn,
                        access: Access::RemoteWrite,
                    };
                    mem.check(key, reth.va, total)
                        .map_err(|_| Outcome::Fatal(ACCESS_ERROR))?;
                }
                self.resp.progress = Progress::Write {
                    va: reth.va,
                    rkey: reth.rkey,
                    total,
                    offset: 0,
                };
            }
            let Progress::Write {
                va,
                rkey,
                total,
                offset,
            } = self.resp.progress
            else {
                unreachable!()
            };
            if offset + len > total || (opcode.ends_message() && offset + len != total) {
                return Err(Outcome::Fatal(INVALID_REQUEST));
            }
            // A WRITE with immediate consumes a receive WQE: take it before touching memory, so an
            // RNR retry of this packet repeats nothing.
            let wqe = if opcode.has_imm() {
                match self.take_recv(srq) {
                    Some(w) => Some(w),
                    None => {
                        // A WRITE ONLY with immediate is retried as the start of a message:
                        // leave none in progress.
                        if opcode.starts_message() {
                            self.resp.progress = Progress::Idle;
                        }
                        return Err(Outcome::Rnr);
                    }
                }
            } else {
                None
            };
            if len > 0 {
                let key = KeyRef {
                    key: rkey,
                    pd: self.resp_pd(),
                    qpn: self.cfg.qpn,
                    access: Access::RemoteWrite,
                };
                if pkt.data.write_to(mem, key, va + offset).is_err() {
                    if let Some(w) = wqe {
                        self.put_back_recv(w, srq);
                    }
                    return Err(Outcome::Fatal(ACCESS_ERROR));
                }
            }
            let offset = offset + len;
            if opcode.ends_message() {
                self.resp.progress = Progress::Idle;
                self.resp.msn = (self.resp.msn + 1) & 0xFF_FFFF;
                if let Some(w) = wqe {
                    let mut wc = WorkCompletion::error(
                        w.wr_id,
                        WcStatus::Success,
                        WcOpcode::RecvRdmaWithImm,
                        self.cfg.qpn,
                    );
                    wc.byte_len = total as u32;
                    wc.src_qp = self.attr.dest_qp_num;
                    wc.wc_flags = WcFlags::WITH_IMM;
                    wc.imm_data = pkt.repr.imm_dt.map_or(0, |i| i.imm_data.to_be());
                    wc.solicited = pkt.repr.bth.solicited;
                    self.push_cqe(self.recv_queue(), wc);
                }
            } else {
                self.resp.progress = Progress::Write {
                    va,
                    rkey,
                    total,
                    offset,
                };
            }
            return Ok(());
        }
        // SEND.
        if opcode.starts_message() {
            let place = if self.cfg.has_srq || self.cfg.qp_type == QpType::XrcRecv {
                // A tag-matching SRQ reads the first packet's headers.
                let first = pkt.data.to_bytes().map_err(|_| Outcome::Fatal(ACCESS_ERROR))?;
                srq.as_deref_mut()
                    .and_then(|s| s.take_send(&first, opcode.ends_message()))
            } else {
                self.rq.pop_front().map(RecvPlacement::plain)
            };
            let Some(mut place) = place else {
                return Err(Outcome::Rnr);
            };
            if place.queue == WorkQueue::Recv {
                // An XRC target completes on the CQ of the SRQ the WQE came from.
                place.queue = self.recv_queue();
            }
            if let (Some(flags), false) = (place.early_flags, opcode.ends_message()) {
                let wc = place.completion(WcStatus::Success, flags, self.cfg.qpn, self.attr.dest_qp_num);
                self.push_cqe(place.queue, wc);
            }
            self.resp.progress = Progress::Send { place, offset: 0 };
        }
        let pd = self.resp_pd();
        let Progress::Send { place, offset } = &mut self.resp.progress else {
            unreachable!()
        };
        if let Some((range, at)) = place.window(*offset, len) {
            match scatter_sges(
                mem,
                (pd, self.cfg.qpn),
                &place.wqe.sg_list,
                at,
                pkt.data.slice(range),
            ) {
                Ok(()) => {}
                Err(ScatterError::Length) => {
                    return Err(Outcome::Fatal(Fatal {
                        nak: NakCode::InvalidRequest,
                        recv_status: WcStatus::LocLenErr,
                        event: EventType::QpReqErr,
                    }))
                }
                Err(ScatterError::Mem(_)) => {
                    return Err(Outcome::Fatal(Fatal {
                        nak: NakCode::RemoteOperationalError,
                        recv_status: WcStatus::LocProtErr,
                        event: EventType::QpFatal,
                    }))
                }
            }
        }
        *offset += len;
        if opcode.ends_message() {
            if let Some(ieth) = pkt.repr.ieth {
                // The window is invalidated before the receive completes, so that a consumer who
                // sees the completion can rely on the peer having lost access (IBTA 9.4.1.1.3).
                // A key that cannot be invalidated is an invalid request (class J): the receive
                // completes in error and the QP moves to ERR.
                if mem.invalidate(self.cfg.qpn, self.resp_pd(), ieth.rkey).is_err() {
                    return Err(Outcome::Fatal(INVALID_REQUEST));
                }
            }
            let Progress::Send { place, offset } = std::mem::take(&mut self.resp.progress) else {
                unreachable!()
            };
            self.resp.msn = (self.resp.msn + 1) & 0xFF_FFFF;
            let mut wc = place.completion(place.status, place.flags, self.cfg.qpn, self.attr.dest_qp_num);
            wc.byte_len = place.placed(offset) as u32;
            wc.solicited = pkt.repr.bth.solicited;
            if let Some(imm) = pkt.repr.imm_dt {
                wc.imm_data = imm.imm_data.to_be();
                wc.wc_flags |= WcFlags::WITH_IMM;
            }
            if let Some(ieth) = pkt.repr.ieth {
                wc.imm_data = ieth.rkey;
                wc.wc_flags |= WcFlags::WITH_INV;
            }
            self.push_cqe(place.queue, wc);
        }
        Ok(())
    }

    fn execute_read(&mut self, pkt: &Rx<'_>, mem: &dyn Memory) -> Result<(), Outcome> {
        if !matches!(self.resp.progress, Progress::Idle) {
            return Err(Outcome::Sequence);
        }
        if !self.attr.qp_access_flags.contains(AccessFlags::REMOTE_READ) || self.resp.max_resources == 0 {
            return Err(Outcome::Fatal(INVALID_REQUEST));
        }
        let reth = pkt.repr.reth.ok_or(Outcome::Fatal(INVALID_REQUEST))?;
        let len = u64::from(reth.dma_len);
        if len > 1 << 31 {
            return Err(Outcome::Fatal(INVALID_REQUEST));
        }
        // IBTA C9-88: a zero-length READ checks neither the R_Key nor the address.
        if len > 0 {
            let key = KeyRef {
                key: reth.rkey,
                pd: self.resp_pd(),
                qpn: self.cfg.qpn,
                access: Access::RemoteRead,
            };
            mem.check(key, reth.va, len)
                .map_err(|_| Outcome::Fatal(ACCESS_ERROR))?;
        }
        let psn = pkt.repr.bth.psn;
        let n = packets(len, self.mtu());
        self.push_resource(RdResource::Read {
            first: psn,
            last: psn + (n - 1),
            va: reth.va,
            rkey: reth.rkey,
            len,
            pd: self.resp_pd(),
        });
        self.resp.msn = (self.resp.msn + 1) & 0xFF_FFFF;
        self.resp.epsn = psn + n;
        self.send_read_responses(psn, reth.va, reth.rkey, len, self.resp_pd(), mem);
        Ok(())
    }

    fn execute_atomic(&mut self, pkt: &Rx<'_>, mem: &dyn Memory) -> Result<(), Outcome> {
        if !matches!(self.resp.progress, Progress::Idle) {
            return Err(Outcome::Sequence);
        }
        if !self.attr.qp_access_flags.contains(AccessFlags::REMOTE_ATOMIC) || self.resp.max_resources == 0 {
            return Err(Outcome::Fatal(INVALID_REQUEST));
        }
        let a = pkt.repr.atomic_eth.ok_or(Outcome::Fatal(INVALID_REQUEST))?;
        if a.va % 8 != 0 {
            return Err(Outcome::Fatal(INVALID_REQUEST));
        }
        let op = if pkt.opcode().rc_equivalent() == Opcode::RcCompareSwap {
            AtomicOp::CompareSwap {
                compare: a.compare,
                swap: a.swap_add,
            }
        } else {
            AtomicOp::FetchAdd { add: a.swap_add }
        };
        let key = KeyRef {
            key: a.rkey,
            pd: self.resp_pd(),
            qpn: self.cfg.qpn,
            access: Access::RemoteAtomic,
        };
        let orig = match mem.atomic(key, a.va, op) {
            Ok(v) => v,
            Err(MemError::Misaligned) => return Err(Outcome::Fatal(INVALID_REQUEST)),
            Err(_) => return Err(Outcome::Fatal(ACCESS_ERROR)),
        };
        let psn = pkt.repr.bth.psn;
        self.push_resource(RdResource::Atomic { psn, orig });
        self.resp.msn = (self.resp.msn + 1) & 0xFF_FFFF;
        self.resp.epsn = psn + 1;
        self.send_atomic_ack(psn, orig);
        Ok(())
    }

    /// ATOMIC WRITE or FLUSH (IBTA memory-placement extensions, as rxe executes them): both
    /// take a responder resource and are answered by a zero-length READ RESPONSE ONLY.
    fn execute_placement(&mut self, pkt: &Rx<'_>, mem: &dyn Memory) -> Result<(), Outcome> {
        if !matches!(self.resp.progress, Progress::Idle) {
            return Err(Outcome::Sequence);
        }
        if self.resp.max_resources == 0 {
            return Err(Outcome::Fatal(INVALID_REQUEST));
        }
        let opcode = pkt.opcode();
        let reth = pkt.repr.reth.ok_or(Outcome::Fatal(INVALID_REQUEST))?;
        if opcode.is_atomic_write() {
            if !self.attr.qp_access_flags.contains(AccessFlags::REMOTE_WRITE) {
                return Err(Outcome::Fatal(INVALID_REQUEST));
            }
            // Exactly one aligned 8-byte word (oA19-28).
            let Ok(bytes) =
                <[u8; 8]>::try_from(&*pkt.data.to_bytes().map_err(|_| Outcome::Fatal(INVALID_REQUEST))?)
            else {
                return Err(Outcome::Fatal(INVALID_REQUEST));
            };
            if reth.dma_len != 8 || pkt.repr.bth.pad_count != 0 || reth.va % 8 != 0 {
                return Err(Outcome::Fatal(INVALID_REQUEST));
            }
            let key = KeyRef {
                key: reth.rkey,
                pd: self.resp_pd(),
                qpn: self.cfg.qpn,
                access: Access::RemoteWrite,
            };
            let op = AtomicOp::Store {
                value: u64::from_ne_bytes(bytes),
            };
            match mem.atomic(key, reth.va, op) {
                Ok(_) => {}
                Err(MemError::Misaligned) => return Err(Outcome::Fatal(INVALID_REQUEST)),
                Err(_) => return Err(Outcome::Fatal(ACCESS_ERROR)),
            }
        } else {
            let feth = pkt.repr.feth.ok_or(Outcome::Fatal(INVALID_REQUEST))?;
            let placement = feth.placement;
            let known = FLUSH_GLOBAL | FLUSH_PERSISTENT;
            if placement == 0 || placement & !known != 0 || feth.selectivity > 1 {
                return Err(Outcome::Fatal(INVALID_REQUEST));
            }
            // The QP must allow each placement type asked for, as it must allow RDMA WRITE.
            let needed = Access::Flush(placement).required_flags();
            if !self.attr.qp_access_flags.contains(needed) {
                return Err(Outcome::Fatal(INVALID_REQUEST));
            }
            let key = KeyRef {
                key: reth.rkey,
                pd: self.resp_pd(),
                qpn: self.cfg.qpn,
                access: Access::Flush(placement),
            };
            let whole = feth.selectivity == softverbs_wire::feth::SELECT_MR;
            mem.flush(key, reth.va, u64::from(reth.dma_len), whole)
                .map_err(|_| Outcome::Fatal(ACCESS_ERROR))?;
        }
        let psn = pkt.repr.bth.psn;
        self.push_resource(RdResource::Placement { psn, opcode });
        self.resp.msn = (self.resp.msn + 1) & 0xFF_FFFF;
        self.resp.epsn = psn + 1;
        self.send_read_responses(psn, 0, 0, 0, 0, mem);
        Ok(())
    }

    fn push_resource(&mut self, r: RdResource) {
        if self.resp.resources.len() >= self.resp.max_resources.max(1) {
            self.resp.resources.pop_front();
        }
        self.resp.resources.push_back(r);
    }

    /// A request with a PSN already executed.
    fn rc_duplicate(&mut self, pkt: &Rx<'_>, mem: &dyn Memory) -> Result<(), DropReason> {
        let psn = pkt.repr.bth.psn;
        let opcode = pkt.opcode();
        if opcode.is_read() {
            let Some(reth) = pkt.repr.reth else {
                return Err(DropReason::Malformed);
            };
            let found = self.resp.resources.iter().rev().find_map(|r| match *r {
                RdResource::Read {
                    first,
                    last,
                    va,
                    rkey,
                    len,
                    pd,
                } if psn.in_range(first, last) => Some((va, rkey, len, pd)),
                _ => None,
            });
            let Some((va, rkey, len, pd)) = found else {
                return Err(DropReason::BadPsn);
            };
            // The retried request must ask for part of the original. Both ends come from the
            // wire (a zero-length original was never checked against a region), so the sums
            // may overflow: such a range is no part of the original.
            let (rva, rlen) = (reth.va, u64::from(reth.dma_len));
            let within = matches!(
                (rva.checked_add(rlen), va.checked_add(len)),
                (Some(end), Some(orig_end)) if rva >= va && end <= orig_end
            );
            if reth.rkey != rkey || !within {
                return Err(DropReason::BadPsn);
            }
            self.send_read_responses(psn, rva, rkey, rlen, pd, mem);
            return Ok(());
        }
        if opcode.is_atomic() {
            let found = self.resp.resources.iter().rev().find_map(|r| match *r {
                RdResource::Atomic { psn: p, orig } if p == psn => Some(orig),
                _ => None,
            });
            let Some(orig) = found else {
                return Err(DropReason::BadPsn);
            };
            // Replayed from the cache, never executed twice.
            self.send_atomic_ack(psn, orig);
            return Ok(());
        }
        if opcode.is_atomic_write() || opcode.is_flush() {
            let found = self.resp.resources.iter().any(
                |r| matches!(*r, RdResource::Placement { psn: p, opcode: o } if p == psn && o == opcode),
            );
            if !found {
                return Err(DropReason::BadPsn);
            }
            // Answered again, not executed again: a later write to the word must not be undone.
            self.send_read_responses(psn, 0, 0, 0, 0, mem);
            return Ok(());
        }
        // SEND or WRITE: acknowledge again what was already received. rxe answers every
        // duplicate, so a go-back-N resend of a whole window draws one ACK per packet; answer
        // the first duplicate of a run, every 16th, and those asking for it. That is still
        // enough feedback for a requester whose earlier ACKs or NAKs were lost.
        if pkt.repr.bth.ack_req || self.resp.dup_run % DUP_ACK_EVERY == 0 {
            self.send_ack(AethSyndrome::ACK_UNLIMITED, self.resp.epsn - 1);
        }
        self.resp.dup_run += 1;
        Ok(())
    }

    fn send_ack(&mut self, syndrome: AethSyndrome, psn: Psn) {
        let msn = self.resp.msn;
        if self.holding_acks && matches!(syndrome, AethSyndrome::Ack { .. }) {
            if self.held_ack.replace((syndrome, psn, msn)).is_some() {
                self.counters.acks_held += 1;
            }
            return;
        }
        // A NAK or RNR NAK goes behind the positive ACK held before it.
        self.flush_held_ack();
        self.queue_ack(syndrome, psn, msn);
    }

    /// Builds an ACK or NAK packet and queues it.
    pub(super) fn queue_ack(&mut self, syndrome: AethSyndrome, psn: Psn, msn: u32) {
        let bth = BthRepr::new(
            self.response_opcode(Opcode::RcAcknowledge),
            self.attr.dest_qp_num,
            psn,
        );
        let repr = PacketRepr {
            aeth: Some(AethRepr { syndrome, msn }),
            ..PacketRepr::new(bth, 0)
        };
        if let Ok(tx) = build(&repr, self.path_dest(), |_| Ok(())) {
            self.out.push_back(tx);
        }
    }

    fn send_atomic_ack(&mut self, psn: Psn, orig: u64) {
        let bth = BthRepr::new(
            self.response_opcode(Opcode::RcAtomicAcknowledge),
            self.attr.dest_qp_num,
            psn,
        );
        let repr = PacketRepr {
            aeth: Some(AethRepr {
                syndrome: AethSyndrome::ACK_UNLIMITED,
                msn: self.resp.msn,
            }),
            atomic_ack_eth: Some(AtomicAckEthRepr { orig }),
            ..PacketRepr::new(bth, 0)
        };
        if let Ok(tx) = build(&repr, self.path_dest(), |_| Ok(())) {
            self.push_out(tx);
        }
    }

    /// Sends the READ response packets for `len` bytes at `va`, numbered from `first`.
    fn send_read_responses(&mut self, first: Psn, va: u64, rkey: u32, len: u64, pd: u32, mem: &dyn Memory) {
        let mtu = u64::from(self.mtu());
        let n = packets(len, self.mtu());
        let dest = self.path_dest();
        for i in 0..n {
            let position = match (i == 0, i + 1 == n) {
                (true, true) => Position::Only,
                (true, false) => Position::First,
                (false, true) => Position::Last,
                (false, false) => Position::Middle,
            };
            let offset = u64::from(i) * mtu;
            let chunk = (len - offset).min(mtu) as usize;
            let opcode = self.response_opcode(Opcode::read_response(position));
            let bth = BthRepr::new(opcode, self.attr.dest_qp_num, first + i);
            let mut repr = PacketRepr::new(bth, chunk);
            if position != Position::Middle {
                repr.aeth = Some(AethRepr {
                    syndrome: AethSyndrome::ACK_UNLIMITED,
                    msn: self.resp.msn,
                });
            }
            let key = KeyRef {
                key: rkey,
                pd,
                qpn: self.cfg.qpn,
                access: Access::RemoteRead,
            };
            // A large response may leave its payload where it is (see `external`).
            let external =
                if self.external_payloads && chunk >= EXTERNAL_MIN_PACKET && len >= EXTERNAL_MIN_MESSAGE {
                    match mem.locate(key, va + offset, chunk as u64) {
                        Ok(Some(host)) => {
                            let mut ranges = ExternalRanges::default();
                            ranges.push(host, chunk as u32);
                            Some(ranges)
                        }
                        _ => None,
                    }
                } else {
                    None
                };
            let built = match external {
                Some(ranges) => Ok(build_external(&repr, dest, ranges)),
                None => build(&repr, dest, |buf| {
                    if buf.is_empty() {
                        Ok(())
                    } else {
                        mem.read(key, va + offset, buf)
                    }
                }),
            };
            match built {
                Ok(tx) => self.push_out(tx),
                // The region went away mid-read: stop; the requester's timeout recovers.
                Err(_) => break,
            }
        }
    }
}

/// Why an in-sequence request was not executed.
enum Outcome {
    /// No receive WQE: RNR NAK.
    Rnr,
    /// Opcode out of sequence.
    Sequence,
    /// A class C error.
    Fatal(Fatal),
}
