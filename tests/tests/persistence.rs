//! Durability across clean restarts, `kill -9` and damaged journal files.

use futures_lite::StreamExt;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel};
use ringmq_tests::{Broker, binary, dead_letter_args, depth};
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

fn persistent() -> BasicProperties {
    BasicProperties::default().with_delivery_mode(2)
}

async fn durable_queue(ch: &Channel, name: &str) {
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
}

async fn publish_confirmed(ch: &Channel, queue: &str, body: &[u8], props: BasicProperties) {
    let c = ch
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            body,
            props,
        )
        .await
        .unwrap();
    assert!(c.await.unwrap().is_ack());
}

async fn drain(ch: &Channel, queue: &str) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    while let Some(m) = ch
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        out.push(m.delivery.data.clone());
    }
    out
}

#[tokio::test]
async fn durable_wiring_and_persistent_messages_survive_restart_and_kill() {
    let mut b = Broker::start();
    {
        let (_c, ch) = b.channel().await;
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        ch.exchange_declare(
            "dx".into(),
            lapin::ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
        durable_queue(&ch, "dq").await;
        ch.queue_bind(
            "dq".into(),
            "dx".into(),
            "a.#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
        ch.queue_declare(
            "transient-q".into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
        for i in 0..5u8 {
            let c = ch
                .basic_publish(
                    "dx".into(),
                    "a.b".into(),
                    BasicPublishOptions::default(),
                    &[i],
                    persistent(),
                )
                .await
                .unwrap();
            assert!(c.await.unwrap().is_ack());
        }
        publish_confirmed(&ch, "dq", b"not persistent", BasicProperties::default()).await;
        publish_confirmed(&ch, "transient-q", b"x", persistent()).await;
        let first = ch
            .basic_get("dq".into(), BasicGetOptions::default())
            .await
            .unwrap()
            .unwrap();
        first
            .delivery
            .ack(BasicAckOptions::default())
            .await
            .unwrap();
        // A confirmed publish after the ack proves the ack reached the journal first.
        publish_confirmed(&ch, "dq", &[5], persistent()).await;
    }
    b.stop_and_restart();
    {
        let (_c, ch) = b.channel().await;
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        let e = ch
            .queue_declare(
                "transient-q".into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await;
        assert!(e.is_err(), "a non-durable queue does not survive a restart");
        let ch = b.connect().await.create_channel().await.unwrap();
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        // The binding survived: publish through the exchange again.
        let c = ch
            .basic_publish(
                "dx".into(),
                "a.c".into(),
                BasicPublishOptions::default(),
                &[6],
                persistent(),
            )
            .await
            .unwrap();
        assert!(c.await.unwrap().is_ack());
        // Make one more message unacked-but-delivered before the crash.
        let m = ch
            .basic_get("dq".into(), BasicGetOptions::default())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(m.delivery.data, vec![1]);
        assert!(
            m.delivery.redelivered,
            "recovered messages may have been delivered before"
        );
    }
    b.crash_and_restart();
    let (_c, ch) = b.channel().await;
    assert_eq!(
        drain(&ch, "dq").await,
        vec![vec![1], vec![2], vec![3], vec![4], vec![5], vec![6]]
    );
}

/// A publish numbered as a session's client numbers it (`x-ringmq-producer`,
/// `x-ringmq-publish-seq`), persistent, on `queue`.
async fn publish_as_session(ch: &Channel, queue: &str, seq: i64) -> bool {
    let mut headers = FieldTable::default();
    headers.insert(
        "x-ringmq-producer".into(),
        lapin::types::AMQPValue::LongString("4b0c-resend:1".into()),
    );
    headers.insert(
        "x-ringmq-publish-seq".into(),
        lapin::types::AMQPValue::LongLongInt(seq),
    );
    let c = ch
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            format!("m{seq}").as_bytes(),
            persistent().with_headers(headers),
        )
        .await
        .unwrap();
    c.await.unwrap().is_ack()
}

#[tokio::test]
async fn a_session_publish_consumed_before_a_kill_is_dropped_when_resent_after_the_restart() {
    let mut b = Broker::start();
    {
        let (_c, ch) = b.channel().await;
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        durable_queue(&ch, "resends").await;
        for seq in 1..=3 {
            assert!(publish_as_session(&ch, "resends", seq).await);
            let m = ch
                .basic_get("resends".into(), BasicGetOptions::default())
                .await
                .unwrap()
                .expect("the message just confirmed");
            m.delivery.ack(BasicAckOptions::default()).await.unwrap();
        }
        // Confirmed after the acks: they reached the journal before it.
        publish_confirmed(&ch, "resends", b"marker", persistent()).await;
    }
    // The queue held none of the three when it stopped: only the journal's producer table
    // knows they were taken (B15).
    for restart in [Broker::crash_and_restart, Broker::stop_and_restart] {
        restart(&mut b);
        let (_c, ch) = b.channel().await;
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        for seq in 1..=3 {
            assert!(
                publish_as_session(&ch, "resends", seq).await,
                "a resend is confirmed"
            );
        }
        let got = drain(&ch, "resends").await;
        assert_eq!(
            got,
            vec![b"marker".to_vec()],
            "the resends are not enqueued again"
        );
        publish_confirmed(&ch, "resends", b"marker", persistent()).await;
    }
    let (_c, ch) = b.channel().await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    assert!(publish_as_session(&ch, "resends", 4).await);
    assert_eq!(
        drain(&ch, "resends").await,
        vec![b"marker".to_vec(), b"m4".to_vec()],
        "the producer's next number is taken"
    );
}

/// Declares durable `queue` dead-lettering into `dlq` with `strategy`.
async fn dead_lettering_queue(ch: &Channel, queue: &str, dlq: &str, strategy: &str) {
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        dead_letter_args(dlq, strategy),
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn an_at_least_once_dead_letter_is_settled_while_its_connection_lives() {
    let b = Broker::start();
    let (c, ch) = b.channel().await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    durable_queue(&ch, "alo-dlq").await;
    dead_lettering_queue(&ch, "alo", "alo-dlq", "at-least-once").await;
    for body in [b"a", b"b", b"c"] {
        publish_confirmed(&ch, "alo", body, persistent()).await;
    }
    for _ in 0..3 {
        let m = ch
            .basic_get("alo".into(), BasicGetOptions::default())
            .await
            .unwrap()
            .expect("published");
        m.delivery
            .reject(BasicRejectOptions { requeue: false })
            .await
            .unwrap();
    }
    // The copies' batch is durable at once on one broker: the originals are settled while
    // the connection lives. Were they still held, the close below would put them back.
    let deadline = Instant::now() + Duration::from_secs(10);
    while depth(&ch, "alo-dlq").await < 3 {
        assert!(Instant::now() < deadline, "the copies never arrived");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A confirmed publish after the rejects: its batch comes after theirs.
    publish_confirmed(&ch, "alo-dlq", b"marker", persistent()).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    c.close(200, "done".into()).await.unwrap();
    let (_c, ch) = b.channel().await;
    assert_eq!(depth(&ch, "alo").await, 0, "no original went back");
    let got = drain(&ch, "alo-dlq").await;
    assert_eq!(
        got,
        vec![
            b"a".to_vec(),
            b"b".to_vec(),
            b"c".to_vec(),
            b"marker".to_vec()
        ],
        "each copy once, in order"
    );
}

#[tokio::test]
async fn an_at_least_once_dead_letter_refused_by_its_target_leaves_the_original_in_place() {
    let b = Broker::start();
    let (_c, ch) = b.channel().await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    // A dead-letter queue that holds nothing and refuses what comes.
    let mut full = FieldTable::default();
    full.insert("x-max-length".into(), lapin::types::AMQPValue::LongInt(0));
    full.insert(
        "x-overflow".into(),
        lapin::types::AMQPValue::LongString("reject-publish".into()),
    );
    ch.queue_declare(
        "full-dlq".into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        full,
    )
    .await
    .unwrap();
    for (queue, strategy) in [("alo", "at-least-once"), ("amo", "at-most-once")] {
        dead_lettering_queue(&ch, queue, "full-dlq", strategy).await;
        publish_confirmed(&ch, queue, b"a", persistent()).await;
        let m = ch
            .basic_get(queue.into(), BasicGetOptions::default())
            .await
            .unwrap()
            .expect("published");
        m.delivery
            .reject(BasicRejectOptions { requeue: false })
            .await
            .unwrap();
    }
    let again = ch
        .basic_get("alo".into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .expect("at least once: the refused copy left the original in its queue");
    assert!(again.delivery.redelivered);
    assert_eq!(
        depth(&ch, "amo").await,
        0,
        "at most once: gone with its refused copy"
    );
}

#[tokio::test]
async fn a_second_broker_on_the_same_data_dir_refuses_to_start() {
    let b = Broker::start();
    let out = std::process::Command::new(binary("ringmq-broker"))
        .args(["--amqp-listen", "127.0.0.1:0", "--data-dir"])
        .arg(b.state_dir())
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("in use by another ringmq-broker"), "{err}");
}

#[tokio::test]
async fn a_data_dir_from_a_newer_format_is_refused_not_touched() {
    let dir = std::env::temp_dir().join(format!("ringmq-newer-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("FORMAT"), "ringmq-data 99\n").unwrap();
    let out = std::process::Command::new(binary("ringmq-broker"))
        .args(["--amqp-listen", "127.0.0.1:0", "--data-dir"])
        .arg(&dir)
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("format version 99"));
    assert_eq!(
        std::fs::read_to_string(dir.join("FORMAT")).unwrap(),
        "ringmq-data 99\n"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Publishes `n` persistent messages (bodies 0..n as u32) each confirmed before the next, so
/// that each is its own record at the tail of the journal.
async fn publish_numbered(b: &Broker, n: u32) {
    let (_c, ch) = b.channel().await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    durable_queue(&ch, "q").await;
    for i in 0..n {
        publish_confirmed(&ch, "q", &i.to_be_bytes(), persistent()).await;
    }
}

fn last_segment(b: &Broker) -> std::path::PathBuf {
    let mut segs: Vec<_> = std::fs::read_dir(b.state_dir().join("journal"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "seg"))
        .collect();
    segs.sort();
    segs.pop().unwrap()
}

async fn recovered_numbers(b: &Broker) -> Vec<u32> {
    let (_c, ch) = b.channel().await;
    drain(&ch, "q")
        .await
        .iter()
        .map(|d| u32::from_be_bytes(d[..4].try_into().unwrap()))
        .collect()
}

#[tokio::test]
async fn a_torn_tail_loses_only_the_torn_record() {
    let mut b = Broker::start();
    publish_numbered(&b, 20).await;
    b.terminate();
    let seg = last_segment(&b);
    let len = std::fs::metadata(&seg).unwrap().len();
    // Cut the last record in half, as a crash in the middle of a write would.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&seg)
        .unwrap()
        .set_len(len - 20)
        .unwrap();
    b.crash_and_restart();
    assert_eq!(recovered_numbers(&b).await, (0..19).collect::<Vec<_>>());
    assert!(b.wait_for_log(
        "journal damage found during recovery",
        Duration::from_secs(1)
    ));
}

#[tokio::test]
async fn a_torn_tail_in_a_segment_written_over_zeros_loses_only_the_torn_record() {
    // Small segments, so that the journal rolls over to spares (docs/persistence.md).
    let mut b = Broker::start_with_config("journal:\n  segment_bytes: 4096\n");
    publish_numbered(&b, 199).await;
    // A crash: no snapshot at shutdown, so recovery reads the segments.
    b.kill();
    let seg = last_segment(&b);
    let mut data = std::fs::read(&seg).unwrap();
    assert_eq!(data.len(), 4096, "the last segment was written over zeros");
    // The last record ends in its body, number 198: its last byte is not zero.
    let end = data.iter().rposition(|byte| *byte != 0).unwrap() + 1;
    // A crash in the middle of the write: the record's end never reached the disk.
    data[end - 20..end].fill(0);
    std::fs::write(&seg, &data).unwrap();
    b.crash_and_restart();
    assert_eq!(recovered_numbers(&b).await, (0..198).collect::<Vec<_>>());
    assert!(b.wait_for_log(
        "journal damage found during recovery",
        Duration::from_secs(1)
    ));
}

#[tokio::test]
async fn a_flipped_bit_drops_the_damaged_record_and_what_follows_it_in_the_segment() {
    let mut b = Broker::start();
    publish_numbered(&b, 20).await;
    b.terminate();
    let seg = last_segment(&b);
    let mut data = std::fs::read(&seg).unwrap();
    // Records are equal-sized here: flip a bit in the body of record 15 (0-based).
    let header = 8;
    let record = (data.len() - header) / 20;
    let at = header + 15 * record + record / 2;
    data[at] ^= 0x10;
    std::fs::write(&seg, &data).unwrap();
    // Without a snapshot recovery reads every record (the path this test is about).
    std::fs::remove_file(b.state_dir().join("snapshot")).unwrap();
    b.crash_and_restart();
    assert_eq!(recovered_numbers(&b).await, (0..15).collect::<Vec<_>>());
}

#[tokio::test]
async fn a_damaged_body_found_on_delivery_stops_the_broker_and_the_restart_drops_it() {
    let mut b = Broker::start();
    publish_numbered(&b, 20).await;
    b.terminate();
    let seg = last_segment(&b);
    let mut data = std::fs::read(&seg).unwrap();
    let header = 8;
    let record = (data.len() - header) / 20;
    data[header + 15 * record + record / 2] ^= 0x10;
    std::fs::write(&seg, &data).unwrap();
    // Recovered from the snapshot: the bodies stay on disk until delivered.
    b.crash_and_restart();
    {
        let (_c, ch) = b.channel().await;
        for _ in 0..20 {
            let got = ch
                .basic_get("q".into(), BasicGetOptions { no_ack: false })
                .await;
            if got.is_err() {
                break;
            }
        }
    }
    assert!(b.wait_for_log("reading a paged-out body failed", Duration::from_secs(5)));
    let deadline = Instant::now() + Duration::from_secs(5);
    while b.is_running() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!b.is_running(), "the broker served on after finding damage");
    // The snapshot is gone: the restart scans, drops the damaged record and what follows.
    b.crash_and_restart();
    assert_eq!(recovered_numbers(&b).await, (0..15).collect::<Vec<_>>());
    assert!(b.wait_for_log(
        "journal damage found during recovery",
        Duration::from_secs(1)
    ));
}

#[tokio::test]
async fn a_damaged_snapshot_is_ignored_with_a_log_line_and_the_journal_scanned() {
    let mut b = Broker::start();
    publish_numbered(&b, 20).await;
    b.terminate();
    let path = b.state_dir().join("snapshot");
    let mut data = std::fs::read(&path).unwrap();
    let last = data.len() - 1;
    data[last] ^= 0x01;
    std::fs::write(&path, &data).unwrap();
    b.crash_and_restart();
    assert!(b.wait_for_log("snapshot ignored", Duration::from_secs(1)));
    assert_eq!(recovered_numbers(&b).await, (0..20).collect::<Vec<_>>());
}

/// The crash test of the persistence issue: publish with confirms while consuming and acking
/// some, `kill -9` at random points, restart, repeat. Every confirmed message that was not
/// acked must come back; no message whose ack is known durable may come back; order within
/// the queue holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_at_random_points_loses_no_confirmed_message_and_resurrects_no_acked_one() {
    let cycles: u32 = std::env::var("RINGMQ_CRASH_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let seed = std::env::var("RINGMQ_CRASH_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("crash test seed {seed} (replay with RINGMQ_CRASH_SEED={seed})");
    let mut rng = seed | 1;
    let mut next_rand = move |bound: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % bound
    };
    let started = Instant::now();
    // Snapshots every few hundred records, so that kills land while one is being written
    // and restarts replay a snapshot plus a tail; a small memory budget, so that bodies are
    // read back from the journal.
    let mut b = Broker::start_with_config(
        "queue_memory_budget_bytes: 16384\njournal:\n  snapshot_every_records: 300\n  snapshot_interval_ms: 50\n",
    );
    let mut next_seq = 0u64;
    let mut confirmed = BTreeSet::new();
    let mut acked_durable = BTreeSet::new();
    // Acks sent but not yet proven durable when the broker died: they may or may not hold.
    let mut acked_maybe = BTreeSet::new();
    for cycle in 0..cycles {
        assert!(
            started.elapsed() < Duration::from_secs(30 + u64::from(cycles)),
            "crash test over its time budget at cycle {cycle}"
        );
        let conn = b.connect().await;
        let ch = conn.create_channel().await.unwrap();
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        durable_queue(&ch, "crash").await;
        ch.basic_qos(50, BasicQosOptions::default()).await.unwrap();
        let mut consumer = ch
            .basic_consume(
                "crash".into(),
                "c".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        let run_for = Duration::from_millis(50 + next_rand(250));
        let cycle_start = Instant::now();
        let mut acked_pending = BTreeSet::new();
        let mut last_first_delivery: Option<u64> = None;
        let mut killed = false;
        while cycle_start.elapsed() < run_for {
            let mut confirms = Vec::new();
            for _ in 0..(1 + next_rand(20)) {
                let seq = next_seq;
                next_seq += 1;
                match ch
                    .basic_publish(
                        "".into(),
                        "crash".into(),
                        BasicPublishOptions::default(),
                        &seq.to_be_bytes(),
                        persistent(),
                    )
                    .await
                {
                    Ok(c) => confirms.push((seq, c)),
                    Err(_) => break,
                }
            }
            for (seq, c) in confirms {
                if let Ok(conf) = c.await {
                    assert!(
                        conf.is_ack(),
                        "a persistent publish to a durable queue was nacked"
                    );
                    confirmed.insert(seq);
                }
            }
            // Every ack sent before those confirms was processed before them: it is durable.
            acked_durable.extend(std::mem::take(&mut acked_pending));
            while let Ok(Some(Ok(d))) =
                tokio::time::timeout(Duration::from_millis(1), consumer.next()).await
            {
                let seq = u64::from_be_bytes(d.data[..8].try_into().unwrap());
                assert!(
                    !acked_durable.contains(&seq),
                    "message {seq} was delivered again after its ack was durable (cycle {cycle})"
                );
                if !d.redelivered {
                    if let Some(last) = last_first_delivery {
                        assert!(
                            seq > last,
                            "order broken: {seq} after {last} (cycle {cycle})"
                        );
                    }
                    last_first_delivery = Some(seq);
                }
                if next_rand(2) == 0
                    && d.delivery_tag > 0
                    && ch
                        .basic_ack(d.delivery_tag, BasicAckOptions::default())
                        .await
                        .is_ok()
                {
                    acked_pending.insert(seq);
                }
            }
            if next_rand(10) == 0 {
                // Crash in the middle of the traffic, with publishes and acks in flight.
                b.crash_and_restart();
                killed = true;
                break;
            }
        }
        if !killed {
            b.crash_and_restart();
        }
        acked_maybe.extend(acked_pending);
        drop(consumer);
        drop(conn);
    }
    let (_c, ch) = b.channel().await;
    let remaining: BTreeSet<u64> = drain(&ch, "crash")
        .await
        .iter()
        .map(|d| u64::from_be_bytes(d[..8].try_into().unwrap()))
        .collect();
    let lost: Vec<_> = confirmed
        .iter()
        .filter(|s| {
            !acked_durable.contains(s) && !acked_maybe.contains(s) && !remaining.contains(s)
        })
        .collect();
    assert!(
        lost.is_empty(),
        "confirmed messages lost: {lost:?} (seed {seed})"
    );
    let resurrected: Vec<_> = remaining.intersection(&acked_durable).collect();
    assert!(
        resurrected.is_empty(),
        "acked messages resurrected: {resurrected:?} (seed {seed})"
    );
    assert!(
        confirmed.len() > 100,
        "the test published too little to mean anything: {}",
        confirmed.len()
    );
}

#[tokio::test]
async fn changes_made_through_the_admin_api_are_durable_when_acknowledged() {
    let mut b = Broker::start();
    let admin = b.admin_client();
    let put = admin.call("PUT", "/api/vhosts/extra", None).unwrap();
    assert!(put.status < 300, "{put:?}");
    let body = serde_json::json!({"durable": true, "auto_delete": false, "arguments": {}});
    for vh in ["%2F", "extra"] {
        let r = admin
            .call("PUT", &format!("/api/queues/{vh}/from-api"), Some(&body))
            .unwrap();
        assert_eq!(r.status, 201, "{r:?}");
    }
    {
        let (_c, ch) = b.channel().await;
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        for i in 0..3u8 {
            publish_confirmed(&ch, "from-api", &[i], persistent()).await;
        }
    }
    let r = admin
        .call("DELETE", "/api/queues/%2F/from-api/contents", None)
        .unwrap();
    assert!(r.status < 300, "{r:?}");
    // SIGKILL right after the answers: they must already be on disk.
    b.crash_and_restart();
    let admin = b.admin_client();
    let q = admin.get("/api/queues/%2F/from-api").unwrap();
    assert_eq!(
        q.status, 200,
        "a queue declared through the API survives a crash"
    );
    assert_eq!(
        q.body["messages"], 0,
        "a purge through the API is durable: {}",
        q.body
    );
    assert_eq!(
        admin.get("/api/queues/extra/from-api").unwrap().status,
        200,
        "so does a run-time vhost holding it"
    );
    let r = admin.call("DELETE", "/api/vhosts/extra", None).unwrap();
    assert!(r.status < 300, "{r:?}");
    b.crash_and_restart();
    assert_eq!(
        b.admin_client().get("/api/vhosts/extra").unwrap().status,
        404,
        "a deleted vhost stays deleted"
    );
}
