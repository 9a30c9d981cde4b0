//! What the tests that run Debian's programs over our two libraries share: the libraries'
//! directory, one program pair at a time, network namespaces and bounded waits.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// A directory with `librdmacm.so.1` and `libibverbs.so.1`, the libraries cargo built for this
/// test run (the ibverbs one as a dev-dependency).
pub(crate) fn lib_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let exe = std::env::current_exe().expect("test executable path");
        let deps = exe.parent().expect("target/<profile>/deps");
        let dir = std::env::temp_dir().join(format!("softverbs-rdmacm-progs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (lib, name) in [
            ("librdmacm.so", "librdmacm.so.1"),
            ("libibverbs.so", "libibverbs.so.1"),
        ] {
            let target = deps.join(lib);
            assert!(target.exists(), "{} not built", target.display());
            let link = dir.join(name);
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink(&target, &link).unwrap();
        }
        dir
    })
}

/// One pair of programs at a time, so that a slow machine shared with other work does not push
/// them past their time limits.
pub(crate) fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) fn require(path: &str) {
    assert!(
        Path::new(path).exists(),
        "{path} is missing: run scripts/setup-deps (rdmacm-utils)"
    );
}

/// A network namespace with only its loopback up; removed on drop.
pub(crate) struct Netns(pub(crate) String);

impl Netns {
    pub(crate) fn new(tag: &str) -> Self {
        let name = format!("svcm{tag}{}", std::process::id());
        for args in [
            vec!["netns", "add", &name],
            vec!["-n", &name, "link", "set", "lo", "up"],
        ] {
            let o = Command::new("ip").args(&args).output().expect("ip runs");
            assert!(
                o.status.success(),
                "ip {args:?} (needs root): {}",
                String::from_utf8_lossy(&o.stderr)
            );
        }
        Self(name)
    }

    /// `program args` inside the namespace, over our libraries.
    pub(crate) fn command(&self, program: &str, args: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.0, "env"])
            .arg(format!("LD_LIBRARY_PATH={}", lib_dir().display()))
            .arg("stdbuf")
            .arg("-oL")
            .arg(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// Waits for `child`, killing it after `limit`.
pub(crate) fn wait_bounded(mut child: Child, limit: Duration) -> Output {
    let start = Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}

pub(crate) fn text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Runs `server` then, once it listens, `client`, each bounded; the client is retried while the
/// server is not listening yet (it fails fast with a rejection and no output then). Returns both
/// outputs.
pub(crate) fn pair(ns: &Netns, server: (&str, &[&str]), client: (&str, &[&str])) -> (Output, Output) {
    let srv = ns.command(server.0, server.1).spawn().expect("spawn the server");
    let start = Instant::now();
    let cli = loop {
        std::thread::sleep(Duration::from_millis(300));
        let o = wait_bounded(
            ns.command(client.0, client.1).spawn().expect("spawn the client"),
            Duration::from_secs(30),
        );
        // Only a rejection with nothing done (the server is not listening yet) is retried.
        let rejected = String::from_utf8_lossy(&o.stderr).contains("REJECTED") && o.stdout.is_empty();
        if !rejected || start.elapsed() > Duration::from_secs(10) {
            break o;
        }
    };
    (wait_bounded(srv, Duration::from_secs(30)), cli)
}

/// Compiles `tests/c/<name>.c` against the system headers and our libraries, runs it in a
/// namespace of its own and expects it to print "ok".
pub(crate) fn c_program(name: &str, tag: &str) {
    let _serial = serial();
    require("/usr/include/rdma/rdma_cma.h");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/c/{name}.c"));
    let bin = lib_dir().join(name);
    let cc = Command::new("gcc")
        .arg(&src)
        .arg("-o")
        .arg(&bin)
        .arg(format!("-L{}", lib_dir().display()))
        .args(["-l:librdmacm.so.1", "-l:libibverbs.so.1", "-Wl,-z,now", "-Werror"])
        .output()
        .expect("gcc runs");
    assert!(cc.status.success(), "{}", String::from_utf8_lossy(&cc.stderr));
    let ns = Netns::new(tag);
    let o = wait_bounded(
        ns.command(bin.to_str().unwrap(), &[]).spawn().expect("spawn"),
        Duration::from_secs(60),
    );
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(String::from_utf8_lossy(&o.stdout), "ok\n");
}
