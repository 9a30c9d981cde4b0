//! One connected stream rsocket: its RC QP, CQ and registered buffers, and librdmacm's data
//! protocol over them (`rsocket.c`: `rs_write_data`, `rs_send_credits`, `rs_poll_cq`).
//!
//! - The *receive buffer* (`rbuf`) is a ring in two halves. The peer RDMA-writes data into
//!   the half it was last given, each write with the immediate `Data(len)`; we copy out in
//!   order. Once a half is free again it is handed back by writing its address into the
//!   peer's *target SGL* (an `Sgl` immediate), and with it credits: the peer may send until
//!   its message count reaches the sequence number the immediate carries. Every message
//!   consumes one of our posted receives, so credits never exceed them.
//! - The *target SGL* (`target`) is where the peer writes the buffers we may write into
//!   (two entries, used alternately; an entry is only rewritten once we used it up), followed
//!   by the *iomap* table, where it writes the buffers it mapped for direct writes.
//! - The *send buffer* (`sbuf`) is a ring the data is copied into before it is written; its
//!   bytes are freed as the writes complete, in order. Control messages (credits, shutdown,
//!   disconnect, keepalive) have `CTRL_SIZE` send slots of their own and may use the RNR
//!   retries of the QP to wait for a receive at the peer.

use std::collections::VecDeque;
use std::sync::Arc;

use softverbs_engine::types::{
    AccessFlags, QpCap, QpType, RecvWr, SendFlags, Sge, WcFlags, WcStatus, WorkCompletion,
};
use softverbs_engine::wr::{Payload, RemoteAddr, SendOp};
use softverbs_engine::Result;
use softverbs_wire::rsocket::{
    conn_flag, ctrl, op, scale_to_value, value_to_scale, ByteOrder, ConnDataRepr, IomapRepr, Message,
    SgeRepr, IOMAP_LEN, SGE_LEN, SGL_SIZE,
};

use crate::cm::CmId;
use crate::context::Context;
use crate::cq::{CompChannel, Cq};
use crate::mem::{AtomicBuffer, MemoryBacking};
use crate::pd::{Mr, Pd};
use crate::qp::{Qp, QpInitAttr, SendRequest};
use crate::rsocket::{errno, resources};

/// librdmacm's low-water mark: a send needs this much free send buffer.
pub(crate) const SNDLOWAT: u32 = 2048;
/// The first write of a send is this large; each next one twice the last, up to
/// [`MAX_TRANSFER`] (so the first bytes leave early).
const OLAP_START: u32 = 2048;
const MAX_TRANSFER: u32 = 65536;
/// Send slots reserved for control messages.
pub(crate) const CTRL_SIZE: u32 = 4;
const QP_MIN_SIZE: u32 = 16;
const QP_MAX_SIZE: u32 = 0xFFFE;
/// Marks receive work requests.
const RECV: u64 = 1 << 63;

/// The sizes a stream socket is made with (socket options, inherited by accepted sockets).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sizes {
    pub(crate) sbuf: u32,
    pub(crate) rbuf: u32,
    pub(crate) sq: u32,
    pub(crate) rq: u32,
    pub(crate) inline: u32,
    pub(crate) iomap: u32,
}

/// A buffer mapped for the peer's direct writes (`riomap`), or locally.
#[derive(Debug)]
struct IoMapping {
    mr: Arc<Mr>,
    offset: u64,
    /// The peer's iomap slot; `None` for a local (`PROT_NONE`) mapping.
    slot: Option<u32>,
    /// Not yet announced to the peer.
    queued: bool,
}

/// Where the connection stands (librdmacm's `rs_connected`, `rs_readable`, `rs_writable`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Status {
    pub(crate) connected: bool,
    pub(crate) readable: bool,
    pub(crate) writable: bool,
    /// A work request failed: the connection is broken (ECONNRESET).
    pub(crate) failed: bool,
}

impl Status {
    pub(crate) fn disconnect(&mut self) {
        self.connected = false;
        self.readable = false;
        self.writable = false;
    }
}

#[derive(Debug)]
pub(crate) struct Conn {
    pub(crate) ctx: Arc<Context>,
    pub(crate) qp: Arc<Qp>,
    pub(crate) cq: Arc<Cq>,
    pub(crate) comp: Arc<CompChannel>,
    pd: Arc<Pd>,
    sbuf: Arc<AtomicBuffer>,
    smr: Arc<Mr>,
    rbuf: Arc<AtomicBuffer>,
    rmr: Arc<Mr>,
    target: Arc<AtomicBuffer>,
    target_mr: Arc<Mr>,
    pub(crate) sizes: Sizes,
    pub(crate) status: Status,

    ctrl_seqno: u32,
    ctrl_max_seqno: u32,
    sseq_no: u16,
    sseq_comp: u16,
    rseq_no: u16,
    rseq_comp: u16,
    remote_sge: u32,
    remote_sgl: SgeRepr,
    remote_iomap: SgeRepr,
    /// The byte order of the peer's SGL and iomap memory.
    peer_order: ByteOrder,
    target_sge: u32,
    /// Lengths of the data messages received and not yet read.
    rmsg: VecDeque<u32>,
    rbuf_bytes_avail: u32,
    rbuf_free_offset: u32,
    rbuf_offset: u32,
    sbuf_bytes_avail: u32,
    sbuf_pos: u32,
    sqe_avail: u32,
    maps: Vec<IoMapping>,
}

fn clamp_queue(n: u32, max: u32) -> u32 {
    n.clamp(QP_MIN_SIZE, max.clamp(QP_MIN_SIZE, QP_MAX_SIZE))
}

impl Conn {
    /// Makes the endpoint of `id` (which knows its device by now): CQ, RC QP attached to the
    /// id (so the connection manager moves it), buffers, and every receive posted.
    pub(crate) fn create(id: &Arc<CmId>, want: Sizes) -> Result<Self> {
        let device = id.device().ok_or_else(|| errno(nix::libc::ENODEV))?;
        let (ctx, pd) = resources(&device)?;
        let max_wr = device.attr().max_qp_wr;
        let max_inline = device.limits().max_inline_data;
        let sizes = Sizes {
            sq: clamp_queue(want.sq, max_wr),
            rq: clamp_queue(want.rq, max_wr),
            inline: want.inline.min(max_inline),
            ..want
        };
        let comp = CompChannel::create(&ctx)?;
        let cq = Cq::create(&ctx, (sizes.sq + sizes.rq) as i32, Some(&comp), 0)?;
        let qp = Qp::create(
            &pd,
            &QpInitAttr {
                qp_type: QpType::Rc,
                send_cq: Some(cq.clone()),
                recv_cq: Some(cq.clone()),
                srq: None,
                cap: QpCap {
                    max_send_wr: sizes.sq,
                    max_recv_wr: sizes.rq,
                    max_send_sge: 2,
                    max_recv_sge: 1,
                    // Credit and iomap updates always go inline, whatever the data does.
                    max_inline_data: sizes.inline.max(IOMAP_LEN as u32).min(max_inline),
                },
                sq_sig_all: true,
                max_tso_header: 0,
            },
        )?;
        let local = AccessFlags::LOCAL_WRITE.bits();
        let remote = (AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).bits();
        let reg = |len: u32, access: u32| -> Result<(Arc<AtomicBuffer>, Arc<Mr>)> {
            let b = Arc::new(AtomicBuffer::new(len as usize));
            let mr = Mr::register(&pd, b.clone(), b.addr(), access)?;
            Ok((b, mr))
        };
        let (sbuf, smr) = reg(sizes.sbuf, local)?;
        let (rbuf, rmr) = reg(sizes.rbuf, remote)?;
        let (target, target_mr) = reg(SGE_LEN as u32 * SGL_SIZE + IOMAP_LEN as u32 * sizes.iomap, remote)?;
        id.attach_qp(&qp)?;
        let c = Self {
            ctx,
            qp,
            cq,
            comp,
            pd,
            sbuf,
            smr,
            rbuf,
            rmr,
            target,
            target_mr,
            sizes,
            status: Status {
                connected: false,
                readable: false,
                writable: false,
                failed: false,
            },
            ctrl_seqno: 0,
            ctrl_max_seqno: CTRL_SIZE,
            sseq_no: 0,
            sseq_comp: 0,
            rseq_no: 0,
            rseq_comp: (sizes.rq >> 1) as u16,
            remote_sge: 0,
            remote_sgl: SgeRepr::default(),
            remote_iomap: SgeRepr::default(),
            peer_order: ByteOrder::native(),
            target_sge: 0,
            rmsg: VecDeque::new(),
            rbuf_bytes_avail: sizes.rbuf >> 1,
            rbuf_free_offset: sizes.rbuf >> 1,
            rbuf_offset: 0,
            sbuf_bytes_avail: sizes.sbuf,
            sbuf_pos: 0,
            sqe_avail: sizes.sq - CTRL_SIZE,
            maps: Vec::new(),
        };
        for _ in 0..sizes.rq {
            c.post_recv()?;
        }
        Ok(c)
    }

    fn post_recv(&self) -> Result<()> {
        self.qp
            .post_recv(&[RecvWr {
                wr_id: RECV,
                sg_list: Vec::new(),
            }])
            .map_err(Into::into)
    }

    /// What this side tells its peer in the connection's private data.
    pub(crate) fn conn_data(&self) -> ConnDataRepr {
        let net = if ByteOrder::native() == ByteOrder::Big {
            conn_flag::NET
        } else {
            0
        };
        ConnDataRepr {
            flags: conn_flag::IOMAP | net,
            credits: self.sizes.rq as u16,
            target_iomap_size: value_to_scale(self.sizes.iomap),
            target_sgl: SgeRepr {
                addr: self.target.addr(),
                key: self.target_mr.rkey(),
                length: SGL_SIZE,
            },
            data_buf: SgeRepr {
                addr: self.rbuf.addr(),
                key: self.rmr.rkey(),
                length: self.sizes.rbuf >> 1,
            },
        }
    }

    /// Takes in the peer's connection data: its SGL and iomap table, our first target
    /// buffer, our credits. The connection is then open both ways.
    pub(crate) fn open(&mut self, peer: &ConnDataRepr) -> Result<()> {
        if peer.target_sgl.length == 0 || peer.credits == 0 {
            return Err(errno(nix::libc::EPROTO));
        }
        self.remote_sgl = peer.target_sgl;
        self.remote_sge = 1 % peer.target_sgl.length;
        self.peer_order = peer.sgl_order();
        if peer.flags & conn_flag::IOMAP != 0 {
            // The peer's addresses are its own business: arithmetic on them wraps.
            self.remote_iomap = SgeRepr {
                addr: peer
                    .target_sgl
                    .addr
                    .wrapping_add(SGE_LEN as u64 * u64::from(peer.target_sgl.length)),
                key: peer.target_sgl.key,
                length: scale_to_value(peer.target_iomap_size),
            };
        }
        self.set_target(0, peer.data_buf);
        self.sseq_comp = peer.credits;
        self.status = Status {
            connected: true,
            readable: true,
            writable: true,
            failed: false,
        };
        Ok(())
    }

    fn target(&self, i: u32) -> SgeRepr {
        let mut b = [0u8; SGE_LEN];
        self.target.read_bytes(i as usize * SGE_LEN, &mut b);
        SgeRepr::parse(&b, ByteOrder::native()).expect("16 bytes")
    }

    fn set_target(&self, i: u32, s: SgeRepr) {
        let mut b = [0u8; SGE_LEN];
        s.emit(&mut b, ByteOrder::native()).expect("16 bytes");
        self.target.write_bytes(i as usize * SGE_LEN, &b);
    }

    fn post(&self, wr_id: u64, op: SendOp, payload: Payload) -> Result<()> {
        let flags = match payload {
            Payload::Inline(_) => SendFlags::SIGNALED | SendFlags::INLINE,
            _ => SendFlags::SIGNALED,
        };
        self.qp
            .post_send(&[SendRequest {
                wr_id,
                op,
                flags,
                payload,
                ud: None,
                xrc_srqn: None,
            }])
            .map_err(Into::into)
    }

    /// An RDMA WRITE WITH IMMEDIATE of `msg` carrying `payload` to `remote`.
    fn post_write_msg(&self, msg: Message, payload: Payload, remote: RemoteAddr) -> Result<()> {
        let op = SendOp::Write {
            remote,
            imm: Some(msg.imm().to_be()),
        };
        self.post(u64::from(msg.imm()), op, payload)
    }

    /// A zero-length write with an immediate: a message with nothing else.
    fn post_msg(&self, msg: Message) -> Result<()> {
        self.post_write_msg(msg, Payload::Sges(Vec::new()), RemoteAddr { addr: 0, rkey: 0 })
    }

    fn ctrl_avail(&self) -> bool {
        self.ctrl_seqno != self.ctrl_max_seqno
    }

    /// Whether a control message (shutdown, disconnect) can be sent now, or never will.
    pub(crate) fn can_send_ctrl(&self) -> bool {
        self.ctrl_avail() || !self.status.connected
    }

    /// Every send, data and control, has completed (or the connection is gone).
    pub(crate) fn all_sends_done(&self) -> bool {
        (self.ctrl_max_seqno - self.ctrl_seqno) + self.sqe_avail == self.sizes.sq || !self.status.connected
    }

    /// Room to send a data message now: a send slot, free send buffer, a credit and a
    /// target buffer.
    pub(crate) fn can_send(&self) -> bool {
        self.status.connected
            && self.sqe_avail > 0
            && self.sbuf_bytes_avail >= SNDLOWAT
            && self.sseq_no != self.sseq_comp
            && self.target(self.target_sge).length != 0
    }

    /// Data received and not yet read.
    pub(crate) fn has_data(&self) -> bool {
        !self.rmsg.is_empty()
    }

    /// Sends `msg` (a [`ctrl`] value) on a control slot; the caller checked
    /// [`Conn::can_send_ctrl`].
    pub(crate) fn send_ctrl(&mut self, ctrl: u32) -> Result<()> {
        if !(self.status.connected && self.ctrl_avail()) {
            return Ok(());
        }
        self.ctrl_seqno += 1;
        self.post_msg(Message::Ctrl(ctrl))
    }

    /// A keepalive: a plain zero-length RDMA WRITE, which needs no receive at the peer; a dead
    /// peer makes it fail after the QP's retries.
    pub(crate) fn send_keepalive(&mut self) -> Result<()> {
        if !(self.status.connected && self.ctrl_avail()) {
            return Ok(());
        }
        self.ctrl_seqno += 1;
        let msg = Message::Ctrl(ctrl::KEEPALIVE);
        self.post(
            u64::from(msg.imm()),
            SendOp::Write {
                remote: RemoteAddr { addr: 0, rkey: 0 },
                imm: None,
            },
            Payload::Sges(Vec::new()),
        )
    }

    fn should_give_credits(&self) -> bool {
        (self.rbuf_bytes_avail >= self.sizes.rbuf >> 1
            || (self.rseq_no.wrapping_sub(self.rseq_comp) as i16) >= 0)
            && self.ctrl_avail()
            && self.status.connected
    }

    /// Returns credits (and a free receive half, when there is one) to the peer if it has
    /// used up enough of them.
    pub(crate) fn update_credits(&mut self) -> Result<()> {
        if !self.should_give_credits() {
            return Ok(());
        }
        self.ctrl_seqno += 1;
        self.rseq_comp = self.rseq_no.wrapping_add((self.sizes.rq >> 1) as u16);
        let msg = Message::Sgl(u32::from(self.rseq_no) + self.sizes.rq);
        let half = self.sizes.rbuf >> 1;
        if self.rbuf_bytes_avail >= half {
            let sge = SgeRepr {
                addr: self.rbuf.addr() + u64::from(self.rbuf_free_offset),
                key: self.rmr.rkey(),
                length: half,
            };
            let mut b = vec![0u8; SGE_LEN];
            sge.emit(&mut b, self.peer_order).expect("16 bytes");
            let remote = RemoteAddr {
                addr: self
                    .remote_sgl
                    .addr
                    .wrapping_add(u64::from(self.remote_sge) * SGE_LEN as u64),
                rkey: self.remote_sgl.key,
            };
            self.post_write_msg(msg, Payload::Inline(b), remote)?;
            self.rbuf_bytes_avail -= half;
            self.rbuf_free_offset += half;
            if self.rbuf_free_offset >= self.sizes.rbuf {
                self.rbuf_free_offset = 0;
            }
            self.remote_sge += 1;
            if self.remote_sge == self.remote_sgl.length {
                self.remote_sge = 0;
            }
            Ok(())
        } else {
            self.post_msg(msg)
        }
    }

    /// Takes every completion: messages received, sends completed. Receives are posted again
    /// while the connection lasts. Returns whether anything happened.
    pub(crate) fn poll(&mut self) -> Result<bool> {
        let mut wcs = [WorkCompletion::default(); 32];
        let mut received = 0;
        let mut any = false;
        loop {
            let n = self.cq.poll(&mut wcs);
            for wc in &wcs[..n] {
                any = true;
                if wc.wr_id & RECV != 0 {
                    if wc.status != WcStatus::Success {
                        continue;
                    }
                    received += 1;
                    if wc.wc_flags.contains(WcFlags::WITH_IMM) {
                        self.on_message(Message::from_imm(u32::from_be(wc.imm_data)));
                    }
                } else {
                    self.on_send_done(wc);
                }
            }
            if n < wcs.len() {
                break;
            }
        }
        if self.status.connected {
            for _ in 0..received {
                if let Err(e) = self.post_recv() {
                    self.fail();
                    return Err(e);
                }
            }
        }
        Ok(any)
    }

    fn on_message(&mut self, msg: Message) {
        match msg {
            Message::Sgl(seq) => self.sseq_comp = seq as u16,
            Message::Ctrl(ctrl::DISCONNECT) => self.status.disconnect(),
            Message::Ctrl(ctrl::SHUTDOWN) => {
                if self.status.writable {
                    self.status.readable = false;
                } else {
                    self.status.disconnect();
                }
            }
            // More than the receive buffer, or beyond the credits we gave: not rsockets.
            Message::Data(len) if len > self.sizes.rbuf || self.rmsg.len() > self.sizes.rq as usize => {
                self.fail();
            }
            Message::Data(len) => self.rmsg.push_back(len),
            // The iomap was updated in place; keepalives and unknown messages need nothing.
            Message::IomapSgl(_) | Message::Ctrl(_) | Message::Other { .. } => {}
        }
    }

    fn on_send_done(&mut self, wc: &WorkCompletion) {
        let msg = Message::from_imm(wc.wr_id as u32);
        match msg.op() {
            op::SGL => self.ctrl_max_seqno += 1,
            op::CTRL => {
                self.ctrl_max_seqno += 1;
                if msg.data() == ctrl::DISCONNECT {
                    self.status.disconnect();
                }
            }
            op::IOMAP_SGL => {
                self.sqe_avail += 1;
                self.sbuf_bytes_avail += IOMAP_LEN as u32;
            }
            _ => {
                self.sqe_avail += 1;
                self.sbuf_bytes_avail += msg.data();
            }
        }
        if wc.status != WcStatus::Success && self.status.connected {
            self.fail();
        }
    }

    fn fail(&mut self) {
        self.status.disconnect();
        self.status.failed = true;
    }

    /// How much of `left` bytes the next data write may carry; `olen` grows with each write.
    pub(crate) fn next_len(&self, left: usize, olen: &mut u32) -> u32 {
        let mut n = if (*olen as usize) < left {
            let n = *olen;
            if *olen < MAX_TRANSFER {
                *olen <<= 1;
            }
            n
        } else {
            left as u32
        };
        n = n.min(self.sbuf_bytes_avail);
        n.min(self.target(self.target_sge).length)
    }

    /// The first size of a send's writes.
    pub(crate) fn first_len() -> u32 {
        OLAP_START
    }

    /// The payload of a write of `bytes`: inline if small enough, else copied into the send
    /// ring (one piece, or two where it wraps).
    fn stage(&mut self, bytes: &[u8]) -> Payload {
        let len = bytes.len() as u32;
        if len <= self.sizes.inline {
            return Payload::Inline(bytes.to_vec());
        }
        let first = len.min(self.sizes.sbuf - self.sbuf_pos);
        self.sbuf
            .write_bytes(self.sbuf_pos as usize, &bytes[..first as usize]);
        let mut sges = vec![Sge {
            addr: self.sbuf.addr() + u64::from(self.sbuf_pos),
            length: first,
            lkey: self.smr.lkey(),
        }];
        if first < len {
            self.sbuf.write_bytes(0, &bytes[first as usize..]);
            sges.push(Sge {
                addr: self.sbuf.addr(),
                length: len - first,
                lkey: self.smr.lkey(),
            });
        }
        self.sbuf_pos = (self.sbuf_pos + len) % self.sizes.sbuf;
        Payload::Sges(sges)
    }

    /// Writes `bytes` (at most [`Conn::next_len`]) into the peer's current receive buffer;
    /// the caller checked [`Conn::can_send`].
    pub(crate) fn send_data(&mut self, bytes: &[u8]) -> Result<()> {
        let len = bytes.len() as u32;
        self.sseq_no = self.sseq_no.wrapping_add(1);
        self.sqe_avail -= 1;
        self.sbuf_bytes_avail -= len;
        let mut t = self.target(self.target_sge);
        let remote = RemoteAddr {
            addr: t.addr,
            rkey: t.key,
        };
        t.addr = t.addr.wrapping_add(u64::from(len));
        t.length -= len;
        self.set_target(self.target_sge, t);
        if t.length == 0 {
            self.target_sge = (self.target_sge + 1) % SGL_SIZE;
        }
        let payload = self.stage(bytes);
        self.post_write_msg(Message::Data(len), payload, remote)
    }

    /// Copies received data into `dst` in order; with `peek` nothing is consumed. Returns
    /// the bytes copied.
    pub(crate) fn read(&mut self, dst: &mut [u8], peek: bool) -> usize {
        let mut done = 0;
        let mut offset = self.rbuf_offset;
        let mut i = 0;
        while done < dst.len() && i < self.rmsg.len() {
            let avail = self.rmsg[i];
            let take = avail.min((dst.len() - done) as u32);
            let mut copied = 0;
            while copied < take {
                let n = (take - copied).min(self.sizes.rbuf - offset);
                let at = done + copied as usize;
                self.rbuf
                    .read_bytes(offset as usize, &mut dst[at..at + n as usize]);
                copied += n;
                offset = (offset + n) % self.sizes.rbuf;
            }
            done += take as usize;
            if peek {
                i += 1;
                continue;
            }
            self.rbuf_bytes_avail = (self.rbuf_bytes_avail + take).min(self.sizes.rbuf);
            if take == avail {
                self.rmsg.pop_front();
                self.rseq_no = self.rseq_no.wrapping_add(1);
            } else {
                self.rmsg[0] -= take;
            }
        }
        if !peek {
            self.rbuf_offset = offset;
        }
        done
    }

    // ---- iomap ------------------------------------------------------------------------

    /// `riomap`: registers `backing` (its first byte at `addr`) for the peer's direct writes
    /// at `offset` (default: `addr`), or for local use only; the peer learns of it before our
    /// next transfer.
    pub(crate) fn iomap(
        &mut self,
        backing: Arc<dyn MemoryBacking>,
        addr: u64,
        writable: bool,
        offset: Option<u64>,
    ) -> Result<u64> {
        let slot = if writable {
            let used: Vec<u32> = self.maps.iter().filter_map(|m| m.slot).collect();
            let free = (0..self.remote_iomap.length).find(|s| !used.contains(s));
            Some(free.ok_or_else(|| errno(nix::libc::ENOMEM))?)
        } else {
            None
        };
        let mut access = AccessFlags::LOCAL_WRITE;
        if writable {
            access |= AccessFlags::REMOTE_WRITE;
        }
        let mr = Mr::register(&self.pd, backing, addr, access.bits())?;
        let offset = offset.unwrap_or(addr);
        self.maps.push(IoMapping {
            mr,
            offset,
            slot,
            queued: slot.is_some(),
        });
        Ok(offset)
    }

    /// `riounmap`: EINVAL unless `addr` and `len` name a mapping.
    pub(crate) fn iounmap(&mut self, addr: u64, len: u64) -> Result<()> {
        let at = self
            .maps
            .iter()
            .position(|m| m.mr.addr() == addr && m.mr.length() == len)
            .ok_or_else(|| errno(nix::libc::EINVAL))?;
        let m = self.maps.remove(at);
        let _ = m.mr.dereg();
        Ok(())
    }

    /// Whether mappings wait to be announced.
    pub(crate) fn iomap_pending(&self) -> bool {
        self.maps.iter().any(|m| m.queued)
    }

    /// Announces the next queued mapping (the caller checked [`Conn::can_send`]): writes its
    /// entry into the peer's iomap table.
    pub(crate) fn send_next_iomap(&mut self) -> Result<()> {
        let Some(m) = self.maps.iter_mut().find(|m| m.queued) else {
            return Ok(());
        };
        m.queued = false;
        let slot = m.slot.expect("queued mappings have a slot");
        let entry = IomapRepr {
            offset: m.offset,
            sge: SgeRepr {
                addr: m.mr.addr(),
                key: m.mr.rkey(),
                length: m.mr.length() as u32,
            },
        };
        let mut b = vec![0u8; IOMAP_LEN];
        entry.emit(&mut b, self.peer_order).expect("24 bytes");
        self.sseq_no = self.sseq_no.wrapping_add(1);
        self.sqe_avail -= 1;
        self.sbuf_bytes_avail -= IOMAP_LEN as u32;
        let remote = RemoteAddr {
            addr: self
                .remote_iomap
                .addr
                .wrapping_add(u64::from(slot) * IOMAP_LEN as u64),
            rkey: self.remote_iomap.key,
        };
        self.post_write_msg(Message::IomapSgl(slot), Payload::Inline(b), remote)
    }

    /// The peer's mapping that holds `offset`, from our iomap table.
    pub(crate) fn find_iomap(&self, offset: u64) -> Option<IomapRepr> {
        (0..self.sizes.iomap).find_map(|i| {
            let mut b = [0u8; IOMAP_LEN];
            self.target
                .read_bytes(SGE_LEN * SGL_SIZE as usize + i as usize * IOMAP_LEN, &mut b);
            let e = IomapRepr::parse(&b, ByteOrder::native()).expect("24 bytes");
            e.contains(offset).then_some(e)
        })
    }

    /// How much of `left` bytes a direct write at `offset` into `map` may carry now.
    pub(crate) fn next_direct_len(&self, map: &IomapRepr, offset: u64, left: usize, olen: &mut u32) -> u32 {
        let mut n = if (*olen as usize) < left {
            let n = *olen;
            if *olen < MAX_TRANSFER {
                *olen <<= 1;
            }
            n
        } else {
            left as u32
        };
        n = n.min(self.sbuf_bytes_avail);
        // `offset` is inside the mapping (`find_iomap`).
        let room = u64::from(map.sge.length) - (offset - map.offset);
        n.min(room.min(u64::from(u32::MAX)) as u32)
    }

    /// A direct write of `bytes` to `offset` of the peer's `map` (`riowrite`): no immediate,
    /// no credit; the peer's application finds the data in its buffer.
    pub(crate) fn send_direct(&mut self, map: &IomapRepr, offset: u64, bytes: &[u8]) -> Result<()> {
        let len = bytes.len() as u32;
        self.sqe_avail -= 1;
        self.sbuf_bytes_avail -= len;
        let remote = RemoteAddr {
            addr: map.sge.addr.wrapping_add(offset - map.offset),
            rkey: map.sge.key,
        };
        let payload = self.stage(bytes);
        let msg = Message::Other {
            op: op::WRITE,
            data: len,
        };
        self.post(u64::from(msg.imm()), SendOp::Write { remote, imm: None }, payload)
    }

    /// The path MTU in bytes (`TCP_MAXSEG`).
    pub(crate) fn mtu(&self) -> u32 {
        self.qp.query().path_mtu.bytes()
    }

    /// Frees everything: the QP (what it still had queued leaves first), CQ, channel, regions.
    pub(crate) fn destroy(&mut self) {
        let _ = self.qp.destroy();
        let _ = self.cq.destroy();
        let _ = self.comp.destroy();
        for m in self.maps.drain(..) {
            let _ = m.mr.dereg();
        }
        for mr in [&self.smr, &self.rmr, &self.target_mr] {
            let _ = mr.dereg();
        }
    }
}
