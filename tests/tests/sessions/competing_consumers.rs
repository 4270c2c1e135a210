//! Competing consumers of two sessions through the loss of their connections: a message one
//! session's application had seen — and acked, the ack lost with the connection — comes back
//! held for that session (`core::queue::holds`), so the other session's application never
//! sees it. Each message reaches the applications once, whether the member they and the
//! queue's primary were on is killed, or the member they consume through closes their
//! connections while the primary lives on.

use super::across_members::{acked, failover_client};
use super::exclusive_queues::wait_in_sync;
use ringmq_client::{Client, Properties, QueueOptions, Table};
use ringmq_tests::Broker;
use ringmq_tests::cluster::start_cluster;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Which application saw each message, and how often: message number → (consumer, count).
type Seen = Arc<Mutex<BTreeMap<usize, Vec<usize>>>>;

/// Consumes `queue` on `client` as application `who`, acking each delivery at once, until
/// `stop` — recording what the application saw in `seen`.
fn consume_as(
    who: usize,
    client: Client,
    queue: &'static str,
    seen: Seen,
    stop: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<Client> {
    tokio::spawn(async move {
        let channel = client.channel().await.unwrap();
        channel.qos(50).await.unwrap();
        let mut consumer = channel
            .consume(queue, &format!("c{who}"), false)
            .await
            .unwrap();
        let mut stop = stop;
        loop {
            tokio::select! {
                d = consumer.next() => {
                    let d = d.expect("the consumer lives");
                    let n: usize = String::from_utf8_lossy(&d.body)[1..].parse().unwrap();
                    seen.lock().unwrap().entry(n).or_default().push(who);
                    channel.ack(d.delivery_tag, false).unwrap();
                }
                _ = stop.changed() => return client,
            }
        }
    })
}

/// What takes the consumers' connections away.
#[derive(Clone, Copy, PartialEq)]
enum Fault {
    /// Member 0 — the consumers' member and the queue's primary — is killed with -9: the
    /// backup takes the queue over.
    KillTheirMemberAndThePrimary,
    /// Member 1, which the consumers consume through (the primary is member 0), closes
    /// their connections with 320: the primary lives on.
    CloseTheirConnections,
}

#[tokio::test]
async fn competing_consumers_of_two_sessions_see_each_message_once_through_their_members_loss() {
    each_message_once_through(
        "sessions-competing-kill",
        Fault::KillTheirMemberAndThePrimary,
    )
    .await;
}

#[tokio::test]
async fn competing_consumers_of_two_sessions_see_each_message_once_when_their_connections_close() {
    each_message_once_through("sessions-competing-close", Fault::CloseTheirConnections).await;
}

async fn each_message_once_through(name: &str, fault: Fault) {
    const MESSAGES: usize = 3000;
    let (mut m, _secret) = start_cluster(name, 3);
    let publisher = failover_client([m[2].uri(), m[1].uri()]).await;
    let channel = publisher.channel().await.unwrap();
    channel.confirm_select().await.unwrap();
    // Declared through member 0: its primary, with the backup on member 1.
    let declarer = failover_client([m[0].uri()]).await;
    declarer
        .channel()
        .await
        .unwrap()
        .queue_declare("competing", QueueOptions::default(), Table::default())
        .await
        .unwrap();
    declarer.close().await.unwrap();
    wait_in_sync(&m[1], "competing").await;

    let first = match fault {
        Fault::KillTheirMemberAndThePrimary => 0,
        Fault::CloseTheirConnections => 1,
    };
    let uris = || (0..3).map(|k| m[(first + k) % 3].uri()).collect::<Vec<_>>();
    let seen: Seen = Arc::default();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let consumers = [
        consume_as(
            0,
            failover_client(uris()).await,
            "competing",
            seen.clone(),
            stopped.clone(),
        ),
        consume_as(
            1,
            failover_client(uris()).await,
            "competing",
            seen.clone(),
            stopped,
        ),
    ];
    let mut window = Vec::new();
    for i in 0..MESSAGES {
        if i == MESSAGES / 3 {
            match fault {
                Fault::KillTheirMemberAndThePrimary => m[0].kill(),
                Fault::CloseTheirConnections => close_client_connections(&m[1]).await,
            }
        }
        let c = channel
            .publish(
                "",
                "competing",
                Properties::default(),
                format!("m{i}").into_bytes(),
            )
            .unwrap();
        window.push((i, c));
        if window.len() == 50 || i + 1 == MESSAGES {
            for (i, c) in window.drain(..) {
                assert!(acked(i, c).await, "m{i} nacked");
            }
        }
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while seen.lock().unwrap().len() < MESSAGES {
        assert!(
            Instant::now() < deadline,
            "confirmed messages never delivered: {} of {MESSAGES} seen",
            seen.lock().unwrap().len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A duplicate would come within a hold's time or from a requeue at once; give the
    // latter a moment.
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.send(true).unwrap();
    let mut failovers = 0;
    for c in consumers {
        let client = c.await.unwrap();
        failovers += client.failovers();
        client.close().await.unwrap();
    }
    assert!(failovers >= 2, "both consumers failed over");
    let twice: Vec<_> = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, who)| who.len() > 1)
        .map(|(n, who)| format!("m{n} by {who:?}"))
        .collect();
    eprintln!(
        "{} messages, {failovers} failovers",
        seen.lock().unwrap().len()
    );
    assert!(
        twice.is_empty(),
        "seen by the applications more than once: {twice:?}"
    );
    publisher.close().await.unwrap();
}

/// Closes every client connection (not the other members' links) on `b` with 320, as an
/// operator's `DELETE /api/connections/{name}` does.
async fn close_client_connections(b: &Broker) {
    let admin = b.admin_client();
    tokio::task::spawn_blocking(move || {
        let conns = admin.get("/api/connections").unwrap().body;
        let mut closed = 0;
        for c in conns.as_array().unwrap() {
            if c["user"] == "guest" {
                let name = c["name"].as_str().unwrap();
                let path = format!("/api/connections/{}", ringmq::admin_client::seg(name));
                let answer = admin.call("DELETE", &path, None).unwrap();
                assert!(answer.status < 300, "{path}: {}", answer.reason());
                closed += 1;
            }
        }
        assert_eq!(closed, 2, "the two consumers' connections: {conns}");
    })
    .await
    .unwrap();
}
