//! The export set: our `sym@version` set equals rdma-core 44's `librdmacm.so.1`, with the same
//! version definitions, soname and immediate binding; Debian's rdmacm-utils programs and a C
//! program compiled against the system headers load and bind against us.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The real rdma-core library, for comparisons only.
const SYSTEM_LIB: &str = "/usr/lib/x86_64-linux-gnu/librdmacm.so.1";

/// The `librdmacm.so` cargo built beside this test executable.
fn built_library() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let lib = exe.parent().expect("target/<profile>/deps").join("librdmacm.so");
    assert!(
        lib.exists(),
        "{} not found: cargo builds the cdylib with the tests",
        lib.display()
    );
    lib
}

/// A directory presenting the built library as `librdmacm.so.1`.
fn lib_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("softverbs-rdmacm-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for name in ["librdmacm.so.1", "librdmacm.so"] {
            let link = dir.join(name);
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink(built_library(), &link).unwrap();
        }
        dir
    })
}

fn require(path: &str) {
    assert!(
        Path::new(path).exists(),
        "{path} is missing: run scripts/setup-deps (librdmacm-dev, rdmacm-utils, binutils, gcc)"
    );
}

/// Runs `cmd`, killing it after `limit`.
fn run_bounded(mut cmd: Command, limit: Duration) -> Output {
    cmd.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .stdin(Stdio::null());
    let mut child = cmd.spawn().expect("spawn");
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

/// `(name, version, hidden)` of every defined, versioned dynamic symbol, from `objdump -T`.
fn versioned_exports(lib: &Path) -> BTreeSet<(String, String, bool)> {
    let out = Command::new("objdump")
        .arg("-T")
        .arg(lib)
        .output()
        .expect("objdump runs");
    assert!(out.status.success(), "objdump -T {} failed", lib.display());
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.contains("*UND*"))
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            if f.len() < 3 {
                return None;
            }
            let (ver, name) = (f[f.len() - 2], f[f.len() - 1]);
            let hidden = ver.starts_with('(');
            let ver = ver.trim_start_matches('(').trim_end_matches(')');
            (ver.starts_with("RDMACM") || ver == "Base").then(|| (name.to_string(), ver.to_string(), hidden))
        })
        .collect()
}

fn readelf(args: &[&str], lib: &Path) -> String {
    let out = Command::new("readelf")
        .args(args)
        .arg(lib)
        .output()
        .expect("readelf runs");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn export_set_equals_rdma_core() {
    require("/usr/bin/objdump");
    require(SYSTEM_LIB);
    let ours = versioned_exports(&built_library());
    let theirs = versioned_exports(Path::new(SYSTEM_LIB));
    // 68 functions and the 4 node symbols.
    assert_eq!(
        theirs.len(),
        72,
        "the reference library should define 72 versioned symbols"
    );
    let missing: Vec<_> = theirs.difference(&ours).collect();
    let extra: Vec<_> = ours.difference(&theirs).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "missing: {missing:#?}\nextra: {extra:#?}"
    );
}

#[test]
fn version_definitions_soname_and_bind_now() {
    require(SYSTEM_LIB);
    let lib = built_library();
    // The node names in order. rust-lld writes no parent (Verdaux) entries for the
    // inheritance the version script declares; the dynamic loader reads only each node's
    // name, so the names are what binding depends on.
    let defs = |l: &Path| -> Vec<String> {
        readelf(&["-V"], l)
            .lines()
            .skip_while(|l| !l.contains(".gnu.version_d"))
            .take_while(|l| !l.contains(".gnu.version_r"))
            .filter_map(|l| l.split("Name: ").nth(1).map(|n| n.trim().to_string()))
            .filter(|n| n.starts_with("RDMACM"))
            .collect()
    };
    let ours = defs(&lib);
    assert_eq!(ours, defs(Path::new(SYSTEM_LIB)));
    assert_eq!(ours, ["RDMACM_1.0", "RDMACM_1.1", "RDMACM_1.2", "RDMACM_1.3"]);
    let dynamic = readelf(&["-d"], &lib);
    assert!(dynamic.contains("Library soname: [librdmacm.so.1]"), "{dynamic}");
    assert!(
        dynamic.contains("BIND_NOW") || dynamic.contains("NOW"),
        "{dynamic}"
    );
}

#[test]
fn rdmacm_utils_load_and_bind_against_us() {
    for tool in [
        "/usr/bin/rping",
        "/usr/bin/ucmatose",
        "/usr/bin/udaddy",
        "/usr/bin/mckey",
    ] {
        require(tool);
        // LD_BIND_NOW resolves every symbol at load time, so a missing one fails here.
        let mut c = Command::new("ldd");
        c.arg("-r").arg(tool).env("LD_LIBRARY_PATH", lib_dir());
        let o = run_bounded(c, Duration::from_secs(20));
        let all = format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(o.status.success(), "{tool}: {all}");
        assert!(
            all.contains(&format!(
                "librdmacm.so.1 => {}",
                lib_dir().join("librdmacm.so.1").display()
            )),
            "{tool} does not resolve librdmacm.so.1 to ours: {all}"
        );
        assert!(
            !all.contains("undefined symbol")
                && !all.contains("version information")
                && !all.contains("not found"),
            "{tool}: {all}"
        );
    }
}

/// A C program built against `<rdma/rdma_cma.h>` and linked with our library, under rdma-core's
/// `libibverbs.so.1` (which has no connection-manager table): the connection-manager calls and
/// rsockets fail with -1/NULL and ENOSYS, the calls that need no table answer.
#[test]
fn c_program_sees_the_errno_convention() {
    require("/usr/include/rdma/rdma_cma.h");
    let dir = lib_dir();
    let src = dir.join("cm.c");
    std::fs::write(
        &src,
        r#"#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <arpa/inet.h>
#include <rdma/rdma_cma.h>
#include <rdma/rsocket.h>
int main(void) {
    errno = 0;
    if (rdma_create_event_channel() != NULL || errno != ENOSYS) return 1;
    struct rdma_cm_id *id = NULL;
    errno = 0;
    if (rdma_create_id(NULL, &id, NULL, RDMA_PS_TCP) != -1 || errno != ENOSYS || id) return 2;
    errno = 0;
    if (rsocket(AF_INET, SOCK_STREAM, 0) != -1 || errno != ENOSYS) return 3;
    errno = 0;
    if (rread(3, NULL, 0) != -1 || errno != ENOSYS) return 4;
    if (strcmp(rdma_event_str(RDMA_CM_EVENT_REJECTED), "RDMA_CM_EVENT_REJECTED")) return 5;
    struct rdma_cm_id fake;
    memset(&fake, 0, sizeof fake);
    fake.route.addr.src_sin.sin_family = AF_INET;
    fake.route.addr.src_sin.sin_port = htons(18515);
    if (rdma_get_src_port(&fake) != htons(18515) || rdma_get_dst_port(&fake) != 0) return 6;
    rdma_freeaddrinfo(NULL);
    printf("ok\n");
    return 0;
}
"#,
    )
    .unwrap();
    let bin = dir.join("cm");
    let cc = Command::new("gcc")
        .arg(&src)
        .arg("-o")
        .arg(&bin)
        .arg(format!("-L{}", dir.display()))
        .arg("-lrdmacm")
        .arg("-Wl,-z,now")
        .output()
        .expect("gcc runs");
    assert!(cc.status.success(), "{}", String::from_utf8_lossy(&cc.stderr));
    let mut c = Command::new(&bin);
    c.env("LD_LIBRARY_PATH", dir);
    let o = run_bounded(c, Duration::from_secs(20));
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(String::from_utf8_lossy(&o.stdout), "ok\n");
}
