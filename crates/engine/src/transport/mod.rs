//! The transport: one [`QpEngine`] per queue pair, holding its requester, completer and
//! responder as pure state machines.
//!
//! The engine is sans-IO. Its inputs are work requests ([`QpEngine::post_send`],
//! [`QpEngine::post_recv`]), packets ([`QpEngine::handle_packet`]), attribute changes
//! ([`QpEngine::set_attr`]) and the passage of time ([`QpEngine::handle_timeout`]). Its outputs are
//! drained by the driver after every input, in this order:
//!
//! 1. [`QpEngine::poll_transmit`]: packets to send (BTH to ICRC; the driver fills the ICRC, which
//!    depends on the IP header it sends with);
//! 2. [`QpEngine::poll_completion`]: work completions for the send or receive CQ;
//! 3. [`QpEngine::poll_event`]: affiliated async events;
//! 4. [`QpEngine::poll_timeout`]: when to call [`QpEngine::handle_timeout`] next.
//!
//! Memory is reached only through the [`Memory`] trait, and shared
//! receive queues through [`RecvSource`], both supplied by the caller for the duration of a call.
//!
//! # XRC
//!
//! An XRC_SEND QP is an RC requester whose packets use the XRC opcodes and carry an XRCETH with
//! the WR's SRQ number; it has no responder. An XRC_RECV QP is an RC responder without a
//! requester: for each request it asks its [`RecvSource`] to select the SRQ the XRCETH names
//! ([`RecvSource::select_xrc_srq`]), checks keys against that SRQ's PD, takes the WQE from it,
//! and tags the completion [`WorkQueue::XrcSrq`]. Responses use the XRC opcodes, with no XRCETH.
//!
//! # Loss recovery (RC)
//!
//! * A sequence-error NAK, or the retransmission timer, makes the requester go back N: it
//!   resends from the missing PSN. One retry is spent per NAKed go-back; a further trigger at
//!   or after the same PSN before any progress is covered by the resend and costs nothing, so a
//!   duplicated NAK or a burst of ACKs cannot exhaust `retry_cnt` on its own. A NAK for the
//!   very PSN being resent, a round trip after the resend began, means that packet was lost
//!   again: it alone is resent at once (and again after two round trips if still nothing
//!   acknowledges it), so a lost resend costs a round trip, not a timeout.
//! * The retransmission timer follows the measured round trip (`recovery`: RFC 6298's
//!   estimate plus four deviations, at least 1 ms, doubled per expiry, at most the configured
//!   local ACK timeout); the retry budget is spent once per configured timeout of stall, so a
//!   vanished peer fails the QP after `retry_cnt + 1` configured timeouts as before. Drivers
//!   turn the measured timer off for carriers that lose nothing.
//! * A congestion window (from 128 PSNs: cut by 30 % once per window on a NAK, to 2 on a
//!   timeout, regrown by slow start and then about four PSNs per window) bounds what a
//!   go-back-N resends. AckReq is set often enough that a small window is acknowledged before
//!   it fills.
//! * The responder NAKs the first packet past a hole and then stays quiet, except for a packet
//!   that asks for an acknowledgement, one at or below a PSN it saw since the NAK (the
//!   requester started over, so the resend was lost), or every 32nd: a lost NAK costs no
//!   timeout either.
//! * A READ or atomic whose response is missing while the responder has evidently executed it
//!   (it acknowledged a later PSN, or the end of the response stream arrived) is asked for
//!   again on its own, as a duplicate request the responder answers from its resources; the
//!   requests after it are not resent. READ responses are placed out of order, and only the
//!   first hole is asked for each time.
//! * SEND/WRITE WQEs acknowledged while an earlier READ or atomic waits for its response
//!   complete as soon as that response arrives, without being resent.
//! * An RNR NAK rewinds the requester to the NAKed packet and holds it for the NAK's timer;
//!   `rnr_retry = 7` retries forever, at that pace.
//! * `retry_cnt` follows the IBTA: 7 means seven retries (rxe treats it as infinite).

pub mod buffers;
mod completer;
mod external;
mod grh;
mod placement;
mod raw;
mod recovery;
mod requester;
mod responder;

use std::collections::VecDeque;
use std::time::Duration;

use softverbs_wire::{AethSyndrome, ParsedPacket, Psn};

use crate::memory::Memory;
use crate::time::Instant;
use crate::types::{
    EventType, Gid, QpAttr, QpState, QpType, RecvWr, WcFlags, WcOpcode, WcStatus, WorkCompletion,
};
use crate::wr::SendWr;

pub use external::{
    ExternalRanges, Rx, RxData, EXTERNAL_MIN_MESSAGE, EXTERNAL_MIN_PACKET, MAX_EXTERNAL_RANGES,
};
pub use grh::write_grh;
pub use placement::RecvPlacement;
pub use raw::receive_frame;

/// Unacknowledged PSNs a requester may have in flight (as rxe).
pub const WINDOW: u32 = 128;
/// A requester sets AckReq at least this often within one long message.
pub const ACK_REQ_EVERY: u32 = 64;

/// Where a packet goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dest {
    /// Destination GID (its IP address), or a multicast GID.
    pub dgid: Gid,
    /// Index of the source GID.
    pub sgid_index: u8,
    /// Traffic class / TOS.
    pub traffic_class: u8,
    /// Hop limit / TTL.
    pub hop_limit: u8,
    /// Flow label (also the UDP source-port entropy).
    pub flow_label: u32,
}

/// A packet for the driver to send: the UDP payload from the BTH to the (zeroed) ICRC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transmit {
    /// Where to.
    pub dest: Dest,
    /// The bytes. With `external`, the payload is not in them: they are the packet with an
    /// empty payload (and no pad).
    pub data: Vec<u8>,
    /// Where the payload is in this process's memory, if it was left there (see
    /// [`QpEngine::set_external_payloads`]).
    pub external: Option<ExternalRanges>,
}

/// What the driver knows about a received packet besides its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RxMeta {
    /// Source GID (the sender's IP address).
    pub sgid: Gid,
    /// Destination GID (the address it was sent to).
    pub dgid: Gid,
    /// Traffic class / TOS.
    pub traffic_class: u8,
    /// Hop limit / TTL.
    pub hop_limit: u8,
}

/// Which CQ a completion belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkQueue {
    /// The send CQ.
    Send,
    /// The receive CQ.
    Recv,
    /// The CQ of the XRC SRQ with this number (XRC targets complete there).
    XrcSrq(u32),
    /// Back to the driver: the end of a work request the driver posted for itself
    /// ([`QpEngine::post_internal`]), or of a message it asked to see ([`RecvPlacement::queue`]).
    Internal,
}

/// A completion to push onto a CQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// Send or receive CQ.
    pub queue: WorkQueue,
    /// The completion.
    pub wc: WorkCompletion,
}

/// Why a received packet was dropped without effect. Drivers count these.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// The QP is not in a state that receives.
    NotReceiving,
    /// Opcode not valid for this QP type.
    WrongTransport,
    /// P_Key does not match.
    BadPkey,
    /// Q_Key does not match (UD).
    BadQkey,
    /// PSN out of the expected window, or a duplicate with nothing to resend.
    BadPsn,
    /// A response that matches no outstanding request.
    UnexpectedResponse,
    /// No receive WQE for a UD or UC message.
    NoReceiveWqe,
    /// Part of a UC message that was abandoned.
    UcMessageDropped,
    /// Structurally invalid for the transport (e.g. bad lengths on UD).
    Malformed,
}

/// Where receive WQEs come from: the QP's own receive queue or a shared receive queue.
pub trait RecvSource {
    /// Takes the next receive WQE.
    fn take(&mut self) -> Option<RecvWr>;
    /// Returns a WQE taken for a message that was then abandoned (UC), to be used next.
    fn put_back(&mut self, wr: RecvWr);
    /// Chooses the receive of a SEND from its first packet's payload (`only`: the message is
    /// that one packet). `None` means no receive is available (RNR), and must change nothing,
    /// since the message will be sent again. By default the next WQE takes the whole message.
    fn take_send(&mut self, first: &[u8], only: bool) -> Option<RecvPlacement> {
        let _ = (first, only);
        self.take().map(RecvPlacement::plain)
    }

    /// XRC targets: looks up the SRQ numbered `srqn` (the request's XRCETH) among the SRQs of
    /// the target's XRC domain, directs the following `take`/`put_back` to it and returns its
    /// protection domain. `None` if the domain has no such SRQ. Sources of other QPs have none.
    fn select_xrc_srq(&mut self, srqn: u32) -> Option<u32> {
        let _ = srqn;
        None
    }
}

/// The attributes the transport runs with, captured from the QP's attributes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpConfig {
    /// Transport service.
    pub qp_type: QpType,
    /// This QP's number.
    pub qpn: u32,
    /// The QP's protection domain (memory keys must belong to it).
    pub pd: u32,
    /// Every send WR completes with an entry.
    pub sq_sig_all: bool,
    /// Receives come from an SRQ.
    pub has_srq: bool,
}

/// Counters of what the engine saw; drivers aggregate them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QpCounters {
    /// Request packets sent (including retransmissions).
    pub tx_packets: u64,
    /// Retransmitted request packets.
    pub retransmits: u64,
    /// Packets dropped, by any [`DropReason`].
    pub rx_dropped: u64,
    /// Q_Key mismatches.
    pub qkey_violations: u64,
    /// P_Key mismatches.
    pub pkey_violations: u64,
    /// Retransmission timer expiries.
    pub timeouts: u64,
    /// Timer expiries that an acknowledgement of packets not yet resent showed to be
    /// spurious (each makes the timer slower to fire).
    pub spurious_timeouts: u64,
    /// RNR NAKs received.
    pub rnr_naks_received: u64,
    /// Sequence-error NAKs received.
    pub seq_naks_received: u64,
    /// Sequence-error NAKs sent by the responder (each for a request that arrived past a
    /// hole in the PSN sequence: a packet before it was lost or reordered).
    pub seq_naks_sent: u64,
    /// Duplicate requests seen by the responder.
    pub duplicates: u64,
    /// Tail probes: the newest packet in flight sent again, asking for an acknowledgement,
    /// when nothing was acknowledged for a few round trips (not counted in `retransmits`).
    pub tail_probes: u64,
    /// Positive ACKs the responder decided on but never built: a later one answered for them
    /// while ACKs were held ([`QpEngine::hold_acks`], a received batch).
    pub acks_held: u64,
}

/// The local ACK timeout for a `timeout` exponent: 4.096 us * 2^timeout; `None` for 0 (never).
pub fn ack_timeout(timeout: u8) -> Option<Duration> {
    (timeout != 0).then(|| Duration::from_nanos(4096u64 << timeout.min(31)))
}

/// RNR NAK timer values (IBTA table), in microseconds, by 5-bit code.
const RNR_MICROS: [u32; 32] = [
    655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920, 2560, 3840, 5120, 7680,
    10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840, 245_760, 327_680, 491_520,
];

/// The RNR delay of a timer code.
pub fn rnr_delay(code: u8) -> Duration {
    Duration::from_micros(u64::from(RNR_MICROS[usize::from(code & 31)]))
}

/// A posted send WQE and its progress.
#[derive(Debug, Clone)]
pub(crate) struct SendWqe {
    pub(crate) wr: SendWr,
    pub(crate) len: u64,
    /// PSNs are assigned when the requester first starts the WQE.
    pub(crate) started: bool,
    pub(crate) first_psn: Psn,
    /// Number of PSNs the WQE uses (for a READ, one per response packet).
    pub(crate) npsn: u32,
    /// Request packets of this WQE already sent in the current pass (always <= packets).
    pub(crate) next_pkt: u32,
    /// For READ: index of the first response packet not yet received.
    pub(crate) resp_pkts: u32,
    /// For READ: which response packets have been placed. Responses are placed out of order,
    /// so a reordered or retransmitted packet never forces the whole remainder to be resent.
    pub(crate) resp_seen: Vec<u64>,
    /// For READ: number of distinct response packets placed.
    pub(crate) resp_count: u32,
    /// For READ: one past the last response packet the latest request asked for.
    pub(crate) req_end: u32,
    /// READ/atomic: the responses are to be asked for again (the request was executed, the
    /// response lost), without resending the requests after it.
    pub(crate) rereq: bool,
    /// READ/atomic: the first missing response when it was last asked for again, so that more
    /// evidence of the same loss does not ask again.
    pub(crate) rereq_psn: Option<Psn>,
    /// READ/atomic: the whole response has arrived (the WQE still completes in order).
    pub(crate) done: bool,
    /// The WQE failed with this status; it completes with it when the QP is flushed, in order.
    pub(crate) failed: Option<WcStatus>,
    /// Posted by the driver for itself: it always completes, to [`WorkQueue::Internal`].
    pub(crate) internal: bool,
}

impl SendWqe {
    pub(crate) fn new(wr: SendWr) -> Self {
        let len = wr.payload.len();
        Self {
            wr,
            len,
            started: false,
            first_psn: Psn::ZERO,
            npsn: 0,
            next_pkt: 0,
            resp_pkts: 0,
            resp_seen: Vec::new(),
            resp_count: 0,
            req_end: 0,
            rereq: false,
            rereq_psn: None,
            done: false,
            failed: None,
            internal: false,
        }
    }

    pub(crate) fn last_psn(&self) -> Psn {
        self.first_psn + (self.npsn.max(1) - 1)
    }

    /// Request packets this WQE sends in a full pass.
    pub(crate) fn request_packets(&self) -> u32 {
        if self.wr.op.is_read_or_atomic() {
            1
        } else {
            self.npsn
        }
    }

    /// Started, and nothing of it is left to send in the current pass: every request packet
    /// went out, or (a READ or atomic) its whole response is in. A go-back-N rewinds a READ
    /// behind the hole it resends; if the READ's responses arrive meanwhile, sending its request
    /// again would ask for nothing, at a PSN past its own.
    pub(crate) fn fully_sent(&self) -> bool {
        self.started && (self.done || self.next_pkt >= self.request_packets())
    }

    /// Started, and still waiting for an acknowledgement or a response.
    pub(crate) fn outstanding(&self) -> bool {
        self.started && !self.done
    }

    /// The next PSN the requester still needs to hear about for this WQE.
    pub(crate) fn resume_psn(&self) -> Psn {
        self.first_psn + self.resp_pkts
    }

    /// Whether READ response packet `k` has been placed.
    pub(crate) fn resp_has(&self, k: u32) -> bool {
        let (word, bit) = ((k / 64) as usize, k % 64);
        self.resp_seen.get(word).is_some_and(|w| w & (1 << bit) != 0)
    }

    /// The first READ response packet at or after the first missing one that has been received
    /// (the end of the first hole), or `npsn`.
    ///
    /// Word by word: the bitmap reaches only as far as the highest response received, so this
    /// costs a few words even for a READ of millions of packets (asked again on every timeout).
    pub(crate) fn hole_end(&self) -> u32 {
        let first_word = (self.resp_pkts / 64) as usize;
        for (i, &bits) in self.resp_seen.iter().enumerate().skip(first_word) {
            let bits = if i == first_word {
                bits & (!0u64 << (self.resp_pkts % 64))
            } else {
                bits
            };
            if bits != 0 {
                return (i as u32 * 64 + bits.trailing_zeros()).min(self.npsn);
            }
        }
        self.npsn
    }

    /// Records READ response packet `k`; advances `resp_pkts` over the received prefix.
    pub(crate) fn resp_mark(&mut self, k: u32) {
        let (word, bit) = ((k / 64) as usize, k % 64);
        if self.resp_seen.len() <= word {
            self.resp_seen.resize(word + 1, 0);
        }
        self.resp_seen[word] |= 1 << bit;
        self.resp_count += 1;
        while self.resp_pkts < self.npsn && self.resp_has(self.resp_pkts) {
            self.resp_pkts += 1;
        }
    }
}

/// The transport state of one queue pair.
#[derive(Debug)]
pub struct QpEngine {
    pub(crate) cfg: QpConfig,
    pub(crate) attr: QpAttr,
    pub(crate) state: QpState,
    pub(crate) rq: VecDeque<RecvWr>,
    pub(crate) sq: VecDeque<SendWqe>,
    pub(crate) req: requester::Requester,
    pub(crate) resp: responder::Responder,
    pub(crate) out: VecDeque<Transmit>,
    pub(crate) cqes: VecDeque<Completion>,
    pub(crate) events: VecDeque<EventType>,
    pub(crate) counters: QpCounters,
    pub(crate) went_to_error: bool,
    /// The driver has posted WQEs for itself: counting the application's WQEs must skip them.
    pub(crate) internal_used: bool,
    /// The send rate limit of a raw packet QP, and when its next frame may go if it is held.
    pub(crate) pacer: Option<crate::pacing::TokenBucket>,
    pub(crate) paced_until: Option<Instant>,
    /// Large payloads of reliable packets may stay in registered memory ([`Transmit::external`]).
    pub(crate) external_payloads: bool,
    /// Positive ACKs are being held: see [`QpEngine::hold_acks`].
    pub(crate) holding_acks: bool,
    /// The newest positive ACK held back: its syndrome, PSN and MSN.
    pub(crate) held_ack: Option<(AethSyndrome, Psn, u32)>,
}

impl QpEngine {
    /// A QP in the RESET state.
    pub fn new(cfg: QpConfig) -> Self {
        Self {
            cfg,
            attr: QpAttr::default(),
            state: QpState::Reset,
            rq: VecDeque::new(),
            sq: VecDeque::new(),
            req: requester::Requester::default(),
            resp: responder::Responder::default(),
            out: VecDeque::new(),
            cqes: VecDeque::new(),
            events: VecDeque::new(),
            counters: QpCounters::default(),
            went_to_error: false,
            internal_used: false,
            pacer: None,
            paced_until: None,
            external_payloads: false,
            holding_acks: false,
            held_ack: None,
        }
    }

    /// Lets the packets of large SEND and WRITE messages and READ responses leave their payload
    /// in registered memory, for a carrier that copies it straight into the receiver's buffer
    /// (the device turns this on while the peer is reached through shared memory). Only
    /// reliable transports do so: their buffers stay in use until acknowledged.
    pub fn set_external_payloads(&mut self, on: bool) {
        self.external_payloads = on && self.cfg.qp_type.is_reliable();
    }

    /// Whether the retransmission timers follow the measured round trip (the default) or
    /// always wait the configured local ACK timeout. A driver turns it off for a carrier that
    /// loses nothing (another QP of this process, shared memory), where an early resend could
    /// only be spurious. The retry budget is counted in configured timeouts either way.
    pub fn set_adaptive_retransmit(&mut self, on: bool) {
        self.req.rec.adaptive = on;
    }

    /// Sets the send rate limit (`None`: unlimited). Only raw packet QPs are shaped.
    pub fn set_rate_limit(&mut self, now: Instant, limit: Option<crate::pacing::RateLimit>) {
        self.pacer = limit.map(|l| crate::pacing::TokenBucket::new(l, now));
        self.paced_until = None;
    }

    /// The configuration.
    pub fn config(&self) -> &QpConfig {
        &self.cfg
    }

    /// The current state as the engine sees it.
    pub fn state(&self) -> QpState {
        self.state
    }

    /// Counters.
    pub fn counters(&self) -> QpCounters {
        self.counters
    }

    /// The requester's congestion window (PSNs it may have unacknowledged) and its current
    /// retransmission timeout, for diagnostics.
    pub fn congestion(&self) -> (u32, Option<Duration>) {
        let rto = ack_timeout(self.attr.timeout).map(|c| self.req.rec.rto(c));
        (self.req.rec.window(), rto)
    }

    /// Whether the send queue is still draining (for `ibv_query_qp` in SQD).
    pub fn sq_draining(&self) -> bool {
        self.has_outstanding()
    }

    /// Whether a started WQE still waits for an acknowledgement or response. WQEs start in
    /// order, so only the started prefix of the queue is looked at.
    pub(crate) fn has_outstanding(&self) -> bool {
        self.sq.iter().take_while(|w| w.started).any(SendWqe::outstanding)
    }

    /// Posted send WQEs of the application not yet completed.
    pub fn send_queue_len(&self) -> usize {
        if self.internal_used {
            self.sq.len() - self.internal_queue_len()
        } else {
            self.sq.len()
        }
    }

    /// Posted receive WQEs not yet consumed (own receive queue only).
    pub fn recv_queue_len(&self) -> usize {
        self.rq.len()
    }

    /// True once after the engine moved the QP to ERR by itself (a transport error); the owner
    /// updates its view of the state.
    pub fn take_error_transition(&mut self) -> bool {
        std::mem::take(&mut self.went_to_error)
    }

    /// Applies new attributes after a validated `modify_qp` from the current state to
    /// `attr.qp_state`.
    pub fn set_attr(&mut self, now: Instant, attr: &QpAttr) {
        let prev = self.state;
        let next = attr.qp_state;
        self.attr = *attr;
        self.state = next;
        match next {
            QpState::Reset => {
                self.rq.clear();
                self.sq.clear();
                self.out.clear();
                self.held_ack = None;
                self.req = requester::Requester::default();
                self.resp = responder::Responder::default();
            }
            QpState::Err if prev != QpState::Err => self.flush(),
            _ => {}
        }
        if next == QpState::Rtr && matches!(prev, QpState::Reset | QpState::Init) {
            self.resp.reset(Psn::new(attr.rq_psn), attr.max_dest_rd_atomic);
        }
        if next == QpState::Rts && prev == QpState::Rtr {
            self.req
                .reset(Psn::new(attr.sq_psn), attr.retry_cnt, attr.rnr_retry);
        }
        if matches!(prev, QpState::Rts | QpState::Sqd) && matches!(next, QpState::Rts | QpState::Sqd) {
            // SQD->RTS and SQD->SQD may change the retry budgets and responder resources; the
            // transport state (PSNs, timers, an RNR wait in progress) carries on untouched.
            self.req.set_budgets(attr.retry_cnt, attr.rnr_retry);
            self.resp.max_resources = usize::from(attr.max_dest_rd_atomic);
        }
        if next == QpState::Sqd && prev == QpState::Rts {
            self.req.drain_notify = attr.en_sqd_async_notify;
            self.check_drained();
        }
        let _ = now;
    }

    /// Queues a receive WQE (own receive queue). In ERR it completes at once as flushed.
    pub fn post_recv(&mut self, wr: RecvWr) {
        if self.state == QpState::Err {
            self.push_cqe(
                WorkQueue::Recv,
                WorkCompletion::error(wr.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, self.cfg.qpn),
            );
        } else {
            self.rq.push_back(wr);
        }
    }

    /// Queues a send WQE, already checked by [`SendWr::check`]. In ERR it completes at once as
    /// flushed.
    pub fn post_send(&mut self, wr: SendWr) {
        if self.state == QpState::Err {
            let wc = WorkCompletion::error(wr.wr_id, WcStatus::WrFlushErr, wr.op.wc_opcode(), self.cfg.qpn);
            self.push_cqe(WorkQueue::Send, wc);
            return;
        }
        self.sq.push_back(SendWqe::new(wr));
    }

    /// Queues a send WQE the driver posts for itself (an RDMA READ or SEND of an offload such
    /// as tag matching): it takes no slot of the application's send queue and completes, signaled
    /// or not, to [`WorkQueue::Internal`]. In ERR it completes at once as flushed.
    pub fn post_internal(&mut self, wr: SendWr) {
        if self.state == QpState::Err {
            let wc = WorkCompletion::error(wr.wr_id, WcStatus::WrFlushErr, wr.op.wc_opcode(), self.cfg.qpn);
            self.push_cqe(WorkQueue::Internal, wc);
            return;
        }
        let mut w = SendWqe::new(wr);
        w.internal = true;
        self.internal_used = true;
        self.sq.push_back(w);
    }

    /// Send WQEs the driver posted for itself and that have not completed.
    pub fn internal_queue_len(&self) -> usize {
        self.sq.iter().filter(|w| w.internal).count()
    }

    /// Processes one received packet addressed to this QP. Returns why it was dropped, if it
    /// was.
    pub fn handle_packet(
        &mut self,
        now: Instant,
        pkt: &ParsedPacket<'_>,
        meta: &RxMeta,
        mem: &dyn Memory,
        srq: Option<&mut dyn RecvSource>,
    ) -> Result<(), DropReason> {
        self.handle_rx(now, &Rx::new(pkt), meta, mem, srq)
    }

    /// [`QpEngine::handle_packet`] for a packet whose payload may have been left in the
    /// sender's memory ([`Rx::external`]).
    pub fn handle_rx(
        &mut self,
        now: Instant,
        pkt: &Rx<'_>,
        meta: &RxMeta,
        mem: &dyn Memory,
        srq: Option<&mut dyn RecvSource>,
    ) -> Result<(), DropReason> {
        let result = if pkt.opcode().is_response() {
            self.handle_response(now, pkt, mem)
        } else {
            self.handle_request(now, pkt, meta, mem, srq)
        };
        if result.is_err() {
            self.counters.rx_dropped += 1;
        }
        result
    }

    /// Produces the next packet to send, if any. Sending may need memory (to gather payload).
    pub fn poll_transmit(&mut self, now: Instant, mem: &dyn Memory) -> Option<Transmit> {
        if self.out.is_empty() {
            self.generate(now, mem);
        }
        self.out.pop_front()
    }

    /// Until [`QpEngine::release_acks`], a positive ACK the responder decides on replaces the
    /// one held before it instead of going out: a device that hands the QP several received
    /// packets in a row calls this first, and one ACK then answers them all (ACKs are
    /// cumulative, and a responder may coalesce them). Anything else the QP sends (a NAK, a
    /// response, a request) lets the held ACK out first, so the order of what leaves is
    /// unchanged.
    pub fn hold_acks(&mut self) {
        self.holding_acks = true;
    }

    /// Ends [`QpEngine::hold_acks`]: the held ACK, if any, is queued for
    /// [`QpEngine::poll_transmit`].
    pub fn release_acks(&mut self) {
        self.holding_acks = false;
        self.flush_held_ack();
    }

    /// Whether a positive ACK is held back (see [`QpEngine::hold_acks`]).
    pub fn holds_ack(&self) -> bool {
        self.held_ack.is_some()
    }

    /// Queues a packet to send, behind the held ACK if there is one.
    pub(crate) fn push_out(&mut self, tx: Transmit) {
        self.flush_held_ack();
        self.out.push_back(tx);
    }

    fn flush_held_ack(&mut self) {
        if let Some((syndrome, psn, msn)) = self.held_ack.take() {
            self.queue_ack(syndrome, psn, msn);
        }
    }

    /// The next completion, if any.
    pub fn poll_completion(&mut self) -> Option<Completion> {
        self.cqes.pop_front()
    }

    /// The next async event, if any.
    pub fn poll_event(&mut self) -> Option<EventType> {
        self.events.pop_front()
    }

    /// When [`QpEngine::handle_timeout`] must next be called.
    pub fn poll_timeout(&self) -> Option<Instant> {
        [
            self.req.retransmit_at,
            self.req.probe_at,
            self.req.probe_nak.map(|(_, at)| at),
            self.req.hole_at,
            self.req.rnr_until,
            self.paced_until,
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Whether the requester could send now (something to send and room in the window).
    pub fn wants_to_send(&self) -> bool {
        !self.out.is_empty() || self.can_start_or_continue()
    }

    pub(crate) fn push_cqe(&mut self, queue: WorkQueue, wc: WorkCompletion) {
        self.cqes.push_back(Completion { queue, wc });
    }

    /// Moves the QP to ERR from inside the engine, flushing everything.
    pub(crate) fn enter_error(&mut self) {
        if self.state != QpState::Err {
            self.state = QpState::Err;
            self.attr.qp_state = QpState::Err;
            self.went_to_error = true;
            self.flush();
        }
    }

    /// Completes every outstanding WQE with `IBV_WC_WR_FLUSH_ERR`, signaled or not, in posting
    /// order. A WQE that failed completes with its own status instead; WQEs whose response had
    /// already arrived but which were still waiting for an earlier WQE are flushed too (send
    /// completions are returned in order, so they cannot complete successfully any more).
    fn flush(&mut self) {
        self.out.clear();
        self.held_ack = None;
        self.req.retransmit_at = None;
        self.req.probe_at = None;
        self.req.probe = None;
        self.req.probe_nak = None;
        self.req.hole_at = None;
        self.req.resend_hole = None;
        self.req.rnr_until = None;
        let qpn = self.cfg.qpn;
        for w in std::mem::take(&mut self.sq) {
            let status = w.failed.unwrap_or(WcStatus::WrFlushErr);
            let wc = WorkCompletion::error(w.wr.wr_id, status, w.wr.op.wc_opcode(), qpn);
            let queue = if w.internal {
                WorkQueue::Internal
            } else {
                WorkQueue::Send
            };
            self.push_cqe(queue, wc);
        }
        self.req.send_idx = 0;
        self.req.outstanding_rd = 0;
        self.req.rereq_pending = 0;
        if let Some(p) = self.resp.take_in_progress_wqe() {
            let wc = p.completion(WcStatus::WrFlushErr, WcFlags::empty(), qpn, 0);
            self.push_cqe(p.queue, wc);
        }
        for r in std::mem::take(&mut self.rq) {
            self.push_cqe(
                WorkQueue::Recv,
                WorkCompletion::error(r.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, qpn),
            );
        }
        if self.cfg.has_srq {
            // No receive of this QP will consume SRQ WQEs any more.
            self.events.push_back(EventType::QpLastWqeReached);
        }
    }

    /// In SQD, raises `IBV_EVENT_SQ_DRAINED` once nothing started is outstanding.
    pub(crate) fn check_drained(&mut self) {
        if self.state == QpState::Sqd && self.req.drain_notify && !self.sq_draining() {
            self.req.drain_notify = false;
            self.events.push_back(EventType::SqDrained);
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::SendWqe;
    use crate::types::{SendFlags, Sge};
    use crate::wr::{Payload, RemoteAddr, SendOp, SendWr};

    fn read(npsn: u32) -> SendWqe {
        let mut w = SendWqe::new(SendWr {
            wr_id: 1,
            op: SendOp::Read {
                remote: RemoteAddr::default(),
            },
            flags: SendFlags::SIGNALED,
            payload: Payload::Sges(vec![Sge::default()]),
            ud: None,
            xrc_srqn: None,
        });
        w.started = true;
        w.npsn = npsn;
        w
    }

    proptest! {
        /// `hole_end` is the first received packet at or after `resp_pkts`, as a scan of every
        /// packet finds it.
        #[test]
        fn hole_end_is_the_first_received_packet_after_the_hole(
            npsn in 1u32..400,
            got in proptest::collection::vec(0u32..400, 0..40),
        ) {
            let mut w = read(npsn);
            for k in got.into_iter().filter(|&k| k < npsn) {
                if !w.resp_has(k) {
                    w.resp_mark(k);
                }
            }
            let scan = (w.resp_pkts..w.npsn).find(|&k| w.resp_has(k)).unwrap_or(w.npsn);
            prop_assert_eq!(w.hole_end(), scan);
        }
    }

    /// A READ of 2^23 packets with one response received past the hole: the end of the hole
    /// is found from the bitmap's few words.
    #[test]
    fn hole_end_of_a_huge_read() {
        let mut w = read(1 << 23);
        assert_eq!(w.hole_end(), 1 << 23);
        w.resp_mark(200);
        assert_eq!(w.hole_end(), 200);
        w.resp_mark(0);
        assert_eq!((w.resp_pkts, w.hole_end()), (1, 200));
    }
}
