//! The completer: consumes ACKs, NAKs and responses, completes send WQEs in order, and owns the
//! retransmit and RNR timers.

use softverbs_wire::{AethSyndrome, NakCode, Opcode, Psn, Transport};

use super::external::{Rx, RxData};
use super::{ack_timeout, rnr_delay, DropReason, QpEngine, SendWqe};
use crate::memory::{Access, KeyRef, MemError, Memory};
use crate::time::Instant;
use crate::types::{QpState, QpType, WcStatus};
use crate::wr::{Payload, SendOp};

/// Copies `src` into the scatter list starting `offset` bytes in; fails if it does not fit.
pub(crate) fn scatter(
    mem: &dyn Memory,
    pd: (u32, u32),
    payload: &Payload,
    offset: u64,
    src: RxData<'_>,
) -> Result<(), ScatterError> {
    let Payload::Sges(sges) = payload else {
        return Err(ScatterError::Length);
    };
    scatter_sges(mem, pd, sges, offset, src)
}

/// Why scattering failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ScatterError {
    /// The data does not fit the buffers.
    Length,
    /// A key check failed.
    Mem(MemError),
}

pub(crate) fn scatter_sges(
    mem: &dyn Memory,
    (pd, qpn): (u32, u32),
    sges: &[crate::types::Sge],
    offset: u64,
    src: RxData<'_>,
) -> Result<(), ScatterError> {
    let mut skip = offset;
    let mut done = 0usize;
    for sge in sges {
        if done == src.len() {
            break;
        }
        let len = u64::from(sge.length);
        if skip >= len {
            skip -= len;
            continue;
        }
        let take = ((len - skip) as usize).min(src.len() - done);
        let key = KeyRef {
            key: sge.lkey,
            pd,
            qpn,
            access: Access::LocalWrite,
        };
        // The entry's address is the application's and unchecked until now: bytes past the
        // end of the address space are outside any region.
        let addr = sge
            .addr
            .checked_add(skip)
            .ok_or(ScatterError::Mem(MemError::OutOfRange))?;
        src.slice(done..done + take)
            .write_to(mem, key, addr)
            .map_err(ScatterError::Mem)?;
        done += take;
        skip = 0;
    }
    if done < src.len() {
        Err(ScatterError::Length)
    } else {
        Ok(())
    }
}

impl QpEngine {
    /// Handles an ACK, NAK, READ response or ATOMIC ACK.
    pub(crate) fn handle_response(
        &mut self,
        now: Instant,
        pkt: &Rx<'_>,
        mem: &dyn Memory,
    ) -> Result<(), DropReason> {
        // Only a reliable requester gets responses, on its own transport.
        let transport_ok = matches!(
            (self.cfg.qp_type, pkt.opcode().transport()),
            (QpType::Rc, Transport::Rc) | (QpType::XrcSend, Transport::Xrc)
        );
        if !transport_ok {
            return Err(DropReason::WrongTransport);
        }
        if !self.sending() {
            return Err(DropReason::NotReceiving);
        }
        let psn = pkt.repr.bth.psn;
        // A response must answer a request sent: fall in [unacked, resp_high). The PSNs of a
        // message not sent yet are reserved (`next_psn` is past them) but nothing answers them.
        if psn.is_before(self.req.unacked) || !psn.is_before(self.req.resp_high) {
            return Err(DropReason::UnexpectedResponse);
        }
        match pkt.repr.aeth.map(|a| a.syndrome) {
            Some(AethSyndrome::RnrNak { timer }) => return self.on_rnr_nak(now, psn, timer),
            Some(AethSyndrome::Nak(code)) => return self.on_nak(now, psn, code),
            _ => {}
        }
        match pkt.opcode().rc_equivalent() {
            Opcode::RcAcknowledge => {
                self.ack_through(now, psn);
                Ok(())
            }
            Opcode::RcAtomicAcknowledge => self.on_atomic_ack(now, pkt, mem),
            op if op.is_read() => self.on_read_response(now, pkt, mem),
            _ => Err(DropReason::UnexpectedResponse),
        }
    }

    /// Whether the requester side is active (responses are only accepted then).
    fn sending(&self) -> bool {
        matches!(self.state, QpState::Rts | QpState::Sqd)
    }

    fn on_rnr_nak(&mut self, now: Instant, psn: Psn, timer: u8) -> Result<(), DropReason> {
        self.counters.rnr_naks_received += 1;
        if self.req.rnr_until.is_some() && self.req.rnr_psn == psn {
            // A copy of the NAK we are already waiting out.
            return Err(DropReason::BadPsn);
        }
        // Everything before the NAKed PSN was executed.
        self.ack_through(now, psn - 1);
        if !self.sending() {
            return Ok(());
        }
        let Some(idx) = self.wqe_index_of(psn) else {
            return Err(DropReason::UnexpectedResponse);
        };
        if self.req.rnr_retry != 7 {
            if self.req.rnr_left == 0 {
                self.fail_wqe(idx, WcStatus::RnrRetryExcErr);
                return Ok(());
            }
            self.req.rnr_left -= 1;
        }
        // Go back now, so that nothing after the NAKed packet is sent during the wait; the
        // sequence-error NAK the responder sends for packets already in flight then finds the
        // retry under way and costs nothing.
        self.retry_from(psn);
        self.req.retry_psn = Some(psn);
        self.req.rnr_until = Some(now + rnr_delay(timer));
        self.req.rnr_psn = psn;
        self.req.retransmit_at = None;
        self.req.hole_at = None;
        Ok(())
    }

    fn on_nak(&mut self, now: Instant, psn: Psn, code: NakCode) -> Result<(), DropReason> {
        // Whether this may answer a tail probe, before what it acknowledges ends the stall.
        let probing = self.req.probe_attempt > 0;
        // A NAK acknowledges everything before its PSN.
        self.ack_through(now, psn - 1);
        if !self.sending() {
            return Ok(());
        }
        match code {
            NakCode::PsnSequenceError => {
                self.counters.seq_naks_received += 1;
                self.request_retry(now, psn, probing);
            }
            other => {
                let status = match other {
                    NakCode::InvalidRequest => WcStatus::RemInvReqErr,
                    NakCode::RemoteAccessError => WcStatus::RemAccessErr,
                    _ => WcStatus::RemOpErr,
                };
                let idx = self
                    .wqe_index_of(psn)
                    .or_else(|| self.first_outstanding())
                    .unwrap_or(0);
                self.fail_wqe(idx, status);
            }
        }
        Ok(())
    }

    /// Index of the started, unfinished WQE whose PSN range holds `psn`.
    pub(crate) fn wqe_index_of(&self, psn: Psn) -> Option<usize> {
        self.sq
            .iter()
            .position(|w| w.outstanding() && psn.in_range(w.first_psn, w.last_psn()))
    }

    /// Index of the oldest WQE still waiting for an acknowledgement or response.
    fn first_outstanding(&self) -> Option<usize> {
        self.sq.iter().position(SendWqe::outstanding)
    }

    /// Consumes one retry; false when the budget is exhausted.
    fn spend_retry(&mut self) -> bool {
        if self.req.retry_left == 0 {
            return false;
        }
        self.req.retry_left -= 1;
        true
    }

    /// Go-back-N from `psn`, because the responder told us (sequence NAK) that it is missing.
    /// Costs one retry, unless a go-back-N from `psn` or before is already under way (then the
    /// resend covers it; a NAK for the very PSN being resent is taken as new only a round trip
    /// after the resend began, when it answers the resend); fails the QP with
    /// `IBV_WC_RETRY_EXC_ERR` once the budget is spent.
    ///
    /// With `probing` (a tail probe was out), the NAK may have been drawn by a probe that
    /// overtook the packets it names: the go-back-N waits a round trip for them
    /// (`probe_nak`).
    fn request_retry(&mut self, now: Instant, psn: Psn, probing: bool) {
        if self.wqe_index_of(psn).is_none() {
            return;
        }
        if self.req.probe_nak.is_some() {
            // A NAK that may answer a probe waits already: what it names is resent if still
            // missing when the wait ends; later ones are dropped (the responder repeats its
            // NAK for packets with AckReq).
            return;
        }
        if probing && self.req.retry_psn.is_none() {
            let wait = self.req.rec.reorder_window();
            self.req.probe_nak = Some((psn, now + wait));
            return;
        }
        self.retry_now(now, psn);
    }

    /// The go-back-N of [`Self::request_retry`], without waiting.
    fn retry_now(&mut self, now: Instant, psn: Psn) {
        let Some(idx) = self.wqe_index_of(psn) else { return };
        if let Some(r) = self.req.retry_psn {
            if psn == r {
                // The PSN being resent is still missing: a copy of the NAK that started the
                // resend, or an answer to a resend that was lost too. Resending that one
                // packet covers both at the cost of a duplicate; the packets after it follow
                // with the pass under way or, once it lands, after the next NAK.
                let w = &self.sq[idx];
                if !w.wr.op.is_read_or_atomic() && self.req.rec.renak_is_new(now) {
                    self.resend_hole(now, psn);
                }
                return;
            }
            if !psn.is_before(r) {
                return;
            }
        }
        if !self.spend_retry() {
            self.fail_wqe(idx, WcStatus::RetryExcErr);
            return;
        }
        self.retry_from(psn);
        self.req.retry_psn = Some(psn);
        self.req.rec.on_loss(now, psn, self.req.sent_high, false);
        self.req.hole_attempt = 0;
        if !self.sq[idx].wr.op.is_read_or_atomic() {
            self.arm_hole(now);
        }
    }

    /// Resends the packet at `psn` on its own (the hole of the go-back-N under way) and waits
    /// a little longer before doing so again.
    fn resend_hole(&mut self, now: Instant, psn: Psn) {
        self.req.resend_hole = Some(psn);
        self.req.rec.on_resend_hole(now);
        self.req.hole_attempt += 1;
        self.arm_hole(now);
    }

    /// Asks again for the missing responses of the READ or atomic at `idx`, which the responder
    /// has executed (it answered something after it, or the end of its response stream arrived)
    /// while some responses were lost. Only that request is resent, as a duplicate the responder
    /// answers from its resources; the requests after it were executed and are not repeated.
    /// For a READ only the first hole is asked for.
    fn request_responses(&mut self, idx: usize) {
        let w = &self.sq[idx];
        let resume = w.resume_psn();
        if w.rereq_psn == Some(resume) || !w.fully_sent() {
            // Already asked at this point, or a go-back-N pass will send the request anyway.
            return;
        }
        if !self.spend_retry() {
            self.fail_wqe(idx, WcStatus::RetryExcErr);
            return;
        }
        self.request_responses_now(idx);
    }

    /// Marks the READ or atomic at `idx` to be asked for again (its first hole, for a READ).
    fn request_responses_now(&mut self, idx: usize) {
        let w = &mut self.sq[idx];
        w.rereq_psn = Some(w.resume_psn());
        if !w.rereq {
            w.rereq = true;
            self.req.rereq_pending += 1;
        }
        if matches!(w.wr.op, SendOp::Read { .. }) {
            w.req_end = w.hole_end();
        }
    }

    /// Everything up to and including `psn` is acknowledged: completes, in order, SEND/WRITE
    /// WQEs that end there and READ/atomic WQEs whose response already arrived. A READ or atomic
    /// still waiting for its response when a PSN at or past it is acknowledged lost its
    /// response (the responder executes in order): its responses are asked for again.
    pub(crate) fn ack_through(&mut self, now: Instant, psn: Psn) {
        // `acked_psn` is remembered for WQEs stuck behind an unanswered READ/atomic: once its
        // response arrives they complete without being sent again. A PSN acknowledged for the
        // first time is progress even when the window cannot move (a READ in front still waits
        // for its response): it resets the retry budget and ends the go-back-N under way, so a
        // new sequence NAK after it is acted upon.
        let mut progressed = false;
        if self.req.acked_psn.is_none_or(|a| psn.is_after(a)) {
            progressed = self.req.acked_psn.is_some();
            self.req.acked_psn = Some(psn);
        }
        let mut lost = false;
        while let Some(w) = self.sq.front() {
            if !w.started {
                break;
            }
            if w.done {
                progressed |= self.pop_completed();
                continue;
            }
            if w.wr.op.is_read_or_atomic() {
                lost = !psn.is_before(w.first_psn);
                break;
            }
            // A cumulative ACK at or past the last PSN proves the responder executed the WQE,
            // even if a late RNR NAK rewound it to be sent again meanwhile; but only once all
            // of it was sent at least once (an ACK for PSNs never sent proves nothing).
            if psn.is_before(w.last_psn()) || !self.req.sent_high.is_after(w.last_psn()) {
                break;
            }
            progressed |= self.pop_completed();
        }
        // The window base moves to psn + 1, but never past a READ or atomic whose response is
        // still missing: its (retried) responses must still be accepted. It moves at least to
        // the first unfinished WQE: a finished READ popped above may reach past psn.
        let mut next = psn + 1;
        if let Some(w) = self
            .sq
            .front()
            .filter(|w| w.outstanding() && w.wr.op.is_read_or_atomic())
        {
            if w.resume_psn().is_before(next) {
                next = w.resume_psn();
            }
        }
        let base = self.window_base();
        if base.is_after(next) {
            next = base;
        }
        let mut advanced = 0;
        if next.is_after(self.req.unacked) {
            advanced = self.req.unacked.distance(next);
            self.req.unacked = next;
            progressed = true;
            self.skip_acknowledged();
        }
        if self.req.rec.on_ack(now, psn + 1, advanced) {
            self.counters.spurious_timeouts += 1;
        }
        if progressed {
            self.on_progress(now);
        }
        if lost && self.sending() {
            self.request_responses(0);
        }
    }

    /// Pops the front WQE, which is finished, and completes it successfully.
    pub(crate) fn pop_completed(&mut self) -> bool {
        let Some(w) = self.sq.pop_front() else {
            return false;
        };
        if w.rereq {
            self.req.rereq_pending -= 1;
        }
        if w.wr.op.is_read_or_atomic() {
            // Released at completion, not when the response arrived: the responder keeps the
            // resources of the last max_dest_rd_atomic requests, and this one could still need
            // them as long as an earlier WQE may make us retry.
            self.req.outstanding_rd -= 1;
        }
        self.req.send_idx = self.req.send_idx.saturating_sub(1);
        self.complete_send(&w, WcStatus::Success);
        true
    }

    /// Resets the retry budgets and re-arms or stops the retransmit timer after progress.
    fn on_progress(&mut self, now: Instant) {
        self.req.retry_left = self.req.retry_cnt;
        self.req.rnr_left = self.req.rnr_retry;
        self.req.retry_psn = None;
        self.req.hole_at = None;
        self.req.hole_attempt = 0;
        self.req.probe_attempt = 0;
        self.req.rec.on_progress(now);
        let outstanding = self.has_outstanding();
        // During an RNR wait nothing is in flight that a timeout could recover.
        if outstanding && self.req.rnr_until.is_none() {
            self.arm_retransmit(now);
        } else {
            self.req.retransmit_at = None;
        }
        self.check_drained();
    }

    fn on_read_response(&mut self, now: Instant, pkt: &Rx<'_>, mem: &dyn Memory) -> Result<(), DropReason> {
        let psn = pkt.repr.bth.psn;
        let find = |sq: &std::collections::VecDeque<SendWqe>| {
            sq.iter().position(|w| {
                w.started
                    && (matches!(w.wr.op, SendOp::Read { .. }) || w.wr.op.is_placement())
                    && psn.in_range(w.first_psn, w.last_psn())
            })
        };
        let Some(idx) = find(&self.sq) else {
            return Err(DropReason::UnexpectedResponse);
        };
        if self.sq[idx].done {
            self.counters.duplicates += 1;
            return Err(DropReason::BadPsn);
        }
        // A response also acknowledges every earlier request.
        let first = self.sq[idx].first_psn;
        if first.is_after(self.req.unacked) {
            self.ack_through(now, first - 1);
            if !self.sending() {
                return Ok(());
            }
        }
        let Some(idx) = find(&self.sq) else { return Ok(()) };
        let mtu = u64::from(self.mtu());
        let w = &self.sq[idx];
        let k = first.distance(psn);
        let ends_stream = k + 1 == w.npsn;
        // The last packet the latest request for this READ asked for.
        let ends_request = k + 1 == w.req_end;
        if w.resp_has(k) {
            self.counters.duplicates += 1;
            if ends_request && w.resp_count < w.npsn {
                // The end of a response stream again, with a hole still open: ask again.
                self.request_responses(idx);
            }
            return Err(DropReason::BadPsn);
        }
        // Packet k carries bytes [k * MTU, ...): FIRST and MIDDLE exactly one MTU, the last one
        // the rest. Checked by position rather than opcode, because a retried READ may resume
        // with either FIRST or MIDDLE, and a hole may be asked for on its own.
        let offset = u64::from(k) * mtu;
        let want = if ends_stream {
            w.len.saturating_sub(offset)
        } else {
            mtu
        };
        if pkt.data.len() as u64 != want {
            self.fail_wqe(idx, WcStatus::BadRespErr);
            return Ok(());
        }
        if let Err(e) = scatter(mem, (self.cfg.pd, self.cfg.qpn), &w.wr.payload, offset, pkt.data) {
            self.fail_wqe(idx, scatter_status(e));
            return Ok(());
        }
        let w = &mut self.sq[idx];
        w.resp_mark(k);
        let (complete, base) = (w.resp_count == w.npsn, w.resume_psn());
        // The end of what was asked for arrived with responses still missing: they were lost
        // (or are reordered, in which case asking again only produces duplicates).
        let holes = !complete && ends_request;
        if idx == 0 && base.is_after(self.req.unacked) {
            self.req.unacked = base;
        }
        if complete {
            w.done = true;
            self.complete_finished(now);
        } else {
            self.on_progress(now);
            if holes {
                self.request_responses(idx);
            }
        }
        Ok(())
    }

    fn on_atomic_ack(&mut self, now: Instant, pkt: &Rx<'_>, mem: &dyn Memory) -> Result<(), DropReason> {
        let psn = pkt.repr.bth.psn;
        let Some(orig) = pkt.repr.atomic_ack_eth.map(|a| a.orig) else {
            return Err(DropReason::UnexpectedResponse);
        };
        let find = |sq: &std::collections::VecDeque<SendWqe>| {
            sq.iter()
                .position(|w| w.started && w.wr.op.is_atomic() && w.first_psn == psn)
        };
        let Some(idx) = find(&self.sq) else {
            return Err(DropReason::UnexpectedResponse);
        };
        if self.sq[idx].done {
            self.counters.duplicates += 1;
            return Err(DropReason::BadPsn);
        }
        if psn.is_after(self.req.unacked) {
            self.ack_through(now, psn - 1);
            if !self.sending() {
                return Ok(());
            }
        }
        let Some(idx) = find(&self.sq) else { return Ok(()) };
        let w = &self.sq[idx];
        // The original value lands in the local buffer in host byte order.
        if let Err(e) = scatter(
            mem,
            (self.cfg.pd, self.cfg.qpn),
            &w.wr.payload,
            0,
            RxData::Bytes(&orig.to_ne_bytes()),
        ) {
            self.fail_wqe(idx, scatter_status(e));
            return Ok(());
        }
        self.sq[idx].done = true;
        if idx == 0 && (psn + 1).is_after(self.req.unacked) {
            self.req.unacked = psn + 1;
        }
        self.complete_finished(now);
        Ok(())
    }

    /// After a READ or atomic finished: completes the finished WQEs at the front, in order,
    /// and the SEND/WRITE WQEs behind them that were acknowledged meanwhile.
    fn complete_finished(&mut self, now: Instant) {
        while self.sq.front().is_some_and(|w| w.done) {
            self.pop_completed();
        }
        let base = self.window_base();
        if base.is_after(self.req.unacked) {
            self.req.unacked = base;
        }
        // A WQE completed: that is progress, whatever happens next (it must not be skipped
        // when the acknowledgements below find the next WQE's response missing).
        self.on_progress(now);
        if let Some(acked) = self.req.acked_psn {
            let next = self.req.next_psn;
            if self
                .sq
                .front()
                .is_some_and(|w| w.started && acked.in_range(w.first_psn, next - 1))
            {
                self.ack_through(now, acked);
            }
        }
    }

    /// After a go-back-N, an acknowledgement may cover packets still waiting to be resent
    /// (the originals had arrived after all): the send position moves past them, since the
    /// responder has them. Left there, it would lie before the window's base, which the window
    /// test reads as a full window: nothing would be sent until the next timer expiry.
    fn skip_acknowledged(&mut self) {
        let unacked = self.req.unacked;
        for w in self.sq.iter_mut() {
            if !w.started || !w.first_psn.is_before(unacked) {
                break;
            }
            if w.wr.op.is_read_or_atomic() || w.done {
                continue;
            }
            let acked = w.first_psn.distance(unacked).min(w.request_packets());
            w.next_pkt = w.next_pkt.max(acked);
        }
    }

    /// The first PSN not known to be finished, judging by the front WQE alone: everything
    /// before the front WQE is complete.
    fn window_base(&self) -> Psn {
        match self.sq.front() {
            Some(w) if w.started && w.wr.op.is_read_or_atomic() => w.resume_psn(),
            Some(w) if w.started => w.first_psn,
            _ => self.req.next_psn,
        }
    }

    /// Go-back-N: resend from `psn`, which lies in a started, unfinished WQE. Later started WQEs
    /// are resent whole; READs keep the response packets they already placed.
    pub(crate) fn retry_from(&mut self, psn: Psn) {
        let Some(idx) = self.wqe_index_of(psn) else {
            return;
        };
        for (i, w) in self.sq.iter_mut().enumerate().skip(idx) {
            if !w.outstanding() {
                continue;
            }
            w.next_pkt = if i == idx && !w.wr.op.is_read_or_atomic() {
                w.first_psn.distance(psn)
            } else {
                0
            };
            // The pass sends the READ/atomic request itself.
            if std::mem::take(&mut w.rereq) {
                self.req.rereq_pending -= 1;
            }
            w.rereq_psn = None;
        }
        self.req.send_idx = self.req.send_idx.min(idx);
        self.req.since_ackreq = 0;
        self.req.retransmit_at = None;
    }

    /// Nothing was acknowledged for a while although packets are in flight and the window
    /// (or the send queue) lets nothing new go: resend the newest SEND or WRITE packet with
    /// AckReq. If the flight arrived and only its ACK was lost, the responder acknowledges the
    /// duplicate; if the tail was lost, the probe lands past the hole and draws a sequence NAK.
    /// Either way recovery starts a round trip later instead of at the retransmission timer.
    fn probe_tail(&mut self, now: Instant) {
        if !self.sending()
            || self.req.rnr_until.is_some()
            || self.req.retry_psn.is_some()
            || self.req.resend_hole.is_some()
            || self.can_start_or_continue()
        {
            return;
        }
        let psn = self.req.sent_high - 1;
        let Some(idx) = self.wqe_index_of(psn) else { return };
        if self.sq[idx].wr.op.is_read_or_atomic() || !self.req.unacked.is_before(self.req.sent_high) {
            return;
        }
        self.req.probe = Some(psn);
        self.req.probe_attempt += 1;
        // The probe or its answer may be lost too: probe again, later, until the timer fires.
        self.arm_probe(now);
    }

    /// Handles expired timers.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.paced_until.is_some_and(|t| now >= t) {
            // The held frame may go: the next poll_transmit sends it.
            self.paced_until = None;
        }
        if self.req.hole_at.is_some_and(|t| now >= t) {
            self.req.hole_at = None;
            let hole = self
                .req
                .retry_psn
                .filter(|_| self.sending() && self.req.rnr_until.is_none());
            if let Some(psn) = hole {
                if self.wqe_index_of(psn).is_some() {
                    self.resend_hole(now, psn);
                }
            }
        }
        if self.req.rnr_until.is_some_and(|t| now >= t) {
            // The RNR wait is over: the requester already went back to the NAKed packet. The
            // responder answered, so no stall is counted from before the wait.
            self.req.rnr_until = None;
            self.req.rec.on_progress(now);
        }
        if self.req.probe_at.is_some_and(|t| now >= t) {
            self.req.probe_at = None;
            self.probe_tail(now);
        }
        if let Some((psn, _)) = self.req.probe_nak.filter(|(_, at)| now >= *at) {
            self.req.probe_nak = None;
            // Still the first PSN missing a round trip after the NAK: lost, not overtaken.
            if self.sending() && self.req.rnr_until.is_none() && !self.req.unacked.is_after(psn) {
                self.retry_now(now, psn);
            }
        }
        let Some(t) = self.req.retransmit_at else { return };
        if now < t {
            return;
        }
        self.req.retransmit_at = None;
        if !self.sending() || self.req.rnr_until.is_some() {
            return;
        }
        let Some(idx) = self.first_outstanding() else {
            return;
        };
        self.counters.timeouts += 1;
        // The timer runs at the measured pace; the retry budget is spent once per configured
        // timeout of stall, as IBTA counts retries.
        if let Some(configured) = ack_timeout(self.attr.timeout) {
            for _ in 0..self.req.rec.charge(now, configured) {
                if !self.spend_retry() {
                    self.fail_wqe(idx, WcStatus::RetryExcErr);
                    return;
                }
            }
        }
        let sent_high = self.req.sent_high;
        let w = &self.sq[idx];
        let executed = self
            .req
            .acked_psn
            .is_some_and(|a| a.in_range(w.first_psn, self.req.next_psn - 1));
        if w.wr.op.is_read_or_atomic() && executed && w.fully_sent() {
            // The responder acknowledged a later PSN, so it executed this request: only the
            // responses are missing. Ask for them alone rather than resending everything after.
            let resume = w.resume_psn();
            self.req.rec.on_loss(now, resume, sent_high, true);
            self.sq[idx].rereq_psn = None;
            self.request_responses_now(idx);
            return;
        }
        let resume = if w.wr.op.is_read_or_atomic() {
            w.resume_psn()
        } else if self.req.unacked.is_after(w.first_psn) {
            self.req.unacked
        } else {
            w.first_psn
        };
        self.retry_from(resume);
        self.req.retry_psn = Some(resume);
        self.req.rec.on_loss(now, resume, sent_high, true);
    }
}

/// The local status of a failed scatter into a READ or atomic result buffer.
fn scatter_status(e: ScatterError) -> WcStatus {
    match e {
        ScatterError::Length => WcStatus::LocLenErr,
        ScatterError::Mem(m) => m.local_status(),
    }
}
