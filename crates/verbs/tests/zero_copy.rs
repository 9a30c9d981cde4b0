//! Zero-copy registration: regions over a `Vec<u8>`, `Box<[u8]>`, `BytesMut` and `memmap2`
//! mappings the program owns (handed back on deregistration), borrowed and scoped regions,
//! and the guards that keep the device out while the program holds slices of the bytes.

mod common;

use std::time::{Duration, Instant};

use bytes::BytesMut;
use softverbs::*;

const LOCAL: AccessFlags = AccessFlags::LOCAL_WRITE;
const REMOTE: AccessFlags = AccessFlags::REMOTE_WRITE
    .union(AccessFlags::REMOTE_READ)
    .union(AccessFlags::REMOTE_ATOMIC);
const ALL: AccessFlags = LOCAL.union(REMOTE);

/// Two connected RC QPs on one device (in-process path), each with its own CQ.
struct Pair {
    ctx: Context,
    pd: ProtectionDomain,
    a: (QueuePair, CompletionQueue),
    b: (QueuePair, CompletionQueue),
}

const PATH: common::RcPath = common::RcPath {
    access: REMOTE,
    mtu: Mtu::Mtu1024,
    psn: 1,
    rd_atomic: 1,
    timeout: 14,
    retry_cnt: 7,
};

fn up(ctx: &Context, qp: &QueuePair, dest: u32) {
    common::connect_rc(ctx, qp, dest, &PATH);
}

fn pair_on(ctx: &Context, pd: &ProtectionDomain) -> Pair {
    let mk = || {
        let cq = ctx.create_cq(64, None, 0).unwrap();
        let mut init = QpInit::new(QpType::Rc, &cq);
        init.cap.max_send_sge = 2;
        (pd.create_qp(&init).unwrap(), cq)
    };
    let (a, b) = (mk(), mk());
    up(ctx, &a.0, b.0.qp_num());
    up(ctx, &b.0, a.0.qp_num());
    Pair {
        ctx: ctx.clone(),
        pd: pd.clone(),
        a,
        b,
    }
}

fn pair() -> Pair {
    let ctx = common::lo();
    let pd = ctx.alloc_pd().unwrap();
    pair_on(&ctx, &pd)
}

fn req(wr_id: u64, op: SendOp, sges: Vec<Sge>) -> SendRequest {
    SendRequest {
        wr_id,
        op,
        flags: SendFlags::SIGNALED,
        payload: Payload::Sges(sges),
        ud: None,
        xrc_srqn: None,
    }
}

/// The next completion of `cq` (bounded wait).
fn next(cq: &CompletionQueue) -> WorkCompletion {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut wc = [WorkCompletion::default(); 1];
    while Instant::now() < deadline {
        if cq.poll(&mut wc) == 1 {
            return wc[0];
        }
    }
    panic!("no completion within 20 s");
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
        .collect()
}

/// Through a region over `buf`: a SEND into it, a peer's WRITE into it, a peer's READ out of
/// it and a SEND out of it; returns the buffer, which must hold what was written.
fn exercise<B: StableBuffer>(p: &Pair, buf: B) -> B {
    let mut mr = p.pd.register_owned(buf, ALL).unwrap();
    let n = mr.len().min(1 << 20);
    assert!(n >= 8192);
    let peer = p.pd.register(2 * n, ALL).unwrap();
    peer.write(0, &pattern(1, n)).unwrap();
    // SEND from the peer into the region.
    p.a.0
        .post_recv(&[RecvWr {
            wr_id: 1,
            sg_list: vec![mr.sge(0..n).unwrap()],
        }])
        .unwrap();
    let send = SendOp::Send {
        imm: None,
        invalidate: None,
    };
    p.b.0
        .post_send(&[req(2, send, vec![peer.sge(0..n / 2).unwrap()])])
        .unwrap();
    assert_eq!(next(&p.b.1).status, WcStatus::Success);
    let wc = next(&p.a.1);
    assert_eq!((wc.status, wc.byte_len as usize), (WcStatus::Success, n / 2));
    assert_eq!(
        mr.local()[..n / 2],
        pattern(1, n)[..n / 2],
        "the SEND landed in place"
    );
    // The peer WRITEs the second half, then READs the whole region back.
    let write = SendOp::Write {
        remote: mr.remote(n / 2),
        imm: None,
    };
    p.b.0
        .post_send(&[req(3, write, vec![peer.sge(n / 2..n).unwrap()])])
        .unwrap();
    assert_eq!(next(&p.b.1).status, WcStatus::Success);
    let read = SendOp::Read { remote: mr.remote(0) };
    p.b.0
        .post_send(&[req(4, read, vec![peer.sge(n..2 * n).unwrap()])])
        .unwrap();
    assert_eq!(next(&p.b.1).status, WcStatus::Success);
    let mut back = vec![0u8; n];
    peer.read(n, &mut back).unwrap();
    assert_eq!(back, pattern(1, n), "the READ saw both halves");
    // Change it in place, SEND it from the region.
    mr.local_mut()[..4].copy_from_slice(b"done");
    p.b.0
        .post_recv(&[RecvWr {
            wr_id: 5,
            sg_list: vec![peer.sge(0..4).unwrap()],
        }])
        .unwrap();
    p.a.0
        .post_send(&[req(6, send, vec![mr.sge(0..4).unwrap()])])
        .unwrap();
    assert_eq!(next(&p.a.1).status, WcStatus::Success);
    assert_eq!(next(&p.b.1).status, WcStatus::Success);
    let mut got = [0u8; 4];
    peer.read(0, &mut got).unwrap();
    assert_eq!(&got, b"done");
    mr.dereg().map_err(|(_, e)| e).unwrap()
}

fn expected(n: usize) -> Vec<u8> {
    let mut v = pattern(1, n);
    v[..4].copy_from_slice(b"done");
    v
}

#[test]
fn a_vec_is_registered_in_place_and_handed_back() {
    let p = pair();
    let v = vec![0u8; 64 * 1024];
    let at = v.as_ptr();
    let mr = p.pd.register_owned(v, LOCAL).unwrap();
    assert_eq!(mr.addr(), at as u64, "the region is the vector's memory");
    assert_eq!(mr.len(), 64 * 1024);
    drop(mr);
    let v = exercise(&p, vec![0u8; 64 * 1024]);
    assert_eq!(v, expected(64 * 1024));
    let v = exercise(&p, v);
    assert_eq!(v.len(), 64 * 1024, "handed back whole, reusable");
}

#[test]
fn boxes_bytes_and_mappings_are_registered_in_place() {
    let p = pair();
    let n = 256 * 1024;
    let b = exercise(&p, vec![0u8; n].into_boxed_slice());
    assert_eq!(b[..], expected(n)[..]);
    let bytes = exercise(&p, BytesMut::zeroed(n));
    assert_eq!(bytes[..], expected(n)[..]);
    let anon = exercise(&p, memmap2::MmapMut::map_anon(n).unwrap());
    assert_eq!(anon[..], expected(n)[..]);
    // Transparent huge pages (a 2 MiB-aligned stretch of an advised mapping): the region does
    // not care how the kernel backs it.
    let huge = memmap2::MmapOptions::new().len(4 << 20).map_anon().unwrap();
    let _ = huge.advise(memmap2::Advice::HugePage);
    let huge = exercise(&p, huge);
    assert_eq!(huge[..1 << 20], expected(1 << 20)[..]);
}

#[test]
fn a_file_mapping_is_registered_and_its_file_gets_the_bytes() {
    let p = pair();
    let n = 128 * 1024;
    let path = std::env::temp_dir().join(format!("softverbs-zero-copy-{}", std::process::id()));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)
        .unwrap();
    file.set_len(n as u64).unwrap();
    #[allow(unsafe_code)]
    // SAFETY: the file was just created (create_new) by this test, which alone uses it and
    // removes it below; nothing else modifies it while it is mapped.
    let map = unsafe { memmap2::MmapMut::map_mut(&file) }.unwrap();
    let map = exercise(&p, map);
    map.flush().unwrap();
    drop(map);
    let on_disk = std::fs::read(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(on_disk, expected(n));
}

#[test]
fn registration_errors_hand_the_buffer_back() {
    let p = pair();
    let e = p.pd.register_owned(Vec::new(), LOCAL).unwrap_err();
    assert_eq!(e.error.errno(), 22, "an empty buffer: EINVAL");
    let e =
        p.pd.register_owned(vec![7u8; 16], AccessFlags::REMOTE_WRITE)
            .unwrap_err();
    assert_eq!(e.error.errno(), 22, "remote write without local write: EINVAL");
    assert_eq!(e.buffer, vec![7u8; 16], "the buffer comes back untouched");
    let as_error: Error = p.pd.register_owned(Vec::new(), LOCAL).unwrap_err().into();
    assert_eq!(as_error.errno(), 22);
}

/// A peer's WRITE of `len` bytes of 0xEE into `mr` at 0; its completion status.
fn peer_write(p: &Pair, remote: RemoteAddr, len: usize) -> WcStatus {
    let src = p.pd.register_bytes(&vec![0xEE; len], LOCAL).unwrap();
    let write = SendOp::Write { remote, imm: None };
    p.b.0
        .post_send(&[req(9, write, vec![src.sge(0..len).unwrap()])])
        .unwrap();
    next(&p.b.1).status
}

#[test]
fn an_exclusive_guard_refuses_every_device_access_and_nothing_changes() {
    let p = pair();
    let mut mr = p.pd.register_owned(vec![0x11u8; 8192], ALL).unwrap();
    let remote = mr.remote(0);
    {
        let mut bytes = mr.local_mut();
        bytes[0] = 0x22;
        assert_eq!(peer_write(&p, remote, 4096), WcStatus::RemAccessErr);
        assert!(
            bytes[1..].iter().all(|&b| b == 0x11),
            "the refused WRITE changed nothing"
        );
    }
    assert_eq!(mr.to_vec()[..2], [0x22, 0x11]);
    // The peer's QP is in error now; a fresh pair on the same PD sees the region again.
    let q = pair_on(&p.ctx, &p.pd);
    assert_eq!(peer_write(&q, remote, 4096), WcStatus::Success);
    assert!(mr.to_vec()[..4096].iter().all(|&b| b == 0xEE));
    // A local SEND out of the region while it is held fails as unregistered memory does.
    let sge = mr.sge(0..64).unwrap();
    let send = SendOp::Send {
        imm: None,
        invalidate: None,
    };
    {
        let _held = mr.local_mut();
        q.a.0.post_send(&[req(1, send, vec![sge])]).unwrap();
        assert_eq!(next(&q.a.1).status, WcStatus::LocProtErr);
    }
}

#[test]
fn a_shared_guard_lets_device_reads_through_and_refuses_writes() {
    let p = pair();
    let mr = p.pd.register_owned(pattern(3, 8192), ALL).unwrap();
    let dst = p.pd.register(8192, ALL).unwrap();
    {
        let bytes = mr.local();
        // A peer's READ goes on while the program reads the same bytes.
        let read = SendOp::Read { remote: mr.remote(0) };
        p.b.0
            .post_send(&[req(1, read, vec![dst.sge(0..8192).unwrap()])])
            .unwrap();
        assert_eq!(next(&p.b.1).status, WcStatus::Success);
        assert_eq!(dst.to_vec(), bytes[..]);
        // Copying writes and device writes are refused.
        assert!(mr.write(0, b"x").is_err());
        assert_eq!(peer_write(&p, mr.remote(0), 64), WcStatus::RemAccessErr);
        assert_eq!(bytes[..], pattern(3, 8192)[..]);
    }
    mr.write(0, b"x").unwrap();
}

#[test]
fn atomics_use_the_word_grid_of_unaligned_memory() {
    let p = pair();
    // A buffer starting 3 bytes into an allocation: edge bytes before the first whole word.
    let mut whole = BytesMut::zeroed(1027);
    let buf = whole.split_off(3);
    let mr = p.pd.register_owned(buf, ALL).unwrap();
    let first_word = ((8 - mr.addr() % 8) % 8) as usize;
    assert!(first_word > 0);
    let result = p.pd.register(8, ALL).unwrap();
    let fetch_add = |offset: usize| {
        let op = SendOp::FetchAdd {
            remote: mr.remote(offset),
            add: 5,
        };
        p.b.0
            .post_send(&[req(1, op, vec![result.sge(0..8).unwrap()])])
            .unwrap();
        next(&p.b.1).status
    };
    assert_eq!(fetch_add(first_word), WcStatus::Success);
    assert_eq!(fetch_add(first_word), WcStatus::Success);
    assert_eq!(mr.read_u64(first_word).unwrap(), 10);
    assert_eq!(result.read_u64(0).unwrap(), 5, "the old value came back");
    // Edge bytes and words share no byte: writing the edge leaves the word alone.
    mr.write(0, &vec![0xFF; first_word]).unwrap();
    assert_eq!(mr.read_u64(first_word).unwrap(), 10);
    let misaligned = SendOp::FetchAdd {
        remote: mr.remote(first_word + 1),
        add: 1,
    };
    let e =
        p.b.0
            .post_send(&[req(2, misaligned, vec![result.sge(0..8).unwrap()])]);
    assert_eq!(e.unwrap_err().error.errno(), 22, "a misaligned atomic is refused");
    let bytes = mr.dereg().map_err(|(_, e)| e).unwrap();
    assert!(bytes[..first_word].iter().all(|&b| b == 0xFF));
    assert_eq!(
        u64::from_ne_bytes(bytes[first_word..first_word + 8].try_into().unwrap()),
        10
    );
    drop(whole);
}

#[test]
fn a_region_dropped_while_a_window_holds_it_is_cut_off() {
    let p = pair();
    let mr =
        p.pd.register_owned(vec![0u8; 8192], LOCAL | AccessFlags::MW_BIND)
            .unwrap();
    let mw = p.pd.alloc_mw(MwType::Type1).unwrap();
    let rkey = mw
        .bind(
            &p.a.0,
            &MwBindInfo {
                wr_id: 1,
                send_flags: SendFlags::SIGNALED,
                mr: Some(&mr),
                addr: mr.addr(),
                length: 4096,
                access: AccessFlags::REMOTE_WRITE,
            },
        )
        .unwrap();
    assert_eq!(next(&p.a.1).status, WcStatus::Success);
    let remote = RemoteAddr {
        addr: mr.addr(),
        rkey,
    };
    assert_eq!(
        peer_write(&p, remote, 64),
        WcStatus::Success,
        "through the window"
    );
    // The window still holds the region (deregistration is EBUSY), but dropping it frees the
    // vector: the device must not reach it any more.
    drop(mr);
    let q = pair_on(&p.ctx, &p.pd);
    assert_ne!(peer_write(&q, remote, 64), WcStatus::Success);
    drop(mw);
}

#[test]
fn scoped_and_borrowed_regions_lend_memory_without_a_copy() {
    let p = pair();
    let mut buf = vec![0u8; 16384];
    let at = buf.as_ptr() as u64;
    let status =
        p.pd.scoped(&mut buf, ALL, |mr| {
            assert_eq!(mr.addr(), at);
            mr.local_mut()[..4].copy_from_slice(b"lent");
            peer_write(&p, mr.remote(100), 50)
        })
        .unwrap();
    assert_eq!(status, WcStatus::Success);
    assert_eq!(&buf[..4], b"lent");
    assert!(buf[100..150].iter().all(|&b| b == 0xEE));
    assert!(buf[150..].iter().all(|&b| b == 0));
    // The unsafe form: the region is dropped before the buffer is used again.
    let q = pair_on(&p.ctx, &p.pd);
    let remote = {
        #[allow(unsafe_code)]
        // SAFETY: the region is dropped at the end of this block, before `buf` is used.
        let mr = unsafe { p.pd.register_borrowed(&mut buf, ALL) }.unwrap();
        assert_eq!(peer_write(&q, mr.remote(0), 10), WcStatus::Success);
        mr.remote(0)
    };
    assert!(buf[..10].iter().all(|&b| b == 0xEE));
    // Once dropped, the memory is no longer the device's: the old rkey is refused.
    assert_ne!(peer_write(&q, remote, 10), WcStatus::Success);
}

/// Sets the flag when dropped, so that a panicking test still stops its helper thread.
struct StopOnDrop<'a>(&'a std::sync::atomic::AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

#[test]
fn guards_and_remote_writes_from_threads_never_tear() {
    // A peer keeps WRITEing 1 KiB blocks (one packet each at this path MTU) of one byte value
    // each; the program takes shared guards in a loop and must never see a block half
    // written: each packet's placement is wholly before or after a guard. (A message of
    // several packets may be cut by a guard between packets, as by any error.) Refused WRITEs
    // move the writer's QP to error, so the writer then connects a fresh pair.
    const BLOCK: usize = 1024;
    let ctx = common::lo();
    let pd = ctx.alloc_pd().unwrap();
    let mr = pd.register_owned(vec![0u8; 64 * BLOCK], ALL).unwrap();
    let remote = mr.remote(0);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (done, refused, looks) = std::thread::scope(|s| {
        let writer = s.spawn(|| {
            let (mut done, mut refused) = (0u32, 0u32);
            let src = pd.register(BLOCK, LOCAL).unwrap();
            let mut p = pair_on(&ctx, &pd);
            let mut k = 0u8;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                k = k.wrapping_add(1);
                src.fill(k);
                let at = RemoteAddr {
                    addr: remote.addr + u64::from(k % 64) * BLOCK as u64,
                    rkey: remote.rkey,
                };
                let write = SendOp::Write {
                    remote: at,
                    imm: None,
                };
                p.b.0
                    .post_send(&[req(1, write, vec![src.sge(0..BLOCK).unwrap()])])
                    .unwrap();
                if next(&p.b.1).status == WcStatus::Success {
                    done += 1;
                } else {
                    refused += 1;
                    p = pair_on(&ctx, &pd);
                }
            }
            (done, refused)
        });
        let _stop = StopOnDrop(&stop);
        let deadline = Instant::now() + Duration::from_secs(2);
        let mut looks = 0;
        while Instant::now() < deadline || looks < 50 {
            let bytes = mr.local();
            for block in bytes.chunks(BLOCK) {
                assert!(block.iter().all(|&b| b == block[0]), "a torn block");
            }
            drop(bytes);
            looks += 1;
            std::thread::yield_now();
        }
        drop(_stop);
        let (done, refused) = writer.join().unwrap();
        (done, refused, looks)
    });
    assert!(
        done > 0,
        "some WRITEs landed between the guards ({refused} refused, {looks} looks)"
    );
}
