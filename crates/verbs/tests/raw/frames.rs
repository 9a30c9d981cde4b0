//! Building Ethernet/IPv4/UDP frames with correct checksums, written independently of the
//! library's parser.
#![allow(dead_code)]

use std::net::Ipv4Addr;

fn fold(mut sum: u32) -> u16 {
    while sum > 0xFFFF {
        sum = (sum & 0xFFFF) + (sum >> 16);
    }
    !(sum as u16)
}

fn sum16(data: &[u8]) -> u32 {
    data.chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum()
}

/// An Ethernet frame carrying IPv4/UDP with `payload`; both checksums filled in.
pub(crate) fn udp_frame(
    dst_mac: [u8; 6],
    src_mac: [u8; 6],
    src: (Ipv4Addr, u16),
    dst: (Ipv4Addr, u16),
    payload: &[u8],
) -> Vec<u8> {
    let udp_len = 8 + payload.len();
    let mut f = Vec::with_capacity(14 + 20 + udp_len);
    f.extend_from_slice(&dst_mac);
    f.extend_from_slice(&src_mac);
    f.extend_from_slice(&0x0800u16.to_be_bytes());
    let mut ip = vec![0x45, 0];
    ip.extend_from_slice(&((20 + udp_len) as u16).to_be_bytes());
    ip.extend_from_slice(&[0x12, 0x34, 0x40, 0, 64, 17, 0, 0]);
    ip.extend_from_slice(&src.0.octets());
    ip.extend_from_slice(&dst.0.octets());
    let c = fold(sum16(&ip));
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    f.extend_from_slice(&ip);
    let mut udp = Vec::with_capacity(udp_len);
    udp.extend_from_slice(&src.1.to_be_bytes());
    udp.extend_from_slice(&dst.1.to_be_bytes());
    udp.extend_from_slice(&(udp_len as u16).to_be_bytes());
    udp.extend_from_slice(&[0, 0]);
    udp.extend_from_slice(payload);
    let mut pseudo = Vec::new();
    pseudo.extend_from_slice(&src.0.octets());
    pseudo.extend_from_slice(&dst.0.octets());
    pseudo.extend_from_slice(&[0, 17]);
    pseudo.extend_from_slice(&(udp_len as u16).to_be_bytes());
    let c = match fold(sum16(&pseudo) + sum16(&udp)) {
        0 => 0xFFFF,
        c => c,
    };
    udp[6..8].copy_from_slice(&c.to_be_bytes());
    f.extend_from_slice(&udp);
    f
}

/// A frame of a local experimental ethertype (0x88B5), which no IP stack reacts to.
pub(crate) fn experimental_frame(dst_mac: [u8; 6], src_mac: [u8; 6], body: &[u8]) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(&dst_mac);
    f.extend_from_slice(&src_mac);
    f.extend_from_slice(&0x88B5u16.to_be_bytes());
    f.extend_from_slice(body);
    f
}

/// The UDP destination port of an IPv4/UDP frame.
pub(crate) fn udp_dst_port(f: &[u8]) -> u16 {
    u16::from_be_bytes([f[36], f[37]])
}

pub(crate) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub(crate) fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

pub(crate) fn mac_of(ifname: &str) -> [u8; 6] {
    let s = std::fs::read_to_string(format!("/sys/class/net/{ifname}/address")).unwrap();
    let v: Vec<u8> = s
        .trim()
        .split(':')
        .map(|x| u8::from_str_radix(x, 16).unwrap())
        .collect();
    v.try_into().unwrap()
}

/// An Ethernet/IPv4/TCP header block (no payload) for TSO.
pub(crate) fn tcp_header(
    dst_mac: [u8; 6],
    src_mac: [u8; 6],
    src: (Ipv4Addr, u16),
    dst: (Ipv4Addr, u16),
    seq: u32,
    flags: u8,
) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(&dst_mac);
    f.extend_from_slice(&src_mac);
    f.extend_from_slice(&0x0800u16.to_be_bytes());
    f.extend_from_slice(&[0x45, 0, 0, 40, 0x42, 0x42, 0x40, 0, 64, 6, 0, 0]);
    f.extend_from_slice(&src.0.octets());
    f.extend_from_slice(&dst.0.octets());
    f.extend_from_slice(&src.1.to_be_bytes());
    f.extend_from_slice(&dst.1.to_be_bytes());
    f.extend_from_slice(&seq.to_be_bytes());
    f.extend_from_slice(&[0, 0, 0, 1, 0x50, flags, 0xFF, 0xFF, 0, 0, 0, 0]);
    f
}

/// Whether an Ethernet/IPv4/TCP frame's IPv4 and TCP checksums verify and its IPv4 total
/// length matches the frame.
pub(crate) fn ipv4_tcp_valid(f: &[u8]) -> bool {
    let ip = &f[14..34];
    let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
    let mut pseudo = ip[12..20].to_vec();
    pseudo.extend_from_slice(&[0, 6]);
    pseudo.extend_from_slice(&((f.len() - 34) as u16).to_be_bytes());
    pseudo.extend_from_slice(&f[34..]);
    total == f.len() - 14 && fold(sum16(ip)) == 0 && fold(sum16(&pseudo)) == 0
}
