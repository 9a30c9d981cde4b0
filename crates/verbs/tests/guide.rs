//! The crate guide's two-process program (`examples/rdma_write.rs`), run as two processes:
//! this test re-runs its own executable as the server and then as the client, each running
//! the example's code unchanged with the example's command line.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

#[allow(dead_code, unreachable_pub)]
#[path = "../examples/rdma_write.rs"]
mod rdma_write;

/// Set in the children: run the example with the remaining arguments.
const ROLE: &str = "SOFTVERBS_GUIDE_EXAMPLE";
const LIMIT: Duration = Duration::from_secs(60);

fn example(args: &[&str]) -> Command {
    let mut c = Command::new(std::env::current_exe().expect("own executable"));
    c.args(args)
        .env(ROLE, "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// Waits for `child` at most until `deadline`, killing it if it is still running then.
fn finish(mut child: Child, deadline: Instant) -> Output {
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}

fn text(o: &Output) -> String {
    format!(
        "{}\nstdout: {}\nstderr: {}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn main() {
    if std::env::var_os(ROLE).is_some() {
        let args: Vec<String> = std::env::args().skip(1).collect();
        if let Err(e) = rdma_write::run(&args) {
            eprintln!("rdma_write: {e}");
            std::process::exit(1);
        }
        return;
    }
    print!("test the_guide_program_writes_between_two_processes ... ");
    let deadline = Instant::now() + LIMIT;
    // The server picks a free TCP port and says which.
    let mut server = example(&[]).spawn().expect("spawn the server");
    let stdout = server.stdout.take().expect("piped");
    let (tx, rx) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut lines = Vec::new();
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(addr) = line.strip_prefix("listening on ") {
                let _ = tx.send(addr.to_string());
            }
            lines.push(line);
        }
        lines
    });
    let addr = rx.recv_timeout(LIMIT);
    let client = addr.as_ref().ok().map(|a| {
        finish(
            example(&["--connect", a]).spawn().expect("spawn the client"),
            deadline,
        )
    });
    let server = finish(server, deadline);
    let lines = reader.join().expect("reader");
    let addr = addr.unwrap_or_else(|_| panic!("the server never listened: {}", text(&server)));
    let client = client.expect("the client ran");
    assert!(client.status.success(), "client to {addr}: {}", text(&client));
    assert_eq!(
        String::from_utf8_lossy(&client.stdout).trim(),
        format!("wrote {} bytes", rdma_write::MESSAGE.len())
    );
    assert!(server.status.success(), "server: {lines:?} {}", text(&server));
    let want = format!("received: {}", String::from_utf8_lossy(rdma_write::MESSAGE));
    assert_eq!(lines.last(), Some(&want), "server: {lines:?}");
    println!("ok");
}
