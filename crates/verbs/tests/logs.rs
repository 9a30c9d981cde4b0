//! Logs: a process with `SOFTVERBS_LOG=debug` writes softverbs' events to stderr (QP state
//! changes, dropped packets with their reasons, retransmissions, error completions and the QP
//! moving to the error state); the same process without it writes nothing.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use softverbs::*;

/// The child: an RC QP connected to a QP number nobody has, so that its SEND is dropped at the
/// receiver, resent after each timeout and fails with RETRY_EXC.
fn child() {
    let ctx = common::lo();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16, None, 0).unwrap();
    let qp = pd.create_qp(&QpInit::new(QpType::Rc, &cq)).unwrap();
    let mr = pd.register(64, AccessFlags::LOCAL_WRITE).unwrap();
    common::to_init(&qp);
    // The QP number after ours in this process: not allocated.
    common::to_rtr(&ctx, &qp, qp.qp_num() + 0x100);
    qp.modify(
        &QpAttr {
            qp_state: QpState::Rts,
            sq_psn: 1,
            timeout: 8,
            retry_cnt: 2,
            rnr_retry: 0,
            max_rd_atomic: 1,
            ..Default::default()
        },
        QpAttrMask::STATE
            | QpAttrMask::SQ_PSN
            | QpAttrMask::TIMEOUT
            | QpAttrMask::RETRY_CNT
            | QpAttrMask::RNR_RETRY
            | QpAttrMask::MAX_QP_RD_ATOMIC,
    )
    .unwrap();
    qp.post_send(&[SendRequest {
        wr_id: 7,
        op: SendOp::Send {
            imm: None,
            invalidate: None,
        },
        flags: SendFlags::SIGNALED,
        payload: Payload::Sges(vec![mr.sge(0..64).unwrap()]),
        ud: None,
        xrc_srqn: None,
    }])
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut wc = [WorkCompletion::default(); 1];
    while cq.poll(&mut wc) == 0 {
        assert!(Instant::now() < deadline, "no completion");
    }
    assert_eq!(wc[0].status, WcStatus::RetryExcErr);
    println!("done");
}

fn run(log: Option<&str>) -> (String, String) {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.arg("--child")
        .env_remove("SOFTVERBS_LOG")
        .env_remove("RUST_LOG");
    if let Some(l) = log {
        c.env("SOFTVERBS_LOG", l);
    }
    let out = c.output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(out.status.success(), "child failed:\n{stdout}\n{stderr}");
    assert_eq!(stdout.trim(), "done");
    (stdout, stderr)
}

fn debug_log_shows_connection_events() {
    let (_, err) = run(Some("debug"));
    for needle in [
        "QP state change",
        "to=INIT",
        "to=RTR",
        "to=RTS",
        "dropped a packet: no such QP",
        "retransmission",
        "timeouts=",
        "error completion",
        "status=RetryExcErr",
        "QP moved to the error state",
        "UDP driver up",
    ] {
        assert!(err.contains(needle), "stderr lacks {needle:?}:\n{err}");
    }
    // Each event is one line on stderr, with its level.
    assert!(
        err.lines()
            .all(|l| l.contains("DEBUG") || l.contains("INFO") || l.contains("WARN") || l.contains("TRACE")),
        "{err}"
    );
}

fn a_filter_selects_targets() {
    // RUST_LOG syntax: only the QP module's events, and only from warnings up.
    let (_, err) = run(Some("softverbs_device::qp=warn"));
    assert!(err.contains("QP moved to the error state"), "{err}");
    assert!(
        !err.contains("QP state change") && !err.contains("dropped a packet"),
        "{err}"
    );
}

fn silent_without_the_variable() {
    let (_, err) = run(None);
    assert!(err.is_empty(), "stderr without SOFTVERBS_LOG:\n{err}");
    let (_, err) = run(Some(""));
    assert!(err.is_empty(), "stderr with an empty SOFTVERBS_LOG:\n{err}");
}

fn main() {
    if std::env::args().any(|a| a == "--child") {
        child();
        return;
    }
    std::env::set_var("SOFTVERBS_UDP_PORT", common::free_base_port().to_string());
    let tests: [(&str, fn()); 3] = [
        (
            "debug_log_shows_connection_events",
            debug_log_shows_connection_events,
        ),
        ("a_filter_selects_targets", a_filter_selects_targets),
        ("silent_without_the_variable", silent_without_the_variable),
    ];
    let mut failed = 0;
    for (name, t) in tests {
        let ok = std::panic::catch_unwind(t).is_ok();
        println!("test logs::{name} ... {}", if ok { "ok" } else { "FAILED" });
        failed += usize::from(!ok);
    }
    println!("{} passed, {} failed", tests.len() - failed, failed);
    std::process::exit(i32::from(failed > 0));
}
