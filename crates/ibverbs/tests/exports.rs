//! The export set: our `sym@version` set equals rdma-core 44's, with the same default (`@@`) and
//! hidden (`@`) versions, the same version definitions and the same soname; and rdma-core's own
//! tools load us without "no version information available" warnings.

mod common;

use std::collections::BTreeSet;
use std::process::Command;
use std::time::Duration;

use common::*;

/// `(name, version, hidden)` of every defined, versioned dynamic symbol, from `objdump -T`.
fn versioned_exports(lib: &std::path::Path) -> BTreeSet<(String, String, bool)> {
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
            (ver.starts_with("IBVERBS") || ver == "Base").then(|| (name.to_string(), ver.to_string(), hidden))
        })
        .collect()
}

fn readelf(args: &[&str], lib: &std::path::Path) -> String {
    let out = Command::new("readelf")
        .args(args)
        .arg(lib)
        .output()
        .expect("readelf runs");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn export_set_equals_rdma_core() {
    require("objdump");
    let ours = versioned_exports(&built_library());
    let theirs = versioned_exports(std::path::Path::new(SYSTEM_LIB));
    assert_eq!(
        theirs.len(),
        193,
        "the reference library should define 193 versioned symbols"
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
    let lib = built_library();
    let defs = |l: &std::path::Path| -> Vec<String> {
        readelf(&["-V"], l)
            .lines()
            .skip_while(|l| !l.contains(".gnu.version_d"))
            .take_while(|l| !l.contains(".gnu.version_r"))
            .filter_map(|l| l.split("Name: ").nth(1).map(|n| n.trim().to_string()))
            .filter(|n| n.starts_with("IBVERBS"))
            .collect()
    };
    let ours = defs(&lib);
    assert_eq!(ours, defs(std::path::Path::new(SYSTEM_LIB)));
    assert_eq!(ours.len(), 13);
    let dynamic = readelf(&["-d"], &lib);
    assert!(dynamic.contains("Library soname: [libibverbs.so.1]"), "{dynamic}");
    assert!(
        dynamic.contains("BIND_NOW") || dynamic.contains("NOW"),
        "{dynamic}"
    );
}

#[test]
fn rdma_core_tools_load_without_version_warnings() {
    for tool in [
        "/usr/bin/ibv_devices",
        "/usr/bin/ibv_devinfo",
        "/usr/bin/ibv_rc_pingpong",
        "/usr/bin/ib_write_bw",
    ] {
        require(tool);
        let mut c = command(tool);
        c.arg("--help");
        let o = run_bounded(c, Duration::from_secs(20));
        let (out, err) = text(&o);
        assert!(!err.contains("version information"), "{tool}: {err}");
        assert!(
            !err.contains("not found") && !err.contains("undefined symbol"),
            "{tool}: {err}{out}"
        );
    }
}

#[test]
fn providers_and_librdmacm_load_against_us() {
    // libmlx5/libefa register themselves from constructors and reach IBVERBS_PRIVATE_34;
    // librdmacm needs the 1.0/1.5/1.9/1.10 nodes.
    let dir = lib_dir();
    let src = dir.join("dlopen.c");
    std::fs::write(
        &src,
        r#"#include <dlfcn.h>
#include <stdio.h>
int main(void) {
    const char *libs[] = {"libmlx5.so.1", "libefa.so.1", "librdmacm.so.1"};
    for (int i = 0; i < 3; i++) {
        if (!dlopen(libs[i], RTLD_NOW | RTLD_GLOBAL)) { printf("FAIL %s\n", dlerror()); return 1; }
    }
    printf("OK\n");
    return 0;
}
"#,
    )
    .unwrap();
    let exe = dir.join("dlopen");
    let st = Command::new("gcc")
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .arg("-ldl")
        .status()
        .expect("gcc runs");
    assert!(st.success());
    let o = run_bounded(command(exe.to_str().unwrap()), Duration::from_secs(20));
    let (out, err) = text(&o);
    assert!(o.status.success() && out.contains("OK"), "{out}{err}");
    assert!(!err.contains("version information"), "{err}");
}
