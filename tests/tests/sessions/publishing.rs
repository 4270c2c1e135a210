//! A session's publishing across a lost connection: a resumed channel stays in confirm or
//! transactional mode and goes on numbering, and a publish resent with
//! `x-ringmq-publish-seq` that the broker processed already is dropped — confirmed again
//! with the outcome it first had.

use super::wire::{new_session_id, props, raw_session};
use lapin::options::{BasicGetOptions, QueueDeclareOptions, QueuePurgeOptions};
use lapin::types::{AMQPValue as LapinValue, FieldTable as LapinTable};
use ringmq::amqp::{AMQPClass, basic, confirm, tx};
use ringmq::client::{RawClient, confirm_of, encode_publish_numbered};
use ringmq_tests::Broker;
use std::time::Duration;
use tokio::io::AsyncWriteExt;

/// Publishes `bodies` on channel 1 to `queue` through the default exchange, numbered from
/// `first` in the `x-ringmq-publish-seq` header.
async fn publish_numbered(c: &mut RawClient, queue: &str, first: u64, bodies: &[&str]) {
    let mut frames = Vec::new();
    for (i, body) in bodies.iter().enumerate() {
        encode_publish_numbered(
            &mut frames,
            1,
            "",
            queue,
            false,
            Some(first + i as u64),
            body.as_bytes(),
            131_072,
        );
    }
    c.stream.write_all(&frames).await.unwrap();
}

/// Reads publisher confirms until one reaches `through`: each as (tag, multiple, ack).
async fn confirms_through(c: &mut RawClient, through: u64) -> Vec<(u64, bool, bool)> {
    let mut got = Vec::new();
    let read = async {
        loop {
            let frame = c.read_frame().await.expect("a confirm");
            if let Some(confirm) = confirm_of(&frame.payload) {
                got.push(confirm);
                if confirm.0 >= through {
                    return;
                }
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .unwrap_or_else(|_| panic!("no confirm reached {through} within 10 s"));
    got
}

/// The session status a raw client reads from `amq.session` on channel 1.
async fn raw_status(c: &mut RawClient) -> serde_json::Value {
    c.send(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
            queue: "amq.session".into(),
            no_ack: true,
        })),
    )
    .await
    .unwrap();
    loop {
        let frame = c.read_frame().await.expect("get-ok");
        if ringmq::amqp::frame::method_ids(&frame.payload) == Some((60, 71)) {
            break;
        }
    }
    c.read_frame().await.expect("its header");
    let body = c.read_frame().await.expect("its body");
    serde_json::from_slice(&body.payload).expect("the status is JSON")
}

async fn call_ok(c: &mut RawClient, method: AMQPClass, what: &str) {
    let reply: fn(&AMQPClass) -> bool = match &method {
        AMQPClass::Confirm(_) => {
            |m: &AMQPClass| matches!(m, AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(_)))
        }
        AMQPClass::Tx(tx::AMQPMethod::Select(_)) => {
            |m: &AMQPClass| matches!(m, AMQPClass::Tx(tx::AMQPMethod::SelectOk(_)))
        }
        _ => |m: &AMQPClass| matches!(m, AMQPClass::Tx(tx::AMQPMethod::CommitOk(_))),
    };
    c.call(method, reply, what).await.unwrap();
}

/// Each confirmed number with its outcome, a `multiple` confirm expanded over the numbers
/// after the highest one confirmed before it.
fn outcomes(confirms: &[(u64, bool, bool)]) -> Vec<(u64, bool)> {
    let mut out = Vec::new();
    let mut highest = 0;
    for &(tag, multiple, ack) in confirms {
        let from = if multiple { highest + 1 } else { tag };
        out.extend((from..=tag).map(|n| (n, ack)));
        highest = highest.max(tag);
    }
    out
}

/// The message count of `queue`, by a passive declare on `ch`.
pub(crate) async fn message_count(ch: &lapin::Channel, queue: &str) -> u32 {
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            passive: true,
            ..Default::default()
        },
        LapinTable::default(),
    )
    .await
    .unwrap()
    .message_count()
}

/// `ringmq_session_duplicates_dropped_total` of `b`.
pub(crate) fn dropped_duplicates(b: &Broker) -> f64 {
    let text = b.admin_client().get("/metrics").unwrap().body;
    let text = text.as_str().expect("metrics are text").to_owned();
    text.lines()
        .find_map(|l| l.strip_prefix("ringmq_session_duplicates_dropped_total "))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no ringmq_session_duplicates_dropped_total in:\n{text}"))
}

#[tokio::test]
async fn a_resumed_confirm_channel_drops_resent_duplicates_and_confirms_them_as_they_were() {
    let b = Broker::start();
    let (_plain_conn, plain) = b.channel().await;
    let mut args = LapinTable::default();
    args.insert("x-max-length".into(), LapinValue::LongInt(2));
    args.insert(
        "x-overflow".into(),
        LapinValue::LongString("reject-publish".into()),
    );
    plain
        .queue_declare("capped".into(), QueueDeclareOptions::default(), args)
        .await
        .unwrap();

    let id = new_session_id();
    let mut first = raw_session(
        &b,
        props(&[("qpid.session.start", &id), ("qpid.session.timeout", "30")]),
    )
    .await
    .unwrap();
    call_ok(
        &mut first,
        AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
            nowait: false,
        })),
        "confirm.select-ok",
    )
    .await;
    publish_numbered(&mut first, "capped", 1, &["p1", "p2", "p3"]).await;
    let confirms = confirms_through(&mut first, 3).await;
    assert_eq!(
        outcomes(&confirms),
        [(1, true), (2, true), (3, false)],
        "the third overflows the queue: nacked"
    );
    drop(first); // the connection is lost; the session is kept
    tokio::time::sleep(Duration::from_millis(200)).await;

    let before = dropped_duplicates(&b);
    let mut resumed = raw_session(&b, props(&[("qpid.session.resume", &id)]))
        .await
        .unwrap();
    let st = raw_status(&mut resumed).await;
    let ch1 = &st["channels"]["1"];
    assert_eq!(ch1["publishes_processed"], 3, "{st}");
    assert_eq!(ch1["confirm"], true, "{st}");
    assert_eq!(ch1["transactional"], false, "{st}");

    // Room in the queue now: a resent p3 would be accepted if it were published again.
    plain
        .queue_purge("capped".into(), QueuePurgeOptions::default())
        .await
        .unwrap();
    publish_numbered(&mut resumed, "capped", 3, &["p3"]).await;
    publish_numbered(&mut resumed, "capped", 1, &["p1"]).await;
    publish_numbered(&mut resumed, "capped", 4, &["p4"]).await;
    let confirms = confirms_through(&mut resumed, 4).await;
    assert_eq!(
        confirms,
        [(3, false, false), (1, false, true), (4, false, true)],
        "duplicates get their first outcome, each alone; the new publish goes on numbering"
    );
    assert_eq!(
        message_count(&plain, "capped").await,
        1,
        "only p4 was routed"
    );
    let got = plain
        .basic_get("capped".into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .expect("p4");
    assert_eq!(got.delivery.data, b"p4");
    assert_eq!(dropped_duplicates(&b) - before, 2.0);
}

#[tokio::test]
async fn a_resumed_transactional_channel_counts_commits_and_takes_a_lost_transaction_again() {
    let b = Broker::start();
    let (_plain_conn, plain) = b.channel().await;
    plain
        .queue_declare(
            "txq".into(),
            QueueDeclareOptions::default(),
            LapinTable::default(),
        )
        .await
        .unwrap();
    let commit = || AMQPClass::Tx(tx::AMQPMethod::Commit(tx::Commit {}));

    let id = new_session_id();
    let mut first = raw_session(
        &b,
        props(&[("qpid.session.start", &id), ("qpid.session.timeout", "30")]),
    )
    .await
    .unwrap();
    call_ok(
        &mut first,
        AMQPClass::Tx(tx::AMQPMethod::Select(tx::Select {})),
        "tx.select-ok",
    )
    .await;
    publish_numbered(&mut first, "txq", 1, &["t1", "t2"]).await;
    call_ok(&mut first, commit(), "tx.commit-ok").await;
    // A second transaction, lost with the connection before its commit.
    publish_numbered(&mut first, "txq", 3, &["t3"]).await;
    drop(first);
    tokio::time::sleep(Duration::from_millis(200)).await;

    let mut resumed = raw_session(&b, props(&[("qpid.session.resume", &id)]))
        .await
        .unwrap();
    let st = raw_status(&mut resumed).await;
    let ch1 = &st["channels"]["1"];
    assert_eq!(ch1["transactional"], true, "{st}");
    assert_eq!(ch1["commits"], 1, "{st}");
    assert_eq!(
        ch1["publishes_processed"], 2,
        "the open transaction was dropped uncounted: {st}"
    );
    // The client sends what it had no commit-ok for again, numbered as before: taken.
    publish_numbered(&mut resumed, "txq", 3, &["t3"]).await;
    call_ok(&mut resumed, commit(), "tx.commit-ok").await;
    // A committed transaction sent again is dropped.
    publish_numbered(&mut resumed, "txq", 1, &["t1", "t2"]).await;
    call_ok(&mut resumed, commit(), "tx.commit-ok").await;
    let mut got = Vec::new();
    while let Some(m) = plain
        .basic_get("txq".into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        got.push(String::from_utf8(m.delivery.data.clone()).unwrap());
    }
    assert_eq!(got, ["t1", "t2", "t3"]);
}
