//! Registration of the device's event fds with tokio's reactor: the one `unsafe` call of the
//! async API (tokio's `AsyncFd::register_with_interest` trusts its caller that the fd stays
//! open, and the same file, for the `AsyncFd`'s life).

#![allow(unsafe_code)]

use std::os::fd::{AsFd, AsRawFd, RawFd};

use softverbs_engine::{Error, Result};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// An object that owns an event fd (a completion channel, a context), as the reactor takes it.
#[derive(Debug)]
pub(crate) struct EventFd<T>(T);

impl<T> EventFd<T> {
    pub(crate) fn get(&self) -> &T {
        &self.0
    }
}

impl<T: AsFd> AsRawFd for EventFd<T> {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

/// Objects whose `as_fd` is an event fd they own for their whole life.
pub(crate) trait OwnsEventFd: AsFd {}

impl OwnsEventFd for crate::CompletionChannel {}
impl OwnsEventFd for crate::Context {}

/// `inner`'s event fd, registered for readability with the current runtime's reactor.
pub(crate) fn register<T: OwnsEventFd>(inner: T) -> Result<AsyncFd<EventFd<T>>> {
    if tokio::runtime::Handle::try_current().is_err() {
        return Err(Error::invalid(
            "the async API needs a tokio runtime (with I/O enabled)",
        ));
    }
    // SAFETY: a completion channel's fd is the eventfd of its core channel and a context's is
    // its async event queue's eventfd: each is opened when the object is created and closed
    // only when the core object is dropped, which the `AsyncFd` prevents by owning a handle
    // (`inner`) for its whole life; `as_fd` returns that same fd on every call.
    unsafe { AsyncFd::register_with_interest(EventFd(inner), Interest::READABLE) }
        .map_err(|e| Error::Io(e.into()))
}
