//! Every crate of the workspace can be published: the metadata crates.io wants, a README in the
//! package, versioned dependencies on the other crates, and no source file reached from outside
//! the crate's directory (a package holds only its own directory). `cargo package --workspace`
//! builds every package from its own sources; it takes minutes, so the suite checks what it
//! relies on here instead.

use std::path::{Component, Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// crates.io's category slugs that the crates use, and others they might.
const CATEGORIES: &[&str] = &[
    "api-bindings",
    "command-line-utilities",
    "concurrency",
    "development-tools::profiling",
    "development-tools::testing",
    "encoding",
    "external-ffi-bindings",
    "hardware-support",
    "network-programming",
    "os::linux-apis",
    "parser-implementations",
    "simulation",
];

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn packages() -> Vec<Value> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
            "--manifest-path",
        ])
        .arg(workspace().join("Cargo.toml"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let meta: Value = serde_json::from_slice(&out.stdout).unwrap();
    meta["packages"].as_array().unwrap().clone()
}

fn text<'a>(p: &'a Value, key: &str) -> &'a str {
    p[key].as_str().unwrap_or_default()
}

#[test]
fn every_crate_has_the_metadata_to_publish() {
    let all = packages();
    assert_eq!(all.len(), 9, "the workspace's crates");
    for p in &all {
        let name = text(p, "name");
        for key in ["description", "license", "repository", "rust_version", "edition"] {
            assert!(!text(p, key).is_empty(), "{name} has no {key}");
        }
        assert_eq!(text(p, "license"), "MIT OR Apache-2.0", "{name}");
        let dir = Path::new(text(p, "manifest_path"))
            .parent()
            .unwrap()
            .to_path_buf();
        let readme = dir.join(text(p, "readme"));
        assert!(
            readme.starts_with(&dir) && readme.is_file(),
            "{name}: its readme {} is not a file of the package",
            readme.display()
        );
        let keywords: Vec<&str> = p["keywords"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| k.as_str().unwrap())
            .collect();
        assert!((1..=5).contains(&keywords.len()), "{name}: {keywords:?}");
        for k in &keywords {
            assert!(
                k.len() <= 20
                    && k.starts_with(|c: char| c.is_ascii_alphabetic())
                    && k.chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'),
                "{name}: keyword {k:?} is not one crates.io takes"
            );
        }
        let categories = p["categories"].as_array().unwrap();
        assert!((1..=5).contains(&categories.len()), "{name}");
        for c in categories {
            assert!(CATEGORIES.contains(&c.as_str().unwrap()), "{name}: category {c}");
        }
        // A dependency on another crate of the workspace needs a version (dev-dependencies
        // without one are left out of the package, which cargo allows).
        for d in p["dependencies"].as_array().unwrap() {
            let dep = text(d, "name");
            if dep.starts_with("softverbs") && d["kind"].is_null() {
                assert_ne!(text(d, "req"), "*", "{name} depends on {dep} without a version");
            }
        }
    }
}

/// `path` with `.` and `..` taken lexically (no links followed: a link inside the crate is
/// packaged as the file it points to).
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            c => out.push(c),
        }
    }
    out
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let path = e.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|x| x == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn no_crate_compiles_a_file_from_outside_its_directory() {
    for p in packages() {
        let dir = normalize(Path::new(text(&p, "manifest_path")).parent().unwrap());
        let mut files = Vec::new();
        rust_files(&dir.join("src"), &mut files);
        for file in files {
            let source = std::fs::read_to_string(&file).unwrap();
            for needle in ["#[path = \"", "include_str!(\"", "include_bytes!(\""] {
                for (at, _) in source.match_indices(needle) {
                    let rest = &source[at + needle.len()..];
                    let target = &rest[..rest.find('"').unwrap()];
                    let resolved = normalize(&file.parent().unwrap().join(target));
                    assert!(
                        resolved.starts_with(&dir),
                        "{}: {target} is outside the package {}",
                        file.display(),
                        text(&p, "name")
                    );
                }
            }
        }
    }
}
