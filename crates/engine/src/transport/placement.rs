//! How an incoming SEND is received: which buffer, which bytes of the message land in it, and
//! how it completes. A plain receive takes the whole message and completes `IBV_WC_RECV`; a
//! tag-matching SRQ decides per message (from the first packet's headers) to skip its headers,
//! place nothing (a rendezvous request, whose data comes by READ), or report a match early.

use super::WorkQueue;
use crate::tm::TmInfo;
use crate::types::{RecvWr, WcFlags, WcOpcode, WcStatus, WorkCompletion};

/// Placement and completion of one incoming SEND message, chosen at its first packet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecvPlacement {
    /// The buffer, and the `wr_id` its completions carry.
    pub wqe: RecvWr,
    /// Leading bytes of the message that are not placed (the headers of a matched message).
    pub skip: u64,
    /// At most this many bytes are placed and the rest dropped; `None`: every byte after
    /// `skip` must fit the buffer (otherwise `IBV_WC_LOC_LEN_ERR`).
    pub limit: Option<u64>,
    /// Where the completions go. [`WorkQueue::Internal`] hands the end of the message back to
    /// the driver (a rendezvous request it must act on).
    pub queue: WorkQueue,
    /// Completion opcode.
    pub opcode: WcOpcode,
    /// Completion status at the end of a message received whole.
    pub status: WcStatus,
    /// Completion flags at the end of the message.
    pub flags: WcFlags,
    /// Tag-matching information of the completions.
    pub tm_info: TmInfo,
    /// A completion with these flags when the message starts, if it spans several packets
    /// (a match is reported at once, its data when complete).
    pub early_flags: Option<WcFlags>,
}

impl RecvPlacement {
    /// An ordinary receive: the whole message into `wqe`, completing `IBV_WC_RECV`.
    pub fn plain(wqe: RecvWr) -> Self {
        Self {
            wqe,
            skip: 0,
            limit: None,
            queue: WorkQueue::Recv,
            opcode: WcOpcode::Recv,
            status: WcStatus::Success,
            flags: WcFlags::empty(),
            tm_info: TmInfo::default(),
            early_flags: None,
        }
    }

    /// The part of a packet carrying message bytes `offset..offset + len` that is placed, as
    /// (range within the packet, offset within the buffer).
    pub(crate) fn window(&self, offset: u64, len: u64) -> Option<(std::ops::Range<usize>, u64)> {
        let lo = self.skip;
        let hi = self.limit.map_or(u64::MAX, |l| lo.saturating_add(l));
        let start = offset.max(lo);
        let end = (offset + len).min(hi);
        (start < end).then(|| (((start - offset) as usize)..((end - offset) as usize), start - lo))
    }

    /// Bytes placed of a message of `total` bytes.
    pub(crate) fn placed(&self, total: u64) -> u64 {
        let n = total.saturating_sub(self.skip);
        self.limit.map_or(n, |l| n.min(l))
    }

    /// A completion of this placement, with status `status` and flags `flags`.
    pub(crate) fn completion(
        &self,
        status: WcStatus,
        flags: WcFlags,
        qpn: u32,
        src_qp: u32,
    ) -> WorkCompletion {
        let mut wc = WorkCompletion::error(self.wqe.wr_id, status, self.opcode, qpn);
        wc.wc_flags = flags;
        wc.src_qp = src_qp;
        wc.tm_info = self.tm_info;
        wc
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows() {
        let mut p = RecvPlacement::plain(RecvWr::default());
        assert_eq!(p.window(0, 100), Some((0..100, 0)));
        p.skip = 16;
        assert_eq!(p.window(0, 100), Some((16..100, 0)));
        assert_eq!(p.window(100, 50), Some((0..50, 84)));
        assert_eq!(p.window(0, 10), None);
        assert_eq!(p.placed(150), 134);
        p.limit = Some(0);
        assert_eq!(p.window(0, 100), None);
        assert_eq!(p.placed(150), 0);
        p.skip = 0;
        p.limit = Some(40);
        assert_eq!(p.window(0, 32), Some((0..32, 0)));
        assert_eq!(p.window(32, 32), Some((0..8, 32)));
        assert_eq!(p.placed(64), 40);
    }
}
