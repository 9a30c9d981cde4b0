//! Writes one seed packet per known opcode, plus the ConnectX-4 Lx CNP
//! capture, into `corpus/packet_parse/` (run from the `fuzz` directory).

use std::fs;
use std::path::Path;

use softverbs_wire::opcode::OPCODE_TABLE;
use softverbs_wire::{
    AethRepr, AethSyndrome, AtomicAckEthRepr, AtomicEthRepr, BthRepr, DethRepr, FethRepr, Header, IethRepr,
    ImmDtRepr, PacketRepr, Psn, RethRepr, XrcEthRepr,
};

fn main() -> std::io::Result<()> {
    let dir = Path::new("corpus/packet_parse");
    fs::create_dir_all(dir)?;
    for info in OPCODE_TABLE {
        let payload: &[u8] = if info.opcode.has_payload() {
            b"seed payload!"
        } else {
            &[]
        };
        let mut repr = PacketRepr::new(
            BthRepr::new(info.opcode, 0x11, Psn::new(0xFF_FFF0)),
            payload.len(),
        );
        let has = |h| info.headers.contains(h);
        repr.deth = has(Header::Deth).then_some(DethRepr {
            qkey: 0x1111_1111,
            src_qpn: 0x22,
        });
        repr.xrceth = has(Header::XrcEth).then_some(XrcEthRepr { srqn: 0x66 });
        repr.feth = has(Header::Feth).then_some(FethRepr {
            placement: 1,
            selectivity: 0,
        });
        repr.reth = has(Header::Reth).then_some(RethRepr {
            va: 0x1000,
            rkey: 0x33,
            dma_len: 13,
        });
        repr.atomic_eth = has(Header::AtomicEth).then_some(AtomicEthRepr {
            va: 0x2000,
            rkey: 0x44,
            swap_add: 1,
            compare: 2,
        });
        repr.aeth = has(Header::Aeth).then_some(AethRepr {
            syndrome: AethSyndrome::ACK_UNLIMITED,
            msn: 5,
        });
        repr.atomic_ack_eth = has(Header::AtomicAckEth).then_some(AtomicAckEthRepr { orig: 7 });
        repr.imm_dt = has(Header::ImmDt).then_some(ImmDtRepr {
            imm_data: 0xdead_beef,
        });
        repr.ieth = has(Header::Ieth).then_some(IethRepr { rkey: 0x55 });
        let mut buf = vec![0u8; repr.buffer_len()];
        repr.emit_with_payload(&mut buf, payload)
            .expect("seed repr is consistent");
        fs::write(dir.join(info.name), &buf)?;
    }
    let mut cnp = vec![0x81, 0x00, 0xff, 0xff, 0x40, 0x00, 0x01, 0x18];
    cnp.resize(28, 0);
    cnp.extend_from_slice(&[0x82, 0xfd, 0x00, 0x2a]);
    fs::write(dir.join("cnp_connectx4"), cnp)?;
    Ok(())
}
