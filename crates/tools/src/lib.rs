//! Shared code of the softverbs command-line tools: the `ibv_*` utilities that mirror rdma-core's
//! `libibverbs/examples` (device listing, device information, async event watching and the four
//! ping-pong tests).
//!
//! The ping-pong logic lives here rather than in the binaries so that it can run on any opened
//! device and any byte stream: the binaries hand it a TCP connection, and the tests run server
//! and client as two threads of one process.

pub mod asyncwatch;
pub mod cli;
pub mod pingpong;
pub mod run;
pub mod xsrq;

use std::fmt;

/// A tool failure: the message says what failed, as the rdma-core tools say it on stderr.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolError(String);

impl ToolError {
    /// An error with `msg`.
    pub fn new(msg: impl Into<String>) -> Self {
        Self(msg.into())
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ToolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ToolError {}

impl From<std::io::Error> for ToolError {
    fn from(e: std::io::Error) -> Self {
        Self(e.to_string())
    }
}

/// Attaches what was being done to an error, turning it into a [`ToolError`].
pub trait OrFail<T> {
    /// `Err(e)` becomes `"<what>: <e>"`.
    fn or_fail(self, what: &str) -> Result<T, ToolError>;
}

impl<T, E: fmt::Display> OrFail<T> for Result<T, E> {
    fn or_fail(self, what: &str) -> Result<T, ToolError> {
        self.map_err(|e| ToolError(format!("{what}: {e}")))
    }
}
