//! The vectors a thread's earlier `ibv_post_*` calls translated into, kept for its next calls:
//! once warm, translating a work request list allocates nothing (the device copies what it
//! keeps). Allocating them afresh cost about as much as the rest of the translation.

use std::cell::RefCell;
use std::ffi::c_int;

use softverbs_device::qp::SendRequest;
use softverbs_engine::types::{RecvWr, Sge};
use softverbs_engine::wr::Payload;

use crate::abi::{ibv_recv_wr, ibv_send_wr, ibv_sge};

/// Spare vectors kept of each kind, and the largest capacity kept: a burst of long lists must
/// not pin its memory for the thread's lifetime.
const MAX_SPARE: usize = 64;
const MAX_CAPACITY: usize = 4096;

thread_local! {
    static SCRATCH: RefCell<Scratch> = const { RefCell::new(Scratch::EMPTY) };
}

/// One call's translated requests, their C pointers, and spare vectors for the next ones.
pub(crate) struct Scratch {
    /// Translated send requests (empty between calls).
    pub(crate) sends: Vec<SendRequest>,
    /// The `ibv_send_wr` each of `sends` came from.
    pub(crate) send_ptrs: Vec<*mut ibv_send_wr>,
    /// Translated receive requests (empty between calls).
    pub(crate) recvs: Vec<RecvWr>,
    /// The `ibv_recv_wr` each of `recvs` came from.
    pub(crate) recv_ptrs: Vec<*mut ibv_recv_wr>,
    sges: Vec<Vec<Sge>>,
    bytes: Vec<Vec<u8>>,
}

impl Scratch {
    const EMPTY: Self = Self {
        sends: Vec::new(),
        send_ptrs: Vec::new(),
        recvs: Vec::new(),
        recv_ptrs: Vec::new(),
        sges: Vec::new(),
        bytes: Vec::new(),
    };

    /// Runs `f` on this thread's scratch (on a fresh one while the thread exits, or if a call
    /// is already using it), then clears it for the next call, keeping its vectors.
    pub(crate) fn with<R>(f: impl FnOnce(&mut Self) -> R) -> R {
        let mut f = Some(f);
        let mut out = None;
        let _ = SCRATCH.try_with(|cell| {
            if let Ok(mut s) = cell.try_borrow_mut() {
                let f = f.take().expect("not run yet");
                out = Some(f(&mut s));
                s.clear();
            }
        });
        match (out, f) {
            (Some(r), _) => r,
            (None, Some(f)) => {
                let mut fresh = Self::EMPTY;
                f(&mut fresh)
            }
            (None, None) => unreachable!("f ran and returned"),
        }
    }

    /// Empties the request lists, keeping their vectors.
    fn clear(&mut self) {
        let Self {
            sends,
            send_ptrs,
            recvs,
            recv_ptrs,
            sges,
            bytes,
        } = self;
        for r in sends.drain(..) {
            match r.payload {
                Payload::Sges(v) => keep_vec(sges, v),
                Payload::Inline(b) => keep_vec(bytes, b),
                Payload::Headed { header, sges: list } => {
                    keep_vec(bytes, header);
                    keep_vec(sges, list);
                }
            }
        }
        for r in recvs.drain(..) {
            keep_vec(sges, r.sg_list);
        }
        send_ptrs.clear();
        recv_ptrs.clear();
    }

    /// The scatter/gather list of a work request, in a spare vector.
    ///
    /// # Safety
    /// `sg` must point at `n` readable `ibv_sge`s when `n > 0`.
    pub(crate) unsafe fn sges(&mut self, sg: *const ibv_sge, n: c_int) -> Result<Vec<Sge>, c_int> {
        let mut v = self.sges.pop().unwrap_or_default();
        // SAFETY: per the contract.
        unsafe { append_sges(&mut v, sg, n) }?;
        Ok(v)
    }

    /// A spare byte vector.
    pub(crate) fn bytes(&mut self) -> Vec<u8> {
        self.bytes.pop().unwrap_or_default()
    }

    /// Keeps a gather list that was copied out (inline data).
    pub(crate) fn keep_sges(&mut self, v: Vec<Sge>) {
        keep_vec(&mut self.sges, v);
    }
}

/// Appends the scatter/gather list of a work request to `out`.
///
/// # Safety
/// `sg` must point at `n` readable `ibv_sge`s when `n > 0`.
pub(crate) unsafe fn append_sges(out: &mut Vec<Sge>, sg: *const ibv_sge, n: c_int) -> Result<(), c_int> {
    if n < 0 || (n > 0 && sg.is_null()) {
        return Err(crate::datapath::EINVAL);
    }
    if n > 0 {
        // SAFETY: per the contract.
        let list = unsafe { std::slice::from_raw_parts(sg, n as usize) };
        out.extend(list.iter().map(|s| Sge {
            addr: s.addr,
            length: s.length,
            lkey: s.lkey,
        }));
    }
    Ok(())
}

fn keep_vec<T>(spare: &mut Vec<Vec<T>>, mut v: Vec<T>) {
    if spare.len() < MAX_SPARE && v.capacity() > 0 && v.capacity() <= MAX_CAPACITY {
        v.clear();
        spare.push(v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vectors_come_back_cleared_and_bounded() {
        let raw = [ibv_sge {
            addr: 1,
            length: 2,
            lkey: 3,
        }; 2];
        let at = Scratch::with(|s| {
            // SAFETY: `raw` holds two SGEs.
            let v = unsafe { s.sges(raw.as_ptr(), 2) }.unwrap();
            let at = v.as_ptr();
            s.recvs.push(RecvWr { wr_id: 7, sg_list: v });
            at
        });
        Scratch::with(|s| {
            assert!(s.recvs.is_empty());
            // SAFETY: `raw` holds one SGE.
            let v = unsafe { s.sges(raw.as_ptr(), 1) }.unwrap();
            assert_eq!(v.as_ptr(), at, "the vector is reused");
            assert_eq!(
                v,
                vec![Sge {
                    addr: 1,
                    length: 2,
                    lkey: 3
                }]
            );
            // A nested call (none happens today) gets a scratch of its own.
            Scratch::with(|inner| assert!(inner.sges.is_empty() && inner.recvs.is_empty()));
            // SAFETY: a negative count is refused before the pointer is read.
            assert_eq!(unsafe { s.sges(raw.as_ptr(), -1) }, Err(crate::datapath::EINVAL));
            s.sges.clear();
            s.keep_sges(Vec::with_capacity(MAX_CAPACITY + 1));
            assert!(s.sges.is_empty(), "an oversized vector is not kept");
            for _ in 0..MAX_SPARE + 5 {
                s.keep_sges(Vec::with_capacity(1));
            }
            assert_eq!(s.sges.len(), MAX_SPARE);
        });
    }
}
