//! Completions held back until the packets produced with them have left.
//!
//! An HCA makes a completion visible only after the responses its packet caused (ACKs, read
//! responses) are on the wire: a program that sees its last receive and exits must not leave the
//! peer without the ACK. The engine produces packets and completions together; the device sends
//! packets in batches, possibly on another thread than the one that will next touch the QP. So
//! each engine drain takes a ticket, its completions wait under that ticket, and they go to the
//! CQ once every ticket up to theirs was released, that is, once all packets produced before
//! them were handed to the fabric. Completions stay in the order the engine produced them.

use std::collections::{BTreeSet, VecDeque};

use softverbs_engine::transport::Completion;
use softverbs_engine::types::WcStatus;

/// The held completions of one QP (kept under the QP's lock).
#[derive(Debug, Default)]
pub(crate) struct Held {
    next: u64,
    /// Every ticket below this one was released.
    watermark: u64,
    /// Released tickets at or above the watermark.
    released: BTreeSet<u64>,
    queue: VecDeque<(u64, Completion)>,
}

impl Held {
    /// A new ticket for one batch of engine outputs.
    pub(crate) fn issue(&mut self) -> u64 {
        let t = self.next;
        self.next += 1;
        t
    }

    /// Takes back the ticket just issued if nothing was held under it (a drain that produced
    /// nothing): nobody else has seen it, so it needs no release. Returns whether it was.
    pub(crate) fn withdraw(&mut self, ticket: u64) -> bool {
        let unused = ticket + 1 == self.next && self.queue.back().is_none_or(|(t, _)| *t != ticket);
        if unused {
            self.next = ticket;
        }
        unused
    }

    /// Holds `c`, produced with the packets of `ticket`.
    pub(crate) fn hold(&mut self, ticket: u64, c: Completion) {
        self.queue.push_back((ticket, c));
    }

    /// Turns the completions held under `ticket` into flush errors (their data was lost).
    pub(crate) fn fail(&mut self, ticket: u64) {
        for (t, c) in &mut self.queue {
            if *t == ticket {
                c.wc.status = WcStatus::WrFlushErr;
            }
        }
    }

    /// Marks `ticket`'s packets as sent and hands each completion that may now be seen to
    /// `ready`, oldest first (with no list between: this runs for every message).
    pub(crate) fn release(&mut self, ticket: u64, mut ready: impl FnMut(Completion)) {
        if ticket == self.watermark && self.released.is_empty() {
            // Tickets released in the order issued (the usual case): no set to keep.
            self.watermark += 1;
        } else if ticket >= self.watermark {
            self.released.insert(ticket);
            while self.released.remove(&self.watermark) {
                self.watermark += 1;
            }
        }
        while self.queue.front().is_some_and(|(t, _)| *t < self.watermark) {
            if let Some((_, c)) = self.queue.pop_front() {
                ready(c);
            }
        }
    }

    /// Whether nothing is waiting.
    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use softverbs_engine::transport::WorkQueue;
    use softverbs_engine::types::WorkCompletion;

    fn c(id: u64) -> Completion {
        Completion {
            queue: WorkQueue::Send,
            wc: WorkCompletion {
                wr_id: id,
                ..WorkCompletion::default()
            },
        }
    }

    /// The ids of what releasing `ticket` makes visible.
    fn released(h: &mut Held, ticket: u64) -> Vec<u64> {
        let mut ids = Vec::new();
        h.release(ticket, |c| ids.push(c.wc.wr_id));
        ids
    }

    #[test]
    fn completions_wait_for_their_own_and_earlier_tickets() {
        let mut h = Held::default();
        let a = h.issue();
        h.hold(a, c(1));
        let b = h.issue();
        h.hold(b, c(2));
        h.hold(b, c(3));
        // The later batch left first: nothing of it may pass the earlier, unsent one.
        assert!(released(&mut h, b).is_empty());
        assert_eq!(released(&mut h, a), [1, 2, 3]);
        assert!(h.is_empty());
    }

    #[test]
    fn a_released_ticket_frees_only_its_own_completions() {
        let mut h = Held::default();
        let a = h.issue();
        h.hold(a, c(1));
        assert_eq!(released(&mut h, a), [1]);
        let b = h.issue();
        h.hold(b, c(2));
        let d = h.issue();
        h.hold(d, c(3));
        assert_eq!(released(&mut h, b), [2]);
        assert_eq!(released(&mut h, d), [3]);
    }

    #[test]
    fn only_an_unused_last_ticket_is_withdrawn() {
        let mut h = Held::default();
        let a = h.issue();
        h.hold(a, c(1));
        assert!(!h.withdraw(a), "a ticket with a completion must be released");
        let b = h.issue();
        assert!(h.withdraw(b));
        // The next drain gets the same number, and the order of releases is unchanged.
        let d = h.issue();
        assert_eq!(d, b);
        h.hold(d, c(2));
        assert!(released(&mut h, d).is_empty(), "the earlier ticket is still out");
        assert_eq!(released(&mut h, a), [1, 2]);
        let e = h.issue();
        let _f = h.issue();
        assert!(!h.withdraw(e), "only the last ticket issued");
    }
}
