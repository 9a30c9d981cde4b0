//! Send work requests as the engine executes them, validated by [`SendWr::check`].

use crate::error::{Error, Result};
use crate::mw::MwBind;
use crate::types::{Gid, QpType, SendFlags, Sge, WcOpcode, WrOpcode};

/// Where a remote operation points.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RemoteAddr {
    /// Remote virtual address.
    pub addr: u64,
    /// Remote key.
    pub rkey: u32,
}

/// The operation of a send work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    /// SEND, optionally with immediate data or an R_Key to invalidate.
    Send {
        /// Immediate data (network byte order, as `ibv_send_wr.imm_data`).
        imm: Option<u32>,
        /// R_Key the responder invalidates.
        invalidate: Option<u32>,
    },
    /// RDMA WRITE, optionally with immediate data.
    Write {
        /// Target.
        remote: RemoteAddr,
        /// Immediate data (network byte order).
        imm: Option<u32>,
    },
    /// RDMA READ.
    Read {
        /// Source.
        remote: RemoteAddr,
    },
    /// Atomic compare and swap.
    CompareSwap {
        /// Target word.
        remote: RemoteAddr,
        /// Expected value.
        compare: u64,
        /// New value.
        swap: u64,
    },
    /// Atomic fetch and add.
    FetchAdd {
        /// Target word.
        remote: RemoteAddr,
        /// Addend.
        add: u64,
    },
    /// Bind a memory window (`IBV_WR_BIND_MW`; `ibv_bind_mw` posts one for type 1 windows).
    /// Executed locally, in send-queue order; it sends nothing.
    BindMw(MwBind),
    /// Invalidate the type 2 window named by `rkey` (`IBV_WR_LOCAL_INV`). Executed locally, in
    /// send-queue order.
    LocalInv {
        /// The window's current rkey.
        rkey: u32,
    },
    /// TCP segmentation offload (raw packet QPs): the payload is [`Payload::Headed`], whose
    /// data is cut into segments of `mss` bytes behind copies of its header.
    Tso {
        /// Largest TCP payload per segment.
        mss: u16,
    },
    /// ATOMIC WRITE: stores 8 bytes at an aligned remote address as one atomic store.
    AtomicWrite {
        /// Target word.
        remote: RemoteAddr,
        /// The bytes to store, in memory order (`ibv_wr_atomic_write`'s `atomic_wr`).
        value: [u8; 8],
    },
    /// FLUSH: makes earlier writes to a remote range (or the whole region) globally visible
    /// and/or persistent.
    Flush {
        /// Start of the range (any address of the region for [`FlushSelect::Mr`]).
        remote: RemoteAddr,
        /// Length of the range.
        len: u32,
        /// Placement type bits: [`FLUSH_GLOBAL`] and/or [`FLUSH_PERSISTENT`].
        placement: u8,
        /// The range or the whole region.
        select: FlushSelect,
    },
}

/// `IBV_FLUSH_GLOBAL`: the placement type asking for global visibility.
pub const FLUSH_GLOBAL: u8 = 1;
/// `IBV_FLUSH_PERSISTENT`: the placement type asking for persistence.
pub const FLUSH_PERSISTENT: u8 = 2;

/// `enum ibv_selectivity_level`: what a FLUSH covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlushSelect {
    /// `IBV_FLUSH_RANGE`: the given range, which must lie in the region.
    Range = 0,
    /// `IBV_FLUSH_MR`: the whole region the R_Key names.
    Mr = 1,
}

impl SendOp {
    /// The `ibv_wr_opcode` of this operation.
    pub fn wr_opcode(&self) -> WrOpcode {
        match self {
            Self::Send { imm: Some(_), .. } => WrOpcode::SendWithImm,
            Self::Send {
                invalidate: Some(_), ..
            } => WrOpcode::SendWithInv,
            Self::Send { .. } => WrOpcode::Send,
            Self::Write { imm: Some(_), .. } => WrOpcode::RdmaWriteWithImm,
            Self::Write { .. } => WrOpcode::RdmaWrite,
            Self::Read { .. } => WrOpcode::RdmaRead,
            Self::CompareSwap { .. } => WrOpcode::AtomicCmpAndSwp,
            Self::FetchAdd { .. } => WrOpcode::AtomicFetchAndAdd,
            Self::BindMw(_) => WrOpcode::BindMw,
            Self::LocalInv { .. } => WrOpcode::LocalInv,
            Self::Tso { .. } => WrOpcode::Tso,
            Self::AtomicWrite { .. } => WrOpcode::AtomicWrite,
            Self::Flush { .. } => WrOpcode::Flush,
        }
    }

    /// The opcode of its send completion.
    pub fn wc_opcode(&self) -> WcOpcode {
        match self {
            Self::Send { .. } => WcOpcode::Send,
            Self::Write { .. } => WcOpcode::RdmaWrite,
            Self::Read { .. } => WcOpcode::RdmaRead,
            Self::CompareSwap { .. } => WcOpcode::CompSwap,
            Self::FetchAdd { .. } => WcOpcode::FetchAdd,
            Self::BindMw(_) => WcOpcode::BindMw,
            Self::LocalInv { .. } => WcOpcode::LocalInv,
            Self::Tso { .. } => WcOpcode::Tso,
            Self::AtomicWrite { .. } => WcOpcode::AtomicWrite,
            Self::Flush { .. } => WcOpcode::Flush,
        }
    }

    /// READ, atomic, ATOMIC WRITE or FLUSH: needs a responder resource and a response, and
    /// counts against `max_rd_atomic`.
    pub fn is_read_or_atomic(&self) -> bool {
        matches!(
            self,
            Self::Read { .. }
                | Self::CompareSwap { .. }
                | Self::FetchAdd { .. }
                | Self::AtomicWrite { .. }
                | Self::Flush { .. }
        )
    }

    /// A memory operation executed by the requester itself (bind, local invalidate): it uses
    /// no PSN and sends no packet.
    pub fn is_local(&self) -> bool {
        matches!(self, Self::BindMw(_) | Self::LocalInv { .. })
    }

    /// ATOMIC WRITE or FLUSH: answered by a zero-length READ RESPONSE.
    pub fn is_placement(&self) -> bool {
        matches!(self, Self::AtomicWrite { .. } | Self::Flush { .. })
    }

    /// Atomic.
    pub fn is_atomic(&self) -> bool {
        matches!(self, Self::CompareSwap { .. } | Self::FetchAdd { .. })
    }
}

/// The destination of a UD send, resolved from its address handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UdDest {
    /// Destination GID (unicast or multicast).
    pub dgid: Gid,
    /// Source GID index.
    pub sgid_index: u8,
    /// Traffic class.
    pub traffic_class: u8,
    /// Hop limit.
    pub hop_limit: u8,
    /// Flow label.
    pub flow_label: u32,
    /// Destination QP number (0xFFFFFF for multicast).
    pub qpn: u32,
    /// Q_Key; a value with the top bit set means "use the QP's own Q_Key".
    pub qkey: u32,
}

/// Data of a send: gathered from registered memory, or copied in at post time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Payload {
    /// Gather list.
    Sges(Vec<Sge>),
    /// Inline bytes (`IBV_SEND_INLINE`): no key is checked.
    Inline(Vec<u8>),
    /// A header copied in at post time, then a gather list (`IBV_WR_TSO`'s `wr.tso.hdr`).
    Headed {
        /// The header bytes.
        header: Vec<u8>,
        /// The data after it.
        sges: Vec<Sge>,
    },
}

impl Payload {
    /// Total length in bytes (saturating).
    pub fn len(&self) -> u64 {
        match self {
            Self::Sges(s) => s.iter().map(|s| u64::from(s.length)).sum(),
            Self::Inline(b) => b.len() as u64,
            Self::Headed { header, sges } => {
                header.len() as u64 + sges.iter().map(|s| u64::from(s.length)).sum::<u64>()
            }
        }
    }

    /// Whether the payload has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A send work request (`struct ibv_send_wr`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendWr {
    /// User identifier returned in the completion.
    pub wr_id: u64,
    /// Operation.
    pub op: SendOp,
    /// `ibv_send_flags`.
    pub flags: SendFlags,
    /// Data (for READ and atomics: where the result lands).
    pub payload: Payload,
    /// UD destination.
    pub ud: Option<UdDest>,
    /// XRC_SEND: the SRQ number at the target (`qp_type.xrc.remote_srqn`).
    pub xrc_srqn: Option<u32>,
}

/// Limits [`SendWr::check`] enforces.
#[derive(Debug, Clone, Copy)]
pub struct SendLimits {
    /// QP type.
    pub qp_type: QpType,
    /// `cap.max_send_sge`.
    pub max_send_sge: u32,
    /// `cap.max_inline_data`.
    pub max_inline_data: u32,
    /// Largest message.
    pub max_msg_sz: u64,
    /// Largest UD message (the path MTU); for a raw QP, the largest frame.
    pub ud_mtu: u32,
    /// `max_rd_atomic` of the QP.
    pub max_rd_atomic: u8,
    /// `max_tso_header` of the QP; 0 if it cannot send TSO.
    pub max_tso_header: u32,
}

impl SendWr {
    /// `IBV_WR_TSO`: a header within `max_tso_header` that is exactly Ethernet/IP/TCP, a
    /// non-zero MSS whose segments fit the largest frame, at most `MAX_TSO` data bytes.
    fn check_tso(&self, l: &SendLimits, mss: u16) -> Result<()> {
        let Payload::Headed { header, .. } = &self.payload else {
            return Err(Error::invalid("IBV_WR_TSO needs a header (wr.tso.hdr)"));
        };
        if header.len() > l.max_tso_header as usize {
            return Err(Error::invalid(format!(
                "hdr_sz {} exceeds the QP's max_tso_header {}",
                header.len(),
                l.max_tso_header
            )));
        }
        crate::tso::parse_header(header).map_err(Error::invalid)?;
        if mss == 0 || header.len() + usize::from(mss) > l.ud_mtu as usize {
            return Err(Error::invalid(format!(
                "mss {mss} behind a {}-byte header does not fit a {}-byte frame",
                header.len(),
                l.ud_mtu
            )));
        }
        let data = self.payload.len() - header.len() as u64;
        if data > u64::from(crate::tso::MAX_TSO) {
            return Err(Error::invalid(format!(
                "{data} bytes exceed max_tso {}",
                crate::tso::MAX_TSO
            )));
        }
        Ok(())
    }

    /// Checks what `ibv_post_send` can check at once: the opcode is legal on the QP type
    /// (ibv_post_send(3) table), the SGE count and inline size fit, atomics target one aligned
    /// 8-byte word into an 8-byte buffer, and UD sends have a destination and fit one packet.
    pub fn check(&self, l: &SendLimits) -> Result<()> {
        let opcode = self.op.wr_opcode();
        let legal = match l.qp_type {
            QpType::Ud => matches!(opcode, WrOpcode::Send | WrOpcode::SendWithImm),
            QpType::Uc => matches!(
                opcode,
                WrOpcode::Send
                    | WrOpcode::SendWithImm
                    | WrOpcode::RdmaWrite
                    | WrOpcode::RdmaWriteWithImm
                    | WrOpcode::BindMw
                    | WrOpcode::LocalInv
            ),
            QpType::Rc => true,
            QpType::RawPacket => matches!(opcode, WrOpcode::Send | WrOpcode::Tso),
            // An XRC initiator has the RC operations of ibv_post_send(3), not the RC-only
            // ATOMIC WRITE and FLUSH extensions; the target sends nothing.
            QpType::XrcSend => !matches!(self.op, SendOp::AtomicWrite { .. } | SendOp::Flush { .. }),
            QpType::XrcRecv => false,
        };
        if !legal {
            return Err(Error::invalid(format!(
                "opcode {opcode:?} is not supported on a {} QP",
                l.qp_type
            )));
        }
        if self.op.is_local() {
            // Binds and invalidations carry no data (rxe refuses them with SGEs, as here).
            if !matches!(&self.payload, Payload::Sges(s) if s.is_empty()) {
                return Err(Error::invalid(format!(
                    "{opcode:?} carries no data: num_sge must be 0 and IBV_SEND_INLINE unset"
                )));
            }
            return Ok(());
        }
        match &self.payload {
            Payload::Sges(s) if s.len() > l.max_send_sge as usize => {
                return Err(Error::invalid(format!(
                    "num_sge {} exceeds max_send_sge {}",
                    s.len(),
                    l.max_send_sge
                )))
            }
            Payload::Inline(b) => {
                if b.len() > l.max_inline_data as usize {
                    return Err(Error::invalid(format!(
                        "{} bytes of inline data exceed max_inline_data {}",
                        b.len(),
                        l.max_inline_data
                    )));
                }
                if self.op.is_read_or_atomic() {
                    return Err(Error::invalid(
                        "IBV_SEND_INLINE is only valid for SEND and RDMA WRITE",
                    ));
                }
            }
            Payload::Headed { sges, .. } if sges.len() > l.max_send_sge as usize => {
                return Err(Error::invalid(format!(
                    "num_sge {} exceeds max_send_sge {}",
                    sges.len(),
                    l.max_send_sge
                )))
            }
            Payload::Sges(_) | Payload::Headed { .. } => {}
        }
        if let SendOp::Tso { mss } = self.op {
            return self.check_tso(l, mss);
        }
        if matches!(self.payload, Payload::Headed { .. }) {
            return Err(Error::invalid("only IBV_WR_TSO carries a header"));
        }
        let len = self.payload.len();
        if len > l.max_msg_sz {
            return Err(Error::invalid(format!(
                "message of {len} bytes exceeds max_msg_sz {}",
                l.max_msg_sz
            )));
        }
        if self.op.is_read_or_atomic() && l.max_rd_atomic == 0 {
            return Err(Error::invalid(
                "max_rd_atomic is 0: the QP cannot issue RDMA READ or atomics",
            ));
        }
        if let SendOp::CompareSwap { remote, .. } | SendOp::FetchAdd { remote, .. } = self.op {
            if remote.addr % 8 != 0 {
                return Err(Error::invalid(format!(
                    "atomic remote_addr {:#x} is not 8-byte aligned",
                    remote.addr
                )));
            }
            if len != 8 {
                return Err(Error::invalid(format!(
                    "an atomic needs an 8-byte local buffer, not {len} bytes"
                )));
            }
        }
        // Binds and local invalidates send nothing, so name no SRQ.
        if l.qp_type == QpType::XrcSend && !self.op.is_local() {
            match self.xrc_srqn {
                None => return Err(Error::invalid("an XRC send needs qp_type.xrc.remote_srqn")),
                Some(n) if n > 0xFF_FFFF => {
                    return Err(Error::invalid(format!("remote_srqn {n:#x} exceeds 24 bits")))
                }
                Some(_) => {}
            }
        }
        if l.qp_type == QpType::RawPacket
            && !matches!(self.op, SendOp::Tso { .. })
            && !(14..=u64::from(l.ud_mtu)).contains(&len)
        {
            return Err(Error::invalid(format!(
                "a raw frame of {len} bytes is outside 14..={} (an Ethernet header up to the MTU)",
                l.ud_mtu
            )));
        }
        match self.op {
            SendOp::AtomicWrite { remote, .. } if remote.addr % 8 != 0 => {
                return Err(Error::invalid(format!(
                    "atomic write remote_addr {:#x} is not 8-byte aligned",
                    remote.addr
                )));
            }
            SendOp::AtomicWrite { .. } | SendOp::Flush { .. } if len != 0 => {
                return Err(Error::invalid("ATOMIC WRITE and FLUSH take no local buffer"));
            }
            SendOp::Flush { placement, .. }
                if placement == 0 || placement & !(FLUSH_GLOBAL | FLUSH_PERSISTENT) != 0 =>
            {
                return Err(Error::invalid(format!(
                    "flush type {placement:#x} is not IBV_FLUSH_GLOBAL and/or IBV_FLUSH_PERSISTENT"
                )));
            }
            _ => {}
        }
        if l.qp_type == QpType::Ud {
            if self.ud.is_none() {
                return Err(Error::invalid("a UD send needs an address handle"));
            }
            if len > u64::from(l.ud_mtu) {
                return Err(Error::invalid(format!(
                    "UD message of {len} bytes exceeds the path MTU {}",
                    l.ud_mtu
                )));
            }
        }
        Ok(())
    }
}
