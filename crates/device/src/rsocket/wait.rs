//! Sleeping until something happens to a socket, without spinning and without lost wake-ups.
//!
//! A thread that must wait arms the socket's CQs, looks once more, and then sleeps in
//! `poll(2)` on what can change its mind: the completion channels (an armed CQ raises an
//! event), the CM event channel, the UDP socket or the accept queue, and the socket's
//! [`Notifier`]. The notifier is for progress made by another thread: a thread that polled a
//! CQ (which can also withdraw a pending completion event, see `Cq::take`) or consumed a CM
//! event while others sleep on the socket wakes them through it.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::libc;
use nix::poll::{PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use parking_lot::{Mutex, MutexGuard};
use softverbs_engine::Result;

use crate::cm::EventChannel;
use crate::cq::CompChannel;
use crate::device::Device;

use super::{defaults, errno};

/// Wakes the threads sleeping on a socket. `enter`, `leave` and `wake` are called under the
/// socket's lock, which orders them with the state changes they are about.
#[derive(Debug)]
pub(crate) struct Notifier {
    fd: EventFd,
    sleepers: AtomicU32,
}

impl Notifier {
    pub(crate) fn new() -> Result<Self> {
        Ok(Self {
            fd: EventFd::from_flags(EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)
                .map_err(std::io::Error::from)?,
            sleepers: AtomicU32::new(0),
        })
    }

    /// A thread is about to sleep on the socket.
    pub(crate) fn enter(&self) {
        self.sleepers.fetch_add(1, Ordering::SeqCst);
    }

    /// A thread woke. The last one out consumes the wake-up, so that the fd is readable
    /// exactly while some sleeper has not yet seen it.
    pub(crate) fn leave(&self) {
        if self.sleepers.fetch_sub(1, Ordering::SeqCst) == 1 {
            let _ = self.fd.read();
        }
    }

    /// The socket's state changed: wakes whoever sleeps on it.
    pub(crate) fn wake(&self) {
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            let _ = self.fd.write(1);
        }
    }

    pub(crate) fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Something a sleeping thread waits to become readable; the `Arc` keeps it open while the
/// socket's lock is released.
#[derive(Debug, Clone)]
pub(crate) enum Source {
    Comp(Arc<CompChannel>),
    Cm(Arc<EventChannel>),
    Fd(Arc<std::os::fd::OwnedFd>),
    Queue(Arc<crate::sync::EventQueue<Arc<super::Stream>>>),
}

impl Source {
    pub(crate) fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Self::Comp(c) => c.as_fd(),
            Self::Cm(c) => c.as_fd(),
            Self::Fd(f) => f.as_fd(),
            Self::Queue(q) => q.as_fd(),
        }
    }
}

/// What one socket's sleep waits on.
#[derive(Debug, Default)]
pub(crate) struct WaitSet {
    pub(crate) sources: Vec<Source>,
    /// Devices whose held-back posts must leave before the thread sleeps.
    pub(crate) devices: Vec<Device>,
}

impl WaitSet {
    pub(crate) fn flush(&self) {
        for d in &self.devices {
            d.node().fabric().flush_outbox();
        }
    }
}

/// The remaining time until `deadline` as a `poll(2)` timeout, capped at `cap`.
pub(crate) fn timeout_until(deadline: Option<Instant>, cap: Duration) -> PollTimeout {
    let left = match deadline {
        None => cap,
        Some(d) => d.saturating_duration_since(Instant::now()).min(cap),
    };
    // Rounded up, so that a short wait does not become a busy one.
    let ms = left.as_micros().div_ceil(1000);
    PollTimeout::try_from(i32::try_from(ms).unwrap_or(i32::MAX)).unwrap_or(PollTimeout::MAX)
}

/// Sleeps until one of `fds` is readable or the timeout passes. EINTR is reported as such.
pub(crate) fn sleep(fds: &[BorrowedFd<'_>], timeout: PollTimeout) -> Result<()> {
    let mut pfds: Vec<PollFd<'_>> = fds.iter().map(|fd| PollFd::new(*fd, PollFlags::POLLIN)).collect();
    nix::poll::poll(&mut pfds, timeout)
        .map(|_| ())
        .map_err(|e| std::io::Error::from(e).into())
}

/// Acknowledges the completion events `comp` holds, without waiting: the CQ is polled next,
/// so what they announce is taken either way.
pub(crate) fn take_comp_events(comp: &CompChannel) {
    while comp.pending() > 0 {
        match comp.get_cq_event(Some(Duration::ZERO)) {
            Ok(cq) => cq.ack_events(1),
            Err(_) => break,
        }
    }
}

/// A socket threads wait on: its state under a lock, how to take what happened, and what to
/// arm and sleep on. The waiting itself (for blocking calls and for `poll`) is the same for
/// every kind of socket.
pub(crate) trait Waitable {
    /// What the socket's lock guards.
    type State;

    /// The socket's lock and its notifier.
    fn parts(&self) -> (&Mutex<Self::State>, &Notifier);

    /// The socket's state, locked.
    fn lock(&self) -> MutexGuard<'_, Self::State> {
        self.parts().0.lock()
    }

    /// Wakes the threads sleeping on the socket.
    fn notifier(&self) -> &Notifier {
        self.parts().1
    }

    /// Takes what happened without waiting; true if anything changed.
    fn take_events(&self, st: &mut Self::State) -> bool;

    /// Takes what happened without waiting, and wakes the other threads waiting on the socket
    /// if anything changed.
    fn progress(&self, st: &mut Self::State) {
        if self.take_events(st) {
            self.notifier().wake();
        }
    }

    /// Requests the events that end a sleep on this socket.
    fn arm(&self, st: &Self::State);

    /// What a sleep on this socket waits for, besides its notifier.
    fn wait_set(&self, st: &Self::State) -> WaitSet;

    /// Whether the socket was closed.
    fn is_closed(st: &Self::State) -> bool;

    /// EBADF once the socket is closed.
    fn check_open(st: &Self::State) -> Result<()> {
        if Self::is_closed(st) {
            Err(errno(libc::EBADF))
        } else {
            Ok(())
        }
    }

    /// Waits until `ready` holds: polls for a little while, then sleeps in `poll(2)`. EBADF
    /// once the socket is closed, EAGAIN at once if `nonblock`, ETIMEDOUT past `deadline`,
    /// EINTR if a signal interrupts the sleep.
    fn wait(
        &self,
        st: &mut MutexGuard<'_, Self::State>,
        nonblock: bool,
        deadline: Option<Instant>,
        ready: impl Fn(&Self::State) -> bool,
    ) -> Result<()> {
        let spin_until = Instant::now() + Duration::from_micros(u64::from(defaults().polling_time));
        loop {
            self.progress(st);
            if ready(st) {
                return Ok(());
            }
            Self::check_open(st)?;
            if nonblock {
                return Err(errno(libc::EAGAIN));
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(errno(libc::ETIMEDOUT));
            }
            if Instant::now() < spin_until {
                MutexGuard::unlocked(st, std::thread::yield_now);
                continue;
            }
            self.arm(st);
            self.progress(st);
            if ready(st) {
                return Ok(());
            }
            let set = self.wait_set(st);
            let notify = self.notifier();
            notify.enter();
            let slept = MutexGuard::unlocked(st, || {
                set.flush();
                let mut fds: Vec<BorrowedFd<'_>> = set.sources.iter().map(Source::as_fd).collect();
                fds.push(notify.as_fd());
                let cap = Duration::from_millis(u64::from(defaults().wake_up_interval));
                sleep(&fds, timeout_until(deadline, cap))
            });
            notify.leave();
            slept?;
        }
    }

    /// Arms the socket and registers a sleeper (before the caller's last look, so that no
    /// change after it goes unnoticed); the returned set is what to sleep on, besides the
    /// notifier.
    fn poll_prepare(&self) -> WaitSet {
        let st = self.lock();
        self.arm(&st);
        self.notifier().enter();
        self.wait_set(&st)
    }

    /// Ends a sleep registered by [`Waitable::poll_prepare`].
    fn poll_finish(&self) {
        let _st = self.lock();
        self.notifier().leave();
    }
}
