//! Replays the `engine_qp` fuzz corpus (`fuzz/corpus/engine_qp`) and the regression inputs
//! (`fuzz/regressions/engine_qp`) through the fuzz harness on stable, with every invariant it
//! checks, and asserts that the corpus still reaches what it was built to reach.

mod qp_fuzz;
mod sim;

use std::path::{Path, PathBuf};

use softverbs_engine::types::{EventType, QpState, QpType, WcOpcode, WcStatus};

fn inputs(dir: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz").join(dir);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

fn replay(files: &[PathBuf]) -> qp_fuzz::Coverage {
    let mut total = qp_fuzz::Coverage::default();
    for f in files {
        let data = std::fs::read(f).expect("readable input");
        let cov = std::panic::catch_unwind(|| qp_fuzz::run(&data))
            .unwrap_or_else(|_| panic!("{} violates an engine invariant (see above)", f.display()));
        total.merge(&cov);
    }
    total
}

#[test]
fn regression_inputs_replay_clean() {
    let files = inputs("regressions/engine_qp");
    assert!(!files.is_empty());
    replay(&files);
}

#[test]
fn corpus_replays_clean_and_covers_the_engine() {
    let files = inputs("corpus/engine_qp");
    assert!(files.len() >= 20, "only {} corpus files", files.len());
    let cov = replay(&files);

    use QpState::*;
    for (t, states) in [
        (QpType::Rc, &[Reset, Init, Rtr, Rts, Sqd, Err][..]),
        (QpType::Uc, &[Reset, Init, Rtr, Rts, Sqd, Sqe, Err]),
        (QpType::Ud, &[Reset, Init, Rtr, Rts, Sqd, Sqe, Err]),
        (QpType::XrcSend, &[Reset, Init, Rtr, Rts, Sqd, Err]),
        (QpType::XrcRecv, &[Reset, Init, Rtr, Rts, Err]),
    ] {
        for s in states {
            assert!(cov.states.contains(&(t.raw(), s.raw())), "no {t} QP entered {s}");
        }
    }
    let ok = WcStatus::Success.raw();
    for op in [
        WcOpcode::Send,
        WcOpcode::RdmaWrite,
        WcOpcode::RdmaRead,
        WcOpcode::CompSwap,
        WcOpcode::FetchAdd,
        WcOpcode::BindMw,
        WcOpcode::LocalInv,
        WcOpcode::AtomicWrite,
        WcOpcode::Flush,
    ] {
        assert!(
            cov.completions.contains(&(true, op.raw(), ok)),
            "no successful {op:?}"
        );
    }
    for op in [WcOpcode::Recv, WcOpcode::RecvRdmaWithImm] {
        assert!(
            cov.completions.contains(&(false, op.raw(), ok)),
            "no successful {op:?}"
        );
    }
    for status in [
        WcStatus::WrFlushErr,
        WcStatus::RetryExcErr,
        WcStatus::RnrRetryExcErr,
        WcStatus::RemAccessErr,
        WcStatus::RemInvReqErr,
        WcStatus::LocProtErr,
        WcStatus::LocLenErr,
        WcStatus::MwBindErr,
    ] {
        assert!(
            cov.completions.iter().any(|&(_, _, s)| s == status.raw()),
            "no completion with {status:?}"
        );
    }
    for e in [
        EventType::CommEst,
        EventType::SqDrained,
        EventType::QpLastWqeReached,
        EventType::QpReqErr,
        EventType::QpAccessErr,
    ] {
        assert!(cov.events.contains(&e.raw()), "no {e:?} event");
    }
    let c = cov.counters;
    assert!(
        c.retransmits > 0
            && c.timeouts > 0
            && c.rnr_naks_received > 0
            && c.seq_naks_received > 0
            && c.duplicates > 0,
        "{c:?}"
    );
    assert!(c.qkey_violations > 0 && c.pkey_violations > 0, "{c:?}");
    assert!(
        cov.unverified > 0 && cov.bad_icrc > 0 && cov.malformed > 0 && cov.no_qp > 0,
        "{cov:?}"
    );
    // Faithful scripts compared delivered data with what was sent.
    assert!(cov.verified >= 10, "{cov:?}");
    // Every opcode the wire knows reached an engine.
    assert_eq!(
        cov.delivered.len(),
        softverbs_wire::OPCODE_TABLE.len(),
        "{:?}",
        cov.delivered
    );
}

/// One mutation of `data` in the manner of libFuzzer's: flip a bit, set a byte, set a little-
/// endian word to an interesting value, insert, erase or duplicate a run, or splice in a part of
/// another input.
fn mutate(rng: &mut sim::Rng, data: &mut Vec<u8>, others: &[Vec<u8>]) {
    const INTERESTING: [u64; 8] = [0, 1, 0x7F, 0xFF, 0xFFFF, 0x00FF_FFFF, u32::MAX as u64, u64::MAX];
    if data.is_empty() {
        data.push(rng.next_u64() as u8);
    }
    let len = data.len();
    let at = rng.below(len as u64) as usize;
    match rng.below(7) {
        0 => data[at] ^= 1 << rng.below(8),
        1 => data[at] = rng.next_u64() as u8,
        2 => {
            let v = INTERESTING[rng.below(INTERESTING.len() as u64) as usize].to_le_bytes();
            let n = [1, 2, 4, 8][rng.below(4) as usize].min(len - at);
            data[at..at + n].copy_from_slice(&v[..n]);
        }
        3 => {
            let n = 1 + rng.below(16) as usize;
            let bytes = rng.bytes(n);
            data.splice(at..at, bytes);
        }
        4 => {
            let n = (1 + rng.below(32) as usize).min(len - at);
            data.drain(at..at + n);
        }
        5 => {
            let n = (1 + rng.below(64) as usize).min(len - at);
            let run = data[at..at + n].to_vec();
            let to = rng.below(len as u64 + 1) as usize;
            data.splice(to..to, run);
        }
        _ => {
            let o = &others[rng.below(others.len() as u64) as usize];
            if !o.is_empty() {
                let from = rng.below(o.len() as u64) as usize;
                let n = 1 + rng.below((o.len() - from) as u64) as usize;
                let to = rng.below(len as u64 + 1) as usize;
                data.splice(to..to, o[from..from + n].iter().copied());
            }
        }
    }
    data.truncate(1024);
}

/// Inputs beyond the corpus: corpus files mutated a few times each, and some random bytes, from
/// a fixed seed so that a run is repeatable (`QP_FUZZ_SEED` picks another, `QP_FUZZ_INPUTS` how
/// many). A failing input is written out, to be traced and kept in `fuzz/regressions/engine_qp/`.
#[test]
fn random_inputs_hold_the_invariants() {
    let seed = std::env::var("QP_FUZZ_SEED")
        .ok()
        .map(|s| s.trim().parse::<u64>().expect("QP_FUZZ_SEED is a decimal number"))
        .unwrap_or(1);
    let count = std::env::var("QP_FUZZ_INPUTS")
        .ok()
        .map(|s| s.trim().parse::<usize>().expect("QP_FUZZ_INPUTS is a number"))
        .unwrap_or(300);
    let corpus: Vec<Vec<u8>> = inputs("corpus/engine_qp")
        .iter()
        .chain(&inputs("regressions/engine_qp"))
        .map(|f| std::fs::read(f).expect("readable input"))
        .collect();
    let mut rng = sim::Rng::new(seed);
    let started = std::time::Instant::now();
    let mut total = qp_fuzz::Coverage::default();
    for i in 0..count {
        let mut data = if rng.below(10) == 0 {
            let n = rng.below(1025) as usize;
            rng.bytes(n)
        } else {
            corpus[rng.below(corpus.len() as u64) as usize].clone()
        };
        for _ in 0..1 + rng.below(8) {
            mutate(&mut rng, &mut data, &corpus);
        }
        match std::panic::catch_unwind(|| qp_fuzz::run(&data)) {
            Ok(cov) => total.merge(&cov),
            Err(_) => {
                let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("engine_qp-{seed}-{i}"));
                std::fs::write(&out, &data).expect("write the failing input");
                panic!(
                    "input {i} of seed {seed} violates an engine invariant (see above); it is in {} \
                     (QP_FUZZ_TRACE=1 traces its replay)",
                    out.display()
                );
            }
        }
    }
    eprintln!(
        "{count} inputs of seed {seed} in {:.1} s, {} actions",
        started.elapsed().as_secs_f64(),
        total.actions
    );
    assert!(total.actions > count as u64, "{total:?}");
}
