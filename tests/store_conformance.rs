//! Conformance of every `KvBackend` to the store contract, with the same test
//! code for each backend: redb always, sled with `--features sled-store`.
//!
//! The crash test runs a child process (this test binary again, selecting an
//! ignored helper test) that commits in a loop, kills it with SIGKILL at an
//! arbitrary point, and checks that every commit survived whole or not at
//! all, in order, and that everything before the last flush survived.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use contextfold::store::{KvBackend, Table, Write};
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

fn put(table: Table, key: &[u8], value: &[u8]) -> Write {
    Write::Put {
        table,
        key: key.to_vec(),
        value: value.to_vec(),
    }
}

fn delete(table: Table, key: &[u8]) -> Write {
    Write::Delete {
        table,
        key: key.to_vec(),
    }
}

/// Deterministic bytes that are not all alike, so a mixed-up chunk shows.
fn patterned(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn commit_writes_every_table_together<B: KvBackend>(open: fn(&Path) -> B) {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path());
    store
        .commit(&[put(Table::Records, b"r1", b"old")], false)
        .unwrap();
    let writes = vec![
        put(Table::Meta, b"checkpoint", b"42"),
        put(Table::Conversations, b"c1", b"head"),
        delete(Table::Records, b"r1"),
        put(Table::Blobs, b"b1", b"payload"),
    ];
    store.commit(&writes, false).unwrap();
    assert_eq!(
        store.get(Table::Meta, b"checkpoint").unwrap().as_deref(),
        Some(&b"42"[..])
    );
    assert_eq!(
        store.get(Table::Conversations, b"c1").unwrap().as_deref(),
        Some(&b"head"[..])
    );
    assert_eq!(store.get(Table::Records, b"r1").unwrap(), None);
    assert_eq!(
        store.get(Table::Blobs, b"b1").unwrap().as_deref(),
        Some(&b"payload"[..])
    );
    // Tables are separate namespaces.
    assert_eq!(store.get(Table::Meta, b"c1").unwrap(), None);
}

fn writes_in_one_commit_apply_in_order<B: KvBackend>(open: fn(&Path) -> B) {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path());
    let writes = vec![
        put(Table::Meta, b"a", b"1"),
        put(Table::Meta, b"a", b"2"),
        put(Table::Meta, b"gone", b"x"),
        delete(Table::Meta, b"gone"),
        delete(Table::Meta, b"back"),
        put(Table::Meta, b"back", b"3"),
    ];
    store.commit(&writes, true).unwrap();
    assert_eq!(
        store.get(Table::Meta, b"a").unwrap().as_deref(),
        Some(&b"2"[..])
    );
    assert_eq!(store.get(Table::Meta, b"gone").unwrap(), None);
    assert_eq!(
        store.get(Table::Meta, b"back").unwrap().as_deref(),
        Some(&b"3"[..])
    );
}

fn scan_prefix_is_ordered_and_bounded<B: KvBackend>(open: fn(&Path) -> B) {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path());
    let keys: Vec<&[u8]> = vec![
        b"",
        b"\x00",
        b"\xfe",
        b"\xfe\xff",
        b"\xff",
        b"\xff\x00",
        b"\xff\xfe\xff",
        b"\xff\xff",
        b"\xff\xff\x00",
        b"\xff\xff\xff",
        b"\xff\xff\xff\xff",
        b"conv/1/0001",
        b"conv/1/0002",
        b"conv/10/0001",
        b"conv/2/0001",
    ];
    // Insert out of order, and the same keys into a neighbouring table.
    let mut writes: Vec<Write> = keys
        .iter()
        .rev()
        .map(|k| put(Table::Records, k, k))
        .collect();
    writes.extend(keys.iter().map(|k| put(Table::Conversations, k, b"other")));
    store.commit(&writes, false).unwrap();

    for prefix in [
        &b""[..],
        b"\xff",
        b"\xff\xff",
        b"\xff\xff\xff",
        b"\xfe",
        b"\x00",
        b"conv/1/",
        b"conv/1",
        b"conv/3",
        b"\xff\xff\xff\xff\xff",
    ] {
        let mut expected: Vec<(Vec<u8>, Vec<u8>)> = keys
            .iter()
            .filter(|k| k.starts_with(prefix))
            .map(|k| (k.to_vec(), k.to_vec()))
            .collect();
        expected.sort();
        let got = store.scan_prefix(Table::Records, prefix).unwrap();
        assert_eq!(got, expected, "prefix {prefix:x?}");
    }
    assert_eq!(store.scan_prefix(Table::Blobs, b"").unwrap(), vec![]);
}

fn last_at_or_before_finds_the_record_holding_a_key<B: KvBackend>(open: fn(&Path) -> B) {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path());
    store
        .commit(
            &[
                put(Table::Records, b"a\x00\x08\x00", b"run 0"),
                put(Table::Records, b"a\x00\x08\x05", b"run 5"),
                put(Table::Records, b"a\x00\x09\x00", b"other kind"),
                put(Table::Records, b"b\x00\x08\x01", b"other key"),
                put(Table::Meta, b"a\x00\x08\x03", b"other table"),
            ],
            false,
        )
        .unwrap();
    let seek = |prefix: &[u8], key: &[u8]| {
        store
            .last_at_or_before(Table::Records, prefix, key)
            .unwrap()
            .map(|(k, v)| (k, String::from_utf8(v).unwrap()))
    };
    let run = |last: u8, value: &str| Some((vec![b'a', 0, 8, last], value.to_string()));
    assert_eq!(seek(b"a\x00\x08", b"a\x00\x08\x03"), run(0, "run 0"));
    assert_eq!(seek(b"a\x00\x08", b"a\x00\x08\x05"), run(5, "run 5"));
    assert_eq!(seek(b"a\x00\x08", b"a\x00\x08\xff\xff"), run(5, "run 5"));
    // Before the first record with the prefix, and a prefix whose nearest
    // record belongs to another prefix: none.
    assert_eq!(seek(b"a\x00\x08", b"a\x00\x08"), None);
    assert_eq!(seek(b"b\x00\x09", b"b\x00\x09\x07"), None);
    assert_eq!(
        store
            .last_at_or_before(Table::Blobs, b"a", b"a\x00")
            .unwrap(),
        None
    );
}

fn flushed_commits_survive_reopen<B: KvBackend>(open: fn(&Path) -> B) {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut store = open(dir.path());
        for i in 0u32..100 {
            store
                .commit(
                    &[put(
                        Table::Records,
                        &i.to_be_bytes(),
                        &patterned(64, i.into()),
                    )],
                    false,
                )
                .unwrap();
        }
        store
            .commit(&[put(Table::Meta, b"durable", b"yes")], true)
            .unwrap();
        store
            .commit(&[put(Table::Meta, b"after", b"flush")], false)
            .unwrap();
        store.flush().unwrap();
    }
    let store = open(dir.path());
    let records = store.scan_prefix(Table::Records, b"").unwrap();
    assert_eq!(records.len(), 100);
    for (i, (k, v)) in records.iter().enumerate() {
        assert_eq!(k, &(i as u32).to_be_bytes());
        assert_eq!(v, &patterned(64, i as u64));
    }
    assert_eq!(
        store.get(Table::Meta, b"durable").unwrap().as_deref(),
        Some(&b"yes"[..])
    );
    assert_eq!(
        store.get(Table::Meta, b"after").unwrap().as_deref(),
        Some(&b"flush"[..])
    );
}

fn delete_removes_and_tolerates_missing_keys<B: KvBackend>(open: fn(&Path) -> B) {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path());
    store
        .commit(
            &[
                put(Table::Blobs, b"k", b"v"),
                put(Table::Blobs, b"k2", b"v2"),
            ],
            false,
        )
        .unwrap();
    store
        .commit(
            &[
                delete(Table::Blobs, b"k"),
                delete(Table::Blobs, b"never-there"),
            ],
            false,
        )
        .unwrap();
    assert_eq!(store.get(Table::Blobs, b"k").unwrap(), None);
    assert_eq!(
        store.scan_prefix(Table::Blobs, b"k").unwrap(),
        vec![(b"k2".to_vec(), b"v2".to_vec())]
    );
    store.flush().unwrap();
    drop(store);
    let store = open(dir.path());
    assert_eq!(store.get(Table::Blobs, b"k").unwrap(), None);
}

fn empty_values_are_present_not_missing<B: KvBackend>(open: fn(&Path) -> B) {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path());
    store
        .commit(
            &[
                put(Table::Meta, b"empty", b""),
                put(Table::Meta, b"", b"empty key"),
            ],
            true,
        )
        .unwrap();
    assert_eq!(store.get(Table::Meta, b"empty").unwrap(), Some(vec![]));
    assert_eq!(
        store.get(Table::Meta, b"").unwrap().as_deref(),
        Some(&b"empty key"[..])
    );
    assert_eq!(store.get(Table::Meta, b"missing").unwrap(), None);
    drop(store);
    let store = open(dir.path());
    assert_eq!(store.get(Table::Meta, b"empty").unwrap(), Some(vec![]));
}

fn large_values_round_trip<B: KvBackend>(open: fn(&Path) -> B) {
    let dir = tempfile::tempdir().unwrap();
    let big = patterned(1 << 20, 7);
    let bigger = patterned((1 << 20) + 4093, 8);
    {
        let mut store = open(dir.path());
        store
            .commit(
                &[
                    put(Table::Blobs, b"one-mib", &big),
                    put(Table::Blobs, b"more", &bigger),
                ],
                false,
            )
            .unwrap();
        assert_eq!(
            store.get(Table::Blobs, b"one-mib").unwrap().as_deref(),
            Some(&big[..])
        );
        store.flush().unwrap();
    }
    let mut store = open(dir.path());
    assert_eq!(
        store.get(Table::Blobs, b"one-mib").unwrap().as_deref(),
        Some(&big[..])
    );
    assert_eq!(
        store.get(Table::Blobs, b"more").unwrap().as_deref(),
        Some(&bigger[..])
    );
    // Overwriting a large value with a small one leaves no trace of it.
    store
        .commit(&[put(Table::Blobs, b"one-mib", b"small")], true)
        .unwrap();
    assert_eq!(
        store.get(Table::Blobs, b"one-mib").unwrap().as_deref(),
        Some(&b"small"[..])
    );
}

/// Environment variable that turns the ignored crash helper into the child.
const CRASH_DIR_ENV: &str = "CONTEXTFOLD_STORE_CRASH_DIR";

/// The child: commit i writes the turn `i` into Conversations, moves the
/// single Records entry from i-1 to i and sets the checkpoint to i, all in
/// one non-durable commit; every 50 commits it flushes and reports.
fn crash_child<B: KvBackend>(open: fn(&Path) -> B) {
    let Some(dir) = std::env::var_os(CRASH_DIR_ENV) else {
        return;
    };
    let mut store = open(Path::new(&dir));
    for i in 1u64..=1_000_000 {
        let writes = vec![
            put(Table::Conversations, &i.to_be_bytes(), &patterned(200, i)),
            delete(Table::Records, &(i - 1).to_be_bytes()),
            put(Table::Records, &i.to_be_bytes(), b"latest"),
            put(Table::Meta, b"checkpoint", &i.to_be_bytes()),
        ];
        store.commit(&writes, false).unwrap();
        if i % 50 == 0 {
            store.flush().unwrap();
            println!("flushed {i}");
        }
    }
}

fn killed_writer_leaves_whole_ordered_commits<B: KvBackend>(
    open: fn(&Path) -> B,
    child_test: &str,
) {
    let dir = tempfile::tempdir().unwrap();
    let store_dir = dir.path().join("store");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            child_test,
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CRASH_DIR_ENV, &store_dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(n) = line.strip_prefix("flushed ") {
                if tx.send(n.trim().parse::<u64>().unwrap()).is_err() {
                    return;
                }
            }
        }
    });
    let mut flushed = 0;
    while flushed < 600 {
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(n) => flushed = n,
            Err(_) => {
                let _ = child.kill();
                panic!("crash child made no progress for 60 s after {flushed} commits (deadlock?)");
            }
        }
    }
    child.kill().unwrap();
    child.wait().unwrap();
    // Commits the child flushed after the last report we read also count.
    flushed = flushed.max(rx.try_iter().last().unwrap_or(0));

    let store = open(&store_dir);
    let checkpoint = store
        .get(Table::Meta, b"checkpoint")
        .unwrap()
        .map(|v| u64::from_be_bytes(v.try_into().unwrap()))
        .unwrap_or(0);
    assert!(
        checkpoint >= flushed,
        "checkpoint {checkpoint} is behind the flush at {flushed}"
    );
    let turns = store.scan_prefix(Table::Conversations, b"").unwrap();
    assert_eq!(
        turns.len() as u64,
        checkpoint,
        "turns and checkpoint disagree"
    );
    for (i, (k, v)) in turns.iter().enumerate() {
        let n = i as u64 + 1;
        assert_eq!(k, &n.to_be_bytes());
        assert_eq!(v, &patterned(200, n));
    }
    assert_eq!(
        store.scan_prefix(Table::Records, b"").unwrap(),
        vec![(checkpoint.to_be_bytes().to_vec(), b"latest".to_vec())]
    );
}

#[derive(Debug, Clone)]
enum Op {
    Put(bool, Vec<u8>, Vec<u8>),
    Delete(bool, Vec<u8>),
}

fn key_strategy() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(
        prop::sample::select(vec![0x00u8, 0x01, 0x7f, 0xfe, 0xff]),
        0..4,
    )
}

fn ops_strategy() -> impl Strategy<Value = Vec<(Vec<Op>, bool)>> {
    let op = prop_oneof![
        3 => (any::<bool>(), key_strategy(), prop::collection::vec(any::<u8>(), 0..6))
            .prop_map(|(t, k, v)| Op::Put(t, k, v)),
        1 => (any::<bool>(), key_strategy()).prop_map(|(t, k)| Op::Delete(t, k)),
    ];
    prop::collection::vec((prop::collection::vec(op, 0..6), any::<bool>()), 1..12)
}

fn table_of(first: bool) -> Table {
    if first {
        Table::Records
    } else {
        Table::Conversations
    }
}

fn matches_model<B: KvBackend>(store: &B, model: &BTreeMap<(bool, Vec<u8>), Vec<u8>>) {
    let mut prefixes = vec![vec![]];
    for a in [0x00u8, 0x7f, 0xfe, 0xff] {
        prefixes.push(vec![a]);
        for b in [0x00u8, 0xff] {
            prefixes.push(vec![a, b]);
        }
    }
    for side in [true, false] {
        for prefix in &prefixes {
            let expected: Vec<(Vec<u8>, Vec<u8>)> = model
                .iter()
                .filter(|((s, k), _)| *s == side && k.starts_with(prefix))
                .map(|((_, k), v)| (k.clone(), v.clone()))
                .collect();
            let got = store.scan_prefix(table_of(side), prefix).unwrap();
            assert_eq!(
                got,
                expected,
                "table {:?} prefix {prefix:x?}",
                table_of(side)
            );
        }
    }
    for ((side, key), value) in model {
        assert_eq!(
            store.get(table_of(*side), key).unwrap().as_ref(),
            Some(value)
        );
    }
    // The seek, from every prefix to each key that starts with it (held or
    // not): the greatest key at or before it with the prefix, or none.
    for side in [true, false] {
        for prefix in &prefixes {
            let mut probes: Vec<Vec<u8>> = model
                .keys()
                .filter(|(_, k)| k.starts_with(prefix))
                .flat_map(|(_, k)| [k.clone(), [k.as_slice(), &[0x80]].concat()])
                .collect();
            probes.push(prefix.clone());
            probes.push([prefix.as_slice(), &[0x80]].concat());
            for probe in probes {
                let expected = model
                    .iter()
                    .filter(|((s, k), _)| *s == side && k.starts_with(prefix) && *k <= probe)
                    .map(|((_, k), v)| (k.clone(), v.clone()))
                    .next_back();
                let got = store
                    .last_at_or_before(table_of(side), prefix, &probe)
                    .unwrap();
                assert_eq!(
                    got,
                    expected,
                    "table {:?} prefix {prefix:x?} key {probe:x?}",
                    table_of(side)
                );
            }
        }
    }
}

fn agrees_with_a_sorted_map<B: KvBackend>(open: fn(&Path) -> B) {
    let config = ProptestConfig {
        cases: 24,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    proptest!(config, |(commits in ops_strategy())| {
        let dir = tempfile::tempdir().unwrap();
        let mut model = BTreeMap::new();
        {
            let mut store = open(dir.path());
            for (ops, durable) in &commits {
                let writes: Vec<Write> = ops
                    .iter()
                    .map(|op| match op {
                        Op::Put(side, k, v) => {
                            model.insert((*side, k.clone()), v.clone());
                            put(table_of(*side), k, v)
                        }
                        Op::Delete(side, k) => {
                            model.remove(&(*side, k.clone()));
                            delete(table_of(*side), k)
                        }
                    })
                    .collect();
                store.commit(&writes, *durable).unwrap();
                matches_model(&store, &model);
            }
            store.flush().unwrap();
        }
        matches_model(&open(dir.path()), &model);
    });
}

macro_rules! conformance {
    ($backend:ident, $open:expr) => {
        mod $backend {
            use super::*;

            #[test]
            fn commit_writes_every_table_together() {
                super::commit_writes_every_table_together($open);
            }
            #[test]
            fn writes_in_one_commit_apply_in_order() {
                super::writes_in_one_commit_apply_in_order($open);
            }
            #[test]
            fn scan_prefix_is_ordered_and_bounded() {
                super::scan_prefix_is_ordered_and_bounded($open);
            }
            #[test]
            fn last_at_or_before_finds_the_record_holding_a_key() {
                super::last_at_or_before_finds_the_record_holding_a_key($open);
            }
            #[test]
            fn flushed_commits_survive_reopen() {
                super::flushed_commits_survive_reopen($open);
            }
            #[test]
            fn delete_removes_and_tolerates_missing_keys() {
                super::delete_removes_and_tolerates_missing_keys($open);
            }
            #[test]
            fn empty_values_are_present_not_missing() {
                super::empty_values_are_present_not_missing($open);
            }
            #[test]
            fn large_values_round_trip() {
                super::large_values_round_trip($open);
            }
            #[test]
            fn agrees_with_a_sorted_map() {
                super::agrees_with_a_sorted_map($open);
            }
            #[test]
            fn killed_writer_leaves_whole_ordered_commits() {
                super::killed_writer_leaves_whole_ordered_commits(
                    $open,
                    concat!(stringify!($backend), "::crash_child"),
                );
            }
            #[test]
            #[ignore = "child process of killed_writer_leaves_whole_ordered_commits"]
            fn crash_child() {
                super::crash_child($open);
            }
        }
    };
}

fn open_redb(dir: &Path) -> contextfold::store::redb_backend::RedbBackend {
    contextfold::store::redb_backend::RedbBackend::open(&dir.join("state.redb")).unwrap()
}

conformance!(redb, open_redb);

#[cfg(feature = "sled-store")]
fn open_sled(dir: &Path) -> contextfold::store::sled_backend::SledBackend {
    contextfold::store::sled_backend::SledBackend::open(&dir.join("sled")).unwrap()
}

#[cfg(feature = "sled-store")]
conformance!(sled, open_sled);

#[test]
fn redb_refuses_a_second_open_with_an_actionable_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.redb");
    let _first = contextfold::store::redb_backend::RedbBackend::open(&path).unwrap();
    let err = contextfold::store::redb_backend::RedbBackend::open(&path).unwrap_err();
    assert!(err.to_string().contains("already open"), "{err}");
}
