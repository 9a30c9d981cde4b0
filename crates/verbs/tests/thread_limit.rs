//! The threads a device starts (the fabric's progress thread with the first device list, the
//! UDP receive thread with the first QP, the CQ moderation timer with the first moderation
//! period) count against the process's thread limit. When that limit is reached, the verb that
//! needs the thread fails with ENOMEM, as rdma-core's verbs do when the kernel is out of
//! resources, instead of the process aborting; once the limit allows it the same verb succeeds,
//! and the device works as before.
//!
//! The limit is `RLIMIT_NPROC`, which binds only users without CAP_SYS_RESOURCE: the harness
//! re-runs a copy of its own executable (`--limited`) as a user id no other process has, so
//! that the threads it counts are the copy's own.

mod common;

use std::os::unix::process::CommandExt;
use std::process::Command;

use nix::sys::resource::{getrlimit, setrlimit, Resource};
use softverbs::*;

use common::{lo, to_rts, wait_one};

const ENOMEM: i32 = 12;

/// Threads of this process, as the kernel counts them.
fn threads() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("a Threads line in /proc/self/status")
}

/// No thread may be started from here on (the user's count is this process's alone).
fn cap_threads() {
    let (_, hard) = getrlimit(Resource::RLIMIT_NPROC).unwrap();
    setrlimit(Resource::RLIMIT_NPROC, threads(), hard).unwrap();
    // The limit must really bind, or the checks below would pass for the wrong reason.
    let spawned = std::thread::Builder::new().spawn(|| {});
    assert!(spawned.is_err(), "a thread started under the limit");
}

/// Back to the inherited hard limit, far above what the test starts.
fn uncap_threads() {
    let (_, hard) = getrlimit(Resource::RLIMIT_NPROC).unwrap();
    setrlimit(Resource::RLIMIT_NPROC, hard, hard).unwrap();
}

/// As the limited user: every verb that needs a new thread fails with ENOMEM while none may
/// start, and succeeds afterwards.
fn limited() {
    assert!(
        !nix::unistd::geteuid().is_root(),
        "the limit binds only an unprivileged user"
    );
    cap_threads();
    let err = devices().expect_err("a device list with no progress thread");
    assert_eq!(err.errno(), ENOMEM, "{err}");
    println!("  device list without a progress thread: ENOMEM");
    uncap_threads();

    let ctx = lo();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16, None, 0).unwrap();
    cap_threads();
    let err = pd
        .create_qp(&QpInit::new(QpType::Rc, &cq))
        .expect_err("a QP with no receive thread");
    assert_eq!(err.errno(), ENOMEM, "{err}");
    println!("  QP without a receive thread: ENOMEM");
    uncap_threads();
    let a = pd.create_qp(&QpInit::new(QpType::Rc, &cq)).unwrap();
    let b = pd.create_qp(&QpInit::new(QpType::Rc, &cq)).unwrap();

    cap_threads();
    let period = Moderation {
        cq_count: 4,
        cq_period: 100,
    };
    let err = cq
        .modify_moderation(period)
        .expect_err("a moderation period with no timer thread");
    assert_eq!(err.errno(), ENOMEM, "{err}");
    assert_eq!(
        cq.moderation(),
        Moderation::default(),
        "the failed verb changed nothing"
    );
    println!("  moderation period without a timer thread: ENOMEM");
    uncap_threads();
    cq.modify_moderation(period).unwrap();
    assert_eq!(cq.moderation(), period);

    // After the failures the device carries traffic as ever.
    to_rts(&ctx, &a, b.qp_num());
    to_rts(&ctx, &b, a.qp_num());
    let access = AccessFlags::LOCAL_WRITE;
    let (src, dst) = (pd.register(64, access).unwrap(), pd.register(64, access).unwrap());
    src.write(0, b"sent after the thread limit").unwrap();
    b.post_recv(&[RecvWr {
        wr_id: 2,
        sg_list: vec![dst.sge(0..64).unwrap()],
    }])
    .unwrap();
    a.post_send(&[SendRequest {
        wr_id: 1,
        op: SendOp::Send {
            imm: None,
            invalidate: None,
        },
        flags: SendFlags::SIGNALED,
        payload: Payload::Sges(vec![src.sge(0..27).unwrap()]),
        ud: None,
        xrc_srqn: None,
    }])
    .unwrap();
    let mut done = [wait_one(&cq), wait_one(&cq)];
    done.sort_by_key(|wc| wc.wr_id);
    assert!(done.iter().all(|wc| wc.status == WcStatus::Success), "{done:?}");
    assert_eq!(done[1].byte_len, 27);
    let mut got = [0u8; 27];
    dst.read(0, &mut got).unwrap();
    assert_eq!(&got, b"sent after the thread limit");
    println!("  a SEND afterwards: delivered");
    println!("limited run passed");
}

/// A user id that no process of this host has.
fn unused_uid() -> u32 {
    let used: std::collections::HashSet<u32> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path().join("status")).ok())
        .filter_map(|s| {
            let line = s.lines().find(|l| l.starts_with("Uid:"))?.to_owned();
            line.split_whitespace().nth(1)?.parse().ok()
        })
        .collect();
    (0..1000u32)
        .map(|i| 200_000 + (std::process::id() + i * 7919) % 100_000)
        .find(|u| !used.contains(u))
        .expect("an unused user id")
}

fn verbs_that_need_a_thread_fail_with_enomem() {
    let uid = unused_uid();
    let exe = common::ProgramCopy::of_this_program();
    let out = Command::new(&exe.0)
        .arg("--limited")
        .uid(uid)
        .gid(uid)
        .output()
        .expect("run the limited copy");
    let text = String::from_utf8_lossy(&out.stdout);
    print!("{text}");
    assert!(
        out.status.success() && text.contains("limited run passed"),
        "exit {:?}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--limited") {
        return limited();
    }
    if args.iter().any(|a| a == "--list") {
        println!("thread_limit: test");
        return;
    }
    // A private base port, so the test does not depend on other softverbs processes of the
    // host; the copy inherits it.
    std::env::set_var("SOFTVERBS_UDP_PORT", common::free_base_port().to_string());
    assert!(
        nix::unistd::Uid::effective().is_root(),
        "running a copy under another user's thread limit needs root; CI runs as root"
    );
    let ok = std::panic::catch_unwind(verbs_that_need_a_thread_fail_with_enomem).is_ok();
    println!(
        "test verbs that need a thread fail with ENOMEM ... {}",
        if ok { "ok" } else { "FAILED" }
    );
    if !ok {
        std::process::exit(1);
    }
}
