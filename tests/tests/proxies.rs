//! One virtual broker: a queue's messages live on its primary (the member it was declared
//! on), and every other member serves it through proxies — publish, consume, get, ack,
//! nack, purge and counts from any member, with real clients on real sockets.

use futures_lite::StreamExt;
use lapin::BasicProperties;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicNackOptions, BasicPublishOptions,
    BasicQosOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueDeclareOptions,
    QueuePurgeOptions,
};
use lapin::types::FieldTable;
use ringmq_tests::cluster::start_cluster;
use ringmq_tests::{Broker, queue_counts, reply_code, wait_queue_gone};
use std::time::Duration;

async fn declare(b: &Broker, name: &str) {
    let (_c, ch) = b.channel().await;
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("declare");
}

async fn count(b: &Broker, name: &str) -> (u32, u32) {
    let (_c, ch) = b.channel().await;
    queue_counts(&ch, name).await.expect("passive declare")
}

/// Publishes `n` persistent messages `prefix-0` … with confirms and waits for them all.
async fn publish_confirmed(ch: &lapin::Channel, queue: &str, prefix: &str, n: usize) {
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut confirms = Vec::new();
    for i in 0..n {
        confirms.push(
            ch.basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                format!("{prefix}-{i}").as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .unwrap(),
        );
    }
    for c in confirms {
        assert!(c.await.unwrap().is_ack(), "every publish is confirmed");
    }
}

#[tokio::test]
async fn a_queue_declared_on_one_member_is_one_queue_on_every_member() {
    let (members, _secret) = start_cluster("proxy-one", 3);
    declare(&members[0], "orders").await;
    let (_c1, on_1) = members[1].channel().await;
    publish_confirmed(&on_1, "orders", "m", 10).await;
    // The messages are on the primary, and every member counts them there.
    for m in &members {
        assert_eq!(count(m, "orders").await, (10, 0));
    }
    // A consumer on the third member gets them all, in order.
    let (_c2, on_2) = members[2].channel().await;
    let mut consumer = on_2
        .basic_consume(
            "orders".into(),
            "c".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut got = Vec::new();
    for _ in 0..10 {
        let d = tokio::time::timeout(Duration::from_secs(10), consumer.next())
            .await
            .expect("a delivery within 10 s")
            .unwrap()
            .unwrap();
        assert_eq!(d.exchange.as_str(), "");
        assert_eq!(d.routing_key.as_str(), "orders");
        got.push(String::from_utf8(d.data.clone()).unwrap());
        d.acker.ack(BasicAckOptions::default()).await.unwrap();
    }
    let want: Vec<String> = (0..10).map(|i| format!("m-{i}")).collect();
    assert_eq!(got, want, "order per producer holds across members");
    // The consumer counts on every member; once acked, nothing is left.
    for m in &members {
        assert_eq!(count(m, "orders").await, (0, 1));
    }
}

#[tokio::test]
async fn get_ack_nack_and_purge_through_a_proxy() {
    let (members, _secret) = start_cluster("proxy-get", 2);
    declare(&members[0], "work").await;
    let (_c0, on_0) = members[0].channel().await;
    publish_confirmed(&on_0, "work", "w", 3).await;

    let (_c1, on_1) = members[1].channel().await;
    let first = on_1
        .basic_get("work".into(), BasicGetOptions::default())
        .await
        .unwrap()
        .expect("a message");
    assert_eq!(first.delivery.data, b"w-0");
    assert!(!first.delivery.redelivered);
    assert_eq!(first.message_count, 2);
    // A nack with requeue puts it back at its place, visible on the primary once the
    // nack's channel has seen its next reply.
    on_1.basic_nack(
        first.delivery.delivery_tag,
        BasicNackOptions {
            requeue: true,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    // The nack's channel sees its next reply, then the primary has the message back.
    on_1.basic_qos(0, BasicQosOptions::default()).await.unwrap();
    assert_eq!(count(&members[0], "work").await.0, 3);
    let again = on_0
        .basic_get("work".into(), BasicGetOptions::default())
        .await
        .unwrap()
        .expect("the requeued message");
    assert_eq!(again.delivery.data, b"w-0");
    assert!(
        again.delivery.redelivered,
        "redelivered flag from the primary"
    );
    on_0.basic_ack(again.delivery.delivery_tag, BasicAckOptions::default())
        .await
        .unwrap();
    // get + ack through the proxy, then purge through it.
    let second = on_1
        .basic_get("work".into(), BasicGetOptions::default())
        .await
        .unwrap()
        .expect("a message");
    assert_eq!(second.delivery.data, b"w-1");
    on_1.basic_ack(second.delivery.delivery_tag, BasicAckOptions::default())
        .await
        .unwrap();
    let purged = on_1
        .queue_purge("work".into(), QueuePurgeOptions::default())
        .await
        .unwrap();
    assert_eq!(purged, 1);
    assert_eq!(count(&members[0], "work").await, (0, 0));
    let empty = on_1
        .basic_get("work".into(), BasicGetOptions::default())
        .await
        .unwrap();
    assert!(empty.is_none());
}

#[tokio::test]
async fn a_slow_consumer_on_a_proxy_holds_only_its_prefetch() {
    let (members, _secret) = start_cluster("proxy-slow", 2);
    declare(&members[0], "slow").await;
    let (_c0, on_0) = members[0].channel().await;
    publish_confirmed(&on_0, "slow", "s", 50).await;

    let (_c1, on_1) = members[1].channel().await;
    on_1.basic_qos(5, BasicQosOptions::default()).await.unwrap();
    let mut consumer = on_1
        .basic_consume(
            "slow".into(),
            "slow-c".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut held = Vec::new();
    for _ in 0..5 {
        held.push(
            tokio::time::timeout(Duration::from_secs(10), consumer.next())
                .await
                .expect("a delivery")
                .unwrap()
                .unwrap(),
        );
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The other 45 stay ready on the primary, where another consumer could take them.
    assert_eq!(count(&members[0], "slow").await, (45, 1));
    // Acking one lets exactly one more through.
    held.remove(0)
        .acker
        .ack(BasicAckOptions::default())
        .await
        .unwrap();
    let next = tokio::time::timeout(Duration::from_secs(10), consumer.next())
        .await
        .expect("one more after an ack")
        .unwrap()
        .unwrap();
    assert_eq!(next.data, b"s-5");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(count(&members[0], "slow").await, (44, 1));
}

/// Deliveries that reach the consumers within `quiet_ms` of each other, in arrival order.
async fn drain(
    consumers: &mut [&mut lapin::Consumer],
    quiet_ms: u64,
) -> Vec<lapin::message::Delivery> {
    let mut got = Vec::new();
    loop {
        let mut any = false;
        for c in consumers.iter_mut() {
            if let Ok(Some(d)) =
                tokio::time::timeout(Duration::from_millis(quiet_ms), c.next()).await
            {
                got.push(d.unwrap());
                any = true;
            }
        }
        if !any {
            return got;
        }
    }
}

#[tokio::test]
async fn a_channel_wide_prefetch_holds_across_members() {
    let (members, _secret) = start_cluster("proxy-global-qos", 3);
    declare(&members[0], "wide-a").await;
    declare(&members[1], "wide-b").await;
    let (_c0, on_0) = members[0].channel().await;
    publish_confirmed(&on_0, "wide-a", "a", 5).await;
    publish_confirmed(&on_0, "wide-b", "b", 5).await;

    // A client of the third member consumes from both primaries under one window of 4.
    let (_c2, on_2) = members[2].channel().await;
    on_2.basic_qos(4, BasicQosOptions { global: true })
        .await
        .unwrap();
    let mut a = on_2
        .basic_consume(
            "wide-a".into(),
            "ca".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut b = on_2
        .basic_consume(
            "wide-b".into(),
            "cb".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut got = drain(&mut [&mut a, &mut b], 400).await;
    assert_eq!(got.len(), 4, "the channel's window, not one per member");

    // Two acks let exactly two more through.
    for d in got.drain(..2) {
        d.acker.ack(BasicAckOptions::default()).await.unwrap();
    }
    let more = drain(&mut [&mut a, &mut b], 400).await;
    assert_eq!(more.len(), 2, "as many as were acked");
    got.extend(more);

    // Cancelled, the consumers' held deliveries go back to their queues: ready there are the
    // ten, less the two acked, less the four the client still holds.
    on_2.basic_cancel("ca".into(), Default::default())
        .await
        .unwrap();
    on_2.basic_cancel("cb".into(), Default::default())
        .await
        .unwrap();
    let (ready_a, consumers_a) = count(&members[1], "wide-a").await;
    let (ready_b, consumers_b) = count(&members[1], "wide-b").await;
    assert_eq!((consumers_a, consumers_b), (0, 0));
    assert_eq!(ready_a + ready_b, 4, "none held back at the proxy");
}

#[tokio::test]
async fn a_proxied_consumer_that_dies_leaves_its_unacked_to_another_redelivered() {
    let (members, _secret) = start_cluster("proxy-kill", 3);
    declare(&members[0], "jobs").await;
    let (_c0, on_0) = members[0].channel().await;
    publish_confirmed(&on_0, "jobs", "j", 20).await;
    {
        let (c1, on_1) = members[1].channel().await;
        on_1.basic_qos(8, BasicQosOptions::default()).await.unwrap();
        let mut consumer = on_1
            .basic_consume(
                "jobs".into(),
                "doomed".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        for _ in 0..8 {
            tokio::time::timeout(Duration::from_secs(10), consumer.next())
                .await
                .expect("a delivery")
                .unwrap()
                .unwrap();
        }
        // The client goes away without acking (its socket closes with the connection).
        drop(consumer);
        c1.close(200, "bye".into()).await.unwrap();
    }
    let (_c2, on_2) = members[2].channel().await;
    let mut consumer = on_2
        .basic_consume(
            "jobs".into(),
            "heir".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut got = Vec::new();
    for _ in 0..20 {
        let d = tokio::time::timeout(Duration::from_secs(10), consumer.next())
            .await
            .expect("every message reaches the heir")
            .unwrap()
            .unwrap();
        got.push((String::from_utf8(d.data.clone()).unwrap(), d.redelivered));
        d.acker.ack(BasicAckOptions::default()).await.unwrap();
    }
    let want: Vec<(String, bool)> = (0..20).map(|i| (format!("j-{i}"), i < 8)).collect();
    assert_eq!(
        got, want,
        "none lost, the first eight redelivered in their order"
    );
}

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
async fn deleting_a_queue_cancels_its_consumers_on_every_member() {
    let (members, _secret) = start_cluster("proxy-del", 2);
    declare(&members[0], "gone").await;
    let (_c1, on_1) = members[1].channel().await;
    let mut consumer = on_1
        .basic_consume(
            "gone".into(),
            "watcher".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    assert_eq!(count(&members[0], "gone").await, (0, 1));
    let (_c0, on_0) = members[0].channel().await;
    on_0.queue_delete("gone".into(), Default::default())
        .await
        .unwrap();
    let end = tokio::time::timeout(Duration::from_secs(10), consumer.next())
        .await
        .expect("the proxy passes the primary's basic.cancel on");
    assert!(end.is_none(), "the consumer ended: {end:?}");
    // The channel stayed open: a later error on it is its own (404), not a closed channel.
    assert!(
        on_1.basic_get("nonexistent".into(), BasicGetOptions::default())
            .await
            .is_err_and(|e| reply_code(&e) == Some(404))
    );
}

#[tokio::test]
async fn a_queue_whose_primary_is_gone_refuses_publishes_and_cancels_its_consumers() {
    let (mut members, _secret) = start_cluster("proxy-down", 3);
    declare(&members[0], "orphan").await;
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

#[tokio::test]
async fn the_primary_is_the_member_the_declare_names() {
    let (members, _secret) = start_cluster("proxy-place", 3);
    let (_c0, on_0) = members[0].channel().await;
    let placed = |primary: &str| {
        let mut args = FieldTable::default();
        args.insert(
            "qpid.cluster.primary".into(),
            lapin::types::AMQPValue::LongString(primary.into()),
        );
        args
    };
    // Declared through member 0, placed on member 2 by its node id.
    on_0.queue_declare(
        "placed".into(),
        QueueDeclareOptions::default(),
        placed("proxy-place-2"),
    )
    .await
    .unwrap();
    let admin = members[1].admin_client();
    let q = admin.get("/api/queues/%2f/placed").unwrap();
    assert_eq!(q.status, 200);
    assert_eq!(q.body["node"], "proxy-place-2", "{}", q.body);
    // A publish through member 0 lands there; a delete through member 1 is decided there.
    publish_confirmed(&on_0, "placed", "p", 2).await;
    assert_eq!(count(&members[2], "placed").await, (2, 0));
    // The admin API of any member answers with the primary's numbers.
    let (_cg, on_g) = members[2].channel().await;
    let held = on_g
        .basic_get("placed".into(), BasicGetOptions::default())
        .await
        .unwrap()
        .expect("a message");
    let q = admin.get("/api/queues/%2f/placed").unwrap();
    assert_eq!(
        (
            &q.body["messages_ready"],
            &q.body["messages_unacknowledged"],
            &q.body["messages"]
        ),
        (&1.into(), &1.into(), &2.into()),
        "{}",
        q.body
    );
    let listed = admin.get("/api/queues/%2f").unwrap().body;
    let listed: Vec<&serde_json::Value> = listed
        .as_array()
        .unwrap()
        .iter()
        .filter(|q| q["name"] == "placed")
        .collect();
    assert_eq!(listed.len(), 1, "each queue once");
    assert_eq!(listed[0]["messages"], 2);
    on_g.basic_nack(
        held.delivery.delivery_tag,
        BasicNackOptions {
            requeue: true,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let (_c1, on_1) = members[1].channel().await;
    let refused = on_1
        .queue_delete(
            "placed".into(),
            lapin::options::QueueDeleteOptions {
                if_empty: true,
                ..Default::default()
            },
        )
        .await
        .expect_err("the primary knows the queue is not empty");
    assert_eq!(reply_code(&refused), Some(406));
    let (_c1, on_1) = members[1].channel().await;
    let deleted = on_1
        .queue_delete("placed".into(), Default::default())
        .await
        .unwrap();
    assert_eq!(deleted, 2, "delete-ok counts the primary's messages");

    // By AMQP address too; an unknown member is 404 naming it.
    let addr = members[1].uri();
    let addr = addr.split('@').nth(1).unwrap().split('/').next().unwrap();
    on_0.queue_declare(
        "by-address".into(),
        QueueDeclareOptions::default(),
        placed(addr),
    )
    .await
    .unwrap();
    let q = admin.get("/api/queues/%2f/by-address").unwrap();
    assert_eq!(q.body["node"], "proxy-place-1", "{}", q.body);
    let refused = on_0
        .queue_declare(
            "nowhere".into(),
            QueueDeclareOptions::default(),
            placed("no-such-node"),
        )
        .await
        .expect_err("an unknown member");
    assert_eq!(reply_code(&refused), Some(404));
}

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

#[tokio::test]
async fn a_balanced_locator_spreads_primaries_over_the_members() {
    let (members, _secret) = start_cluster("proxy-balanced", 3);
    let (_c0, on_0) = members[0].channel().await;
    let locator = |name: &str| {
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-leader-locator".into(),
            lapin::types::AMQPValue::LongString(name.into()),
        );
        args
    };
    for q in ["b-1", "b-2", "b-3"] {
        on_0.queue_declare(
            q.into(),
            QueueDeclareOptions::default(),
            locator("balanced"),
        )
        .await
        .unwrap();
    }
    let admin = members[1].admin_client();
    let mut nodes: Vec<String> = ["b-1", "b-2", "b-3"]
        .iter()
        .map(|q| {
            let q = admin.get(&format!("/api/queues/%2f/{q}")).unwrap();
            q.body["node"].as_str().expect("a node").to_owned()
        })
        .collect();
    nodes.sort();
    assert_eq!(
        nodes,
        ["proxy-balanced-0", "proxy-balanced-1", "proxy-balanced-2"],
        "one primary on each member"
    );
    // client-local (the default) stays on the member the declare arrived at.
    on_0.queue_declare(
        "local".into(),
        QueueDeclareOptions::default(),
        locator("client-local"),
    )
    .await
    .unwrap();
    let q = admin.get("/api/queues/%2f/local").unwrap();
    assert_eq!(q.body["node"], "proxy-balanced-0", "{}", q.body);
    let e = on_0
        .queue_declare(
            "odd".into(),
            QueueDeclareOptions::default(),
            locator("random"),
        )
        .await
        .unwrap_err();
    assert_eq!(reply_code(&e), Some(406), "{e}");
}

#[tokio::test]
async fn auto_delete_counts_consumers_on_every_member_and_deletes_everywhere() {
    let (members, _secret) = start_cluster("proxy-auto", 3);
    let (_c0, on_0) = members[0].channel().await;
    on_0.queue_declare(
        "transient".into(),
        QueueDeclareOptions {
            auto_delete: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    let consume = |ch: lapin::Channel, tag: &'static str| async move {
        // The consumer stream is kept: lapin cancels a consumer whose stream is dropped.
        let consumer = ch
            .basic_consume(
                "transient".into(),
                tag.into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        (ch, consumer)
    };
    let (_c1, on_1) = members[1].channel().await;
    let (_c2, on_2) = members[2].channel().await;
    let (on_1, _one) = consume(on_1, "one").await;
    let (on_2, _two) = consume(on_2, "two").await;
    assert_eq!(count(&members[0], "transient").await, (0, 2));
    // One consumer left: the queue stays.
    on_1.basic_cancel("one".into(), Default::default())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(count(&members[1], "transient").await, (0, 1));
    // The last one goes: the queue goes from every member.
    on_2.basic_cancel("two".into(), Default::default())
        .await
        .unwrap();
    for m in &members {
        wait_queue_gone(m, "transient", Duration::from_secs(10)).await;
    }
}

#[tokio::test]
async fn x_expires_is_decided_by_the_primary_and_deletes_everywhere() {
    let (members, _secret) = start_cluster("proxy-expire", 2);
    let (_c0, on_0) = members[0].channel().await;
    let mut args = FieldTable::default();
    args.insert("x-expires".into(), lapin::types::AMQPValue::LongUInt(1500));
    on_0.queue_declare("fleeting".into(), QueueDeclareOptions::default(), args)
        .await
        .unwrap();
    // Watched through the admin API of the proxy: a passive declare is a use of the queue
    // and would keep it alive.
    let admin = members[1].admin_client();
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let status = admin.get("/api/queues/%2f/fleeting").unwrap().status;
        if status == 404 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the expired queue leaves the proxy too (still {status})"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

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

#[tokio::test]
async fn dead_letters_and_ttl_cross_members() {
    let (members, _secret) = start_cluster("proxy-dlx", 3);
    // The dead-letter queue lives on member 2, the work queue on member 0.
    declare(&members[2], "dead").await;
    let (_c0, on_0) = members[0].channel().await;
    let mut args = FieldTable::default();
    args.insert(
        "x-dead-letter-exchange".into(),
        lapin::types::AMQPValue::LongString("".into()),
    );
    args.insert(
        "x-dead-letter-routing-key".into(),
        lapin::types::AMQPValue::LongString("dead".into()),
    );
    args.insert(
        "x-message-ttl".into(),
        lapin::types::AMQPValue::LongUInt(60_000),
    );
    on_0.queue_declare("work-dlx".into(), QueueDeclareOptions::default(), args)
        .await
        .unwrap();
    let (_c1, on_1) = members[1].channel().await;
    publish_confirmed(&on_1, "work-dlx", "d", 2).await;
    // A reject through a proxy: the primary dead-letters to the queue on member 2.
    let got = on_1
        .basic_get("work-dlx".into(), BasicGetOptions::default())
        .await
        .unwrap()
        .expect("a message");
    on_1.basic_reject(
        got.delivery.delivery_tag,
        lapin::options::BasicRejectOptions { requeue: false },
    )
    .await
    .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while count(&members[2], "dead").await.0 != 1 {
        assert!(
            std::time::Instant::now() < deadline,
            "the dead letter reaches the queue on another member"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let dead = on_1
        .basic_get("dead".into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .expect("the dead letter");
    assert_eq!(dead.delivery.data, b"d-0");
    let deaths = dead
        .delivery
        .properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get("x-death").cloned());
    assert!(deaths.is_some(), "x-death is set by the primary");

    // Per-message TTL, applied where the queue lives.
    let (_c0, on_0) = members[0].channel().await;
    let mut args = FieldTable::default();
    args.insert(
        "x-message-ttl".into(),
        lapin::types::AMQPValue::LongUInt(200),
    );
    on_0.queue_declare("short-lived".into(), QueueDeclareOptions::default(), args)
        .await
        .unwrap();
    publish_confirmed(&on_1, "short-lived", "ttl", 3).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let gone = on_1
        .basic_get("short-lived".into(), BasicGetOptions::default())
        .await
        .unwrap();
    assert!(gone.is_none(), "expired on the primary");
}

#[tokio::test]
async fn single_active_consumer_holds_across_members() {
    let (members, _secret) = start_cluster("proxy-sac", 3);
    let (_c0, on_0) = members[0].channel().await;
    let mut args = FieldTable::default();
    args.insert(
        "x-single-active-consumer".into(),
        lapin::types::AMQPValue::Boolean(true),
    );
    on_0.queue_declare("single".into(), QueueDeclareOptions::default(), args)
        .await
        .unwrap();
    let (_c1, on_1) = members[1].channel().await;
    let (_c2, on_2) = members[2].channel().await;
    let mut first = on_1
        .basic_consume(
            "single".into(),
            "first".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut second = on_2
        .basic_consume(
            "single".into(),
            "second".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    publish_confirmed(&on_0, "single", "s", 4).await;
    for i in 0..4 {
        let d = tokio::time::timeout(Duration::from_secs(10), first.next())
            .await
            .expect("the active consumer gets everything")
            .unwrap()
            .unwrap();
        assert_eq!(d.data, format!("s-{i}").as_bytes());
        d.acker.ack(BasicAckOptions::default()).await.unwrap();
    }
    assert!(
        tokio::time::timeout(Duration::from_millis(300), second.next())
            .await
            .is_err(),
        "the other member's consumer is not active"
    );
    // The active one goes: the one on the other member takes over.
    on_1.basic_cancel("first".into(), Default::default())
        .await
        .unwrap();
    publish_confirmed(&on_0, "single", "t", 1).await;
    let d = tokio::time::timeout(Duration::from_secs(10), second.next())
        .await
        .expect("the next consumer becomes active")
        .unwrap()
        .unwrap();
    assert_eq!(d.data, b"t-0");
}

#[tokio::test]
async fn a_malformed_proxy_uri_is_refused_with_a_reason() {
    let (members, _secret) = start_cluster("proxy-args", 2);
    let (_c, ch) = members[0].channel().await;
    let refused = ch
        .queue_declare(
            "p".into(),
            QueueDeclareOptions::default(),
            proxy_to("amqp://[bad"),
        )
        .await
        .expect_err("not a URI");
    assert_eq!(reply_code(&refused), Some(406));
}

fn proxy_to(target: &str) -> FieldTable {
    let mut args = FieldTable::default();
    args.insert(
        "qpid.cluster.proxy".into(),
        lapin::types::AMQPValue::LongString(target.into()),
    );
    args
}

/// A declare with `qpid.cluster.proxy` naming a member: `Ok` with its counts, or the code.
async fn declare_naming(
    b: &Broker,
    queue: &str,
    exchange: Option<&str>,
    member: &str,
) -> Result<(u32, u32), Option<u16>> {
    let (_c, ch) = b.channel().await;
    match exchange {
        Some(x) => ch
            .exchange_declare(
                x.into(),
                lapin::ExchangeKind::Topic,
                ExchangeDeclareOptions::default(),
                proxy_to(member),
            )
            .await
            .map(|()| (0, 0)),
        None => ch
            .queue_declare(
                queue.into(),
                QueueDeclareOptions::default(),
                proxy_to(member),
            )
            .await
            .map(|q| (q.message_count(), q.consumer_count())),
    }
    .map_err(|e| reply_code(&e))
}

#[tokio::test]
async fn a_proxy_naming_a_member_answers_whether_that_member_has_the_queue() {
    let (members, _secret) = start_cluster("proxy-member", 2);
    // "on-1" lives on member 1; declared through member 0.
    let (_c0, on_0) = members[0].channel().await;
    let mut placed = FieldTable::default();
    placed.insert(
        "qpid.cluster.primary".into(),
        lapin::types::AMQPValue::LongString("proxy-member-1".into()),
    );
    on_0.queue_declare("on-1".into(), QueueDeclareOptions::default(), placed)
        .await
        .unwrap();
    publish_confirmed(&on_0, "on-1", "m", 2).await;

    // Member 1 is its primary, by node id or AMQP address, from either member: declare-ok
    // with the primary's counts, and nothing new.
    let addr = members[1].uri();
    let addr = addr.split('@').nth(1).unwrap().split('/').next().unwrap();
    for b in &members {
        assert_eq!(
            declare_naming(b, "on-1", None, "proxy-member-1").await,
            Ok((2, 0))
        );
        assert_eq!(declare_naming(b, "on-1", None, addr).await, Ok((2, 0)));
    }
    // Not its primary, no such queue, no such member: 404.
    assert_eq!(
        declare_naming(&members[1], "on-1", None, "proxy-member-0").await,
        Err(Some(404))
    );
    assert_eq!(
        declare_naming(&members[0], "nowhere", None, "proxy-member-1").await,
        Err(Some(404))
    );
    let (_c, ch) = members[0].channel().await;
    assert!(
        ch.queue_declare(
            "nowhere".into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .is_err(),
        "the refused declare created nothing"
    );
    assert_eq!(
        declare_naming(&members[0], "on-1", None, "proxy-member-9").await,
        Err(Some(404))
    );

    // An exchange: declare-ok when the cluster's shared wiring has it, else 404.
    on_0.exchange_declare(
        "shared-x".into(),
        lapin::ExchangeKind::Topic,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    assert_eq!(
        declare_naming(&members[1], "", Some("shared-x"), "proxy-member-0").await,
        Ok((0, 0))
    );
    assert_eq!(
        declare_naming(&members[1], "", Some("no-such-x"), "proxy-member-0").await,
        Err(Some(404))
    );
    assert_eq!(
        declare_naming(&members[1], "", Some("shared-x"), "proxy-member-9").await,
        Err(Some(404))
    );
}

#[tokio::test]
async fn a_redeclare_through_a_third_member_right_after_the_create_is_answered() {
    // The create goes through member 0 and places the queue on member 2; the redeclare
    // through member 1 comes right after. Member 1 asks member 2 for the counts only once
    // member 2 applied the create (the upstream channel's catch-up), so never a 404.
    let (members, _secret) = start_cluster("proxy-redeclare", 3);
    let (_c0, on_0) = members[0].channel().await;
    let (_c1, on_1) = members[1].channel().await;
    let mut placed = FieldTable::default();
    placed.insert(
        "qpid.cluster.primary".into(),
        lapin::types::AMQPValue::LongString("proxy-redeclare-2".into()),
    );
    for i in 0..50 {
        let name = format!("again-{i}");
        on_0.queue_declare(
            name.as_str().into(),
            QueueDeclareOptions::default(),
            placed.clone(),
        )
        .await
        .unwrap();
        let again = on_1
            .queue_declare(
                name.as_str().into(),
                QueueDeclareOptions::default(),
                placed.clone(),
            )
            .await
            .unwrap_or_else(|e| panic!("redeclare {i}: {e}"));
        assert_eq!((again.message_count(), again.consumer_count()), (0, 0));
    }
}

#[tokio::test]
async fn under_a_channel_wide_prefetch_local_and_proxied_deliveries_keep_tag_order() {
    // Held proxied deliveries are let out by the same acks that let local ones out: both
    // must reach the client in delivery-tag order (read off the wire: a client library
    // hands each consumer its own stream).
    use ringmq::amqp::frame::FRAME_METHOD;
    use ringmq::amqp::{AMQPClass, basic};
    use ringmq::client::{RawClient, Target, deliver_tag, encode_ack};
    use tokio::io::AsyncWriteExt;
    let (members, _secret) = start_cluster("proxy-mixed-qos", 2);
    declare(&members[0], "far").await;
    declare(&members[1], "near").await;
    let (_c1, on_1) = members[1].channel().await;
    publish_confirmed(&on_1, "far", "f", 200).await;
    publish_confirmed(&on_1, "near", "n", 200).await;
    let mut c = RawClient::connect(&Target::parse(&members[1].uri()).unwrap())
        .await
        .unwrap();
    c.call(
        AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
            prefetch_count: 4,
            global: true,
        })),
        |m| matches!(m, AMQPClass::Basic(basic::AMQPMethod::QosOk(_))),
        "basic.qos-ok",
    )
    .await
    .unwrap();
    for queue in ["far", "near"] {
        // consume-ok may come after the first deliveries of the other consumer: the read
        // loop below skips it.
        c.send(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
                queue: queue.into(),
                consumer_tag: queue.into(),
                no_local: false,
                no_ack: false,
                exclusive: false,
                nowait: false,
                arguments: FieldTable::default(),
            })),
        )
        .await
        .unwrap();
    }
    let (mut last, mut seen) = (0, 0);
    while seen < 400 {
        let f = tokio::time::timeout(Duration::from_secs(10), c.read_frame())
            .await
            .unwrap_or_else(|_| panic!("delivery {seen} within 10 s"))
            .unwrap();
        let Some(tag) = (f.kind == FRAME_METHOD)
            .then(|| deliver_tag(&f.payload))
            .flatten()
        else {
            continue;
        };
        assert!(tag > last, "tag {tag} after {last} (delivery {seen})");
        last = tag;
        seen += 1;
        let mut ack = Vec::new();
        encode_ack(&mut ack, 1, tag, false);
        c.stream.write_all(&ack).await.unwrap();
    }
}
