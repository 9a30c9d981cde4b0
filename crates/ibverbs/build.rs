//! Link arguments for `libibverbs.so.1`: the soname, immediate binding, and a version script
//! that declares the version nodes of rdma-core 44. The script declares the nodes only; which
//! symbol goes in which node is decided by `.symver` directives in `src/symbols.rs`, because
//! rustc passes its own anonymous version script that would otherwise override ours.

use std::path::PathBuf;

/// The nodes of rdma-core 44's libibverbs, in definition order; each 1.x names the previous one
/// as its parent, and IBVERBS_PRIVATE_34 stands alone.
const NODES: &[&str] = &[
    "IBVERBS_1.0",
    "IBVERBS_1.1",
    "IBVERBS_1.5",
    "IBVERBS_1.6",
    "IBVERBS_1.7",
    "IBVERBS_1.8",
    "IBVERBS_1.9",
    "IBVERBS_1.10",
    "IBVERBS_1.11",
    "IBVERBS_1.12",
    "IBVERBS_1.13",
    "IBVERBS_1.14",
];

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
    map.push_str("IBVERBS_PRIVATE_34 { };\n");
    // This workspace's own private node: the table librdmacm.so.1 forwards to.
    map.push_str("SOFTVERBS_PRIVATE_1 { };\n");
    let path = out.join("libibverbs.map");
    std::fs::write(&path, map).expect("write the version script");
    println!(
        "cargo:rustc-cdylib-link-arg=-Wl,--version-script={}",
        path.display()
    );
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libibverbs.so.1");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,now");
    println!("cargo:rerun-if-changed=build.rs");
}
