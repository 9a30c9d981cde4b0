use super::*;

/// The key of the Microsoft RSS verification suite.
const MS_KEY: [u8; 40] = [
    0x6d, 0x5a, 0x56, 0xda, 0x25, 0x5b, 0x0e, 0xc2, 0x41, 0x67, 0x25, 0x3d, 0x43, 0xa3, 0x8f, 0xb0, 0xd0,
    0xca, 0x2b, 0xcb, 0xae, 0x7b, 0x30, 0xb4, 0x77, 0xcb, 0x2d, 0xa3, 0x80, 0x30, 0xf2, 0x0c, 0x6a, 0x42,
    0xb7, 0x3b, 0xbe, 0xac, 0x01, 0xfa,
];

/// An Ethernet/IPv4/TCP-or-UDP frame with the given addresses and ports.
fn v4_frame(proto: u8, src: [u8; 4], dst: [u8; 4], sport: u16, dport: u16) -> Vec<u8> {
    let mut f = vec![0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2, 0x08, 0x00];
    f.extend_from_slice(&[0x45, 0, 0, 40, 0, 0, 0x40, 0, 64, proto, 0, 0]);
    f.extend_from_slice(&src);
    f.extend_from_slice(&dst);
    f.extend_from_slice(&sport.to_be_bytes());
    f.extend_from_slice(&dport.to_be_bytes());
    f.extend_from_slice(&[0; 16]);
    f
}

fn v6_frame(src: Ipv6Addr, dst: Ipv6Addr, sport: u16, dport: u16) -> Vec<u8> {
    let mut f = vec![0x33, 0x33, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2, 0x86, 0xDD];
    f.extend_from_slice(&[0x60, 0x0A, 0xBC, 0xDE, 0, 8, IPPROTO_UDP, 7]);
    f.extend_from_slice(&src.octets());
    f.extend_from_slice(&dst.octets());
    f.extend_from_slice(&sport.to_be_bytes());
    f.extend_from_slice(&dport.to_be_bytes());
    f.extend_from_slice(&[0, 8, 0, 0]);
    f
}

#[test]
fn toeplitz_matches_the_microsoft_ipv4_vectors() {
    // (source, source port, destination, destination port, IPv4-only hash, with TCP ports)
    type Case = ([u8; 4], u16, [u8; 4], u16, u32, u32);
    let cases: [Case; 5] = [
        (
            [66, 9, 149, 187],
            2794,
            [161, 142, 100, 80],
            1766,
            0x323e_8fc2,
            0x51cc_c178,
        ),
        (
            [199, 92, 111, 2],
            14230,
            [65, 69, 140, 83],
            4739,
            0xd718_262a,
            0xc626_b0ea,
        ),
        (
            [24, 19, 198, 95],
            12898,
            [12, 22, 207, 184],
            38024,
            0xd2d0_a5de,
            0x5c2b_394a,
        ),
        (
            [38, 27, 205, 30],
            48228,
            [209, 142, 163, 6],
            2217,
            0x8298_9176,
            0xafc7_327f,
        ),
        (
            [153, 39, 163, 191],
            44251,
            [202, 188, 127, 2],
            1303,
            0x5d18_09c5,
            0x10e8_28a2,
        ),
    ];
    let ip = RxHashFields::SRC_IPV4 | RxHashFields::DST_IPV4;
    let tcp = ip | RxHashFields::SRC_PORT_TCP | RxHashFields::DST_PORT_TCP;
    for (src, sport, dst, dport, h_ip, h_tcp) in cases {
        let f = FrameHeaders::parse(&v4_frame(IPPROTO_TCP, src, dst, sport, dport)).unwrap();
        assert_eq!(toeplitz(&MS_KEY, &ip.input(&f)), h_ip, "{src:?}");
        assert_eq!(toeplitz(&MS_KEY, &tcp.input(&f)), h_tcp, "{src:?}");
        // UDP port fields do not apply to a TCP frame: only the addresses are hashed.
        let udp = ip | RxHashFields::SRC_PORT_UDP | RxHashFields::DST_PORT_UDP;
        assert_eq!(toeplitz(&MS_KEY, &udp.input(&f)), h_ip);
    }
}

#[test]
fn toeplitz_matches_the_microsoft_ipv6_vector() {
    let src: Ipv6Addr = "3ffe:2501:200:1fff::7".parse().unwrap();
    let dst: Ipv6Addr = "3ffe:2501:200:3::1".parse().unwrap();
    let f = FrameHeaders::parse(&v6_frame(src, dst, 2794, 1766)).unwrap();
    let ip = RxHashFields::SRC_IPV6 | RxHashFields::DST_IPV6;
    assert_eq!(toeplitz(&MS_KEY, &ip.input(&f)), 0x2cc1_8cd5);
    let udp = ip | RxHashFields::SRC_PORT_UDP | RxHashFields::DST_PORT_UDP;
    assert_eq!(toeplitz(&MS_KEY, &udp.input(&f)), 0x4020_7d3d);
}

#[test]
fn parses_vlan_ipv4_and_ipv6_headers() {
    let mut f = v4_frame(IPPROTO_UDP, [10, 0, 0, 1], [10, 0, 0, 2], 5000, 6000);
    f.splice(12..12, [0x81, 0x00, 0x20, 0x07]);
    let h = FrameHeaders::parse(&f).unwrap();
    assert_eq!(h.vlan_tag, Some(0x2007));
    assert_eq!(h.ether_type, ETH_P_IPV4);
    assert_eq!(
        h.l4,
        Some(L4 {
            proto: IPPROTO_UDP,
            src_port: 5000,
            dst_port: 6000
        })
    );
    assert!(matches!(
        h.l3,
        Some(L3::V4 {
            ttl: 64,
            flags: 2,
            ..
        })
    ));
    let v6 = FrameHeaders::parse(&v6_frame(Ipv6Addr::LOCALHOST, Ipv6Addr::LOCALHOST, 1, 2)).unwrap();
    assert!(v6.is_multicast());
    assert!(matches!(
        v6.l3,
        Some(L3::V6 {
            flow_label: 0xABCDE,
            traffic_class: 0,
            hop_limit: 7,
            ..
        })
    ));
    assert!(FrameHeaders::parse(&[0; 13]).is_none());
    // A non-first fragment has no ports.
    let mut frag = v4_frame(IPPROTO_UDP, [1, 1, 1, 1], [2, 2, 2, 2], 1, 2);
    frag[14 + 7] = 8;
    assert_eq!(FrameHeaders::parse(&frag).unwrap().l4, None);
}

#[test]
fn specs_match_by_value_and_mask() {
    let frame = v4_frame(IPPROTO_UDP, [10, 0, 0, 1], [10, 0, 0, 2], 5000, 6000);
    let h = FrameHeaders::parse(&frame).unwrap();
    let full_mac = [0xFF; 6];
    let eth = |dst: [u8; 6]| FlowSpec::Eth {
        val: EthFilter {
            dst_mac: dst,
            ether_type: ETH_P_IPV4,
            ..Default::default()
        },
        mask: EthFilter {
            dst_mac: full_mac,
            ether_type: 0xFFFF,
            ..Default::default()
        },
    };
    assert!(eth([2, 0, 0, 0, 0, 1]).matches(&h));
    assert!(!eth([2, 0, 0, 0, 0, 3]).matches(&h));
    // A VLAN mask requires a tag.
    let vlan = FlowSpec::Eth {
        val: EthFilter {
            vlan_tag: 7,
            ..Default::default()
        },
        mask: EthFilter {
            vlan_tag: 0xFFF,
            ..Default::default()
        },
    };
    assert!(!vlan.matches(&h));
    let udp = |port: u16| FlowSpec::Udp {
        val: PortFilter {
            dst_port: port,
            src_port: 0,
        },
        mask: PortFilter {
            dst_port: 0xFFFF,
            src_port: 0,
        },
    };
    assert!(udp(6000).matches(&h));
    assert!(!udp(6001).matches(&h));
    let tcp = FlowSpec::Tcp {
        val: PortFilter::default(),
        mask: PortFilter::default(),
    };
    assert!(!tcp.matches(&h), "an L4 spec requires its protocol");
    let v4 = |dst: [u8; 4], m: u8| FlowSpec::Ipv4 {
        val: Ipv4Filter {
            dst_ip: dst.into(),
            ..Default::default()
        },
        mask: Ipv4Filter {
            dst_ip: [255, 255, 255, m].into(),
            ..Default::default()
        },
    };
    assert!(v4([10, 0, 0, 2], 255).matches(&h));
    assert!(!v4([10, 0, 0, 3], 255).matches(&h));
    assert!(v4([10, 0, 0, 3], 0).matches(&h), "masked-out bits are ignored");
    let v6 = FlowSpec::Ipv6 {
        val: Ipv6Filter::default(),
        mask: Ipv6Filter::default(),
    };
    assert!(!v6.matches(&h), "an IPv6 spec requires IPv6");
}

#[test]
fn hash_fields_are_validated() {
    assert!(RxHashFields::validate(0x3 | 0x30).is_ok());
    assert!(RxHashFields::validate(0x1 | 0x4).is_err());
    assert!(RxHashFields::validate(0x10 | 0x40).is_err());
    assert!(RxHashFields::validate(1 << 40).is_err());
}

#[test]
fn roce_datagram_headers_match_udp_and_ip_specs_but_never_tcp() {
    let mac = [0x02, 0x11, 0x22, 0x33, 0x44, 0x55];
    let src: SocketAddr = "10.0.0.1:49152".parse().unwrap();
    let dst: SocketAddr = "10.0.0.2:4791".parse().unwrap();
    let h = FrameHeaders::roce_datagram(mac, src, dst, 0, 64);
    let udp = |dst_port: u16, mask: u16| FlowSpec::Udp {
        val: PortFilter {
            dst_port,
            src_port: 0,
        },
        mask: PortFilter {
            dst_port: mask,
            src_port: 0,
        },
    };
    assert!(udp(4791, 0xFFFF).matches(&h));
    assert!(!udp(4792, 0xFFFF).matches(&h));
    let tcp = FlowSpec::Tcp {
        val: PortFilter::default(),
        mask: PortFilter::default(),
    };
    assert!(!tcp.matches(&h), "RoCE traffic is never TCP");
    let v4 = FlowSpec::Ipv4 {
        val: Ipv4Filter {
            src_ip: Ipv4Addr::new(10, 0, 0, 1),
            proto: IPPROTO_UDP,
            ..Default::default()
        },
        mask: Ipv4Filter {
            src_ip: Ipv4Addr::BROADCAST,
            proto: 0xFF,
            ..Default::default()
        },
    };
    assert!(v4.matches(&h));
    assert!(!FlowSpec::Ipv6 {
        val: Ipv6Filter::default(),
        mask: Ipv6Filter::default(),
    }
    .matches(&h));
    let eth = |val: EthFilter, mask: EthFilter| FlowSpec::Eth { val, mask }.matches(&h);
    let ones = [0xFF; 6];
    assert!(eth(
        EthFilter {
            dst_mac: mac,
            ether_type: 0x0800,
            ..Default::default()
        },
        EthFilter {
            dst_mac: ones,
            ether_type: 0xFFFF,
            ..Default::default()
        }
    ));
    assert!(
        !eth(
            EthFilter::default(),
            EthFilter {
                src_mac: ones,
                ..Default::default()
            }
        ),
        "the source MAC is unknown, so a rule on it cannot match"
    );
    assert!(
        !eth(
            EthFilter::default(),
            EthFilter {
                vlan_tag: 0xFFF,
                ..Default::default()
            }
        ),
        "no VLAN tag"
    );
}

#[test]
fn roce_datagram_to_a_group_goes_to_its_multicast_mac() {
    let src: SocketAddr = "[fe80::1]:1000".parse().unwrap();
    let dst: SocketAddr = "[ff12::1:2:3]:4791".parse().unwrap();
    let h = FrameHeaders::roce_datagram([0x02, 0, 0, 0, 0, 9], src, dst, 3, 1);
    assert_eq!(h.dst_mac, [0x33, 0x33, 0x00, 0x02, 0x00, 0x03]);
    assert!(h.is_multicast());
    assert_eq!(h.ether_type, 0x86DD);
    assert!(FlowSpec::Ipv6 {
        val: Ipv6Filter {
            dst_ip: "ff12::1:2:3".parse().unwrap(),
            next_hdr: IPPROTO_UDP,
            traffic_class: 3,
            ..Default::default()
        },
        mask: Ipv6Filter {
            dst_ip: Ipv6Addr::from([0xFF; 16]),
            next_hdr: 0xFF,
            traffic_class: 0xFF,
            ..Default::default()
        },
    }
    .matches(&h));
    assert_eq!(
        multicast_mac("239.129.2.3".parse().unwrap()),
        Some([0x01, 0x00, 0x5e, 0x01, 0x02, 0x03])
    );
    assert_eq!(multicast_mac("10.1.2.3".parse().unwrap()), None);
}
