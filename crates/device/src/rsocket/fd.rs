//! What rsockets keep of file-descriptor semantics: the flags `fcntl` sets, and the
//! descriptor each socket owns as its number.

use nix::libc;
use softverbs_engine::Result;

use super::errno;

/// The file status flags and close-on-exec flag of a socket, as `fcntl` sees them.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct FdFlags {
    status: i32,
    cloexec: bool,
}

impl FdFlags {
    /// Whether `O_NONBLOCK` is set.
    pub(crate) fn is_nonblocking(&self) -> bool {
        self.status & libc::O_NONBLOCK != 0
    }

    /// Whether a call with `MSG_*` `flags` must not block.
    pub(crate) fn nonblocking(&self, flags: i32) -> bool {
        self.is_nonblocking() || flags & libc::MSG_DONTWAIT != 0
    }

    /// `fcntl`: F_GETFL, F_SETFL, F_GETFD, F_SETFD; EINVAL for other commands.
    pub(crate) fn fcntl(&mut self, cmd: i32, arg: i32) -> Result<i32> {
        match cmd {
            libc::F_GETFL => Ok(self.status | libc::O_RDWR),
            libc::F_SETFL => {
                self.status = arg & !libc::O_ACCMODE;
                Ok(0)
            }
            libc::F_GETFD => Ok(if self.cloexec { libc::FD_CLOEXEC } else { 0 }),
            libc::F_SETFD => {
                self.cloexec = arg & libc::FD_CLOEXEC != 0;
                Ok(0)
            }
            _ => Err(errno(libc::EINVAL)),
        }
    }
}

/// `AsFd` of a socket type as the descriptor in its field `$fd` (the socket's number), and
/// `Drop` as `close`, so that a socket dropped without `rclose` still ends in order.
macro_rules! socket_fd {
    ($ty:ty, $fd:ident) => {
        impl std::os::fd::AsFd for $ty {
            fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
                #[allow(unused_imports)]
                use std::os::fd::AsFd as _;
                self.$fd.as_fd()
            }
        }

        impl Drop for $ty {
            fn drop(&mut self) {
                self.close();
            }
        }
    };
}
pub(crate) use socket_fd;
