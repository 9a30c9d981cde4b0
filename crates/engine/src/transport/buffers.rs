//! Packet buffers that are used again instead of allocated for every packet.
//!
//! Every packet the engine builds needs a buffer, and every buffer is let go once a carrier
//! took the bytes (a `sendmsg`, a copy into a shared-memory ring) or a receiver in this
//! process consumed them. At millions of packets a second the allocator's work (and, for full
//! MTU packets, the heap growing and shrinking under it) is a large part of the cost, so the
//! carrier hands finished buffers back with [`recycle`] and the engine's next packet takes one
//! from [`take`]. The pool is per thread (no lock: the thread that builds a packet is mostly
//! the one that sends it), holds a few size classes, and is bounded, so a thread that only
//! gives buffers back keeps at most 256 of each class.

use std::cell::RefCell;

use super::Transmit;

/// Capacities of the pooled classes: ACKs and small messages, medium payloads, and a full
/// 4096-byte MTU payload with the largest header set (BTH, RETH or AtomicETH, DETH, ImmDt,
/// pad and ICRC all fit in the 128 spare bytes).
const CLASSES: [usize; 3] = [128, 1024 + 128, 4096 + 128];
/// Most buffers kept per class and thread.
const PER_CLASS: usize = 256;

thread_local! {
    static POOL: RefCell<[Vec<Vec<u8>>; CLASSES.len()]> = const {
        RefCell::new([Vec::new(), Vec::new(), Vec::new()])
    };
}

/// The class a buffer of `len` bytes comes from, if any.
fn class_for(len: usize) -> Option<usize> {
    CLASSES.iter().position(|&c| len <= c)
}

/// A buffer of `len` bytes for a packet: a recycled one of its class if this thread has one,
/// else a new one. Its bytes are unspecified (a recycled buffer keeps what an earlier packet of
/// this thread left; only growth is zeroed), so the caller writes all of them: `PacketRepr::emit`
/// writes every header, pad and ICRC byte, and the payload is filled in full. Buffers larger
/// than the largest class are allocated as usual.
pub fn take(len: usize) -> Vec<u8> {
    let Some(class) = class_for(len) else {
        return vec![0; len];
    };
    let recycled = POOL
        .try_with(|p| p.try_borrow_mut().ok().and_then(|mut p| p[class].pop()))
        .ok()
        .flatten();
    let mut buf = recycled.unwrap_or_else(|| Vec::with_capacity(CLASSES[class]));
    // Zeroing a full-MTU buffer for every packet, only to overwrite it, is a visible part of
    // the cost of a stream.
    if buf.len() >= len {
        buf.truncate(len);
    } else {
        buf.resize(len, 0);
    }
    buf
}

/// Hands a buffer back for a later [`take`] on this thread. Buffers not from a class (other
/// capacities), and any beyond the pool's bound, are freed.
pub fn recycle(buf: Vec<u8>) {
    let Some(class) = CLASSES.iter().position(|&c| buf.capacity() == c) else {
        return;
    };
    // During thread exit the pool may be gone: the buffer is simply freed.
    let _ = POOL.try_with(|p| {
        if let Ok(mut p) = p.try_borrow_mut() {
            if p[class].len() < PER_CLASS {
                p[class].push(buf);
            }
        }
    });
}

/// How many buffers of the class of `len` bytes this thread keeps (0 for lengths no class
/// holds): what a carrier handed back and no packet has taken since.
pub fn pooled(len: usize) -> usize {
    class_for(len).map_or(0, |class| {
        POOL.try_with(|p| p.try_borrow().map_or(0, |p| p[class].len()))
            .unwrap_or(0)
    })
}

thread_local! {
    /// Emptied lists of transmits and of packet buffers, kept for the next bursts.
    static LISTS: RefCell<Lists> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Most entries a kept list may have room for (a larger one is freed, not kept).
const LIST_KEEP: usize = 1024;
/// Most emptied lists of each kind a thread keeps: a receive pass holds one per packet it
/// processed until the pass's single send, so a pass of a few packets takes several at once.
const SPARES: usize = 8;

/// The spare lists of this thread.
type Lists = (Vec<Vec<Transmit>>, Vec<Vec<Vec<u8>>>);

/// Takes a spare list of the kind `slot` picks (a new, empty one if there is none).
fn take_spare<T>(slot: fn(&mut Lists) -> &mut Vec<Vec<T>>) -> Vec<T> {
    LISTS
        .try_with(|l| l.try_borrow_mut().ok().and_then(|mut l| slot(&mut l).pop()))
        .ok()
        .flatten()
        .unwrap_or_default()
}

/// Keeps `list` (emptied) among the spares `slot` picks, unless it is huge, has no room at
/// all, or enough are kept.
fn keep_spare<T>(slot: fn(&mut Lists) -> &mut Vec<Vec<T>>, mut list: Vec<T>) {
    list.clear();
    if list.capacity() == 0 || list.capacity() > LIST_KEEP {
        return;
    }
    let _ = LISTS.try_with(|l| {
        if let Ok(mut l) = l.try_borrow_mut() {
            let spares = slot(&mut l);
            if spares.len() < SPARES {
                spares.push(list);
            }
        }
    });
}

/// An empty list for the transmits of one burst: one this thread handed back with
/// [`recycle_transmits`] if any (a list per work request would be an allocation each).
pub fn take_transmits() -> Vec<Transmit> {
    take_spare(|l| &mut l.0)
}

/// Keeps an emptied list of transmits for [`take_transmits`] (its contents are dropped).
pub fn recycle_transmits(list: Vec<Transmit>) {
    keep_spare(|l| &mut l.0, list);
}

/// An empty list for a run of packet buffers, as [`take_transmits`] gives one for transmits.
pub fn take_list() -> Vec<Vec<u8>> {
    take_spare(|l| &mut l.1)
}

/// [`recycle`] for each buffer of `bufs`, keeping the emptied list for [`take_list`].
pub fn recycle_list(mut bufs: Vec<Vec<u8>>) {
    for b in bufs.drain(..) {
        recycle(b);
    }
    keep_spare(|l| &mut l.1, bufs);
}

/// [`recycle`] for each buffer of `bufs`.
pub fn recycle_all(bufs: impl IntoIterator<Item = Vec<u8>>) {
    for b in bufs {
        recycle(b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recycled_buffer_is_taken_again_at_the_new_length_and_growth_is_zeroed() {
        let mut a = take(100);
        assert_eq!(a.capacity(), 128);
        a.iter_mut().for_each(|b| *b = 0xAB);
        let addr = a.as_ptr();
        recycle(a);
        let b = take(40);
        assert_eq!(b.as_ptr(), addr, "the same allocation comes back");
        assert_eq!(b.len(), 40);
        recycle(b);
        let c = take(120);
        assert_eq!(c.as_ptr(), addr);
        assert!(
            c[40..].iter().all(|&x| x == 0),
            "bytes beyond the last length are new and zeroed"
        );
    }

    #[test]
    fn a_packet_built_in_a_used_buffer_carries_nothing_of_the_old_one() {
        use softverbs_wire::{BthRepr, Opcode, PacketRepr, Psn, RethRepr};
        let dest = super::super::Dest {
            dgid: crate::types::Gid::ZERO,
            sgid_index: 0,
            traffic_class: 0,
            hop_limit: 64,
            flow_label: 0,
        };
        let payload: Vec<u8> = (0..61u8).collect();
        let mut repr = PacketRepr::new(
            BthRepr::new(Opcode::RcWriteOnly, 0x12, Psn::new(7)),
            payload.len(),
        );
        repr.bth.pad_count = softverbs_wire::pad_count_for(payload.len());
        repr.reth = Some(RethRepr {
            va: 0x1000,
            rkey: 5,
            dma_len: 4096,
        });
        let mut expected = vec![0u8; repr.buffer_len()];
        repr.emit_with_payload(&mut expected, &payload).unwrap();
        // The pool now holds a buffer full of another packet's bytes.
        let mut dirty = take(repr.buffer_len() + 30);
        dirty.iter_mut().for_each(|b| *b = 0xEE);
        let addr = dirty.as_ptr();
        recycle(dirty);
        let tx = super::super::requester::build(&repr, dest, |buf| {
            buf.copy_from_slice(&payload);
            Ok(())
        })
        .unwrap();
        assert_eq!(tx.data.as_ptr(), addr, "built in the used buffer");
        assert_eq!(tx.data, expected);
    }

    #[test]
    fn emptied_lists_come_back_for_the_next_burst() {
        let mut l = take_list();
        l.extend((0..10).map(|_| take(100)));
        let addr = l.as_ptr();
        recycle_list(l);
        assert_eq!(pooled(100), 10, "the buffers went to the pool");
        let again = take_list();
        assert!(again.is_empty());
        assert_eq!(again.as_ptr(), addr, "the list's allocation came back");
        assert!(take_list().capacity() == 0, "each kept list is taken once");
        let mut t = take_transmits();
        t.reserve(4);
        let addr = t.as_ptr();
        recycle_transmits(t);
        let back = take_transmits();
        assert_eq!(back.as_ptr(), addr);
        recycle_transmits(Vec::with_capacity(LIST_KEEP + 1));
        assert_eq!(take_transmits().capacity(), 0, "a huge list is not kept");
    }

    #[test]
    fn a_pass_that_holds_several_lists_gets_them_all_back() {
        // As a receive pass does: a list per packet taken before any is handed back.
        let mut held: Vec<Vec<Transmit>> = (0..SPARES + 2)
            .map(|_| {
                let mut t = take_transmits();
                t.reserve(4);
                t
            })
            .collect();
        let addrs: Vec<_> = held.iter().map(|t| t.as_ptr()).collect();
        for t in held.drain(..) {
            recycle_transmits(t);
        }
        let again: Vec<Vec<Transmit>> = (0..SPARES + 1).map(|_| take_transmits()).collect();
        for t in &again[..SPARES] {
            assert!(t.capacity() >= 4, "a kept list comes back with its room");
            assert!(addrs.contains(&t.as_ptr()));
        }
        assert_eq!(again[SPARES].capacity(), 0, "at most {SPARES} are kept");
    }

    #[test]
    fn sizes_pick_the_smallest_class_that_fits() {
        assert_eq!(take(0).capacity(), 128);
        assert_eq!(take(129).capacity(), 1152);
        assert_eq!(take(4096 + 60).capacity(), 4224);
        let big = take(9000);
        assert_eq!(big.len(), 9000);
        recycle(big);
        assert_eq!(pooled(4096), 0, "an oversized buffer is freed, not pooled");
    }

    #[test]
    fn foreign_buffers_are_not_pooled_and_the_pool_is_bounded() {
        recycle(Vec::with_capacity(200));
        assert_eq!(pooled(100) + pooled(1000), 0);
        recycle_all((0..PER_CLASS + 10).map(|_| Vec::with_capacity(128)));
        assert_eq!(pooled(100), PER_CLASS);
        assert_eq!(pooled(9000), 0);
    }
}
