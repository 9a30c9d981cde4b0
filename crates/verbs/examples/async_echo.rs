//! An async echo server and client over RC, on tokio.
//!
//! ```sh
//! cargo run -p softverbs --example async_echo -- server --port 7471 &
//! cargo run -p softverbs --example async_echo -- client 127.0.0.1:7471 --messages 1000
//! ```
//!
//! The two sides meet over TCP (each sends one line: QP number, PSN, GID), then move their QPs
//! to RTS and talk SEND/RECV. Every buffer is a `Vec<u8>` registered without a copy
//! (`register_owned`), owned by the work request that uses it and handed back with its
//! completion, so it is never touched while the device may use it; the program reads and
//! fills buffers in place through the regions' guards. The server echoes each message back
//! from the buffer it arrived in; the client keeps a window of messages in flight and checks
//! every echo. With `--cancel-every M` the client also drops some send and receive futures
//! while their requests are in flight, which must change nothing the peer sees.
//!
//! Output: the server prints `listening <port>`; the client prints `ok <messages> messages
//! <bytes> bytes <payload copies>` (the last figure is the device's `rx_payload_copies`:
//! large payloads between processes of one host are copied once, straight between the
//! registered buffers).

use std::collections::VecDeque;
use std::error::Error as StdError;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use softverbs::aio::{AsyncQp, Op};
use softverbs::{
    devices, AccessFlags, AhAttr, Context, Gid, GlobalRoute, Mtu, OwnedRegion, ProtectionDomain, QpAttr,
    QpAttrMask, QpCap, QpState, QpType,
};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

type Result<T> = std::result::Result<T, Box<dyn StdError + Send + Sync>>;
type Buf = OwnedRegion<Vec<u8>>;

/// Receives the server keeps posted.
const SERVER_DEPTH: usize = 16;
/// Largest message.
const DEFAULT_MAX: usize = 64 * 1024;

/// The device holding `ip` and the index of its GID.
fn device_for(ip: IpAddr) -> Result<(Context, u8, Gid)> {
    let want = Gid::from_ip(ip);
    for dev in devices()? {
        let ctx = dev.open()?;
        let port = ctx.query_port(1)?;
        for i in 0..port.gid_tbl_len.min(256) {
            if ctx.query_gid(1, i as i32)? == want {
                return Ok((ctx, i as u8, want));
            }
        }
    }
    Err(format!("no device has the address {ip}").into())
}

/// One side of a connection: the QP and what is needed to connect it.
struct Side {
    pd: ProtectionDomain,
    qp: AsyncQp,
    gid_index: u8,
    gid: Gid,
    psn: u32,
}

impl Side {
    fn new(local: IpAddr, depth: u32) -> Result<Self> {
        let (ctx, gid_index, gid) = device_for(local)?;
        let pd = ctx.alloc_pd()?;
        let cap = QpCap {
            max_send_wr: depth,
            max_recv_wr: depth,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        let qp = AsyncQp::new(&pd, QpType::Rc, cap)?;
        qp.qp().modify(
            &QpAttr {
                qp_state: QpState::Init,
                port_num: 1,
                ..Default::default()
            },
            QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS,
        )?;
        let psn = (std::process::id().wrapping_mul(2_654_435_761) ^ qp.qp().qp_num()) & 0xFF_FFFF;
        Ok(Self {
            pd,
            qp,
            gid_index,
            gid,
            psn,
        })
    }

    fn line(&self) -> String {
        let gid: String = self.gid.0.iter().map(|b| format!("{b:02x}")).collect();
        format!("{} {} {gid}\n", self.qp.qp().qp_num(), self.psn)
    }

    /// RTR towards the peer described by `line`, then RTS.
    fn connect(&self, line: &str) -> Result<()> {
        let f: Vec<&str> = line.split_whitespace().collect();
        let [qpn, psn, gid] = f[..] else {
            return Err(format!("bad peer line {line:?}").into());
        };
        let mut dgid = [0u8; 16];
        for (i, b) in dgid.iter_mut().enumerate() {
            *b = u8::from_str_radix(gid.get(2 * i..2 * i + 2).ok_or("short GID")?, 16)?;
        }
        let qp = self.qp.qp();
        qp.modify(
            &QpAttr {
                qp_state: QpState::Rtr,
                path_mtu: Mtu::Mtu4096,
                dest_qp_num: qpn.parse()?,
                rq_psn: psn.parse()?,
                max_dest_rd_atomic: 1,
                min_rnr_timer: 1,
                ah_attr: AhAttr {
                    grh: GlobalRoute {
                        dgid: Gid(dgid),
                        sgid_index: self.gid_index,
                        hop_limit: 64,
                        ..Default::default()
                    },
                    is_global: true,
                    port_num: 1,
                    ..Default::default()
                },
                ..Default::default()
            },
            QpAttrMask::STATE
                | QpAttrMask::AV
                | QpAttrMask::PATH_MTU
                | QpAttrMask::DEST_QPN
                | QpAttrMask::RQ_PSN
                | QpAttrMask::MAX_DEST_RD_ATOMIC
                | QpAttrMask::MIN_RNR_TIMER,
        )?;
        qp.modify(
            &QpAttr {
                qp_state: QpState::Rts,
                sq_psn: self.psn,
                // About 1 s per try: a loaded host may stall a process for a good part of one.
                timeout: 18,
                retry_cnt: 7,
                rnr_retry: 7,
                max_rd_atomic: 1,
                ..Default::default()
            },
            QpAttrMask::STATE
                | QpAttrMask::SQ_PSN
                | QpAttrMask::TIMEOUT
                | QpAttrMask::RETRY_CNT
                | QpAttrMask::RNR_RETRY
                | QpAttrMask::MAX_QP_RD_ATOMIC,
        )?;
        Ok(())
    }

    fn buffer(&self, len: usize) -> Result<Buf> {
        Ok(self.pd.register_owned(vec![0u8; len], AccessFlags::LOCAL_WRITE)?)
    }
}

/// `e` with the QP's transport counters (retransmissions, timer expiries, drops), which tell
/// a lost peer from a slow one.
fn failed(e: softverbs::aio::WrError, qp: &AsyncQp) -> Box<dyn StdError + Send + Sync> {
    format!("{e} (QP {:#x}: {:?})", qp.qp().qp_num(), qp.qp().counters()).into()
}

/// Sends our line and reads the peer's.
async fn exchange(tcp: &mut BufReader<TcpStream>, mine: &str) -> Result<String> {
    tcp.get_mut().write_all(mine.as_bytes()).await?;
    let mut line = String::new();
    if tcp.read_line(&mut line).await? == 0 {
        return Err("the peer closed the connection".into());
    }
    Ok(line)
}

/// Byte `i` of message `n`.
fn pattern(n: u64, i: usize) -> u8 {
    (i as u64).wrapping_mul(31).wrapping_add(n.wrapping_mul(7)) as u8
}

/// The size of message `n`: from 1 byte to `max`, a few of them large enough to travel
/// straight between the buffers.
fn size_of(n: u64, max: usize) -> usize {
    match n % 5 {
        0 => max,
        1 => 1 + (n as usize * 7919) % 64,
        _ => 1 + (n as usize * 104_729) % max,
    }
}

async fn serve(tcp: TcpStream) -> Result<()> {
    let local = tcp.local_addr()?.ip();
    let mut tcp = BufReader::new(tcp);
    let side = Side::new(local, SERVER_DEPTH as u32 + 1)?;
    // The client's first line says how large its messages are.
    let mut hello = String::new();
    tcp.read_line(&mut hello).await?;
    let max: usize = hello.trim().strip_prefix("max ").ok_or("bad hello")?.parse()?;
    let mut recvs = VecDeque::new();
    for _ in 0..SERVER_DEPTH {
        recvs.push_back(side.qp.recv(side.buffer(max)?, 0..max));
    }
    let peer = exchange(&mut tcp, &side.line()).await?;
    side.connect(&peer)?;
    while let Some(op) = recvs.pop_front() {
        let (r, buf) = op.await;
        let n = r.map_err(|e| failed(e, &side.qp))?.byte_len as usize;
        if n == 0 {
            break; // the client's end marker
        }
        // Back from the buffer it arrived in; then that buffer receives again.
        let (r, buf) = side.qp.send(buf, 0..n).await;
        r.map_err(|e| failed(e, &side.qp))?;
        recvs.push_back(side.qp.recv(buf, 0..max));
    }
    // Tell the client everything was echoed, then drop the QP (flushing the receives left).
    tcp.get_mut().write_all(b"done\n").await?;
    Ok(())
}

/// What the client checks for each message in flight.
struct InFlight {
    n: u64,
    size: usize,
    send: Option<Op<Buf>>,
    recv: Option<Op<Buf>>,
}

/// Allocates and scribbles over memory of the sizes the buffers have: a buffer freed while
/// its request was in flight would likely be reused here, and the echo would show it.
fn churn(max: usize) {
    let junk: Vec<Vec<u8>> = (0..8).map(|k| vec![0xA0 | k as u8; max]).collect();
    std::hint::black_box(&junk);
}

async fn client(addr: SocketAddr, messages: u64, max: usize, window: usize, cancel_every: u64) -> Result<()> {
    let tcp = TcpStream::connect(addr).await?;
    let local = tcp.local_addr()?.ip();
    let mut tcp = BufReader::new(tcp);
    let depth = 2 * window + 2;
    let side = Side::new(local, depth as u32)?;
    tcp.get_mut().write_all(format!("max {max}\n").as_bytes()).await?;
    let peer = exchange(&mut tcp, &side.line()).await?;
    side.connect(&peer)?;

    let mut spare: Vec<Buf> = Vec::new();
    let take = |spare: &mut Vec<Buf>| match spare.pop() {
        Some(b) => Ok::<Buf, Box<dyn StdError + Send + Sync>>(b),
        None => side.buffer(max),
    };
    let mut flight: VecDeque<InFlight> = VecDeque::new();
    let (mut next, mut bytes, mut checked) = (0u64, 0u64, 0u64);
    while next < messages || !flight.is_empty() {
        if next < messages && flight.len() < window {
            let n = next;
            next += 1;
            let size = size_of(n, max);
            // The echo's receive goes first, so it is posted before the echo can come.
            let recv = side.qp.recv(take(&mut spare)?, 0..max);
            let mut out = take(&mut spare)?;
            for (i, b) in out.local_mut()[..size].iter_mut().enumerate() {
                *b = pattern(n, i);
            }
            let send = side.qp.send(out, 0..size);
            let (mut send, mut recv) = (Some(send), Some(recv));
            if cancel_every > 0 && n % cancel_every == cancel_every - 1 {
                // Give up on the send at once: the request keeps its buffer until it
                // completes, so the echo must still be exact.
                drop(send.take());
                churn(max);
            } else if cancel_every > 1 && n % cancel_every == cancel_every / 2 {
                // Give up on the echo: its buffer stays posted and takes this echo.
                drop(recv.take());
                churn(max);
            }
            flight.push_back(InFlight { n, size, send, recv });
            continue;
        }
        let f = flight.pop_front().expect("something is in flight");
        if let Some(send) = f.send {
            let (r, buf) = send.await;
            r.map_err(|e| failed(e, &side.qp))?;
            spare.push(buf);
        }
        if let Some(recv) = f.recv {
            let (r, buf) = recv.await;
            let wc = r.map_err(|e| failed(e, &side.qp))?;
            if wc.byte_len as usize != f.size {
                return Err(format!("echo {} has {} bytes, not {}", f.n, wc.byte_len, f.size).into());
            }
            let data = buf.local();
            if let Some(i) = (0..f.size).find(|&i| data[i] != pattern(f.n, i)) {
                return Err(format!("echo {} differs at byte {i} of {}", f.n, f.size).into());
            }
            drop(data);
            spare.push(buf);
            checked += 1;
        }
        bytes += f.size as u64;
    }
    // The end marker: an empty message.
    let (r, _) = side.qp.send(take(&mut spare)?, 0..0).await;
    r.map_err(|e| failed(e, &side.qp))?;
    let mut done = String::new();
    tokio::time::timeout(Duration::from_secs(60), tcp.read_line(&mut done)).await??;
    if done.trim() != "done" {
        return Err(format!("the server said {done:?}").into());
    }
    // Requests whose futures were dropped have completed too: nothing is left in flight.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while side.qp.outstanding() > 0 {
        if tokio::time::Instant::now() > deadline {
            return Err(format!("{} requests never completed", side.qp.outstanding()).into());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let copies = side.pd.context().counters().rx_payload_copies;
    println!("ok {messages} messages {bytes} bytes {copies} copies {checked} checked");
    Ok(())
}

fn usage() -> ! {
    eprintln!(
        "usage: async_echo server [--port P] [--connections N]\n       async_echo client HOST:PORT [--messages N] [--max-size BYTES] [--window K] [--cancel-every M]"
    );
    std::process::exit(2)
}

/// Runs the command line `args` (without the program name).
pub(crate) fn run(args: Vec<String>) -> Result<()> {
    let mut it = args.into_iter();
    let mode = it.next().unwrap_or_else(|| usage());
    let mut target = None;
    let mut opts = std::collections::HashMap::new();
    while let Some(a) = it.next() {
        match a.strip_prefix("--") {
            Some(k) => {
                opts.insert(k.to_string(), it.next().unwrap_or_else(|| usage()));
            }
            None => target = Some(a),
        }
    }
    let num = |k: &str, default: u64| -> Result<u64> {
        Ok(opts.get(k).map(|v| v.parse()).transpose()?.unwrap_or(default))
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    match mode.as_str() {
        "server" => {
            let port = num("port", 7471)? as u16;
            let connections = num("connections", u64::MAX)?;
            rt.block_on(async move {
                let listener = TcpListener::bind(("127.0.0.1", port)).await?;
                println!("listening {}", listener.local_addr()?.port());
                let mut tasks = Vec::new();
                for _ in 0..connections {
                    let (tcp, _) = listener.accept().await?;
                    tasks.push(tokio::spawn(serve(tcp)));
                }
                for t in tasks {
                    t.await??;
                }
                Ok(())
            })
        }
        "client" => {
            let addr: SocketAddr = target.unwrap_or_else(|| usage()).parse()?;
            let messages = num("messages", 1000)?;
            let max = num("max-size", DEFAULT_MAX as u64)? as usize;
            let window = num("window", 4)?.max(1) as usize;
            let cancel = num("cancel-every", 0)?;
            rt.block_on(client(addr, messages, max, window, cancel))
        }
        _ => usage(),
    }
}

#[allow(dead_code)] // The test harness that includes this file has its own `main`.
fn main() {
    use std::io::Write;
    let r = run(std::env::args().skip(1).collect());
    let _ = std::io::stdout().flush();
    if let Err(e) = r {
        eprintln!("async_echo: {e}");
        std::process::exit(1);
    }
}
