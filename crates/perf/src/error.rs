//! The error type of the benchmark: a message, converted from any error it meets.

use std::fmt;

/// A failure of the benchmark, with a human-readable explanation.
///
/// Any standard error converts into it (`?` works on verbs, I/O and parse errors alike); it does
/// not implement [`std::error::Error`] itself, which is what makes that blanket conversion legal.
pub struct Error(String);

impl Error {
    /// An error with the message `msg`.
    pub fn msg(msg: impl Into<String>) -> Self {
        Self(msg.into())
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl<E: std::error::Error> From<E> for Error {
    fn from(e: E) -> Self {
        Self(e.to_string())
    }
}

/// The result type of the benchmark.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Returns early with an [`Error`] made from a format string.
macro_rules! bail {
    ($($t:tt)*) => {
        return Err($crate::error::Error::msg(format!($($t)*)))
    };
}
pub(crate) use bail;
