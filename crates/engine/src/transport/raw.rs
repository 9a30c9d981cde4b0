//! Raw packet QPs: a send WQE is one whole Ethernet frame (from the destination MAC, no FCS),
//! or with `IBV_WR_TSO` a header and a TCP payload cut into frames; a receive WQE takes one
//! whole frame. There is no transport header, PSN or acknowledgement:
//! a send completes once its frame is handed to the driver.

use super::completer::{scatter_sges, ScatterError};
use super::external::RxData;
use super::requester::gather;
use super::{Dest, DropReason, QpEngine, RecvSource, Transmit, WorkQueue};
use crate::memory::Memory;
use crate::time::Instant;
use crate::tso::{parse_header, segment};
use crate::types::{Gid, QpState, RecvWr, WcOpcode, WcStatus, WorkCompletion};
use crate::wr::{Payload, SendOp};

/// Scatters a received frame into `wr` and returns its completion (`IBV_WC_RECV`, `byte_len` the
/// frame length, `flow_tag` the steering flow's tag). The status is `IBV_WC_LOC_LEN_ERR` if
/// the frame does not fit, or the key error if a buffer is not usable.
pub fn receive_frame(
    mem: &dyn Memory,
    pd: u32,
    qpn: u32,
    wr: &RecvWr,
    frame: &[u8],
    flow_tag: u32,
) -> WorkCompletion {
    let status = match scatter_sges(mem, (pd, qpn), &wr.sg_list, 0, RxData::Bytes(frame)) {
        Ok(()) => WcStatus::Success,
        Err(ScatterError::Length) => WcStatus::LocLenErr,
        Err(ScatterError::Mem(e)) => e.local_status(),
    };
    let mut wc = WorkCompletion::error(wr.wr_id, status, WcOpcode::Recv, qpn);
    if status == WcStatus::Success {
        wc.byte_len = frame.len() as u32;
        wc.flow_tag = flow_tag;
    }
    wc
}

impl QpEngine {
    /// Sends the frame of the oldest send WQE of a raw QP and completes it.
    /// Under a rate limit the WQE waits until the token bucket has room for its bytes.
    pub(crate) fn generate_raw(&mut self, now: Instant, mem: &dyn Memory) {
        if self.state != QpState::Rts {
            return;
        }
        let Some(w) = self.sq.front() else {
            return;
        };
        if let Some(p) = &mut self.pacer {
            if let Some(at) = p.admit(now, w.len as usize) {
                self.paced_until = Some(at);
                return;
            }
            self.paced_until = None;
        }
        let mut bytes = vec![0; w.len as usize];
        if let Err(e) = gather(mem, (self.cfg.pd, self.cfg.qpn), &w.wr.payload, 0, &mut bytes) {
            self.fail_wqe(0, e.local_status());
            return;
        }
        let frames = match (&w.wr.op, &w.wr.payload) {
            (SendOp::Tso { mss }, Payload::Headed { header, .. }) => {
                let (hdr, data) = bytes.split_at(header.len());
                match parse_header(hdr) {
                    Ok(layout) => segment(hdr, layout, data, usize::from(*mss)),
                    // Checked at post time; unreachable for a checked WR.
                    Err(_) => {
                        self.fail_wqe(0, WcStatus::LocQpOpErr);
                        return;
                    }
                }
            }
            _ => vec![bytes],
        };
        for data in frames {
            self.push_out(Transmit {
                dest: Dest {
                    dgid: Gid::ZERO,
                    sgid_index: 0,
                    traffic_class: 0,
                    hop_limit: 0,
                    flow_label: 0,
                },
                data,
                external: None,
            });
            self.counters.tx_packets += 1;
        }
        let w = self.sq.pop_front().expect("the front WQE");
        self.complete_send(&w, WcStatus::Success);
    }

    /// Delivers a frame steered to this raw QP into its next receive WQE. A frame that does not
    /// fit fails its WQE and moves the QP to the error state, as any receive error does.
    pub fn handle_frame(
        &mut self,
        frame: &[u8],
        flow_tag: u32,
        mem: &dyn Memory,
        srq: Option<&mut dyn RecvSource>,
    ) -> Result<(), DropReason> {
        if !matches!(self.state, QpState::Rtr | QpState::Rts) {
            self.counters.rx_dropped += 1;
            return Err(DropReason::NotReceiving);
        }
        let wr = match srq {
            Some(s) => s.take(),
            None => self.rq.pop_front(),
        };
        let Some(wr) = wr else {
            self.counters.rx_dropped += 1;
            return Err(DropReason::NoReceiveWqe);
        };
        let wc = receive_frame(mem, self.cfg.pd, self.cfg.qpn, &wr, frame, flow_tag);
        let failed = wc.status != WcStatus::Success;
        self.push_cqe(WorkQueue::Recv, wc);
        if failed {
            self.enter_error();
        }
        Ok(())
    }
}
