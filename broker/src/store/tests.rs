//! The journal and its compactor against a model: random enqueues, removals, queue
//! deletions, page records (flow-to-disk) and restarts, with tiny segments so that rolling and
//! compaction happen often. After every restart, recovery must hold exactly the model's
//! persistent messages, and every live queue's producer table the highest number any of
//! its enqueues carried (removed, cancelled and compacted ones included); while running,
//! every live body must read back byte for byte from wherever compaction moved it.

use super::DataDir;
use super::journal::{Job, Journal, JournalConfig};
use super::paging::{read_bodies, read_present};
use super::record::Record;
use super::recovery::{Recovered, Start, recover, recover_from};
use super::snapshot::SNAPSHOT_FILE;
use crate::amqp::{AMQPValue, FieldTable, Properties};
use crate::core::producers::{PRODUCER_HEADER, PUBLISH_SEQ_HEADER};
use crate::core::wiring::{Wiring, WiringQueue};
use crate::core::{DiskBody, Message};
use bytes::Bytes;
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Debug, Clone)]
enum Step {
    Enqueue(usize, usize),
    Remove(usize, usize),
    RemoveFreshlyEnqueued(usize),
    /// The queue's producer table replaced (a replica installed its primary's image) by
    /// one that has the producer at a number below its current one.
    ReplaceProducers(usize, u64),
    DeleteQueue(usize),
    /// A page record: on queue 0..3 (durable) or 3 (a queue the wiring does not list).
    Page(usize, usize),
    ReleasePage(usize),
    ReadAll,
    /// Keeps a copy of the current snapshot; the next restart starts from it instead of the
    /// one written at shutdown: an old snapshot and a long journal tail.
    SaveSnapshot,
    Restart,
}

/// The non-durable queue of the model: page records only.
const TRANSIENT_UID: u64 = 999;

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => (0usize..3, 1usize..300).prop_map(|(q, size)| Step::Enqueue(q, size)),
        4 => (0usize..3, any::<usize>()).prop_map(|(q, k)| Step::Remove(q, k)),
        2 => (0usize..3).prop_map(Step::RemoveFreshlyEnqueued),
        1 => (0usize..3, any::<u64>()).prop_map(|(q, n)| Step::ReplaceProducers(q, n)),
        1 => (0usize..3).prop_map(Step::DeleteQueue),
        3 => (0usize..4, 1usize..300).prop_map(|(q, size)| Step::Page(q, size)),
        2 => any::<usize>().prop_map(Step::ReleasePage),
        1 => Just(Step::ReadAll),
        1 => Just(Step::SaveSnapshot),
        1 => Just(Step::Restart),
    ]
}

fn wiring(uids: &[u64]) -> Wiring {
    Wiring {
        queues: uids
            .iter()
            .map(|&uid| WiringQueue {
                name: format!("q{uid}"),
                uid,
                durable: true,
                auto_delete: false,
                arguments: Default::default(),
                home: None,
                exclusive: false,
                session: None,
                roles: Default::default(),
            })
            .collect(),
        ..Default::default()
    }
}

/// Reads every body of `expected` ((uid, id) → size) back through the live index and
/// compares it with what was written.
fn check_reads(journal: &Journal, expected: &BTreeMap<(u64, u64), usize>) {
    let keys: Vec<DiskBody> = expected
        .iter()
        .map(|(&(uid, id), &len)| DiskBody { uid, id, len })
        .collect();
    let bodies = read_bodies(journal.index(), &keys, journal.last_submitted()).unwrap();
    for (k, body) in keys.iter().zip(bodies) {
        assert_eq!(
            &body[..],
            &message(k.len, k.id).body.bytes()[..],
            "body of {k:?}"
        );
    }
    // A catch-up's read: keys no live record holds come back as `None`, between the others.
    let gone = DiskBody {
        uid: 4242,
        id: 1,
        len: 3,
    };
    let mixed: Vec<DiskBody> = keys.iter().flat_map(|&k| [gone, k]).collect();
    let bodies = read_present(journal.index(), &mixed, journal.last_submitted()).unwrap();
    for (k, body) in mixed.iter().zip(bodies) {
        match body {
            None => assert_eq!(*k, gone, "only the gone key is missing"),
            Some(body) => assert_eq!(&body[..], &message(k.len, k.id).body.bytes()[..]),
        }
    }
    if !keys.is_empty() {
        assert!(read_bodies(journal.index(), &[gone], journal.last_submitted()).is_err());
    }
}

/// A persistent message of `size` bytes, numbered `id` by the session producer
/// [`PRODUCER`] (the model's ids grow per queue, as a producer's numbers do).
fn message(size: usize, id: u64) -> Arc<Message> {
    let mut body = vec![(id % 251) as u8; size];
    body[..8.min(size)].copy_from_slice(&id.to_be_bytes()[..8.min(size)]);
    let mut headers = FieldTable::default();
    headers.insert(PUBLISH_SEQ_HEADER.into(), AMQPValue::LongLongInt(id as i64));
    headers.insert(
        PRODUCER_HEADER.into(),
        AMQPValue::LongString(PRODUCER.into()),
    );
    Arc::new(Message::authored(
        "".into(),
        "k".into(),
        Properties::default()
            .with_delivery_mode(2)
            .with_headers(headers),
        Bytes::from(body),
    ))
}

/// The session producer that numbers every message of the model.
const PRODUCER: &str = "session:1";

/// Per live queue uid, the highest number [`PRODUCER`] reached it with, as recovered.
fn producers(r: &Recovered) -> BTreeMap<u64, u64> {
    r.disk
        .producers
        .iter()
        .filter_map(|(&uid, table)| {
            let highest = table.highest();
            let (_, seq) = highest.iter().find(|(p, _)| &**p == PRODUCER)?;
            Some((uid, *seq))
        })
        .collect()
}

static DIRS: AtomicU64 = AtomicU64::new(0);

/// What recovery put back, comparable: (uid, id) → (expiry, content header, body length).
type Restored = BTreeMap<(u64, u64), (Option<u64>, Vec<u8>, usize)>;

fn restored(r: &Recovered) -> Restored {
    r.messages
        .iter()
        .flat_map(|(uid, ms)| {
            ms.iter().map(move |(id, m, exp)| {
                ((*uid, *id), (*exp, m.header_payload.to_vec(), m.body_len()))
            })
        })
        .collect()
}

fn start(dir: &std::path::Path) -> (Journal, BTreeSet<(u64, u64)>, BTreeMap<u64, u64>) {
    start_with(dir, JournalConfig::default().removals_sync_ms)
}

/// [`start`], with removals and a backup's records synced after `sync_ms`.
fn start_with(
    dir: &std::path::Path,
    sync_ms: u64,
) -> (Journal, BTreeSet<(u64, u64)>, BTreeMap<u64, u64>) {
    let recovered = recover(dir).unwrap();
    assert!(recovered.damage.is_empty(), "{:?}", recovered.damage);
    // A snapshot is only ever ignored because the compactor deleted its position's segment
    // (an old one a test put back).
    assert!(
        recovered
            .snapshot_ignored
            .as_deref()
            .is_none_or(|r| r.contains("is gone")),
        "{:?}",
        recovered.snapshot_ignored
    );
    // The snapshot plus the journal after it hold exactly what the whole journal holds.
    let full = recover_from(dir, Start::FullScan).unwrap();
    assert_eq!(restored(&recovered), restored(&full));
    let tables = producers(&recovered);
    assert_eq!(tables, producers(&full));
    let found = recovered
        .messages
        .iter()
        .flat_map(|(uid, ms)| {
            ms.iter().map(move |(id, m, _)| {
                if let Some(body) = m.body.in_memory() {
                    assert_eq!(
                        &body[..8.min(body.len())],
                        &id.to_be_bytes()[..8.min(body.len())]
                    );
                }
                (*uid, *id)
            })
        })
        .collect();
    let config = JournalConfig {
        segment_bytes: 2048,
        // Snapshots all the time, so that restarts start from them and compactions make
        // them stale.
        snapshot_every_records: 5,
        removals_sync_ms: sync_ms,
        replica_sync_ms: sync_ms,
        ..JournalConfig::default()
    };
    (
        Journal::start(
            dir.to_owned(),
            config,
            recovered.disk,
            recovered.next_segment,
        )
        .unwrap(),
        found,
        tables,
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]
    #[test]
    fn recovery_holds_exactly_the_live_messages(steps in prop::collection::vec(step(), 1..250)) {
        let dir = std::env::temp_dir().join(format!("ringmq-journal-prop-{}-{}", std::process::id(), DIRS.fetch_add(1, Ordering::Relaxed)));
        let _ = std::fs::remove_dir_all(&dir);
        let data = DataDir::open(&dir).unwrap();
        let mut uids = vec![11u64, 22, 33];
        let mut next_uid = 100;
        let mut next_id: BTreeMap<u64, u64> = BTreeMap::new();
        let mut model: BTreeMap<(u64, u64), usize> = BTreeMap::new();
        let mut paged: BTreeMap<(u64, u64), usize> = BTreeMap::new();
        // Per live queue, the highest number PRODUCER enqueued on it.
        let mut highest: BTreeMap<u64, u64> = BTreeMap::new();
        let (mut journal, found, _) = start(&data.path);
        prop_assert!(found.is_empty());
        journal.submit(Job::Wiring { vhost: "/".into(), wiring: wiring(&uids) });
        for s in steps {
            match s {
                Step::Enqueue(q, size) => {
                    let uid = uids[q];
                    let id = next_id.entry(uid).or_insert(1);
                    journal.submit(Job::Records(vec![Record::Enqueued { uid, id: *id, expires_at_ms: None, message: message(size, *id) }]));
                    model.insert((uid, *id), size);
                    highest.insert(uid, *id);
                    *id += 1;
                }
                Step::Remove(q, k) => {
                    let uid = uids[q];
                    let ids: Vec<u64> = model.keys().filter(|(u, _)| *u == uid).map(|(_, i)| *i).collect();
                    if !ids.is_empty() {
                        let id = ids[k % ids.len()];
                        journal.submit(Job::Records(vec![Record::Removed { uid, ids: vec![id] }]));
                        model.remove(&(uid, id));
                    }
                }
                Step::RemoveFreshlyEnqueued(q) => {
                    // Enqueue and remove in one submission: the pair must cancel out.
                    let uid = uids[q];
                    let id = next_id.entry(uid).or_insert(1);
                    journal.submit(Job::Records(vec![
                        Record::Enqueued { uid, id: *id, expires_at_ms: None, message: message(10, *id) },
                        Record::Removed { uid, ids: vec![*id] },
                    ]));
                    highest.insert(uid, *id);
                    *id += 1;
                }
                Step::ReplaceProducers(q, n) => {
                    let uid = uids[q];
                    if let Some(h) = highest.get_mut(&uid) {
                        let replaced = n % (*h + 1);
                        journal.submit(Job::Records(vec![Record::Producers {
                            uid,
                            highest: vec![(Arc::from(PRODUCER), replaced)],
                            replace: true,
                        }]));
                        *h = replaced;
                    }
                }
                Step::DeleteQueue(q) => {
                    let old = uids[q];
                    uids[q] = next_uid;
                    next_uid += 1;
                    journal.submit(Job::Wiring { vhost: "/".into(), wiring: wiring(&uids) });
                    model.retain(|(u, _), _| *u != old);
                    paged.retain(|(u, _), _| *u != old);
                    highest.remove(&old);
                }
                Step::Page(q, size) => {
                    let uid = uids.get(q).copied().unwrap_or(TRANSIENT_UID);
                    let id = next_id.entry(uid).or_insert(1);
                    journal.submit(Job::Records(vec![Record::Paged { uid, id: *id, message: message(size, *id) }]));
                    paged.insert((uid, *id), size);
                    *id += 1;
                }
                Step::ReleasePage(k) => {
                    if !paged.is_empty() {
                        let key = *paged.keys().nth(k % paged.len()).expect("in range");
                        journal.submit(Job::Release { pages: vec![key], queues: vec![] });
                        paged.remove(&key);
                    }
                }
                Step::ReadAll => {
                    let mut all = model.clone();
                    all.extend(paged.iter().map(|(k, v)| (*k, *v)));
                    check_reads(&journal, &all);
                }
                Step::SaveSnapshot => {
                    let _ = std::fs::copy(data.path.join(SNAPSHOT_FILE), data.path.join("snapshot.saved"));
                }
                Step::Restart => {
                    journal.shutdown();
                    let _ = std::fs::rename(data.path.join("snapshot.saved"), data.path.join(SNAPSHOT_FILE));
                    let (j, found, tables) = start(&data.path);
                    prop_assert_eq!(&found, &model.keys().copied().collect::<BTreeSet<_>>());
                    prop_assert_eq!(&tables, &highest);
                    // Page records hold transient bodies: none survives a restart.
                    paged.clear();
                    journal = j;
                    check_reads(&journal, &model);
                }
            }
        }
        journal.shutdown();
        let (j, found, tables) = start(&data.path);
        prop_assert_eq!(&found, &model.keys().copied().collect::<BTreeSet<_>>());
        prop_assert_eq!(&tables, &highest);
        check_reads(&j, &model);
        j.shutdown();
        drop(data);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn a_message_acked_before_its_batch_is_never_written() {
    let (dir, data, journal) = fresh_journal("fast", &[1]);
    journal.submit(Job::Records(vec![
        Record::Enqueued {
            uid: 1,
            id: 1,
            expires_at_ms: None,
            message: message(1000, 1),
        },
        Record::Removed {
            uid: 1,
            ids: vec![1],
        },
    ]));
    journal.shutdown();
    assert_eq!(journal.stats.records_cancelled.load(Ordering::Relaxed), 1);
    assert_eq!(
        journal.stats.records_written.load(Ordering::Relaxed),
        1,
        "only its producer's number, in a Producers record"
    );
    let (journal, found, tables) = start(&data.path);
    assert!(found.is_empty());
    assert_eq!(
        tables,
        BTreeMap::from([(1, 1)]),
        "a resend of the consumed message is still recognised after the restart"
    );
    journal.shutdown();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A fresh data directory `ringmq-journal-NAME-PID`, a journal started on it, and the durable
/// queues `uids` in its wiring.
fn fresh_journal(name: &str, uids: &[u64]) -> (std::path::PathBuf, DataDir, Journal) {
    fresh_journal_with(name, uids, JournalConfig::default().removals_sync_ms)
}

/// [`fresh_journal`], with removals and a backup's records synced after `sync_ms`.
fn fresh_journal_with(
    name: &str,
    uids: &[u64],
    sync_ms: u64,
) -> (std::path::PathBuf, DataDir, Journal) {
    let dir = std::env::temp_dir().join(format!("ringmq-journal-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let data = DataDir::open(&dir).unwrap();
    let (journal, ..) = start_with(&data.path, sync_ms);
    let seq = journal.submit(Job::Wiring {
        vhost: "/".into(),
        wiring: wiring(uids),
    });
    wait_synced(&journal, seq);
    (dir, data, journal)
}

/// Submits the Enqueued record of message `id` (of `size` bytes) on queue `uid` and waits
/// until it is on disk.
fn enqueue_durably(journal: &Journal, uid: u64, id: u64, size: usize) {
    let seq = journal.submit(Job::Records(vec![Record::Enqueued {
        uid,
        id,
        expires_at_ms: None,
        message: message(size, id),
    }]));
    wait_synced(journal, seq);
}

/// Waits until the journal has processed submission `seq` (made it as durable as promised).
fn wait_synced(journal: &Journal, seq: u64) {
    let synced = journal.synced();
    while *synced.borrow() < seq {
        std::thread::sleep(std::time::Duration::from_micros(100));
    }
}

/// Copies the files of a data directory as they are: what a crash of the process leaves.
fn copy_as_crashed(from: &std::path::Path, to: &std::path::Path) {
    let _ = std::fs::remove_dir_all(to);
    for sub in ["", "journal"] {
        std::fs::create_dir_all(to.join(sub)).unwrap();
        for entry in std::fs::read_dir(from.join(sub)).unwrap() {
            let entry = entry.unwrap();
            if entry.file_type().unwrap().is_file() {
                std::fs::copy(entry.path(), to.join(sub).join(entry.file_name())).unwrap();
            }
        }
    }
}

/// Submits the removal of message `id` from queue `uid` and waits until the journal has
/// processed it; returns the journal's sync count before and after.
fn remove_and_count_syncs(journal: &Journal, uid: u64, id: u64) -> (u64, u64) {
    submit_and_count_syncs(
        journal,
        Job::Records(vec![Record::Removed { uid, ids: vec![id] }]),
    )
}

/// Submits `job` and waits until the journal has processed it; returns the journal's sync
/// count before and after.
fn submit_and_count_syncs(journal: &Journal, job: Job) -> (u64, u64) {
    let before = journal.stats.fsyncs.load(Ordering::Relaxed);
    let seq = journal.submit(job);
    wait_synced(journal, seq);
    (before, journal.stats.fsyncs.load(Ordering::Relaxed))
}

/// The job a backup hands its journal for message `id` of queue `uid`, replicated from the
/// queue's primary.
fn replicated_enqueue(uid: u64, id: u64) -> Job {
    Job::Replica(vec![Record::Enqueued {
        uid,
        id,
        expires_at_ms: None,
        message: message(10, id),
    }])
}

/// Waits (up to 10 s) until the journal has synced more than `before` times.
fn wait_for_a_sync_after(journal: &Journal, before: u64, what: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while journal.stats.fsyncs.load(Ordering::Relaxed) == before {
        assert!(
            std::time::Instant::now() < deadline,
            "{what} was never synced"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

#[test]
fn an_ack_alone_is_written_at_once_without_a_sync_and_rides_on_the_next_one() {
    let (dir, _data, journal) = fresh_journal_with("lazy-removal", &[1], 60_000);
    let crashed = dir.with_extension("crashed");
    enqueue_durably(&journal, 1, 1, 10);
    let (before, after) = remove_and_count_syncs(&journal, 1, 1);
    assert_eq!(after, before, "a commit of removals alone took a sync");
    // Written, so a crash of the process cannot undo the ack.
    copy_as_crashed(&dir, &crashed);
    let (recovered, found, _) = start(&crashed);
    assert!(found.is_empty(), "the acked message came back: {found:?}");
    recovered.shutdown();
    // The next commit that must be durable syncs, and covers the removal with it.
    enqueue_durably(&journal, 1, 2, 10);
    assert_eq!(journal.stats.fsyncs.load(Ordering::Relaxed), before + 1);
    journal.shutdown();
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&crashed);
}

#[test]
fn an_ack_with_nothing_after_it_is_synced_within_removals_sync_ms() {
    let (dir, _data, journal) = fresh_journal_with("removal-timer", &[1], 50);
    enqueue_durably(&journal, 1, 1, 10);
    let (before, _) = remove_and_count_syncs(&journal, 1, 1);
    wait_for_a_sync_after(&journal, before, "the removal");
    journal.shutdown();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn removals_sync_ms_zero_syncs_every_commit_of_acks() {
    let (dir, _data, journal) = fresh_journal_with("removal-at-once", &[1], 0);
    enqueue_durably(&journal, 1, 1, 10);
    let (before, after) = remove_and_count_syncs(&journal, 1, 1);
    assert_eq!(
        after,
        before + 1,
        "removals_sync_ms 0 must sync the ack's commit"
    );
    journal.shutdown();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_backups_enqueue_is_written_at_once_without_a_sync_and_a_primarys_commit_syncs_it() {
    let (dir, _data, journal) = fresh_journal_with("lazy-replica", &[1, 2], 60_000);
    let crashed = dir.with_extension("crashed");
    let (before, after) = submit_and_count_syncs(&journal, replicated_enqueue(1, 1));
    assert_eq!(
        after, before,
        "a backup's commit took a sync before it acknowledged"
    );
    // Written, so a crash of the process cannot lose what the backup acknowledged.
    copy_as_crashed(&dir, &crashed);
    let (recovered, found, _) = start(&crashed);
    assert!(
        found.contains(&(1, 1)),
        "the replicated message is gone: {found:?}"
    );
    recovered.shutdown();
    // A queue this member serves syncs before its confirm, and covers the backup's record.
    enqueue_durably(&journal, 2, 1, 10);
    assert_eq!(journal.stats.fsyncs.load(Ordering::Relaxed), before + 1);
    journal.shutdown();
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&crashed);
}

#[test]
fn a_backups_records_with_nothing_after_them_are_synced_within_replica_sync_ms() {
    let (dir, _data, journal) = fresh_journal_with("replica-timer", &[1], 50);
    let (before, _) = submit_and_count_syncs(&journal, replicated_enqueue(1, 1));
    wait_for_a_sync_after(&journal, before, "the backup's enqueue");
    journal.shutdown();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn replica_sync_ms_zero_syncs_a_backups_commit_before_it_acknowledges() {
    let (dir, _data, journal) = fresh_journal_with("replica-at-once", &[1], 0);
    let (before, after) = submit_and_count_syncs(&journal, replicated_enqueue(1, 1));
    assert_eq!(
        after,
        before + 1,
        "replica_sync_ms 0 must sync the backup's commit"
    );
    journal.shutdown();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_sync_job_syncs_what_a_backup_wrote_and_costs_nothing_when_all_is_synced() {
    let (dir, _data, journal) = fresh_journal_with("sync-barrier", &[1], 60_000);
    let (before, after) = submit_and_count_syncs(&journal, replicated_enqueue(1, 1));
    assert_eq!(after, before, "the backup's commit is written, not synced");
    let (_, synced) = submit_and_count_syncs(&journal, Job::Sync);
    assert_eq!(synced, before + 1, "the promoted copy is synced at once");
    let (_, again) = submit_and_count_syncs(&journal, Job::Sync);
    assert_eq!(again, synced, "nothing written since: no sync");
    journal.shutdown();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn segments_written_over_zeros_recover_whole_after_a_crash() {
    let (dir, _data, journal) = fresh_journal("zeros", &[1]);
    let crashed = dir.with_extension("crashed");
    for id in 1..=60u64 {
        enqueue_durably(&journal, 1, id, 200);
        // Time for the next spare, so that the segments rolled to are written over zeros.
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    copy_as_crashed(&dir, &crashed);
    let over_zeros = std::fs::read_dir(crashed.join("journal"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "seg"))
        .filter(|p| {
            let data = std::fs::read(p).unwrap();
            data.len() == 2048 && data.ends_with(&[0; 8])
        })
        .count();
    assert!(
        over_zeros >= 3,
        "{over_zeros} segments written over zeros: the spares were not used"
    );
    let (recovered, found, _) = start(&crashed);
    assert_eq!(found, (1..=60).map(|id| (1, id)).collect::<BTreeSet<_>>());
    recovered.shutdown();
    journal.shutdown();
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&crashed);
}

#[test]
fn compaction_reclaims_dead_segments_and_keeps_the_live_messages() {
    let (dir, data, journal) = fresh_journal("compact", &[1, 2, 3]);
    // A session's message on queue 3, written and consumed: its segment is compacted away,
    // and its producer's number must outlive it.
    enqueue_durably(&journal, 3, 7, 100);
    journal.submit(Job::Records(vec![Record::Removed {
        uid: 3,
        ids: vec![7],
    }]));
    // One slow consumer's message on queue 2, then a lot of traffic on queue 1 that is consumed.
    journal.submit(Job::Records(vec![Record::Enqueued {
        uid: 2,
        id: 1,
        expires_at_ms: None,
        message: message(100, 1),
    }]));
    for id in 1..=400u64 {
        // On disk before its removal, so that the removal cannot cancel it.
        enqueue_durably(&journal, 1, id, 200);
        if id > 1 {
            journal.submit(Job::Records(vec![Record::Removed {
                uid: 1,
                ids: vec![id - 1],
            }]));
        }
    }
    journal.shutdown();
    assert!(journal.stats.segments_compacted.load(Ordering::Relaxed) > 10);
    let segments = std::fs::read_dir(data.path.join("journal"))
        .unwrap()
        .count();
    assert!(
        segments <= 6,
        "{segments} segment files left: dead ones were not reclaimed"
    );
    let (j, found, tables) = start(&data.path);
    assert_eq!(found, BTreeSet::from([(1, 400), (2, 1)]));
    assert_eq!(
        tables,
        BTreeMap::from([(1, 400), (2, 1), (3, 7)]),
        "from the snapshot and from the full scan alike"
    );
    j.shutdown();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_page_record_reads_back_after_compaction_moved_it_and_is_not_recovered() {
    let (dir, data, journal) = fresh_journal("page", &[1]);
    // A transient body paged out first, then traffic that is consumed: the page's segment
    // becomes the oldest and is compacted, its record copied forward.
    journal.submit(Job::Records(vec![Record::Paged {
        uid: TRANSIENT_UID,
        id: 7,
        message: message(150, 7),
    }]));
    let first = loop {
        if let Some(at) = journal.index().index.lock().get((TRANSIENT_UID, 7)) {
            break at;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    };
    for id in 1..=300u64 {
        let seq = journal.submit(Job::Records(vec![Record::Enqueued {
            uid: 1,
            id,
            expires_at_ms: None,
            message: message(200, id),
        }]));
        assert!(
            journal
                .index()
                .wait_processed(seq, std::time::Duration::from_secs(10))
        );
        journal.submit(Job::Records(vec![Record::Removed {
            uid: 1,
            ids: vec![id],
        }]));
    }
    let seq = journal.last_submitted();
    assert!(
        journal
            .index()
            .wait_processed(seq, std::time::Duration::from_secs(10))
    );
    let moved = journal
        .index()
        .index
        .lock()
        .get((TRANSIENT_UID, 7))
        .unwrap();
    assert_ne!(
        moved.segment, first.segment,
        "compaction did not move the page"
    );
    assert!(journal.stats.segments_compacted.load(Ordering::Relaxed) > 0);
    check_reads(&journal, &BTreeMap::from([((TRANSIENT_UID, 7), 150)]));
    // Released: forgotten, and its segment can go.
    journal.submit(Job::Release {
        pages: vec![],
        queues: vec![TRANSIENT_UID],
    });
    let seq = journal.last_submitted();
    assert!(
        journal
            .index()
            .wait_processed(seq, std::time::Duration::from_secs(10))
    );
    assert_eq!(journal.index().index.lock().get((TRANSIENT_UID, 7)), None);
    journal.shutdown();
    // Written again before the restart, never released: still not recovered.
    let (journal, found, _) = start(&data.path);
    journal.submit(Job::Records(vec![Record::Paged {
        uid: 1,
        id: 500,
        message: message(50, 500),
    }]));
    journal.shutdown();
    let (j, found_after, _) = start(&data.path);
    assert!(
        found.is_empty() && found_after.is_empty(),
        "{found_after:?}"
    );
    j.shutdown();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_clean_restart_recovers_from_the_snapshot_without_reading_the_journal() {
    let (dir, data, journal) = fresh_journal("snap", &[1]);
    for id in 1..=50u64 {
        journal.submit(Job::Records(vec![Record::Enqueued {
            uid: 1,
            id,
            expires_at_ms: Some(1000 + id),
            message: message(100, id),
        }]));
    }
    journal.submit(Job::Records(vec![Record::Removed {
        uid: 1,
        ids: vec![3, 4],
    }]));
    journal.shutdown();
    let recovered = recover(&data.path).unwrap();
    assert_eq!((recovered.snapshot_records, recovered.records), (48, 0));
    let (j, found, _) = start(&data.path);
    let model: BTreeMap<(u64, u64), usize> = (1..=50u64)
        .filter(|id| !matches!(id, 3 | 4))
        .map(|id| ((1, id), 100))
        .collect();
    assert_eq!(found, model.keys().copied().collect::<BTreeSet<_>>());
    check_reads(&j, &model);
    j.shutdown();
    // A damaged snapshot is ignored, with the reason, and the full scan finds the same.
    let path = data.path.join(SNAPSHOT_FILE);
    let mut bytes = std::fs::read(&path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x01;
    std::fs::write(&path, bytes).unwrap();
    let recovered = recover(&data.path).unwrap();
    assert!(
        recovered
            .snapshot_ignored
            .as_deref()
            .is_some_and(|r| r.contains("checksum")),
        "{:?}",
        recovered.snapshot_ignored
    );
    assert_eq!(recovered.snapshot_records, 0);
    assert_eq!(
        recovered.messages[&1].len(),
        48,
        "the full scan recovers everything"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `wiring.json` byte for byte as a broker wrote it before the durable and shared wiring types
/// became one (no `durable`, no `home` fields).
const WIRING_FILE_BEFORE_ONE_TYPE: &str = r#"{"format":1,"vhosts":{"/":{"exchanges":[{"name":"alt","kind":"fanout","auto_delete":true,"internal":true,"arguments":{}},{"name":"orders","kind":"topic","auto_delete":false,"internal":false,"arguments":{"alternate-exchange":{"LongString":[97,108,116]}}}],"queues":[{"name":"spill","uid":16834447057089888969,"auto_delete":true,"arguments":{}},{"name":"work","uid":10451216379200822465,"auto_delete":false,"arguments":{"x-dead-letter-exchange":{"LongString":[97,108,116]},"x-message-ttl":{"LongInt":60000}}}],"bindings":[{"source":"alt","destination":"spill","destination_is_queue":true,"routing_key":"","arguments":{}},{"source":"orders","destination":"alt","destination_is_queue":false,"routing_key":"lost.*","arguments":{}},{"source":"orders","destination":"work","destination_is_queue":true,"routing_key":"order.#","arguments":{"x-match":{"LongString":[97,110,121]}}}]}}}"#;

#[test]
fn a_wiring_file_written_before_the_wiring_types_merged_restores_unchanged() {
    use crate::core::VHost;
    let dir = std::env::temp_dir().join(format!("ringmq-wiring-v1-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("wiring.json"), WIRING_FILE_BEFORE_ONE_TYPE).unwrap();
    let read = super::read_wiring_file(&dir).unwrap();
    let w = &read["/"];
    assert_eq!(
        w.queues.iter().map(|q| q.uid).collect::<Vec<_>>(),
        vec![16834447057089888969, 10451216379200822465],
        "journal records name queues by these uids"
    );
    let mut v = VHost::new("/", 1);
    assert!(v.restore_wiring(w.clone(), 0).is_empty());
    assert_eq!(&v.durable_wiring(), w, "everything restored, durable");
    let work = v.queue("work").unwrap();
    assert_eq!(work.args.message_ttl_ms, Some(60000));
    assert_eq!(work.args.dead_letter_exchange.as_deref(), Some("alt"));
    assert!(v.queue("spill").unwrap().auto_delete);
    let orders = v.exchange("orders").unwrap();
    assert_eq!(orders.alternate_exchange.as_deref(), Some("alt"));
    assert_eq!(orders.bindings().len(), 2);
    let alt = v.exchange("alt").unwrap();
    assert!(alt.durable && alt.internal && alt.auto_delete);
    super::write_wiring_file(&dir, &read).unwrap();
    assert_eq!(
        super::read_wiring_file(&dir).unwrap(),
        read,
        "rewritten, it reads the same"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
