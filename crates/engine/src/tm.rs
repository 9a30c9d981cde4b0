//! Tag matching (rdma-core `Documentation/tag_matching.md`): the vocabulary of tag-matching SRQs
//! and [`TagMatcher`], the pure state a device keeps for one: the tag list in posting order and
//! the unexpected-message phase.
//!
//! # The phase protocol
//!
//! Matching is split between the device and software. The device matches incoming tagged
//! messages against the tags it holds; a message that matches none is *unexpected* and goes
//! whole to an ordinary SRQ buffer, where software matches it against receives it has not
//! handed to the device. Software could post a tag for a receive while an unexpected message
//! that should have matched it is still unread in the CQ; a later message would then take the
//! tag out of order. So the device counts unexpected messages, software reports how many it
//! has handled (`unexpected_cnt` with `IBV_OPS_TM_SYNC`), and a tag added while the two counts
//! differ is not matched until software reports a count equal to the device's (software deletes
//! such a tag itself if one of those messages claims it). Every operation completion, and every
//! unexpected-message completion, carries `IBV_WC_TM_SYNC_REQ` while the counts differ.

use std::collections::{BTreeMap, VecDeque};

use bitflags::bitflags;

use crate::types::Sge;

/// `struct ibv_wc_tm_info`: what a tag-matching receive completion says about the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct TmInfo {
    /// The TMH's tag.
    pub tag: u64,
    /// The TMH's opaque `app_ctx` (`priv`).
    pub priv_data: u32,
}

bitflags! {
    /// `enum ibv_tm_cap_flags`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct TmCapFlags: u32 {
        /// Tag matching on RC QPs.
        const RC = 1;
    }
}

/// `struct ibv_tm_caps` of `ibv_query_device_ex`; all zero when tag matching is not offered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct TmCaps {
    /// Largest rendezvous request (TMH, RVH and metadata) the device handles.
    pub max_rndv_hdr_size: u32,
    /// Largest tag list of one SRQ.
    pub max_num_tags: u32,
    /// Transports.
    pub flags: TmCapFlags,
    /// Most outstanding tag-list operations of one SRQ.
    pub max_ops: u32,
    /// Most scatter entries of one tagged buffer.
    pub max_sge: u32,
}

/// `struct ibv_tm_cap`: the tag-matching size of a new SRQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct TmCap {
    /// Tag list size.
    pub max_num_tags: u32,
    /// Outstanding tag-list operations.
    pub max_ops: u32,
}

bitflags! {
    /// `enum ibv_ops_flags`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct OpsFlags: u32 {
        /// Generate a completion (operations are unsignaled by default).
        const SIGNALED = 1;
        /// `unexpected_cnt` reports the unexpected messages software has handled.
        const TM_SYNC = 1 << 1;
    }
}

/// What an `ibv_ops_wr` does (`enum ibv_ops_wr_opcode`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SrqOpKind {
    /// `IBV_WR_TAG_ADD`: adds a tagged buffer; the handle is returned.
    Add {
        /// `wr_id` of the buffer's receive completions.
        recv_wr_id: u64,
        /// The buffer.
        sg_list: Vec<Sge>,
        /// Tag to match.
        tag: u64,
        /// A message matches when `message tag & mask == tag`.
        mask: u64,
    },
    /// `IBV_WR_TAG_DEL`: removes the entry of a handle.
    Del {
        /// Handle from the `Add`.
        handle: u32,
    },
    /// `IBV_WR_TAG_SYNC`: only reports `unexpected_cnt`.
    Sync,
}

impl SrqOpKind {
    /// The raw `ibv_ops_wr_opcode`.
    pub fn raw(&self) -> u32 {
        match self {
            Self::Add { .. } => 0,
            Self::Del { .. } => 1,
            Self::Sync => 2,
        }
    }
}

/// `struct ibv_ops_wr`: one tag-list operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SrqOp {
    /// `wr_id` of the operation's completion.
    pub wr_id: u64,
    /// The operation.
    pub kind: SrqOpKind,
    /// Flags.
    pub flags: OpsFlags,
    /// Unexpected messages software has handled (used with [`OpsFlags::TM_SYNC`]).
    pub unexpected_cnt: u32,
}

/// Why the tag list refused an addition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the tag list is full ({0} entries)")]
pub struct ListFull(pub u32);

/// Where an incoming tagged message goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    /// The entry of this handle takes it.
    Match(u32),
    /// No entry may take it: it is unexpected.
    Unexpected,
}

#[derive(Debug, Clone)]
struct Entry<T> {
    tag: u64,
    mask: u64,
    seq: u64,
    /// Added while software's count equalled the device's, or synchronised since.
    enabled: bool,
    item: T,
}

/// The tag list of one tag-matching SRQ and its unexpected-message phase. `T` is what a tagged
/// buffer carries (its scatter list and `wr_id`).
#[derive(Debug, Clone)]
pub struct TagMatcher<T> {
    slots: Vec<Option<Entry<T>>>,
    /// Free handles, least recently freed first, so a stale handle is reused as late as possible.
    free: VecDeque<u32>,
    /// Live handles in posting order.
    order: BTreeMap<u64, u32>,
    next_seq: u64,
    /// Messages the device delivered as unexpected.
    unexpected: u32,
    /// The count software last reported.
    reported: u32,
    /// Entries added out of phase and not yet synchronised.
    held_back: usize,
}

impl<T> TagMatcher<T> {
    /// An empty list of at most `max_num_tags` entries.
    pub fn new(max_num_tags: u32) -> Self {
        Self {
            slots: (0..max_num_tags).map(|_| None).collect(),
            free: (0..max_num_tags).collect(),
            order: BTreeMap::new(),
            next_seq: 0,
            unexpected: 0,
            reported: 0,
            held_back: 0,
        }
    }

    /// Entries in the list.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// Whether the list is empty.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Unexpected messages so far (wrapping).
    pub fn unexpected(&self) -> u32 {
        self.unexpected
    }

    /// Whether software's count differs from the device's (`IBV_WC_TM_SYNC_REQ`).
    pub fn sync_required(&self) -> bool {
        self.unexpected != self.reported
    }

    /// Records software's count. When it equals the device's, every entry added meanwhile
    /// becomes eligible. Returns whether synchronisation is still required.
    pub fn sync(&mut self, unexpected_cnt: u32) -> bool {
        self.reported = unexpected_cnt;
        // Operations usually carry the right count: only scan when something waits.
        if !self.sync_required() && self.held_back > 0 {
            for e in self.slots.iter_mut().flatten() {
                e.enabled = true;
            }
            self.held_back = 0;
        }
        self.sync_required()
    }

    /// Adds an entry after applying `sync` (the operation's count, if it carries one).
    /// Returns its handle and whether synchronisation is required.
    pub fn add(&mut self, tag: u64, mask: u64, item: T, sync: Option<u32>) -> Result<(u32, bool), ListFull> {
        let handle = *self.free.front().ok_or(ListFull(self.slots.len() as u32))?;
        if let Some(c) = sync {
            self.sync(c);
        }
        self.free.pop_front();
        let seq = self.next_seq;
        self.next_seq += 1;
        self.slots[handle as usize] = Some(Entry {
            tag,
            mask,
            seq,
            enabled: !self.sync_required(),
            item,
        });
        self.order.insert(seq, handle);
        self.held_back += usize::from(self.sync_required());
        Ok((handle, self.sync_required()))
    }

    /// Removes the entry of `handle` after applying `sync`. `None` if there is none (it was
    /// consumed by a message, or never added): the operation completes with `IBV_WC_TM_ERR`.
    /// The second value tells whether synchronisation is required.
    pub fn remove(&mut self, handle: u32, sync: Option<u32>) -> (Option<T>, bool) {
        if let Some(c) = sync {
            self.sync(c);
        }
        (self.take(handle), self.sync_required())
    }

    /// Where a message with `tag` goes: the earliest-posted entry with
    /// `tag & entry.mask == entry.tag`, provided that entry is eligible. A message whose first
    /// match is an entry added out of phase is unexpected, so that software, which knows of
    /// that entry, matches it in order. Changes nothing.
    pub fn lookup(&self, tag: u64) -> Lookup {
        for &h in self.order.values() {
            let e = self.slots[h as usize].as_ref().expect("ordered handles are live");
            if tag & e.mask == e.tag {
                return if e.enabled {
                    Lookup::Match(h)
                } else {
                    Lookup::Unexpected
                };
            }
        }
        Lookup::Unexpected
    }

    /// Consumes the entry of `handle` (after a [`Lookup::Match`]), freeing the handle.
    pub fn take(&mut self, handle: u32) -> Option<T> {
        let e = self.slots.get_mut(handle as usize)?.take()?;
        self.order.remove(&e.seq);
        self.held_back -= usize::from(!e.enabled);
        self.free.push_back(handle);
        Some(e.item)
    }

    /// Counts a message delivered as unexpected.
    pub fn note_unexpected(&mut self) {
        self.unexpected = self.unexpected.wrapping_add(1);
    }

    /// The entry of a live handle.
    pub fn get(&self, handle: u32) -> Option<&T> {
        self.slots.get(handle as usize)?.as_ref().map(|e| &e.item)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn earliest_posted_match_wins_and_masks_apply() {
        let mut m = TagMatcher::new(8);
        let (a, _) = m.add(0x10, 0xF0, "a", None).unwrap();
        let (b, _) = m.add(0x12, u64::MAX, "b", None).unwrap();
        // 0x12 & 0xF0 == 0x10: the older wildcard entry takes it.
        assert_eq!(m.lookup(0x12), Lookup::Match(a));
        assert_eq!(m.take(a), Some("a"));
        assert_eq!(m.lookup(0x12), Lookup::Match(b));
        assert_eq!(m.lookup(0x13), Lookup::Unexpected);
        // An entry whose tag has bits outside its mask can never match.
        let (c, _) = m.add(0x1FF, 0xFF, "c", None).unwrap();
        assert_eq!(m.lookup(0x1FF), Lookup::Unexpected);
        assert_eq!(m.take(c), Some("c"));
    }

    #[test]
    fn list_size_and_handles() {
        let mut m = TagMatcher::new(2);
        let (a, _) = m.add(1, u64::MAX, 1, None).unwrap();
        let (b, _) = m.add(2, u64::MAX, 2, None).unwrap();
        assert_ne!(a, b);
        assert_eq!(m.add(3, u64::MAX, 3, None), Err(ListFull(2)));
        // Deleting a consumed entry fails; the freed handle is reused last.
        assert_eq!(m.take(a), Some(1));
        assert_eq!(m.remove(a, None), (None, false));
        let (c, _) = m.add(3, u64::MAX, 3, None).unwrap();
        assert_eq!(c, a, "the only free handle");
        assert_eq!(m.remove(99, None), (None, false));
        assert_eq!(m.len(), 2);
    }

    #[test]
    fn tags_added_out_of_phase_wait_for_sync() {
        let mut m = TagMatcher::new(8);
        let (old, req) = m.add(1, u64::MAX, "old", None).unwrap();
        assert!(!req);
        // A message nothing matches is unexpected: the device's count moves on.
        assert_eq!(m.lookup(5), Lookup::Unexpected);
        m.note_unexpected();
        assert!(m.sync_required());
        // Tags posted before that message stay eligible.
        assert_eq!(m.lookup(1), Lookup::Match(old));
        // A tag posted by software that has not seen it (count 0) is held back...
        let (new, req) = m.add(5, u64::MAX, "new", Some(0)).unwrap();
        assert!(req);
        assert_eq!(m.lookup(5), Lookup::Unexpected);
        // ... until software reports the device's count.
        assert!(m.sync(0));
        assert_eq!(m.lookup(5), Lookup::Unexpected);
        assert!(!m.sync(1));
        assert_eq!(m.lookup(5), Lookup::Match(new));
        // An addition carrying the right count is eligible at once.
        m.note_unexpected();
        let (n2, req) = m.add(6, u64::MAX, "n2", Some(2)).unwrap();
        assert!(!req);
        assert_eq!(m.lookup(6), Lookup::Match(n2));
    }

    #[test]
    fn a_held_back_first_match_makes_the_message_unexpected() {
        let mut m = TagMatcher::new(8);
        m.note_unexpected();
        let (_held, _) = m.add(7, u64::MAX, "held", None).unwrap();
        m.sync(1);
        let (_h2, _) = m.add(7, u64::MAX, "second", None).unwrap();
        m.note_unexpected();
        let (_h3, _) = m.add(7, 0, "never", None).unwrap();
        // The first entry is eligible (synchronised): it wins over later ones.
        assert!(matches!(m.lookup(7), Lookup::Match(_)));
        let mut m = TagMatcher::new(8);
        m.note_unexpected();
        m.add(7, u64::MAX, "held", None).unwrap();
        m.sync(1);
        m.note_unexpected();
        m.add(8, u64::MAX, "held too", None).unwrap();
        // 8's only entry was added out of phase.
        assert_eq!(m.lookup(8), Lookup::Unexpected);
    }

    /// Operations of the property test.
    #[derive(Debug, Clone)]
    enum Op {
        Add {
            tag: u8,
            mask: u8,
            sync: Option<u8>,
        },
        Del {
            pick: u8,
            sync: Option<u8>,
        },
        Sync(u8),
        Message {
            tag: u8,
        },
        /// Software catches up: reports the device's count.
        CatchUp,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (
                any::<u8>(),
                prop_oneof![Just(0xFFu8), Just(0xF0), Just(0)],
                proptest::option::of(0u8..4)
            )
                .prop_map(|(tag, mask, sync)| Op::Add { tag, mask, sync }),
            (any::<u8>(), proptest::option::of(0u8..4)).prop_map(|(pick, sync)| Op::Del { pick, sync }),
            (0u8..4).prop_map(Op::Sync),
            any::<u8>().prop_map(|tag| Op::Message { tag }),
            Just(Op::CatchUp),
        ]
    }

    /// A naive reference of the documented contract: a vector of entries in posting order.
    #[derive(Default)]
    struct Model {
        entries: Vec<(u32, u64, u64, bool, u64)>, // handle, tag, mask, enabled, id
        unexpected: u32,
        reported: u32,
    }

    impl Model {
        fn sync(&mut self, c: u32) {
            self.reported = c;
            if self.reported == self.unexpected {
                self.entries.iter_mut().for_each(|e| e.3 = true);
            }
        }
    }

    proptest! {
        #[test]
        fn matches_the_reference(ops in proptest::collection::vec(op(), 1..80)) {
            let mut m = TagMatcher::new(6);
            let mut model = Model::default();
            let mut next_id = 0u64;
            for op in ops {
                match op {
                    Op::Add { tag, mask, sync } => {
                        let sync = sync.map(u32::from);
                        let r = m.add(u64::from(tag), u64::from(mask), next_id, sync);
                        if model.entries.len() == 6 {
                            prop_assert_eq!(r, Err(ListFull(6)));
                        } else {
                            if let Some(c) = sync { model.sync(c); }
                            let (h, req) = r.unwrap();
                            prop_assert!(model.entries.iter().all(|e| e.0 != h), "handle reused while live");
                            let ok = model.reported == model.unexpected;
                            prop_assert_eq!(req, !ok);
                            model.entries.push((h, u64::from(tag), u64::from(mask), ok, next_id));
                            next_id += 1;
                        }
                    }
                    Op::Del { pick, sync } => {
                        let sync = sync.map(u32::from);
                        if let Some(c) = sync { model.sync(c); }
                        let handle = if model.entries.is_empty() || pick % 4 == 0 {
                            u32::from(pick)
                        } else {
                            model.entries[usize::from(pick) % model.entries.len()].0
                        };
                        let pos = model.entries.iter().position(|e| e.0 == handle);
                        let want = pos.map(|p| model.entries.remove(p).4);
                        let (got, req) = m.remove(handle, sync);
                        prop_assert_eq!(got, want);
                        prop_assert_eq!(req, model.reported != model.unexpected);
                    }
                    Op::Sync(c) => {
                        model.sync(u32::from(c));
                        prop_assert_eq!(m.sync(u32::from(c)), model.reported != model.unexpected);
                    }
                    Op::CatchUp => {
                        let c = model.unexpected;
                        model.sync(c);
                        prop_assert!(!m.sync(c));
                    }
                    Op::Message { tag } => {
                        let tag = u64::from(tag);
                        let first = model.entries.iter().position(|e| tag & e.2 == e.1);
                        match (m.lookup(tag), first) {
                            (Lookup::Match(h), Some(p)) => {
                                prop_assert!(model.entries[p].3, "matched a held-back entry");
                                prop_assert_eq!(h, model.entries[p].0);
                                let id = model.entries.remove(p).4;
                                prop_assert_eq!(m.take(h), Some(id));
                            }
                            (Lookup::Unexpected, p) => {
                                prop_assert!(p.is_none_or(|p| !model.entries[p].3));
                                m.note_unexpected();
                                model.unexpected += 1;
                            }
                            (Lookup::Match(_), None) => prop_assert!(false, "matched nothing the reference has"),
                        }
                    }
                }
                prop_assert_eq!(m.len(), model.entries.len());
                prop_assert_eq!(m.sync_required(), model.reported != model.unexpected);
            }
        }
    }
}
