//! rsockets between two processes of one host, over shared memory and over UDP
//! (`SOFTVERBS_SHM=0`): the test re-runs its own executable as a server and a client.
//! Covers a stream carrying 8 MiB each way byte for byte, then a half close and the end;
//! datagrams echoed; direct writes into a mapped buffer; a port nobody listens on; and a
//! peer killed while the other side waits in a read (keepalives notice it).

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use softverbs::rsocket::*;
use softverbs::HostBuffer;

fn lo(port: u16) -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, port))
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed ^ (i >> 12) as u8))
        .collect()
}

const BIG: usize = 8 << 20;

fn iomap_opts() -> StreamOptions {
    StreamOptions {
        iomap_size: Some(1),
        ..StreamOptions::default()
    }
}

fn server(scenario: &str) {
    if scenario == "dgram" {
        let s = RDatagram::bind(lo(0)).unwrap();
        println!("port {}", s.local_addr().unwrap().port());
        let mut buf = [0u8; 2048];
        for _ in 0..1000 {
            let (n, from) = s.recv_from(&mut buf).unwrap();
            s.send_to(&buf[..n], from).unwrap();
        }
        println!("ok");
        return;
    }
    let opts = if scenario == "iomap" {
        iomap_opts()
    } else {
        StreamOptions::default()
    };
    let l = RListener::bind_with(lo(0), &opts).unwrap();
    println!("port {}", l.local_addr().unwrap().port());
    let (mut s, _) = l.accept().unwrap();
    match scenario {
        "stream" => {
            let mut got = vec![0u8; BIG];
            s.read_exact(&mut got).unwrap();
            assert!(got == pattern(BIG, 1), "the client's bytes");
            s.write_all(&pattern(BIG, 2)).unwrap();
            // The client shuts down its side: the end of its data.
            assert_eq!(s.read(&mut [0u8; 16]).unwrap(), 0);
            s.write_all(b"bye").unwrap();
        }
        "iomap" => {
            let buf = HostBuffer::new(1 << 20).unwrap();
            let _map = s.iomap(&buf, Some(0)).unwrap();
            s.write_all(b"mapped").unwrap();
            let mut done = [0u8; 4];
            s.read_exact(&mut done).unwrap();
            assert_eq!(&done, b"done");
            let mut landed = vec![0u8; 1 << 20];
            buf.read(0, &mut landed).unwrap();
            assert!(landed == pattern(1 << 20, 3), "the direct writes landed");
        }
        "vanish" => {
            println!("connected");
            // Killed here by the test.
            std::thread::sleep(Duration::from_secs(120));
        }
        _ => panic!("no scenario {scenario}"),
    }
    drop(s);
    println!("ok");
}

fn client(scenario: &str, dst: SocketAddr) {
    match scenario {
        "stream" => {
            let mut c = RStream::connect(dst).unwrap();
            c.write_all(&pattern(BIG, 1)).unwrap();
            let mut got = vec![0u8; BIG];
            c.read_exact(&mut got).unwrap();
            assert!(got == pattern(BIG, 2), "the server's bytes");
            c.shutdown(Shutdown::Write).unwrap();
            let mut rest = Vec::new();
            c.read_to_end(&mut rest).unwrap();
            assert_eq!(rest, b"bye");
        }
        "dgram" => {
            let c = RDatagram::bind(lo(0)).unwrap();
            c.connect(dst).unwrap();
            let mut buf = [0u8; 2048];
            for i in 0..1000u32 {
                let msg = pattern(16 + (i as usize % 1400), i as u8);
                c.send(&msg).unwrap();
                let n = c.recv(&mut buf).unwrap();
                assert_eq!(&buf[..n], &msg[..], "echo {i}");
            }
        }
        "iomap" => {
            let mut c = RStream::connect_with(dst, &iomap_opts()).unwrap();
            let mut mapped = [0u8; 6];
            c.read_exact(&mut mapped).unwrap();
            let data = pattern(1 << 20, 3);
            let mut at = 0;
            while at < data.len() {
                at += c.iowrite(&data[at..], at as u64).unwrap();
            }
            c.write_all(b"done").unwrap();
        }
        "nobody" => {
            let e = RStream::connect(dst).unwrap_err();
            assert_eq!(e.errno(), 111, "ECONNREFUSED: {e}");
        }
        "vanish" => {
            let mut c = RStream::connect(dst).unwrap();
            c.set_keepalive(Some(Duration::from_secs(1))).unwrap();
            println!("reading");
            let started = Instant::now();
            let e = c.read(&mut [0u8; 16]).unwrap_err();
            assert_eq!(e.raw_os_error(), Some(104), "ECONNRESET: {e}");
            assert!(started.elapsed() < Duration::from_secs(60));
        }
        _ => panic!("no scenario {scenario}"),
    }
    // The data took the carrier under test.
    let shm_packets = common::lo().counters().tx_shm_packets;
    match std::env::var("SOFTVERBS_SHM").as_deref() {
        Ok("0") => assert_eq!(shm_packets, 0),
        _ if scenario == "nobody" => {}
        _ => assert!(shm_packets > 0, "nothing went through shared memory"),
    }
    println!("ok");
}

fn spawn(shm: &str, args: &[&str]) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(args)
        .env("SOFTVERBS_SHM", shm)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()
}

fn wait(child: &mut Child, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s.success();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn read_line(r: &mut impl BufRead) -> String {
    let mut s = String::new();
    r.read_line(&mut s).unwrap();
    s.trim().to_string()
}

fn stop(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

fn run(shm: &str, scenario: &str) -> bool {
    let mut srv = spawn(
        shm,
        &["--server", if scenario == "nobody" { "stream" } else { scenario }],
    );
    let mut out = BufReader::new(srv.stdout.take().unwrap());
    let port = read_line(&mut out)
        .strip_prefix("port ")
        .and_then(|p| p.parse::<u16>().ok());
    let Some(port) = port else {
        stop(&mut srv);
        return false;
    };
    if scenario == "nobody" {
        // Nobody is left on the port.
        stop(&mut srv);
    }
    let mut cli = spawn(shm, &["--client", scenario, &lo(port).to_string()]);
    let mut ok = true;
    if scenario == "vanish" {
        let mut cout = BufReader::new(cli.stdout.take().unwrap());
        ok = read_line(&mut out) == "connected" && read_line(&mut cout) == "reading";
        stop(&mut srv);
        ok &= wait(&mut cli, Duration::from_secs(90)) && read_line(&mut cout) == "ok";
    } else {
        ok &= wait(&mut cli, Duration::from_secs(180));
        if scenario != "nobody" {
            ok &= wait(&mut srv, Duration::from_secs(30)) && read_line(&mut out) == "ok";
        }
    }
    stop(&mut srv);
    stop(&mut cli);
    ok
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("--server") => return server(&args[2]),
        Some("--client") => return client(&args[2], args[3].parse().unwrap()),
        _ => {}
    }
    // A private base port, so the test does not depend on other softverbs processes of the
    // host; the children inherit it.
    std::env::set_var("SOFTVERBS_UDP_PORT", common::free_base_port().to_string());
    if args.iter().any(|a| a == "--list") {
        println!("rsocket_two_process: test");
        return;
    }
    let (mut passed, mut failed) = (0, 0);
    for shm in ["1", "0"] {
        for scenario in ["stream", "dgram", "iomap", "nobody", "vanish"] {
            let carrier = if shm == "0" { "udp" } else { "shared memory" };
            let ok = run(shm, scenario);
            println!(
                "test {scenario} over {carrier} ... {}",
                if ok { "ok" } else { "FAILED" }
            );
            if ok {
                passed += 1;
            } else {
                failed += 1;
            }
        }
    }
    println!("test result: {passed} passed; {failed} failed");
    if failed > 0 {
        std::process::exit(1);
    }
}
