//! Errors and failures: the primary's errors reach the proxy's client as they are; a queue
//! whose primary is gone with no backup refuses publishes and cancels its consumers; an
//! at-least-once dead letter whose copy is lost on the way is dead-lettered again.

use crate::support::*;
use futures_lite::StreamExt;
use lapin::BasicProperties;
use lapin::options::{
    BasicConsumeOptions, BasicGetOptions, BasicPublishOptions, BasicRejectOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use ringmq_tests::cluster::{start_cluster, start_cluster_with};
use ringmq_tests::reply_code;
use std::time::Duration;

#[tokio::test]
async fn errors_of_the_primary_reach_the_client_of_the_proxy() {
    let (members, _secret) = start_cluster("proxy-err", 2);
    declare(&members[0], "mine").await;
    let (_c0, on_0) = members[0].channel().await;
    // Kept: lapin cancels a consumer whose stream is dropped.
    let _solo = on_0
        .basic_consume(
            "mine".into(),
            "solo".into(),
            BasicConsumeOptions {
                exclusive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    // An exclusive consumer on the primary excludes consumers on every member.
    let (_c1, on_1) = members[1].channel().await;
    let refused = on_1
        .basic_consume(
            "mine".into(),
            "other".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect_err("the queue has an exclusive consumer");
    assert_eq!(reply_code(&refused), Some(403));
}

#[tokio::test]
async fn a_queue_whose_primary_is_gone_refuses_publishes_and_cancels_its_consumers() {
    let (mut members, _secret) = start_cluster("proxy-down", 3);
    declare_unreplicated(&members[0], "orphan").await;
    let (_c1, on_1) = members[1].channel().await;
    let mut consumer = on_1
        .basic_consume(
            "orphan".into(),
            "left-behind".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    members[0].kill();
    let end = tokio::time::timeout(Duration::from_secs(10), consumer.next())
        .await
        .expect("the proxy cancels the consumer when its primary goes");
    assert!(
        !matches!(end, Some(Ok(_))),
        "no delivery, the consumer ended: {end:?}"
    );
    // Once the survivors removed the primary, a publish to its queue is refused.
    let admin = members[1].admin_client();
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while admin.get("/api/overview").unwrap().body["members"]
        .as_array()
        .map(Vec::len)
        != Some(2)
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the primary is removed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (_c2, on_2) = members[2].channel().await;
    on_2.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let confirm = on_2
        .basic_publish(
            "".into(),
            "orphan".into(),
            BasicPublishOptions::default(),
            b"nowhere",
            BasicProperties::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(confirm.is_nack(), "basic.nack: the queue cannot take it");
}

/// A replicated queue's primary is killed under a consumer on another member: the proxy
/// cancels the consumer, and a plain client that asks for the queue and consumes again at
/// once — before the cluster has noticed the loss and promoted the backup — is not refused
/// with 404 "the queue's primary, '…', cannot be reached" (which would close its channel):
/// its passive declare and consume wait for the new primary and go there
/// (`PRIMARY_PATIENCE` in `server/connection/proxied.rs`). The primary is not the member
/// that founded the cluster (the consensus leader): a leader's loss is an election too, and
/// a member whose lease lapses through it for longer than its grace closes its clients.
#[tokio::test]
async fn a_consume_while_the_primary_is_lost_waits_for_the_new_one() {
    let (mut members, _secret) = start_cluster("proxy-again", 3);
    declare(&members[2], "promoted").await;
    let (_c1, on_1) = members[1].channel().await;
    let mut consumer = on_1
        .basic_consume(
            "promoted".into(),
            "first".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    members[2].kill();
    let end = tokio::time::timeout(Duration::from_secs(10), consumer.next())
        .await
        .expect("the proxy cancels the consumer when its primary goes");
    assert!(!matches!(end, Some(Ok(_))), "the consumer ended: {end:?}");
    // A passive declare, asked at once, waits too.
    on_1.queue_declare(
        "promoted".into(),
        QueueDeclareOptions {
            passive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("the passive declare waits for the new primary instead of a 404");
    let mut again = on_1
        .basic_consume(
            "promoted".into(),
            "second".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("the consume waits for the new primary instead of a 404");
    // A publish through the founder reaches it once the backup took over (nacked until
    // then).
    let (_c2, on_2) = members[0].channel().await;
    on_2.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let confirm = on_2
            .basic_publish(
                "".into(),
                "promoted".into(),
                BasicPublishOptions::default(),
                b"after",
                BasicProperties::default(),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        if confirm.is_ack() {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "never taken");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let d = tokio::time::timeout(Duration::from_secs(10), again.next())
        .await
        .expect("a delivery")
        .expect("the consumer lives")
        .expect("a delivery, not an error");
    assert_eq!(d.data, b"after");
}

#[tokio::test]
async fn a_purge_or_delete_while_the_primary_is_lost_waits_for_the_new_one() {
    let (mut members, _secret) = start_cluster("proxy-again-purge", 3);
    declare(&members[2], "purged").await;
    declare(&members[2], "deleted").await;
    let (_c2, on_2) = members[2].channel().await;
    on_2.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    for _ in 0..3 {
        let confirm = on_2
            .basic_publish(
                "".into(),
                "purged".into(),
                BasicPublishOptions::default(),
                b"before",
                BasicProperties::default(),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        assert!(confirm.is_ack(), "{confirm:?}");
    }
    let (_c1, on_1) = members[1].channel().await;
    members[2].kill();
    // Asked at once, before the cluster noticed: both wait for the promoted backup, which
    // holds the three confirmed messages.
    let purged = on_1
        .queue_purge("purged".into(), Default::default())
        .await
        .expect("the purge waits for the new primary instead of a 404");
    assert_eq!(purged, 3, "the new primary purges what was confirmed");
    on_1.queue_delete("deleted".into(), Default::default())
        .await
        .expect("the delete waits for the new primary instead of a 404");
    let (_c0, on_0) = members[0].channel().await;
    let gone = on_0
        .queue_declare(
            "deleted".into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect_err("deleted everywhere");
    assert_eq!(reply_code(&gone), Some(404), "{gone:?}");
}

/// A rejected message of an `at-least-once` queue whose dead-letter queue's primary is
/// killed as the copy leaves: the copy's forward fails, the rejecting connection is closed
/// (320) and puts the original back; rejected again once the dead-letter queue's backup took
/// over, the message arrives there. With `at-most-once` (set `RINGMQ_DL_STRATEGY` to try it)
/// the original is gone with its lost copy and the test fails.
#[tokio::test]
async fn a_dead_letter_whose_forward_is_lost_is_dead_lettered_again_at_least_once() {
    let strategy =
        std::env::var("RINGMQ_DL_STRATEGY").unwrap_or_else(|_| "at-least-once".to_owned());
    let (mut members, _secret) = start_cluster("proxy-dead-letter", 3);
    declare(&members[2], "far-dlq").await;
    let args = ringmq_tests::dead_letter_args("far-dlq", &strategy);
    {
        let (_c, ch) = members[1].channel().await;
        ch.queue_declare(
            "rejecting".into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        )
        .await
        .unwrap();
        publish_confirmed(&ch, "rejecting", "m", 1).await;
    }
    let (_c1, on_1) = members[1].channel().await;
    let got = on_1
        .basic_get("rejecting".into(), BasicGetOptions::default())
        .await
        .unwrap()
        .expect("the message");
    members[2].kill();
    // Rejected while the dead-letter queue's primary is gone: its copy's forward fails.
    let _ = got
        .delivery
        .reject(BasicRejectOptions { requeue: false })
        .await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        assert!(
            std::time::Instant::now() < deadline,
            "the rejected message reached neither queue again ({strategy})"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
        let c = members[0].connect().await;
        let Ok(ch) = c.create_channel().await else {
            continue;
        };
        if let Ok(Some(copy)) = ch
            .basic_get("far-dlq".into(), BasicGetOptions { no_ack: true })
            .await
        {
            assert_eq!(copy.delivery.data, b"m-0");
            break;
        }
        // Back in its queue: reject it again, now towards the promoted backup.
        if let Ok(Some(again)) = ch
            .basic_get("rejecting".into(), BasicGetOptions::default())
            .await
        {
            assert!(again.delivery.redelivered);
            let _ = again
                .delivery
                .reject(BasicRejectOptions { requeue: false })
                .await;
        }
        let _ = c.close(200, "again".into()).await;
    }
}

/// A client cancels its proxied consumer while the queue's primary is frozen, and the
/// primary is then killed: the cancel's answer can never come from it, but the consumer is
/// gone with its link all the same — the client gets cancel-ok and keeps its channel (it was
/// closed with 404, taking the failover client's channel down: found by the scripted kill
/// runs, `docs/sessions.md` §6).
/// Member configuration for a test that freezes the leader and needs its clients served
/// through the election that follows.
const PATIENT: &str = "cluster_failure_timeout_ms: 3000\n";

#[tokio::test]
async fn a_cancel_whose_primary_dies_on_the_way_is_answered_and_the_channel_lives() {
    // The frozen primary is the consensus leader: the others elect another while it is
    // frozen, and on a loaded machine that can outlast the default serving grace (0.2 s),
    // which would close this test's client with 320 (seen in CI). A longer failure timeout
    // gives a grace of 1.35 s; what the test checks does not depend on it.
    let (mut members, _secret) = start_cluster_with("proxy-cancel", 3, PATIENT);
    ringmq_tests::cluster::wait_voters(&members, Duration::from_secs(30));
    declare(&members[0], "frozen").await;
    let (_c1, on_1) = members[1].channel().await;
    let _consumer = on_1
        .basic_consume(
            "frozen".into(),
            "c".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    members[0].pause();
    let cancel = {
        let ch = on_1.clone();
        tokio::spawn(async move {
            ch.basic_cancel("c".into(), lapin::options::BasicCancelOptions::default())
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    members[0].kill();
    tokio::time::timeout(Duration::from_secs(20), cancel)
        .await
        .expect("the cancel is answered")
        .unwrap()
        .expect("cancel-ok, not a channel error");
    assert!(on_1.status().connected(), "the channel lives");
    on_1.queue_declare(
        "after-the-cancel".into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("the channel still works");
}

/// A client rejects a proxied delivery with requeue while the queue's primary is frozen, and
/// the primary is then killed: the reject's barrier (nothing more is read until the primary
/// has requeued it) can never be answered, but the delivery goes back to the queue with
/// every other the lost primary had out — so the client keeps its channel, and the message
/// comes again from the new primary (found by the scripted kill runs, `docs/sessions.md` §6).
#[tokio::test]
async fn a_requeue_whose_primary_dies_on_the_way_keeps_the_channel_and_the_message() {
    // The frozen primary is the consensus leader: the others elect another while it is
    // frozen, and on a loaded machine that can outlast the default serving grace (0.2 s),
    // which would close this test's client with 320 (seen in CI). A longer failure timeout
    // gives a grace of 1.35 s; what the test checks does not depend on it.
    let (mut members, _secret) = start_cluster_with("proxy-nack", 3, PATIENT);
    ringmq_tests::cluster::wait_voters(&members, Duration::from_secs(30));
    declare(&members[0], "rejected").await;
    let (_c0, on_0) = members[0].channel().await;
    publish_confirmed(&on_0, "rejected", "r", 1).await;
    let (_c1, on_1) = members[1].channel().await;
    let mut consumer = on_1
        .basic_consume(
            "rejected".into(),
            "c".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let first = tokio::time::timeout(Duration::from_secs(10), consumer.next())
        .await
        .expect("a delivery")
        .expect("the consumer lives")
        .expect("a delivery");
    members[0].pause();
    first
        .nack(lapin::options::BasicNackOptions {
            requeue: true,
            ..Default::default()
        })
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    members[0].kill();
    let again = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match on_1
                .basic_get("rejected".into(), BasicGetOptions { no_ack: true })
                .await
                .expect("the channel lives")
            {
                Some(m) => return m,
                None => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    })
    .await
    .expect("the requeued message comes again from the new primary");
    assert!(again.delivery.redelivered, "marked redelivered");
}
