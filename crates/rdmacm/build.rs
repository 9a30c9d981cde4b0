//! Link arguments for `librdmacm.so.1`: the soname, immediate binding, and a version script
//! declaring rdma-core 44's nodes RDMACM_1.0 to 1.3, each inheriting the previous. Which symbol
//! goes in which node is decided by `.symver` directives in `src/symbols.rs`, as in
//! `crates/ibverbs`, because rustc's own anonymous version script would otherwise override ours.

use std::path::PathBuf;

const NODES: &[&str] = &["RDMACM_1.0", "RDMACM_1.1", "RDMACM_1.2", "RDMACM_1.3"];

fn main() {
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let mut map = String::new();
    let mut parent: Option<&str> = None;
    for node in NODES {
        match parent {
            None => map.push_str(&format!("{node} {{ }};\n")),
            Some(p) => map.push_str(&format!("{node} {{ }} {p};\n")),
        }
        parent = Some(node);
    }
    let path = out.join("librdmacm.map");
    std::fs::write(&path, map).expect("write the version script");
    println!(
        "cargo:rustc-cdylib-link-arg=-Wl,--version-script={}",
        path.display()
    );
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,librdmacm.so.1");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,now");
    println!("cargo:rerun-if-changed=build.rs");
}
