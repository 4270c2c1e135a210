//! Flow-to-disk on a backup (issue #13): a replicated queue far over its memory budget is
//! kept within the budget on its backup as on its primary — the bodies beyond it live only
//! in the backup's own journal — and after a `kill -9` of the primary the promoted backup
//! delivers every confirmed message, in order, with its body read back from that journal;
//! promoted, it catches a new backup up from those same records, and that backup in turn
//! serves them all once it is promoted.

use crate::harness::*;
use futures_lite::StreamExt;
use lapin::BasicProperties;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use ringmq_tests::Broker;
use serde_json::Value;
use std::time::Duration;

/// Bytes of bodies one queue keeps in memory on every member.
const BUDGET_BYTES: u64 = 256 * 1024;
const BODY_BYTES: usize = 8 * 1024;
/// 12.5 MiB of bodies: fifty times the budget.
const MESSAGES: u32 = 1_600;
/// Taken from the first promoted backup; the rest from the second.
const FIRST_DRAIN: u32 = 1_000;
/// Longest wait for a backup to be in sync, and for an election.
const ROLE_LIMIT: Duration = Duration::from_secs(60);

/// Message `n`'s body: its number, then a pattern that differs per message and per byte.
fn body(n: u32) -> Vec<u8> {
    let mut b: Vec<u8> = (0..BODY_BYTES)
        .map(|i| (i as u32).wrapping_mul(31).wrapping_add(n) as u8)
        .collect();
    b[..4].copy_from_slice(&n.to_be_bytes());
    b
}

/// Even numbers are persistent (paged out to their `Enqueued` record), odd ones transient
/// (paged out to a record of their own).
fn properties(n: u32) -> BasicProperties {
    BasicProperties::default().with_delivery_mode(if n.is_multiple_of(2) { 2 } else { 1 })
}

fn rss_bytes(b: &Broker) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", b.pid())).expect("status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS line");
    kib * 1024
}

/// A counter from `b`'s `/metrics`.
fn counter(b: &Broker, series: &str) -> f64 {
    let text = b.admin_client().get("/metrics").expect("/metrics").body;
    text.as_str()
        .expect("text")
        .lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            (name == series).then(|| value.parse().ok())?
        })
        .unwrap_or_else(|| panic!("{series} missing from /metrics"))
}

/// Publishes every message through `b` with confirms, 64 in flight at most; each is acked.
async fn publish_all(b: &Broker, queue: &str) {
    let (conn, ch) = b.channel().await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut window = Vec::new();
    for n in 0..MESSAGES {
        window.push(
            ch.basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                &body(n),
                properties(n),
            )
            .await
            .unwrap(),
        );
        if window.len() == 64 || n + 1 == MESSAGES {
            for c in window.drain(..) {
                assert!(c.await.unwrap().is_ack(), "a publish was nacked");
            }
        }
    }
    let _ = conn.close(200, "published".into()).await;
}

/// Consumes `range` from `queue` through `b`, acking each, and checks each message is the
/// next one with its body intact.
async fn drain_in_order(b: &Broker, queue: &str, range: std::ops::Range<u32>, what: &str) {
    let (conn, ch) = b.channel().await;
    ch.basic_qos(128, BasicQosOptions::default()).await.unwrap();
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "audit".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    for n in range.clone() {
        let d = tokio::time::timeout(Duration::from_secs(20), consumer.next())
            .await
            .unwrap_or_else(|_| panic!("{what}: message {n} of {range:?} never came"))
            .unwrap()
            .unwrap();
        let got = u32::from_be_bytes(d.data[..4].try_into().expect("4 bytes"));
        assert_eq!(got, n, "{what}: out of order");
        assert!(d.data == body(n), "{what}: the body of message {n} differs");
        d.acker.ack(BasicAckOptions::default()).await.unwrap();
    }
    let _ = conn.close(200, "drained".into()).await;
}

/// `b`'s own copy of `queue` (its admin view's `local_copy`), once it holds `messages`.
fn local_copy(b: &Broker, queue: &str, role: &str, messages: u32, what: &str) -> Value {
    let view = wait_queue_view(b, queue, ROLE_LIMIT, what, |v| {
        v["local_copy"]["role"] == role && v["local_copy"]["messages"] == messages
    });
    view["local_copy"].clone()
}

fn ram_bytes(copy: &Value) -> u64 {
    copy["message_bytes_ram"]
        .as_u64()
        .expect("message_bytes_ram")
}

/// The queue's one in-sync backup as `b` sees it, once there is one that is not `not`.
fn in_sync_backup(b: &Broker, queue: &str, not: &str) -> String {
    let view = wait_queue_view(b, queue, ROLE_LIMIT, "a backup in sync", |v| {
        v["in_sync_backup_nodes"]
            .as_array()
            .is_some_and(|a| a.len() == 1 && a[0] != not)
    });
    view["in_sync_backup_nodes"][0]
        .as_str()
        .expect("a node id")
        .to_owned()
}

#[tokio::test]
async fn a_backup_pages_bodies_past_the_budget_and_serves_them_all_after_the_primary_dies() {
    let name = "repl-paging";
    let extra = format!("queue_memory_budget_bytes: {BUDGET_BYTES}\n");
    let (mut members, _ports, _secret) = start_cluster_with(name, N, &extra);
    let queue = "deep";
    let backup = declare_replicated(&members[0], queue, 1, ROLE_LIMIT).await[0].clone();
    let b = member_of(name, N, &backup);
    publish_all(&members[0], queue).await;

    // Every confirmed message is on the backup (a confirm waits for its ack), and the
    // backup holds no more of their bodies in memory than the primary.
    let on_primary = local_copy(&members[0], queue, "primary", MESSAGES, "the primary");
    let on_backup = local_copy(&members[b], queue, "backup", MESSAGES, "the backup");
    eprintln!(
        "{name}: {MESSAGES} × {BODY_BYTES} B, budget {BUDGET_BYTES} B; in memory: primary {} B \
         (RSS {} B), backup {} B (RSS {} B); backup page records {}",
        ram_bytes(&on_primary),
        rss_bytes(&members[0]),
        ram_bytes(&on_backup),
        rss_bytes(&members[b]),
        counter(&members[b], "ringmq_journal_pages_written_total"),
    );
    assert!(ram_bytes(&on_backup) <= BUDGET_BYTES, "backup: {on_backup}");
    assert!(
        ram_bytes(&on_backup) > 0,
        "the head stays in memory: {on_backup}"
    );
    assert!(
        ram_bytes(&on_primary) <= BUDGET_BYTES,
        "primary: {on_primary}"
    );
    assert!(
        counter(&members[b], "ringmq_journal_pages_written_total") > 0.0,
        "the transient bodies went to page records of the backup's own"
    );

    members[0].kill();
    wait_queue_view(&members[b], queue, ROLE_LIMIT, "the backup elected", |v| {
        v["node"].as_str() == Some(backup.as_str())
    });
    // Promoted, it catches the third member up from its paged records.
    let next = in_sync_backup(&members[b], queue, &backup);
    let c = member_of(name, N, &next);
    let caught_up = local_copy(&members[c], queue, "backup", MESSAGES, "the new backup");
    eprintln!(
        "{name}: new backup caught up from the promoted one: {} B in memory (RSS {} B)",
        ram_bytes(&caught_up),
        rss_bytes(&members[c]),
    );
    assert!(
        ram_bytes(&caught_up) <= BUDGET_BYTES,
        "new backup: {caught_up}"
    );

    let read_before = counter(&members[b], "ringmq_journal_bodies_read_total");
    drain_in_order(&members[b], queue, 0..FIRST_DRAIN, "the promoted backup").await;
    let read = counter(&members[b], "ringmq_journal_bodies_read_total") - read_before;
    eprintln!("{name}: the promoted backup read {read} bodies back from its journal");
    assert!(
        read > 0.0,
        "the paged bodies came from the promoted backup's journal"
    );

    // A majority again, then the promoted backup dies too: its own backup, caught up from
    // paged records, serves the rest.
    restart_member(&mut members, 0, name);
    let all: Vec<usize> = (0..N).collect();
    wait_settled(&mut members, &all, READY_LIMIT, name);
    let last = in_sync_backup(&members[b], queue, &backup);
    let l = member_of(name, N, &last);
    local_copy(
        &members[l],
        queue,
        "backup",
        MESSAGES - FIRST_DRAIN,
        "the last backup",
    );
    members[b].kill();
    let view = wait_queue_view(
        &members[l],
        queue,
        ROLE_LIMIT,
        "a backup elected again",
        |v| v["node"].as_str().is_some_and(|n| n != backup) && v["unavailable"] == false,
    );
    let p = member_of(name, N, view["node"].as_str().expect("a node id"));
    drain_in_order(
        &members[p],
        queue,
        FIRST_DRAIN..MESSAGES,
        "the second promoted backup",
    )
    .await;
}
