//! UDP ping-pong with busy polling: each side spins on a non-blocking `recv`, so neither ever
//! sleeps in the kernel, which is the best a kernel UDP socket can do for latency.

use std::io::ErrorKind;
use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use crate::{announce, check_duration, spawn_server, Result, UdpLatArgs, PEER_TIMEOUT};

/// How long the echo side waits without a datagram before it gives up.
const IDLE_LIMIT: Duration = Duration::from_secs(10);
/// A round trip with no answer after this long is sent again (a datagram was dropped).
const RESEND_AFTER: Duration = Duration::from_secs(1);
/// More dropped round trips than this fail the run.
const MAX_RESENDS: u32 = 100;

pub(crate) fn run(a: &UdpLatArgs) -> Result<()> {
    if a.size == 0 || a.size > 65507 {
        return Err("--size must be 1..=65507".into());
    }
    let duration = check_duration(a.duration)?;
    if let Some(bind) = a.place.serve {
        return echo(bind, a.size);
    }
    let (peer, addr) = match a.place.connect {
        Some(addr) => (None, addr),
        None => {
            let extra = vec!["--size".to_string(), a.size.to_string()];
            let (p, addr) = spawn_server("udp-lat", &extra)?;
            (Some(p), addr)
        }
    };
    let samples = ping(addr, a.size, duration)?;
    if let Some(p) = peer {
        p.finish(PEER_TIMEOUT)?;
    }
    print_result(a.size, samples);
    Ok(())
}

fn socket(bind: SocketAddr) -> Result<UdpSocket> {
    let s = UdpSocket::bind(bind).map_err(|e| format!("bind {bind}: {e}"))?;
    s.set_nonblocking(true).map_err(|e| e.to_string())?;
    Ok(s)
}

/// The echo side: returns every datagram to its sender until an empty one says stop.
fn echo(bind: SocketAddr, size: usize) -> Result<()> {
    let s = socket(bind)?;
    announce(s.local_addr().map_err(|e| e.to_string())?.port());
    let mut buf = vec![0u8; size.max(1)];
    let mut last = Instant::now();
    let mut limit = PEER_TIMEOUT;
    let mut spins = 0u32;
    loop {
        match s.recv_from(&mut buf) {
            Ok((0, _)) => return Ok(()),
            Ok((n, from)) => {
                s.send_to(&buf[..n], from).map_err(|e| format!("send: {e}"))?;
                last = Instant::now();
                limit = IDLE_LIMIT;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                // Reading the clock on every spin would dominate the loop.
                spins = spins.wrapping_add(1);
                if spins % 4096 == 0 && last.elapsed() > limit {
                    return Err("no datagram from the pinger in time".into());
                }
                std::hint::spin_loop();
            }
            Err(e) => return Err(format!("recv: {e}")),
        }
    }
}

/// The pinger: one datagram in flight at a time; returns the round-trip times of the measured
/// part, after a warm-up of a tenth of `duration`.
fn ping(addr: SocketAddr, size: usize, duration: Duration) -> Result<Vec<Duration>> {
    let bind: SocketAddr = if addr.is_ipv4() {
        ([0, 0, 0, 0], 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let s = socket(bind)?;
    s.connect(addr).map_err(|e| format!("connect {addr}: {e}"))?;
    let mut out = vec![0u8; size];
    let mut back = vec![0u8; size.max(8) + 1];
    let warmup = duration / 10;
    let start = Instant::now();
    let mut samples = Vec::new();
    let mut resends = 0u32;
    let mut seq = 0u64;
    // The first datagrams may reach the echo side before it polls; they wait in its socket.
    loop {
        let now = Instant::now();
        if now - start > warmup + duration {
            break;
        }
        seq += 1;
        let tag = seq.to_le_bytes();
        let k = size.min(8);
        out[..k].copy_from_slice(&tag[..k]);
        let t0 = Instant::now();
        s.send(&out).map_err(|e| format!("send: {e}"))?;
        let mut sent_at = t0;
        loop {
            match s.recv(&mut back) {
                // Stale answers to resent datagrams carry an older sequence number.
                Ok(n) if n == size && back[..k] == tag[..k] => break,
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if sent_at.elapsed() > RESEND_AFTER {
                        resends += 1;
                        if resends > MAX_RESENDS {
                            return Err("too many datagrams lost".into());
                        }
                        s.send(&out).map_err(|e| format!("send: {e}"))?;
                        sent_at = Instant::now();
                    }
                    std::hint::spin_loop();
                }
                // An ICMP port unreachable from an echo side that is not bound yet.
                Err(e) if e.kind() == ErrorKind::ConnectionRefused => {}
                Err(e) => return Err(format!("recv: {e}")),
            }
        }
        if t0 - start >= warmup {
            samples.push(t0.elapsed());
        }
    }
    for _ in 0..3 {
        let _ = s.send(&[]);
    }
    if samples.is_empty() {
        return Err("no round trip completed".into());
    }
    Ok(samples)
}

fn print_result(size: usize, mut rtts: Vec<Duration>) {
    rtts.sort_unstable();
    let us = |d: Duration| d.as_secs_f64() * 1e6 / 2.0;
    let n = rtts.len();
    let avg = rtts.iter().map(|&d| us(d)).sum::<f64>() / n as f64;
    println!("bytes,iterations,t_min_us,t_typical_us,t_avg_us,p99_us");
    println!(
        "{size},{n},{:.3},{:.3},{avg:.3},{:.3}",
        us(rtts[0]),
        us(rtts[n / 2]),
        us(rtts[(n * 99 / 100).min(n - 1)]),
    );
}
