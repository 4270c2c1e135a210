//! Exclusive queues on a cluster: known to every member, reached by publishes through any.

use crate::support::*;
use futures_lite::StreamExt;
use lapin::options::{BasicConsumeOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use ringmq_tests::cluster::start_cluster;
use ringmq_tests::{reply_code, wait_queue_gone};
use std::time::Duration;

#[tokio::test]
async fn an_exclusive_reply_queue_gets_replies_published_through_another_member() {
    let (members, _secret) = start_cluster("proxy-rpc", 3);
    let (client_conn, client) = members[0].channel().await;
    let reply_to = client
        .queue_declare(
            "".into(),
            QueueDeclareOptions {
                exclusive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap()
        .name()
        .to_string();
    let mut replies = client
        .basic_consume(
            reply_to.as_str().into(),
            "replies".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    // The server of the RPC is connected to another member.
    let (_s, server) = members[1].channel().await;
    publish_confirmed(&server, &reply_to, "reply", 3).await;
    for i in 0..3 {
        let d = tokio::time::timeout(Duration::from_secs(10), replies.next())
            .await
            .expect("a reply in time")
            .expect("consumer open")
            .expect("delivery");
        assert_eq!(d.data, format!("reply-{i}").as_bytes());
    }
    // Other members' connections may not use it: 405, as on one broker.
    let (_o, other) = members[2].channel().await;
    let e = other
        .basic_consume(
            reply_to.as_str().into(),
            "thief".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(reply_code(&e), Some(405), "{e}");
    // It goes with its connection, from every member.
    client_conn.close(200, "done".into()).await.unwrap();
    wait_queue_gone(&members[1], &reply_to, Duration::from_secs(10)).await;
    wait_queue_gone(&members[2], &reply_to, Duration::from_secs(10)).await;
}
