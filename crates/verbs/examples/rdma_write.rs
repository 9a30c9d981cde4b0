//! An RDMA WRITE between two processes: the program of the crate guide.
//!
//! ```text
//! rdma_write [ADDR]          server: listens on ADDR (default 127.0.0.1:0), prints "listening on ..."
//! rdma_write --connect ADDR  client: writes a message into the server's memory
//! ```

use std::error::Error;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use softverbs::{
    devices, AccessFlags, AhAttr, Context, Gid, GlobalRoute, MemoryRegion, Mtu, Payload, QpAttr, QpAttrMask,
    QpInit, QpState, QpType, QueuePair, RecvWr, RemoteAddr, SendFlags, SendOp, SendRequest, WcOpcode,
    WcStatus, WorkCompletion,
};

/// What the client writes.
pub const MESSAGE: &[u8] = b"hello from the other process, by RDMA WRITE";
/// The immediate value that tells the server the write is complete.
const DONE: u32 = 0x600d;
/// Every wait is bounded: a vanished peer is an error, not a hang.
const TIMEOUT: Duration = Duration::from_secs(20);

type Result<T> = std::result::Result<T, Box<dyn Error>>;

/// What each side tells the other over TCP before any RDMA traffic: its QP number and first
/// PSN, its GID, and (the server) where its buffer is and the rkey that opens it.
#[derive(Debug, Clone, Copy)]
struct Endpoint {
    qpn: u32,
    psn: u32,
    gid: Gid,
    addr: u64,
    rkey: u32,
}

impl Endpoint {
    const LEN: usize = 4 + 4 + 16 + 8 + 4;

    fn send(&self, tcp: &mut TcpStream) -> Result<()> {
        let mut b = Vec::with_capacity(Self::LEN);
        b.extend_from_slice(&self.qpn.to_be_bytes());
        b.extend_from_slice(&self.psn.to_be_bytes());
        b.extend_from_slice(&self.gid.0);
        b.extend_from_slice(&self.addr.to_be_bytes());
        b.extend_from_slice(&self.rkey.to_be_bytes());
        tcp.write_all(&b)?;
        Ok(())
    }

    fn recv(tcp: &mut TcpStream) -> Result<Self> {
        let mut b = [0u8; Self::LEN];
        tcp.read_exact(&mut b)?;
        let u32_at = |i: usize| u32::from_be_bytes(b[i..i + 4].try_into().unwrap());
        Ok(Self {
            qpn: u32_at(0),
            psn: u32_at(4),
            gid: Gid(b[8..24].try_into().unwrap()),
            addr: u64::from_be_bytes(b[24..32].try_into().unwrap()),
            rkey: u32_at(32),
        })
    }
}

/// The device and GID index whose GID is `ip`: the RDMA device behind the interface the TCP
/// connection runs over (softverbs has one per interface, and a GID per address).
fn open_device_for(ip: IpAddr) -> Result<(Context, u8)> {
    let want = Gid::from_ip(ip);
    for dev in devices()? {
        let ctx = dev.open()?;
        let port = ctx.query_port(1)?;
        for index in 0..port.gid_tbl_len {
            if ctx.query_gid(1, index as i32).is_ok_and(|gid| gid == want) {
                return Ok((ctx, index as u8));
            }
        }
    }
    Err(format!("no RDMA device has the GID of {ip}").into())
}

/// Moves `qp` from RESET through INIT and RTR to RTS, connected to `peer`.
fn connect(
    qp: &QueuePair,
    sgid_index: u8,
    me: &Endpoint,
    peer: &Endpoint,
    access: AccessFlags,
) -> Result<()> {
    // INIT: the port, and what the peer may do to this side's memory.
    qp.modify(
        &QpAttr {
            qp_state: QpState::Init,
            port_num: 1,
            pkey_index: 0,
            qp_access_flags: access,
            ..Default::default()
        },
        QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS,
    )?;
    // RTR (ready to receive): where the peer is and the PSN its first packet carries.
    qp.modify(
        &QpAttr {
            qp_state: QpState::Rtr,
            path_mtu: Mtu::Mtu1024,
            dest_qp_num: peer.qpn,
            rq_psn: peer.psn,
            max_dest_rd_atomic: 1,
            min_rnr_timer: 12,
            ah_attr: AhAttr {
                is_global: true,
                port_num: 1,
                grh: GlobalRoute {
                    dgid: peer.gid,
                    sgid_index,
                    hop_limit: 64,
                    ..Default::default()
                },
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
    // RTS (ready to send): this side's first PSN, and how long and how often to retry.
    qp.modify(
        &QpAttr {
            qp_state: QpState::Rts,
            sq_psn: me.psn,
            timeout: 14,
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

/// Waits (busy polling, bounded) for the next completion of `cq`.
fn next_completion(cq: &softverbs::CompletionQueue) -> Result<WorkCompletion> {
    let deadline = Instant::now() + TIMEOUT;
    let mut wc = [WorkCompletion::default()];
    while cq.poll(&mut wc) == 0 {
        if Instant::now() > deadline {
            return Err("no completion in time".into());
        }
        std::thread::yield_now();
    }
    if wc[0].status != WcStatus::Success {
        return Err(format!("work request {} failed: {:?}", wc[0].wr_id, wc[0].status).into());
    }
    Ok(wc[0])
}

/// A random 24-bit first PSN, as rdma-core's tools pick one.
fn first_psn() -> u32 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    (t.subsec_nanos() ^ std::process::id()) & 0xff_ffff
}

/// The server: offers a buffer for remote writing, waits for the client's RDMA WRITE with
/// immediate data and returns what was written.
pub fn server(listener: TcpListener) -> Result<Vec<u8>> {
    let (mut tcp, _) = listener.accept()?;
    tcp.set_read_timeout(Some(TIMEOUT))?;
    let (ctx, sgid_index) = open_device_for(tcp.local_addr()?.ip())?;
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(16, None, 0)?;
    let qp = pd.create_qp(&QpInit::new(QpType::Rc, &cq))?;
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    let mr: MemoryRegion = pd.register(4096, access)?;

    let me = Endpoint {
        qpn: qp.qp_num(),
        psn: first_psn(),
        gid: ctx.query_gid(1, i32::from(sgid_index))?,
        addr: mr.addr(),
        rkey: mr.rkey(),
    };
    me.send(&mut tcp)?;
    let peer = Endpoint::recv(&mut tcp)?;
    connect(&qp, sgid_index, &me, &peer, AccessFlags::REMOTE_WRITE)?;
    // A WRITE with immediate data consumes a receive (which needs no buffer): that completion
    // is how the server learns the data is there.
    qp.post_recv(&[RecvWr {
        wr_id: 1,
        sg_list: vec![],
    }])?;
    tcp.write_all(b"R")?; // ready: the client may write now

    let wc = next_completion(&cq)?;
    if wc.opcode != WcOpcode::RecvRdmaWithImm || u32::from_be(wc.imm_data) != DONE {
        return Err(format!("unexpected completion {wc:?}").into());
    }
    let mut got = vec![0u8; wc.byte_len as usize];
    mr.read(0, &mut got)?;
    Ok(got)
}

/// The client: writes [`MESSAGE`] into the server's buffer with one RDMA WRITE.
pub fn client(addr: SocketAddr) -> Result<()> {
    let mut tcp = TcpStream::connect_timeout(&addr, TIMEOUT)?;
    tcp.set_read_timeout(Some(TIMEOUT))?;
    let (ctx, sgid_index) = open_device_for(tcp.local_addr()?.ip())?;
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(16, None, 0)?;
    let qp = pd.create_qp(&QpInit::new(QpType::Rc, &cq))?;
    let mr = pd.register_bytes(MESSAGE, AccessFlags::LOCAL_WRITE)?;

    let peer = Endpoint::recv(&mut tcp)?;
    let me = Endpoint {
        qpn: qp.qp_num(),
        psn: first_psn(),
        gid: ctx.query_gid(1, i32::from(sgid_index))?,
        addr: 0,
        rkey: 0,
    };
    me.send(&mut tcp)?;
    connect(&qp, sgid_index, &me, &peer, AccessFlags::empty())?;
    let mut ready = [0u8; 1];
    tcp.read_exact(&mut ready)?;

    qp.post_send(&[SendRequest {
        wr_id: 7,
        op: SendOp::Write {
            remote: RemoteAddr {
                addr: peer.addr,
                rkey: peer.rkey,
            },
            imm: Some(DONE.to_be()),
        },
        flags: SendFlags::SIGNALED,
        payload: Payload::Sges(vec![mr.sge(0..MESSAGE.len())?]),
        ud: None,
        xrc_srqn: None,
    }])?;
    // The completion means the server's side acknowledged the data.
    let wc = next_completion(&cq)?;
    assert_eq!((wc.wr_id, wc.opcode), (7, WcOpcode::RdmaWrite));
    Ok(())
}

/// The whole program: `args` are its command-line arguments.
pub fn run(args: &[String]) -> Result<()> {
    match args {
        [flag, addr] if flag == "--connect" => {
            client(addr.parse()?)?;
            println!("wrote {} bytes", MESSAGE.len());
        }
        [] | [_] => {
            let listener = TcpListener::bind(args.first().map_or("127.0.0.1:0", String::as_str))?;
            println!("listening on {}", listener.local_addr()?);
            std::io::stdout().flush()?;
            let got = server(listener)?;
            println!("received: {}", String::from_utf8_lossy(&got));
        }
        _ => return Err("usage: rdma_write [ADDR] | rdma_write --connect ADDR".into()),
    }
    Ok(())
}

fn main() -> Result<()> {
    run(&std::env::args().skip(1).collect::<Vec<_>>())
}
