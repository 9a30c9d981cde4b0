//! Parses arbitrary bytes as a RoCEv2 UDP payload. Whatever parses must
//! re-emit to the same bytes, except for what the parser deliberately
//! drops: reserved bits, pad contents and the ICRC (copied over).
#![no_main]

use libfuzzer_sys::fuzz_target;
use softverbs_wire::{icrc::ICRC_LEN, Header, RocePacket};

fuzz_target!(|data: &[u8]| {
    let Ok(parsed) = RocePacket::parse(data) else {
        return;
    };
    let repr = parsed.repr;
    assert_eq!(repr.buffer_len(), data.len());

    let mut out = vec![0u8; repr.buffer_len()];
    repr.emit_with_payload(&mut out, parsed.payload)
        .expect("a parsed repr must emit");
    let icrc_at = data.len() - ICRC_LEN;
    out[icrc_at..].copy_from_slice(&data[icrc_at..]);

    let mut expected = data.to_vec();
    expected[4] &= 0xC0; // BTH: FECN, BECN kept; resv6 dropped
    expected[8] &= 0x80; // BTH: AckReq kept; resv7 dropped
    let op = repr.opcode();
    if let Some(at) = op.offset(Header::Deth) {
        expected[at + 4] = 0; // DETH reserved byte
    }
    if let Some(at) = op.offset(Header::XrcEth) {
        expected[at] = 0; // XRCETH reserved byte
    }
    if let Some(at) = op.offset(Header::CnpPad) {
        expected[at..at + Header::CnpPad.size()].fill(0);
    }
    let pad = usize::from(repr.bth.pad_count);
    expected[icrc_at - pad..icrc_at].fill(0);
    assert_eq!(out, expected);

    let again = RocePacket::parse(&out).expect("re-emitted packet must parse");
    assert_eq!(again, parsed);
});
