//! Drives two transport engines with a script decoded from the input: state changes through
//! the validated transitions, work requests of every opcode, packets (the peer's, dropped,
//! duplicated, reordered or corrupted, and injected ones, structured or raw) and timer ticks,
//! with every invariant of `crates/engine/tests/qp_fuzz` checked after every step. The
//! harness is shared with the stable replay test (`crates/engine/tests/engine_fuzz_corpus.rs`).
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../crates/engine/tests/sim/mod.rs"]
mod sim;

#[path = "../../crates/engine/tests/qp_fuzz/mod.rs"]
mod qp_fuzz;

fuzz_target!(|data: &[u8]| {
    qp_fuzz::run(data);
});
