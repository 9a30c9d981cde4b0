//! rsockets in one process (`softverbs::rsocket`): streams both ways, large transfers checked
//! byte for byte, half close and close while the peer reads, a port nobody listens on,
//! non-blocking calls and poll, datagrams, direct writes into a mapped buffer, and an idle
//! blocked reader that costs no CPU.

use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use softverbs::rsocket::*;
use softverbs::HostBuffer;

const WAIT: Option<Duration> = Some(Duration::from_secs(20));

/// The tests share the process; the one that measures its CPU use runs alone.
static GATE: std::sync::RwLock<()> = std::sync::RwLock::new(());

fn shared() -> std::sync::RwLockReadGuard<'static, ()> {
    GATE.read().unwrap_or_else(|p| p.into_inner())
}

fn any() -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, 0))
}

fn pair_with(opts: &StreamOptions) -> (RStream, RStream) {
    let l = RListener::bind_with(any(), opts).unwrap();
    let c = RStream::connect_with(l.local_addr().unwrap(), opts).unwrap();
    let (s, peer) = l.accept().unwrap();
    assert_eq!(peer, c.local_addr().unwrap());
    assert_eq!(c.peer_addr().unwrap(), l.local_addr().unwrap());
    (c, s)
}

fn pair() -> (RStream, RStream) {
    pair_with(&StreamOptions::default())
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed ^ (i >> 11) as u8))
        .collect()
}

#[test]
fn echo_both_directions() {
    let _g = shared();
    let (mut c, mut s) = pair();
    for i in 0..100u32 {
        let msg = format!("message {i}");
        c.write_all(msg.as_bytes()).unwrap();
        let mut got = vec![0u8; msg.len()];
        s.read_exact(&mut got).unwrap();
        assert_eq!(got, msg.as_bytes());
        s.write_all(&got).unwrap();
        let mut back = vec![0u8; msg.len()];
        c.read_exact(&mut back).unwrap();
        assert_eq!(back, msg.as_bytes());
    }
}

/// 16 MiB each way at the same time, through small buffers (so the credit and buffer
/// updates go round many times) and through the defaults.
#[test]
fn large_transfers_are_byte_exact() {
    let _g = shared();
    for opts in [
        StreamOptions {
            send_buffer: Some(4096),
            recv_buffer: Some(8192),
            sq_size: Some(16),
            rq_size: Some(16),
            inline: Some(0),
            ..StreamOptions::default()
        },
        StreamOptions::default(),
    ] {
        let (c, s) = pair_with(&opts);
        let len = 16 << 20;
        let (a, b) = (pattern(len, 1), pattern(len, 2));
        std::thread::scope(|t| {
            let (c, s, a2, b2) = (&c, &s, &a, &b);
            t.spawn(move || (&*c).write_all(a2).unwrap());
            t.spawn(move || (&*s).write_all(b2).unwrap());
            let r1 = t.spawn(move || {
                let mut got = vec![0u8; len];
                (&*s).read_exact(&mut got).unwrap();
                got
            });
            let mut got = vec![0u8; len];
            (&*c).read_exact(&mut got).unwrap();
            assert!(got == b, "client received the server's bytes");
            assert!(r1.join().unwrap() == a, "server received the client's bytes");
        });
    }
}

#[test]
fn half_close_ends_the_peers_reads_only() {
    let _g = shared();
    let (mut c, mut s) = pair();
    c.write_all(b"last words").unwrap();
    c.shutdown(Shutdown::Write).unwrap();
    let mut got = Vec::new();
    s.read_to_end(&mut got).unwrap();
    assert_eq!(got, b"last words");
    assert_eq!(s.read(&mut [0u8; 8]).unwrap(), 0, "still the end");
    // The other direction still works.
    s.write_all(b"reply").unwrap();
    let mut r = [0u8; 5];
    c.read_exact(&mut r).unwrap();
    assert_eq!(&r, b"reply");
    let e = c.write(b"x").unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc_epipe()), "{e}");
    drop(s);
    assert_eq!(c.read(&mut r).unwrap(), 0, "the peer closed");
}

fn libc_epipe() -> i32 {
    32
}

#[test]
fn close_while_the_peer_reads() {
    let _g = shared();
    let (c, mut s) = pair();
    let reader = std::thread::spawn(move || {
        let start = Instant::now();
        let mut buf = [0u8; 16];
        let n = s.read(&mut buf).unwrap();
        (n, start.elapsed())
    });
    std::thread::sleep(Duration::from_millis(200));
    drop(c);
    let (n, waited) = reader.join().unwrap();
    assert_eq!(n, 0);
    assert!(waited < Duration::from_secs(10), "{waited:?}");
}

#[test]
fn nobody_listening_is_connection_refused() {
    let _g = shared();
    // A port of a listener that is gone.
    let addr = RListener::bind(any()).unwrap().local_addr().unwrap();
    let e = RStream::connect(addr).unwrap_err();
    assert_eq!(e.errno(), 111, "{e}");
    // Non-blocking: EINPROGRESS, then the error through poll and SO_ERROR.
    let c = RStream::connect_nonblocking(addr, &StreamOptions::default()).unwrap();
    let mut items = [PollItem::stream(&c, POLLOUT)];
    assert_eq!(poll(&mut items, WAIT).unwrap(), 1);
    assert_ne!(items[0].revents() & POLLERR, 0);
    assert_eq!(c.take_error().unwrap().unwrap().raw_os_error(), Some(111));
    assert_eq!(c.peer_addr().unwrap_err().errno(), 107, "ENOTCONN");
}

#[test]
fn non_blocking_calls() {
    let _g = shared();
    let l = RListener::bind(any()).unwrap();
    l.set_nonblocking(true).unwrap();
    assert_eq!(
        l.accept().unwrap_err().errno(),
        11,
        "EAGAIN with nothing to accept"
    );
    let c = RStream::connect_nonblocking(l.local_addr().unwrap(), &StreamOptions::default()).unwrap();
    let mut items = [PollItem::stream(&c, POLLOUT), PollItem::listener(&l, POLLIN)];
    let deadline = Instant::now() + Duration::from_secs(20);
    while items[0].revents() & POLLOUT == 0 || items[1].revents() & POLLIN == 0 {
        assert!(Instant::now() < deadline);
        poll(&mut items, WAIT).unwrap();
    }
    assert!(c.take_error().unwrap().is_none());
    let (mut s, _) = l.accept().unwrap();
    s.set_nonblocking(true).unwrap();
    let e = s.read(&mut [0u8; 4]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::WouldBlock);
    // A non-blocking writer stops with EAGAIN once credits and buffers run out, having
    // written only part.
    let mut c = c;
    let big = vec![7u8; 8 << 20];
    let n = c.write(&big).unwrap();
    assert!(n > 0 && n < big.len(), "{n}");
    let mut items = [PollItem::stream(&s, POLLIN)];
    assert_eq!(poll(&mut items, WAIT).unwrap(), 1);
    let mut got = vec![0u8; n];
    let mut at = 0;
    while at < n {
        match s.read(&mut got[at..]) {
            Ok(k) => at += k,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                poll(&mut [PollItem::stream(&s, POLLIN)], WAIT).unwrap();
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(got.iter().all(|b| *b == 7));
}

#[test]
fn poll_mixes_rsockets_and_ordinary_fds() {
    let _g = shared();
    let (c, s) = pair();
    let (r, w) = nix::unistd::pipe().unwrap();
    let mut items = [PollItem::stream(&s, POLLIN), PollItem::fd(r.as_fd(), POLLIN)];
    assert_eq!(
        poll(&mut items, Some(Duration::from_millis(50))).unwrap(),
        0,
        "nothing yet"
    );
    nix::unistd::write(&w, b"x").unwrap();
    assert_eq!(poll(&mut items, WAIT).unwrap(), 1);
    assert_eq!((items[0].revents(), items[1].revents()), (0, POLLIN));
    let mut items = [PollItem::stream(&s, POLLIN)];
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        (&c).write_all(b"hello").unwrap();
        c
    });
    assert_eq!(poll(&mut items, WAIT).unwrap(), 1, "woken by the data");
    assert_eq!(items[0].revents(), POLLIN);
    let c = t.join().unwrap();
    drop(c);
    let mut buf = [0u8; 5];
    (&s).read_exact(&mut buf).unwrap();
    let mut items = [PollItem::stream(&s, POLLIN)];
    assert_eq!(poll(&mut items, WAIT).unwrap(), 1);
    assert_ne!(items[0].revents() & POLLHUP, 0, "the peer closed");
}

#[test]
fn datagrams_both_ways() {
    let _g = shared();
    let a = RDatagram::bind(any()).unwrap();
    let b = RDatagram::bind(any()).unwrap();
    let (aa, ba) = (a.local_addr().unwrap(), b.local_addr().unwrap());
    let mut buf = [0u8; 2048];
    for i in 0..200u32 {
        let msg = format!("datagram {i}");
        a.send_to(msg.as_bytes(), ba).unwrap();
        let (n, from) = b.recv_from(&mut buf).unwrap();
        assert_eq!((&buf[..n], from), (msg.as_bytes(), aa));
        b.send_to(&buf[..n], from).unwrap();
        let (n, from) = a.recv_from(&mut buf).unwrap();
        assert_eq!((&buf[..n], from), (msg.as_bytes(), ba));
    }
    // Connected: send and recv; a datagram is taken whole, as large as a slot allows.
    a.connect(ba).unwrap();
    let big = pattern(1500, 9);
    assert_eq!(a.send(&big).unwrap(), 1500);
    let (n, _) = b.peek_from(&mut buf).unwrap();
    assert_eq!(n, 1500);
    assert_eq!(b.recv(&mut buf).unwrap(), 1500);
    assert_eq!(&buf[..1500], &big[..]);
    assert_eq!(a.send(&vec![0u8; 4096]).unwrap_err().errno(), 90, "EMSGSIZE");
    b.set_nonblocking(true).unwrap();
    assert_eq!(b.recv(&mut buf).unwrap_err().errno(), 11);
}

#[test]
fn iowrite_lands_in_the_mapped_buffer() {
    let _g = shared();
    let opts = StreamOptions {
        iomap_size: Some(1),
        ..StreamOptions::default()
    };
    let (mut c, mut s) = pair_with(&opts);
    let buf = HostBuffer::new(1 << 16).unwrap();
    let map = s.iomap(&buf, Some(0)).unwrap();
    assert_eq!(map.offset(), 0);
    // The mapping reaches the peer ahead of this message.
    s.write_all(b"mapped").unwrap();
    let mut got = [0u8; 6];
    c.read_exact(&mut got).unwrap();
    let data = pattern(40000, 5);
    assert_eq!(c.iowrite(&data, 1000).unwrap(), data.len());
    c.write_all(b"done").unwrap();
    let mut done = [0u8; 4];
    s.read_exact(&mut done).unwrap();
    assert_eq!(&done, b"done");
    let mut landed = vec![0u8; data.len()];
    buf.read(1000, &mut landed).unwrap();
    assert!(landed == data, "the data is where it was written");
    // Past the end of the mapping: only what fits.
    assert_eq!(c.iowrite(&data, 60000).unwrap(), 5536);
    assert_eq!(c.iowrite(&data, 70000).unwrap_err().errno(), 22);
    drop(map);
}

/// A reader blocked on an idle connection sleeps.
#[test]
fn a_blocked_reader_uses_no_cpu() {
    let _alone = GATE.write().unwrap_or_else(|p| p.into_inner());
    let (c, s) = pair();
    let cpu = || {
        let u = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF).unwrap();
        let us = |t: nix::sys::time::TimeVal| t.tv_sec() as u64 * 1_000_000 + t.tv_usec() as u64;
        Duration::from_micros(us(u.user_time()) + us(u.system_time()))
    };
    let reader = std::thread::spawn(move || {
        let mut b = [0u8; 1];
        (&s).read_exact(&mut b).unwrap();
        s
    });
    std::thread::sleep(Duration::from_millis(100));
    let before = cpu();
    std::thread::sleep(Duration::from_secs(1));
    let used = cpu() - before;
    (&c).write_all(b"!").unwrap();
    reader.join().unwrap();
    println!("{used:?} of CPU in 1 s idle");
    assert!(used < Duration::from_millis(20), "{used:?} of CPU in 1 s idle");
}
