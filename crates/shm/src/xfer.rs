//! Copies straight out of another process's memory (cross-memory attach,
//! `process_vm_readv(2)`): how a payload moves once, from the sender's registered buffer into
//! the receiver's, between processes of one user. The kernel checks that the caller may trace
//! the other process (same user, and Yama's policy); otherwise the call fails and nothing is
//! copied.

#![allow(unsafe_code)]

use std::io;
use std::sync::atomic::AtomicU64;

use nix::sys::uio::{process_vm_readv, RemoteIoVec};
use nix::unistd::Pid;

/// Ranges per system call (the kernel's `IOV_MAX`).
const IOV_MAX: usize = 1024;

fn remote_iovs(remote: &[(u64, usize)]) -> Vec<RemoteIoVec> {
    remote
        .iter()
        .map(|&(base, len)| RemoteIoVec {
            base: base as usize,
            len,
        })
        .collect()
}

fn check_len(remote: &[(u64, usize)], want: usize) -> io::Result<()> {
    let total: usize = remote.iter().map(|r| r.1).sum();
    if total != want || remote.len() > IOV_MAX {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "ranges do not match the destination",
        ));
    }
    Ok(())
}

fn complete(got: nix::Result<usize>, want: usize) -> io::Result<()> {
    match got {
        Ok(n) if n == want => Ok(()),
        Ok(n) => Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("copied {n} of {want} bytes"),
        )),
        Err(e) => Err(e.into()),
    }
}

/// Copies the bytes at `remote` (address, length) in process `pid`, in order, into `dst`,
/// whose length must be their total.
pub fn read_from_process(pid: i32, dst: &mut [u8], remote: &[(u64, usize)]) -> io::Result<()> {
    check_len(remote, dst.len())?;
    if dst.is_empty() {
        return Ok(());
    }
    let want = dst.len();
    let got = process_vm_readv(
        Pid::from_raw(pid),
        &mut [io::IoSliceMut::new(dst)],
        &remote_iovs(remote),
    );
    complete(got, want)
}

/// Copies the bytes at `remote` in process `pid`, in order, into `len` bytes of `words`
/// starting `byte_offset` bytes in (memory that other threads may access concurrently, with
/// atomic operations only).
pub fn read_into_words(
    pid: i32,
    words: &[AtomicU64],
    byte_offset: usize,
    len: usize,
    remote: &[(u64, usize)],
) -> io::Result<()> {
    check_len(remote, len)?;
    let end = byte_offset
        .checked_add(len)
        .filter(|&e| e <= words.len() * 8)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "beyond the words"))?;
    if len == 0 {
        return Ok(());
    }
    let base = words.as_ptr() as *mut u8;
    // SAFETY: `byte_offset..end` lies inside `words` (checked above), so the slice covers
    // memory this borrow keeps alive for the whole call. The memory is made of `AtomicU64`s,
    // whose bytes may be changed through a shared reference (they are `UnsafeCell`s): the
    // slice is only handed to the kernel as the destination of the copy, like a device
    // writing by DMA, and never read or written by Rust code, so no Rust access aliases it.
    let dst = unsafe { std::slice::from_raw_parts_mut(base.add(byte_offset), end - byte_offset) };
    let got = process_vm_readv(
        Pid::from_raw(pid),
        &mut [io::IoSliceMut::new(dst)],
        &remote_iovs(remote),
    );
    complete(got, len)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn copies_from_own_memory_into_bytes_and_words() {
        let src: Vec<u8> = (0..100u8).collect();
        let me = std::process::id() as i32;
        let a = src.as_ptr() as u64;
        let mut dst = vec![0u8; 30];
        read_from_process(me, &mut dst, &[(a + 10, 20), (a + 50, 10)]).unwrap();
        assert_eq!(&dst[..20], &src[10..30]);
        assert_eq!(&dst[20..], &src[50..60]);

        let words: Vec<AtomicU64> = (0..4).map(|_| AtomicU64::new(0)).collect();
        read_into_words(me, &words, 3, 16, &[(a, 16)]).unwrap();
        let bytes: Vec<u8> = words
            .iter()
            .flat_map(|w| w.load(Ordering::Relaxed).to_ne_bytes())
            .collect();
        assert_eq!(&bytes[3..19], &src[..16]);
        assert!(bytes[..3].iter().chain(&bytes[19..]).all(|&b| b == 0));
    }

    #[test]
    fn refuses_mismatched_or_bad_ranges() {
        let me = std::process::id() as i32;
        let words: Vec<AtomicU64> = (0..2).map(|_| AtomicU64::new(0)).collect();
        assert!(
            read_into_words(me, &words, 10, 8, &[(0x1000, 8)]).is_err(),
            "beyond the words"
        );
        let mut dst = [0u8; 8];
        assert!(
            read_from_process(me, &mut dst, &[(0x1000, 4)]).is_err(),
            "lengths differ"
        );
        // An address that is not mapped in the source: an error, nothing copied.
        assert!(read_from_process(me, &mut dst, &[(8, 8)]).is_err());
    }
}
