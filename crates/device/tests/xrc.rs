//! XRC teardown rules and domain sharing on the core object model: ibv_close_xrcd fails with
//! EBUSY while SRQs or QPs use the handle, ibv_destroy_srq/ibv_destroy_cq/ibv_dealloc_pd while an
//! XRC SRQ uses them, a bad fd is EBADF, and domains keyed by a file's inode are shared between
//! processes (O_CREAT, O_EXCL, EAGAIN) with no daemon.

use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::process::Command;
use std::sync::Arc;

use softverbs_device::config::Config;
use softverbs_device::xrc::{O_CREAT, O_EXCL};
use softverbs_device::*;
use softverbs_engine::types::*;

const EBUSY: i32 = 16;
const EINVAL: i32 = 22;
const EAGAIN: i32 = 11;
const EBADF: i32 = 9;

fn ctx() -> Arc<Context> {
    let cfg = Config {
        interfaces: Some(vec!["lo".into()]),
        ..Config::default()
    };
    Context::open(&discover(&cfg).unwrap().remove(0)).unwrap()
}

fn srq_attr() -> SrqAttr {
    SrqAttr {
        max_wr: 4,
        max_sge: 1,
        srq_limit: 0,
    }
}

#[test]
fn ibv_close_xrcd_fails_while_an_srq_or_qp_uses_the_handle() {
    let ctx = ctx();
    let pd = Pd::alloc(&ctx).unwrap();
    let cq = Cq::create(&ctx, 8, None, 0).unwrap();
    let x = Xrcd::open(&ctx, None, 0).unwrap();
    let srq = Srq::create_xrc(&pd, &x, &cq, &srq_attr()).unwrap();
    assert_eq!(x.close().unwrap_err().errno(), EBUSY);
    // The SRQ still works after the refused close.
    srq.post_recv(&[RecvWr {
        wr_id: 1,
        sg_list: vec![],
    }])
    .unwrap();
    // Its CQ and PD cannot go either.
    assert_eq!(cq.destroy().unwrap_err().errno(), EBUSY);
    assert_eq!(pd.dealloc().unwrap_err().errno(), EBUSY);
    let tgt = Qp::create_xrc_recv(&x).unwrap();
    srq.destroy().unwrap();
    assert_eq!(x.close().unwrap_err().errno(), EBUSY);
    tgt.destroy().unwrap();
    x.close().unwrap();
    // A closed handle makes nothing more.
    assert_eq!(
        Srq::create_xrc(&pd, &x, &cq, &srq_attr()).unwrap_err().errno(),
        EINVAL
    );
    assert_eq!(Qp::create_xrc_recv(&x).unwrap_err().errno(), EINVAL);
    cq.destroy().unwrap();
    pd.dealloc().unwrap();
}

#[test]
fn an_opened_qp_holds_the_opening_handle_and_the_qp_dies_with_its_last_handle() {
    let ctx = ctx();
    let dir = std::env::temp_dir().join(format!("softverbs-xrc-core-{}", std::process::id()));
    let f = std::fs::File::create(&dir).unwrap();
    let x1 = Xrcd::open(&ctx, Some(f.as_raw_fd()), O_CREAT).unwrap();
    let x2 = Xrcd::open(&ctx, Some(f.as_raw_fd()), 0).unwrap();
    let tgt = Qp::create_xrc_recv(&x1).unwrap();
    let qpn = tgt.qpn();
    let opened = Qp::open(&x2, qpn, QpType::XrcRecv, 1).unwrap();
    assert!(Arc::ptr_eq(&tgt, &opened));
    assert_eq!(x2.close().unwrap_err().errno(), EBUSY);
    // Destroying the creator's handle closes only it: x1 is free, the QP lives on.
    tgt.destroy().unwrap();
    x1.close().unwrap();
    assert_eq!(opened.state(), QpState::Reset);
    let again = Qp::open(&x2, qpn, QpType::XrcRecv, 2).unwrap();
    opened.close_opened(&x2, 1).unwrap();
    again.close_opened(&x2, 2).unwrap();
    assert_eq!(
        Qp::open(&x2, qpn, QpType::XrcRecv, 3).unwrap_err().errno(),
        EINVAL
    );
    x2.close().unwrap();
    std::fs::remove_file(dir).unwrap();
}

#[test]
fn ibv_open_xrcd_with_a_bad_fd_is_ebadf() {
    let ctx = ctx();
    assert_eq!(
        Xrcd::open(&ctx, Some(1 << 20), O_CREAT).unwrap_err().errno(),
        EBADF
    );
}

/// Run in a child process by `domains_are_shared_between_processes`: opens the domain of the
/// file named by `SOFTVERBS_XRC_CHILD_FILE` with `SOFTVERBS_XRC_CHILD_OFLAGS` and prints the
/// errno (0 for success).
#[test]
fn xrc_child_process() {
    let (Ok(path), Ok(oflags)) = (
        std::env::var("SOFTVERBS_XRC_CHILD_FILE"),
        std::env::var("SOFTVERBS_XRC_CHILD_OFLAGS"),
    ) else {
        return;
    };
    let f = std::fs::File::open(path).unwrap();
    let ctx = ctx();
    let r = Xrcd::open(&ctx, Some(f.as_raw_fd()), oflags.parse().unwrap());
    println!("XRC-CHILD-ERRNO={} END", r.map_or_else(|e| e.errno(), |_| 0));
}

fn child_open(path: &std::path::Path, oflags: i32) -> i32 {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "xrc_child_process", "--nocapture", "--test-threads=1"])
        .env("SOFTVERBS_XRC_CHILD_FILE", path)
        .env("SOFTVERBS_XRC_CHILD_OFLAGS", oflags.to_string())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find_map(|l| l.split("XRC-CHILD-ERRNO=").nth(1))
        .unwrap_or_else(|| {
            panic!(
                "child said nothing: {stdout} {}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
    line.split_whitespace().next().unwrap().parse().unwrap()
}

#[test]
fn domains_are_shared_between_processes() {
    let path = std::env::temp_dir().join(format!("softverbs-xrc-procs-{}", std::process::id()));
    let f = std::fs::File::create(&path).unwrap();
    // Nobody has the domain: another process gets EAGAIN without O_CREAT.
    assert_eq!(child_open(&path, 0), EAGAIN);
    // ... and creates it with O_CREAT (then closes it on exit).
    assert_eq!(child_open(&path, O_CREAT), 0);
    assert_eq!(child_open(&path, 0), EAGAIN, "the last close destroyed it");
    // While this process holds it, another one opens it without O_CREAT, and O_EXCL fails.
    let ctx = ctx();
    let x = Xrcd::open(&ctx, Some(f.as_raw_fd()), O_CREAT | O_EXCL).unwrap();
    assert_eq!(child_open(&path, 0), 0);
    assert_eq!(child_open(&path, O_CREAT | O_EXCL), EINVAL);
    // The domain is announced by a registry file, which the last holder removes.
    let meta = std::fs::metadata(&path).unwrap();
    let registry = std::path::Path::new("/dev/shm").join(format!(
        "softverbs-xrcd-{}-{}-{}",
        ctx.device().name(),
        meta.dev(),
        meta.ino()
    ));
    assert!(registry.exists(), "{} while the domain lives", registry.display());
    x.close().unwrap();
    drop(x);
    assert!(!registry.exists(), "{} after the last close", registry.display());
    assert_eq!(child_open(&path, 0), EAGAIN);
    // Created and destroyed again, by this process and by another.
    let x = Xrcd::open(&ctx, Some(f.as_raw_fd()), O_CREAT).unwrap();
    assert_eq!(child_open(&path, 0), 0);
    drop(x);
    assert_eq!(child_open(&path, O_CREAT), 0);
    assert!(!registry.exists());
    std::fs::remove_file(path).unwrap();
}
