//! Acceptance: Open MPI (Debian's `openmpi-bin` 4.1, unmodified) runs a two-rank ping-pong that
//! checks every byte (`tests/c/mpi_pingpong.c`, built with `mpicc`; 1 B to 4 MiB) over softverbs,
//! through both of its roads to RDMA hardware:
//!
//! - `--mca pml ucx`: UCX over `rc_verbs` on `sv_lo` (`ud_verbs` for UCX's wire-up), with UCX's
//!   placeholder device node (README, "UCX"; the tests add it as root and remove it again);
//! - `--mca pml cm --mca mtl ofi`: libfabric's `ofi_rxm` over verbs MSG endpoints, which need a
//!   non-loopback interface: both ranks run in a network namespace holding both ends of a veth
//!   pair (root).
//!
//! Open MPI's own transports are kept out (`--mca btl self`: no `vader` shared memory, `tcp` or
//! `openib`; UCX only gets its verbs transports and `self`; the MTL only `verbs;ofi_rxm`), and
//! each test shows that softverbs carried the data twice: the logs name the transport (UCX's
//! endpoint lanes, the MTL's verbs domain), and a second run with `SOFTVERBS_SHM=0` counts the
//! bytes arriving at softverbs' RoCEv2 UDP ports in the namespace (an nftables counter), which
//! must be at least the ping-pong's payload.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(120);
const MPIRUN: &str = "/usr/bin/mpirun";
const MPICC: &str = "/usr/bin/mpicc";
const ITERATIONS: u64 = 10;
/// The sizes `mpi_pingpong.c` sends, each way, per iteration.
const SIZES: [u64; 6] = [1, 64, 4096, 65536, 1 << 20, 4 << 20];
/// The UDP ports softverbs' processes take (4791 and the 255 slots above it).
const ROCE_PORTS: &str = "4791-5046";

/// The runs share two cores; one at a time.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    let guard = LOCK.lock().unwrap_or_else(|p| p.into_inner());
    for program in [MPIRUN, MPICC] {
        assert!(
            Path::new(program).exists(),
            "{program} is not installed: run scripts/setup-deps (openmpi-bin, libopenmpi-dev)"
        );
    }
    guard
}

/// `tests/c/mpi_pingpong.c` built with `mpicc`, once per test run.
fn program() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/mpi_pingpong.c");
        let exe = std::env::temp_dir().join(format!("softverbs-mpi-pingpong-{}", std::process::id()));
        let o = Command::new(MPICC)
            .arg("-O2")
            .arg("-o")
            .arg(&exe)
            .arg(&src)
            .output()
            .expect("mpicc runs");
        assert!(
            o.status.success(),
            "mpicc: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        exe
    })
}

/// Counts the bytes of UDP datagrams to softverbs' ports arriving in the namespace; removed
/// with the namespace.
struct RoceCounter<'a> {
    veth: &'a Veth,
}

impl<'a> RoceCounter<'a> {
    fn new(veth: &'a Veth) -> Self {
        let rules = format!(
            "table inet svcount {{\n chain input {{\n  type filter hook input priority 0; policy accept;\n  \
             udp dport {ROCE_PORTS} counter\n }}\n}}\n"
        );
        let path = std::env::temp_dir().join(format!("softverbs-mpi-nft-{}", std::process::id()));
        std::fs::write(&path, rules).unwrap();
        run_ok(
            "ip",
            &["netns", "exec", &veth.ns[0], "nft", "-f", path.to_str().unwrap()],
        );
        let _ = std::fs::remove_file(&path);
        Self { veth }
    }

    /// The bytes counted so far.
    fn bytes(&self) -> u64 {
        let o = Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.veth.ns[0],
                "nft",
                "list",
                "table",
                "inet",
                "svcount",
            ])
            .output()
            .expect("nft runs");
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        out.split_whitespace()
            .skip_while(|w| *w != "bytes")
            .nth(1)
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no byte counter in:\n{out}"))
    }
}

/// `mpirun -np 2` of the ping-pong in the namespace with the MCA arguments `mca` and the
/// environment `env` (exported to the ranks with `-x`); nothing of MPI's, UCX's, libfabric's or
/// softverbs' configuration is inherited. Panics unless it verified every byte; returns the
/// output (stdout and stderr).
fn mpirun(veth: &Veth, mca: &[&str], env: &[(&str, &str)]) -> String {
    let mut c = veth.command(0, MPIRUN);
    for (k, _) in std::env::vars() {
        if ["OMPI_", "PMIX_", "UCX_", "FI_", "SOFTVERBS_"]
            .iter()
            .any(|p| k.starts_with(p))
        {
            c.env_remove(k);
        }
    }
    c.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        "2",
        "--mca",
        "btl",
        "self",
    ])
    .args(mca)
    .args(["-x", "LD_LIBRARY_PATH"]);
    for (k, v) in env {
        c.env(k, v).args(["-x", k]);
    }
    c.arg(program()).arg(ITERATIONS.to_string());
    let o: Output = wait_bounded(c.spawn().expect("spawn mpirun"), LIMIT);
    let (out, err) = text(&o);
    let all = format!("{out}{err}");
    assert!(
        o.status.success() && out.contains("pingpong: verified, 0 bad bytes"),
        "mpirun {mca:?} {env:?} ({:?}):\n{all}",
        o.status
    );
    for size in SIZES {
        let line = format!("size {size} iterations {ITERATIONS} one-way ");
        assert!(out.contains(&line), "no {line:?}:\n{all}");
    }
    println!(
        "{}",
        out.lines()
            .filter(|l| l.starts_with("size "))
            .collect::<Vec<_>>()
            .join("\n")
    );
    all
}

/// The ping-pong's payload: every size, both ways, every iteration.
fn payload() -> u64 {
    SIZES.iter().sum::<u64>() * 2 * ITERATIONS
}

/// Runs the ping-pong once as configured, and once with `SOFTVERBS_SHM=0` while counting what
/// reaches softverbs' UDP ports; returns the first run's output.
fn run_both_ways(veth: &Veth, mca: &[&str], env: &[(&str, &str)]) -> String {
    let log = mpirun(veth, mca, env);
    let counter = RoceCounter::new(veth);
    let before = counter.bytes();
    let mut udp: Vec<(&str, &str)> = env.to_vec();
    udp.push(("SOFTVERBS_SHM", "0"));
    mpirun(veth, mca, &udp);
    let carried = counter.bytes() - before;
    println!(
        "{carried} bytes reached softverbs' UDP ports for {} bytes of payload",
        payload()
    );
    assert!(
        carried >= payload(),
        "only {carried} bytes crossed softverbs' RoCEv2 ports, for {} bytes of payload",
        payload()
    );
    log
}

/// `--mca pml ucx` with UCX restricted to `rc_verbs` (and `ud_verbs` for wire-up) on sv_lo.
#[test]
fn mpi_pingpong_over_ucx_rc_verbs() {
    let _serial = serial();
    let _node = DevNode::ensure("sv_lo");
    let veth = Veth::new("mpiu", 1, 81);
    let log = run_both_ways(
        &veth,
        &["--mca", "pml", "ucx"],
        &[
            ("UCX_TLS", "rc_verbs,ud_verbs:aux,self"),
            ("UCX_NET_DEVICES", "sv_lo:1"),
            ("UCX_UD_ETH_DGID_CHECK", "n"),
            ("UCX_LOG_LEVEL", "info"),
        ],
    );
    // Each rank's endpoint to the other one is an rc_verbs lane (its own: self).
    let lanes: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("ep_cfg[") && l.contains("tag("))
        .collect();
    assert!(
        lanes
            .iter()
            .filter(|l| l.contains("tag(rc_verbs/sv_lo:1)"))
            .count()
            >= 2,
        "no rc_verbs lane between the ranks:\n{log}"
    );
    assert!(
        lanes
            .iter()
            .all(|l| !l.contains("posix") && !l.contains("sysv") && !l.contains("tcp")),
        "{log}"
    );
}

/// `--mca pml cm --mca mtl ofi`, the MTL given only libfabric's `verbs;ofi_rxm`.
#[test]
fn mpi_pingpong_over_ofi_rxm_on_verbs() {
    let _serial = serial();
    let veth = Veth::new("mpio", 1, 82);
    let log = run_both_ways(
        &veth,
        &[
            "--mca",
            "pml",
            "cm",
            "--mca",
            "mtl",
            "ofi",
            "--mca",
            "mtl_ofi_provider_include",
            "verbs;ofi_rxm",
            "--mca",
            "mtl_base_verbose",
            "100",
        ],
        &[],
    );
    // Both ranks chose a verbs domain on one of the veth's devices.
    let domains: Vec<&str> = log
        .lines()
        .filter_map(|l| l.split("mtl:ofi:provider: ").nth(1))
        .collect();
    assert_eq!(domains.len(), 2, "{log}");
    for d in domains {
        assert!(
            veth.ifs.iter().any(|i| d.trim() == format!("sv_{i}")),
            "domain {d}:\n{log}"
        );
    }
}
