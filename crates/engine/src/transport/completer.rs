//! The completer: consumes ACKs, NAKs and responses, completes send WQEs in order, and owns the
//! retransmit and RNR timers.

use softverbs_wire::{AethSyndrome, NakCode, Opcode, ParsedPacket, Psn};

use super::{ack_timeout, rnr_delay, DropReason, QpEngine};
use crate::memory::{Access, KeyRef, MemError, Memory};
use crate::time::Instant;
use crate::types::{QpState, QpType, WcStatus};
use crate::wr::{Payload, SendOp};

/// Copies `src` into the scatter list starting `offset` bytes in; fails if it does not fit.
pub(crate) fn scatter(mem: &dyn Memory, pd: u32, payload: &Payload, offset: u64, src: &[u8]) -> Result<(), ScatterError> {
    let Payload::Sges(sges) = payload else { return Err(ScatterError::Length) };
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
    pd: u32,
    sges: &[crate::types::Sge],
    offset: u64,
    src: &[u8],
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
        let key = KeyRef { key: sge.lkey, pd, access: Access::LocalWrite };
        mem.write(key, sge.addr + skip, &src[done..done + take]).map_err(ScatterError::Mem)?;
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
    pub(crate) fn handle_response(&mut self, now: Instant, pkt: &ParsedPacket<'_>, mem: &dyn Memory) -> Result<(), DropReason> {
        if self.cfg.qp_type != QpType::Rc {
            return Err(DropReason::WrongTransport);
        }
        if !matches!(self.state, QpState::Rts | QpState::Sqd) {
            return Err(DropReason::NotReceiving);
        }
        let psn = pkt.repr.bth.psn;
        let opcode = pkt.opcode();
        // A response must fall in [unacked, next_psn).
        if psn.is_before(self.req.unacked) || !psn.is_before(self.req.next_psn) {
            return Err(DropReason::UnexpectedResponse);
        }
        let syndrome = pkt.repr.aeth.map(|a| a.syndrome);
        match syndrome {
            Some(AethSyndrome::RnrNak { timer }) => {
                self.counters.rnr_naks_received += 1;
                self.ack_through(now, psn - 1, mem);
                if self.req.rnr_retry != 7 {
                    if self.req.rnr_left == 0 {
                        let idx = self.wqe_index_of(psn);
                        self.fail_wqe(idx.unwrap_or(0), WcStatus::RnrRetryExcErr);
                        return Ok(());
                    }
                    self.req.rnr_left -= 1;
                }
                self.req.rnr_until = Some(now + rnr_delay(timer));
                self.req.rnr_psn = psn;
                self.req.retransmit_at = None;
                return Ok(());
            }
            Some(AethSyndrome::Nak(code)) => {
                self.ack_through(now, psn - 1, mem);
                match code {
                    NakCode::PsnSequenceError => {
                        self.counters.seq_naks_received += 1;
                        if !self.spend_retry() {
                            let idx = self.wqe_index_of(psn);
                            self.fail_wqe(idx.unwrap_or(0), WcStatus::RetryExcErr);
                        } else {
                            self.retry_from(psn);
                        }
                    }
                    other => {
                        let status = match other {
                            NakCode::InvalidRequest => WcStatus::RemInvReqErr,
                            NakCode::RemoteAccessError => WcStatus::RemAccessErr,
                            _ => WcStatus::RemOpErr,
                        };
                        let idx = self.wqe_index_of(psn);
                        self.fail_wqe(idx.unwrap_or(0), status);
                    }
                }
                return Ok(());
            }
            _ => {}
        }
        match opcode {
            Opcode::RcAcknowledge => {
                self.ack_through(now, psn, mem);
                Ok(())
            }
            Opcode::RcAtomicAcknowledge => self.on_atomic_ack(now, pkt, mem),
            op if op.is_read() => self.on_read_response(now, pkt, mem),
            _ => Err(DropReason::UnexpectedResponse),
        }
    }

    /// Index of the started WQE whose PSN range holds `psn`.
    fn wqe_index_of(&self, psn: Psn) -> Option<usize> {
        self.sq.iter().position(|w| w.started && !w.done && psn.in_range(w.first_psn, w.last_psn()))
    }

    /// Consumes one retry; false when the budget is exhausted.
    fn spend_retry(&mut self) -> bool {
        if self.req.retry_left == 0 {
            return false;
        }
        self.req.retry_left -= 1;
        true
    }

    /// Everything up to and including `psn` is acknowledged: completes SEND/WRITE WQEs that end
    /// there, in order. A READ or atomic still waiting for its response when a later PSN is
    /// acknowledged lost its response: that triggers a retry from it.
    pub(crate) fn ack_through(&mut self, now: Instant, psn: Psn, _mem: &dyn Memory) {
        let mut progressed = false;
        while let Some(w) = self.sq.front() {
            if !w.started || psn.is_before(w.first_psn) {
                break;
            }
            if w.wr.op.is_read_or_atomic() {
                // An ACK beyond an unanswered READ/atomic: its response was lost (implied NAK).
                if !psn.is_before(w.first_psn) {
                    let resume = w.first_psn + w.resp_pkts;
                    if self.spend_retry() {
                        self.retry_from(resume);
                    } else {
                        self.fail_wqe(0, WcStatus::RetryExcErr);
                    }
                }
                break;
            }
            if psn.is_before(w.last_psn()) || !w.fully_sent() {
                break;
            }
            let w = self.sq.pop_front().expect("front exists");
            self.req.send_idx = self.req.send_idx.saturating_sub(1);
            self.complete_send(&w, WcStatus::Success);
            progressed = true;
        }
        let next = psn + 1;
        if next.is_after(self.req.unacked) {
            self.req.unacked = next;
            progressed = true;
        }
        if progressed {
            self.on_progress(now);
        }
    }

    /// Resets the retry budgets and re-arms or stops the retransmit timer after progress.
    fn on_progress(&mut self, now: Instant) {
        self.req.retry_left = self.req.retry_cnt;
        self.req.rnr_left = self.req.rnr_retry;
        let outstanding = self.sq.iter().any(|w| w.started && !w.done);
        self.req.retransmit_at = if outstanding { ack_timeout(self.attr.timeout).map(|t| now + t) } else { None };
        self.check_drained();
    }

    fn on_read_response(&mut self, now: Instant, pkt: &ParsedPacket<'_>, mem: &dyn Memory) -> Result<(), DropReason> {
        let psn = pkt.repr.bth.psn;
        let idx = self.sq.iter().position(|w| w.started && !w.done && w.wr.op.is_read_or_atomic());
        let Some(idx) = idx else { return Err(DropReason::UnexpectedResponse) };
        if !matches!(self.sq[idx].wr.op, SendOp::Read { .. }) {
            return Err(DropReason::UnexpectedResponse);
        }
        let (first, expected) = {
            let w = &self.sq[idx];
            (w.first_psn, w.first_psn + w.resp_pkts)
        };
        if psn.is_before(first) {
            return Err(DropReason::UnexpectedResponse);
        }
        // The response also acknowledges every earlier request.
        if idx > 0 || first.is_after(self.req.unacked) {
            self.ack_through(now, first - 1, mem);
        }
        let Some(idx) = self.sq.iter().position(|w| w.started && !w.done && w.wr.op.is_read_or_atomic()) else {
            return Ok(());
        };
        if psn.is_before(expected) {
            self.counters.duplicates += 1;
            return Err(DropReason::BadPsn);
        }
        if psn != expected {
            // Responses in between were lost: go back to the first missing one.
            if self.spend_retry() {
                self.retry_from(expected);
            } else {
                self.fail_wqe(idx, WcStatus::RetryExcErr);
            }
            return Ok(());
        }
        let mtu = u64::from(self.mtu());
        let w = &self.sq[idx];
        let offset = u64::from(w.resp_pkts) * mtu;
        let payload = pkt.payload;
        let ends = pkt.opcode().ends_message();
        let bad_len = if ends {
            offset + payload.len() as u64 != w.len
        } else {
            payload.len() as u64 != mtu || offset + mtu >= w.len
        };
        if bad_len {
            self.fail_wqe(idx, WcStatus::BadRespErr);
            return Ok(());
        }
        if let Err(e) = scatter(mem, self.cfg.pd, &w.wr.payload, offset, payload) {
            let status = match e {
                ScatterError::Length => WcStatus::LocLenErr,
                ScatterError::Mem(m) => m.local_status(),
            };
            self.fail_wqe(idx, status);
            return Ok(());
        }
        let w = &mut self.sq[idx];
        w.resp_pkts += 1;
        let last = w.last_psn();
        if ends {
            w.done = true;
            self.req.outstanding_rd -= 1;
            self.ack_through_responses(now, last);
        } else {
            self.req.unacked = psn + 1;
            self.on_progress(now);
        }
        Ok(())
    }

    fn on_atomic_ack(&mut self, now: Instant, pkt: &ParsedPacket<'_>, mem: &dyn Memory) -> Result<(), DropReason> {
        let psn = pkt.repr.bth.psn;
        let Some(orig) = pkt.repr.atomic_ack_eth.map(|a| a.orig) else { return Err(DropReason::UnexpectedResponse) };
        let Some(idx) = self.sq.iter().position(|w| w.started && !w.done && w.wr.op.is_read_or_atomic()) else {
            return Err(DropReason::UnexpectedResponse);
        };
        let first = self.sq[idx].first_psn;
        if !self.sq[idx].wr.op.is_atomic() || psn != first {
            if psn.is_after(first) && self.sq[idx].wr.op.is_atomic() {
                // The expected ATOMIC ACK was lost.
                if self.spend_retry() {
                    self.retry_from(first);
                } else {
                    self.fail_wqe(idx, WcStatus::RetryExcErr);
                }
                return Ok(());
            }
            return Err(DropReason::UnexpectedResponse);
        }
        if first.is_after(self.req.unacked) {
            self.ack_through(now, first - 1, mem);
        }
        let Some(idx) = self.sq.iter().position(|w| w.started && !w.done && w.wr.op.is_read_or_atomic()) else {
            return Ok(());
        };
        let w = &self.sq[idx];
        if let Err(e) = scatter(mem, self.cfg.pd, &w.wr.payload, 0, &orig.to_ne_bytes()) {
            let status = match e {
                ScatterError::Length => WcStatus::LocLenErr,
                ScatterError::Mem(m) => m.local_status(),
            };
            self.fail_wqe(idx, status);
            return Ok(());
        }
        self.sq[idx].done = true;
        self.req.outstanding_rd -= 1;
        self.ack_through_responses(now, psn);
        Ok(())
    }

    /// After a READ or atomic finished at `last`: pops completed WQEs from the front in order.
    fn ack_through_responses(&mut self, now: Instant, last: Psn) {
        while let Some(w) = self.sq.front() {
            if !w.done {
                break;
            }
            let w = self.sq.pop_front().expect("front exists");
            self.req.send_idx = self.req.send_idx.saturating_sub(1);
            self.complete_send(&w, WcStatus::Success);
        }
        let next = last + 1;
        if next.is_after(self.req.unacked) {
            self.req.unacked = next;
        }
        self.on_progress(now);
    }

    /// Go-back-N: resend from `psn`, which lies in a started, incomplete WQE.
    pub(crate) fn retry_from(&mut self, psn: Psn) {
        let Some(idx) = self.wqe_index_of(psn) else {
            return;
        };
        let mtu = self.mtu();
        for (i, w) in self.sq.iter_mut().enumerate().skip(idx) {
            if !w.started || w.done {
                continue;
            }
            if i == idx {
                let k = w.first_psn.distance(psn);
                if w.wr.op.is_read_or_atomic() {
                    w.resp_pkts = if matches!(w.wr.op, SendOp::Read { .. }) { k } else { 0 };
                    w.next_pkt = 0;
                } else {
                    w.next_pkt = k;
                }
            } else {
                w.next_pkt = 0;
                if matches!(w.wr.op, SendOp::Read { .. }) {
                    w.resp_pkts = 0;
                }
            }
        }
        let _ = mtu;
        self.req.send_idx = idx;
        self.req.since_ackreq = 0;
        self.req.retransmit_at = None;
    }

    /// Handles expired timers.
    pub fn handle_timeout(&mut self, now: Instant) {
        if let Some(t) = self.req.rnr_until {
            if now >= t {
                self.req.rnr_until = None;
                let psn = self.req.rnr_psn;
                self.retry_from(psn);
            }
        }
        if let Some(t) = self.req.retransmit_at {
            if now >= t {
                self.req.retransmit_at = None;
                let outstanding = self.sq.iter().any(|w| w.started && !w.done);
                if !outstanding || !matches!(self.state, QpState::Rts | QpState::Sqd) {
                    return;
                }
                self.counters.timeouts += 1;
                if self.spend_retry() {
                    let resume = self
                        .sq
                        .iter()
                        .find(|w| w.started && !w.done)
                        .map(|w| if matches!(w.wr.op, SendOp::Read { .. }) { w.first_psn + w.resp_pkts } else { self.req.unacked.max_in(w.first_psn) })
                        .unwrap_or(self.req.unacked);
                    self.retry_from(resume);
                } else {
                    let idx = self.sq.iter().position(|w| w.started && !w.done).unwrap_or(0);
                    self.fail_wqe(idx, WcStatus::RetryExcErr);
                }
            }
        }
    }
}

/// Small helper: the later of two PSNs in wrap-aware order.
trait PsnExt {
    fn max_in(self, other: Psn) -> Psn;
}

impl PsnExt for Psn {
    fn max_in(self, other: Psn) -> Psn {
        if self.is_before(other) {
            other
        } else {
            self
        }
    }
}
