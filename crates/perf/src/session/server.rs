//! The server: follows the client's phases and checks what arrived.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener};

use super::client::print_header;
use super::{handshake, idle, PeerKind, PROTOCOL};
use crate::bw;
use crate::cli::{Args, Connection, Metric, Params, TestKind};
use crate::endpoint::{Endpoint, Info, Side};
use crate::error::{bail, Error, Result};
use crate::lat::{counter, Pinger};
use crate::oob::Oob;

/// Listens on `port` (every address, IPv6 and IPv4 where possible).
pub(crate) fn listen(port: u16) -> Result<TcpListener> {
    let v6 = SocketAddr::from((Ipv6Addr::UNSPECIFIED, port));
    match TcpListener::bind(v6) {
        Ok(l) => Ok(l),
        Err(_) => TcpListener::bind(SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)))
            .map_err(|e| Error::msg(format!("cannot listen on TCP port {port}: {e}"))),
    }
}

/// The server: serves one client on `listener`. `quiet` prints nothing.
pub(crate) fn server(args: &Args, listener: &TcpListener, quiet: bool) -> Result<()> {
    if !quiet {
        println!(
            " Waiting for a client on TCP port {} ...",
            listener.local_addr()?.port()
        );
    }
    let (stream, _) = listener.accept()?;
    let mut oob = Oob::new(stream)?;
    let result = server_session(args, &mut oob, quiet);
    if let Err(e) = &result {
        oob.send_error(e);
    }
    result
}

fn server_session(args: &Args, oob: &mut Oob, quiet: bool) -> Result<()> {
    let hello = oob.expect("HELLO")?;
    let Some((proto, rest)) = hello.split_once(' ') else {
        bail!("bad HELLO {hello:?}")
    };
    if proto != PROTOCOL {
        bail!("the client speaks {proto}, this server {PROTOCOL}");
    }
    let params = Params::decode(rest)?;
    let (mut ep, remote) = handshake(oob, Side::Server, &params, args)?;
    if !quiet {
        println!(" Client {} connected: {}", oob.peer_ip()?, params.title());
        print_header(&ep, &remote, &params, PeerKind::Process);
    }
    loop {
        let line = oob.recv()?;
        let mut words = line.split_whitespace();
        match words.next() {
            Some("PHASE") => {
                let mut num = || words.next().and_then(|w| w.parse::<u64>().ok());
                let (Some(size), Some(iters)) = (num(), num()) else {
                    bail!("bad PHASE {line:?}")
                };
                server_phase(
                    &mut ep,
                    &remote,
                    oob,
                    size as usize,
                    Some(iters).filter(|&n| n > 0),
                )?;
            }
            Some("IDLE") => {
                let secs: f64 = words.next().and_then(|w| w.parse().ok()).unwrap_or(1.0);
                oob.send("GO")?;
                let (cpu, wall) = idle(secs)?;
                oob.send(&format!("IDLE {cpu} {wall}"))?;
            }
            Some("BYE") => break,
            _ => bail!("protocol error: unexpected {line:?}"),
        }
    }
    if !quiet {
        println!(" Client done.");
    }
    Ok(())
}

fn server_phase(
    ep: &mut Endpoint,
    remote: &Info,
    oob: &mut Oob,
    size: usize,
    iters: Option<u64>,
) -> Result<()> {
    let p = ep.params.clone();
    if size == 0 || size > ep.layout.max {
        bail!("size {size} is outside 1..={}", ep.layout.max);
    }
    ep.clear_targets(size)?;
    match (p.metric, p.test) {
        (Metric::Bw, TestKind::Send) => {
            for q in 0..ep.qps.len() {
                ep.fill_recvs(q, p.rx_depth)?;
            }
        }
        (Metric::Lat, TestKind::Send) => ep.fill_recvs(0, 1)?,
        _ => {}
    }
    oob.send("GO")?;
    let mut lost = 0;
    let (counts, bad_len) = match (p.metric, p.test) {
        (Metric::Bw, TestKind::Send) => {
            let r = bw::server_send(ep, oob, size, iters)?;
            lost = r.lost;
            (r.counts, r.bad_len)
        }
        (Metric::Lat, TestKind::Send | TestKind::Write) => {
            let n = iters.unwrap_or(0);
            let mut pinger = Pinger::new(ep, remote, size);
            pinger.server(n)?;
            let bad = pinger
                .bad_len
                .map(|l| format!("a message of {l} bytes arrived, expected {size}"));
            (bw::parse_end(&oob.expect("END")?)?, bad)
        }
        // READ, atomics and WRITE bandwidth: the device answers without this thread.
        _ => {
            let counts = bw::parse_end(&oob.expect("END")?)?;
            if p.connection == Connection::Uc {
                bw::settle(ep);
            }
            (counts, None)
        }
    };
    let words = if p.test == TestKind::Atomic {
        let w: Vec<String> = (0..ep.qps.len())
            .map(|q| ep.atomic_word(q).map(|v| v.to_string()))
            .collect::<Result<_>>()?;
        w.join(",")
    } else {
        "-".to_string()
    };
    let problem = if !p.check {
        None
    } else if let Some(b) = bad_len {
        Some(b)
    } else {
        match (p.metric, p.test) {
            (_, TestKind::Send) | (Metric::Bw, TestKind::Write) => ep.verify_dst(size, None),
            (Metric::Lat, TestKind::Write) => ep.verify_dst(
                size,
                Some(counter(counts.first().copied().unwrap_or(1).max(1) - 1)),
            ),
            _ => None,
        }
    };
    let check = match (&problem, p.check) {
        (Some(_), _) => "bad",
        (None, true) => "ok",
        (None, false) => "skip",
    };
    oob.send(&format!(
        "DONE words={words} lost={lost} check={check} {}",
        problem.unwrap_or_default()
    ))?;
    Ok(())
}
