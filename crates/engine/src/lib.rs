//! The softverbs transport engine and the verbs data model it works on.
//!
//! This crate is pure: it never reads a clock, touches a socket or spawns a thread. Everything that
//! both front ends (the safe Rust API and the C ABI) must agree on lives here, so there is exactly
//! one source of truth for it:
//!
//! * [`types`]: the verbs vocabulary (QP types and states, access flags, attributes, completions,
//!   events) with the numeric values of `<infiniband/verbs.h>`;
//! * [`qp_state`]: the IBTA QP state machine with the required and optional attribute masks of
//!   every transition for every QP type, and value checks for each attribute;
//! * [`rate`]: the static-rate conversions of `ibv_rate_to_mult(3)`;
//! * [`mw`]: memory windows and the rules of binding, using and invalidating them;
//! * [`tm`]: tag matching: the tag list and unexpected-message phase of a tag-matching SRQ;
//! * [`cm`]: the IB Communication Manager (connection setup and teardown over QP1 MADs) as a
//!   sans-IO state machine;
//! * [`Error`]: caller errors, each mapping to the errno the man pages name.

pub mod cm;
pub mod error;
pub mod memory;
pub mod mw;
pub mod pacing;
pub mod qp_state;
pub mod rate;
pub mod steering;
pub mod time;
pub mod tm;
pub mod transport;
pub mod tso;
pub mod types;
pub mod wr;

pub use error::{Errno, Error, Result};
