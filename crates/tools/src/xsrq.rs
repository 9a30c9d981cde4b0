//! rdma-core's `ibv_xsrq_pingpong` on the safe softverbs API: ping-pong over XRC, each side
//! receiving into one XRC SRQ, wire-compatible with the C program.
//!
//! Each side opens the XRC domain of `/tmp/xrc_domain`, creates an XRC SRQ (its CQ is the
//! receive CQ) and, per client, an XRC_RECV (target) and an XRC_SEND (initiator) QP. Addresses
//! travel over TCP as the text `LLLL:RRRRRR:SSSSSS:PPPPPP:NNNNNN:<32 hex GID digits>` and a NUL
//! ([`WIRE_LEN`] bytes: LID, target QPN, initiator QPN, PSN and SRQ number). The client sends its
//! address first; the server answers each client in turn, then sends the first message to each.
//! Every receive is answered with the next send until `num_tests` have been sent per client; the
//! last send is signaled. The run ends with a `"END"` handshake ([`TERMINATION`]) so that no
//! side tears down while the peer's last message may still be on the way.
//!
//! As in the C program, with several clients the server sends to client `i`'s SRQ through the
//! initiator connected to client `(i + count) % clients`, whose target QP then delivers into
//! another process's SRQ of the same domain (the device relays it to the SRQ's owner).

use std::io::{Read, Write};
use std::net::Ipv6Addr;
use std::time::{Duration, Instant};

use softverbs::{
    odp, AccessFlags, CompletionChannel, CompletionQueue, Context, Error, Gid, GlobalRoute, MemoryRegion,
    Mtu, Payload, ProtectionDomain, QpAttr, QpAttrMask, QpCap, QpInit, QpState, QpType, QueuePair, RecvWr,
    SendFlags, SendOp, SendRequest, SharedReceiveQueue, SrqAttr, WcStatus, WorkCompletion, XrcDomain,
    O_CREAT,
};

use crate::pingpong::{parse_wire, pick_gid, random_psn, Role};
use crate::{OrFail, ToolError};

/// Bytes of one address message: `"%04x:%06x:%06x:%06x:%06x:%32s"` plus the NUL.
pub const WIRE_LEN: usize = 66;
/// The handshake that ends a run, NUL included.
pub const TERMINATION: &[u8; 4] = b"END\0";
/// The file whose inode names the XRC domain, as in the C program.
pub const DOMAIN_FILE: &str = "/tmp/xrc_domain";

/// One side's address as the peers exchange it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dest {
    /// Port LID (0 on RoCE).
    pub lid: u16,
    /// The XRC_RECV (target) QP number the peer's initiator connects to.
    pub recv_qpn: u32,
    /// The XRC_SEND (initiator) QP number the peer's target connects to.
    pub send_qpn: u32,
    /// The initiator's first PSN (the peer's target expects it).
    pub psn: u32,
    /// The XRC SRQ number the peer's sends name.
    pub srqn: u32,
    /// GID.
    pub gid: Gid,
}

impl Dest {
    /// The wire message and its NUL.
    pub fn to_wire(&self) -> [u8; WIRE_LEN] {
        let gid: String = self.gid.0.iter().map(|b| format!("{b:02x}")).collect();
        let text = format!(
            "{:04x}:{:06x}:{:06x}:{:06x}:{:06x}:{gid}",
            self.lid,
            self.recv_qpn & 0xff_ffff,
            self.send_qpn & 0xff_ffff,
            self.psn & 0xff_ffff,
            self.srqn & 0xff_ffff
        );
        let mut msg = [0u8; WIRE_LEN];
        msg[..text.len()].copy_from_slice(text.as_bytes());
        msg
    }

    /// Parses a wire message (text up to the first NUL).
    pub fn from_wire(msg: &[u8]) -> Result<Self, ToolError> {
        let q = 0xff_ffff;
        let (v, gid) = parse_wire(msg, &[0xffff, q, q, q, q])?;
        Ok(Self {
            lid: v[0] as u16,
            recv_qpn: v[1],
            send_qpn: v[2],
            psn: v[3],
            srqn: v[4],
            gid,
        })
    }

    /// The line the program prints; `label` is `local` or `remote`.
    pub fn line(&self, label: &str) -> String {
        format!(
            "{label:>8}: LID {:04x}, QPN RECV {:06x} SEND {:06x}, PSN {:06x}, SRQN {:06x}, GID {}",
            self.lid,
            self.recv_qpn,
            self.send_qpn,
            self.psn,
            self.srqn,
            Ipv6Addr::from(self.gid.0)
        )
    }
}

/// The command-line options of the C program.
#[derive(Debug, Clone)]
pub struct Config {
    /// Port of the device (`-i`).
    pub ib_port: u8,
    /// Message size (`-s`).
    pub size: usize,
    /// Path MTU (`-m`).
    pub mtu: Mtu,
    /// Clients the server waits for (`-c`; a client always counts one).
    pub num_clients: u32,
    /// Messages sent to each client (`-n`).
    pub num_tests: u32,
    /// Service level (`-l`).
    pub sl: u8,
    /// Sleep on completion events (`-e`).
    pub use_events: bool,
    /// Local GID index (`-g`); `None` picks one.
    pub gid_index: Option<i32>,
    /// Give up when no completion arrives for this long (`None`: wait forever).
    pub timeout: Option<Duration>,
    /// Register the buffer for on-demand paging (`-o`).
    pub odp: bool,
}

impl Default for Config {
    /// The C program's defaults: port 1, 4096 bytes, MTU 1024, one client, five tests, SL 0.
    fn default() -> Self {
        Self {
            ib_port: 1,
            size: 4096,
            mtu: Mtu::Mtu1024,
            num_clients: 1,
            num_tests: 5,
            sl: 0,
            use_events: false,
            gid_index: None,
            timeout: None,
            odp: false,
        }
    }
}

/// One side's resources. Fields drop in order: QPs before the SRQ, the SRQ before the domain.
#[derive(Debug)]
pub struct XsrqPingPong {
    send_qps: Vec<QueuePair>,
    recv_qps: Vec<QueuePair>,
    srq: SharedReceiveQueue,
    xrcd: XrcDomain,
    _domain_file: Option<std::fs::File>,
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
    channel: Option<CompletionChannel>,
    mr: MemoryRegion,
    _pd: ProtectionDomain,
    cfg: Config,
    sgid_index: u8,
    lid: u16,
    gid: Gid,
}

/// What a run did.
#[derive(Debug, Clone)]
pub struct Report {
    /// Receives completed.
    pub recvs: u64,
    /// The addresses exchanged: (local, remote) per client.
    pub dests: Vec<(Dest, Dest)>,
}

impl XsrqPingPong {
    /// Creates the resources as the C program's `pp_init_ctx` does.
    pub fn new(ctx: &Context, cfg: Config) -> Result<Self, ToolError> {
        if cfg.size == 0 || cfg.num_clients == 0 || cfg.num_tests == 0 {
            return Err(ToolError::new("size, clients and num_tests must be at least 1"));
        }
        let mut access = AccessFlags::LOCAL_WRITE;
        if cfg.odp {
            // rdma-core's check, with its message: XRC sends and SRQ receives on ODP memory.
            let caps = ctx.query_device_ex().odp_caps;
            let needed = odp::SEND | odp::SRQ_RECV;
            if caps.general_caps & odp::SUPPORT == 0 || caps.xrc_odp_caps & needed != needed {
                return Err(ToolError::new(
                    "The device isn't ODP capable or does not support XRC send, receive and srq with ODP",
                ));
            }
            access |= AccessFlags::ON_DEMAND;
        }
        let port = ctx.query_port(cfg.ib_port).or_fail("Failed to get port info")?;
        let channel = if cfg.use_events {
            Some(
                ctx.create_comp_channel()
                    .or_fail("Couldn't create completion channel")?,
            )
        } else {
            None
        };
        let pd = ctx.alloc_pd().or_fail("Couldn't allocate PD")?;
        let mr = pd.register(cfg.size, access).or_fail("Couldn't register MR")?;
        // As the C program: without the file the domain is anonymous, which only works within
        // one process.
        let domain_file = std::fs::OpenOptions::new()
            .read(true)
            .write(false)
            .create(false)
            .open(DOMAIN_FILE)
            .or_else(|_| {
                std::fs::OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .open(DOMAIN_FILE)
            })
            .ok();
        let xrcd = ctx
            .open_xrcd(domain_file.as_ref().map(std::os::fd::AsFd::as_fd), O_CREAT)
            .or_fail("Couldn't Open the XRC Domain")?;
        let clients = cfg.num_clients;
        let recv_cq = ctx
            .create_cq(clients as i32, channel.as_ref(), 0)
            .or_fail("Couldn't create recv CQ")?;
        if channel.is_some() {
            recv_cq
                .req_notify(false)
                .or_fail("Couldn't request CQ notification")?;
        }
        let send_cq = ctx
            .create_cq(clients as i32, None, 0)
            .or_fail("Couldn't create send CQ")?;
        let srq = xrcd
            .create_srq(
                &pd,
                &recv_cq,
                &SrqAttr {
                    max_wr: clients,
                    max_sge: 1,
                    srq_limit: 0,
                },
            )
            .or_fail("Couldn't create SRQ")?;
        let mut recv_qps = Vec::new();
        let mut send_qps = Vec::new();
        for i in 0..clients {
            let tgt = xrcd
                .create_recv_qp()
                .or_fail(&format!("Couldn't create recv QP[{i}]"))?;
            to_init(
                &tgt,
                cfg.ib_port,
                AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
            )
            .or_fail(&format!("Failed to modify recv QP[{i}] to INIT"))?;
            let init = QpInit {
                qp_type: QpType::XrcSend,
                send_cq: &send_cq,
                recv_cq: &send_cq,
                srq: None,
                cap: QpCap {
                    max_send_wr: clients * cfg.num_tests,
                    max_send_sge: 1,
                    ..QpCap::default()
                },
                sq_sig_all: false,
            };
            let ini = pd
                .create_qp(&init)
                .or_fail(&format!("Couldn't create send QP[{i}]"))?;
            to_init(&ini, cfg.ib_port, AccessFlags::empty())
                .or_fail(&format!("Failed to modify send QP[{i}] to INIT"))?;
            recv_qps.push(tgt);
            send_qps.push(ini);
        }
        let sgid_index = pick_gid(ctx, cfg.ib_port, cfg.gid_index)?;
        let gid = ctx
            .query_gid(cfg.ib_port, i32::from(sgid_index))
            .or_fail(&format!("can't read sgid of index {sgid_index}"))?;
        Ok(Self {
            send_qps,
            recv_qps,
            srq,
            xrcd,
            _domain_file: domain_file,
            send_cq,
            recv_cq,
            channel,
            mr,
            _pd: pd,
            cfg,
            sgid_index,
            lid: port.lid,
            gid,
        })
    }

    /// The XRC domain handle.
    pub fn xrcd(&self) -> &XrcDomain {
        &self.xrcd
    }

    fn post_recv(&self, n: u32) -> Result<(), ToolError> {
        let sge = self
            .mr
            .sge(0..self.cfg.size)
            .or_fail("Failed to post receive to SRQ")?;
        for _ in 0..n {
            self.srq
                .post_recv(&[RecvWr {
                    wr_id: 0,
                    sg_list: vec![sge],
                }])
                .or_fail("Failed to post receive to SRQ")?;
        }
        Ok(())
    }

    fn local_dest(&self, index: usize) -> Dest {
        Dest {
            lid: self.lid,
            recv_qpn: self.recv_qps[index].qp_num(),
            send_qpn: self.send_qps[index].qp_num(),
            psn: random_psn(),
            srqn: self.srq.srq_num(),
            gid: self.gid,
        }
    }

    fn connect(&self, index: usize, local: &Dest, remote: &Dest) -> Result<(), ToolError> {
        let ah_attr = softverbs::AhAttr {
            grh: GlobalRoute {
                dgid: remote.gid,
                sgid_index: self.sgid_index,
                hop_limit: 5,
                ..Default::default()
            },
            is_global: remote.gid.interface_id() != 0,
            dlid: remote.lid,
            sl: self.cfg.sl,
            port_num: self.cfg.ib_port,
            ..Default::default()
        };
        let tgt = &self.recv_qps[index];
        let rtr = QpAttr {
            qp_state: QpState::Rtr,
            dest_qp_num: remote.send_qpn,
            path_mtu: self.cfg.mtu,
            rq_psn: remote.psn,
            min_rnr_timer: 12,
            ah_attr,
            ..Default::default()
        };
        let av = QpAttrMask::STATE
            | QpAttrMask::AV
            | QpAttrMask::PATH_MTU
            | QpAttrMask::DEST_QPN
            | QpAttrMask::RQ_PSN;
        tgt.modify(
            &rtr,
            av | QpAttrMask::MAX_DEST_RD_ATOMIC | QpAttrMask::MIN_RNR_TIMER,
        )
        .or_fail(&format!("Failed to modify recv QP[{index}] to RTR"))?;
        let rts = QpAttr {
            qp_state: QpState::Rts,
            timeout: 14,
            sq_psn: local.psn,
            ..Default::default()
        };
        tgt.modify(&rts, QpAttrMask::STATE | QpAttrMask::TIMEOUT | QpAttrMask::SQ_PSN)
            .or_fail(&format!("Failed to modify recv QP[{index}] to RTS"))?;
        let ini = &self.send_qps[index];
        let rtr = QpAttr {
            dest_qp_num: remote.recv_qpn,
            ..rtr
        };
        ini.modify(&rtr, av)
            .or_fail(&format!("Failed to modify send QP[{index}] to RTR"))?;
        let rts = QpAttr {
            retry_cnt: 7,
            rnr_retry: 7,
            ..rts
        };
        ini.modify(
            &rts,
            QpAttrMask::STATE
                | QpAttrMask::TIMEOUT
                | QpAttrMask::SQ_PSN
                | QpAttrMask::RETRY_CNT
                | QpAttrMask::RNR_RETRY
                | QpAttrMask::MAX_QP_RD_ATOMIC,
        )
        .or_fail(&format!("Failed to modify send QP[{index}] to RTS"))
    }

    /// Sends to client `index`'s SRQ, round robin over the initiators; the last is signaled.
    fn post_send(&self, index: usize, remote: &[Dest], counts: &mut [u32]) -> Result<(), ToolError> {
        let n = self.send_qps.len();
        let qpi = (index + counts[index] as usize) % n;
        counts[index] += 1;
        let flags = if counts[index] >= self.cfg.num_tests {
            SendFlags::SIGNALED
        } else {
            SendFlags::empty()
        };
        let sge = self.mr.sge(0..self.cfg.size).or_fail("Couldn't post send")?;
        let wr = SendRequest {
            wr_id: index as u64,
            op: SendOp::Send {
                imm: None,
                invalidate: None,
            },
            flags,
            payload: Payload::Sges(vec![sge]),
            ud: None,
            xrc_srqn: Some(remote[index].srqn),
        };
        self.send_qps[qpi].post_send(&[wr]).or_fail("Couldn't post send")
    }

    /// Runs as `role` over the given streams (one per client; a client has one), printing the
    /// address lines and `success` to `out`.
    pub fn run<S: Read + Write>(
        self,
        role: Role,
        mut streams: Vec<S>,
        out: &mut dyn Write,
    ) -> Result<Report, ToolError> {
        let clients = self.recv_qps.len();
        if streams.len() != clients {
            return Err(ToolError::new(format!(
                "{clients} connections needed, {} given",
                streams.len()
            )));
        }
        self.post_recv(clients as u32)?;
        let mut dests = Vec::new();
        for (i, s) in streams.iter_mut().enumerate() {
            let local = self.local_dest(i);
            let remote = if role == Role::Client {
                send_dest(s, &local, out)?;
                recv_dest(s, i, out)?
            } else {
                let remote = recv_dest(s, i, out)?;
                send_dest(s, &local, out)?;
                remote
            };
            self.connect(i, &local, &remote)?;
            dests.push((local, remote));
        }
        let remote: Vec<Dest> = dests.iter().map(|d| d.1).collect();
        let mut counts = vec![0u32; clients];
        if role == Role::Server {
            for i in 0..clients {
                self.post_send(i, &remote, &mut counts)?;
            }
        }
        let total = u64::from(self.cfg.num_tests) * clients as u64;
        let (mut cnt, mut cq_events) = (0u64, 0u32);
        let mut wc = [WorkCompletion::default()];
        let mut last = Instant::now();
        while cnt < total {
            if let Some(ch) = &self.channel {
                let ev = match ch.get_cq_event_timeout(self.cfg.timeout) {
                    Ok(ev) => ev,
                    Err(Error::WouldBlock) => return Err(self.stalled(cnt)),
                    Err(e) => return Err(ToolError::new(format!("Failed to get cq_event: {e}"))),
                };
                if !ev.cq().same_as(&self.recv_cq) {
                    return Err(ToolError::new("CQ event for unknown CQ"));
                }
                self.recv_cq
                    .req_notify(false)
                    .or_fail("Couldn't request CQ notification")?;
                ev.ack();
                cq_events += 1;
            }
            loop {
                if self.recv_cq.poll(&mut wc) == 0 {
                    if self.channel.is_some() {
                        break;
                    }
                    if self.cfg.timeout.is_some_and(|t| last.elapsed() > t) {
                        return Err(self.stalled(cnt));
                    }
                    std::hint::spin_loop();
                    continue;
                }
                last = Instant::now();
                if wc[0].status != WcStatus::Success {
                    return Err(ToolError::new(format!(
                        "Work completion error {}",
                        wc[0].status.raw()
                    )));
                }
                self.post_recv(1)?;
                let qpi = if clients == 1 {
                    0
                } else {
                    self.recv_qps
                        .iter()
                        .position(|q| q.qp_num() == wc[0].qp_num)
                        .unwrap_or_else(|| {
                            eprintln!("Unable to find qp {:x}", wc[0].qp_num);
                            0
                        })
                };
                if counts[qpi] < self.cfg.num_tests {
                    self.post_send(qpi, &remote, &mut counts)?;
                }
                cnt += 1;
                if self.channel.is_none() || cnt >= total {
                    break;
                }
            }
        }
        let _ = cq_events;
        // The last send of each client is signaled.
        let mut sent = 0;
        let start = Instant::now();
        while sent < clients {
            sent += self.send_cq.poll(&mut wc);
            if self.cfg.timeout.is_some_and(|t| start.elapsed() > t) {
                return Err(self.stalled(cnt));
            }
        }
        // Nobody tears down before every peer is done (the C program's termination messages).
        match role {
            Role::Client => {
                terminate_send(&mut streams[0])?;
                terminate_recv(&mut streams[0])?;
            }
            Role::Server => {
                for s in streams.iter_mut() {
                    terminate_recv(s)?;
                }
                for s in streams.iter_mut() {
                    terminate_send(s)?;
                }
            }
        }
        drop(self);
        writeln!(out, "success").or_fail("write")?;
        out.flush().or_fail("write")?;
        Ok(Report { recvs: cnt, dests })
    }

    fn stalled(&self, cnt: u64) -> ToolError {
        ToolError::new(format!(
            "timed out after {:?} ({cnt} of {} receives completed)",
            self.cfg.timeout.unwrap_or_default(),
            u64::from(self.cfg.num_tests) * self.recv_qps.len() as u64
        ))
    }
}

fn to_init(qp: &QueuePair, port: u8, access: AccessFlags) -> softverbs::Result<()> {
    let attr = QpAttr {
        qp_state: QpState::Init,
        pkey_index: 0,
        port_num: port,
        qp_access_flags: access,
        ..Default::default()
    };
    qp.modify(
        &attr,
        QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS,
    )
}

fn send_dest<S: Write>(s: &mut S, d: &Dest, out: &mut dyn Write) -> Result<(), ToolError> {
    writeln!(out, "{}", d.line("local")).or_fail("write")?;
    out.flush().or_fail("write")?;
    s.write_all(&d.to_wire()).or_fail("Couldn't send local address")?;
    s.flush().or_fail("Couldn't send local address")
}

fn recv_dest<S: Read>(s: &mut S, index: usize, out: &mut dyn Write) -> Result<Dest, ToolError> {
    let mut msg = [0u8; WIRE_LEN];
    s.read_exact(&mut msg)
        .or_fail(&format!("Couldn't read remote address [{index}]"))?;
    let d = Dest::from_wire(&msg)?;
    writeln!(out, "{}", d.line("remote")).or_fail("write")?;
    out.flush().or_fail("write")?;
    Ok(d)
}

fn terminate_send<S: Write>(s: &mut S) -> Result<(), ToolError> {
    s.write_all(TERMINATION)
        .or_fail("Couldn't send termination ack")?;
    s.flush().or_fail("Couldn't send termination ack")
}

fn terminate_recv<S: Read>(s: &mut S) -> Result<(), ToolError> {
    let mut msg = [0u8; TERMINATION.len()];
    s.read_exact(&mut msg)
        .or_fail("Couldn't read remote termination ack")?;
    if &msg != TERMINATION {
        return Err(ToolError::new("Invalid termination ack was accepted"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_format_round_trips_and_matches_the_c_layout() {
        let d = Dest {
            lid: 0,
            recv_qpn: 0x03_0012,
            send_qpn: 0x03_0013,
            psn: 0x16_c746,
            srqn: 0x03_0011,
            gid: Gid(Ipv6Addr::new(0, 0, 0, 0, 0, 0xffff, 0x7f00, 1).octets()),
        };
        let w = d.to_wire();
        assert_eq!(
            std::str::from_utf8(&w[..65]).unwrap(),
            "0000:030012:030013:16c746:030011:00000000000000000000ffff7f000001"
        );
        assert_eq!(w[65], 0);
        assert_eq!(Dest::from_wire(&w), Ok(d));
        assert_eq!(
            d.line("local"),
            "   local: LID 0000, QPN RECV 030012 SEND 030013, PSN 16c746, SRQN 030011, GID ::ffff:127.0.0.1"
        );
        assert!(Dest::from_wire(b"0000:zz:0:0:0:00").is_err());
    }
}
