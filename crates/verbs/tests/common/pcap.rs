//! Checks of softverbs packet captures with tools independent of softverbs: tshark decodes
//! every frame (as RRoCE on the given UDP ports, with IP and UDP checksums validated) and
//! Python's zlib recomputes every ICRC (tshark 4.0 shows the ICRC but does not check it).
//! Shared by the Rust and the C capture tests.
#![allow(dead_code, unreachable_pub)]

use std::path::Path;
use std::process::Command;

/// One decoded frame.
#[derive(Debug, Clone)]
pub struct Frame {
    /// `frame.protocols`, e.g. `sll:ethertype:ip:udp:infiniband:data`.
    pub protocols: String,
    /// Whether the process sent it (cooked-capture packet type 4).
    pub outgoing: bool,
    /// `udp.checksum.status` (1: good).
    pub udp_checksum: String,
    /// `ip.checksum.status` (1: good; empty for IPv6, which has none).
    pub ip_checksum: String,
    /// Expert-info severities tshark attached, if any.
    pub expert: String,
    /// The BTH opcode.
    pub opcode: u8,
    /// The destination QP.
    pub dest_qp: u32,
    /// The payload bytes tshark shows as data.
    pub data: Vec<u8>,
    /// For a MAD: management class and attribute ID (CM: class 7, REQ 0x10, REP 0x13, ...).
    pub mad: Option<(u8, u16)>,
    /// The BTH PSN.
    pub psn: u32,
}

fn hex(s: &str) -> Vec<u8> {
    let s: Vec<u8> = s.bytes().filter(u8::is_ascii_hexdigit).collect();
    s.chunks(2)
        .map(|p| u8::from_str_radix(std::str::from_utf8(p).unwrap(), 16).unwrap())
        .collect()
}

/// The fields read of each frame, in the order [`Frame`] takes them.
const FIELDS: [&str; 11] = [
    "frame.protocols",
    "sll.pkttype",
    "udp.checksum.status",
    "ip.checksum.status",
    "_ws.expert.severity",
    "infiniband.bth.opcode",
    "infiniband.bth.destqp",
    "data.data",
    "infiniband.mad.mgmtclass",
    "infiniband.mad.attributeid",
    "infiniband.bth.psn",
];

/// Decodes `path` with tshark, RoCEv2 on UDP ports `ports` (the slots' ports). Panics if tshark
/// fails or reports the file cut short.
pub fn decode(path: &Path, ports: std::ops::RangeInclusive<u16>) -> Vec<Frame> {
    let decode_as = format!("udp.port=={}-{},infiniband", ports.start(), ports.end());
    let out = Command::new("tshark")
        .arg("-r")
        .arg(path)
        .args(["-o", "udp.check_checksum:TRUE", "-o", "ip.check_checksum:TRUE"])
        .args(["-d", &decode_as])
        .args(["-T", "fields", "-E", "separator=/t", "-E", "occurrence=a"])
        .args(FIELDS.iter().flat_map(|f| ["-e", f]))
        .output()
        .unwrap_or_else(|e| panic!("tshark could not be run ({e}); install it with scripts/setup-deps"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "tshark failed on {}: {err}", path.display());
    assert!(
        !err.contains("cut short") && !err.contains("corrupt"),
        "tshark on {}: {err}",
        path.display()
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split('\t').collect();
            let field = |i: usize| f.get(i).copied().unwrap_or("").to_string();
            let num = |i: usize| {
                let v = field(i);
                let v = v.trim_start_matches("0x");
                u32::from_str_radix(v, if field(i).starts_with("0x") { 16 } else { 10 }).unwrap_or(u32::MAX)
            };
            Frame {
                protocols: field(0),
                outgoing: field(1) == "4",
                udp_checksum: field(2),
                ip_checksum: field(3),
                expert: field(4),
                opcode: num(5) as u8,
                dest_qp: num(6),
                data: hex(&field(7)),
                mad: (!field(8).is_empty()).then(|| (num(8) as u8, num(9) as u16)),
                psn: num(10),
            }
        })
        .collect()
}

/// The payload of the SEND packets (first, middle, last, only) among `frames` that `pick`
/// selects, in PSN order with each PSN once (a resent packet is in a capture twice).
pub fn send_payload(frames: &[Frame], pick: impl Fn(&Frame) -> bool) -> Vec<u8> {
    let mut by_psn: Vec<&Frame> = frames
        .iter()
        .filter(|f| pick(f) && matches!(f.opcode, 0..=2 | 4))
        .collect();
    by_psn.sort_by_key(|f| f.psn);
    by_psn.dedup_by_key(|f| f.psn);
    by_psn.iter().flat_map(|f| f.data.iter().copied()).collect()
}

/// Asserts that `a == b` without printing megabytes: their lengths and where they first differ.
pub fn assert_same_bytes(a: &[u8], b: &[u8], what: &str) {
    let first = a.iter().zip(b).position(|(x, y)| x != y);
    assert!(
        a.len() == b.len() && first.is_none(),
        "{what}: {} and {} bytes, first difference at {first:?}",
        a.len(),
        b.len()
    );
}

/// Asserts that every frame decodes as RRoCE with good IP and UDP checksums and no expert
/// warning or error, and that every ICRC is right. Returns the frames.
pub fn check(path: &Path, ports: std::ops::RangeInclusive<u16>) -> Vec<Frame> {
    let frames = decode(path, ports);
    for (i, f) in frames.iter().enumerate() {
        let n = i + 1;
        assert!(
            f.protocols.contains(":udp:infiniband"),
            "{} frame {n} is not RRoCE: {f:?}",
            path.display()
        );
        assert!(
            !f.protocols.contains("malformed"),
            "{} frame {n}: {f:?}",
            path.display()
        );
        assert_eq!(f.udp_checksum, "1", "{} frame {n}: UDP checksum", path.display());
        assert!(
            f.ip_checksum.is_empty() || f.ip_checksum == "1",
            "{} frame {n}: IP checksum {f:?}",
            path.display()
        );
        assert!(
            f.expert.is_empty(),
            "{} frame {n}: expert info {f:?}",
            path.display()
        );
    }
    let (good, bad) = icrc_check(path);
    assert_eq!(
        (good, bad),
        (frames.len(), 0),
        "{}: ICRCs right and wrong",
        path.display()
    );
    frames
}

/// Recomputes every frame's ICRC with zlib over the masked headers of roce.md.
const ICRC_CHECK: &str = r#"
import struct, sys, zlib
data = open(sys.argv[1], "rb").read()
assert struct.unpack_from("<I", data, 0)[0] == 0xa1b23c4d, "nanosecond pcap"
assert struct.unpack_from("<I", data, 20)[0] == 113, "LINUX_SLL"
off, good, bad = 24, 0, 0
while off < len(data):
    incl = struct.unpack_from("<I", data, off + 8)[0]
    frame = bytearray(data[off + 16 : off + 16 + incl])
    off += 16 + incl
    proto = struct.unpack_from(">H", frame, 14)[0]
    ip_at = 16
    if proto == 0x0800:
        ip = frame[ip_at : ip_at + 20]
        ip[1] = 0xFF; ip[8] = 0xFF; ip[10:12] = b"\xff\xff"
    else:
        ip = frame[ip_at : ip_at + 40]
        ip[0] |= 0x0F; ip[1:4] = b"\xff\xff\xff"; ip[7] = 0xFF
    udp = frame[ip_at + len(ip) : ip_at + len(ip) + 8]
    udp[6:8] = b"\xff\xff"
    roce = bytearray(frame[ip_at + len(ip) + 8 : -4])
    roce[4] = 0xFF
    crc = zlib.crc32(b"\xff" * 8 + bytes(ip) + bytes(udp) + bytes(roce)) & 0xFFFFFFFF
    if crc == struct.unpack("<I", frame[-4:])[0]:
        good += 1
    else:
        bad += 1
print(good, bad)
"#;

/// (right, wrong) ICRCs in the capture at `path`.
pub fn icrc_check(path: &Path) -> (usize, usize) {
    let out = Command::new("python3")
        .arg("-c")
        .arg(ICRC_CHECK)
        .arg(path)
        .output()
        .unwrap_or_else(|e| panic!("python3 could not be run ({e}); install it with scripts/setup-deps"));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let mut it = text.split_whitespace().map(|n| n.parse().unwrap());
    (it.next().unwrap(), it.next().unwrap())
}
