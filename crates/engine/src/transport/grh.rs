//! The 40-byte network-header area at the start of a UD receive buffer (IBTA Annex 17): the
//! IPv6 header, or for IPv4 twenty undefined (zero) bytes followed by the IPv4 header.

use softverbs_wire::{grh, udp, GrhPacket, GrhRepr};

use crate::types::Gid;

/// The GRH area for a packet of `roce_len` UDP-payload bytes from `sgid` to `dgid`.
pub fn write_grh(sgid: Gid, dgid: Gid, traffic_class: u8, hop_limit: u8, roce_len: usize) -> [u8; 40] {
    let mut g = [0u8; grh::HEADER_LEN];
    GrhRepr {
        src_addr: sgid.to_ip(),
        dst_addr: dgid.to_ip(),
        traffic_class,
        flow_label: 0,
        hop_limit,
        payload_len: udp::HEADER_LEN + roce_len,
    }
    .emit(&mut GrhPacket::new_unchecked(&mut g));
    g
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    #[test]
    fn ipv4_header_sits_in_the_last_20_bytes_with_a_valid_checksum() {
        let g = write_grh(
            Gid::from(Ipv4Addr::new(10, 0, 0, 1)),
            Gid::from(Ipv4Addr::new(10, 0, 0, 2)),
            0,
            64,
            100,
        );
        assert_eq!(&g[..20], &[0u8; 20]);
        assert_eq!(g[20], 0x45);
        assert_eq!(u16::from_be_bytes([g[22], g[23]]), 128);
        let mut sum: u32 = g[20..]
            .chunks(2)
            .map(|c| u32::from(u16::from_be_bytes([c[0], c[1]])))
            .sum();
        while sum > 0xFFFF {
            sum = (sum & 0xFFFF) + (sum >> 16);
        }
        assert_eq!(sum, 0xFFFF, "a header with its checksum sums to all ones");
        assert_eq!(&g[32..36], &[10, 0, 0, 1]);
    }

    #[test]
    fn ipv6_header_fills_the_area() {
        let g = write_grh(
            Gid::from(Ipv6Addr::LOCALHOST),
            Gid::from(Ipv6Addr::LOCALHOST),
            3,
            9,
            10,
        );
        assert_eq!(g[0] >> 4, 6);
        assert_eq!(u16::from_be_bytes([g[4], g[5]]), 18);
        assert_eq!((g[6], g[7]), (17, 9));
        assert_eq!(&g[8..24], &Ipv6Addr::LOCALHOST.octets());
    }
}
