//! What the harness remembers to judge the engine's outputs: posted work requests, the PSNs a
//! requester sent, and the spans of memory an input may write.

use std::collections::VecDeque;

use softverbs_engine::types::{AccessFlags, Sge};
use softverbs_engine::wr::{SendOp, UdDest};
use softverbs_wire::Psn;

use crate::sim::Mr;

/// A send WR the engine has and has not completed yet.
#[derive(Debug, Clone)]
pub(crate) struct PostedSend {
    pub(crate) wr_id: u64,
    pub(crate) signaled: bool,
    pub(crate) op: SendOp,
    pub(crate) len: u64,
    /// READ and atomics: where the response lands.
    pub(crate) sges: Vec<Sge>,
    pub(crate) ud: Option<UdDest>,
    /// The step it was posted at.
    pub(crate) posted: usize,
    /// READ: the PSNs its first request reserved (first, count), once sent.
    pub(crate) psns: Option<(Psn, u32)>,
}

/// A receive WR posted and not completed yet.
#[derive(Debug, Clone)]
pub(crate) struct PostedRecv {
    pub(crate) wr_id: u64,
    pub(crate) sges: Vec<Sge>,
    pub(crate) posted: usize,
}

/// What an input that wrote memory was doing, to tell a message's own placement from other
/// writes to the same bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tag {
    /// Placing a SEND into this receive WR (the oldest one outstanding).
    Recv(u64),
    /// A response with this PSN, to QP `usize`.
    Response(usize, Psn),
    Other,
}

/// A write the engine made, in the faithful mode's log.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Write {
    pub(crate) start: u64,
    pub(crate) end: u64,
    pub(crate) step: usize,
    pub(crate) tag: Tag,
}

/// Whether two entries of a scatter list share a byte (the later write of it wins, so the
/// list does not read back as the message).
pub(crate) fn self_overlapping(sges: &[Sge]) -> bool {
    sges.iter().enumerate().any(|(i, a)| {
        sges[i + 1..].iter().any(|b| {
            a.addr < b.addr.saturating_add(u64::from(b.length))
                && b.addr < a.addr.saturating_add(u64::from(a.length))
        })
    })
}

/// Whether a write since `since` overlapping `[start, start + len)` is not `own`'s.
pub(crate) fn tainted(log: &[Write], since: usize, start: u64, len: u64, own: impl Fn(Tag) -> bool) -> bool {
    let end = start.saturating_add(len);
    log.iter()
        .any(|w| w.step >= since && w.start < end && start < w.end && !own(w.tag))
}

/// A message the responder must execute next (faithful mode, reliable transports): the
/// receive it consumes must complete with these bytes and this immediate data.
#[derive(Debug, Clone)]
pub(crate) struct Expected {
    pub(crate) wr_id: u64,
    /// The payload as it was at post time; `None` if it cannot be read (the WR will fail).
    pub(crate) data: Option<Vec<u8>>,
    /// Where the payload is, on the sender's node.
    pub(crate) src: Vec<(u64, u64)>,
    pub(crate) posted: usize,
    pub(crate) len: u64,
    pub(crate) imm: Option<u32>,
    pub(crate) inv: Option<u32>,
    /// RDMA WRITE with immediate: consumes a receive, places nothing in it.
    pub(crate) write_imm: bool,
    pub(crate) xrc_srqn: Option<u32>,
}

/// The request PSNs a requester emitted since it entered RTS: new PSNs come in order (a READ
/// reserves one per response packet), anything else must resend a PSN already used.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct PsnTrack {
    first: Option<Psn>,
    /// The next new PSN.
    pub(crate) next: Psn,
}

impl PsnTrack {
    pub(crate) fn reset(&mut self, sq_psn: u32) {
        *self = Self {
            first: None,
            next: Psn::new(sq_psn),
        };
    }

    pub(crate) fn first(&self) -> Psn {
        self.first.unwrap_or(self.next)
    }

    /// A request packet at `psn` using `reserve` PSNs; `resend_ok` for reliable transports.
    pub(crate) fn on_request(&mut self, psn: Psn, reserve: u32, resend_ok: bool) -> Result<bool, String> {
        if let Some(first) = self.first {
            if first.distance(psn) < first.distance(self.next) {
                if resend_ok {
                    return Ok(true);
                }
                return Err(format!(
                    "unreliable requester resent PSN {psn} (sent {first}..{})",
                    self.next
                ));
            }
        }
        if psn != self.next {
            return Err(format!(
                "request PSN {psn} is neither the next new PSN {} nor a resend of {}..{}",
                self.next,
                self.first(),
                self.next
            ));
        }
        self.first.get_or_insert(psn);
        self.next = psn + reserve.max(1);
        Ok(false)
    }
}

/// Half-open address ranges that an input may write.
#[derive(Debug, Default, Clone)]
pub(crate) struct Spans(Vec<(u64, u64)>);

impl Spans {
    pub(crate) fn add(&mut self, start: u64, len: u64) {
        let end = start.saturating_add(len);
        if start < end {
            self.0.push((start, end));
        }
    }

    /// `[start, start + len)` clipped to `mr`.
    pub(crate) fn add_within(&mut self, mr: &Mr, start: u64, len: u64) {
        let lo = start.max(mr.addr);
        let hi = start.saturating_add(len).min(mr.addr + mr.len);
        if lo < hi {
            self.0.push((lo, hi));
        }
    }

    pub(crate) fn contains(&self, addr: u64) -> bool {
        self.0.iter().any(|&(s, e)| (s..e).contains(&addr))
    }

    /// Whether every byte of `[start, start + len)` is in some span.
    pub(crate) fn covers(&self, start: u64, len: u64) -> bool {
        let end = start.saturating_add(len);
        let mut at = start;
        while at < end {
            match self
                .0
                .iter()
                .filter(|&&(s, e)| s <= at && at < e)
                .map(|&(_, e)| e)
                .max()
            {
                Some(e) => at = e,
                None => return false,
            }
        }
        true
    }

    /// Local scatter entries, each clipped to its valid region with local write.
    pub(crate) fn add_sges(&mut self, sges: &[Sge], regions: &[(Mr, bool)]) {
        for sge in sges {
            for (mr, valid) in regions {
                if *valid && mr.lkey == sge.lkey && mr.access.contains(AccessFlags::LOCAL_WRITE) {
                    self.add_within(mr, sge.addr, u64::from(sge.length));
                }
            }
        }
    }
}

/// Removes and returns the WRs up to and including the one with `wr_id`.
pub(crate) fn take_through<T>(q: &mut VecDeque<T>, pos: usize) -> Vec<T> {
    q.drain(..=pos).collect()
}
