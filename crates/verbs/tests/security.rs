//! The claims of ARCHITECTURE.md's security model that concern memory keys and other users,
//! through the device:
//!
//! - memory keys are random 31-bit values, distinct, with lkey and rkey different;
//! - a remote access succeeds only with the rkey of a region of the QP's PD, within its
//!   bounds and with the right it was registered with; every other attempt (a guessed key, an
//!   lkey, another PD's key, past the end, without the right, a deregistered region's key)
//!   fails with `IBV_WC_REM_ACCESS_ERR` and changes no byte of any region;
//! - as root, a process of another user cannot open this user's shared-memory mailboxes,
//!   connection-manager, multicast or XRC-relay directories, nor read this process's memory
//!   with `process_vm_readv` (the payload copy path).
//!
//! The harness re-runs its own executable as that other user (`--intruder`).

mod common;

use std::collections::HashSet;
use std::process::Command;

use softverbs::*;

use common::{lo, to_rts, wait_one};

const ALL: AccessFlags = AccessFlags::LOCAL_WRITE
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_READ)
    .union(AccessFlags::REMOTE_ATOMIC);

/// The user the intruder runs as (`nobody`).
const NOBODY: u32 = 65534;

fn keys_are_random_and_distinct() {
    let ctx = lo();
    let pds = [ctx.alloc_pd().unwrap(), ctx.alloc_pd().unwrap()];
    let mrs: Vec<MemoryRegion> = (0..512).map(|i| pds[i % 2].register(64, ALL).unwrap()).collect();
    let mut keys = HashSet::new();
    let mut buckets = HashSet::new();
    for mr in &mrs {
        assert_ne!(mr.lkey(), mr.rkey(), "lkey and rkey differ");
        for k in [mr.lkey(), mr.rkey()] {
            assert!(keys.insert(k), "key {k:#x} handed out twice");
            assert_eq!(k >> 31, 0, "region keys leave the top bit to windows");
            buckets.insert(k >> 24);
        }
    }
    // 1,024 uniform 31-bit keys fill nearly all 128 buckets of their top seven bits; keys
    // counted up from a base would fill one or two.
    assert!(
        buckets.len() > 110,
        "keys fall in only {} of 128 buckets",
        buckets.len()
    );
    let steps: HashSet<u32> = mrs
        .windows(2)
        .map(|w| w[1].rkey().wrapping_sub(w[0].rkey()))
        .collect();
    assert!(steps.len() > 500, "successive keys differ by a pattern");
}

/// One connected RC pair on the loopback device: `a` sends to `b`, whose PD is `pd_b`.
struct Pair {
    _ctx: Context,
    a_cq: CompletionQueue,
    a: QueuePair,
    _b: QueuePair,
    a_mr: MemoryRegion,
}

fn pair(ctx: &Context, pd_b: &ProtectionDomain) -> Pair {
    let pd_a = ctx.alloc_pd().unwrap();
    let a_cq = ctx.create_cq(16, None, 0).unwrap();
    let b_cq = ctx.create_cq(16, None, 0).unwrap();
    let a = pd_a.create_qp(&QpInit::new(QpType::Rc, &a_cq)).unwrap();
    let b = pd_b.create_qp(&QpInit::new(QpType::Rc, &b_cq)).unwrap();
    to_rts(ctx, &a, b.qp_num());
    to_rts(ctx, &b, a.qp_num());
    let a_mr = pd_a.register(4096, ALL).unwrap();
    a_mr.write(0, &[0x5A; 4096]).unwrap();
    Pair {
        _ctx: ctx.clone(),
        a_cq,
        a,
        _b: b,
        a_mr,
    }
}

fn remote_access_needs_key_pd_bounds_and_right() {
    let ctx = lo();
    let pd_b = ctx.alloc_pd().unwrap();
    let other_pd = ctx.alloc_pd().unwrap();
    let target = pd_b.register(256, ALL).unwrap();
    let neighbour = pd_b.register(256, ALL).unwrap();
    let read_only = pd_b
        .register(256, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ)
        .unwrap();
    let elsewhere = other_pd.register(256, ALL).unwrap();
    let gone = pd_b.register(256, ALL).unwrap();
    let gone_at = RemoteAddr {
        addr: gone.addr(),
        rkey: gone.rkey(),
    };
    drop(gone);
    let regions = [&target, &neighbour, &read_only, &elsewhere];
    for (i, mr) in regions.iter().enumerate() {
        mr.write(0, &[i as u8 + 1; 256]).unwrap();
    }
    let snapshot: Vec<Vec<u8>> = regions.iter().map(|m| m.to_vec()).collect();
    let at = |mr: &MemoryRegion, off: u64, rkey: u32| RemoteAddr {
        addr: mr.addr() + off,
        rkey,
    };
    let mut guessed = [0u8; 4];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut guessed))
        .unwrap();
    let cases: Vec<(&str, RemoteAddr, usize)> = vec![
        (
            "a guessed rkey",
            at(&target, 0, u32::from_ne_bytes(guessed) & 0x7FFF_FFFF),
            16,
        ),
        ("the region's lkey", at(&target, 0, target.lkey()), 16),
        ("a region of another PD", at(&elsewhere, 0, elsewhere.rkey()), 16),
        (
            "the key at another region's address",
            at(&neighbour, 0, target.rkey()),
            16,
        ),
        ("starting past the end", at(&target, 256, target.rkey()), 1),
        ("running past the end", at(&target, 250, target.rkey()), 16),
        (
            "a region without REMOTE_WRITE",
            at(&read_only, 0, read_only.rkey()),
            16,
        ),
        ("a deregistered region's key", gone_at, 16),
    ];
    for (what, remote, len) in cases {
        let p = pair(&ctx, &pd_b);
        let write = SendRequest {
            wr_id: 1,
            op: SendOp::Write { remote, imm: None },
            flags: SendFlags::SIGNALED,
            payload: Payload::Sges(vec![p.a_mr.sge(0..len).unwrap()]),
            ud: None,
            xrc_srqn: None,
        };
        p.a.post_send(&[write]).unwrap();
        let wc = wait_one(&p.a_cq);
        assert_eq!(wc.status, WcStatus::RemAccessErr, "WRITE with {what}");
        for (mr, before) in regions.iter().zip(&snapshot) {
            assert!(&mr.to_vec() == before, "WRITE with {what} changed a region");
        }
        println!("  WRITE with {what}: REM_ACCESS_ERR, nothing changed");
    }
    // The control: the right key, in bounds, lands.
    let p = pair(&ctx, &pd_b);
    p.a.post_send(&[SendRequest {
        wr_id: 2,
        op: SendOp::Write {
            remote: at(&target, 8, target.rkey()),
            imm: None,
        },
        flags: SendFlags::SIGNALED,
        payload: Payload::Sges(vec![p.a_mr.sge(0..16).unwrap()]),
        ud: None,
        xrc_srqn: None,
    }])
    .unwrap();
    assert_eq!(wait_one(&p.a_cq).status, WcStatus::Success);
    let mut got = [0u8; 16];
    target.read(8, &mut got).unwrap();
    assert_eq!(got, [0x5A; 16]);
}

/// As another user: every path must be refused and our memory unreadable.
fn intruder(pid: i32, addr: u64, paths: &[String]) {
    use nix::sys::uio::{process_vm_readv, RemoteIoVec};
    use std::io::IoSliceMut;
    assert_eq!(
        nix::unistd::geteuid().as_raw(),
        NOBODY,
        "running as the other user"
    );
    let mut buf = [0u8; 8];
    let read = process_vm_readv(
        nix::unistd::Pid::from_raw(pid),
        &mut [IoSliceMut::new(&mut buf)],
        &[RemoteIoVec {
            base: addr as usize,
            len: 8,
        }],
    );
    assert!(
        read.is_err(),
        "process_vm_readv of the other user's memory: {read:?}"
    );
    println!("refused process_vm_readv: {:?}", read.unwrap_err());
    for p in paths {
        let path = std::path::Path::new(p);
        if path.is_dir() || std::fs::metadata(path).is_err() {
            let listed = std::fs::read_dir(path);
            assert!(listed.is_err(), "listed {p}");
        }
        let opened = std::fs::OpenOptions::new().read(true).write(true).open(path);
        assert!(opened.is_err(), "opened {p}");
        let connected = std::os::unix::net::UnixStream::connect(path);
        assert!(connected.is_err(), "connected to {p}");
        println!("refused {p}");
    }
    println!("intruder refused everywhere");
}

fn other_users_are_kept_out() {
    // A QP starts the UDP and shared-memory drivers (the mailbox), a listener registers with
    // the CM's registry, a multicast attach with the multicast registry.
    let ctx = lo();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(4, None, 0).unwrap();
    let _qp = pd.create_qp(&QpInit::new(QpType::Rc, &cq)).unwrap();
    let ch = cm::EventChannel::new().unwrap();
    let listener = cm::CmId::new(Some(&ch), cm::PortSpace::Tcp).unwrap();
    listener
        .bind_addr(std::net::SocketAddr::from(([127, 0, 0, 1], 0)))
        .unwrap();
    listener.listen(1).unwrap();
    let secret = pd.register(64, ALL).unwrap();
    secret.write(0, b"not yours").unwrap();
    let uid = nix::unistd::getuid().as_raw();
    let mut paths = Vec::new();
    for dir in ["shm", "cm", "mcast", "xrc"] {
        let d = format!("/dev/shm/softverbs-{dir}-{uid}");
        if let Ok(entries) = std::fs::read_dir(&d) {
            paths.extend(entries.flatten().map(|e| e.path().display().to_string()));
            paths.push(d);
        }
    }
    assert!(
        paths.iter().any(|p| p.contains("softverbs-shm-")),
        "this process has a mailbox: {paths:?}"
    );
    // The other user runs a copy of this program where it may read it: the checkout (and so
    // this binary) may lie in a directory only we can enter.
    let exe = common::ProgramCopy::of_this_program();
    let out = Command::new(&exe.0)
        .arg("--intruder")
        .arg(std::process::id().to_string())
        .arg(secret.addr().to_string())
        .args(&paths)
        .uid(NOBODY)
        .gid(NOBODY)
        .output()
        .expect("run the intruder");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("intruder refused everywhere"),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    println!(
        "  another user was refused {} paths and process_vm_readv",
        paths.len()
    );
}

use std::os::unix::process::CommandExt;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--intruder") {
        return intruder(args[2].parse().unwrap(), args[3].parse().unwrap(), &args[4..]);
    }
    if args.iter().any(|a| a == "--list") {
        println!("security: test");
        return;
    }
    // A private base port, so the test does not depend on other softverbs processes of the
    // host.
    std::env::set_var("SOFTVERBS_UDP_PORT", common::free_base_port().to_string());
    let root = nix::unistd::Uid::effective().is_root();
    assert!(
        root,
        "the other-user checks need root (to run a process as nobody); CI runs as root"
    );
    let cases: [(&str, fn()); 3] = [
        (
            "memory keys are random and distinct",
            keys_are_random_and_distinct,
        ),
        (
            "remote access needs the key, the PD, the bounds and the right",
            remote_access_needs_key_pd_bounds_and_right,
        ),
        ("other users are kept out", other_users_are_kept_out),
    ];
    let mut failed = 0;
    for (name, case) in cases {
        let ok = std::panic::catch_unwind(case).is_ok();
        println!("test {name} ... {}", if ok { "ok" } else { "FAILED" });
        failed += usize::from(!ok);
    }
    println!("test result: {} passed; {failed} failed", cases.len() - failed);
    if failed > 0 {
        std::process::exit(1);
    }
}
