//! Tag-matching SRQs (`IBV_SRQT_TM`, rdma-core `Documentation/tag_matching.md`), done by the
//! device as a ConnectX HCA does them.
//!
//! * An SRQ of this type has its own CQ, which receives every completion of the QPs attached
//!   to it and of its tag-list operations ([`Srq::post_ops`]).
//! * An incoming RC SEND is classified by its TMH ([`Srq`]'s `take_send`): an eager message that
//!   matches a tag ([`TagMatcher`]) lands in the tag's buffer without its header; a tagged
//!   message that matches none is *unexpected* and goes whole to an ordinary SRQ buffer as
//!   `IBV_WC_RECV` (as `tag_matching.md` says; mlx5 reports `IBV_WC_TM_RECV` without flags),
//!   with the TMH's tag in its `tm_info` and `IBV_WC_TM_SYNC_REQ`, and counts towards the
//!   phase; `NO_TAG` messages go whole to an ordinary buffer as `IBV_WC_TM_NO_TAG`; FIN
//!   messages and messages without a valid TMH are plain receives.
//! * A matched rendezvous request makes the device READ the sender's buffer (the RVH's va,
//!   rkey, len) into the tag's buffer, on the send queue of the QP the request arrived on, then
//!   send the FIN message back; the tag completes `IBV_WC_TM_MATCH` when the request has
//!   arrived and `IBV_WC_TM_DATA_VALID` once the READ is done. When the buffer is too small, or
//!   the QP cannot READ (not in RTS, or `max_rd_atomic` 0), the request's headers are placed in
//!   the buffer and the tag completes with `IBV_WC_TM_RNDV_INCOMPLETE`, for software to finish.
//! * A tag-list operation stays outstanding until a completion of it, or of a later
//!   operation, has been polled, as on hardware; at most `max_ops` are outstanding.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use softverbs_engine::tm::{
    Lookup, OpsFlags, SrqOp, SrqOpKind, TagMatcher, TmCap, TmCapFlags, TmCaps, TmInfo,
};
use softverbs_engine::transport::{QpEngine, RecvPlacement, RecvSource, WorkQueue};
use softverbs_engine::types::{
    QpAttr, QpState, RecvWr, SendFlags, Sge, SrqAttr, WcFlags, WcOpcode, WcStatus, WorkCompletion,
};
use softverbs_engine::wr::{Payload, RemoteAddr, SendOp, SendWr};
use softverbs_engine::{Error, Result};
use softverbs_wire::tm::{TmHeaders, TmhOpcode, RVH_LEN, TMH_LEN};

use crate::cq::Cq;
use crate::device::Device;
use crate::pd::Pd;
use crate::qp::{PostError, Srq};

/// Largest rendezvous request (TMH, RVH and metadata) the device reads headers from.
pub const MAX_RNDV_HDR_SIZE: u32 = 64;
/// Largest tag list of one SRQ.
pub const MAX_NUM_TAGS: u32 = 4096;

impl Device {
    /// The tag-matching capabilities (`ibv_device_attr_ex.tm_caps`).
    pub fn tm_caps(&self) -> TmCaps {
        let l = self.limits();
        TmCaps {
            max_rndv_hdr_size: MAX_RNDV_HDR_SIZE,
            max_num_tags: MAX_NUM_TAGS,
            flags: TmCapFlags::RC,
            max_ops: l.max_qp_wr,
            max_sge: l.max_srq_sge,
        }
    }
}

/// A tagged buffer.
#[derive(Debug, Clone)]
pub(crate) struct TagBuf {
    recv_wr_id: u64,
    sg_list: Vec<Sge>,
    len: u64,
}

/// What never changes about a tag-matching SRQ.
#[derive(Debug)]
pub(crate) struct TmShared {
    pub(crate) cq: Arc<Cq>,
    cap: TmCap,
    max_sge: u32,
    /// Tag-list operations whose completion (or a later one's) has been polled.
    reaped: Arc<AtomicU64>,
}

/// The tag list, phase and operation count, under the SRQ's lock.
#[derive(Debug)]
pub(crate) struct TmState {
    matcher: TagMatcher<TagBuf>,
    posted: u64,
}

impl Srq {
    /// `ibv_create_srq_ex` with `IBV_SRQT_TM`: an SRQ with a tag list of
    /// `tm.max_num_tags` entries and at most `tm.max_ops` outstanding operations, reporting to
    /// `cq`. Each must be between 1 and the device's [`TmCaps`] (EINVAL).
    pub fn create_tm(pd: &Arc<Pd>, attr: &SrqAttr, cq: &Arc<Cq>, tm: TmCap) -> Result<Arc<Self>> {
        let ctx = pd.context();
        if !Arc::ptr_eq(cq.context(), ctx) {
            return Err(Error::invalid("the CQ belongs to another context"));
        }
        let caps = ctx.device().tm_caps();
        if tm.max_num_tags == 0 || tm.max_num_tags > caps.max_num_tags {
            return Err(Error::invalid(format!(
                "tm_cap.max_num_tags {} is outside 1..={}",
                tm.max_num_tags, caps.max_num_tags
            )));
        }
        if tm.max_ops == 0 || tm.max_ops > caps.max_ops {
            return Err(Error::invalid(format!(
                "tm_cap.max_ops {} is outside 1..={}",
                tm.max_ops, caps.max_ops
            )));
        }
        cq.uses().acquire("cq")?;
        let shared = TmShared {
            cq: cq.clone(),
            cap: tm,
            max_sge: caps.max_sge,
            reaped: Arc::new(AtomicU64::new(0)),
        };
        let state = TmState {
            matcher: TagMatcher::new(tm.max_num_tags),
            posted: 0,
        };
        Self::create_with(pd, attr, Some((shared, state))).inspect_err(|_| cq.uses().release())
    }

    /// Whether this is a tag-matching SRQ.
    pub fn is_tm(&self) -> bool {
        self.tm_shared().is_some()
    }

    /// The CQ of a tag-matching SRQ.
    pub fn tm_cq(&self) -> Option<&Arc<Cq>> {
        self.tm_shared().map(|t| &t.cq)
    }

    /// The `tm_cap` of a tag-matching SRQ.
    pub fn tm_cap(&self) -> Option<TmCap> {
        self.tm_shared().map(|t| t.cap)
    }

    /// Entries in the tag list (0 for other SRQs).
    pub fn tm_tags(&self) -> usize {
        self.with_queue(|_, tm| tm.map_or(0, |t| t.matcher.len()))
    }

    /// Tag-list operations posted and not yet reaped.
    pub fn tm_outstanding_ops(&self) -> u64 {
        let reaped = self.tm_shared().map_or(0, |t| t.reaped.load(Ordering::Acquire));
        self.with_queue(|_, tm| tm.map_or(0, |t| t.posted - reaped))
    }

    /// `ibv_post_srq_ops`: performs tag-list operations in order, stopping at the first that
    /// cannot be posted. Returns the handle of each `IBV_WR_TAG_ADD` performed (0 for the other
    /// operations), and the error of the first refused one: EINVAL on an SRQ that is not
    /// tag-matching, for too many SGEs or a handle outside the list; ENOMEM when `max_ops`
    /// operations are outstanding or the tag list is full.
    pub fn post_ops(&self, ops: &[SrqOp]) -> (Vec<u32>, Result<(), PostError>) {
        let mut handles = Vec::new();
        let Some(shared) = self.tm_shared() else {
            let error = Error::invalid("the SRQ is not a tag-matching SRQ");
            return (handles, Err(PostError { index: 0, error }));
        };
        let mut completions = Vec::new();
        let result = self.with_queue(|_, tm| {
            let tm = tm.expect("a tag-matching SRQ has its state");
            for (index, op) in ops.iter().enumerate() {
                let fail = |error| Err(PostError { index, error });
                if OpsFlags::from_bits(op.flags.bits()).is_none() {
                    return fail(Error::invalid("unknown ibv_ops_flags"));
                }
                let reaped = shared.reaped.load(Ordering::Acquire);
                if tm.posted - reaped >= u64::from(shared.cap.max_ops) {
                    return fail(Error::no_resources(format!(
                        "{} tag-list operations are outstanding (max_ops)",
                        shared.cap.max_ops
                    )));
                }
                let sync = op.flags.contains(OpsFlags::TM_SYNC).then_some(op.unexpected_cnt);
                let (opcode, status, sync_req, handle) = match &op.kind {
                    SrqOpKind::Add {
                        recv_wr_id,
                        sg_list,
                        tag,
                        mask,
                    } => {
                        if sg_list.len() > shared.max_sge as usize {
                            return fail(Error::invalid(format!(
                                "num_sge {} exceeds the tag-matching max_sge {}",
                                sg_list.len(),
                                shared.max_sge
                            )));
                        }
                        let buf = TagBuf {
                            recv_wr_id: *recv_wr_id,
                            sg_list: sg_list.clone(),
                            len: sg_list.iter().map(|s| u64::from(s.length)).sum(),
                        };
                        match tm.matcher.add(*tag, *mask, buf, sync) {
                            Ok((h, req)) => (WcOpcode::TmAdd, WcStatus::Success, req, h),
                            Err(full) => return fail(Error::no_resources(full.to_string())),
                        }
                    }
                    SrqOpKind::Del { handle } => {
                        if *handle >= shared.cap.max_num_tags {
                            return fail(Error::invalid(format!(
                                "handle {handle} is outside the tag list of {}",
                                shared.cap.max_num_tags
                            )));
                        }
                        let (found, req) = tm.matcher.remove(*handle, sync);
                        // Consumed by a message meanwhile (or never added).
                        let status = if found.is_some() {
                            WcStatus::Success
                        } else {
                            WcStatus::TmErr
                        };
                        (WcOpcode::TmDel, status, req, 0)
                    }
                    SrqOpKind::Sync => {
                        let req = match sync {
                            Some(c) => tm.matcher.sync(c),
                            None => tm.matcher.sync_required(),
                        };
                        (WcOpcode::TmSync, WcStatus::Success, req, 0)
                    }
                };
                tm.posted += 1;
                handles.push(handle);
                // As on hardware, only signaled operations complete, even when they fail.
                if op.flags.contains(OpsFlags::SIGNALED) {
                    let mut wc = WorkCompletion::error(op.wr_id, status, opcode, 0);
                    if sync_req {
                        wc.wc_flags = WcFlags::TM_SYNC_REQ;
                    }
                    completions.push((wc, tm.posted));
                }
            }
            Ok(())
        });
        for (wc, through) in completions {
            // An overrun CQ is in error and has raised IBV_EVENT_CQ_ERR; the operation is done.
            let _ = shared.cq.push_with_release(wc, &shared.reaped, through);
        }
        (handles, result)
    }

    /// Chooses the receive of an incoming SEND on a tag-matching SRQ from its first packet.
    fn tm_take_send(
        &self,
        first: &[u8],
        only: bool,
        qp: &mut QpRendezvous,
        can_read: bool,
    ) -> Option<RecvPlacement> {
        let headers = TmHeaders::parse(first).ok();
        self.with_queue(|queue, tm| {
            let tm = tm.expect("a tag-matching SRQ has its state");
            let Some(h) = headers else {
                return queue.pop_front().map(RecvPlacement::plain);
            };
            let info = TmInfo {
                tag: h.tmh.tag,
                priv_data: h.tmh.app_ctx,
            };
            let plain = |queue: &mut VecDeque<RecvWr>, opcode| {
                let mut p = RecvPlacement::plain(queue.pop_front()?);
                p.opcode = opcode;
                p.tm_info = info;
                Some(p)
            };
            match h.tmh.opcode {
                TmhOpcode::NoTag => return plain(queue, WcOpcode::TmNoTag),
                TmhOpcode::Fin => return plain(queue, WcOpcode::Recv),
                TmhOpcode::Eager | TmhOpcode::Rndv => {}
            }
            let handle = match tm.matcher.lookup(h.tmh.tag) {
                Lookup::Match(handle) => handle,
                Lookup::Unexpected => {
                    // Counted only once a buffer takes it: an RNR NAK leaves no trace.
                    let mut p = plain(queue, WcOpcode::Recv)?;
                    tm.matcher.note_unexpected();
                    p.flags = WcFlags::TM_SYNC_REQ;
                    return Some(p);
                }
            };
            let buf = tm.matcher.take(handle).expect("a matched handle is live");
            let wqe = RecvWr {
                wr_id: buf.recv_wr_id,
                sg_list: buf.sg_list.clone(),
            };
            let mut p = RecvPlacement::plain(wqe);
            p.opcode = WcOpcode::TmRecv;
            p.tm_info = info;
            let (TmhOpcode::Rndv, Some(rvh)) = (h.tmh.opcode, h.rvh) else {
                // Eager: the data without its header; a match spanning packets is reported at
                // once and its data at the end.
                p.skip = TMH_LEN as u64;
                if only {
                    p.flags = WcFlags::TM_MATCH | WcFlags::TM_DATA_VALID;
                } else {
                    p.early_flags = Some(WcFlags::TM_MATCH);
                    p.flags = WcFlags::TM_DATA_VALID;
                }
                return Some(p);
            };
            if u64::from(rvh.len) > buf.len || !can_read {
                // Software finishes it from the headers.
                p.limit = Some(buf.len);
                p.status = WcStatus::TmRndvIncomplete;
                p.flags = WcFlags::TM_MATCH | WcFlags::TM_DATA_VALID;
                return Some(p);
            }
            let key = qp.insert(Rendezvous {
                buf,
                headers: h,
                info,
            });
            // The request itself lands nowhere; its end comes back to the QP, which READs.
            p.wqe = RecvWr {
                wr_id: stage_id(key, Stage::Request),
                sg_list: Vec::new(),
            };
            p.limit = Some(0);
            p.queue = WorkQueue::Internal;
            p.flags = WcFlags::TM_MATCH;
            Some(p)
        })
    }
}

/// The receive side of a QP attached to a tag-matching SRQ, for the engine.
pub(crate) struct TmRecv<'a> {
    pub(crate) srq: &'a Srq,
    pub(crate) rndv: &'a mut QpRendezvous,
    pub(crate) can_read: bool,
}

impl RecvSource for TmRecv<'_> {
    fn take(&mut self) -> Option<RecvWr> {
        self.srq.take()
    }

    fn put_back(&mut self, wr: RecvWr) {
        self.srq.put_back(wr);
    }

    fn take_send(&mut self, first: &[u8], only: bool) -> Option<RecvPlacement> {
        self.srq.tm_take_send(first, only, self.rndv, self.can_read)
    }
}

/// Whether a QP in this state, with these attributes, can READ for a rendezvous.
pub(crate) fn can_read(attr: &QpAttr) -> bool {
    attr.qp_state == QpState::Rts && attr.max_rd_atomic > 0
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// The whole request arrived.
    Request = 0,
    /// The READ of the data completed.
    Read = 1,
    /// The FIN message completed.
    Fin = 2,
}

fn stage_id(key: u64, stage: Stage) -> u64 {
    key << 2 | stage as u64
}

/// A matched rendezvous request in progress.
#[derive(Debug)]
struct Rendezvous {
    buf: TagBuf,
    headers: TmHeaders,
    info: TmInfo,
}

/// The rendezvous transfers a QP performs for its tag-matching SRQ.
#[derive(Debug, Default)]
pub(crate) struct QpRendezvous {
    next: u64,
    pending: HashMap<u64, Rendezvous>,
}

impl QpRendezvous {
    fn insert(&mut self, r: Rendezvous) -> u64 {
        let key = self.next;
        self.next += 1;
        self.pending.insert(key, r);
        key
    }

    /// Handles a completion the engine handed back ([`WorkQueue::Internal`]): posts the READ
    /// when a request has arrived, the FIN when the READ is done. Returns the tag's receive
    /// completions, and whether it posted work.
    pub(crate) fn on_internal(
        &mut self,
        engine: &mut QpEngine,
        wc: &WorkCompletion,
        qpn: u32,
        src_qp: u32,
    ) -> (Vec<WorkCompletion>, bool) {
        let mut out = Vec::new();
        let posted = self.step(engine, wc, qpn, src_qp, &mut out);
        (out, posted)
    }

    fn step(
        &mut self,
        engine: &mut QpEngine,
        wc: &WorkCompletion,
        qpn: u32,
        src_qp: u32,
        out: &mut Vec<WorkCompletion>,
    ) -> bool {
        let key = wc.wr_id >> 2;
        let stage = match wc.wr_id & 3 {
            0 => Stage::Request,
            1 => Stage::Read,
            _ => Stage::Fin,
        };
        let tag_wc = |r: &Rendezvous, status, flags, byte_len| {
            let mut c = WorkCompletion::error(r.buf.recv_wr_id, status, WcOpcode::TmRecv, qpn);
            c.wc_flags = flags;
            c.byte_len = byte_len;
            c.src_qp = src_qp;
            c.tm_info = r.info;
            c
        };
        match stage {
            Stage::Fin => false,
            Stage::Request => {
                let Some(r) = self.pending.get(&key) else {
                    return false;
                };
                if wc.status != WcStatus::Success {
                    let r = self.pending.remove(&key).expect("present");
                    out.push(tag_wc(&r, wc.status, WcFlags::empty(), 0));
                    return false;
                }
                out.push(tag_wc(r, WcStatus::Success, WcFlags::TM_MATCH, 0));
                let rvh = r.headers.rvh.expect("a rendezvous request has an RVH");
                if rvh.len == 0 {
                    let r = self.pending.remove(&key).expect("present");
                    post_fin(engine, key, &r.headers);
                    out.push(tag_wc(&r, WcStatus::Success, WcFlags::TM_DATA_VALID, 0));
                    return true;
                }
                engine.post_internal(SendWr {
                    wr_id: stage_id(key, Stage::Read),
                    op: SendOp::Read {
                        remote: RemoteAddr {
                            addr: rvh.va,
                            rkey: rvh.rkey,
                        },
                    },
                    flags: SendFlags::SIGNALED,
                    payload: Payload::Sges(truncate(&r.buf.sg_list, u64::from(rvh.len))),
                    ud: None,
                    xrc_srqn: None,
                });
                true
            }
            Stage::Read => {
                let Some(r) = self.pending.remove(&key) else {
                    return false;
                };
                if wc.status != WcStatus::Success {
                    out.push(tag_wc(&r, wc.status, WcFlags::empty(), 0));
                    return false;
                }
                post_fin(engine, key, &r.headers);
                let len = r.headers.rvh.map_or(0, |v| v.len);
                out.push(tag_wc(&r, WcStatus::Success, WcFlags::TM_DATA_VALID, len));
                true
            }
        }
    }

    /// Completes every transfer in progress as flushed (the QP was reset, so the engine
    /// forgot its work).
    pub(crate) fn flush(&mut self, cq: &Cq, qpn: u32) {
        for (_, r) in self.pending.drain() {
            let mut c = WorkCompletion::error(r.buf.recv_wr_id, WcStatus::WrFlushErr, WcOpcode::TmRecv, qpn);
            c.tm_info = r.info;
            let _ = cq.push(c);
        }
    }
}

/// Sends the FIN message: the request's TMH and RVH with the FIN opcode.
fn post_fin(engine: &mut QpEngine, key: u64, request: &TmHeaders) {
    let mut fin = *request;
    fin.tmh.opcode = TmhOpcode::Fin;
    let mut bytes = vec![0u8; TMH_LEN + RVH_LEN];
    fin.emit(&mut bytes).expect("sized for TMH and RVH");
    engine.post_internal(SendWr {
        wr_id: stage_id(key, Stage::Fin),
        op: SendOp::Send {
            imm: None,
            invalidate: None,
        },
        flags: SendFlags::SIGNALED,
        payload: Payload::Inline(bytes),
        ud: None,
        xrc_srqn: None,
    });
}

/// The first `len` bytes of a scatter list.
fn truncate(sg: &[Sge], mut len: u64) -> Vec<Sge> {
    let mut out = Vec::new();
    for s in sg {
        if len == 0 {
            break;
        }
        let take = u64::from(s.length).min(len);
        out.push(Sge {
            length: take as u32,
            ..*s
        });
        len -= take;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncating_scatter_lists() {
        let sg = [
            Sge {
                addr: 0x1000,
                length: 10,
                lkey: 1,
            },
            Sge {
                addr: 0x2000,
                length: 10,
                lkey: 2,
            },
        ];
        let t = truncate(&sg, 15);
        assert_eq!(t.len(), 2);
        assert_eq!((t[0].length, t[1].length, t[1].addr), (10, 5, 0x2000));
        assert_eq!(truncate(&sg, 10).len(), 1);
        assert!(truncate(&sg, 0).is_empty());
    }

    #[test]
    fn stage_ids_round_trip() {
        for (k, s) in [(0, Stage::Request), (7, Stage::Read), (u64::MAX >> 2, Stage::Fin)] {
            let id = stage_id(k, s);
            assert_eq!(id >> 2, k);
            assert_eq!(id & 3, s as u64);
        }
    }
}
