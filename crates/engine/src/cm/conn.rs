//! One connection's protocol state.

use std::collections::VecDeque;
use std::time::Duration;

use softverbs_wire::cm::{private_data_len, CmMessage, DrepRepr, DreqRepr};
use softverbs_wire::mad::MAD_LEN;

use super::{encode, CmTransmit};
use crate::time::Instant;
use crate::types::Gid;

/// Which side of the connection this engine is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Role {
    /// Sent the REQ.
    Active,
    /// Received the REQ.
    Passive,
}

/// The IB CM states this engine goes through (IBTA Vol. 1 ch. 12.9, without LAP/APR).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum State {
    /// Active: REQ sent, waiting for the REP.
    ReqSent,
    /// Passive: REQ reported, waiting for the application.
    ReqRcvd,
    /// Passive: REP sent, waiting for the RTU.
    RepSent,
    /// Active: REP reported, waiting for the application to establish.
    RepRcvd,
    /// Both: connected.
    Established,
    /// DREQ sent, waiting for the DREP.
    DreqSent,
    /// DREQ received and reported, waiting for the application to disconnect.
    DreqRcvd,
    /// Disconnected; waiting out stray packets of the old connection.
    TimeWait,
    /// Rejected or given up; the REJ is kept to answer retries, with no more events.
    Rejected,
}

/// A message sent with retries.
#[derive(Debug, Clone)]
pub(super) struct Retry {
    pub(super) mad: [u8; MAD_LEN],
    pub(super) deadline: Instant,
    pub(super) timeout: Duration,
    pub(super) retries_left: u8,
}

/// One connection.
#[derive(Debug, Clone)]
pub(super) struct Conn {
    pub(super) role: Role,
    pub(super) state: State,
    pub(super) id: u32,
    pub(super) dest: Gid,
    /// The transaction ID of the exchange: the REQ's, which the REP, MRA, RTU and REJ of
    /// either side carry (as Linux sends them).
    pub(super) tid: u64,
    /// The transaction ID of this side's DREQ (a new one for the passive side).
    pub(super) dreq_tid: u64,
    /// The transaction ID of the DREP: the peer's DREQ's.
    pub(super) drep_tid: u64,
    pub(super) remote_comm_id: u32,
    pub(super) remote_ca_guid: u64,
    pub(super) remote_qpn: u32,
    pub(super) local_qpn: u32,
    /// Wait for a reply to a REQ, REP or DREQ before resending.
    pub(super) timeout: Duration,
    pub(super) max_retries: u8,
    /// Length of timewait.
    pub(super) timewait: Duration,
    /// How long a REJ is kept to answer retries.
    pub(super) reject_keep: Duration,
    pub(super) retry: Option<Retry>,
    /// End of timewait or of the rejected state.
    pub(super) timer: Option<Instant>,
    /// The last reply sent without retries (MRA, RTU, REJ), resent for duplicates.
    pub(super) stored: Option<[u8; MAD_LEN]>,
    /// The application destroyed its ID: no more events.
    pub(super) detached: bool,
}

impl Conn {
    pub(super) fn new(role: Role, id: u32, dest: Gid, tid: u64, timeout: Duration, max_retries: u8) -> Self {
        Self {
            role,
            state: State::ReqSent,
            id,
            dest,
            tid,
            dreq_tid: tid,
            drep_tid: tid,
            remote_comm_id: 0,
            remote_ca_guid: 0,
            remote_qpn: 0,
            local_qpn: 0,
            timeout,
            max_retries,
            timewait: Duration::from_millis(1),
            reject_keep: timeout * (u32::from(max_retries) + 1),
            retry: None,
            timer: None,
            stored: None,
            detached: false,
        }
    }

    /// When this connection needs `handle_timeout`.
    pub(super) fn deadline(&self) -> Option<Instant> {
        match &self.retry {
            Some(r) => Some(r.deadline),
            None => self.timer,
        }
    }

    /// Sends `mad` now and again after each timeout until answered or out of retries.
    pub(super) fn send_with_retry(
        &mut self,
        now: Instant,
        mad: [u8; MAD_LEN],
        out: &mut VecDeque<CmTransmit>,
    ) {
        out.push_back(CmTransmit { dest: self.dest, mad });
        self.stored = None;
        self.retry = Some(Retry {
            mad,
            deadline: now + self.timeout,
            timeout: self.timeout,
            retries_left: self.max_retries,
        });
    }

    /// Sends a reply once and keeps it to answer duplicates.
    pub(super) fn send_reply(&mut self, mad: [u8; MAD_LEN], out: &mut VecDeque<CmTransmit>) {
        out.push_back(CmTransmit { dest: self.dest, mad });
        self.stored = Some(mad);
    }

    pub(super) fn send_dreq(
        &mut self,
        now: Instant,
        private_data: [u8; private_data_len::DREQ],
        out: &mut VecDeque<CmTransmit>,
    ) {
        let dreq = DreqRepr {
            local_comm_id: self.id,
            remote_comm_id: self.remote_comm_id,
            remote_qpn: self.remote_qpn,
            private_data,
        };
        let mad = encode(&CmMessage::Dreq(dreq), self.dreq_tid);
        self.state = State::DreqSent;
        // A DREQ is retried as often as the REQ was allowed to be.
        self.send_with_retry(now, mad, out);
    }

    pub(super) fn send_drep(&mut self, out: &mut VecDeque<CmTransmit>) {
        let drep = DrepRepr {
            local_comm_id: self.id,
            remote_comm_id: self.remote_comm_id,
            private_data: [0; private_data_len::DREP],
        };
        let mad = encode(&CmMessage::Drep(drep), self.drep_tid);
        out.push_back(CmTransmit { dest: self.dest, mad });
    }

    pub(super) fn enter_timewait(&mut self, now: Instant) {
        self.retry = None;
        self.stored = None;
        self.state = State::TimeWait;
        self.timer = Some(now + self.timewait);
    }

    pub(super) fn enter_rejected(&mut self, now: Instant) {
        self.retry = None;
        self.state = State::Rejected;
        self.timer = Some(now + self.reject_keep);
    }
}

/// A SIDR_REQ this side sent.
#[derive(Debug, Clone)]
pub(super) struct PendingSidr {
    pub(super) dest: Gid,
    pub(super) mad: [u8; MAD_LEN],
    pub(super) deadline: Instant,
    pub(super) timeout: Duration,
    pub(super) retries_left: u8,
}

/// A SIDR_REQ this side received: waiting for the application, then its reply kept a while.
#[derive(Debug, Clone)]
pub(super) struct ServedSidr {
    pub(super) service_id: u64,
    pub(super) tid: u64,
    pub(super) reply: Option<[u8; MAD_LEN]>,
    pub(super) expires: Instant,
}
