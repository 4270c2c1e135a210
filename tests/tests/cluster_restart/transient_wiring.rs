//! A member restarted in place (killed and started again before the others declare it
//! failed) serves the cluster's transient wiring again (issue #13): the journal keeps only
//! durable wiring, so the member gets the rest back from its map checkpoint and from the
//! replay of the cluster's log after it — a non-durable exchange routes through it, and a
//! non-durable queue is there to publish to and to declare passively.

use crate::harness::*;
use lapin::BasicProperties;
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::types::FieldTable;
use ringmq_tests::Broker;
use std::time::Duration;

/// Declares, through `b`, non-durable exchange `exchange` and non-durable queue `queue`
/// bound to it with key `key`.
async fn declare_transient(b: &Broker, exchange: &str, queue: &str, key: &str) {
    let (conn, ch) = b.channel().await;
    ch.exchange_declare(
        exchange.into(),
        lapin::ExchangeKind::Direct,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_bind(
        queue.into(),
        exchange.into(),
        key.into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let _ = conn.close(200, "declared".into()).await;
}

/// Publishes one message through `b` to `exchange` with key `key`, mandatory, with a
/// confirm: whether it was routed to a queue and confirmed.
async fn publish_routed(b: &Broker, exchange: &str, key: &str) -> Result<(), String> {
    let (conn, ch) = b.channel().await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|e| e.to_string())?;
    let confirm = ch
        .basic_publish(
            exchange.into(),
            key.into(),
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            b"through the restarted member",
            BasicProperties::default(),
        )
        .await
        .map_err(|e| e.to_string())?
        .await
        .map_err(|e| e.to_string())?;
    let _ = conn.close(200, "published".into()).await;
    let acked = confirm.is_ack();
    match confirm.take_message() {
        None if acked => Ok(()),
        returned => Err(format!("acked: {acked}, returned: {returned:?}")),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_restarted_in_place_serves_the_transient_wiring_again() {
    let name = "transient";
    let (mut members, _ports, _secret) = start_cluster(name);
    declare_transient(&members[0], "tx-before", "tq-before", "before").await;
    // Long enough for member 2's map checkpoint (every 200 ms) to hold it.
    tokio::time::sleep(Duration::from_secs(1)).await;
    members[2].start_again();
    wait_settled(
        &mut members,
        &[0, 1, 2],
        READY_LIMIT,
        "member 2 restarted in place",
    );
    let resumed = members[2].wait_for_log(
        "transient cluster wiring restored from the map checkpoint",
        Duration::from_secs(5),
    );
    assert!(
        resumed,
        "member 2 did not resume from its checkpoint (a snapshot install would hide what this \
         test checks):\n{}",
        members[2].log_tail(40)
    );
    // What the cluster declares after the restart reaches it as before.
    declare_transient(&members[0], "tx-after", "tq-after", "after").await;
    for (exchange, queue, key) in [
        ("tx-before", "tq-before", "before"),
        ("tx-after", "tq-after", "after"),
    ] {
        let routed = publish_routed(&members[2], exchange, key).await;
        assert!(
            routed.is_ok(),
            "a publish to {exchange} through the restarted member: {routed:?}\n{}",
            members[2].log_tail(40)
        );
        assert_eq!(
            passive(&members[2], queue).await,
            Ok(1),
            "{queue} through the restarted member"
        );
        assert_eq!(
            passive(&members[0], queue).await,
            Ok(1),
            "{queue} through member 0"
        );
    }
}
