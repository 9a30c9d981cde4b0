//! A single-producer single-consumer ring of variable-length records in shared memory.
//!
//! Layout at the ring's offset: the producer's `tail` (byte position, first cache line), the
//! consumer's `head` (second cache line), then `cap` bytes of data (`cap` a power of two).
//! Positions only grow; a position's index is `pos % cap`. A record is an 8-byte header (its
//! length, or [`WRAP`] for the filler that pads the end of the data area when the next record
//! does not fit before it) and the payload, padded to 8 bytes, never split across the end.
//! The producer publishes records by storing `tail` (release), the consumer frees them by
//! storing `head` (release); each reads the other's word with acquire.
//!
//! The consumer trusts nothing it reads: a length that does not fit what was published is
//! reported as corruption and the ring is skipped to its tail, so a broken producer can lose
//! its own records but not make the consumer read outside the ring.

use std::sync::atomic::Ordering;

use crate::raw::Mapping;
use crate::Error;

/// Bytes before the data area: the tail and head words, a cache line each.
pub(crate) const RING_HEADER: usize = 128;
const TAIL: usize = 0;
const HEAD: usize = 64;
/// Bytes of a record header.
const REC: usize = 8;
/// The header length of the filler record at the end of the data area.
const WRAP: u32 = u32::MAX;

fn padded(len: usize) -> usize {
    (len + 7) & !7
}

/// The largest payload a ring of `cap` bytes takes: half the ring, so that a record always fits
/// after at most one filler.
pub(crate) fn max_record(cap: usize) -> usize {
    cap / 2 - REC
}

/// Whether the ring at `base` holds no published, unfreed record (from the shared words; the
/// consumer stores its head after every record it frees).
pub(crate) fn is_empty(map: &Mapping, base: usize) -> bool {
    map.u64_at(base + TAIL).load(Ordering::SeqCst) == map.u64_at(base + HEAD).load(Ordering::SeqCst)
}

/// The producing end of one ring.
#[derive(Debug)]
pub(crate) struct Producer {
    base: usize,
    cap: usize,
    tail: u64,
    head: u64,
}

impl Producer {
    /// Takes over the ring at `base` where it stands (a previous producer may have left
    /// records the consumer has not read yet).
    pub(crate) fn attach(map: &Mapping, base: usize, cap: usize) -> Self {
        Self {
            base,
            cap,
            tail: map.u64_at(base + TAIL).load(Ordering::Acquire),
            head: map.u64_at(base + HEAD).load(Ordering::Acquire),
        }
    }

    fn free(&mut self, map: &Mapping, need: u64) -> bool {
        if self.tail + need - self.head <= self.cap as u64 {
            return true;
        }
        self.head = map.u64_at(self.base + HEAD).load(Ordering::Acquire);
        self.tail + need - self.head <= self.cap as u64
    }

    /// Appends a record of `len` bytes that `fill` writes in place. `Ok(false)` if the ring is
    /// full now (nothing was written), [`Error::TooLarge`] if it could never hold it.
    pub(crate) fn push(
        &mut self,
        map: &Mapping,
        len: usize,
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<bool, Error> {
        if len > max_record(self.cap) {
            return Err(Error::TooLarge {
                len,
                max: max_record(self.cap),
            });
        }
        let need = REC + padded(len);
        let idx = (self.tail % self.cap as u64) as usize;
        let room = self.cap - idx;
        let filler = if room < need { room } else { 0 };
        if !self.free(map, (filler + need) as u64) {
            return Ok(false);
        }
        let data = self.base + RING_HEADER;
        let mut at = idx;
        if filler > 0 {
            map.with_bytes_mut(data + at, REC, |h| {
                h[..4].copy_from_slice(&WRAP.to_le_bytes());
                h[4..].fill(0);
            });
            at = 0;
        }
        map.with_bytes_mut(data + at, REC + len, |r| {
            r[..4].copy_from_slice(&(len as u32).to_le_bytes());
            r[4..REC].fill(0);
            fill(&mut r[REC..]);
        });
        self.tail += (filler + need) as u64;
        map.u64_at(self.base + TAIL).store(self.tail, Ordering::SeqCst);
        Ok(true)
    }
}

/// The consuming end of one ring.
#[derive(Debug)]
pub(crate) struct Consumer {
    base: usize,
    cap: usize,
    head: u64,
}

impl Consumer {
    /// The consumer of a ring the owner just laid out (or took over as it stands).
    pub(crate) fn attach(map: &Mapping, base: usize, cap: usize) -> Self {
        Self {
            base,
            cap,
            head: map.u64_at(base + HEAD).load(Ordering::Acquire),
        }
    }

    /// Hands the next record to `f` and frees it. `Ok(None)` if the ring is empty;
    /// [`Error::Corrupt`] if what the producer published is not a valid record (everything
    /// published so far is then dropped).
    pub(crate) fn pop<R>(&mut self, map: &Mapping, f: impl FnOnce(&[u8]) -> R) -> Result<Option<R>, Error> {
        let tail = map.u64_at(self.base + TAIL).load(Ordering::Acquire);
        let data = self.base + RING_HEADER;
        loop {
            let published = tail.wrapping_sub(self.head);
            if published == 0 {
                return Ok(None);
            }
            let idx = (self.head % self.cap as u64) as usize;
            let room = (self.cap - idx) as u64;
            let corrupt = published > self.cap as u64 || published < REC as u64;
            let len = if corrupt {
                None
            } else {
                Some(map.with_bytes(data + idx, 4, |h| {
                    u32::from_le_bytes(h.try_into().expect("4 bytes"))
                }))
            };
            match len {
                Some(WRAP) if room <= published => {
                    // The filler: the record starts over at the beginning of the data area.
                    self.head += room;
                    map.u64_at(self.base + HEAD).store(self.head, Ordering::Release);
                }
                Some(len) if len != WRAP => {
                    let need = (REC + padded(len as usize)) as u64;
                    if need > room || need > published {
                        return Err(self.skip(map, tail));
                    }
                    let r = map.with_bytes(data + idx + REC, len as usize, f);
                    self.head += need;
                    map.u64_at(self.base + HEAD).store(self.head, Ordering::Release);
                    return Ok(Some(r));
                }
                _ => return Err(self.skip(map, tail)),
            }
        }
    }

    /// Drops everything published up to `tail`.
    fn skip(&mut self, map: &Mapping, tail: u64) -> Error {
        self.head = tail;
        map.u64_at(self.base + HEAD).store(self.head, Ordering::Release);
        Error::Corrupt
    }
}
