//! Compares every `repr(C)` mirror with the system `<rdma/rdma_cma.h>`: a C program compiled
//! with gcc prints `sizeof` and `offsetof` of each structure and field, and each must equal the
//! Rust `size_of`/`offset_of!`.

use std::mem::{offset_of, size_of};
use std::process::Command;

use crate::abi::*;

macro_rules! layout {
    ($checks:ident, $ty:ident { $($field:ident $(= $cname:literal)?),* $(,)? }) => {{
        $checks.push((format!("sizeof(struct {})", stringify!($ty)), size_of::<$ty>()));
        $(
            #[allow(unused_mut, unused_assignments)]
            let mut c = stringify!($field);
            $( c = $cname; )?
            $checks.push((format!("offsetof(struct {}, {})", stringify!($ty), c), offset_of!($ty, $field)));
        )*
    }};
}

fn checks() -> Vec<(String, usize)> {
    let mut v = Vec::new();
    layout!(
        v,
        ibv_global_route {
            dgid,
            flow_label,
            sgid_index,
            hop_limit,
            traffic_class
        }
    );
    layout!(
        v,
        ibv_ah_attr {
            grh,
            dlid,
            sl,
            src_path_bits,
            static_rate,
            is_global,
            port_num
        }
    );
    layout!(
        v,
        ibv_ece {
            vendor_id,
            options,
            comp_mask
        }
    );
    layout!(v, rdma_ib_addr { sgid, dgid, pkey });
    layout!(v, rdma_addr { src_addr = "src_storage", dst_addr = "dst_storage", addr });
    layout!(
        v,
        rdma_route {
            addr,
            path_rec,
            num_paths
        }
    );
    layout!(v, rdma_event_channel { fd });
    layout!(
        v,
        rdma_cm_id {
            verbs,
            channel,
            context,
            qp,
            route,
            ps,
            port_num,
            event,
            send_cq_channel,
            send_cq,
            recv_cq_channel,
            recv_cq,
            srq,
            pd,
            qp_type
        }
    );
    layout!(
        v,
        rdma_conn_param {
            private_data,
            private_data_len,
            responder_resources,
            initiator_depth,
            flow_control,
            retry_count,
            rnr_retry_count,
            srq,
            qp_num
        }
    );
    layout!(
        v,
        rdma_ud_param {
            private_data,
            private_data_len,
            ah_attr,
            qp_num,
            qkey
        }
    );
    layout!(
        v,
        rdma_cm_event {
            id,
            listen_id,
            event,
            status,
            param
        }
    );
    layout!(
        v,
        rdma_addrinfo {
            ai_flags,
            ai_family,
            ai_qp_type,
            ai_port_space,
            ai_src_len,
            ai_dst_len,
            ai_src_addr,
            ai_dst_addr,
            ai_src_canonname,
            ai_dst_canonname,
            ai_route_len,
            ai_route,
            ai_connect_len,
            ai_connect,
            ai_next
        }
    );
    layout!(
        v,
        rdma_cm_join_mc_attr_ex {
            comp_mask,
            join_flags,
            addr
        }
    );
    v
}

#[test]
fn mirrors_match_rdma_cma_h() {
    let header = std::path::Path::new("/usr/include/rdma/rdma_cma.h");
    assert!(
        header.exists(),
        "{} is missing: run scripts/setup-deps (librdmacm-dev)",
        header.display()
    );
    let checks = checks();
    let dir = std::env::temp_dir().join(format!("rdmacm-layout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut c = String::from(
        "#include <stdio.h>\n#include <stddef.h>\n#include <rdma/rdma_cma.h>\nint main(void) {\n",
    );
    for (expr, _) in &checks {
        c.push_str(&format!("    printf(\"%zu\\n\", (size_t){expr});\n"));
    }
    c.push_str("    return 0;\n}\n");
    std::fs::write(dir.join("layout.c"), c).unwrap();
    let bin = dir.join("layout");
    let cc = Command::new("gcc")
        .arg(dir.join("layout.c"))
        .arg("-o")
        .arg(&bin)
        .output()
        .expect("gcc runs");
    assert!(cc.status.success(), "{}", String::from_utf8_lossy(&cc.stderr));
    let out = Command::new(&bin).output().expect("the layout program runs");
    let values: Vec<usize> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.parse().unwrap())
        .collect();
    assert_eq!(values.len(), checks.len());
    let wrong: Vec<_> = checks
        .iter()
        .zip(&values)
        .filter(|((_, rust), c)| rust != *c)
        .map(|((e, rust), c)| format!("{e}: C {c}, Rust {rust}"))
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(wrong.is_empty(), "{wrong:#?}");
    assert_eq!(size_of::<rdma_cm_id>(), 416);
}

#[test]
fn event_names_and_ports() {
    use crate::entry::{rdma_event_str, rdma_get_dst_port, rdma_get_src_port};
    // SAFETY: the returned pointers are static NUL-terminated strings.
    let name = |e| {
        unsafe { std::ffi::CStr::from_ptr(rdma_event_str(e)) }
            .to_str()
            .unwrap()
    };
    assert_eq!(name(0), "RDMA_CM_EVENT_ADDR_RESOLVED");
    assert_eq!(name(9), "RDMA_CM_EVENT_ESTABLISHED");
    assert_eq!(name(15), "RDMA_CM_EVENT_TIMEWAIT_EXIT");
    assert_eq!(name(16), "UNKNOWN EVENT");
    assert_eq!(name(-1), "UNKNOWN EVENT");

    // SAFETY: an all-zero `rdma_cm_id` is a valid value (null pointers, zero addresses).
    let mut id: rdma_cm_id = unsafe { std::mem::zeroed() };
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 7174u16.to_be(),
        sin_addr: libc::in_addr { s_addr: 0 },
        sin_zero: [0; 8],
    };
    // SAFETY: a sockaddr_in fits in the sockaddr_storage it is written to.
    unsafe {
        std::ptr::write(
            &mut id.route.addr.src_addr as *mut _ as *mut libc::sockaddr_in,
            sin,
        );
    };
    let mut sin6: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
    sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
    sin6.sin6_port = 20079u16.to_be();
    // SAFETY: likewise for sockaddr_in6.
    unsafe {
        std::ptr::write(
            &mut id.route.addr.dst_addr as *mut _ as *mut libc::sockaddr_in6,
            sin6,
        );
    };
    // SAFETY: `id` is a valid rdma_cm_id.
    unsafe {
        assert_eq!(u16::from_be(rdma_get_src_port(&mut id)), 7174);
        assert_eq!(u16::from_be(rdma_get_dst_port(&mut id)), 20079);
        id.route.addr.dst_addr.ss_family = 0;
        assert_eq!(rdma_get_dst_port(&mut id), 0);
    }
}
