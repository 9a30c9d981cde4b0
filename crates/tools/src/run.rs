//! `softverbs-run`: where softverbs' `libibverbs.so.1` and `librdmacm.so.1` are, and the
//! environment that makes a program load them instead of the system's.
//!
//! The libraries are found in this order: the `--lib-dir` option, `SOFTVERBS_LIB_DIR`,
//! `<prefix>/lib/softverbs` of the prefix the running tool is installed in (`<prefix>/bin`, as
//! `scripts/install` lays it out), the tool's own directory (a cargo target directory where
//! `crates/rdmacm/build-lib.sh` linked the libraries), and the default prefix of
//! `scripts/install`. The libraries live in a directory of their own, never in one the dynamic
//! loader searches by default, so that only the programs started this way use them.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// The C library every run needs.
pub const IBVERBS: &str = "libibverbs.so.1";
/// The connection manager's library, loaded by programs that use librdmacm.
pub const RDMACM: &str = "librdmacm.so.1";
/// The directory of a prefix that holds the libraries.
pub const LIB_SUBDIR: &str = "lib/softverbs";

/// `scripts/install`'s default prefix: `$XDG_DATA_HOME/softverbs`, or
/// `~/.local/share/softverbs`; `None` without a home directory.
pub fn default_prefix(xdg_data_home: Option<OsString>, home: Option<OsString>) -> Option<PathBuf> {
    let data = match xdg_data_home.filter(|d| Path::new(d).is_absolute()) {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(home.filter(|h| !h.is_empty())?).join(".local/share"),
    };
    Some(data.join("softverbs"))
}

/// The directories searched for the libraries, in order (see the module documentation).
pub fn candidates(
    lib_dir: Option<PathBuf>,
    env_dir: Option<OsString>,
    exe: Option<PathBuf>,
    default_prefix: Option<PathBuf>,
) -> Vec<PathBuf> {
    let mut out = Vec::new();
    out.extend(lib_dir);
    out.extend(env_dir.filter(|d| !d.is_empty()).map(PathBuf::from));
    if let Some(bin) = exe.as_deref().and_then(Path::parent) {
        if let Some(prefix) = bin.parent() {
            out.push(prefix.join(LIB_SUBDIR));
        }
        out.push(bin.to_path_buf());
    }
    out.extend(default_prefix.map(|p| p.join(LIB_SUBDIR)));
    out
}

/// The first of `candidates` that holds [`IBVERBS`]. An explicit directory (the option or the
/// variable, `explicit` of the first candidates) that lacks it is an error rather than skipped,
/// so that a typing mistake does not silently run another build.
pub fn find_lib_dir(candidates: &[PathBuf], explicit: usize) -> Result<PathBuf, String> {
    for (i, dir) in candidates.iter().enumerate() {
        if dir.join(IBVERBS).is_file() {
            return Ok(dir.clone());
        }
        if i < explicit {
            return Err(format!("{} has no {IBVERBS}", dir.display()));
        }
    }
    let tried: Vec<String> = candidates.iter().map(|d| d.display().to_string()).collect();
    Err(format!(
        "softverbs' {IBVERBS} was not found (looked in: {}); install it with scripts/install, \
         or name its directory with --lib-dir or SOFTVERBS_LIB_DIR",
        tried.join(", ")
    ))
}

/// `LD_LIBRARY_PATH` for the program: `dir` first, then what was set before.
pub fn library_path(dir: &Path, before: Option<OsString>) -> OsString {
    let mut v = OsString::from(dir);
    if let Some(b) = before.filter(|b| !b.is_empty()) {
        v.push(":");
        v.push(b);
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_prefix_follows_xdg() {
        assert_eq!(
            default_prefix(None, Some("/home/u".into())),
            Some(PathBuf::from("/home/u/.local/share/softverbs"))
        );
        assert_eq!(
            default_prefix(Some("/x/data".into()), Some("/home/u".into())),
            Some(PathBuf::from("/x/data/softverbs"))
        );
        // The XDG specification ignores relative paths.
        assert_eq!(
            default_prefix(Some("rel".into()), Some("/home/u".into())),
            Some(PathBuf::from("/home/u/.local/share/softverbs"))
        );
        assert_eq!(default_prefix(None, None), None);
    }

    #[test]
    fn candidates_come_in_order() {
        let c = candidates(
            Some("/opt".into()),
            Some("/env".into()),
            Some("/p/bin/softverbs-run".into()),
            Some("/d/softverbs".into()),
        );
        let want = [
            "/opt",
            "/env",
            "/p/lib/softverbs",
            "/p/bin",
            "/d/softverbs/lib/softverbs",
        ];
        assert_eq!(c, want.iter().map(PathBuf::from).collect::<Vec<_>>());
        assert_eq!(
            candidates(None, Some("".into()), None, None),
            Vec::<PathBuf>::new()
        );
    }

    #[test]
    fn the_first_directory_with_the_library_wins_and_explicit_ones_must_have_it() {
        let root = std::env::temp_dir().join(format!("svrun-{}", std::process::id()));
        let (a, b) = (root.join("a"), root.join("b"));
        std::fs::create_dir_all(&a).unwrap();
        std::fs::create_dir_all(&b).unwrap();
        std::fs::write(b.join(IBVERBS), b"").unwrap();
        let dirs = vec![a.clone(), b.clone()];
        assert_eq!(find_lib_dir(&dirs, 0), Ok(b.clone()));
        let e = find_lib_dir(&dirs, 1).unwrap_err();
        assert!(e.contains(&a.display().to_string()), "{e}");
        let e = find_lib_dir(&dirs[..1], 0).unwrap_err();
        assert!(e.contains("scripts/install"), "{e}");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn the_library_path_is_prepended() {
        assert_eq!(library_path(Path::new("/l"), None), "/l");
        assert_eq!(library_path(Path::new("/l"), Some("".into())), "/l");
        assert_eq!(library_path(Path::new("/l"), Some("/a:/b".into())), "/l:/a:/b");
    }
}
