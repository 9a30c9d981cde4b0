//! Shared helpers of the C ABI tests: where the freshly built `libibverbs.so` is, a directory
//! that presents it (and `librdmacm.so`, built beside it as a dev-dependency) as
//! `libibverbs.so.1` and `librdmacm.so.1` for `LD_LIBRARY_PATH`, bounded process runs, network
//! namespaces with veth pairs, and UCX's placeholder device node.
#![allow(dead_code, unreachable_pub)] // each test binary uses a subset

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The real rdma-core library, for comparisons only.
pub const SYSTEM_LIB: &str = "/usr/lib/x86_64-linux-gnu/libibverbs.so.1";

/// The `libibverbs.so` cargo built for this test run: the cdylib of this package, which cargo
/// leaves beside the test executable in `target/<profile>/deps`.
pub fn built_library() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let deps = exe.parent().expect("target/<profile>/deps/<test>");
    let lib = deps.join("libibverbs.so");
    assert!(
        lib.exists(),
        "{} not found: cargo builds the cdylib with the tests",
        lib.display()
    );
    lib
}

/// A directory holding `libibverbs.so.1` and `libibverbs.so` links to the built library, and
/// `librdmacm.so.1` to the drop-in connection manager built with it (libfabric's verbs provider
/// and Open MPI load both).
pub fn lib_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("softverbs-ibverbs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let lib = built_library();
        let rdmacm = lib.with_file_name("librdmacm.so");
        assert!(
            rdmacm.exists(),
            "{} not found: cargo builds it as a dev-dependency",
            rdmacm.display()
        );
        for (target, name) in [
            (&lib, "libibverbs.so.1"),
            (&lib, "libibverbs.so"),
            (&rdmacm, "librdmacm.so.1"),
        ] {
            let link = dir.join(name);
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink(target, &link).unwrap();
        }
        dir
    })
}

/// A command that loads our library (and nothing else is changed in its environment).
pub fn command(program: &str) -> Command {
    let mut c = Command::new(program);
    c.env("LD_LIBRARY_PATH", lib_dir());
    c
}

/// Panics unless `program` is installed (scripts/setup-deps installs the packages).
pub fn require(program: &str) {
    assert!(
        Path::new(program).exists() || which(program),
        "{program} is not installed: run scripts/setup-deps (ibverbs-utils, perftest, gcc, libibverbs-dev)"
    );
}

fn which(program: &str) -> bool {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(program).exists()))
        .unwrap_or(false)
}

/// Runs `cmd` to completion, killing it after `limit`.
pub fn run_bounded(mut cmd: Command, limit: Duration) -> Output {
    cmd.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .stdin(Stdio::null());
    let child = cmd.spawn().expect("spawn");
    wait_bounded(child, limit)
}

/// Waits for `child`, killing it after `limit`; the output of a killed child is what it wrote.
pub fn wait_bounded(mut child: std::process::Child, limit: Duration) -> Output {
    let start = Instant::now();
    loop {
        if child.try_wait().expect("wait").is_some() {
            return child.wait_with_output().expect("output");
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "timed out after {limit:?}\nstdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// stdout and stderr as text.
pub fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// The GID index of `::ffff:127.0.0.1` on sv_lo, as `ibv_devinfo -v` reports it.
pub fn gid_index() -> String {
    static INDEX: OnceLock<String> = OnceLock::new();
    INDEX
        .get_or_init(|| {
            require("/usr/bin/ibv_devinfo");
            let mut c = command("/usr/bin/ibv_devinfo");
            c.args(["-v", "-d", "sv_lo"]);
            let (out, err) = text(&run_bounded(c, Duration::from_secs(120)));
            out.lines()
                .find(|l| l.contains("::ffff:127.0.0.1"))
                .and_then(|l| l.split('[').nth(1))
                .and_then(|l| l.split(']').next())
                .map(|i| i.trim().to_string())
                .unwrap_or_else(|| panic!("no ::ffff:127.0.0.1 GID on sv_lo:\n{out}{err}"))
        })
        .clone()
}

/// A network namespace with only its loopback up; removed on drop.
pub struct Netns(pub String);

impl Netns {
    /// A namespace named after `tag` and this process.
    pub fn new(tag: &str) -> Self {
        let name = format!("sv{tag}{}", std::process::id());
        for args in [
            vec!["netns", "add", &name],
            vec!["-n", &name, "link", "set", "lo", "up"],
        ] {
            let o = std::process::Command::new("ip").args(&args).output().unwrap();
            assert!(
                o.status.success(),
                "ip {args:?}: {}",
                String::from_utf8_lossy(&o.stderr)
            );
        }
        Self(name)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.0])
            .status();
    }
}

/// Runs a set-up command, failing the test if it fails.
pub fn run_ok(program: &str, args: &[&str]) {
    let o = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    assert!(
        o.status.success(),
        "{program} {args:?} (needs root): {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Network namespaces joined by a veth pair, with an IPv4 address on each end; removed on
/// drop. `hosts` 2: one end in each of two namespaces (two hosts); 1: both ends in one
/// namespace (one host with a non-loopback interface, as libfabric's MSG endpoints need).
pub struct Veth {
    /// The namespaces (one or two).
    pub ns: Vec<String>,
    /// The interface names of the two ends.
    pub ifs: [String; 2],
    /// The addresses of the two ends.
    pub ips: [String; 2],
}

impl Veth {
    /// Names carry `tag` and this process's id; the addresses are `10.<net>.0.1` and `.2`.
    pub fn new(tag: &str, hosts: usize, net: u8) -> Self {
        assert!(hosts == 1 || hosts == 2);
        let id = std::process::id() % 100_000;
        let ns: Vec<String> = (0..hosts).map(|i| format!("sv{tag}{id}{i}")).collect();
        let v = Self {
            ifs: [format!("v{tag}{id}a"), format!("v{tag}{id}b")],
            ips: [format!("10.{net}.0.1"), format!("10.{net}.0.2")],
            ns,
        };
        for n in &v.ns {
            run_ok("ip", &["netns", "add", n]);
            run_ok("ip", &["-n", n, "link", "set", "lo", "up"]);
        }
        let (a, b) = (&v.ns[0], v.ns.last().unwrap());
        run_ok(
            "ip",
            &[
                "link", "add", &v.ifs[0], "netns", a, "type", "veth", "peer", "name", &v.ifs[1], "netns", b,
            ],
        );
        for i in 0..2 {
            let n = if i == 0 { a } else { b };
            let addr = format!("{}/24", v.ips[i]);
            run_ok("ip", &["-n", n, "addr", "add", &addr, "dev", &v.ifs[i]]);
            run_ok("ip", &["-n", n, "link", "set", &v.ifs[i], "up"]);
        }
        // The kernel reports carrier on a new link a moment later (link watch); until then the
        // device's port is down and libfabric skips it.
        let start = Instant::now();
        for i in 0..2 {
            let n = if i == 0 { a } else { b };
            loop {
                let o = Command::new("ip")
                    .args(["-n", n, "-o", "link", "show", "dev", &v.ifs[i]])
                    .output()
                    .expect("ip link show");
                if String::from_utf8_lossy(&o.stdout).contains(" state UP ") {
                    break;
                }
                assert!(
                    start.elapsed() < Duration::from_secs(20),
                    "{} never came up: {}",
                    v.ifs[i],
                    String::from_utf8_lossy(&o.stdout)
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        v
    }

    /// `program` in namespace `i`, over our libraries (`LD_LIBRARY_PATH`), with piped output.
    pub fn command(&self, i: usize, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns[i], program])
            .env("LD_LIBRARY_PATH", lib_dir())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    }
}

impl Drop for Veth {
    fn drop(&mut self) {
        // Deleting a namespace also removes the veth end in it.
        for n in &self.ns {
            let _ = Command::new("ip").args(["netns", "del", n]).status();
        }
    }
}

/// Whether the process `pid` has a TCP socket listening on `port` (read from its network
/// namespace's `/proc/<pid>/net/tcp`, so a server's one accept is not consumed by a probe).
pub fn pid_listening(pid: u32, port: u16) -> bool {
    let needle = format!(":{port:04X}");
    ["tcp", "tcp6"].iter().any(|f| {
        std::fs::read_to_string(format!("/proc/{pid}/net/{f}"))
            .unwrap_or_default()
            .lines()
            .skip(1)
            .any(|l| {
                let cols: Vec<&str> = l.split_whitespace().collect();
                cols.len() > 3 && cols[1].ends_with(&needle) && cols[3] == "0A"
            })
    })
}

/// UCX's placeholder device node `/dev/infiniband/<dev>` (README, "UCX"): made with
/// `scripts/dev-nodes add` (root) when missing and removed again on drop; a node that was
/// there before is left alone.
pub struct DevNode {
    dev: String,
    /// Whether this guard made the node.
    pub added: bool,
}

impl DevNode {
    /// The node of `dev`, made now if it is missing (which needs root).
    pub fn ensure(dev: &str) -> Self {
        let path = format!("/dev/infiniband/{dev}");
        let mut added = false;
        if !accessible_char_device(&path) {
            assert!(
                nix::unistd::geteuid().is_root(),
                "UCX ignores {dev} unless {path} exists: run `sudo scripts/dev-nodes add {dev}` \
                 (README, \"UCX\") or run these tests as root"
            );
            dev_nodes(&["add", dev]);
            added = true;
            assert!(
                accessible_char_device(&path),
                "scripts/dev-nodes add made no usable {path}"
            );
        }
        Self {
            dev: dev.to_string(),
            added,
        }
    }
}

impl Drop for DevNode {
    fn drop(&mut self) {
        if self.added {
            dev_nodes(&["remove", &self.dev]);
        }
    }
}

/// Runs `scripts/dev-nodes ARGS`, which must succeed.
pub fn dev_nodes(args: &[&str]) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/dev-nodes");
    let o = Command::new(script)
        .args(args)
        .output()
        .expect("run scripts/dev-nodes");
    assert!(
        o.status.success(),
        "scripts/dev-nodes {args:?}: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Whether `path` is a character device this process may read and write, UCX's test.
pub fn accessible_char_device(path: &str) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::metadata(path).is_ok_and(|m| m.file_type().is_char_device())
        && nix::unistd::access(
            path,
            nix::unistd::AccessFlags::R_OK | nix::unistd::AccessFlags::W_OK,
        )
        .is_ok()
}

/// A TCP port nobody listens on now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Whether something listens on TCP `port` (read from /proc, so a server's one accept is not
/// consumed by a probe).
pub fn listening(port: u16) -> bool {
    let needle = format!(":{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|f| {
        std::fs::read_to_string(f)
            .unwrap_or_default()
            .lines()
            .skip(1)
            .any(|l| {
                let cols: Vec<&str> = l.split_whitespace().collect();
                cols.len() > 3 && cols[1].ends_with(&needle) && cols[3] == "0A"
            })
    })
}
pub mod rxe_vm;

mod perftest_clock;
// Not every test binary runs perftest.
#[allow(unused_imports)]
pub use perftest_clock::*;
