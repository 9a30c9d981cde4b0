//! Shared helpers of the C ABI tests: where the freshly built `libibverbs.so` is, a directory
//! that presents it as `libibverbs.so.1` for `LD_LIBRARY_PATH`, and bounded process runs.
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

/// A directory holding `libibverbs.so.1` and `libibverbs.so` links to the built library.
pub fn lib_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("softverbs-ibverbs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let lib = built_library();
        for name in ["libibverbs.so.1", "libibverbs.so"] {
            let link = dir.join(name);
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink(&lib, &link).unwrap();
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
