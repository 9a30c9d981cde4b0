//! Conformance with the libibverbs man pages: every RETURN VALUE and NOTES statement that needs no
//! traffic, one module per man page. Teardown rules that a safe program cannot violate (EBUSY on
//! destroying an object still in use) are tested on the core object model in
//! `crates/device/tests/teardown.rs`.

mod common;

use std::net::Ipv4Addr;
use std::os::fd::AsFd;
use std::time::Duration;

use common::*;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use softverbs::*;

const EINVAL: i32 = 22;
const ENOMEM: i32 = 12;
const EAGAIN: i32 = 11;

fn readable(fd: &impl AsFd) -> bool {
    let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
    poll(&mut fds, PollTimeout::ZERO).unwrap() == 1
}

fn set_nonblocking(fd: &impl AsFd) {
    use nix::fcntl::{fcntl, FcntlArg, OFlag};
    use std::os::fd::AsRawFd;
    fcntl(fd.as_fd().as_raw_fd(), FcntlArg::F_SETFL(OFlag::O_NONBLOCK)).unwrap();
}

mod ibv_get_device_list {
    use super::*;

    #[test]
    fn returns_a_device_per_addressed_interface_including_loopback() {
        let list = devices().unwrap();
        assert!(
            list.iter().any(|d| d.netdev() == "lo"),
            "a fresh machine always has the loopback device"
        );
        let mut names: Vec<&str> = list.iter().map(Device::name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), list.len(), "device names are unique");
    }

    #[test]
    fn devices_keep_their_identity_across_calls() {
        let a = devices().unwrap();
        let b = devices().unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn interface_filter_selects_devices() {
        let cfg = Config {
            interfaces: Some(vec!["lo".into()]),
            ..Config::default()
        };
        let list = Device::discover(&cfg).unwrap();
        assert_eq!(list.len(), 1);
        assert_eq!(list[0].name(), "sv_lo");
        let none = Device::discover(&Config {
            interfaces: Some(vec!["no-such-if".into()]),
            ..Config::default()
        });
        assert!(none.unwrap().is_empty());
    }
}

mod ibv_get_device_name {
    use super::*;

    #[test]
    fn name_is_stable_and_derived_from_the_interface() {
        for d in devices().unwrap() {
            assert_eq!(d.name(), format!("sv_{}", d.netdev()));
            assert!(d.name().len() < 64, "fits IBV_SYSFS_NAME_MAX");
        }
    }
}

mod ibv_get_device_guid {
    use super::*;

    #[test]
    fn guid_is_stable_and_matches_query_device() {
        let d = devices()
            .unwrap()
            .into_iter()
            .find(|d| d.netdev() == "lo")
            .unwrap();
        let again = Device::discover(&Config {
            interfaces: Some(vec!["lo".into()]),
            ..Config::default()
        })
        .unwrap();
        assert_eq!(d.guid(), again[0].guid());
        assert_ne!(d.guid(), 0);
        assert_eq!(d.open().unwrap().query_device().node_guid, d.guid());
    }
}

mod ibv_open_device {
    use super::*;

    #[test]
    fn open_several_contexts_on_one_device() {
        let d = devices()
            .unwrap()
            .into_iter()
            .find(|d| d.netdev() == "lo")
            .unwrap();
        let a = d.open().unwrap();
        let b = d.open().unwrap();
        assert_eq!(a.device(), b.device());
        drop(a);
        assert!(
            b.alloc_pd().is_ok(),
            "closing one context leaves the other usable"
        );
    }
}

mod ibv_fork_init {
    use super::*;

    #[test]
    fn returns_success_and_fork_is_unneeded() {
        assert!(fork_init().is_ok());
        assert_eq!(is_fork_initialized(), ForkStatus::Unneeded);
    }
}

mod ibv_query_device {
    use super::*;

    #[test]
    fn reports_honest_roce_attributes() {
        let ctx = lo();
        let a = ctx.query_device();
        assert_eq!(a.phys_port_cnt, 1);
        assert_eq!(a.max_pkeys, 1);
        assert_eq!(a.atomic_cap, AtomicCap::Hca);
        assert!(a.max_qp > 0 && a.max_qp_wr > 0 && a.max_sge > 0 && a.max_cq > 0 && a.max_cqe > 0);
        assert!(a.max_mr > 0 && a.max_pd > 0 && a.max_srq > 0 && a.max_srq_wr > 0 && a.max_srq_sge > 0);
        assert!(a.max_qp_rd_atom > 0 && a.max_qp_init_rd_atom > 0);
        assert!(a.max_mcast_grp > 0 && a.max_total_mcast_qp_attach >= a.max_mcast_qp_attach);
        assert!(!a.fw_ver.is_empty());
        assert!(a.max_mw > 0, "memory windows are offered");
        assert_eq!(
            a.device_cap_flags & ((1 << 17) | (1 << 24)),
            (1 << 17) | (1 << 24),
            "IBV_DEVICE_MEM_WINDOW | IBV_DEVICE_MEM_WINDOW_TYPE_2B"
        );
        assert_eq!(
            a.device_cap_flags & 1,
            0,
            "QP resize (IBV_DEVICE_RESIZE_MAX_WR) is not offered"
        );
        assert_eq!(
            a.device_cap_flags & (1 << 4),
            0,
            "alternate paths (IBV_DEVICE_AUTO_PATH_MIG) are not offered"
        );
        assert_ne!(a.device_cap_flags & (1 << 13), 0, "SRQ resize is offered");
    }

    #[test]
    fn limits_are_upper_bounds_that_are_enforced() {
        let ctx = lo_with(
            "max_pd=2,max_cq=2,max_qp=1,max_mr=1,max_srq=1,max_ah=1,max_cqe=64,max_qp_wr=32,max_sge=2",
        );
        let a = ctx.query_device();
        assert_eq!(
            (a.max_pd, a.max_cq, a.max_qp, a.max_mr, a.max_cqe),
            (2, 2, 1, 1, 64)
        );
        let pd = ctx.alloc_pd().unwrap();
        let _pd2 = ctx.alloc_pd().unwrap();
        assert_eq!(ctx.alloc_pd().unwrap_err().errno(), ENOMEM);
        let cq = ctx.create_cq(64, None, 0).unwrap();
        let _cq2 = ctx.create_cq(1, None, 0).unwrap();
        assert_eq!(ctx.create_cq(1, None, 0).unwrap_err().errno(), ENOMEM);
        assert_eq!(
            lo_with("max_cqe=64").create_cq(65, None, 0).unwrap_err().errno(),
            EINVAL
        );
        let _mr = pd.register(64, AccessFlags::LOCAL_WRITE).unwrap();
        assert_eq!(
            pd.register(64, AccessFlags::LOCAL_WRITE).unwrap_err().errno(),
            ENOMEM
        );
        let _qp = pd.create_qp(&QpInit::new(QpType::Rc, &cq)).unwrap();
        assert_eq!(
            pd.create_qp(&QpInit::new(QpType::Rc, &cq)).unwrap_err().errno(),
            ENOMEM
        );
        let mut big = QpInit::new(QpType::Rc, &cq);
        big.cap.max_send_wr = 33;
        assert_eq!(
            lo_with("max_qp_wr=32")
                .alloc_pd()
                .unwrap()
                .create_qp(&big)
                .map(drop)
                .unwrap_err()
                .errno(),
            EINVAL
        );
        let _srq = pd
            .create_srq(&SrqAttr {
                max_wr: 4,
                max_sge: 1,
                srq_limit: 0,
            })
            .unwrap();
        assert_eq!(
            pd.create_srq(&SrqAttr {
                max_wr: 4,
                max_sge: 1,
                srq_limit: 0
            })
            .unwrap_err()
            .errno(),
            ENOMEM
        );
        let _ah = pd.create_ah(&ah_attr(&ctx)).unwrap();
        assert_eq!(pd.create_ah(&ah_attr(&ctx)).unwrap_err().errno(), ENOMEM);
    }

    #[test]
    fn limits_come_back_after_destroy() {
        let ctx = lo_with("max_pd=1");
        let pd = ctx.alloc_pd().unwrap();
        drop(pd);
        assert!(ctx.alloc_pd().is_ok());
    }
}

mod ibv_query_port {
    use super::*;

    #[test]
    fn port_one_is_an_active_roce_port() {
        let ctx = lo();
        let p = ctx.query_port(1).unwrap();
        assert_eq!(p.state, PortState::Active);
        assert_eq!(p.link_layer, 2, "IBV_LINK_LAYER_ETHERNET");
        assert_eq!(p.max_mtu, Mtu::Mtu4096);
        assert_eq!(p.active_mtu, Mtu::Mtu4096, "loopback gets 4096");
        assert_eq!(p.pkey_tbl_len, 1);
        assert!(p.gid_tbl_len >= 1);
        assert_eq!(p.lid, 0, "RoCE has no LIDs");
        assert_ne!(p.port_cap_flags & (1 << 26), 0, "IBV_PORT_IP_BASED_GIDS");
    }

    #[test]
    fn bad_port_is_einval() {
        let ctx = lo();
        assert_eq!(ctx.query_port(0).unwrap_err().errno(), EINVAL);
        assert_eq!(ctx.query_port(2).unwrap_err().errno(), EINVAL);
    }
}

mod ibv_query_gid {
    use super::*;

    #[test]
    fn first_entry_is_usable_and_loopback_addresses_are_present() {
        let ctx = lo();
        let len = ctx.query_port(1).unwrap().gid_tbl_len as i32;
        assert!(!ctx.query_gid(1, 0).unwrap().is_zero());
        let gids: Vec<Gid> = (0..len).map(|i| ctx.query_gid(1, i).unwrap()).collect();
        assert!(
            gids.contains(&Gid::from(Ipv4Addr::LOCALHOST)),
            "IPv4 addresses appear as ::ffff:a.b.c.d"
        );
        for (i, g) in gids.iter().enumerate() {
            if !g.is_zero() {
                assert_eq!(ctx.query_gid_type(1, i as i32).unwrap(), 2, "RoCE v2");
            }
        }
    }

    #[test]
    fn bad_index_or_port_is_an_error() {
        let ctx = lo();
        let len = ctx.query_port(1).unwrap().gid_tbl_len as i32;
        assert!(ctx.query_gid(1, len).is_err());
        assert!(ctx.query_gid(1, -1).is_err());
        assert!(ctx.query_gid(2, 0).is_err());
    }
}

mod ibv_query_pkey {
    use super::*;

    #[test]
    fn table_holds_the_default_pkey() {
        let ctx = lo();
        assert_eq!(ctx.query_pkey(1, 0).unwrap(), 0xFFFF);
        assert!(ctx.query_pkey(1, 1).is_err());
        assert!(ctx.query_pkey(3, 0).is_err());
        assert_eq!(ctx.pkey_index(1, 0xFFFF).unwrap(), 0);
        assert!(ctx.pkey_index(1, 0x1234).is_err());
    }
}

mod ibv_alloc_pd {
    use super::*;

    #[test]
    fn alloc_returns_a_pd_and_dealloc_happens_on_drop() {
        let ctx = lo_with("max_pd=1");
        let pd = ctx.alloc_pd().unwrap();
        let mr = pd.register(8, AccessFlags::empty()).unwrap();
        drop(pd); // the MR keeps the PD alive: deallocating it now would fail with EBUSY
        assert_eq!(ctx.alloc_pd().unwrap_err().errno(), ENOMEM);
        drop(mr);
        assert!(ctx.alloc_pd().is_ok());
    }
}

mod ibv_reg_mr {
    use super::*;

    #[test]
    fn remote_write_or_atomic_needs_local_write() {
        let pd = lo().alloc_pd().unwrap();
        for bad in [
            AccessFlags::REMOTE_WRITE,
            AccessFlags::REMOTE_ATOMIC,
            AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        ] {
            assert_eq!(pd.register(64, bad).unwrap_err().errno(), EINVAL, "{bad:?}");
        }
        for ok in [
            AccessFlags::empty(),
            AccessFlags::REMOTE_READ,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_ATOMIC | AccessFlags::REMOTE_READ,
            AccessFlags::LOCAL_WRITE | AccessFlags::RELAXED_ORDERING,
        ] {
            let mr = pd.register(64, ok).unwrap();
            assert_eq!(
                mr.access(),
                ok - AccessFlags::RELAXED_ORDERING,
                "optional flags may be dropped"
            );
        }
    }

    #[test]
    fn keys_are_unique_and_unpredictable() {
        let pd = lo().alloc_pd().unwrap();
        let mrs: Vec<_> = (0..64)
            .map(|_| pd.register(16, AccessFlags::LOCAL_WRITE).unwrap())
            .collect();
        let mut keys: Vec<u32> = mrs.iter().flat_map(|m| [m.lkey(), m.rkey()]).collect();
        keys.sort_unstable();
        keys.dedup();
        assert_eq!(keys.len(), 128, "every lkey and rkey is distinct");
        let consecutive = mrs
            .windows(2)
            .filter(|w| w[1].rkey().wrapping_sub(w[0].rkey()) < 256)
            .count();
        assert!(consecutive < 4, "rkeys must not be sequential");
    }

    #[test]
    fn region_reports_its_buffer() {
        let pd = lo().alloc_pd().unwrap();
        let mr = pd.register_bytes(&[7u8; 100], AccessFlags::LOCAL_WRITE).unwrap();
        assert_eq!(mr.len(), 100);
        mr.write(0, &[1]).unwrap();
        let mut two = [0u8; 2];
        mr.read(0, &mut two).unwrap();
        assert_eq!(two, [1, 7]);
        assert_eq!(mr.write(99, &[1, 2]).unwrap_err().errno(), EINVAL);
        let sge = mr.sge(10..20).unwrap();
        assert_eq!((sge.addr, sge.length, sge.lkey), (mr.addr() + 10, 10, mr.lkey()));
        assert_eq!(mr.sge(90..101).unwrap_err().errno(), EINVAL);
    }

    #[test]
    fn unknown_flags_are_einval_and_odp_is_accepted() {
        let pd = lo().alloc_pd().unwrap();
        let unknown = AccessFlags::LOCAL_WRITE | AccessFlags::from_bits_retain(1 << 15);
        assert_eq!(pd.register(64, unknown).unwrap_err().errno(), EINVAL);
        let odp = pd
            .register(64, AccessFlags::ON_DEMAND | AccessFlags::LOCAL_WRITE)
            .unwrap();
        assert!(odp.access().contains(AccessFlags::ON_DEMAND));
        let huge = AccessFlags::ON_DEMAND | AccessFlags::HUGETLB | AccessFlags::LOCAL_WRITE;
        assert!(pd.register(64, huge).is_ok());
        // The huge-page hint only applies to explicit ODP.
        assert_eq!(
            pd.register(64, AccessFlags::HUGETLB | AccessFlags::LOCAL_WRITE)
                .unwrap_err()
                .errno(),
            EINVAL
        );
    }

    #[test]
    fn zero_length_is_einval() {
        let pd = lo().alloc_pd().unwrap();
        assert_eq!(
            pd.register(0, AccessFlags::LOCAL_WRITE).unwrap_err().errno(),
            EINVAL
        );
    }
}

mod ibv_create_comp_channel {
    use super::*;

    #[test]
    fn channel_is_a_real_pollable_fd() {
        let ctx = lo();
        let ch = ctx.create_comp_channel().unwrap();
        assert!(!readable(&ch));
        set_nonblocking(&ch);
        assert_eq!(ch.get_cq_event().unwrap_err().errno(), EAGAIN);
    }
}

mod ibv_create_cq {
    use super::*;

    #[test]
    fn size_is_at_least_the_request() {
        let ctx = lo();
        for n in [1, 2, 3, 100, 1000, 4096] {
            let cq = ctx.create_cq(n, None, 0).unwrap();
            assert!(cq.cqe() >= n as u32, "{n} -> {}", cq.cqe());
        }
    }

    #[test]
    fn zero_negative_and_huge_sizes_are_einval() {
        let ctx = lo();
        let max = ctx.query_device().max_cqe as i32;
        for n in [0, -1, max + 1, i32::MAX] {
            assert_eq!(ctx.create_cq(n, None, 0).unwrap_err().errno(), EINVAL, "{n}");
        }
        assert!(ctx.create_cq(max, None, 0).is_ok());
    }

    #[test]
    fn comp_vector_must_be_below_num_comp_vectors() {
        let ctx = lo();
        assert!(ctx.create_cq(1, None, 0).is_ok());
        assert_eq!(ctx.create_cq(1, None, 1).unwrap_err().errno(), EINVAL);
        assert_eq!(ctx.create_cq(1, None, -1).unwrap_err().errno(), EINVAL);
    }

    #[test]
    fn channel_of_another_context_is_einval() {
        let a = lo();
        let b = lo();
        let ch = b.create_comp_channel().unwrap();
        assert_eq!(a.create_cq(4, Some(&ch), 0).unwrap_err().errno(), EINVAL);
    }
}

mod ibv_resize_cq {
    use super::*;

    #[test]
    fn resize_reports_actual_size_and_refuses_below_unpolled() {
        let ctx = lo();
        let cq = ctx.create_cq(4, None, 0).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let mr = pd.register(64, AccessFlags::LOCAL_WRITE).unwrap();
        let qp = pd.create_qp(&QpInit::new(QpType::Ud, &cq)).unwrap();
        to_init(&qp);
        qp.post_recv(&recv_wrs(&mr, 0..3, 8)).unwrap();
        to_err(&qp); // flushes three completions into the CQ
        assert_eq!(
            cq.resize(2).unwrap_err().errno(),
            EINVAL,
            "cqe must cover the 3 unpolled entries"
        );
        assert_eq!(drain(&cq).len(), 3, "a failed resize loses nothing");
        let n = cq.resize(100).unwrap();
        assert!(n >= 100);
        assert_eq!(cq.cqe(), n);
        assert_eq!(cq.resize(0).unwrap_err().errno(), EINVAL);
        assert_eq!(cq.cqe(), n, "a failed resize changes nothing");
    }
}

mod ibv_create_qp {
    use super::*;

    #[test]
    fn capabilities_are_at_least_the_request() {
        let ctx = lo();
        let cq = ctx.create_cq(16, None, 0).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        for t in [QpType::Rc, QpType::Uc, QpType::Ud] {
            let mut init = QpInit::new(t, &cq);
            init.cap = QpCap {
                max_send_wr: 5,
                max_recv_wr: 9,
                max_send_sge: 3,
                max_recv_sge: 2,
                max_inline_data: 20,
            };
            let qp = pd.create_qp(&init).unwrap();
            let c = qp.cap();
            assert!(c.max_send_wr >= 5 && c.max_recv_wr >= 9 && c.max_send_sge >= 3 && c.max_recv_sge >= 2);
            assert!(c.max_inline_data >= 20);
            assert_eq!(qp.state(), QpState::Reset);
            assert_eq!(qp.qp_type(), t);
            assert!(qp.qp_num() > 1 && qp.qp_num() <= 0xFF_FFFF, "check the QP number");
        }
    }

    #[test]
    fn qp_numbers_are_unique() {
        let ctx = lo();
        let cq = ctx.create_cq(16, None, 0).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let qps: Vec<_> = (0..32)
            .map(|_| pd.create_qp(&QpInit::new(QpType::Ud, &cq)).unwrap())
            .collect();
        let mut n: Vec<u32> = qps.iter().map(QueuePair::qp_num).collect();
        n.sort_unstable();
        n.dedup();
        assert_eq!(n.len(), 32);
    }

    #[test]
    fn uc_with_srq_fails_rc_and_ud_succeed() {
        let ctx = lo();
        let cq = ctx.create_cq(16, None, 0).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let srq = pd
            .create_srq(&SrqAttr {
                max_wr: 8,
                max_sge: 1,
                srq_limit: 0,
            })
            .unwrap();
        let mut init = QpInit::new(QpType::Uc, &cq);
        init.srq = Some(&srq);
        assert_eq!(pd.create_qp(&init).unwrap_err().errno(), EINVAL);
        for t in [QpType::Rc, QpType::Ud] {
            init.qp_type = t;
            assert!(pd.create_qp(&init).is_ok());
        }
    }

    #[test]
    fn recv_caps_are_ignored_with_an_srq() {
        let ctx = lo();
        let cq = ctx.create_cq(16, None, 0).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let srq = pd
            .create_srq(&SrqAttr {
                max_wr: 8,
                max_sge: 1,
                srq_limit: 0,
            })
            .unwrap();
        let mut init = QpInit::new(QpType::Rc, &cq);
        init.srq = Some(&srq);
        init.cap.max_recv_wr = u32::MAX; // would be EINVAL without the SRQ
        init.cap.max_recv_sge = u32::MAX;
        let qp = pd.create_qp(&init).unwrap();
        assert_eq!((qp.cap().max_recv_wr, qp.cap().max_recv_sge), (0, 0));
    }

    #[test]
    fn oversized_caps_and_foreign_cqs_are_einval() {
        let ctx = lo();
        let other = lo();
        let cq = ctx.create_cq(16, None, 0).unwrap();
        let foreign_cq = other.create_cq(16, None, 0).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let a = ctx.query_device();
        let caps = [
            QpCap {
                max_send_wr: a.max_qp_wr + 1,
                ..QpInit::new(QpType::Rc, &cq).cap
            },
            QpCap {
                max_recv_wr: a.max_qp_wr + 1,
                ..QpInit::new(QpType::Rc, &cq).cap
            },
            QpCap {
                max_send_sge: a.max_sge + 1,
                ..QpInit::new(QpType::Rc, &cq).cap
            },
            QpCap {
                max_recv_sge: a.max_sge + 1,
                ..QpInit::new(QpType::Rc, &cq).cap
            },
            QpCap {
                max_inline_data: 1 << 20,
                ..QpInit::new(QpType::Rc, &cq).cap
            },
        ];
        for cap in caps {
            let init = QpInit {
                cap,
                ..QpInit::new(QpType::Rc, &cq)
            };
            assert_eq!(pd.create_qp(&init).unwrap_err().errno(), EINVAL, "{cap:?}");
        }
        let init = QpInit {
            send_cq: &foreign_cq,
            ..QpInit::new(QpType::Rc, &cq)
        };
        assert_eq!(pd.create_qp(&init).unwrap_err().errno(), EINVAL);
        let init = QpInit {
            recv_cq: &foreign_cq,
            ..QpInit::new(QpType::Rc, &cq)
        };
        assert_eq!(pd.create_qp(&init).unwrap_err().errno(), EINVAL);
    }
}

mod ibv_modify_qp {
    use super::*;

    #[test]
    fn minimal_attribute_tables_bring_every_type_to_rts() {
        let ctx = lo();
        let cq = ctx.create_cq(16, None, 0).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        for t in [QpType::Rc, QpType::Uc, QpType::Ud] {
            let qp = pd.create_qp(&QpInit::new(t, &cq)).unwrap();
            to_rts(&ctx, &qp, 0x42);
            assert_eq!(qp.state(), QpState::Rts);
        }
    }

    #[test]
    fn invalid_request_modifies_nothing() {
        let ctx = lo();
        let cq = ctx.create_cq(16, None, 0).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let qp = pd.create_qp(&QpInit::new(QpType::Rc, &cq)).unwrap();
        to_init(&qp);
        let before = qp.query();
        // Valid PKEY_INDEX and ACCESS_FLAGS values, plus one invalid attribute (port 9).
        let attr = QpAttr {
            qp_state: QpState::Init,
            pkey_index: 0,
            port_num: 9,
            qp_access_flags: AccessFlags::REMOTE_READ,
            ..Default::default()
        };
        let e = qp
            .modify(
                &attr,
                QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS,
            )
            .unwrap_err();
        assert_eq!(e.errno(), EINVAL);
        assert!(e.to_string().contains("IBV_QP_PORT"), "{e}");
        assert_eq!(
            qp.query(),
            before,
            "no attribute changed, not even the access flags"
        );
        // A missing required attribute: INIT -> RTR without the AV.
        let e = qp
            .modify(
                &QpAttr {
                    qp_state: QpState::Rtr,
                    ..Default::default()
                },
                QpAttrMask::STATE | QpAttrMask::PATH_MTU,
            )
            .unwrap_err();
        assert!(e.to_string().contains("IBV_QP_AV"), "{e}");
        assert_eq!(qp.state(), QpState::Init, "the state did not change either");
        // An illegal transition.
        let e = qp
            .modify(
                &QpAttr {
                    qp_state: QpState::Rts,
                    ..Default::default()
                },
                QpAttrMask::STATE,
            )
            .unwrap_err();
        assert!(
            e.to_string().contains("INIT") && e.to_string().contains("RTS"),
            "{e}"
        );
    }

    #[test]
    fn qp_resize_and_alternate_paths_are_refused() {
        let ctx = lo();
        let cq = ctx.create_cq(16, None, 0).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let qp = pd.create_qp(&QpInit::new(QpType::Rc, &cq)).unwrap();
        to_rts(&ctx, &qp, 3);
        let e = qp
            .modify(
                &QpAttr {
                    qp_state: QpState::Rts,
                    ..Default::default()
                },
                QpAttrMask::STATE | QpAttrMask::CAP,
            )
            .unwrap_err();
        assert!(e.to_string().contains("IBV_QP_CAP"), "{e}");
        let e = qp
            .modify(
                &QpAttr {
                    qp_state: QpState::Rts,
                    ..Default::default()
                },
                QpAttrMask::STATE | QpAttrMask::ALT_PATH,
            )
            .unwrap_err();
        assert!(e.to_string().contains("IBV_QP_ALT_PATH"), "{e}");
    }

    #[test]
    fn roce_address_vectors_need_a_grh_and_a_valid_sgid() {
        let ctx = lo();
        let cq = ctx.create_cq(16, None, 0).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let qp = pd.create_qp(&QpInit::new(QpType::Rc, &cq)).unwrap();
        to_init(&qp);
        let mut attr = QpAttr {
            qp_state: QpState::Rtr,
            ah_attr: ah_attr(&ctx),
            path_mtu: Mtu::Mtu1024,
            dest_qp_num: 5,
            max_dest_rd_atomic: 1,
            ..Default::default()
        };
        let mask = QpAttrMask::STATE
            | QpAttrMask::AV
            | QpAttrMask::PATH_MTU
            | QpAttrMask::DEST_QPN
            | QpAttrMask::RQ_PSN
            | QpAttrMask::MAX_DEST_RD_ATOMIC
            | QpAttrMask::MIN_RNR_TIMER;
        attr.ah_attr.is_global = false;
        assert!(qp
            .modify(&attr, mask)
            .unwrap_err()
            .to_string()
            .contains("is_global"));
        attr.ah_attr = ah_attr(&ctx);
        attr.ah_attr.grh.sgid_index = 15;
        assert_eq!(qp.modify(&attr, mask).unwrap_err().errno(), EINVAL);
        attr.ah_attr = ah_attr(&ctx);
        qp.modify(&attr, mask).unwrap();
        assert_eq!(qp.state(), QpState::Rtr);
    }

    /// The kernel passes the flow label through unchecked and hardware keeps its low 20 bits;
    /// UCX sets all 32 on RoCE.
    #[test]
    fn a_wide_flow_label_is_kept_as_its_low_20_bits() {
        let ctx = lo();
        let cq = ctx.create_cq(16, None, 0).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let qp = pd.create_qp(&QpInit::new(QpType::Rc, &cq)).unwrap();
        to_init(&qp);
        let mut attr = QpAttr {
            qp_state: QpState::Rtr,
            ah_attr: ah_attr(&ctx),
            path_mtu: Mtu::Mtu1024,
            dest_qp_num: 5,
            max_dest_rd_atomic: 1,
            ..Default::default()
        };
        attr.ah_attr.grh.flow_label = 0xFFFF_FFFF;
        let mask = QpAttrMask::STATE
            | QpAttrMask::AV
            | QpAttrMask::PATH_MTU
            | QpAttrMask::DEST_QPN
            | QpAttrMask::RQ_PSN
            | QpAttrMask::MAX_DEST_RD_ATOMIC
            | QpAttrMask::MIN_RNR_TIMER;
        qp.modify(&attr, mask).unwrap();
        assert_eq!(qp.state(), QpState::Rtr);
        assert_eq!(qp.query().ah_attr.grh.flow_label, 0xF_FFFF);
    }

    #[test]
    fn sqd_with_notification_raises_sq_drained() {
        let ctx = lo();
        let cq = ctx.create_cq(16, None, 0).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let qp = pd.create_qp(&QpInit::new(QpType::Rc, &cq)).unwrap();
        to_rts(&ctx, &qp, 3);
        let attr = QpAttr {
            qp_state: QpState::Sqd,
            en_sqd_async_notify: true,
            ..Default::default()
        };
        qp.modify(&attr, QpAttrMask::STATE | QpAttrMask::EN_SQD_ASYNC_NOTIFY)
            .unwrap();
        assert_eq!(qp.state(), QpState::Sqd);
        let ev = ctx.get_async_event_timeout(Some(Duration::from_secs(5))).unwrap();
        assert_eq!(ev.event_type(), EventType::SqDrained);
        assert!(matches!(ev.target(), AsyncEventTarget::Qp(q) if q.same_as(&qp)));
        drop(ev);
        // SQD -> RTS again.
        qp.modify(
            &QpAttr {
                qp_state: QpState::Rts,
                ..Default::default()
            },
            QpAttrMask::STATE,
        )
        .unwrap();
        assert_eq!(qp.state(), QpState::Rts);
    }

    #[test]
    fn reset_empties_the_receive_queue_without_completions() {
        let ctx = lo();
        let cq = ctx.create_cq(16, None, 0).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let mr = pd.register(64, AccessFlags::LOCAL_WRITE).unwrap();
        let qp = pd.create_qp(&QpInit::new(QpType::Rc, &cq)).unwrap();
        to_init(&qp);
        qp.post_recv(&recv_wrs(&mr, 0..4, 8)).unwrap();
        qp.modify(
            &QpAttr {
                qp_state: QpState::Reset,
                ..Default::default()
            },
            QpAttrMask::STATE,
        )
        .unwrap();
        assert!(drain(&cq).is_empty());
        to_init(&qp);
        to_err(&qp);
        assert!(drain(&cq).is_empty(), "nothing left to flush after the reset");
    }
}

mod ibv_query_qp {
    use super::*;

    #[test]
    fn attributes_set_by_modify_are_returned() {
        let ctx = lo();
        let cq = ctx.create_cq(16, None, 0).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let qp = pd.create_qp(&QpInit::new(QpType::Rc, &cq)).unwrap();
        to_rts(&ctx, &qp, 0x1234);
        let a = qp.query();
        assert_eq!(a.qp_state, QpState::Rts);
        assert_eq!(a.dest_qp_num, 0x1234);
        assert_eq!(a.path_mtu, Mtu::Mtu1024);
        assert_eq!(
            (a.timeout, a.retry_cnt, a.rnr_retry, a.min_rnr_timer),
            (14, 7, 7, 12)
        );
        assert_eq!((a.max_rd_atomic, a.max_dest_rd_atomic), (1, 1));
        assert_eq!((a.sq_psn, a.rq_psn), (1, 1));
        assert_eq!(a.port_num, 1);
        assert_eq!(a.qp_access_flags, AccessFlags::REMOTE_WRITE);
        assert_eq!(a.ah_attr, ah_attr(&ctx));
        assert_eq!(a.cap, qp.cap());
    }
}

mod ibv_create_srq {
    use super::*;

    #[test]
    fn sizes_are_at_least_the_request() {
        let pd = lo().alloc_pd().unwrap();
        let srq = pd
            .create_srq(&SrqAttr {
                max_wr: 100,
                max_sge: 3,
                srq_limit: 50,
            })
            .unwrap();
        let a = srq.query();
        assert!(a.max_wr >= 100 && a.max_sge >= 3);
        assert_eq!(a.srq_limit, 0, "srq_limit is irrelevant at creation");
    }

    #[test]
    fn zero_and_huge_sizes_are_einval() {
        let ctx = lo();
        let pd = ctx.alloc_pd().unwrap();
        let a = ctx.query_device();
        for attr in [
            SrqAttr {
                max_wr: 0,
                max_sge: 1,
                srq_limit: 0,
            },
            SrqAttr {
                max_wr: a.max_srq_wr + 1,
                max_sge: 1,
                srq_limit: 0,
            },
            SrqAttr {
                max_wr: 4,
                max_sge: a.max_srq_sge + 1,
                srq_limit: 0,
            },
        ] {
            assert_eq!(pd.create_srq(&attr).unwrap_err().errno(), EINVAL, "{attr:?}");
        }
    }
}

mod ibv_modify_srq {
    use super::*;

    #[test]
    fn limit_arms_and_resize_works() {
        let pd = lo().alloc_pd().unwrap();
        let srq = pd
            .create_srq(&SrqAttr {
                max_wr: 16,
                max_sge: 1,
                srq_limit: 0,
            })
            .unwrap();
        srq.modify(
            &SrqAttr {
                srq_limit: 4,
                ..Default::default()
            },
            SrqAttrMask::LIMIT.bits(),
        )
        .unwrap();
        assert_eq!(srq.query().srq_limit, 4);
        srq.modify(
            &SrqAttr {
                max_wr: 64,
                ..Default::default()
            },
            SrqAttrMask::MAX_WR.bits(),
        )
        .unwrap();
        assert!(srq.query().max_wr >= 64);
        assert_eq!(srq.query().srq_limit, 4);
    }

    #[test]
    fn invalid_attribute_modifies_nothing() {
        let pd = lo().alloc_pd().unwrap();
        let mr = pd.register(64, AccessFlags::LOCAL_WRITE).unwrap();
        let srq = pd
            .create_srq(&SrqAttr {
                max_wr: 16,
                max_sge: 1,
                srq_limit: 0,
            })
            .unwrap();
        let before = srq.query();
        // A valid new size with an invalid limit: neither is applied.
        let e = srq.modify(
            &SrqAttr {
                max_wr: 32,
                max_sge: 0,
                srq_limit: 1000,
            },
            (SrqAttrMask::MAX_WR | SrqAttrMask::LIMIT).bits(),
        );
        assert_eq!(e.unwrap_err().errno(), EINVAL);
        assert_eq!(srq.query(), before);
        assert_eq!(
            srq.modify(&before, 1 << 5).unwrap_err().errno(),
            EINVAL,
            "unknown mask bits"
        );
        srq.post_recv(&recv_wrs(&mr, 0..10, 8)).unwrap();
        let e = srq
            .modify(&SrqAttr { max_wr: 5, ..before }, SrqAttrMask::MAX_WR.bits())
            .unwrap_err();
        assert_eq!(e.errno(), EINVAL, "cannot shrink below the posted WRs");
        assert_eq!(srq.query(), before);
    }
}

mod ibv_query_srq {
    use super::*;

    #[test]
    fn limit_zero_means_not_armed() {
        let pd = lo().alloc_pd().unwrap();
        let srq = pd
            .create_srq(&SrqAttr {
                max_wr: 8,
                max_sge: 1,
                srq_limit: 0,
            })
            .unwrap();
        assert_eq!(srq.query().srq_limit, 0);
        srq.modify(
            &SrqAttr {
                srq_limit: 2,
                ..Default::default()
            },
            SrqAttrMask::LIMIT.bits(),
        )
        .unwrap();
        assert_eq!(srq.query().srq_limit, 2);
        srq.modify(
            &SrqAttr {
                srq_limit: 0,
                ..Default::default()
            },
            SrqAttrMask::LIMIT.bits(),
        )
        .unwrap();
        assert_eq!(srq.query().srq_limit, 0, "disarmed");
    }
}

mod ibv_post_recv {
    use super::*;

    #[test]
    fn stops_at_the_first_bad_wr_and_reports_it() {
        let ctx = lo();
        let cq = ctx.create_cq(64, None, 0).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let mr = pd.register(64, AccessFlags::LOCAL_WRITE).unwrap();
        let qp = pd.create_qp(&QpInit::new(QpType::Rc, &cq)).unwrap();
        to_init(&qp);
        let mut wrs = recv_wrs(&mr, 0..3, 8);
        wrs[1].sg_list.push(mr.sge(8..16).unwrap()); // two SGEs, but max_recv_sge is 1
        let e = qp.post_recv(&wrs).unwrap_err();
        assert_eq!((e.index, e.error.errno()), (1, EINVAL));
        to_err(&qp);
        let done = drain(&cq);
        assert_eq!(
            done.iter().map(|w| w.wr_id).collect::<Vec<_>>(),
            vec![0],
            "only the WR before the bad one was posted"
        );
    }

    #[test]
    fn full_queue_and_reset_state_are_refused() {
        let ctx = lo();
        let cq = ctx.create_cq(64, None, 0).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let mr = pd.register(64, AccessFlags::LOCAL_WRITE).unwrap();
        let qp = pd.create_qp(&QpInit::new(QpType::Ud, &cq)).unwrap();
        assert_eq!(
            qp.post_recv(&recv_wrs(&mr, 0..1, 8)).unwrap_err().error.errno(),
            EINVAL,
            "RESET state"
        );
        to_init(&qp);
        let depth = qp.cap().max_recv_wr as u64;
        let e = qp.post_recv(&recv_wrs(&mr, 0..depth + 1, 8)).unwrap_err();
        assert_eq!((e.index as u64, e.error.errno()), (depth, ENOMEM));
    }

    #[test]
    fn qp_with_srq_must_use_post_srq_recv() {
        let ctx = lo();
        let cq = ctx.create_cq(16, None, 0).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let mr = pd.register(64, AccessFlags::LOCAL_WRITE).unwrap();
        let srq = pd
            .create_srq(&SrqAttr {
                max_wr: 8,
                max_sge: 1,
                srq_limit: 0,
            })
            .unwrap();
        let qp = pd
            .create_qp(&QpInit {
                srq: Some(&srq),
                ..QpInit::new(QpType::Rc, &cq)
            })
            .unwrap();
        to_init(&qp);
        assert_eq!(
            qp.post_recv(&recv_wrs(&mr, 0..1, 8)).unwrap_err().error.errno(),
            EINVAL
        );
    }
}

mod ibv_post_srq_recv {
    use super::*;

    #[test]
    fn stops_at_the_first_bad_wr() {
        let pd = lo().alloc_pd().unwrap();
        let mr = pd.register(64, AccessFlags::LOCAL_WRITE).unwrap();
        let srq = pd
            .create_srq(&SrqAttr {
                max_wr: 4,
                max_sge: 1,
                srq_limit: 0,
            })
            .unwrap();
        let depth = srq.query().max_wr as u64;
        let e = srq.post_recv(&recv_wrs(&mr, 0..depth + 2, 8)).unwrap_err();
        assert_eq!((e.index as u64, e.error.errno()), (depth, ENOMEM));
        assert_eq!(srq.len() as u64, depth);
    }
}

mod ibv_poll_cq {
    use super::*;

    #[test]
    fn returns_the_number_found_and_removes_them() {
        let ctx = lo();
        let cq = ctx.create_cq(16, None, 0).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let mr = pd.register(64, AccessFlags::LOCAL_WRITE).unwrap();
        let qp = pd.create_qp(&QpInit::new(QpType::Rc, &cq)).unwrap();
        let mut wc = [WorkCompletion::default(); 4];
        assert_eq!(cq.poll(&mut wc), 0);
        to_init(&qp);
        qp.post_recv(&recv_wrs(&mr, 10..16, 8)).unwrap();
        to_err(&qp);
        assert_eq!(cq.poll(&mut wc), 4, "at most num_entries");
        assert_eq!(cq.poll(&mut wc), 2, "then the rest");
        assert_eq!(cq.poll(&mut wc), 0, "each completion is returned once");
    }

    #[test]
    fn error_completions_carry_wr_id_status_and_qp_num() {
        let ctx = lo();
        let cq = ctx.create_cq(16, None, 0).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let mr = pd.register(64, AccessFlags::LOCAL_WRITE).unwrap();
        let qp = pd.create_qp(&QpInit::new(QpType::Uc, &cq)).unwrap();
        to_init(&qp);
        qp.post_recv(&recv_wrs(&mr, 7..9, 8)).unwrap();
        to_err(&qp);
        let done = drain(&cq);
        assert_eq!(done.len(), 2);
        for (wc, id) in done.iter().zip([7, 8]) {
            assert_eq!(
                (wc.wr_id, wc.status, wc.qp_num),
                (id, WcStatus::WrFlushErr, qp.qp_num())
            );
        }
        // A QP already in ERR flushes new receives at once.
        qp.post_recv(&recv_wrs(&mr, 9..10, 8)).unwrap();
        assert_eq!(drain(&cq)[0].wr_id, 9);
    }
}

mod ibv_req_notify_cq {
    use super::*;

    fn flush_one(qp: &QueuePair, mr: &MemoryRegion, id: u64) {
        qp.post_recv(&recv_wrs(mr, id..id + 1, 8)).unwrap();
    }

    #[test]
    fn notification_is_one_shot() {
        let ctx = lo();
        let ch = ctx.create_comp_channel().unwrap();
        let cq = ctx.create_cq(16, Some(&ch), 0).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let mr = pd.register(64, AccessFlags::LOCAL_WRITE).unwrap();
        let qp = pd.create_qp(&QpInit::new(QpType::Rc, &cq)).unwrap();
        to_init(&qp);
        to_err(&qp);
        flush_one(&qp, &mr, 1);
        assert!(!readable(&ch), "no event without a request");
        cq.req_notify(false).unwrap();
        flush_one(&qp, &mr, 2);
        flush_one(&qp, &mr, 3);
        assert!(readable(&ch));
        let ev = ch.get_cq_event().unwrap();
        assert!(ev.cq().same_as(&cq));
        ev.ack();
        assert!(!readable(&ch), "one event for two completions");
        cq.req_notify(false).unwrap();
        flush_one(&qp, &mr, 4);
        assert!(
            ch.get_cq_event_timeout(Some(Duration::from_secs(5))).is_ok(),
            "re-arming gives the next event"
        );
        assert_eq!(drain(&cq).len(), 4);
    }

    #[test]
    fn solicited_only_fires_for_unsuccessful_completions() {
        // ibv_req_notify_cq(3): a completion whose status is not success is solicited.
        let ctx = lo();
        let ch = ctx.create_comp_channel().unwrap();
        let cq = ctx.create_cq(16, Some(&ch), 0).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let mr = pd.register(64, AccessFlags::LOCAL_WRITE).unwrap();
        let qp = pd.create_qp(&QpInit::new(QpType::Rc, &cq)).unwrap();
        to_init(&qp);
        to_err(&qp);
        cq.req_notify(true).unwrap();
        flush_one(&qp, &mr, 1);
        let ev = ch.get_cq_event_timeout(Some(Duration::from_secs(5))).unwrap();
        assert!(ev.cq().same_as(&cq));
    }

    #[test]
    fn completions_queued_before_the_request_do_not_fire_it() {
        let ctx = lo();
        let ch = ctx.create_comp_channel().unwrap();
        let cq = ctx.create_cq(16, Some(&ch), 0).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let mr = pd.register(64, AccessFlags::LOCAL_WRITE).unwrap();
        let qp = pd.create_qp(&QpInit::new(QpType::Rc, &cq)).unwrap();
        to_init(&qp);
        to_err(&qp);
        flush_one(&qp, &mr, 1);
        cq.req_notify(false).unwrap();
        assert!(!readable(&ch));
    }
}

mod ibv_get_cq_event {
    use super::*;

    #[test]
    fn events_are_acknowledged_and_counted() {
        let ctx = lo();
        let ch = ctx.create_comp_channel().unwrap();
        let cq = ctx.create_cq(16, Some(&ch), 0).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let mr = pd.register(64, AccessFlags::LOCAL_WRITE).unwrap();
        let qp = pd.create_qp(&QpInit::new(QpType::Rc, &cq)).unwrap();
        to_init(&qp);
        to_err(&qp);
        for i in 0..3 {
            cq.req_notify(false).unwrap();
            qp.post_recv(&recv_wrs(&mr, i..i + 1, 8)).unwrap();
            let ev = ch.get_cq_event().unwrap();
            assert!(ev.cq().same_as(&cq));
        }
        set_nonblocking(&ch);
        assert_eq!(ch.get_cq_event().unwrap_err().errno(), EAGAIN);
    }

    #[test]
    fn blocking_get_wakes_on_the_event() {
        let ctx = lo();
        let ch = ctx.create_comp_channel().unwrap();
        let cq = ctx.create_cq(16, Some(&ch), 0).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let mr = pd.register(64, AccessFlags::LOCAL_WRITE).unwrap();
        let qp = pd.create_qp(&QpInit::new(QpType::Rc, &cq)).unwrap();
        to_init(&qp);
        to_err(&qp);
        cq.req_notify(false).unwrap();
        let waiter = {
            let ch = ch.clone();
            std::thread::spawn(move || {
                ch.get_cq_event_timeout(Some(Duration::from_secs(10)))
                    .map(|e| e.cq().cqe())
            })
        };
        qp.post_recv(&recv_wrs(&mr, 0..1, 8)).unwrap();
        assert_eq!(waiter.join().unwrap().unwrap(), cq.cqe());
    }
}

mod ibv_get_async_event {
    use super::*;

    #[test]
    fn last_wqe_reached_for_srq_qps_entering_error() {
        let ctx = lo();
        let cq = ctx.create_cq(16, None, 0).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let srq = pd
            .create_srq(&SrqAttr {
                max_wr: 8,
                max_sge: 1,
                srq_limit: 0,
            })
            .unwrap();
        let qp = pd
            .create_qp(&QpInit {
                srq: Some(&srq),
                ..QpInit::new(QpType::Rc, &cq)
            })
            .unwrap();
        to_init(&qp);
        assert!(!readable(&ctx));
        to_err(&qp);
        assert!(
            readable(&ctx),
            "the async fd is readable while an event is pending"
        );
        let ev = ctx.get_async_event().unwrap();
        assert_eq!(ev.event_type(), EventType::QpLastWqeReached);
        assert!(matches!(ev.target(), AsyncEventTarget::Qp(q) if q.same_as(&qp)));
        assert!(!readable(&ctx));
    }

    #[test]
    fn each_event_goes_to_exactly_one_of_several_threads() {
        let ctx = lo();
        let cq = ctx.create_cq(16, None, 0).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let srq = pd
            .create_srq(&SrqAttr {
                max_wr: 8,
                max_sge: 1,
                srq_limit: 0,
            })
            .unwrap();
        let qps: Vec<_> = (0..4)
            .map(|_| {
                pd.create_qp(&QpInit {
                    srq: Some(&srq),
                    ..QpInit::new(QpType::Ud, &cq)
                })
                .unwrap()
            })
            .collect();
        let waiters: Vec<_> = (0..4)
            .map(|_| {
                let ctx = ctx.clone();
                std::thread::spawn(move || {
                    let ev = ctx
                        .get_async_event_timeout(Some(Duration::from_secs(10)))
                        .unwrap();
                    match ev.target() {
                        AsyncEventTarget::Qp(q) => q.qp_num(),
                        other => panic!("{other:?}"),
                    }
                })
            })
            .collect();
        for qp in &qps {
            to_init(qp);
            to_err(qp);
        }
        let mut got: Vec<u32> = waiters.into_iter().map(|w| w.join().unwrap()).collect();
        got.sort_unstable();
        let mut want: Vec<u32> = qps.iter().map(QueuePair::qp_num).collect();
        want.sort_unstable();
        assert_eq!(got, want);
        assert_eq!(ctx.pending_async_events(), 0);
    }

    #[test]
    fn nonblocking_fd_gives_eagain() {
        let ctx = lo();
        set_nonblocking(&ctx);
        assert_eq!(ctx.get_async_event().unwrap_err().errno(), EAGAIN);
    }

    #[test]
    fn event_keeps_its_object_alive_until_acknowledged() {
        let ctx = lo();
        let cq = ctx.create_cq(16, None, 0).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let srq = pd
            .create_srq(&SrqAttr {
                max_wr: 8,
                max_sge: 1,
                srq_limit: 0,
            })
            .unwrap();
        let qp = pd
            .create_qp(&QpInit {
                srq: Some(&srq),
                ..QpInit::new(QpType::Rc, &cq)
            })
            .unwrap();
        let qpn = qp.qp_num();
        to_init(&qp);
        to_err(&qp);
        let ev = ctx.get_async_event().unwrap();
        drop(qp); // not destroyed yet: the event holds it
        match ev.target() {
            AsyncEventTarget::Qp(q) => assert_eq!(q.qp_num(), qpn),
            other => panic!("{other:?}"),
        }
        drop(ev); // acknowledges, then the QP is destroyed
    }
}

mod ibv_attach_mcast {
    use super::*;

    fn mgid() -> Gid {
        Gid::from(Ipv4Addr::new(239, 1, 2, 3))
    }

    #[test]
    fn only_ud_qps_and_multicast_gids() {
        let ctx = lo();
        let cq = ctx.create_cq(16, None, 0).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        for t in [QpType::Rc, QpType::Uc] {
            let qp = pd.create_qp(&QpInit::new(t, &cq)).unwrap();
            assert_eq!(qp.attach_mcast(&mgid(), 0).unwrap_err().errno(), EINVAL);
        }
        let ud = pd.create_qp(&QpInit::new(QpType::Ud, &cq)).unwrap();
        assert_eq!(
            ud.attach_mcast(&Gid::from(Ipv4Addr::LOCALHOST), 0)
                .unwrap_err()
                .errno(),
            EINVAL
        );
        ud.attach_mcast(&mgid(), 0).unwrap();
    }

    #[test]
    fn attaching_twice_is_harmless_and_detach_undoes_it() {
        let ctx = lo_with("max_total_mcast_qp_attach=1");
        let cq = ctx.create_cq(16, None, 0).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let qp = pd.create_qp(&QpInit::new(QpType::Ud, &cq)).unwrap();
        qp.attach_mcast(&mgid(), 0).unwrap();
        qp.attach_mcast(&mgid(), 0).unwrap();
        let other = pd.create_qp(&QpInit::new(QpType::Ud, &cq)).unwrap();
        assert_eq!(
            other.attach_mcast(&mgid(), 0).unwrap_err().errno(),
            ENOMEM,
            "the second attach took no slot"
        );
        qp.detach_mcast(&mgid(), 0).unwrap();
        assert_eq!(qp.detach_mcast(&mgid(), 0).unwrap_err().errno(), EINVAL);
        other.attach_mcast(&mgid(), 0).unwrap();
    }

    #[test]
    fn group_limits_are_enforced() {
        let ctx = lo_with("max_mcast_grp=1,max_mcast_qp_attach=1");
        let cq = ctx.create_cq(16, None, 0).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let a = pd.create_qp(&QpInit::new(QpType::Ud, &cq)).unwrap();
        let b = pd.create_qp(&QpInit::new(QpType::Ud, &cq)).unwrap();
        a.attach_mcast(&mgid(), 0).unwrap();
        assert_eq!(
            a.attach_mcast(&Gid::from(Ipv4Addr::new(239, 9, 9, 9)), 0)
                .unwrap_err()
                .errno(),
            ENOMEM
        );
        assert_eq!(b.attach_mcast(&mgid(), 0).unwrap_err().errno(), ENOMEM);
        drop(a); // detaches on drop
        b.attach_mcast(&mgid(), 0).unwrap();
    }
}

mod ibv_create_ah {
    use super::*;

    #[test]
    fn needs_a_grh_a_valid_port_and_sgid() {
        let ctx = lo();
        let pd = ctx.alloc_pd().unwrap();
        let ah = pd.create_ah(&ah_attr(&ctx)).unwrap();
        assert_eq!(ah.attr(), &ah_attr(&ctx));
        let mut bad = ah_attr(&ctx);
        bad.is_global = false;
        assert_eq!(pd.create_ah(&bad).unwrap_err().errno(), EINVAL);
        let mut bad = ah_attr(&ctx);
        bad.port_num = 2;
        assert_eq!(pd.create_ah(&bad).unwrap_err().errno(), EINVAL);
        let mut bad = ah_attr(&ctx);
        bad.grh.sgid_index = 200;
        assert_eq!(pd.create_ah(&bad).unwrap_err().errno(), EINVAL);
        let mut bad = ah_attr(&ctx);
        bad.grh.dgid = Gid::ZERO;
        assert_eq!(pd.create_ah(&bad).unwrap_err().errno(), EINVAL);
    }

    /// As with `ibv_modify_qp`, a flow label is kept as its low 20 bits, not refused.
    #[test]
    fn a_wide_flow_label_is_kept_as_its_low_20_bits() {
        let ctx = lo();
        let pd = ctx.alloc_pd().unwrap();
        let mut attr = ah_attr(&ctx);
        attr.grh.flow_label = 0xFFFF_FFFF;
        let ah = pd.create_ah(&attr).unwrap();
        assert_eq!(ah.attr().grh.flow_label, 0xF_FFFF);
    }
}

mod ibv_create_ah_from_wc {
    use super::*;

    fn ud_wc() -> WorkCompletion {
        WorkCompletion {
            opcode: WcOpcode::Recv,
            wc_flags: WcFlags::GRH,
            src_qp: 77,
            ..Default::default()
        }
    }

    fn ipv4_grh(src: Ipv4Addr, dst: Ipv4Addr) -> [u8; 40] {
        let mut g = [0u8; 40];
        g[20] = 0x45;
        g[21] = 0x10; // TOS
        g[28] = 64; // TTL
        g[29] = 17; // UDP
        g[32..36].copy_from_slice(&src.octets());
        g[36..40].copy_from_slice(&dst.octets());
        g
    }

    #[test]
    fn init_ah_from_wc_fills_an_attr_that_create_ah_accepts() {
        let ctx = lo();
        let grh = ipv4_grh(Ipv4Addr::new(127, 0, 0, 1), Ipv4Addr::LOCALHOST);
        let attr = ctx.init_ah_from_wc(1, &ud_wc(), &grh).unwrap();
        assert!(attr.is_global);
        assert_eq!(attr.grh.dgid, Gid::from(Ipv4Addr::LOCALHOST));
        assert_eq!(
            ctx.query_gid(1, i32::from(attr.grh.sgid_index)).unwrap(),
            Gid::from(Ipv4Addr::LOCALHOST)
        );
        assert_eq!(attr.grh.traffic_class, 0x10);
        let pd = ctx.alloc_pd().unwrap();
        pd.create_ah(&attr).unwrap();
        let ah = pd.create_ah_from_wc(&ud_wc(), &grh, 1).unwrap();
        assert_eq!(ah.attr(), &attr);
    }

    #[test]
    fn ipv6_grh_is_understood() {
        let ctx = lo();
        let Some(idx) =
            (0..16).find(|&i| ctx.query_gid(1, i).unwrap() == Gid::from(std::net::Ipv6Addr::LOCALHOST))
        else {
            return; // this host's loopback has no IPv6 address
        };
        let mut g = [0u8; 40];
        g[0] = 0x60;
        g[1] = 0x20; // traffic class 0x02
        g[6] = 17;
        g[7] = 64;
        g[8..24].copy_from_slice(&std::net::Ipv6Addr::LOCALHOST.octets());
        g[24..40].copy_from_slice(&std::net::Ipv6Addr::LOCALHOST.octets());
        let attr = ctx.init_ah_from_wc(1, &ud_wc(), &g).unwrap();
        assert_eq!(i32::from(attr.grh.sgid_index), idx);
        assert_eq!(attr.grh.traffic_class, 2);
    }

    #[test]
    fn errors_without_grh_or_with_a_foreign_destination() {
        let ctx = lo();
        let grh = ipv4_grh(Ipv4Addr::new(127, 0, 0, 1), Ipv4Addr::LOCALHOST);
        let no_grh = WorkCompletion {
            wc_flags: WcFlags::empty(),
            ..ud_wc()
        };
        assert!(ctx.init_ah_from_wc(1, &no_grh, &grh).is_err());
        assert!(ctx.init_ah_from_wc(2, &ud_wc(), &grh).is_err());
        assert!(ctx.init_ah_from_wc(1, &ud_wc(), &grh[..39]).is_err());
        let foreign = ipv4_grh(Ipv4Addr::LOCALHOST, Ipv4Addr::new(203, 0, 113, 9));
        assert!(ctx.init_ah_from_wc(1, &ud_wc(), &foreign).is_err());
        assert!(ctx.init_ah_from_wc(1, &ud_wc(), &[0u8; 40]).is_err());
        let pd = ctx.alloc_pd().unwrap();
        assert!(pd.create_ah_from_wc(&no_grh, &grh, 1).is_err());
    }
}

mod ibv_rate_to_mult {
    use super::*;

    #[test]
    fn man_page_examples_and_mbps_variants() {
        assert_eq!(rate_to_mult(5), 2, "IBV_RATE_5_GBPS -> 2");
        assert_eq!(mult_to_rate(2), 5, "2 -> IBV_RATE_5_GBPS");
        assert_eq!(rate_to_mult(2), 1);
        assert_eq!(rate_to_mbps(3), 10000, "IBV_RATE_10_GBPS");
        assert_eq!(mbps_to_rate(25781), 15, "IBV_RATE_25_GBPS");
        assert_eq!(mult_to_rate(1000), 0, "unknown multiplier -> IBV_RATE_MAX");
        assert_eq!(rate_to_mult(0), -1);
    }
}
