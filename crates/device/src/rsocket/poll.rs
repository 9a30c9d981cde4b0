//! `rpoll` and `rselect`: readiness of rsockets and ordinary file descriptors together.
//!
//! An rsocket's readiness is its protocol state (data received, credits to send, a connection
//! made or ended), found by taking what its queues hold. To sleep, each rsocket arms its CQs
//! and contributes the descriptors that change its state (see `wait`), and ordinary
//! descriptors take part as they are; after a wake-up every entry is looked at again.

use std::os::fd::BorrowedFd;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout};
use softverbs_engine::Result;

use super::wait::{self, WaitSet, Waitable};
use super::{defaults, Socket};

/// `POLLIN`.
pub const POLLIN: i16 = nix::libc::POLLIN;
/// `POLLOUT`.
pub const POLLOUT: i16 = nix::libc::POLLOUT;
/// `POLLERR`: the connection broke or could not be made.
pub const POLLERR: i16 = nix::libc::POLLERR;
/// `POLLHUP`: the connection ended.
pub const POLLHUP: i16 = nix::libc::POLLHUP;
/// `POLLNVAL`: the socket is closed.
pub const POLLNVAL: i16 = nix::libc::POLLNVAL;

/// What an entry of [`poll`] watches.
#[derive(Debug, Clone, Copy)]
pub enum PollTarget<'a> {
    /// An rsocket.
    Socket(&'a Socket),
    /// An ordinary file descriptor.
    Fd(BorrowedFd<'a>),
    /// Nothing (a negative fd in `struct pollfd`): never ready.
    None,
}

/// One entry of [`poll`] (`struct pollfd`).
#[derive(Debug, Clone, Copy)]
pub struct PollEntry<'a> {
    /// What to watch.
    pub target: PollTarget<'a>,
    /// `POLLIN`, `POLLOUT`, ...
    pub events: i16,
    /// What happened (set by [`poll`]).
    pub revents: i16,
}

impl<'a> PollEntry<'a> {
    /// An entry for `target` watching `events`.
    pub fn new(target: PollTarget<'a>, events: i16) -> Self {
        Self {
            target,
            events,
            revents: 0,
        }
    }
}

impl Socket {
    fn poll_events(&self, events: i16) -> i16 {
        match self {
            Self::Stream(s) => s.poll_events(events),
            Self::Datagram(d) => d.poll_events(events),
        }
    }

    fn poll_prepare(&self) -> WaitSet {
        match self {
            Self::Stream(s) => s.poll_prepare(),
            Self::Datagram(d) => d.poll_prepare(),
        }
    }

    fn poll_finish(&self) {
        match self {
            Self::Stream(s) => s.poll_finish(),
            Self::Datagram(d) => d.poll_finish(),
        }
    }

    fn notifier_fd(&self) -> BorrowedFd<'_> {
        match self {
            Self::Stream(s) => s.notifier().as_fd(),
            Self::Datagram(d) => d.notifier().as_fd(),
        }
    }
}

/// Sets every entry's `revents` from what is true now; returns how many are non-zero.
fn check(entries: &mut [PollEntry<'_>]) -> Result<usize> {
    let mut fds = Vec::new();
    for e in entries.iter_mut() {
        e.revents = match e.target {
            PollTarget::Socket(s) => s.poll_events(e.events),
            PollTarget::Fd(fd) => {
                fds.push(PollFd::new(fd, PollFlags::from_bits_truncate(e.events)));
                0
            }
            PollTarget::None => 0,
        };
    }
    if !fds.is_empty() {
        nix::poll::poll(&mut fds, PollTimeout::ZERO).map_err(std::io::Error::from)?;
        let mut it = fds.iter();
        for e in entries.iter_mut() {
            if let PollTarget::Fd(_) = e.target {
                let f = it.next().expect("one per fd entry");
                e.revents = f.revents().map_or(0, |r| r.bits());
            }
        }
    }
    Ok(entries.iter().filter(|e| e.revents != 0).count())
}

/// `rpoll`: waits until an entry is ready or `timeout` passes (`None`: forever; zero: look
/// once). Returns the number of ready entries (0 on timeout). EINTR if a signal interrupts
/// the wait.
pub fn poll(entries: &mut [PollEntry<'_>], timeout: Option<Duration>) -> Result<usize> {
    let start = Instant::now();
    let deadline = timeout.map(|t| start + t);
    let spin = Duration::from_micros(u64::from(defaults().polling_time));
    loop {
        let n = check(entries)?;
        if n > 0 || timeout == Some(Duration::ZERO) {
            return Ok(n);
        }
        if start.elapsed() > spin || deadline.is_some_and(|d| Instant::now() >= d) {
            break;
        }
        std::thread::yield_now();
    }
    let cap = Duration::from_millis(u64::from(defaults().wake_up_interval));
    loop {
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(0);
        }
        let sockets: Vec<&Socket> = entries
            .iter()
            .filter_map(|e| match e.target {
                PollTarget::Socket(s) => Some(s),
                _ => None,
            })
            .collect();
        let sets: Vec<WaitSet> = sockets.iter().map(|s| s.poll_prepare()).collect();
        let slept: Result<usize> = (|| {
            // Looked at after arming and registering, so nothing that happens from here on
            // goes unnoticed.
            let n = check(entries)?;
            if n > 0 {
                return Ok(n);
            }
            let mut fds: Vec<PollFd<'_>> = Vec::new();
            for (s, set) in sockets.iter().zip(&sets) {
                set.flush();
                fds.extend(
                    set.sources
                        .iter()
                        .map(|src| PollFd::new(src.as_fd(), PollFlags::POLLIN)),
                );
                fds.push(PollFd::new(s.notifier_fd(), PollFlags::POLLIN));
            }
            for e in entries.iter() {
                if let PollTarget::Fd(fd) = e.target {
                    fds.push(PollFd::new(fd, PollFlags::from_bits_truncate(e.events)));
                }
            }
            nix::poll::poll(&mut fds, wait::timeout_until(deadline, cap)).map_err(std::io::Error::from)?;
            Ok(0)
        })();
        for s in &sockets {
            s.poll_finish();
        }
        let n = slept?;
        if n > 0 {
            return Ok(n);
        }
        let n = check(entries)?;
        if n > 0 {
            return Ok(n);
        }
    }
}
