//! A new backup catches up from a queue's image sent in chunks (issue #13): a queue larger
//! than one chunk and than the backup's `max_message_size`, and a queue whose bodies are
//! paged out to the journal (flow-to-disk), each get a new backup when their first backup is
//! killed; the new one receives the image in bounded chunks while the primary keeps taking
//! confirmed publishes (and, for the paged queue, consumers keep acking), becomes in sync,
//! and after the primary is killed serves every message the queue held, in order. Also: a
//! purge while the image goes out (bodies gone from the journal before their chunk is
//! built), and a catch-up over its time limit, abandoned and retried until one finishes.

use crate::harness::*;
use futures_lite::StreamExt;
use lapin::BasicProperties;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use ringmq_tests::{Broker, Ports};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Messages in the queue before its backup is replaced.
const MESSAGES: usize = 2_000;
/// Bytes of each body: the queue holds about 2 MiB.
const BODY_BYTES: usize = 1_024;
/// The members' `max_message_size`: an image of the queue is ~30 times that.
const MAX_MESSAGE_SIZE: usize = 64 * 1024;
/// Prefetch of the consumer that acks during a catch-up.
const PREFETCH: usize = 50;
/// Longest wait for a catch-up or an election.
const LIMIT: Duration = Duration::from_secs(60);

/// Three members (as [`start_cluster`]) with `extra` YAML added to each member's file.
fn start_cluster_with(name: &str, extra: &str) -> (Vec<Broker>, Vec<Ports>, Secret) {
    let secret = secret(name);
    let ports: Vec<Ports> = (0..N).map(|_| Ports::allocate()).collect();
    let mut members: Vec<Broker> = Vec::new();
    for i in 0..N {
        let seeds = if i == 0 { Seeds::None } else { Seeds::Others };
        let yaml = member_yaml(name, i, &ports, &secret.0, seeds, 60_000) + extra;
        members.push(Broker::start_on_ports(&yaml, ports[i]));
        let started: Vec<usize> = (0..=i).collect();
        wait_ready(
            &mut members,
            &started,
            READY_LIMIT,
            &format!("{name}: start"),
        );
    }
    let all: Vec<usize> = (0..N).collect();
    wait_settled(&mut members, &all, READY_LIMIT, &format!("{name}: start"));
    (members, ports, secret)
}

/// The body of message `tag`: the tag, then filler up to [`BODY_BYTES`].
fn body(tag: &str) -> Vec<u8> {
    let mut b = format!("{tag}:").into_bytes();
    b.resize(BODY_BYTES, b'.');
    b
}

/// The tag of a body made by [`body`].
fn tag_of(data: &[u8]) -> String {
    let text = String::from_utf8_lossy(data);
    let tag = text.split(':').next().unwrap_or_default().to_owned();
    assert_eq!(data, body(&tag).as_slice(), "body of {tag} intact");
    tag
}

/// Publishes `tags` persistent to `queue` through `b`, pipelined; panics unless each is
/// confirmed.
async fn publish_confirmed(b: &Broker, queue: &str, tags: &[String]) {
    let (conn, ch) = b.channel().await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut confirms = Vec::with_capacity(tags.len());
    for tag in tags {
        confirms.push(
            ch.basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                &body(tag),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .unwrap(),
        );
    }
    for c in confirms {
        assert!(c.await.unwrap().is_ack(), "a publish was nacked");
    }
    let _ = conn.close(200, "published".into()).await;
}

/// Publishes `late-<n>` messages, each confirmed, through `b` until `stop`; returns their
/// tags in order.
async fn publish_until(b: &Broker, queue: &str, stop: Arc<AtomicBool>) -> Vec<String> {
    let mut tags = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let batch: Vec<String> = (tags.len()..tags.len() + 20)
            .map(|n| format!("late-{n}"))
            .collect();
        publish_confirmed(b, queue, &batch).await;
        tags.extend(batch);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tags
}

/// Consumes and acks `count` messages of `queue` through `b`; returns their tags.
async fn consume_and_ack_tags(b: &Broker, queue: &str, count: usize) -> Vec<String> {
    let (conn, ch) = b.channel().await;
    ch.basic_qos(PREFETCH as u16, BasicQosOptions::default())
        .await
        .unwrap();
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "during-catch-up".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut tags = Vec::new();
    while tags.len() < count {
        let d = tokio::time::timeout(Duration::from_secs(10), consumer.next())
            .await
            .unwrap_or_else(|_| panic!("only {} of {count} deliveries", tags.len()))
            .unwrap()
            .unwrap();
        tags.push(tag_of(&d.data));
        // Slowly: the consumer runs while the image is being sent.
        if tags.len().is_multiple_of(25) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        d.acker.ack(BasicAckOptions::default()).await.unwrap();
    }
    // A round trip after the acks: the member has read them before the channel closes.
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            passive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    let _ = conn.close(200, "done".into()).await;
    tags
}

/// Takes every message of `queue` through `b` (no-ack): tags and redelivered flags.
async fn drain(b: &Broker, queue: &str, count: usize) -> Vec<(String, bool)> {
    let (_conn, ch) = b.channel().await;
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "audit".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut got = Vec::new();
    while got.len() < count {
        let d = tokio::time::timeout(Duration::from_secs(10), consumer.next())
            .await
            .unwrap_or_else(|_| panic!("only {} of {count} messages", got.len()))
            .unwrap()
            .unwrap();
        got.push((tag_of(&d.data), d.redelivered));
    }
    got
}

/// The scenario both tests run: `queue` (primary member 0, one backup) holds [`MESSAGES`];
/// its backup is killed, so the third member becomes its backup and catches up while
/// publishes go on (and, with `consume_during`, a consumer acks that many messages); once
/// it is in sync the killed member comes back and the primary is killed: the new backup is
/// elected and serves everything the queue held, in order.
async fn new_backup_catches_up_then_serves_everything(
    name: &str,
    extra_yaml: &str,
    consume_during: usize,
) {
    let (mut members, _ports, _secret) = start_cluster_with(name, extra_yaml);
    let queue = "big";
    let first_backup = declare_replicated(&members[0], queue, 1, LIMIT)
        .await
        .remove(0);
    let b = member_of(name, N, &first_backup);
    let c = (1..N).find(|&i| i != b).unwrap();
    let new_backup = crate::harness::node(name, c);
    let initial: Vec<String> = (0..MESSAGES).map(|i| format!("m{i}")).collect();
    publish_confirmed(&members[0], queue, &initial).await;
    // The ops frames of those batches (far more than `max_message_size` each batch) went to
    // the backup in frames it takes: it is still in sync.
    let view = queue_view(&members[0], queue).expect("the queue's view");
    assert_eq!(
        view["in_sync_backup_nodes"],
        serde_json::json!([first_backup]),
        "{name}: the first backup kept up with the publishes"
    );
    let completed_before = metric(&members[0], "ringmq_replication_catch_ups_completed_total");
    let timed_before = metric(
        &members[0],
        "ringmq_replication_catch_up_duration_seconds_count",
    );

    // The first backup dies: the third member takes its role and catches up, while the
    // primary keeps taking publishes (and acks).
    members[b].kill();
    let started = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let primary = &members[0];
    let publisher = publish_until(primary, queue, stop.clone());
    let consumer = async {
        if consume_during == 0 {
            return Vec::new();
        }
        consume_and_ack_tags(primary, queue, consume_during).await
    };
    let watch = async {
        let view = loop {
            let view = queue_view(primary, queue);
            let in_sync = view.as_ref().is_some_and(|v| {
                v["in_sync_backup_nodes"]
                    .as_array()
                    .is_some_and(|a| a.iter().any(|n| n.as_str() == Some(new_backup.as_str())))
            });
            if in_sync {
                break view.unwrap();
            }
            assert!(
                started.elapsed() < LIMIT,
                "{name}: {new_backup} not in sync within {LIMIT:?}; last view {view:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        eprintln!(
            "{name}: {new_backup} in sync {:?} after the first backup was killed",
            started.elapsed()
        );
        view
    };
    let (late, consumed, view) = {
        let stopper = async {
            let v = watch.await;
            stop.store(true, Ordering::Relaxed);
            v
        };
        let (late, consumed, view) = tokio::join!(publisher, consumer, stopper);
        (late, consumed, view)
    };
    assert_eq!(
        view["backup_nodes"],
        serde_json::json!([new_backup]),
        "{name}: the third member holds the backup role"
    );
    let completed = metric(&members[0], "ringmq_replication_catch_ups_completed_total");
    assert!(
        completed > completed_before,
        "{name}: the catch-up counted ({completed_before} → {completed})"
    );
    // Each completed catch-up's duration is observed once, and it took some time.
    let timed = metric(
        &members[0],
        "ringmq_replication_catch_up_duration_seconds_count",
    );
    assert_eq!(
        timed - timed_before,
        completed - completed_before,
        "{name}: one duration per completed catch-up"
    );
    let seconds = metric(
        &members[0],
        "ringmq_replication_catch_up_duration_seconds_sum",
    );
    assert!(
        seconds > 0.0 && seconds < LIMIT.as_secs_f64() * timed,
        "{name}: catch-ups took {seconds} s in all"
    );
    // The per-queue series agree with the view: the one backup, in sync, its lag drained
    // once the publisher stopped.
    let q = format!("vhost=\"/\",queue=\"{queue}\"");
    let primary = &members[0];
    let deadline = Instant::now() + LIMIT;
    loop {
        let series = |s: &str| detailed_metric(primary, &format!("ringmq_replication_{s}"));
        let counts = (
            series(&format!("queue_backups{{{q}}}")),
            series(&format!("queue_backups_in_sync{{{q}}}")),
            series(&format!("queue_lag_ops{{{q},backup=\"{new_backup}\"}}")),
        );
        if counts == (Some(1.0), Some(1.0), Some(0.0)) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{name}: per-queue series (backups, in sync, lag ops) {counts:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        detailed_metric(
            primary,
            &format!("ringmq_replication_queue_catch_up_messages{{{q},backup=\"{new_backup}\"}}")
        ),
        None,
        "{name}: no catch-up under way once the backup is in sync"
    );
    let chunks_sent = metric(&members[0], "ringmq_replication_frames_sent_total");
    eprintln!(
        "{name}: {} late publishes, {} consumed during the catch-up; {chunks_sent} frames sent; \
         abandoned {}",
        late.len(),
        consumed.len(),
        metric(&members[0], "ringmq_replication_catch_ups_abandoned_total")
    );
    assert_eq!(
        consumed,
        initial[..consume_during].to_vec(),
        "{name}: the consumer took the head of the queue"
    );
    let log = members[0].log_tail(5_000);
    for line in log.lines().filter(|l| l.contains("catch-up")) {
        eprintln!("{name}: primary: {line}");
    }

    // The killed member comes back (so that two of three keep the majority), then the
    // primary dies: the caught-up backup is elected and serves every message.
    restart_member(&mut members, b, name);
    wait_settled(
        &mut members,
        &[0, 1, 2],
        READY_LIMIT,
        &format!("{name}: rejoin"),
    );
    members[0].kill();
    wait_queue_view(
        &members[c],
        queue,
        LIMIT,
        "the caught-up backup elected",
        |v| v["node"].as_str() == Some(new_backup.as_str()),
    );
    let expected: Vec<String> = initial[consume_during..]
        .iter()
        .chain(late.iter())
        .cloned()
        .collect();
    let got = drain(&members[c], queue, expected.len()).await;
    // The consumer's prefetch went out unacked and came back when it closed: redelivered.
    let prefetched = if consume_during > 0 { PREFETCH } else { 0 };
    if let Some(at) = got.iter().skip(prefetched).position(|(_, r)| *r) {
        panic!(
            "{name}: message {} after the failover is marked redelivered; only the first \
             {prefetched} may be",
            at + prefetched
        );
    }
    let got: Vec<String> = got.into_iter().map(|(t, _)| t).collect();
    assert_eq!(
        got.len(),
        expected.len(),
        "{name}: the queue after the failover"
    );
    if let Some(at) = got.iter().zip(&expected).position(|(a, b)| a != b) {
        panic!(
            "{name}: the queue after the failover differs at {at}: got {:?}, expected {:?}",
            &got[at..(at + 5).min(got.len())],
            &expected[at..(at + 5).min(expected.len())]
        );
    }
}

/// ~2 MiB of messages against a 64 KiB `max_message_size`: the image goes in ~30 chunks.
#[tokio::test]
async fn a_queue_larger_than_a_message_catches_up_a_new_backup_in_chunks() {
    let extra = format!("max_message_size: {MAX_MESSAGE_SIZE}\nqueue_memory_budget_bytes: 0\n");
    new_backup_catches_up_then_serves_everything("catch-up-chunks", &extra, 0).await;
}

/// Flow-to-disk: with a 64 KiB memory budget nearly every body of the queue is only in the
/// journal; the image reads them back while a consumer acks the head of the queue (some of
/// the image's messages leave the queue before their chunk is built).
#[tokio::test]
async fn a_queue_paged_out_to_disk_catches_up_a_new_backup_while_consumers_ack() {
    let extra = format!(
        "max_message_size: {MAX_MESSAGE_SIZE}\nqueue_memory_budget_bytes: {MAX_MESSAGE_SIZE}\n"
    );
    new_backup_catches_up_then_serves_everything("catch-up-paged", &extra, 300).await;
}

/// A purge while the new backup's image is still going out: most of the image's paged-out
/// bodies are gone from the journal before their chunk is built. They go as stand-ins, the
/// purge (held back behind the last chunk) removes them on the backup, and after the
/// failover the backup holds exactly what the primary held: the messages published after
/// the purge.
#[tokio::test]
async fn a_purge_during_the_image_leaves_the_new_backup_with_exactly_the_primarys_queue() {
    let name = "catch-up-purge";
    let extra = format!(
        "max_message_size: {MAX_MESSAGE_SIZE}\nqueue_memory_budget_bytes: {MAX_MESSAGE_SIZE}\n"
    );
    let (mut members, _ports, _secret) = start_cluster_with(name, &extra);
    let queue = "purged";
    let first_backup = declare_replicated(&members[0], queue, 1, LIMIT)
        .await
        .remove(0);
    let b = member_of(name, N, &first_backup);
    let c = (1..N).find(|&i| i != b).unwrap();
    let new_backup = crate::harness::node(name, c);
    // ~20 MiB, nearly all of it paged out: an image of ~300 chunks.
    let initial: Vec<String> = (0..20_000).map(|i| format!("m{i}")).collect();
    for part in initial.chunks(2_000) {
        publish_confirmed(&members[0], queue, part).await;
    }

    members[b].kill();
    // The map gives the role to the third member, whose catch-up starts at once; purge
    // while its chunks are going out.
    wait_queue_view(&members[0], queue, LIMIT, "the role transferred", |v| {
        v["backup_nodes"] == serde_json::json!([new_backup])
    });
    let (conn, ch) = members[0].channel().await;
    let purged = ch
        .queue_purge(queue.into(), Default::default())
        .await
        .expect("purge on the primary");
    let _ = conn.close(200, "purged".into()).await;
    let after: Vec<String> = (0..10).map(|i| format!("after-{i}")).collect();
    publish_confirmed(&members[0], queue, &after).await;
    wait_queue_view(&members[0], queue, LIMIT, "the new backup in sync", |v| {
        v["in_sync_backup_nodes"] == serde_json::json!([new_backup])
    });
    let log = members[0].log_tail(5_000);
    let confirmed: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("catch-up confirmed") && l.contains(new_backup.as_str()))
        .collect();
    eprintln!("{name}: purged {purged} messages during the catch-up; {confirmed:?}");

    restart_member(&mut members, b, name);
    wait_settled(
        &mut members,
        &[0, 1, 2],
        READY_LIMIT,
        &format!("{name}: rejoin"),
    );
    members[0].kill();
    wait_queue_view(
        &members[c],
        queue,
        LIMIT,
        "the caught-up backup elected",
        |v| v["node"].as_str() == Some(new_backup.as_str()),
    );
    let got = drain(&members[c], queue, after.len()).await;
    let expected: Vec<(String, bool)> = after.iter().map(|t| (t.clone(), false)).collect();
    assert_eq!(got, expected, "{name}: the queue after the failover");
    let (_conn, ch) = members[c].channel().await;
    assert_eq!(
        ringmq_tests::depth(&ch, queue).await,
        0,
        "{name}: no stand-in or purged message is left on the new primary"
    );
}

/// The time bound: with `replication_catch_up_timeout_ms` far below what a ~20 MiB image
/// takes, the new backup's catch-up is abandoned and retried from a new image again and
/// again (counted), and the backup stays out of sync; once the queue is purged the next
/// attempt's image is small, it finishes in time, and the backup — whose replica held half
/// an image from each abandoned attempt — holds exactly the primary's queue.
#[tokio::test]
async fn a_catch_up_over_its_time_limit_is_abandoned_retried_and_counted() {
    let name = "catch-up-timeout";
    let extra = format!(
        "max_message_size: {MAX_MESSAGE_SIZE}\nqueue_memory_budget_bytes: 0\n\
         replication_catch_up_timeout_ms: 100\n"
    );
    let (mut members, _ports, _secret) = start_cluster_with(name, &extra);
    let queue = "slow";
    let first_backup = declare_replicated(&members[0], queue, 1, LIMIT)
        .await
        .remove(0);
    let b = member_of(name, N, &first_backup);
    let c = (1..N).find(|&i| i != b).unwrap();
    let new_backup = crate::harness::node(name, c);
    let initial: Vec<String> = (0..20_000).map(|i| format!("m{i}")).collect();
    for part in initial.chunks(2_000) {
        publish_confirmed(&members[0], queue, part).await;
    }

    members[b].kill();
    wait_queue_view(&members[0], queue, LIMIT, "the role transferred", |v| {
        v["backup_nodes"] == serde_json::json!([new_backup])
    });
    let abandoned = |m: &Broker| metric(m, "ringmq_replication_catch_ups_abandoned_total");
    let before = abandoned(&members[0]);
    let deadline = Instant::now() + LIMIT;
    while abandoned(&members[0]) < before + 3.0 {
        assert!(
            Instant::now() < deadline,
            "{name}: the catch-up was not abandoned and retried three times; log:\n{}",
            members[0].log_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let view = queue_view(&members[0], queue).unwrap();
    assert_eq!(
        view["in_sync_backup_nodes"],
        serde_json::json!([]),
        "{name}: a catch-up that never finishes in time never makes the backup in sync"
    );

    let (conn, ch) = members[0].channel().await;
    ch.queue_purge(queue.into(), Default::default())
        .await
        .expect("purge on the primary");
    let _ = conn.close(200, "purged".into()).await;
    let after: Vec<String> = (0..5).map(|i| format!("after-{i}")).collect();
    publish_confirmed(&members[0], queue, &after).await;
    wait_queue_view(&members[0], queue, LIMIT, "the new backup in sync", |v| {
        v["in_sync_backup_nodes"] == serde_json::json!([new_backup])
    });
    eprintln!(
        "{name}: in sync after {} abandoned catch-ups",
        abandoned(&members[0]) - before
    );

    restart_member(&mut members, b, name);
    wait_settled(
        &mut members,
        &[0, 1, 2],
        READY_LIMIT,
        &format!("{name}: rejoin"),
    );
    members[0].kill();
    wait_queue_view(
        &members[c],
        queue,
        LIMIT,
        "the caught-up backup elected",
        |v| v["node"].as_str() == Some(new_backup.as_str()),
    );
    let got = drain(&members[c], queue, after.len()).await;
    let expected: Vec<(String, bool)> = after.iter().map(|t| (t.clone(), false)).collect();
    assert_eq!(got, expected, "{name}: the queue after the failover");
    let (_conn, ch) = members[c].channel().await;
    assert_eq!(
        ringmq_tests::depth(&ch, queue).await,
        0,
        "{name}: nothing of the abandoned attempts is left on the new primary"
    );
}
