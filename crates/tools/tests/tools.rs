//! The `ibv_*` binaries run as processes (each killed if it outlives a bound), checking their
//! output against rdma-core's layout, plus the async event formatting on real events.

use std::io::Read;
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use softverbs::*;
use softverbs_tools::asyncwatch;

const BOUND: Duration = Duration::from_secs(30);

struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// Runs `bin` with `args`, killing it after [`BOUND`].
fn run(bin: &str, args: &[&str]) -> Run {
    let mut child = Command::new(bin)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let out_reader = thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err_reader = thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + BOUND;
    let code = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st.code();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        thread::sleep(Duration::from_millis(10));
    };
    Run {
        code,
        stdout: out_reader.join().unwrap(),
        stderr: err_reader.join().unwrap(),
    }
}

fn lo() -> Device {
    devices()
        .unwrap()
        .into_iter()
        .find(|d| d.netdev() == "lo")
        .expect("a loopback device")
}

mod ibv_devices {
    use super::*;

    #[test]
    fn lists_every_device_with_its_guid_in_the_rdma_core_layout() {
        let r = run(env!("CARGO_BIN_EXE_ibv_devices"), &[]);
        assert_eq!(r.code, Some(0), "{}", r.stderr);
        let lines: Vec<&str> = r.stdout.lines().collect();
        assert_eq!(lines[0], "    device          \t   node GUID");
        assert_eq!(lines[1], "    ------          \t----------------");
        let lo = lo();
        assert!(
            lines.contains(&format!("    {:<16}\t{:016x}", lo.name(), lo.guid()).as_str()),
            "{}",
            r.stdout
        );
        assert_eq!(lines.len(), 2 + devices().unwrap().len());
        for l in &lines[2..] {
            let (name, guid) = l.trim_start().split_once('\t').unwrap();
            assert!(name.trim_end().starts_with("sv_"), "{l}");
            assert!(
                guid.len() == 16 && guid.bytes().all(|b| b.is_ascii_hexdigit()),
                "{l}"
            );
        }
    }
}

mod ibv_devinfo {
    use super::*;

    const BIN: &str = env!("CARGO_BIN_EXE_ibv_devinfo");

    #[test]
    fn default_output_has_the_device_and_port_fields() {
        let r = run(BIN, &["-d", "sv_lo"]);
        assert_eq!(r.code, Some(0), "{}", r.stderr);
        let guid = lo().guid();
        let guid_text = format!(
            "{:04x}:{:04x}:{:04x}:{:04x}",
            guid >> 48,
            (guid >> 32) & 0xffff,
            (guid >> 16) & 0xffff,
            guid & 0xffff
        );
        for expected in [
            "hca_id:\tsv_lo\n".to_string(),
            "\ttransport:\t\t\tInfiniBand (0)\n".into(),
            "\tfw_ver:\t\t\t\t".into(),
            format!("\tnode_guid:\t\t\t{guid_text}\n"),
            format!("\tsys_image_guid:\t\t\t{guid_text}\n"),
            "\tvendor_id:\t\t\t0x".into(),
            "\tvendor_part_id:\t\t\t".into(),
            "\thw_ver:\t\t\t\t0x".into(),
            "\tphys_port_cnt:\t\t\t1\n".into(),
            "\t\tport:\t1\n".into(),
            "\t\t\tstate:\t\t\tPORT_ACTIVE (4)\n".into(),
            "\t\t\tmax_mtu:\t\t4096 (5)\n".into(),
            "\t\t\tactive_mtu:\t\t4096 (5)\n".into(),
            "\t\t\tsm_lid:\t\t\t0\n".into(),
            "\t\t\tport_lid:\t\t0\n".into(),
            "\t\t\tport_lmc:\t\t0x00\n".into(),
            "\t\t\tlink_layer:\t\tEthernet\n".into(),
        ] {
            assert!(
                r.stdout.contains(&expected),
                "missing {expected:?} in\n{}",
                r.stdout
            );
        }
        assert!(!r.stdout.contains("max_qp:"), "only -v prints the limits");
        assert!(!r.stdout.contains("GID["), "only -v prints the GID table");
        assert!(
            !r.stdout.contains("softverbs counters"),
            "only -v prints the counters"
        );
    }

    #[test]
    fn verbose_output_has_limits_gids_and_counters() {
        let r = run(BIN, &["-v", "-d", "sv_lo"]);
        assert_eq!(r.code, Some(0), "{}", r.stderr);
        let a = lo().open().unwrap().query_device();
        for expected in [
            "\tmax_mr_size:\t\t\t0x10000000000\n".to_string(),
            format!("\tmax_qp:\t\t\t\t{}\n", a.max_qp),
            format!("\tmax_qp_wr:\t\t\t{}\n", a.max_qp_wr),
            format!("\tdevice_cap_flags:\t\t0x{:08x}\n", a.device_cap_flags),
            "\t\t\t\t\tRC_RNR_NAK_GEN\n".into(),
            "\t\t\t\t\tXRC\n".into(),
            "\t\t\t\t\tMEM_WINDOW\n".into(),
            "\t\t\t\t\tMEM_WINDOW_TYPE_2B\n".into(),
            format!("\tmax_mw:\t\t\t\t{}\n", a.max_mw),
            format!("\tmax_sge:\t\t\t{}\n", a.max_sge),
            format!("\tmax_cqe:\t\t\t{}\n", a.max_cqe),
            format!("\tmax_mr:\t\t\t\t{}\n", a.max_mr),
            format!("\tmax_pd:\t\t\t\t{}\n", a.max_pd),
            format!("\tmax_qp_rd_atom:\t\t\t{}\n", a.max_qp_rd_atom),
            format!("\tmax_qp_init_rd_atom:\t\t{}\n", a.max_qp_init_rd_atom),
            "\tatomic_cap:\t\t\tATOMIC_HCA (1)\n".into(),
            format!("\tmax_mcast_grp:\t\t\t{}\n", a.max_mcast_grp),
            format!("\tmax_total_mcast_qp_attach:\t{}\n", a.max_total_mcast_qp_attach),
            format!("\tmax_ah:\t\t\t\t{}\n", a.max_ah),
            format!("\tmax_srq:\t\t\t{}\n", a.max_srq),
            format!("\tmax_srq_wr:\t\t\t{}\n", a.max_srq_wr),
            format!("\tmax_srq_sge:\t\t\t{}\n", a.max_srq_sge),
            "\tmax_pkeys:\t\t\t1\n".into(),
            "\t\t\tmax_msg_sz:\t\t0x".into(),
            "\t\t\tgid_tbl_len:\t\t16\n".into(),
            "\t\t\tactive_speed:\t\t".into(),
            "\t\t\tphys_state:\t\tLINK_UP (5)\n".into(),
            "\t\t\tGID[  0]:\t\t::ffff:127.0.0.1, RoCE v2\n".into(),
            "\tsoftverbs counters:\n".into(),
            format!(
                "\tmax_num_tags:\t\t\t{}\n",
                lo().open().unwrap().tm_caps().max_num_tags
            ),
            "\t\t\t\t\tIBV_TM_CAP_RC\n".into(),
        ] {
            assert!(
                r.stdout.contains(&expected),
                "missing {expected:?} in\n{}",
                r.stdout
            );
        }
        for counter in [
            "tx_packets",
            "rx_packets",
            "rx_malformed",
            "rx_unknown_qp",
            "rx_dropped",
            "rx_bad_icrc",
            "tx_unroutable",
        ] {
            let line = r
                .stdout
                .lines()
                .find(|l| l.trim_start().starts_with(&format!("{counter}:")));
            let value = line
                .unwrap_or_else(|| panic!("no {counter} in\n{}", r.stdout))
                .rsplit('\t')
                .next()
                .unwrap();
            assert!(value.parse::<u64>().is_ok(), "{counter}: {value:?}");
        }
        // The counters come after the port section, apart from rdma-core's fields.
        assert!(r.stdout.find("softverbs counters").unwrap() > r.stdout.find("GID[  0]").unwrap());
    }

    #[test]
    fn all_devices_by_default_and_list_mode() {
        let names: Vec<String> = devices().unwrap().iter().map(|d| d.name().to_string()).collect();
        let r = run(BIN, &[]);
        assert_eq!(r.code, Some(0), "{}", r.stderr);
        for n in &names {
            assert!(r.stdout.contains(&format!("hca_id:\t{n}\n")), "{}", r.stdout);
        }
        let r = run(BIN, &["-l"]);
        assert_eq!(r.code, Some(0));
        let s = if names.len() == 1 { "" } else { "s" };
        let mut expected = format!("{} HCA{s} found:\n", names.len());
        for n in &names {
            expected.push_str(&format!("\t{n}\n"));
        }
        expected.push('\n');
        assert_eq!(r.stdout, expected);
    }

    #[test]
    fn port_selection_and_errors() {
        let r = run(BIN, &["-d", "sv_lo", "-i", "1"]);
        assert_eq!(r.code, Some(0));
        assert!(r.stdout.contains("\t\tport:\t1\n"));
        let r = run(BIN, &["-d", "sv_lo", "--ib-port=2"]);
        assert_eq!(r.code, Some(4), "a port the device lacks: {}", r.stdout);
        assert!(r.stderr.contains("Invalid port"), "{}", r.stderr);
        let r = run(BIN, &["-d", "sv_no_such_device"]);
        assert_eq!(r.code, Some(255));
        assert!(r.stderr.contains("sv_no_such_device"), "{}", r.stderr);
        let r = run(BIN, &["-i", "0"]);
        assert_eq!(r.code, Some(1), "ports start at 1");
    }
}

/// Counters of every process: `ibv_devinfo -v` sums them per device and `softverbs-stat` lists
/// them per process, reading the boards each process keeps, here this test process's.
mod host_counters {
    use super::*;

    /// Two connected RC QPs of this process and one SEND between them; returns the QPs (kept
    /// alive) and the packets this process has sent on sv_lo since.
    fn traffic() -> (Context, Vec<QueuePair>) {
        let ctx = lo().open().unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(8, None, 0).unwrap();
        let a = pd.create_qp(&QpInit::new(QpType::Rc, &cq)).unwrap();
        let b = pd.create_qp(&QpInit::new(QpType::Rc, &cq)).unwrap();
        let attr = |dest: u32, state: QpState| QpAttr {
            qp_state: state,
            port_num: 1,
            path_mtu: Mtu::Mtu1024,
            dest_qp_num: dest,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 1,
            ah_attr: AhAttr {
                grh: GlobalRoute {
                    dgid: Gid::from(std::net::Ipv4Addr::LOCALHOST),
                    sgid_index: (0..16)
                        .find(|&i| ctx.query_gid(1, i).unwrap() == Gid::from(std::net::Ipv4Addr::LOCALHOST))
                        .unwrap() as u8,
                    hop_limit: 64,
                    ..Default::default()
                },
                is_global: true,
                port_num: 1,
                ..Default::default()
            },
            ..Default::default()
        };
        for (qp, dest) in [(&a, b.qp_num()), (&b, a.qp_num())] {
            qp.modify(
                &attr(dest, QpState::Init),
                QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS,
            )
            .unwrap();
            qp.modify(
                &attr(dest, QpState::Rtr),
                QpAttrMask::STATE
                    | QpAttrMask::AV
                    | QpAttrMask::PATH_MTU
                    | QpAttrMask::DEST_QPN
                    | QpAttrMask::RQ_PSN
                    | QpAttrMask::MAX_DEST_RD_ATOMIC
                    | QpAttrMask::MIN_RNR_TIMER,
            )
            .unwrap();
            qp.modify(
                &attr(dest, QpState::Rts),
                QpAttrMask::STATE
                    | QpAttrMask::SQ_PSN
                    | QpAttrMask::TIMEOUT
                    | QpAttrMask::RETRY_CNT
                    | QpAttrMask::RNR_RETRY
                    | QpAttrMask::MAX_QP_RD_ATOMIC,
            )
            .unwrap();
        }
        let mr = pd.register(64, AccessFlags::LOCAL_WRITE).unwrap();
        b.post_recv(&[RecvWr {
            wr_id: 1,
            sg_list: vec![mr.sge(0..64).unwrap()],
        }])
        .unwrap();
        a.post_send(&[SendRequest {
            wr_id: 2,
            op: SendOp::Send {
                imm: None,
                invalidate: None,
            },
            flags: SendFlags::SIGNALED,
            payload: Payload::Sges(vec![mr.sge(0..16).unwrap()]),
            ud: None,
            xrc_srqn: None,
        }])
        .unwrap();
        let mut wc = [WorkCompletion::default(); 2];
        let deadline = Instant::now() + BOUND;
        let mut got = 0;
        while got < 2 {
            got += cq.poll(&mut wc[got..]);
            assert!(Instant::now() < deadline, "the SEND completes");
        }
        assert!(wc.iter().all(|w| w.status == WcStatus::Success), "{wc:?}");
        (ctx, vec![a, b])
    }

    fn counter(text: &str, name: &str) -> u64 {
        let line = text
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{name}:")))
            .unwrap_or_else(|| panic!("no {name} in\n{text}"));
        line.rsplit('\t').next().unwrap().trim().parse().unwrap()
    }

    #[test]
    fn devinfo_sums_every_process_and_stat_lists_this_one() {
        let (ctx, _qps) = traffic();
        let mine = ctx.counters();
        assert!(
            mine.tx_packets >= 2 && mine.tx_bytes > 0 && mine.qps >= 2,
            "{mine:?}"
        );
        let r = run(env!("CARGO_BIN_EXE_ibv_devinfo"), &["-v", "-d", "sv_lo"]);
        assert_eq!(r.code, Some(0), "{}", r.stderr);
        // This process and ibv_devinfo itself, at least.
        assert!(counter(&r.stdout, "processes") >= 2, "{}", r.stdout);
        assert!(
            counter(&r.stdout, "tx_packets") >= mine.tx_packets,
            "{}",
            r.stdout
        );
        assert!(counter(&r.stdout, "qps") >= 2, "{}", r.stdout);
        for name in CounterSnapshot::NAMES {
            counter(&r.stdout, name);
        }

        let me = std::process::id().to_string();
        let r = run(env!("CARGO_BIN_EXE_softverbs-stat"), &["--once", "-d", "sv_lo"]);
        assert_eq!(r.code, Some(0), "{}", r.stderr);
        let row = r
            .stdout
            .lines()
            .find(|l| l.split_whitespace().next() == Some(me.as_str()))
            .unwrap_or_else(|| panic!("this process is not listed:\n{}", r.stdout));
        let cols: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(cols[2], "sv_lo");
        assert!(cols[3].parse::<u64>().unwrap() >= 2, "QPs: {row}");
        assert!(
            cols[4].parse::<u64>().unwrap() >= mine.tx_packets,
            "tx_packets: {row}"
        );

        let r = run(
            env!("CARGO_BIN_EXE_softverbs-stat"),
            &["--all", "-d", "sv_lo", "-n", "1"],
        );
        let lines: Vec<&str> = r
            .stdout
            .lines()
            .filter(|l| l.starts_with(&format!("{me} ")))
            .collect();
        assert_eq!(lines.len(), CounterSnapshot::NAMES.len(), "{}", r.stdout);
        let bad = run(env!("CARGO_BIN_EXE_softverbs-stat"), &["-i", "0"]);
        assert_eq!(bad.code, Some(2));
    }
}

mod ibv_asyncwatch {
    use super::*;

    const BIN: &str = env!("CARGO_BIN_EXE_ibv_asyncwatch");

    #[test]
    fn starts_and_exits_when_the_time_bound_passes() {
        let started = Instant::now();
        let r = run(BIN, &["-d", "sv_lo", "--timeout", "0.5"]);
        assert_eq!(r.code, Some(0), "{}", r.stderr);
        assert!(started.elapsed() >= Duration::from_millis(500));
        let first = r.stdout.lines().next().unwrap_or_default();
        let fd = first
            .strip_prefix("sv_lo: async event FD ")
            .unwrap_or_else(|| panic!("{first:?}"));
        assert!(fd.parse::<i32>().unwrap() >= 0);
    }

    #[test]
    fn count_bound_and_default_device() {
        let r = run(BIN, &["--count", "0"]);
        assert_eq!(r.code, Some(0), "{}", r.stderr);
        let first = devices().unwrap()[0].name().to_string();
        assert!(
            r.stdout.starts_with(&format!("{first}: async event FD ")),
            "{}",
            r.stdout
        );
    }

    #[test]
    fn unknown_device_fails() {
        let r = run(BIN, &["-d", "sv_no_such_device", "--timeout", "1"]);
        assert_eq!(r.code, Some(1));
        assert!(r.stderr.contains("sv_no_such_device"), "{}", r.stderr);
    }

    /// The line format on real events: moving an SRQ-attached QP to ERR raises
    /// IBV_EVENT_QP_LAST_WQE_REACHED (16) for it.
    #[test]
    fn watch_prints_events_with_name_number_and_object() {
        let ctx = lo().open().unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(8, None, 0).unwrap();
        let srq = pd
            .create_srq(&SrqAttr {
                max_wr: 4,
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
        let err = QpAttr {
            qp_state: QpState::Err,
            ..Default::default()
        };
        qp.modify(&err, QpAttrMask::STATE).unwrap();
        let mut out = Vec::new();
        let n = asyncwatch::watch(&ctx, Some(1), Some(BOUND), &mut out).unwrap();
        assert_eq!(n, 1);
        let text = String::from_utf8(out).unwrap();
        assert_eq!(
            text,
            format!(
                "  event_type IBV_EVENT_QP_LAST_WQE_REACHED (16), QP 0x{:06x}\n",
                qp.qp_num()
            )
        );
        // The bound: nothing more arrives, so the watch ends at the timeout with no line.
        let mut out = Vec::new();
        assert_eq!(
            asyncwatch::watch(&ctx, None, Some(Duration::from_millis(100)), &mut out).unwrap(),
            0
        );
        assert!(out.is_empty());
    }

    #[test]
    fn every_event_type_has_its_c_name() {
        for t in EventType::ALL {
            let name = asyncwatch::event_name(*t);
            assert!(name.starts_with("IBV_EVENT_"), "{name}");
        }
        assert_eq!(
            asyncwatch::event_name(EventType::PortActive),
            "IBV_EVENT_PORT_ACTIVE"
        );
        assert_eq!(asyncwatch::describe_target(&AsyncEventTarget::Port(1)), "port 1");
    }
}

/// Command-line behaviour of the ping-pong programs that needs no peer.
mod pingpong_cli {
    use super::*;

    const RC: &str = env!("CARGO_BIN_EXE_ibv_rc_pingpong");
    const UC: &str = env!("CARGO_BIN_EXE_ibv_uc_pingpong");
    const UD: &str = env!("CARGO_BIN_EXE_ibv_ud_pingpong");
    const SRQ: &str = env!("CARGO_BIN_EXE_ibv_srq_pingpong");

    #[test]
    fn help_lists_the_rdma_core_options() {
        for (bin, extra) in [
            (
                RC,
                &[
                    "--mtu",
                    "--odp",
                    "--iodp",
                    "--prefetch",
                    "--ts",
                    "--dm",
                    "--new_send",
                ][..],
            ),
            (UC, &["--mtu"][..]),
            (UD, &[][..]),
            (SRQ, &["--mtu", "--num-qp", "--odp"][..]),
        ] {
            let r = run(bin, &["--help"]);
            assert_eq!(r.code, Some(0), "{bin}");
            for opt in [
                "--port",
                "--ib-dev",
                "--ib-port",
                "--size",
                "--rx-depth",
                "--iters",
                "--sl",
                "--events",
                "--gid-idx",
                "--chk",
            ]
            .iter()
            .chain(extra)
            {
                assert!(r.stdout.contains(opt), "{bin} --help lacks {opt}:\n{}", r.stdout);
            }
        }
    }

    /// Every option of rdma-core's programs is accepted: a server started with it gets as far
    /// as waiting for a client; only the combinations rdma-core refuses are refused, with its
    /// messages.
    #[test]
    fn every_rdma_core_option_is_accepted() {
        for (bin, args) in [
            (RC, &["-o"][..]),
            (RC, &["-O"]),
            (RC, &["--odp", "-P"]),
            (RC, &["-O", "--prefetch"]),
            (RC, &["-t"]),
            (RC, &["-j"]),
            (RC, &["--dm", "--ts", "-N"]),
            (SRQ, &["-o", "-q", "2"]),
        ] {
            let mut all = vec!["-d", "sv_lo", "-p", "0", "--timeout", "0.3"];
            all.extend_from_slice(args);
            let r = run(bin, &all);
            assert_eq!(r.code, Some(1), "{args:?}: no client comes");
            assert!(r.stdout.contains("local address:"), "{args:?}: {}", r.stdout);
            assert!(r.stderr.contains("no client connected"), "{args:?}: {}", r.stderr);
        }
        for (args, msg) in [
            (&["-P"][..], "prefetch is valid only with on-demand memory region"),
            (&["-o", "-j"], "DM memory region can't be on demand"),
        ] {
            let r = run(RC, args);
            assert_eq!(r.code, Some(1), "{args:?}");
            assert!(r.stderr.contains(msg), "{args:?}: {}", r.stderr);
        }
    }

    #[test]
    fn bad_options_exit_1() {
        for (bin, args) in [
            (RC, &["-m", "1500"][..]),
            (UD, &["-m", "1024"]),
            (UC, &["-p", "70000"]),
            (RC, &["-i", "0"]),
            (RC, &["a", "b"]),
            (SRQ, &["-q", "300", "-r", "500"]),
            (SRQ, &["-q", "8", "-r", "4"]),
            (RC, &["-d", "sv_no_such_device"]),
        ] {
            let r = run(bin, args);
            assert_eq!(r.code, Some(1), "{bin} {args:?}: {}{}", r.stdout, r.stderr);
        }
    }

    #[test]
    fn server_prints_its_address_and_honours_the_timeout() {
        // -N is accepted; C-style numbers are too (0x10 iterations).
        let r = run(
            RC,
            &[
                "-d",
                "sv_lo",
                "-p",
                "0",
                "-N",
                "-n",
                "0x10",
                "-g",
                "0",
                "--timeout",
                "0.3",
            ],
        );
        assert_eq!(r.code, Some(1), "no client comes");
        assert!(
            r.stdout.starts_with("  local address:  LID 0x0000, QPN 0x")
                && r.stdout.contains(", GID ::ffff:127.0.0.1\n"),
            "{}",
            r.stdout
        );
        assert!(r.stderr.contains("no client connected"), "{}", r.stderr);
        let r = run(UD, &["-d", "sv_lo", "-p", "0", "--timeout", "0.3"]);
        assert!(
            r.stdout.contains(": GID ::ffff:127.0.0.1"),
            "the UD local line has a colon: {}",
            r.stdout
        );
        let r = run(SRQ, &["-d", "sv_lo", "-p", "0", "-q", "4", "--timeout", "0.3"]);
        assert_eq!(
            r.stdout.lines().filter(|l| l.contains("local address")).count(),
            4,
            "{}",
            r.stdout
        );
    }
}
