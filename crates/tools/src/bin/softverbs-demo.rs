//! The loopback demo: finds the built-in loopback device, opens it and sets up two connected
//! RC queue pairs, printing each step.

use std::process::ExitCode;

use clap::Parser;
use softverbs::*;

/// Runs a loopback RDMA demo on the built-in software device.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Network interface whose device to use.
    #[arg(short, long, default_value = "lo")]
    interface: String,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("softverbs-demo: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<()> {
    let list = devices()?;
    println!("devices:");
    for d in &list {
        println!("  {:<16} guid {:016x}  on {}", d.name(), d.guid(), d.netdev());
    }
    let dev = list
        .iter()
        .find(|d| d.netdev() == args.interface)
        .ok_or_else(|| Error::NoDevice(format!("no device on interface {}", args.interface).into()))?;
    let ctx = dev.open()?;
    let attr = ctx.query_device();
    let port = ctx.query_port(1)?;
    println!(
        "opened {}: fw {}, max_qp {}, max_cqe {}, max_mr_size {}",
        dev.name(),
        attr.fw_ver,
        attr.max_qp,
        attr.max_cqe,
        attr.max_mr_size
    );
    println!(
        "port 1: {:?}, active MTU {} bytes, link layer Ethernet",
        port.state,
        port.active_mtu.bytes()
    );
    let sgid_index = (0..port.gid_tbl_len as i32)
        .find(|&i| ctx.query_gid(1, i).is_ok_and(|g| !g.is_zero()))
        .ok_or_else(|| Error::NoDevice("the port has no usable GID".into()))?;
    let gid = ctx.query_gid(1, sgid_index)?;
    println!("GID[{sgid_index}] {gid} ({})", gid.to_ip());

    let pd = ctx.alloc_pd()?;
    let mr = pd.register(
        vec![0u8; 64 * 1024],
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
    )?;
    println!(
        "registered {} bytes: lkey {:#010x} rkey {:#010x}",
        mr.len(),
        mr.lkey(),
        mr.rkey()
    );
    let channel = ctx.create_comp_channel()?;
    let cq = ctx.create_cq(64, Some(&channel), 0)?;
    println!("CQ with {} entries on a completion channel", cq.cqe());

    let a = pd.create_qp(&QpInit::new(QpType::Rc, &cq))?;
    let b = pd.create_qp(&QpInit::new(QpType::Rc, &cq))?;
    for (me, peer) in [(&a, &b), (&b, &a)] {
        connect(me, peer.qp_num(), gid, sgid_index as u8, port.active_mtu)?;
    }
    println!(
        "RC QP {:#08x} <-> RC QP {:#08x}: both {}",
        a.qp_num(),
        b.qp_num(),
        a.state()
    );

    a.post_recv(&[RecvWr {
        wr_id: 1,
        sg_list: vec![mr.sge(0..4096)?],
    }])?;
    a.modify(
        &QpAttr {
            qp_state: QpState::Err,
            ..Default::default()
        },
        QpAttrMask::STATE,
    )?;
    let mut wc = [WorkCompletion::default(); 4];
    let n = cq.poll(&mut wc);
    for w in &wc[..n] {
        println!(
            "moved QP {:#08x} to ERR: receive {} completed with \"{}\"",
            w.qp_num,
            w.wr_id,
            w.status.as_str()
        );
    }
    println!("done: all objects are released as they go out of scope");
    Ok(())
}

/// Brings `qp` to RTS, connected to QP `dest` at `gid`.
fn connect(qp: &QueuePair, dest: u32, gid: Gid, sgid_index: u8, mtu: Mtu) -> Result<()> {
    let init = QpAttr {
        qp_state: QpState::Init,
        port_num: 1,
        qp_access_flags: AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        ..Default::default()
    };
    qp.modify(
        &init,
        QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS,
    )?;
    let rtr = QpAttr {
        qp_state: QpState::Rtr,
        path_mtu: mtu,
        dest_qp_num: dest,
        rq_psn: 0,
        max_dest_rd_atomic: 4,
        min_rnr_timer: 12,
        ah_attr: AhAttr {
            grh: GlobalRoute {
                dgid: gid,
                sgid_index,
                hop_limit: 64,
                ..Default::default()
            },
            is_global: true,
            port_num: 1,
            ..Default::default()
        },
        ..Default::default()
    };
    qp.modify(
        &rtr,
        QpAttrMask::STATE
            | QpAttrMask::AV
            | QpAttrMask::PATH_MTU
            | QpAttrMask::DEST_QPN
            | QpAttrMask::RQ_PSN
            | QpAttrMask::MAX_DEST_RD_ATOMIC
            | QpAttrMask::MIN_RNR_TIMER,
    )?;
    let rts = QpAttr {
        qp_state: QpState::Rts,
        sq_psn: 0,
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        max_rd_atomic: 4,
        ..Default::default()
    };
    qp.modify(
        &rts,
        QpAttrMask::STATE
            | QpAttrMask::SQ_PSN
            | QpAttrMask::TIMEOUT
            | QpAttrMask::RETRY_CNT
            | QpAttrMask::RNR_RETRY
            | QpAttrMask::MAX_QP_RD_ATOMIC,
    )
}
