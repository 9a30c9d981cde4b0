//! `scripts/install` into a temporary prefix and `softverbs-run` from there: rdma-core's own C
//! `ibv_devices` lists the softverbs devices when started through it, the installation is
//! refused where it would shadow the system's libraries, and `--uninstall` leaves the prefix
//! as it was. Also `softverbs-run`'s manual, exit statuses and argument handling.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const RUN: &str = env!("CARGO_BIN_EXE_softverbs-run");
const BOUND: Duration = Duration::from_secs(60);
/// rdma-core's tools (Debian's ibverbs-utils and rdmacm-utils, from scripts/setup-deps).
const C_IBV_DEVICES: &str = "/usr/bin/ibv_devices";
const C_RPING: &str = "/usr/bin/rping";

struct Out {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// Runs `cmd` with a clean loader environment, killing it after [`BOUND`].
fn run(mut cmd: Command) -> Out {
    cmd.env_remove("LD_LIBRARY_PATH")
        .env_remove("SOFTVERBS_LIB_DIR")
        .env("PATH", "/usr/bin:/bin")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    let (mut out, mut err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let o = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let e = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + BOUND;
    let code = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st.code();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{cmd:?} ran past {BOUND:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Out {
        code,
        stdout: o.join().unwrap(),
        stderr: e.join().unwrap(),
    }
}

fn install(args: &[&Path]) -> Out {
    let mut cmd = Command::new(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/install"));
    cmd.args(args);
    run(cmd)
}

/// A fresh directory under the temporary directory.
fn temp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("softverbs-install-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The tools of this crate, by the names of its binaries' sources.
fn tools() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/bin"))
        .unwrap()
        .map(|e| {
            e.unwrap()
                .path()
                .file_stem()
                .unwrap()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    v.sort();
    v
}

/// What `scripts/install --from` takes: this build's tools, and the C libraries cargo built as
/// dev-dependencies (beside the test executables).
fn staged(tag: &str) -> PathBuf {
    let dir = temp(&format!("from-{tag}"));
    let bins = Path::new(RUN).parent().unwrap();
    let deps = std::env::current_exe().unwrap().parent().unwrap().to_path_buf();
    for t in tools() {
        std::os::unix::fs::symlink(bins.join(&t), dir.join(&t)).unwrap();
    }
    for lib in ["libibverbs.so", "librdmacm.so"] {
        assert!(deps.join(lib).exists(), "{lib} was not built");
        std::os::unix::fs::symlink(deps.join(lib), dir.join(lib)).unwrap();
    }
    dir
}

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn install_run_and_uninstall_leave_the_prefix_empty() {
    let from = staged("run");
    let prefix = temp("prefix");
    let r = install(&[Path::new("--prefix"), &prefix, Path::new("--from"), &from]);
    assert_eq!(r.code, Some(0), "{}\n{}", r.stdout, r.stderr);
    assert_eq!(entries(&prefix.join("bin")), tools());
    assert_eq!(
        entries(&prefix.join("lib/softverbs")),
        [
            "install-manifest",
            "libibverbs.so",
            "libibverbs.so.1",
            "librdmacm.so",
            "librdmacm.so.1"
        ]
    );
    // Installing again replaces the installation.
    let r = install(&[Path::new("--prefix"), &prefix, Path::new("--from"), &from]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);

    // rdma-core's C ibv_devices finds no device on its own library here (no RDMA hardware or
    // kernel module), and the softverbs ones through softverbs-run.
    let r = run(Command::new(C_IBV_DEVICES));
    assert!(!r.stdout.contains("sv_lo"), "{}", r.stdout);
    let sv_run = prefix.join("bin/softverbs-run");
    let mut cmd = Command::new(&sv_run);
    cmd.arg("ibv_devices");
    let r = run(cmd);
    assert_eq!(r.code, Some(0), "{}\n{}", r.stdout, r.stderr);
    assert!(
        r.stdout.contains("device") && r.stdout.contains("sv_lo"),
        "{}",
        r.stdout
    );

    // Programs of librdmacm load the installed one too.
    let mut cmd = Command::new(&sv_run);
    cmd.args(["ldd", C_RPING]);
    let r = run(cmd);
    let libdir = prefix.join("lib/softverbs");
    for lib in ["libibverbs.so.1", "librdmacm.so.1"] {
        let want = format!("{lib} => {}/{lib}", libdir.display());
        assert!(r.stdout.contains(&want), "no {want:?} in\n{}", r.stdout);
    }
    let mut cmd = Command::new(&sv_run);
    cmd.arg("--print-lib-dir");
    assert_eq!(run(cmd).stdout.trim(), libdir.display().to_string());

    let r = install(&[Path::new("--uninstall"), Path::new("--prefix"), &prefix]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert_eq!(entries(&prefix), Vec::<String>::new(), "the prefix is left empty");
    let r = install(&[Path::new("--uninstall"), Path::new("--prefix"), &prefix]);
    assert_eq!(r.code, Some(1), "nothing left to remove");
    std::fs::remove_dir_all(&prefix).unwrap();
    std::fs::remove_dir_all(&from).unwrap();
}

#[test]
fn install_keeps_what_it_did_not_install_and_refuses_system_prefixes() {
    let from = staged("foreign");
    let prefix = temp("foreign");
    std::fs::create_dir(prefix.join("bin")).unwrap();
    std::fs::write(prefix.join("bin/ibv_devices"), "someone else's").unwrap();
    std::fs::write(prefix.join("bin/other"), "").unwrap();
    let r = install(&[Path::new("--prefix"), &prefix, Path::new("--from"), &from]);
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    assert!(r.stderr.contains("ibv_devices"), "{}", r.stderr);
    assert_eq!(entries(&prefix), ["bin"]);
    assert_eq!(entries(&prefix.join("bin")), ["ibv_devices", "other"]);

    // With --force it replaces the file, and uninstalling keeps the directory it did not make
    // and the file it did not install.
    let r = install(&[
        Path::new("--force"),
        Path::new("--prefix"),
        &prefix,
        Path::new("--from"),
        &from,
    ]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let r = install(&[Path::new("--uninstall"), Path::new("--prefix"), &prefix]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert_eq!(entries(&prefix), ["bin"]);
    assert_eq!(entries(&prefix.join("bin")), ["other"]);

    for system in ["/usr", "/", "/usr/lib/x86_64-linux-gnu", "/usr/local"] {
        let r = install(&[
            Path::new("--prefix"),
            Path::new(system),
            Path::new("--from"),
            &from,
        ]);
        assert_eq!(r.code, Some(2), "{system}: {}", r.stderr);
        assert!(r.stderr.contains("private prefix"), "{}", r.stderr);
    }
    assert!(!Path::new("/usr/lib/softverbs").exists());
    std::fs::remove_dir_all(&prefix).unwrap();
    std::fs::remove_dir_all(&from).unwrap();
}

#[test]
fn help_is_a_manual_page() {
    let mut cmd = Command::new(RUN);
    cmd.arg("--help");
    let r = run(cmd);
    assert_eq!(r.code, Some(0));
    let mut at = 0;
    for section in [
        "NAME",
        "SYNOPSIS",
        "DESCRIPTION",
        "OPTIONS",
        "ENVIRONMENT",
        "EXAMPLES",
    ] {
        let found = r.stdout[at..]
            .lines()
            .position(|l| l == section)
            .unwrap_or_else(|| panic!("no {section} section (in order) in\n{}", r.stdout));
        at += r.stdout[at..]
            .lines()
            .take(found + 1)
            .map(|l| l.len() + 1)
            .sum::<usize>();
    }
    for option in [
        "--lib-dir",
        "--print-lib-dir",
        "SOFTVERBS_LIB_DIR",
        "LD_LIBRARY_PATH",
    ] {
        assert!(r.stdout.contains(option), "{option} is not described");
    }
}

#[test]
fn the_command_gets_the_library_path_its_arguments_and_gives_its_status() {
    let dir = temp("libdir");
    std::fs::write(dir.join("libibverbs.so.1"), "").unwrap();
    // Not `run`, which clears LD_LIBRARY_PATH.
    let o = Command::new(RUN)
        .arg("-L")
        .arg(&dir)
        .args([
            "sh",
            "-c",
            "echo \"$LD_LIBRARY_PATH|$*\"; exit 7",
            "sh",
            "--help",
            "-v",
        ])
        .env("LD_LIBRARY_PATH", "/before")
        .env_remove("SOFTVERBS_LIB_DIR")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(7), "the command's status");
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).trim(),
        format!("{}:/before|--help -v", dir.display()),
        "options after the command are the command's"
    );

    // SOFTVERBS_LIB_DIR names the directory as -L does.
    let mut cmd = Command::new(RUN);
    cmd.args(["sh", "-c", "echo $LD_LIBRARY_PATH"]);
    cmd.env("SOFTVERBS_LIB_DIR", &dir);
    let o = cmd.output().unwrap();
    assert!(String::from_utf8_lossy(&o.stdout).starts_with(&dir.display().to_string()));

    let status = |args: &[&str]| {
        let mut cmd = Command::new(RUN);
        cmd.arg("-L").arg(&dir).args(args);
        run(cmd)
    };
    let r = status(&["no-such-program-anywhere"]);
    assert_eq!(r.code, Some(127), "{}", r.stderr);
    assert!(r.stderr.contains("no-such-program-anywhere"), "{}", r.stderr);
    let r = status(&["/dev/null"]);
    assert_eq!(r.code, Some(126), "{}", r.stderr);
    let r = status(&[]);
    assert_eq!(r.code, Some(125), "no command: {}", r.stderr);
    let mut cmd = Command::new(RUN);
    cmd.args(["-L", "/nonexistent", "true"]);
    let r = run(cmd);
    assert_eq!(r.code, Some(125));
    assert!(
        r.stderr.contains("/nonexistent has no libibverbs.so.1"),
        "{}",
        r.stderr
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
