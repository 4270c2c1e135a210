//! Transactions through a proxy: commit-ok once the primary applied the transaction.

use crate::support::*;
use lapin::BasicProperties;
use lapin::options::{BasicAckOptions, BasicGetOptions, BasicPublishOptions};
use ringmq_tests::Broker;
use ringmq_tests::cluster::start_cluster;

#[tokio::test]
async fn a_transaction_through_a_proxy_commits_at_the_primary_before_commit_ok() {
    let (members, _secret) = start_cluster("proxy-tx", 2);
    declare(&members[0], "ledger").await;
    let (_c1, on_1) = members[1].channel().await;
    on_1.tx_select().await.unwrap();
    for i in 0..5 {
        on_1.basic_publish(
            "".into(),
            "ledger".into(),
            BasicPublishOptions::default(),
            format!("t-{i}").as_bytes(),
            BasicProperties::default().with_delivery_mode(2),
        )
        .await
        .unwrap();
    }
    assert_eq!(count(&members[0], "ledger").await.0, 0, "held until commit");
    on_1.tx_commit().await.unwrap();
    // commit-ok came only after the primary confirmed every publish of the transaction.
    assert_eq!(count(&members[0], "ledger").await.0, 5);
    on_1.basic_publish(
        "".into(),
        "ledger".into(),
        BasicPublishOptions::default(),
        b"rolled-back",
        BasicProperties::default(),
    )
    .await
    .unwrap();
    on_1.tx_rollback().await.unwrap();
    assert_eq!(count(&members[0], "ledger").await.0, 5);

    // Acks of proxied deliveries in a transaction: applied at the primary before commit-ok.
    let unacked = |b: &Broker| {
        let q = b
            .admin_client()
            .get("/api/queues/%2f/ledger")
            .expect("admin API");
        assert_eq!(q.status, 200, "{}", q.reason());
        (
            q.body["messages_ready"].as_u64(),
            q.body["messages_unacknowledged"].as_u64(),
        )
    };
    let mut tags = Vec::new();
    for _ in 0..5 {
        let got = on_1
            .basic_get("ledger".into(), BasicGetOptions::default())
            .await
            .unwrap()
            .expect("a message");
        tags.push(got.delivery.delivery_tag);
    }
    for tag in tags {
        on_1.basic_ack(tag, BasicAckOptions::default())
            .await
            .unwrap();
    }
    assert_eq!(
        unacked(&members[0]),
        (Some(0), Some(5)),
        "acks held until commit"
    );
    on_1.tx_commit().await.unwrap();
    assert_eq!(
        unacked(&members[0]),
        (Some(0), Some(0)),
        "commit-ok came after the primary applied the acks"
    );
}
