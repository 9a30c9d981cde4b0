//! The out-of-band channel: newline-terminated text messages over TCP, as perftest exchanges
//! its connection data over a socket before any RDMA traffic.

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::error::{bail, Error, Result};

/// One side of the TCP connection.
pub(crate) struct Oob {
    stream: TcpStream,
    buf: Vec<u8>,
    nonblocking: bool,
}

impl Oob {
    pub(crate) fn new(stream: TcpStream) -> Result<Self> {
        stream.set_nodelay(true)?;
        Ok(Self {
            stream,
            buf: Vec::new(),
            nonblocking: false,
        })
    }

    /// Connects to `host:port`, retrying for up to `patience` while nobody listens yet.
    pub(crate) fn connect(host: &str, port: u16, patience: Duration) -> Result<Self> {
        let addrs: Vec<SocketAddr> = (host, port)
            .to_socket_addrs()
            .map_err(|e| Error::msg(format!("cannot resolve {host}: {e}")))?
            .collect();
        let deadline = Instant::now() + patience;
        loop {
            let mut last = None;
            for a in &addrs {
                match TcpStream::connect_timeout(a, Duration::from_secs(5)) {
                    Ok(s) => return Self::new(s),
                    Err(e) => last = Some(e),
                }
            }
            if Instant::now() >= deadline {
                let e = last.map_or_else(|| "no address".to_string(), |e| e.to_string());
                bail!("cannot connect to {host}:{port}: {e}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The local address of the connection: the one the peer reaches us at.
    pub(crate) fn local_ip(&self) -> Result<IpAddr> {
        Ok(canonical(self.stream.local_addr()?.ip()))
    }

    /// The peer's address.
    pub(crate) fn peer_ip(&self) -> Result<IpAddr> {
        Ok(canonical(self.stream.peer_addr()?.ip()))
    }

    pub(crate) fn send(&mut self, line: &str) -> Result<()> {
        debug_assert!(!line.contains('\n'));
        self.set_nonblocking(false)?;
        let mut msg = Vec::with_capacity(line.len() + 1);
        msg.extend_from_slice(line.as_bytes());
        msg.push(b'\n');
        self.stream.write_all(&msg)?;
        Ok(())
    }

    fn take_line(&mut self) -> Result<Option<String>> {
        let Some(pos) = self.buf.iter().position(|&b| b == b'\n') else {
            return Ok(None);
        };
        let line: Vec<u8> = self.buf.drain(..=pos).collect();
        let s =
            String::from_utf8(line[..pos].to_vec()).map_err(|_| Error::msg("peer sent non-UTF-8 text"))?;
        if let Some(err) = s.strip_prefix("ERR ") {
            bail!("peer: {err}");
        }
        Ok(Some(s))
    }

    fn set_nonblocking(&mut self, on: bool) -> Result<()> {
        if self.nonblocking != on {
            self.stream.set_nonblocking(on)?;
            self.nonblocking = on;
        }
        Ok(())
    }

    /// Reads once into the buffer; `false` if nothing was available (non-blocking mode).
    fn fill(&mut self) -> Result<bool> {
        let mut chunk = [0u8; 4096];
        match self.stream.read(&mut chunk) {
            Ok(0) => bail!("the peer closed the connection"),
            Ok(n) => {
                self.buf.extend_from_slice(&chunk[..n]);
                Ok(true)
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => Ok(false),
            Err(e) if e.kind() == ErrorKind::Interrupted => Ok(true),
            Err(e) => Err(e.into()),
        }
    }

    /// The next message, waiting for it. A message `ERR <text>` becomes an error.
    pub(crate) fn recv(&mut self) -> Result<String> {
        loop {
            if let Some(l) = self.take_line()? {
                return Ok(l);
            }
            self.set_nonblocking(false)?;
            self.fill()?;
        }
    }

    /// The next message if one has arrived, without waiting.
    pub(crate) fn try_recv(&mut self) -> Result<Option<String>> {
        if let Some(l) = self.take_line()? {
            return Ok(Some(l));
        }
        self.set_nonblocking(true)?;
        while self.fill()? {
            if let Some(l) = self.take_line()? {
                return Ok(Some(l));
            }
        }
        Ok(None)
    }

    /// The next message, which must start with the word `word`; returns the rest.
    pub(crate) fn expect(&mut self, word: &str) -> Result<String> {
        let l = self.recv()?;
        match l.split_once(' ') {
            Some((w, rest)) if w == word => Ok(rest.to_string()),
            None if l == word => Ok(String::new()),
            _ => bail!("protocol error: expected {word}, got {l:?}"),
        }
    }

    /// Tells the peer about a failure (best effort).
    pub(crate) fn send_error(&mut self, e: &Error) {
        let _ = self.send(&format!("ERR {}", e.message().replace('\n', " ")));
    }
}

/// IPv4-mapped IPv6 addresses (a dual-stack listener's view of IPv4 peers) as IPv4.
pub(crate) fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}
