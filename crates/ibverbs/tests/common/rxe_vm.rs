//! The `scripts/rxe-vm` guest of the kernel interop tests: whether one can boot here, booting
//! it with its tap device in a test's network namespace, waiting for lines on its console, and
//! killing it (QEMU and all) whatever happens.

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::Netns;

/// The guest's and the tap's addresses (private to the test's namespace).
pub const GUEST: &str = "10.77.0.2";
pub const HOST: &str = "10.77.0.1";
pub const TAP: &str = "rxetap0";
/// Booting under software emulation takes 10-60 s depending on the machine's load.
pub const BOOT: Duration = Duration::from_secs(180);

pub fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/rxe-vm")
}

/// Whether a guest can boot here; if not, why.
pub fn vm_possible() -> Result<(), String> {
    let o = Command::new(script())
        .arg("check")
        .output()
        .map_err(|e| e.to_string())?;
    if o.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&o.stderr).into_owned())
    }
}

/// A guest running `cmd`, with the process group of the script, `timeout` and QEMU: killed on
/// drop, so a failed test leaves no emulator running (the script removes its tap device).
pub struct Vm {
    child: Child,
    lines: mpsc::Receiver<String>,
    /// The console so far.
    pub log: String,
}

impl Vm {
    /// Boots the guest with its tap in `ns`; it runs `cmd` and powers off after `limit`
    /// whatever happens.
    pub fn boot(ns: &Netns, cmd: &[&str], limit: Duration) -> Self {
        let mut child = Command::new(script())
            .args(["run", "--netns", &ns.0, "--tap", TAP])
            .args([
                "--host-ip",
                &format!("{HOST}/24"),
                "--guest-ip",
                &format!("{GUEST}/24"),
            ])
            .args(["--timeout", &limit.as_secs().to_string(), "--"])
            .args(cmd)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .stdin(Stdio::null())
            .process_group(0)
            .spawn()
            .expect("start scripts/rxe-vm");
        let (tx, lines) = mpsc::channel();
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Self {
            child,
            lines,
            log: String::new(),
        }
    }

    /// Waits for a console line ending in `what`; panics with the console if it does not come
    /// within `limit` or the guest stops first.
    pub fn wait_for(&mut self, what: &str, limit: Duration) {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.log.push_str(&line);
                    self.log.push('\n');
                    // The console may put terminal escapes before a line.
                    if line.trim_end().ends_with(what) {
                        return;
                    }
                    assert!(
                        !line.contains("RXE-VM-EXIT"),
                        "the guest stopped before {what}:\n{}",
                        self.log
                    );
                }
                Err(_) => panic!("no {what} from the guest within {limit:?}:\n{}", self.log),
            }
        }
    }

    /// Waits for scripts/rxe-vm to end.
    pub fn wait_exit(&mut self, limit: Duration) -> ExitStatus {
        let deadline = Instant::now() + limit;
        loop {
            while let Ok(line) = self.lines.try_recv() {
                self.log.push_str(&line);
                self.log.push('\n');
            }
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "scripts/rxe-vm did not end:\n{}",
                self.log
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        let pgid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGKILL);
        let _ = self.child.wait();
    }
}
