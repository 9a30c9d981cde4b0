//! The frames of relay calls: a little-endian encoding of the few types they carry.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;

use softverbs_engine::memory::{Access, KeyRef, MemError};
use softverbs_engine::types::{RecvWr, Sge, WcFlags, WcOpcode, WcStatus, WorkCompletion};

/// The largest frame either side accepts (a read or write is at most one packet's payload).
pub(super) const MAX_FRAME: usize = 1 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum Op {
    Select = 1,
    Take,
    PutBack,
    Complete,
    Read,
    Write,
    Check,
    Atomic,
    Invalidate,
    Flush,
}

impl Op {
    pub(super) fn from_u8(v: u8) -> Option<Self> {
        [
            Self::Select,
            Self::Take,
            Self::PutBack,
            Self::Complete,
            Self::Read,
            Self::Write,
            Self::Check,
            Self::Atomic,
            Self::Invalidate,
            Self::Flush,
        ]
        .into_iter()
        .find(|o| *o as u8 == v)
    }

    /// Calls that get no answer.
    pub(super) fn one_way(self) -> bool {
        matches!(self, Self::PutBack | Self::Complete)
    }
}

/// Builds one frame.
#[derive(Default)]
pub(super) struct Enc(pub(super) Vec<u8>);

impl Enc {
    pub(super) fn u8(mut self, v: u8) -> Self {
        self.0.push(v);
        self
    }
    pub(super) fn u16(mut self, v: u16) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(super) fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(super) fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(super) fn bytes(self, v: &[u8]) -> Self {
        let mut s = self.u32(v.len() as u32);
        s.0.extend_from_slice(v);
        s
    }
    pub(super) fn str(self, v: &str) -> Self {
        self.bytes(v.as_bytes())
    }
    pub(super) fn key(self, k: KeyRef) -> Self {
        let (a, p) = match k.access {
            Access::LocalRead => (0, 0),
            Access::LocalWrite => (1, 0),
            Access::RemoteRead => (2, 0),
            Access::RemoteWrite => (3, 0),
            Access::RemoteAtomic => (4, 0),
            Access::Flush(p) => (5, p),
        };
        self.u32(k.key).u32(k.pd).u32(k.qpn).u8(a).u8(p)
    }
    pub(super) fn recv_wr(self, wr: &RecvWr) -> Self {
        let mut s = self.u64(wr.wr_id).u32(wr.sg_list.len() as u32);
        for sge in &wr.sg_list {
            s = s.u64(sge.addr).u32(sge.length).u32(sge.lkey);
        }
        s
    }
    pub(super) fn wc(self, wc: &WorkCompletion) -> Self {
        self.u64(wc.wr_id)
            .u32(wc.status.raw())
            .u32(wc.opcode.raw())
            .u32(wc.vendor_err)
            .u32(wc.byte_len)
            .u32(wc.imm_data)
            .u32(wc.qp_num)
            .u32(wc.src_qp)
            .u32(wc.wc_flags.bits())
            .u16(wc.pkey_index)
            .u16(wc.slid)
            .u8(wc.sl)
            .u8(wc.dlid_path_bits)
            .u8(u8::from(wc.solicited))
    }
}

/// Reads one frame; every getter fails on a short or malformed frame.
pub(super) struct Dec<'a>(pub(super) &'a [u8]);

impl<'a> Dec<'a> {
    pub(super) fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (h, t) = self.0.split_at(n);
        self.0 = t;
        Some(h)
    }
    pub(super) fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    pub(super) fn u16(&mut self) -> Option<u16> {
        self.take(2)
            .map(|b| u16::from_le_bytes(b.try_into().expect("2 bytes")))
    }
    pub(super) fn u32(&mut self) -> Option<u32> {
        self.take(4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
    }
    pub(super) fn u64(&mut self) -> Option<u64> {
        self.take(8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }
    pub(super) fn bytes(&mut self) -> Option<&'a [u8]> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    pub(super) fn str(&mut self) -> Option<&'a str> {
        std::str::from_utf8(self.bytes()?).ok()
    }
    pub(super) fn key(&mut self) -> Option<KeyRef> {
        let (key, pd, qpn) = (self.u32()?, self.u32()?, self.u32()?);
        let access = match (self.u8()?, self.u8()?) {
            (0, _) => Access::LocalRead,
            (1, _) => Access::LocalWrite,
            (2, _) => Access::RemoteRead,
            (3, _) => Access::RemoteWrite,
            (4, _) => Access::RemoteAtomic,
            (5, p) => Access::Flush(p),
            _ => return None,
        };
        Some(KeyRef { key, pd, qpn, access })
    }
    pub(super) fn recv_wr(&mut self) -> Option<RecvWr> {
        let wr_id = self.u64()?;
        let n = self.u32()? as usize;
        let mut sg_list = Vec::with_capacity(n.min(64));
        for _ in 0..n {
            sg_list.push(Sge {
                addr: self.u64()?,
                length: self.u32()?,
                lkey: self.u32()?,
            });
        }
        Some(RecvWr { wr_id, sg_list })
    }
    pub(super) fn wc(&mut self) -> Option<WorkCompletion> {
        Some(WorkCompletion {
            wr_id: self.u64()?,
            status: WcStatus::from_raw(self.u32()?)?,
            opcode: WcOpcode::from_raw(self.u32()?)?,
            vendor_err: self.u32()?,
            byte_len: self.u32()?,
            imm_data: self.u32()?,
            qp_num: self.u32()?,
            src_qp: self.u32()?,
            wc_flags: WcFlags::from_bits_truncate(self.u32()?),
            pkey_index: self.u16()?,
            slid: self.u16()?,
            sl: self.u8()?,
            dlid_path_bits: self.u8()?,
            solicited: self.u8()? != 0,
            ..Default::default()
        })
    }
}

pub(super) const MEM_ERRORS: [MemError; 9] = [
    MemError::BadKey,
    MemError::WrongPd,
    MemError::OutOfRange,
    MemError::NoAccess,
    MemError::Misaligned,
    MemError::WrongQp,
    MemError::BadState,
    MemError::InvalidBind,
    MemError::Unmapped,
];

/// A memory result as one byte: 0 for success, else 1 + the error's index.
pub(super) fn status_byte(r: Result<(), MemError>) -> u8 {
    match r {
        Ok(()) => 0,
        Err(e) => 1 + MEM_ERRORS.iter().position(|x| *x == e).unwrap_or(0) as u8,
    }
}

pub(super) fn status_of(b: u8) -> Result<(), MemError> {
    match b {
        0 => Ok(()),
        n => Err(*MEM_ERRORS.get(usize::from(n) - 1).unwrap_or(&MemError::BadKey)),
    }
}

pub(super) fn write_frame(s: &mut UnixStream, body: &[u8]) -> std::io::Result<()> {
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(body);
    s.write_all(&frame)
}

pub(super) fn read_frame(s: &mut UnixStream) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "frame too long",
        ));
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body)?;
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use softverbs_engine::memory::Access;

    #[test]
    fn frames_round_trip() {
        let wr = RecvWr {
            wr_id: 0xdead_beef_0000_0001,
            sg_list: vec![
                Sge {
                    addr: 0x1000,
                    length: 64,
                    lkey: 9,
                },
                Sge {
                    addr: 0x2000,
                    length: 4096,
                    lkey: 10,
                },
            ],
        };
        let wc = WorkCompletion {
            wr_id: 5,
            status: WcStatus::LocLenErr,
            opcode: WcOpcode::RecvRdmaWithImm,
            byte_len: 77,
            imm_data: 0x0102_0304,
            qp_num: 0x0001_0011,
            wc_flags: WcFlags::WITH_IMM,
            solicited: true,
            ..Default::default()
        };
        let key = KeyRef {
            key: 0x1234_5678,
            pd: 3,
            qpn: 0x11,
            access: Access::Flush(2),
        };
        let e = Enc::default().recv_wr(&wr).wc(&wc).key(key).str("sv_lo");
        let mut d = Dec(&e.0);
        assert_eq!(d.recv_wr(), Some(wr));
        assert_eq!(d.wc(), Some(wc));
        assert_eq!(d.key(), Some(key));
        assert_eq!(d.str(), Some("sv_lo"));
        assert_eq!(d.u8(), None, "nothing left");
        let mut short = Dec(&e.0[..5]);
        assert_eq!(short.recv_wr(), None, "a truncated frame is refused");
    }

    #[test]
    fn memory_errors_survive_the_wire() {
        for e in MEM_ERRORS {
            assert_eq!(status_of(status_byte(Err(e))), Err(e));
        }
        assert_eq!(status_of(status_byte(Ok(()))), Ok(()));
    }
}
