//! Competing consumers of two sessions through the loss of the member they and the queue's
//! primary were on: a message one session's application had seen — and acked, the ack lost
//! with the member — comes back held for that session (`core::queue::holds`), so the other
//! session's application never sees it. Each message reaches the applications once.

use super::across_members::failover_client;
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

#[tokio::test]
async fn competing_consumers_of_two_sessions_see_each_message_once_through_their_members_loss() {
    const MESSAGES: usize = 3000;
    let (mut m, _secret) = start_cluster("sessions-competing", 3);
    let publisher = failover_client([m[2].uri(), m[1].uri()]).await;
    let channel = publisher.channel().await.unwrap();
    channel.confirm_select().await.unwrap();
    // Declared through member 0: its primary, with the backup on member 1.
    let on_0 = failover_client(m.iter().map(Broker::uri)).await;
    on_0.channel()
        .await
        .unwrap()
        .queue_declare("competing", QueueOptions::default(), Table::default())
        .await
        .unwrap();
    wait_in_sync(&m[1], "competing").await;

    let seen: Seen = Arc::default();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let consumers = [
        consume_as(0, on_0, "competing", seen.clone(), stopped.clone()),
        consume_as(
            1,
            failover_client(m.iter().map(Broker::uri)).await,
            "competing",
            seen.clone(),
            stopped,
        ),
    ];
    let mut window = Vec::new();
    for i in 0..MESSAGES {
        if i == MESSAGES / 3 {
            // Both consumers' member and the queue's primary: the backup takes over, every
            // client fails over.
            m[0].kill();
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
                let ack = tokio::time::timeout(Duration::from_secs(60), c.wait())
                    .await
                    .unwrap_or_else(|_| panic!("the confirm of m{i} in time"))
                    .expect("no error reaches the application");
                assert!(ack, "m{i} nacked");
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
    assert!(
        twice.is_empty(),
        "seen by the applications more than once: {twice:?}"
    );
    publisher.close().await.unwrap();
}
