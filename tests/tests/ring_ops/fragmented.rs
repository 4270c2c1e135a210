//! Fragmented shared queues on real brokers (issue #15): a fragment per member, each
//! producer's messages in its member's fragment and so in order at every consumer, members
//! whose consumers run dry pulling from the others, the whole queue counted, purged and
//! deleted as one, and a member killed with -9 losing nothing confirmed.

use crate::{get, publish_confirmed};
use futures_lite::StreamExt;
use lapin::BasicProperties;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions, QueuePurgeOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use ringmq_tests::cluster::start_cluster;
use ringmq_tests::{Broker, queue_counts, reply_code};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Mutex;

const QUEUE: &str = "orders";

/// What one consumer received: producer → sequence numbers, in arrival order.
type Received = Arc<Mutex<BTreeMap<String, Vec<u64>>>>;

fn fragmented() -> FieldTable {
    let mut args = FieldTable::default();
    args.insert("qpid.cluster.fragmented".into(), AMQPValue::Boolean(true));
    args
}

async fn declare(b: &Broker) -> lapin::Channel {
    let (conn, ch) = b.channel().await;
    std::mem::forget(conn);
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.queue_declare(QUEUE.into(), durable, fragmented())
        .await
        .expect("a fragmented queue is declared");
    ch
}

/// Publishes `count` persistent messages `{producer}-{n}` through `b`, confirmed in windows
/// (nacked ones sent again); returns the confirmed ones, stopping early at a connection
/// failure (a member killed under it).
async fn produce(b: &Broker, producer: &str, count: u64) -> BTreeSet<String> {
    let (conn, ch) = b.channel().await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut confirmed = BTreeSet::new();
    let mut next = 0;
    while next < count {
        let window: Vec<u64> = (next..(next + 50).min(count)).collect();
        let mut pending = Vec::new();
        for n in &window {
            let body = format!("{producer}-{n}");
            match ch
                .basic_publish(
                    "".into(),
                    QUEUE.into(),
                    BasicPublishOptions::default(),
                    body.as_bytes(),
                    BasicProperties::default().with_delivery_mode(2),
                )
                .await
            {
                Ok(c) => pending.push((body, c)),
                Err(_) => return confirmed,
            }
        }
        let mut all_acked = true;
        for (body, c) in pending {
            match c.await {
                Ok(c) if c.is_ack() => {
                    confirmed.insert(body);
                }
                Ok(_) => all_acked = false,
                Err(_) => return confirmed,
            }
        }
        if all_acked {
            next = window.last().copied().unwrap_or(next) + 1;
        }
    }
    drop(conn);
    confirmed
}

/// Consumes through `b` (prefetch 20, acks), recording each delivery.
async fn consume(b: &Broker, received: Received) -> lapin::Connection {
    let (conn, ch) = b.channel().await;
    ch.basic_qos(20, BasicQosOptions::default()).await.unwrap();
    let mut consumer = ch
        .basic_consume(
            QUEUE.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("consume");
    tokio::spawn(async move {
        while let Some(Ok(d)) = consumer.next().await {
            let body = String::from_utf8(d.data.clone()).unwrap();
            let (producer, n) = body.rsplit_once('-').unwrap();
            received
                .lock()
                .await
                .entry(producer.to_owned())
                .or_default()
                .push(n.parse().unwrap());
            let _ = d.acker.ack(BasicAckOptions::default()).await;
        }
    });
    conn
}

/// Waits until the consumers received `want` messages in all, for at most `limit`.
async fn wait_received(consumers: &[Received], want: usize, limit: Duration) -> usize {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let mut got = 0;
        for r in consumers {
            got += r.lock().await.values().map(Vec::len).sum::<usize>();
        }
        if got >= want || tokio::time::Instant::now() > deadline {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_producer_and_one_consumer_per_member_get_every_message_once_and_in_order() {
    let (members, _secret) = start_cluster("fragmented-order", 3);
    declare(&members[0]).await;
    let queue = get(&members[1], &format!("/api/queues/%2f/{QUEUE}")).await;
    assert_eq!(queue["fragmented"], true, "{queue}");
    let fragments = queue["fragments"].as_array().cloned().unwrap_or_default();
    assert_eq!(
        fragments.len(),
        3,
        "a fragment per member at declare-ok: {queue}"
    );
    let holders: BTreeSet<&str> = fragments
        .iter()
        .filter_map(|f| f["member"].as_str())
        .collect();
    let ids: Vec<String> = (0..3).map(|i| format!("fragmented-order-{i}")).collect();
    assert_eq!(holders, ids.iter().map(String::as_str).collect(), "{queue}");
    for f in &fragments {
        assert_eq!(
            f["member"], f["node"],
            "each member is its fragment's primary: {f}"
        );
    }

    let received: Vec<Received> = (0..3).map(|_| Received::default()).collect();
    let mut conns = Vec::new();
    for (m, r) in members.iter().zip(&received) {
        conns.push(consume(m, r.clone()).await);
    }
    const EACH: u64 = 1_500;
    let confirmed = tokio::join!(
        produce(&members[0], "p0", EACH),
        produce(&members[1], "p1", EACH),
        produce(&members[2], "p2", EACH),
    );
    for c in [confirmed.0, confirmed.1, confirmed.2] {
        assert_eq!(c.len(), EACH as usize);
    }
    let total = 3 * EACH as usize;
    let got = wait_received(&received, total, Duration::from_secs(60)).await;
    assert_eq!(got, total, "every message once");
    let mut seen: BTreeMap<String, BTreeSet<u64>> = BTreeMap::new();
    for (c, r) in received.iter().enumerate() {
        for (producer, ns) in r.lock().await.iter() {
            let late = ns.windows(2).position(|w| w[0] >= w[1]);
            assert!(
                late.is_none(),
                "consumer {c} got producer {producer}'s messages out of order: {:?}",
                late.map(|i| &ns[i.saturating_sub(3)..(i + 4).min(ns.len())])
            );
            for n in ns {
                assert!(
                    seen.entry(producer.clone()).or_default().insert(*n),
                    "{producer}-{n} delivered twice"
                );
            }
        }
    }
    for (i, r) in received.iter().enumerate() {
        let local = r.lock().await.get(&format!("p{i}")).map_or(0, Vec::len);
        assert!(local > 0, "consumer {i} read its own member's fragment");
    }
    drop(conns);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_whose_consumers_wait_pulls_from_the_others_and_the_queue_is_one_for_counts_purge_and_delete()
 {
    let (members, _secret) = start_cluster("fragmented-pull", 3);
    let ch = declare(&members[1]).await;
    // Published on members 0 and 1, consumed only on member 2: it pulls everything.
    for (i, m) in members[..2].iter().enumerate() {
        assert_eq!(produce(m, &format!("p{i}"), 300).await.len(), 300);
    }
    for m in &members {
        let (_c, ch) = m.channel().await;
        assert_eq!(
            queue_counts(&ch, QUEUE).await,
            Ok((600, 0)),
            "declare-ok counts the whole queue on {}",
            m.addr
        );
    }
    let received = Received::default();
    let conn = consume(&members[2], received.clone()).await;
    let got = wait_received(
        std::slice::from_ref(&received),
        600,
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(
        got, 600,
        "the consumer on the member that publishes nothing gets everything"
    );
    for (producer, ns) in received.lock().await.iter() {
        let late = ns.windows(2).position(|w| w[0] >= w[1]);
        assert!(
            late.is_none(),
            "{producer} in order: {:?}",
            late.map(|i| &ns[i.saturating_sub(5)..(i + 8).min(ns.len())])
        );
    }
    conn.close(200, "done".into()).await.unwrap();

    assert_eq!(produce(&members[0], "p0", 40).await.len(), 40);
    assert_eq!(produce(&members[2], "p2", 60).await.len(), 60);
    let purged = ch
        .queue_purge(QUEUE.into(), QueuePurgeOptions::default())
        .await
        .expect("purge");
    assert_eq!(purged, 100, "purge covers every fragment");
    assert_eq!(queue_counts(&ch, QUEUE).await, Ok((0, 0)));

    assert_eq!(produce(&members[2], "p2", 5).await.len(), 5);
    let (_c, ch) = members[0].channel().await;
    let if_empty = QueueDeleteOptions {
        if_empty: true,
        ..Default::default()
    };
    let refused = ch
        .queue_delete(QUEUE.into(), if_empty)
        .await
        .expect_err("five messages on another member's fragment");
    assert_eq!(reply_code(&refused), Some(406));
    let (_c, ch) = members[0].channel().await;
    let deleted = ch
        .queue_delete(QUEUE.into(), QueueDeleteOptions::default())
        .await
        .expect("delete");
    assert_eq!(deleted, 5);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let queues = get(&members[2], "/api/queues/%2f").await;
        let left: Vec<&Value> = (queues.as_array().into_iter().flatten())
            .filter(|q| q["name"].as_str().is_some_and(|n| n.contains(QUEUE)))
            .collect();
        if left.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "fragments left: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_killed_under_load_loses_nothing_confirmed() {
    let (members, _secret) = start_cluster("fragmented-kill", 3);
    declare(&members[0]).await;
    let received: Vec<Received> = (0..2).map(|_| Received::default()).collect();
    let mut conns = Vec::new();
    for (m, r) in members[..2].iter().zip(&received) {
        conns.push(consume(m, r.clone()).await);
    }
    let victim = &members[2];
    let kill = async {
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        victim.signal(libc::SIGKILL);
    };
    let (p0, p1, p2, ()) = tokio::join!(
        produce(&members[0], "p0", 4_000),
        produce(&members[1], "p1", 4_000),
        produce(victim, "p2", 4_000),
        kill,
    );
    let confirmed: BTreeSet<String> = p0.into_iter().chain(p1).chain(p2).collect();
    assert!(confirmed.len() > 8_000, "{} confirmed", confirmed.len());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    let missing = loop {
        let mut got = BTreeSet::new();
        for r in &received {
            for (producer, ns) in r.lock().await.iter() {
                got.extend(ns.iter().map(|n| format!("{producer}-{n}")));
            }
        }
        let missing: Vec<&String> = confirmed.difference(&got).collect();
        if missing.is_empty() || tokio::time::Instant::now() > deadline {
            break missing.into_iter().cloned().collect::<Vec<_>>();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(
        missing.is_empty(),
        "{} confirmed messages never delivered, e.g. {:?}",
        missing.len(),
        &missing[..missing.len().min(5)]
    );
    drop(conns);
}

/// The name and primary of `member`'s fragment, and its messages, as `b`'s admin API says.
async fn fragment_of(b: &Broker, member: &str) -> Option<(String, String, u64)> {
    let queue = get(b, &format!("/api/queues/%2f/{QUEUE}")).await;
    let f = (queue["fragments"].as_array().into_iter().flatten())
        .find(|f| f["member"] == member)?
        .clone();
    let name = f["name"].as_str()?.to_owned();
    let one = get(b, &format!("/api/queues/%2f/{name}")).await;
    Some((
        name,
        f["node"].as_str()?.to_owned(),
        one["messages"].as_u64()?,
    ))
}

/// Waits until `check` holds for `b`'s view of `member`'s fragment, for at most `limit`.
async fn wait_fragment(
    b: &Broker,
    member: &str,
    limit: Duration,
    check: impl Fn(&(String, String, u64)) -> bool,
) -> (String, String, u64) {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let now = fragment_of(b, member).await;
        if let Some(f) = now.as_ref().filter(|f| check(f)) {
            return f.clone();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{member}'s fragment is {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A session of its own on `b`: started (`resume` false) or resumed.
async fn session(b: &Broker, id: &str, resume: bool) -> Result<lapin::Connection, lapin::Error> {
    let key = if resume {
        "qpid.session.resume"
    } else {
        "qpid.session.start"
    };
    let props = lapin::ConnectionProperties::default()
        .with_client_property(key.into(), lapin::types::LongString::from(id))
        .with_client_property("qpid.session.timeout".into(), "30".into());
    lapin::Connection::connect(&b.uri(), props).await
}

/// Publishes `bodies` on `conn` with confirms; panics unless each is acked.
async fn publish_on(conn: &lapin::Connection, bodies: std::ops::Range<u32>) {
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    publish_confirmed(&ch, QUEUE, bodies.map(|n| format!("s-{n}"))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_session_keeps_publishing_into_the_fragment_it_started_in() {
    let (members, _secret) = start_cluster("fragmented-session", 3);
    declare(&members[0]).await;
    let id = "8f7d0b6e-9d1c-4f6e-a8a5-2f1d3c4b5a69";
    let first = session(&members[1], id, false)
        .await
        .expect("session started");
    publish_on(&first, 0..10).await;
    // 330 keeps the session (lapin reports the close of the channel it dropped as an error).
    let _ = first.close(330, "keep my session".into()).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let moved = loop {
        match session(&members[0], id, true).await {
            Ok(conn) => break conn,
            Err(e) => {
                assert!(tokio::time::Instant::now() < deadline, "no resume: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    publish_on(&moved, 10..20).await;
    let (name, node, messages) = fragment_of(&members[2], "fragmented-session-1")
        .await
        .expect("member 1's fragment");
    assert_eq!(node, "fragmented-session-1", "{name}");
    assert_eq!(
        messages, 20,
        "resumed on member 0, the session still publishes into member 1's fragment"
    );
    let (_, _, on_0) = fragment_of(&members[2], "fragmented-session-0")
        .await
        .unwrap();
    assert_eq!(on_0, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_members_fragment_empties_into_the_others_and_a_new_member_gets_one() {
    let name = "fragmented-ring";
    let (mut members, secret) = start_cluster(name, 3);
    declare(&members[0]).await;
    let drained = format!("{name}-2");
    assert_eq!(produce(&members[2], "p2", 50).await.len(), 50);
    let (ok, out) = crate::ctl(
        &members[0],
        &["cluster", "drain", &drained, "--wait", "--timeout", "60"],
    )
    .await;
    assert!(ok, "{out}");
    let (_, node, _) =
        wait_fragment(&members[0], &drained, Duration::from_secs(30), |f| f.2 == 0).await;
    assert_ne!(node, drained, "the drained member holds nothing");
    let mut held = 0;
    for i in 0..2 {
        held += fragment_of(&members[0], &format!("{name}-{i}"))
            .await
            .unwrap()
            .2;
    }
    assert_eq!(
        held, 50,
        "the drained member's messages are in the others' fragments"
    );

    let seeds: Vec<String> = members.iter().filter_map(|m| m.cluster.clone()).collect();
    let seeds: Vec<&str> = seeds.iter().map(String::as_str).collect();
    let joiner = format!("{name}-3");
    members.push(Broker::start_with_config(
        &ringmq_tests::cluster::member_yaml(&joiner, &seeds, &secret),
    ));
    members[3].wait_ready(Duration::from_secs(30));
    let (_, node, _) = wait_fragment(&members[1], &joiner, Duration::from_secs(30), |_| true).await;
    assert_eq!(node, joiner, "the new member is its fragment's primary");
}
