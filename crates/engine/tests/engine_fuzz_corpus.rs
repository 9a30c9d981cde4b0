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
