//! QP numbers: the per-process indices in use.

use std::collections::HashSet;

/// QPNs 0 and 1 are the special management QPs; ordinary QPs start above them, as on hardware.
pub(super) const FIRST_QPN: u32 = 0x11;
/// The last per-process QP index (bits 0..16; the slot fills bits 16..24).
pub(super) const LAST_QPN_INDEX: u32 = 0xFFFF;

/// The per-process QP indices in use, handed out round robin so that a freed number is not
/// reused at once.
#[derive(Debug)]
pub(super) struct QpnTable {
    next: u32,
    first: u32,
    last: u32,
    live: HashSet<u32>,
}

impl QpnTable {
    pub(super) fn new(first: u32, last: u32) -> Self {
        Self {
            next: first,
            first,
            last,
            live: HashSet::new(),
        }
    }

    /// A free index, or `None` when every one is in use (a full table must not be searched
    /// forever).
    pub(super) fn alloc(&mut self) -> Option<u32> {
        if self.live.len() as u64 > u64::from(self.last - self.first) {
            return None;
        }
        loop {
            let idx = self.next;
            self.next = if idx >= self.last { self.first } else { idx + 1 };
            if self.live.insert(idx) {
                return Some(idx);
            }
        }
    }

    pub(super) fn free(&mut self, idx: u32) {
        self.live.remove(&idx);
    }
}
