//! Command-line plumbing shared by the tools: C-style number parsing, device selection and
//! argument errors that exit the way getopt-based tools do.

use std::net::{Ipv4Addr, Ipv6Addr, TcpListener, TcpStream, ToSocketAddrs};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use softverbs::{devices, Device, Mtu};

use crate::pingpong::{Config, PingPong, Role, Transport, DEFAULT_TCP_PORT};
use crate::{OrFail, ToolError};

/// Parses an integer as C's `strtol(s, NULL, 0)` reads it, so that `-s 0x1000` and `-s 010` work
/// as with rdma-core's tools: decimal, `0x` hexadecimal or leading-`0` octal, optionally signed.
pub fn parse_c_int<T: TryFrom<i64>>(s: &str) -> Result<T, String> {
    let t = s.trim();
    let (neg, digits) = match t.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, t.strip_prefix('+').unwrap_or(t)),
    };
    let (radix, body) = if let Some(h) = digits.strip_prefix("0x").or_else(|| digits.strip_prefix("0X")) {
        (16, h)
    } else if digits.len() > 1 && digits.starts_with('0') {
        (8, &digits[1..])
    } else {
        (10, digits)
    };
    let magnitude = i64::from_str_radix(body, radix).map_err(|e| format!("'{s}' is not a number: {e}"))?;
    let value = if neg { -magnitude } else { magnitude };
    T::try_from(value).map_err(|_| format!("{s} is out of range"))
}

/// The device named `name`, or the first device when `name` is `None` (rdma-core's "default
/// first device found").
pub fn find_device(name: Option<&str>) -> Result<Device, ToolError> {
    let list = devices().map_err(|e| ToolError::new(format!("Failed to get the RDMA device list: {e}")))?;
    match name {
        None => list
            .into_iter()
            .next()
            .ok_or_else(|| ToolError::new("No RDMA devices found")),
        Some(n) => list
            .into_iter()
            .find(|d| d.name() == n)
            .ok_or_else(|| ToolError::new(format!("IB device {n} not found"))),
    }
}

/// Parses the command line like getopt-based tools: `--help` and `--version` exit 0, and any
/// other mistake prints the error and usage and exits 1 (clap's default would be 2).
pub fn parse_args<T: clap::Parser>() -> T {
    match T::try_parse() {
        Ok(args) => args,
        Err(e) => match e.kind() {
            clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion => e.exit(),
            _ => {
                let _ = e.print();
                std::process::exit(1);
            }
        },
    }
}

/// Prints `err` on stderr prefixed with the tool name and returns exit status 1.
pub fn fail(tool: &str, err: &ToolError) -> ExitCode {
    eprintln!("{tool}: {err}");
    ExitCode::FAILURE
}

/// Parses an IB path MTU given in bytes (256, 512, 1024, 2048 or 4096).
pub fn parse_mtu(s: &str) -> Result<Mtu, String> {
    let bytes: u32 = parse_c_int(s)?;
    Mtu::ALL
        .iter()
        .copied()
        .find(|m| m.bytes() == bytes)
        .ok_or_else(|| format!("{s} is not an IB MTU (256, 512, 1024, 2048 or 4096)"))
}

fn parse_ib_port(s: &str) -> Result<u8, String> {
    let p: u8 = parse_c_int(s)?;
    if p == 0 {
        return Err("ports are numbered from 1".into());
    }
    Ok(p)
}

fn parse_secs(s: &str) -> Result<Duration, String> {
    let secs: f64 = s
        .parse()
        .map_err(|e| format!("'{s}' is not a number of seconds: {e}"))?;
    Duration::try_from_secs_f64(secs).map_err(|e| format!("'{s}': {e}"))
}

/// The options every ping-pong program has (rdma-core's `-p -d -i -s -r -n -l -e -g -c` and the
/// server name), plus `--timeout`.
#[derive(clap::Args, Debug, Clone)]
pub struct PingPongArgs {
    /// Listen on / connect to TCP port PORT
    #[arg(short = 'p', long = "port", default_value_t = DEFAULT_TCP_PORT, value_parser = parse_c_int::<u16>)]
    pub port: u16,
    /// Use RDMA device DEV (default: the first device found)
    #[arg(short = 'd', long = "ib-dev", value_name = "DEV")]
    pub ib_dev: Option<String>,
    /// Use port PORT of the device
    #[arg(short = 'i', long = "ib-port", value_name = "PORT", default_value_t = 1, value_parser = parse_ib_port)]
    pub ib_port: u8,
    /// Size of the message to exchange (default 4096; 1024 for UD)
    #[arg(short = 's', long = "size", value_parser = parse_c_int::<u32>)]
    pub size: Option<u32>,
    /// Number of receives to keep posted
    #[arg(short = 'r', long = "rx-depth", value_name = "DEPTH", default_value_t = 500, value_parser = parse_c_int::<u32>)]
    pub rx_depth: u32,
    /// Number of exchanges
    #[arg(short = 'n', long = "iters", default_value_t = 1000, value_parser = parse_c_int::<u32>)]
    pub iters: u32,
    /// Service level
    #[arg(short = 'l', long = "sl", default_value_t = 0, value_parser = parse_c_int::<u8>)]
    pub sl: u8,
    /// Sleep on completion events instead of busy polling
    #[arg(short = 'e', long = "events")]
    pub events: bool,
    /// Local port GID index (default: the first IPv4 GID, else the first GID)
    #[arg(short = 'g', long = "gid-idx", value_name = "INDEX", allow_negative_numbers = true, value_parser = parse_c_int::<i32>)]
    pub gid_idx: Option<i32>,
    /// Validate the received buffer (server side)
    #[arg(short = 'c', long = "chk")]
    pub chk: bool,
    /// Give up if the peer or a completion does not arrive within SECS (softverbs extension;
    /// the default waits forever, as rdma-core does)
    #[arg(long = "timeout", value_name = "SECS", value_parser = parse_secs)]
    pub timeout: Option<Duration>,
    /// Server to connect to; without it, wait for a client
    #[arg(value_name = "HOST")]
    pub servername: Option<String>,
}

impl PingPongArgs {
    /// The run configuration for `transport`; `mtu` and `num_qp` come from the programs that
    /// have `-m` and `-q`.
    pub fn config(&self, transport: Transport, mtu: Option<Mtu>, num_qp: Option<u32>) -> Config {
        let mut cfg = Config::new(transport);
        cfg.ib_port = self.ib_port;
        if let Some(s) = self.size {
            cfg.size = s as usize;
        }
        if let Some(m) = mtu {
            cfg.mtu = m;
        }
        cfg.rx_depth = self.rx_depth;
        cfg.iters = self.iters;
        cfg.sl = self.sl;
        cfg.use_events = self.events;
        cfg.gid_index = self.gid_idx;
        cfg.check = self.chk;
        if let Some(q) = num_qp {
            cfg.num_qp = q;
        }
        cfg.timeout = self.timeout;
        cfg
    }
}

/// Runs a ping-pong program: opens the device, prints the local addresses, connects the TCP
/// exchange (listening on `args.port`, or connecting to `args.servername`) and runs.
pub fn pingpong_main(
    transport: Transport,
    args: &PingPongArgs,
    mtu: Option<Mtu>,
    num_qp: Option<u32>,
) -> ExitCode {
    pingpong_main_with(args, args.config(transport, mtu, num_qp))
}

/// As [`pingpong_main`], with the run configuration `cfg` (built from `args` and the options
/// of one program).
pub fn pingpong_main_with(args: &PingPongArgs, cfg: Config) -> ExitCode {
    let tool = cfg.transport.tool_name();
    match pingpong_run(args, cfg) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(tool, &e),
    }
}

fn pingpong_run(args: &PingPongArgs, cfg: Config) -> Result<(), ToolError> {
    let dev = find_device(args.ib_dev.as_deref())?;
    let ctx = dev
        .open()
        .or_fail(&format!("Couldn't get context for {}", dev.name()))?;
    let pp = PingPong::new(&ctx, cfg)?;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    pp.print_local(&mut out)?;
    let (role, stream) = match &args.servername {
        Some(host) => (Role::Client, connect(host, args.port, args.timeout)?),
        None => (Role::Server, accept(args.port, args.timeout)?),
    };
    if let Some(t) = args.timeout {
        // Bounds the address exchange; the completion loop has its own bound.
        stream
            .set_read_timeout(Some(t))
            .or_fail("set the socket timeout")?;
    }
    pp.run(role, stream, &mut out)?;
    Ok(())
}

/// Connects to `host:port`, trying each address it resolves to.
pub fn connect(host: &str, port: u16, timeout: Option<Duration>) -> Result<TcpStream, ToolError> {
    let addrs = (host, port)
        .to_socket_addrs()
        .map_err(|e| ToolError::new(format!("{e} for {host}:{port}")))?;
    for a in addrs {
        let s = match timeout {
            Some(t) => TcpStream::connect_timeout(&a, t),
            None => TcpStream::connect(a),
        };
        if let Ok(s) = s {
            return Ok(s);
        }
    }
    Err(ToolError::new(format!("Couldn't connect to {host}:{port}")))
}

/// Listens on `port` (IPv6 and IPv4 where the host allows it) and accepts one client.
fn accept(port: u16, timeout: Option<Duration>) -> Result<TcpStream, ToolError> {
    let listener = listen(port)?;
    accept_on(&listener, port, timeout)
}

/// Listens on `port` and accepts `n` clients, in order.
pub fn accept_many(port: u16, n: u32, timeout: Option<Duration>) -> Result<Vec<TcpStream>, ToolError> {
    let listener = listen(port)?;
    (0..n).map(|_| accept_on(&listener, port, timeout)).collect()
}

fn listen(port: u16) -> Result<TcpListener, ToolError> {
    TcpListener::bind((Ipv6Addr::UNSPECIFIED, port))
        .or_else(|_| TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)))
        .map_err(|e| ToolError::new(format!("Couldn't listen to port {port}: {e}")))
}

fn accept_on(listener: &TcpListener, port: u16, timeout: Option<Duration>) -> Result<TcpStream, ToolError> {
    let Some(limit) = timeout else {
        return Ok(listener.accept().or_fail("accept() failed")?.0);
    };
    // std has no accept timeout: poll a non-blocking listener.
    listener.set_nonblocking(true).or_fail("accept() failed")?;
    let deadline = Instant::now() + limit;
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).or_fail("accept() failed")?;
                return Ok(s);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(ToolError::new(format!(
                        "no client connected to port {port} within {limit:?}"
                    )));
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(ToolError::new(format!("accept() failed: {e}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn c_style_integers() {
        assert_eq!(parse_c_int::<u32>("4096"), Ok(4096));
        assert_eq!(parse_c_int::<u32>("0x1000"), Ok(4096));
        assert_eq!(parse_c_int::<u32>("010"), Ok(8));
        assert_eq!(parse_c_int::<u32>("0"), Ok(0));
        assert_eq!(parse_c_int::<i32>("-1"), Ok(-1));
        assert!(parse_c_int::<u32>("-1").is_err());
        assert!(parse_c_int::<u16>("70000").is_err());
        assert!(parse_c_int::<u32>("12abc").is_err());
    }

    #[test]
    fn mtus() {
        assert_eq!(parse_mtu("1024"), Ok(Mtu::Mtu1024));
        assert_eq!(parse_mtu("4096"), Ok(Mtu::Mtu4096));
        assert!(parse_mtu("1500").is_err());
    }
}
