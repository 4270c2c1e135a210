//! The journal and its compactor against a model: random enqueues, removals, queue
//! deletions and restarts, with tiny segments so that rolling and compaction happen often.
//! After every restart, recovery must hold exactly the model's messages.

use super::DataDir;
use super::journal::{Job, Journal, JournalConfig};
use super::record::Record;
use super::recovery::recover;
use crate::amqp::Properties;
use crate::core::Message;
use crate::core::wiring::{DurableQueue, DurableWiring};
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
    DeleteQueue(usize),
    Restart,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => (0usize..3, 1usize..300).prop_map(|(q, size)| Step::Enqueue(q, size)),
        4 => (0usize..3, any::<usize>()).prop_map(|(q, k)| Step::Remove(q, k)),
        2 => (0usize..3).prop_map(Step::RemoveFreshlyEnqueued),
        1 => (0usize..3).prop_map(Step::DeleteQueue),
        1 => Just(Step::Restart),
    ]
}

fn wiring(uids: &[u64]) -> DurableWiring {
    DurableWiring {
        queues: uids
            .iter()
            .map(|&uid| DurableQueue {
                name: format!("q{uid}"),
                uid,
                auto_delete: false,
                arguments: Default::default(),
            })
            .collect(),
        ..Default::default()
    }
}

fn message(size: usize, id: u64) -> Arc<Message> {
    let mut body = vec![(id % 251) as u8; size];
    body[..8.min(size)].copy_from_slice(&id.to_be_bytes()[..8.min(size)]);
    Arc::new(Message::authored(
        "".into(),
        "k".into(),
        Properties::default().with_delivery_mode(2),
        Bytes::from(body),
    ))
}

static DIRS: AtomicU64 = AtomicU64::new(0);

fn start(dir: &std::path::Path) -> (Journal, BTreeSet<(u64, u64)>) {
    let recovered = recover(dir).unwrap();
    assert!(recovered.damage.is_empty(), "{:?}", recovered.damage);
    let found = recovered
        .messages
        .iter()
        .flat_map(|(uid, ms)| {
            ms.iter().map(move |(id, m, _)| {
                assert_eq!(
                    &m.body[..8.min(m.body.len())],
                    &id.to_be_bytes()[..8.min(m.body.len())]
                );
                (*uid, *id)
            })
        })
        .collect();
    let config = JournalConfig {
        segment_bytes: 2048,
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
        let mut model: BTreeSet<(u64, u64)> = BTreeSet::new();
        let (mut journal, found) = start(&data.path);
        prop_assert!(found.is_empty());
        journal.submit(Job::Wiring { vhost: "/".into(), wiring: wiring(&uids) });
        for s in steps {
            match s {
                Step::Enqueue(q, size) => {
                    let uid = uids[q];
                    let id = next_id.entry(uid).or_insert(1);
                    journal.submit(Job::Records(vec![Record::Enqueued { uid, id: *id, expires_at_ms: None, message: message(size, *id) }]));
                    model.insert((uid, *id));
                    *id += 1;
                }
                Step::Remove(q, k) => {
                    let uid = uids[q];
                    let ids: Vec<u64> = model.iter().filter(|(u, _)| *u == uid).map(|(_, i)| *i).collect();
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
                    *id += 1;
                }
                Step::DeleteQueue(q) => {
                    let old = uids[q];
                    uids[q] = next_uid;
                    next_uid += 1;
                    journal.submit(Job::Wiring { vhost: "/".into(), wiring: wiring(&uids) });
                    model.retain(|(u, _)| *u != old);
                }
                Step::Restart => {
                    journal.shutdown();
                    let (j, found) = start(&data.path);
                    prop_assert_eq!(&found, &model);
                    journal = j;
                }
            }
        }
        journal.shutdown();
        let (j, found) = start(&data.path);
        prop_assert_eq!(&found, &model);
        j.shutdown();
        drop(data);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn a_message_acked_before_its_batch_is_never_written() {
    let dir = std::env::temp_dir().join(format!("ringmq-journal-fast-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let data = DataDir::open(&dir).unwrap();
    let (journal, _) = start(&data.path);
    journal.submit(Job::Wiring {
        vhost: "/".into(),
        wiring: wiring(&[1]),
    });
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
    assert_eq!(journal.stats.records_written.load(Ordering::Relaxed), 0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn compaction_reclaims_dead_segments_and_keeps_the_live_messages() {
    let dir = std::env::temp_dir().join(format!("ringmq-journal-compact-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let data = DataDir::open(&dir).unwrap();
    let (journal, _) = start(&data.path);
    journal.submit(Job::Wiring {
        vhost: "/".into(),
        wiring: wiring(&[1, 2]),
    });
    // One slow consumer's message on queue 2, then a lot of traffic on queue 1 that is consumed.
    journal.submit(Job::Records(vec![Record::Enqueued {
        uid: 2,
        id: 1,
        expires_at_ms: None,
        message: message(100, 1),
    }]));
    for id in 1..=400u64 {
        let seq = journal.submit(Job::Records(vec![Record::Enqueued {
            uid: 1,
            id,
            expires_at_ms: None,
            message: message(200, id),
        }]));
        // Let the enqueue reach disk, so that the removal cannot cancel it.
        let synced = journal.synced();
        while *synced.borrow() < seq {
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
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
    let (j, found) = start(&data.path);
    assert_eq!(found, BTreeSet::from([(1, 400), (2, 1)]));
    j.shutdown();
    let _ = std::fs::remove_dir_all(&dir);
}
