//! UDP throughput with the kernel's segmentation offloads: the sender hands the kernel one
//! large buffer per `send` and `UDP_SEGMENT` cuts it into wire datagrams; the receiver enables
//! `UDP_GRO` so that consecutive datagrams arrive coalesced. Only bytes that reach the
//! receiver count.

use std::io::ErrorKind;
use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use nix::sys::socket::{setsockopt, sockopt};

use crate::{announce, check_duration, spawn_server, Result, UdpGsoArgs, PEER_TIMEOUT};

/// Largest UDP payload of one send (65535 minus the IPv4 and UDP headers).
const MAX_SEND: usize = 65507;
/// The receiver stops when no data has arrived for this long after the first.
const QUIET_END: Duration = Duration::from_millis(700);
/// Receive buffer of the receiver, large so that short stalls of the receiving process do not
/// turn into drops at once.
const RCVBUF: usize = 16 << 20;

pub(crate) fn run(a: &UdpGsoArgs) -> Result<()> {
    let seg = usize::from(a.segment);
    if seg == 0 || seg > MAX_SEND {
        return Err("--segment must be 1..=65507".into());
    }
    let send_size = a.send_size.unwrap_or(MAX_SEND / seg * seg);
    if send_size == 0 || send_size > MAX_SEND || send_size.div_ceil(seg) > 64 {
        return Err("--send-size must be 1..=65507 bytes and at most 64 segments".into());
    }
    let duration = check_duration(a.duration)?;
    if let Some(bind) = a.place.serve {
        return receive(bind, seg, send_size);
    }
    match a.place.connect {
        Some(addr) => {
            let sent = send(addr, seg, send_size, duration)?;
            println!("bytes_sent,seconds");
            println!("{sent},{:.6}", duration.as_secs_f64());
        }
        None => {
            let (peer, addr) = spawn_server("udp-gso", &[])?;
            send(addr, seg, send_size, duration)?;
            for l in peer.finish(PEER_TIMEOUT)? {
                println!("{l}");
            }
        }
    }
    Ok(())
}

fn receive(bind: SocketAddr, seg: usize, send_size: usize) -> Result<()> {
    let s = UdpSocket::bind(bind).map_err(|e| format!("bind {bind}: {e}"))?;
    setsockopt(&s, sockopt::UdpGroSegment, &true).map_err(|e| format!("UDP_GRO: {e}"))?;
    // Without CAP_NET_ADMIN the forced size fails; the ordinary one is capped by rmem_max.
    if setsockopt(&s, sockopt::RcvBufForce, &RCVBUF).is_err() {
        let _ = setsockopt(&s, sockopt::RcvBuf, &RCVBUF);
    }
    s.set_read_timeout(Some(PEER_TIMEOUT))
        .map_err(|e| e.to_string())?;
    announce(s.local_addr().map_err(|e| e.to_string())?.port());
    // GRO delivers up to 64 KiB per receive.
    let mut buf = vec![0u8; 1 << 17];
    let (mut bytes, mut recvs) = (0u64, 0u64);
    let mut first = None;
    let mut last = Instant::now();
    loop {
        match s.recv(&mut buf) {
            Ok(n) => {
                last = Instant::now();
                if first.is_none() {
                    first = Some(last);
                    s.set_read_timeout(Some(QUIET_END)).map_err(|e| e.to_string())?;
                }
                bytes += n as u64;
                recvs += 1;
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => break,
            Err(e) => return Err(format!("recv: {e}")),
        }
    }
    let Some(first) = first else {
        return Err("no data arrived".into());
    };
    let secs = (last - first).as_secs_f64();
    if secs <= 0.0 {
        return Err("data arrived in a single receive; run longer".into());
    }
    println!("bytes_received,seconds,gbps,receives,segment,send_size");
    println!(
        "{bytes},{secs:.6},{:.3},{recvs},{seg},{send_size}",
        bytes as f64 * 8.0 / secs / 1e9
    );
    Ok(())
}

/// Sends for `duration`; returns the bytes the kernel accepted.
fn send(addr: SocketAddr, seg: usize, send_size: usize, duration: Duration) -> Result<u64> {
    let bind: SocketAddr = if addr.is_ipv4() {
        ([0, 0, 0, 0], 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let s = UdpSocket::bind(bind).map_err(|e| format!("bind: {e}"))?;
    s.connect(addr).map_err(|e| format!("connect {addr}: {e}"))?;
    let seg_opt = i32::try_from(seg).map_err(|_| "segment too large")?;
    setsockopt(&s, sockopt::UdpGsoSegment, &seg_opt).map_err(|e| format!("UDP_SEGMENT: {e}"))?;
    let buf: Vec<u8> = (0..send_size).map(|i| i as u8).collect();
    let start = Instant::now();
    let mut sent = 0u64;
    while start.elapsed() < duration {
        match s.send(&buf) {
            Ok(n) => sent += n as u64,
            // A full device queue, or an ICMP error from before the receiver bound.
            Err(e)
                if matches!(e.kind(), ErrorKind::ConnectionRefused | ErrorKind::WouldBlock)
                    || e.raw_os_error() == Some(nix::libc::ENOBUFS) => {}
            Err(e) => return Err(format!("send: {e}")),
        }
    }
    Ok(sent)
}
