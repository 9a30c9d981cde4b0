//! Mailboxes: records in order and intact across wrap-around, back-pressure, ring claims,
//! privacy checks, corruption, the doorbell, and a sender in another process.

use std::collections::VecDeque;
use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use softverbs_shm::{private_dir, Error, Inbox, Layout, Outbox};

const SMALL: Layout = Layout {
    rings: 4,
    ring_capacity: 4096,
};

/// A fresh mailbox path in this user's private test directory.
fn path(tag: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let dir = private_dir("softverbs-shm-test").unwrap();
    dir.join(format!(
        "{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

fn record(seq: u64, len: usize) -> Vec<u8> {
    let mut r: Vec<u8> = (0..len).map(|i| (i as u64 * 7 + seq) as u8).collect();
    if len >= 8 {
        r[..8].copy_from_slice(&seq.to_le_bytes());
    }
    r
}

fn drain(inbox: &Inbox) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    inbox.poll(usize::MAX, |r| out.push(r.to_vec()));
    out
}

#[test]
fn records_arrive_in_order_and_intact() {
    let p = path("order");
    let inbox = Inbox::create(&p, SMALL).unwrap();
    let mut out = Outbox::open(&p).unwrap();
    assert!(inbox.is_empty());
    for (seq, len) in [(1u64, 0usize), (2, 1), (3, 8), (4, 100), (5, 2040)] {
        let r = record(seq, len);
        assert!(out.push(len, |b| b.copy_from_slice(&r)).unwrap());
    }
    assert!(!inbox.is_empty());
    let got = drain(&inbox);
    let want: Vec<Vec<u8>> = [(1u64, 0usize), (2, 1), (3, 8), (4, 100), (5, 2040)]
        .iter()
        .map(|&(s, l)| record(s, l))
        .collect();
    assert_eq!(got, want);
    assert!(inbox.is_empty());
    assert_eq!(inbox.corrupt(), 0);
}

#[test]
fn a_full_ring_refuses_and_a_too_large_record_is_an_error() {
    let p = path("full");
    let inbox = Inbox::create(&p, SMALL).unwrap();
    let mut out = Outbox::open(&p).unwrap();
    assert_eq!(out.max_record(), 2048 - 8);
    assert!(matches!(
        out.push(2048, |_| {}),
        Err(Error::TooLarge { len: 2048, max: 2040 })
    ));
    let mut pushed = 0;
    while out.push(500, |b| b.fill(pushed as u8)).unwrap() {
        pushed += 1;
        assert!(pushed < 100, "a 4 KiB ring never fills");
    }
    assert_eq!(pushed, 4096 / 512, "each 500-byte record takes 512 bytes");
    assert_eq!(drain(&inbox).len(), pushed);
    assert!(out.push(500, |_| {}).unwrap(), "room again once consumed");
}

#[test]
fn rings_are_claimed_one_per_sender_and_freed_on_drop() {
    let p = path("claims");
    let inbox = Inbox::create(&p, SMALL).unwrap();
    let mut outs: Vec<Outbox> = (0..4).map(|_| Outbox::open(&p).unwrap()).collect();
    assert!(matches!(Outbox::open(&p), Err(Error::NoRing)));
    for (i, o) in outs.iter_mut().enumerate() {
        assert!(o.push(1, |b| b[0] = i as u8).unwrap());
    }
    let mut got: Vec<u8> = drain(&inbox).into_iter().map(|r| r[0]).collect();
    got.sort_unstable();
    assert_eq!(got, [0, 1, 2, 3], "one record from each sender");
    outs.pop();
    let mut again = Outbox::open(&p).unwrap();
    assert!(again.push(3, |b| b.copy_from_slice(b"new")).unwrap());
    assert_eq!(drain(&inbox), [b"new".to_vec()]);
    assert!(again.owner_alive());
}

#[test]
fn claimed_rings_are_read_in_turn_skipping_idle_ones() {
    let p = path("turns");
    let inbox = Inbox::create(&p, SMALL).unwrap();
    let mut outs: Vec<Outbox> = (0..4).map(|_| Outbox::open(&p).unwrap()).collect();
    // Ring 1 was claimed once (its bit stays set) and is empty now.
    drop(outs.remove(1));
    for round in 0..2u8 {
        for (i, o) in outs.iter_mut().enumerate() {
            assert!(o.push(2, |b| b.copy_from_slice(&[i as u8, round])).unwrap());
        }
    }
    // One record per ring in turn; a poll that stops early resumes with the next ring.
    let mut got = Vec::new();
    assert_eq!(inbox.poll(2, |r| got.push(r.to_vec())), 2);
    assert_eq!(inbox.poll(usize::MAX, |r| got.push(r.to_vec())), 4);
    let want: Vec<Vec<u8>> = [[0, 0], [1, 0], [2, 0], [0, 1], [1, 1], [2, 1]]
        .iter()
        .map(|r| r.to_vec())
        .collect();
    assert_eq!(got, want);
    assert_eq!(inbox.poll(usize::MAX, |_| {}), 0);
}

#[test]
fn the_last_of_the_most_rings_is_read() {
    let p = path("most");
    let layout = Layout {
        rings: softverbs_shm::MAX_RINGS,
        ..SMALL
    };
    let inbox = Inbox::create(&p, layout).unwrap();
    let mut outs: Vec<Outbox> = (0..layout.rings).map(|_| Outbox::open(&p).unwrap()).collect();
    let mut last = outs.pop().unwrap();
    assert!(last.push(4, |b| b.copy_from_slice(b"last")).unwrap());
    assert!(outs[0].push(5, |b| b.copy_from_slice(b"first")).unwrap());
    assert_eq!(drain(&inbox), [b"first".to_vec(), b"last".to_vec()]);
}

#[test]
fn a_dead_senders_ring_is_taken_over_with_its_records() {
    let p = path("dead");
    let inbox = Inbox::create(&p, Layout { rings: 1, ..SMALL }).unwrap();
    // A sender in a child process pushes one record and exits without freeing its ring.
    child("push-one", &p);
    let mut out = Outbox::open(&p).expect("the dead sender's ring is free again");
    assert!(out.push(2, |b| b.copy_from_slice(b"me")).unwrap());
    assert_eq!(drain(&inbox), [b"child".to_vec(), b"me".to_vec()]);
}

#[test]
fn a_sender_learns_that_the_owner_is_gone() {
    let p = path("owner");
    let inbox = Inbox::create(&p, SMALL).unwrap();
    let out = Outbox::open(&p).unwrap();
    assert!(out.owner_alive());
    assert!(out.owner_alive(), "asking does not change the answer");
    assert!(!out.is_closed());
    drop(inbox);
    assert!(out.is_closed(), "a dropped mailbox says so");
    // The lock goes with the last descriptor of the file: a child another test forks meanwhile
    // holds a copy until it execs (close-on-exec), so wait (bounded) for that.
    let deadline = Instant::now() + Duration::from_secs(10);
    while out.owner_alive() {
        assert!(Instant::now() < deadline, "the owner's lock outlived it");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(!p.exists(), "the owner removes its mailbox");
}

#[test]
fn a_new_owner_of_the_path_closes_the_old_mailbox() {
    let p = path("replace");
    let old = Inbox::create(&p, SMALL).unwrap();
    let mut out = Outbox::open(&p).unwrap();
    // The owner dies without dropping anything; a new process takes its place.
    std::mem::forget(old);
    let new = Inbox::create(&p, SMALL).unwrap();
    assert!(out.is_closed(), "senders of the old file learn it is gone");
    assert!(out.push(1, |b| b[0] = 1).unwrap(), "pushing there is harmless");
    let mut fresh = Outbox::open(&p).unwrap();
    assert!(!fresh.is_closed());
    assert!(fresh.push(3, |b| b.copy_from_slice(b"new")).unwrap());
    assert_eq!(drain(&new), [b"new".to_vec()]);
}

#[test]
fn mailboxes_of_owners_that_died_are_swept() {
    let p = path("swept");
    child("own-and-exit", &p);
    assert!(p.exists(), "an owner that exits without dropping leaves its file");
    let out = Outbox::open(&p).unwrap();
    assert!(!out.owner_alive());
    assert!(!out.is_closed());
    // The next mailbox made in the directory takes it away (and says so to its senders).
    let live = Inbox::create(&path("sweeper"), SMALL).unwrap();
    assert!(!p.exists());
    assert!(out.is_closed());
    // A live owner's mailbox stays.
    let q = path("kept");
    let _kept = Inbox::create(&q, SMALL).unwrap();
    assert_eq!(softverbs_shm::sweep(q.parent().unwrap()), 0);
    assert!(q.exists());
    drop(live);
}

#[test]
fn files_that_are_not_private_are_refused() {
    let p = path("perm");
    let _inbox = Inbox::create(&p, SMALL).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
    assert!(matches!(Outbox::open(&p), Err(Error::NotPrivate)));
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    assert!(Outbox::open(&p).is_ok());
    // Not a mailbox at all.
    let q = path("junk");
    std::fs::write(&q, vec![0u8; 8192]).unwrap();
    std::fs::set_permissions(&q, std::fs::Permissions::from_mode(0o600)).unwrap();
    assert!(matches!(Outbox::open(&q), Err(Error::BadLayout)));
    std::fs::remove_file(q).unwrap();
}

#[test]
fn a_corrupted_record_is_dropped_not_read() {
    let p = path("corrupt");
    let inbox = Inbox::create(&p, Layout { rings: 1, ..SMALL }).unwrap();
    let mut out = Outbox::open(&p).unwrap();
    assert!(out.push(16, |b| b.fill(1)).unwrap());
    // Overwrite the published record's length with one far beyond the ring (the file is the
    // mapping: the page cache is shared).
    let first_ring_data = 4096 + 128;
    let f = OpenOptions::new().write(true).open(&p).unwrap();
    f.write_all_at(&100_000u32.to_le_bytes(), first_ring_data)
        .unwrap();
    assert!(drain(&inbox).is_empty());
    assert_eq!(inbox.corrupt(), 1);
    // The ring goes on after the damage.
    assert!(out.push(3, |b| b.copy_from_slice(b"ok!")).unwrap());
    assert_eq!(drain(&inbox), [b"ok!".to_vec()]);
}

#[test]
fn the_doorbell_wakes_a_sleeping_owner() {
    let p = path("bell");
    let inbox = Inbox::create(&p, SMALL).unwrap();
    let mut out = Outbox::open(&p).unwrap();
    // Nothing to read: the wait ends by its timeout.
    let t = Instant::now();
    assert!(!inbox.wait(Duration::from_millis(20)));
    assert!(t.elapsed() >= Duration::from_millis(15));
    let sender = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        assert!(out.push(4, |b| b.copy_from_slice(b"ring")).unwrap());
    });
    let t = Instant::now();
    // Woken by the doorbell long before the timeout (even on a loaded machine).
    while inbox.is_empty() {
        inbox.wait(Duration::from_secs(30));
        assert!(t.elapsed() < Duration::from_secs(25), "never woken");
    }
    assert!(t.elapsed() < Duration::from_secs(25));
    assert_eq!(drain(&inbox), [b"ring".to_vec()]);
    sender.join().unwrap();
}

/// A sender that pushes one record at a time, each just as the owner may be on its way to
/// sleep, is always seen: no wait lasts until its timeout.
#[test]
fn no_wake_up_is_lost_while_the_owner_falls_asleep() {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    const ROUNDS: u64 = 3000;
    let p = path("asleep");
    let inbox = Inbox::create(&p, SMALL).unwrap();
    let mut out = Outbox::open(&p).unwrap();
    let consumed = Arc::new(AtomicU64::new(0));
    let seen = consumed.clone();
    let sender = std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(60);
        for i in 0..ROUNDS {
            // Varying delays move the push across the owner's way into its wait.
            for _ in 0..(i * 37) % 2000 {
                std::hint::spin_loop();
            }
            assert!(out.push(8, |b| b.copy_from_slice(&i.to_le_bytes())).unwrap());
            while seen.load(Ordering::Acquire) <= i {
                assert!(Instant::now() < deadline, "record {i} never consumed");
                std::thread::yield_now();
            }
        }
    });
    let mut next = 0u64;
    while next < ROUNDS {
        let t = Instant::now();
        if inbox.is_empty() {
            inbox.wait(Duration::from_secs(20));
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "record {next} pushed but its doorbell was missed"
        );
        inbox.poll(usize::MAX, |r| {
            assert_eq!(u64::from_le_bytes(r.try_into().unwrap()), next);
            next += 1;
        });
        consumed.store(next, Ordering::Release);
    }
    sender.join().unwrap();
}

const STREAM: u64 = 50_000;

/// A sender in another process streams records of varying sizes; the owner sleeps whenever it
/// runs dry. Every record arrives once, in order, intact.
#[test]
fn a_sender_in_another_process() {
    let p = path("proc");
    let inbox = Inbox::create(
        &p,
        Layout {
            rings: 2,
            ring_capacity: 64 * 1024,
        },
    )
    .unwrap();
    let mut child = spawn_child("stream", &p);
    let mut next = 0u64;
    let deadline = Instant::now() + Duration::from_secs(120);
    while next < STREAM {
        let n = inbox.poll(usize::MAX, |r| {
            let seq = u64::from_le_bytes(r[..8].try_into().unwrap());
            assert_eq!(seq, next, "in order, none lost or repeated");
            assert_eq!(r, record(seq, r.len()), "intact");
            assert_eq!(r.len(), 8 + (seq as usize * 13) % 3000);
            next += 1;
        });
        if n == 0 {
            inbox.wait(Duration::from_secs(1));
        }
        assert!(Instant::now() < deadline, "{next} of {STREAM} records");
    }
    assert!(child.wait().unwrap().success());
    assert_eq!(inbox.corrupt(), 0);
}

fn spawn_child(what: &str, p: &std::path::Path) -> std::process::Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_process", "--nocapture", "--test-threads=1"])
        .env("SOFTVERBS_SHM_CHILD", what)
        .env("SOFTVERBS_SHM_PATH", p)
        .spawn()
        .unwrap()
}

fn child(what: &str, p: &std::path::Path) {
    assert!(spawn_child(what, p).wait().unwrap().success());
}

/// Run in a child process by the tests above.
#[test]
fn child_process() {
    let (Ok(what), Ok(p)) = (
        std::env::var("SOFTVERBS_SHM_CHILD"),
        std::env::var("SOFTVERBS_SHM_PATH"),
    ) else {
        return;
    };
    if what == "own-and-exit" {
        let inbox = Inbox::create(p.as_ref(), SMALL).unwrap();
        std::mem::forget(inbox);
        std::process::exit(0);
    }
    let mut out = Outbox::open(p.as_ref()).unwrap();
    match what.as_str() {
        "push-one" => {
            assert!(out.push(5, |b| b.copy_from_slice(b"child")).unwrap());
            // Exit without dropping the outbox: the claim stays, naming a dead process.
            std::process::exit(0);
        }
        "stream" => {
            for seq in 0..STREAM {
                let len = 8 + (seq as usize * 13) % 3000;
                let r = record(seq, len);
                let deadline = Instant::now() + Duration::from_secs(60);
                while !out.push(len, |b| b.copy_from_slice(&r)).unwrap() {
                    assert!(Instant::now() < deadline, "the owner stopped reading");
                    std::thread::yield_now();
                }
            }
        }
        other => panic!("unknown child role {other}"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Any interleaving of pushes and polls behaves like a bounded FIFO of records.
    #[test]
    fn behaves_like_a_fifo(ops in proptest::collection::vec((any::<bool>(), 0usize..2041), 1..300)) {
        let p = path("prop");
        let inbox = Inbox::create(&p, Layout { rings: 1, ..SMALL }).unwrap();
        let mut out = Outbox::open(&p).unwrap();
        let mut model: VecDeque<Vec<u8>> = VecDeque::new();
        for (seq, (push, len)) in ops.into_iter().enumerate() {
            if push {
                let r = record(seq as u64, len);
                if out.push(len, |b| b.copy_from_slice(&r)).unwrap() {
                    model.push_back(r);
                } else {
                    // Full: what is queued cannot leave room for this record.
                    let used: usize = model.iter().map(|m| 8 + m.len().div_ceil(8) * 8).sum();
                    prop_assert!(used + 8 + len.div_ceil(8) * 8 > 4096 / 2, "refused with {used} bytes queued");
                }
            } else {
                let mut got = None;
                inbox.poll(1, |r| got = Some(r.to_vec()));
                prop_assert_eq!(got, model.pop_front());
            }
        }
        let rest = drain(&inbox);
        prop_assert_eq!(rest, model.into_iter().collect::<Vec<_>>());
        prop_assert_eq!(inbox.corrupt(), 0);
    }
}
