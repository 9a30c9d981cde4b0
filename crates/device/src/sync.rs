//! Small synchronisation building blocks shared by the objects.

use std::collections::VecDeque;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use nix::fcntl::{fcntl, FcntlArg, OFlag};
use nix::sys::eventfd::{EfdFlags, EventFd};
use parking_lot::{Condvar, Mutex};
use softverbs_engine::{Error, Result};

/// Counts the objects that depend on an object, and retires it only when none do.
///
/// This is what makes `ibv_dealloc_pd` on a PD with MRs fail with EBUSY and change nothing.
#[derive(Debug, Default)]
pub(crate) struct UseCount(AtomicU32);

const RETIRED: u32 = 1 << 31;

impl UseCount {
    /// Registers a dependent; fails if the object was already destroyed.
    pub(crate) fn acquire(&self, what: &'static str) -> Result<()> {
        self.0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n & RETIRED == 0).then_some(n + 1)
            })
            .map(drop)
            .map_err(|_| Error::invalid(format!("{what} has been destroyed")))
    }

    /// Unregisters a dependent.
    pub(crate) fn release(&self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }

    /// Marks the object destroyed if nothing depends on it; EBUSY otherwise.
    pub(crate) fn retire(&self, what: &'static str) -> Result<()> {
        match self
            .0
            .compare_exchange(0, RETIRED, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => Ok(()),
            Err(n) if n & RETIRED != 0 => Err(Error::invalid(format!("{what} has already been destroyed"))),
            Err(n) => Err(Error::busy(format!(
                "{what} is still used by {n} other object(s)"
            ))),
        }
    }

    /// How many dependents are registered.
    pub(crate) fn count(&self) -> u32 {
        self.0.load(Ordering::Acquire) & !RETIRED
    }

    /// Whether the object was destroyed.
    pub(crate) fn is_retired(&self) -> bool {
        self.0.load(Ordering::Acquire) & RETIRED != 0
    }
}

/// Events handed out versus acknowledged, so destruction can wait for the acknowledgements
/// (`ibv_get_async_event(3)`, `ibv_get_cq_event(3)`).
#[derive(Debug, Default)]
pub(crate) struct AckCounter {
    counts: Mutex<(u64, u64)>,
    acked: Condvar,
}

impl AckCounter {
    /// One more event was handed to the application.
    pub(crate) fn delivered(&self) {
        self.counts.lock().0 += 1;
    }

    /// The application acknowledged `n` events.
    pub(crate) fn ack(&self, n: u64) {
        let mut c = self.counts.lock();
        c.1 = (c.1 + n).min(c.0);
        self.acked.notify_all();
    }

    /// Blocks until every delivered event was acknowledged.
    pub(crate) fn wait_all_acked(&self) {
        let mut c = self.counts.lock();
        while c.1 < c.0 {
            self.acked.wait(&mut c);
        }
    }

    /// (delivered, acknowledged).
    pub(crate) fn counts(&self) -> (u64, u64) {
        *self.counts.lock()
    }
}

/// A queue whose pending entries are mirrored in an eventfd, so the fd is readable exactly when
/// the queue is not empty and works with poll/epoll.
///
/// The eventfd is in semaphore mode and every push and pop adjusts it under the queue lock, so its
/// counter always equals the queue length. Blocking waits use a condition variable; a caller that
/// put the fd into O_NONBLOCK gets EAGAIN instead, as with a kernel event file.
#[derive(Debug)]
pub(crate) struct EventQueue<T> {
    queue: Mutex<VecDeque<T>>,
    ready: Condvar,
    fd: EventFd,
}

impl<T> EventQueue<T> {
    pub(crate) fn new() -> Result<Self> {
        let fd = EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_SEMAPHORE)
            .map_err(std::io::Error::from)?;
        Ok(Self {
            queue: Mutex::new(VecDeque::new()),
            ready: Condvar::new(),
            fd,
        })
    }

    pub(crate) fn push(&self, item: T) {
        let mut q = self.queue.lock();
        q.push_back(item);
        // Cannot fail: the counter stays far below its 2^64-2 ceiling.
        let _ = self.fd.write(1);
        self.ready.notify_one();
    }

    fn pop_locked(&self, q: &mut VecDeque<T>) -> Option<T> {
        let item = q.pop_front()?;
        // The counter equals the queue length, so this read never blocks.
        let _ = self.fd.read();
        Some(item)
    }

    /// Takes the next entry, waiting up to `timeout` (`None` waits forever). Honours O_NONBLOCK on
    /// the fd: then an empty queue gives [`Error::WouldBlock`] at once.
    pub(crate) fn pop(&self, timeout: Option<Duration>) -> Result<T> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut q = self.queue.lock();
        loop {
            if let Some(item) = self.pop_locked(&mut q) {
                return Ok(item);
            }
            if self.is_nonblocking() {
                return Err(Error::WouldBlock);
            }
            match deadline {
                None => self.ready.wait(&mut q),
                Some(d) => {
                    if self.ready.wait_until(&mut q, d).timed_out() && q.is_empty() {
                        return Err(Error::WouldBlock);
                    }
                }
            }
        }
    }

    /// Takes the next entry if there is one.
    #[cfg(test)]
    pub(crate) fn try_pop(&self) -> Option<T> {
        self.pop_locked(&mut self.queue.lock())
    }

    /// Drops every pending entry for which `pred` holds (used when their object is destroyed).
    pub(crate) fn remove_where(&self, mut pred: impl FnMut(&T) -> bool) -> usize {
        let mut q = self.queue.lock();
        let before = q.len();
        q.retain(|e| !pred(e));
        let removed = before - q.len();
        for _ in 0..removed {
            let _ = self.fd.read();
        }
        removed
    }

    /// Drops every pending entry.
    pub(crate) fn clear(&self) {
        self.remove_where(|_| true);
    }

    /// Number of pending entries.
    pub(crate) fn len(&self) -> usize {
        self.queue.lock().len()
    }

    fn is_nonblocking(&self) -> bool {
        fcntl(self.fd.as_raw_fd(), FcntlArg::F_GETFL)
            .map(|f| OFlag::from_bits_truncate(f).contains(OFlag::O_NONBLOCK))
            .unwrap_or(false)
    }

    pub(crate) fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    pub(crate) fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use std::sync::Arc;

    fn readable(q: &EventQueue<u32>) -> bool {
        let mut fds = [PollFd::new(q.as_fd(), PollFlags::POLLIN)];
        poll(&mut fds, PollTimeout::ZERO).unwrap() == 1
    }

    #[test]
    fn fd_readable_exactly_when_pending() {
        let q = EventQueue::new().unwrap();
        assert!(!readable(&q));
        q.push(1);
        q.push(2);
        assert!(readable(&q));
        assert_eq!(q.pop(None).unwrap(), 1);
        assert!(readable(&q));
        assert_eq!(q.try_pop(), Some(2));
        assert!(!readable(&q));
        q.push(3);
        assert_eq!(q.remove_where(|&x| x == 3), 1);
        assert!(!readable(&q));
    }

    #[test]
    fn nonblocking_fd_gives_eagain() {
        let q: EventQueue<u32> = EventQueue::new().unwrap();
        fcntl(q.raw_fd(), FcntlArg::F_SETFL(OFlag::O_NONBLOCK)).unwrap();
        assert!(matches!(q.pop(None), Err(Error::WouldBlock)));
        q.push(7);
        assert_eq!(q.pop(None).unwrap(), 7);
    }

    #[test]
    fn timeout_expires() {
        let q: EventQueue<u32> = EventQueue::new().unwrap();
        assert!(matches!(
            q.pop(Some(Duration::from_millis(10))),
            Err(Error::WouldBlock)
        ));
    }

    #[test]
    fn each_event_reaches_exactly_one_of_several_waiters() {
        let q = Arc::new(EventQueue::new().unwrap());
        let waiters: Vec<_> = (0..4)
            .map(|_| {
                let q = q.clone();
                std::thread::spawn(move || q.pop(Some(Duration::from_secs(10))).unwrap())
            })
            .collect();
        for i in 0..4 {
            q.push(i);
        }
        let mut got: Vec<u32> = waiters.into_iter().map(|w| w.join().unwrap()).collect();
        got.sort_unstable();
        assert_eq!(got, vec![0, 1, 2, 3]);
        assert!(!readable(&q));
    }

    #[test]
    fn use_count_rules() {
        let u = UseCount::default();
        u.acquire("pd").unwrap();
        assert_eq!(u.retire("pd").unwrap_err().errno(), 16);
        u.release();
        u.retire("pd").unwrap();
        assert!(u.is_retired());
        assert_eq!(u.acquire("pd").unwrap_err().errno(), 22);
        assert_eq!(u.retire("pd").unwrap_err().errno(), 22);
    }

    #[test]
    fn ack_counter_waits() {
        let c = Arc::new(AckCounter::default());
        c.delivered();
        let c2 = c.clone();
        let t = std::thread::spawn(move || c2.wait_all_acked());
        std::thread::sleep(Duration::from_millis(20));
        assert!(!t.is_finished());
        c.ack(1);
        t.join().unwrap();
        assert_eq!(c.counts(), (1, 1));
    }
}

/// Hashes numbers chosen by this device (QP numbers, memory keys) with one multiplication:
/// much cheaper than SipHash on every packet, and safe here because the keys in the tables are
/// ours (sequential QP numbers, random memory keys), so a peer naming other numbers cannot make
/// them collide.
pub(crate) type NumberHash = std::hash::BuildHasherDefault<NumberHasher>;

/// See [`NumberHash`].
#[derive(Debug, Default)]
pub(crate) struct NumberHasher(u64);

impl std::hash::Hasher for NumberHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u32(u32::from(b));
        }
    }

    fn write_u32(&mut self, n: u32) {
        self.0 = (self.0 ^ u64::from(n)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }

    fn finish(&self) -> u64 {
        self.0 ^ (self.0 >> 32)
    }
}
