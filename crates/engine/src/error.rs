//! Errors returned to callers of the verbs, each with the errno the man pages name.

use std::borrow::Cow;

use crate::qp_state::ModifyQpError;

/// Linux errno values used by the verbs. The project targets Linux, where these are fixed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum Errno {
    /// Operation not permitted.
    EPERM = 1,
    /// No such file or directory (an object that does not exist).
    ENOENT = 2,
    /// Resource temporarily unavailable.
    EAGAIN = 11,
    /// Out of memory or out of device resources.
    ENOMEM = 12,
    /// Bad address.
    EFAULT = 14,
    /// Resource busy: an object is still in use.
    EBUSY = 16,
    /// No such device.
    ENODEV = 19,
    /// Invalid argument.
    EINVAL = 22,
    /// Function not implemented.
    ENOSYS = 38,
    /// Operation not supported.
    EOPNOTSUPP = 95,
}

impl Errno {
    /// The raw errno number.
    pub fn raw(self) -> i32 {
        self as i32
    }
}

/// A caller error from a verb. Transport failures never appear here: they are work-completion
/// statuses, and malformed packets are dropped and counted.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An argument is invalid (EINVAL). The text names the argument.
    #[error("invalid argument: {0}")]
    InvalidArgument(Cow<'static, str>),
    /// A QP modification was rejected (EINVAL); the error names the offending attribute.
    #[error(transparent)]
    ModifyQp(#[from] ModifyQpError),
    /// The object is still in use by another object (EBUSY).
    #[error("resource busy: {0}")]
    Busy(Cow<'static, str>),
    /// A device limit or memory was exhausted (ENOMEM).
    #[error("out of resources: {0}")]
    NoResources(Cow<'static, str>),
    /// The device does not implement this (EOPNOTSUPP).
    #[error("operation not supported: {0}")]
    NotSupported(Cow<'static, str>),
    /// The caller lacks a needed capability, such as CAP_NET_RAW for raw packet QPs, or combined
    /// objects of different protection domains (EPERM).
    #[error("operation not permitted: {0}")]
    PermissionDenied(Cow<'static, str>),
    /// A non-blocking call found nothing to return (EAGAIN).
    #[error("would block")]
    WouldBlock,
    /// The device is not present (ENODEV).
    #[error("no such device: {0}")]
    NoDevice(Cow<'static, str>),
    /// An operating-system call failed.
    #[error("system call failed: {0}")]
    Io(#[from] std::io::Error),
}

impl Error {
    /// Shorthand for [`Error::InvalidArgument`].
    pub fn invalid(msg: impl Into<Cow<'static, str>>) -> Self {
        Self::InvalidArgument(msg.into())
    }

    /// Shorthand for [`Error::Busy`].
    pub fn busy(msg: impl Into<Cow<'static, str>>) -> Self {
        Self::Busy(msg.into())
    }

    /// Shorthand for [`Error::PermissionDenied`].
    pub fn permission(msg: impl Into<Cow<'static, str>>) -> Self {
        Self::PermissionDenied(msg.into())
    }

    /// Shorthand for [`Error::NoResources`].
    pub fn no_resources(msg: impl Into<Cow<'static, str>>) -> Self {
        Self::NoResources(msg.into())
    }

    /// Shorthand for [`Error::NotSupported`].
    pub fn not_supported(msg: impl Into<Cow<'static, str>>) -> Self {
        Self::NotSupported(msg.into())
    }

    /// The errno a C caller sees for this error.
    pub fn errno(&self) -> i32 {
        match self {
            Self::InvalidArgument(_) | Self::ModifyQp(_) => Errno::EINVAL.raw(),
            Self::Busy(_) => Errno::EBUSY.raw(),
            Self::NoResources(_) => Errno::ENOMEM.raw(),
            Self::NotSupported(_) => Errno::EOPNOTSUPP.raw(),
            Self::PermissionDenied(_) => Errno::EPERM.raw(),
            Self::WouldBlock => Errno::EAGAIN.raw(),
            Self::NoDevice(_) => Errno::ENODEV.raw(),
            Self::Io(e) => e.raw_os_error().unwrap_or(Errno::EINVAL.raw()),
        }
    }
}

impl From<Error> for std::io::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Io(io) => io,
            other => Self::from_raw_os_error(other.errno()),
        }
    }
}

/// Result of a verb.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_mapping() {
        assert_eq!(Error::invalid("x").errno(), 22);
        assert_eq!(Error::busy("x").errno(), 16);
        assert_eq!(Error::no_resources("x").errno(), 12);
        assert_eq!(Error::not_supported("x").errno(), 95);
        assert_eq!(Error::WouldBlock.errno(), 11);
        let io: std::io::Error = Error::busy("pd in use").into();
        assert_eq!(io.raw_os_error(), Some(16));
    }
}
