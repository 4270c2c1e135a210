//! The scripted application of the seed's definition of transparent failover (DESIGN §2),
//! on the failover client: it records every command it sends and receives per channel, so
//! that a run through failures can be compared with a run without any.

use ringmq_client::{Client, Config, Properties, QueueOptions, Table};
use std::time::Duration;

/// What the application saw, per channel, in order.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Record {
    /// Publishing channel in confirm mode: the declares, each publish and its confirm.
    pub(crate) publisher: Vec<String>,
    /// Publishing channel without confirms: each publish.
    pub(crate) plain: Vec<String>,
    /// Consuming channel: each delivery (tag, body, redelivered) and what the app did.
    pub(crate) consumer: Vec<String>,
    /// Transactional channel: each publish, commit and rollback, then each delivery it
    /// acknowledges in transactions and each commit of those acks.
    pub(crate) tx: Vec<String>,
}

/// Messages published with confirms.
pub(crate) const MESSAGES: usize = 300;

/// Messages published without confirms, to the second queue.
pub(crate) const PLAIN_MESSAGES: usize = 50;

/// Deliveries the consumer records in a run: every message once, and every 7th of the
/// confirmed ones a second time after its rejection.
pub(crate) const DELIVERIES: usize = MESSAGES + MESSAGES.div_ceil(7) + PLAIN_MESSAGES;

/// Publishes per transaction of the transactional channel: one transaction after each
/// window of confirmed publishes.
const TX_SIZE: usize = 5;

/// Every this-many-th transaction is rolled back instead of committed.
const TX_ROLLED_BACK_EVERY: usize = 4;

/// The confirmed publishes' windows: one transaction follows each.
const WINDOW: usize = 25;

/// Messages the transactional channel commits (and consumes again, in transactions).
pub(crate) const TX_COMMITTED: usize = {
    let transactions = MESSAGES.div_ceil(WINDOW);
    (transactions - transactions / TX_ROLLED_BACK_EVERY) * TX_SIZE
};

/// `what` within `limit`, or a failure naming it.
async fn within_for<T>(what: &str, limit: Duration, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(limit, f)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer within {limit:?}"))
}

/// The scripted application on a client configured by `config`, on queues `queue`,
/// `<queue>-plain` and `<queue>-tx`, all declared with `options` and `arguments`:
///
/// 1. channel 1 selects confirms and declares the queues; channel 4 selects transactions;
/// 2. channel 3 publishes [`PLAIN_MESSAGES`] to `<queue>-plain` without confirms;
/// 3. channel 1 publishes [`MESSAGES`] to `queue`, confirms awaited in windows of 25; after
///    each window channel 4 publishes a transaction of [`TX_SIZE`] to `<queue>-tx` and
///    commits it, or every [`TX_ROLLED_BACK_EVERY`]-th, rolls it back;
/// 4. channel 2 (prefetch 1) consumes `queue`, rejecting every 7th delivery once with requeue
///    and acknowledging everything else, then consumes `<queue>-plain`, acknowledging all;
/// 5. channel 4 consumes `<queue>-tx`, acknowledging [`TX_SIZE`] deliveries per transaction.
///
/// Every step is given `patience` (a failover included). Returns the record and the
/// client's failover count.
pub(crate) async fn script(
    config: Config,
    queue: &str,
    (options, arguments): (QueueOptions, Table),
    patience: Duration,
) -> (Record, u64) {
    let within = |what: &str| (what.to_owned(), patience);
    let plain_queue = format!("{queue}-plain");
    let (w, p) = within("connect");
    let client = within_for(&w, p, Client::connect(config))
        .await
        .expect("connect");
    let mut record = Record::default();
    let (w, p) = within("channel 1");
    let publisher = within_for(&w, p, client.channel()).await.unwrap();
    let (w, p) = within("confirm.select");
    within_for(&w, p, publisher.confirm_select()).await.unwrap();
    let tx_queue = format!("{queue}-tx");
    for (role, name) in [
        ("queue", queue),
        ("plain", plain_queue.as_str()),
        ("tx", tx_queue.as_str()),
    ] {
        let (w, p) = within("queue.declare");
        let declared = within_for(
            &w,
            p,
            publisher.queue_declare(name, options, arguments.clone()),
        )
        .await
        .unwrap();
        record
            .publisher
            .push(format!("declare-ok {role} {}", declared.message_count));
    }
    let consumer_channel = {
        let (w, p) = within("channel 2");
        within_for(&w, p, client.channel()).await.unwrap()
    };
    let plain = {
        let (w, p) = within("channel 3");
        within_for(&w, p, client.channel()).await.unwrap()
    };
    let transactional = {
        let (w, p) = within("channel 4");
        within_for(&w, p, client.channel()).await.unwrap()
    };
    let (w, p) = within("tx.select");
    within_for(&w, p, transactional.tx_select()).await.unwrap();
    record.tx.push("select-ok".into());
    let mut transactions = 0;
    for i in 0..PLAIN_MESSAGES {
        let body = format!("u{i}");
        // Without confirm mode the confirmation only says the client took it.
        drop(
            plain
                .publish("", &plain_queue, Properties::default(), body.into_bytes())
                .unwrap(),
        );
        record.plain.push(format!("publish u{i}"));
    }
    let mut window = Vec::new();
    for i in 0..MESSAGES {
        let body = format!("m{i}");
        window.push((
            body.clone(),
            publisher
                .publish("", queue, Properties::default(), body.into_bytes())
                .unwrap(),
        ));
        record.publisher.push(format!("publish m{i}"));
        if window.len() == WINDOW || i + 1 == MESSAGES {
            for (body, confirmation) in window.drain(..) {
                let (w, p) = within(&format!("the confirm of {body}"));
                let ack = within_for(&w, p, confirmation.wait())
                    .await
                    .expect("a confirm");
                record.publisher.push(format!("confirm {body} {ack}"));
            }
            transactions += 1;
            for k in 0..TX_SIZE {
                let body = format!("t{}", (transactions - 1) * TX_SIZE + k);
                drop(
                    transactional
                        .publish(
                            "",
                            &tx_queue,
                            Properties::default(),
                            body.clone().into_bytes(),
                        )
                        .unwrap(),
                );
                record.tx.push(format!("publish {body}"));
            }
            if transactions % TX_ROLLED_BACK_EVERY == 0 {
                let (w, p) = within(&format!("the rollback of transaction {transactions}"));
                within_for(&w, p, transactional.tx_rollback())
                    .await
                    .unwrap();
                record.tx.push("rollback-ok".into());
            } else {
                let (w, p) = within(&format!("the commit of transaction {transactions}"));
                within_for(&w, p, transactional.tx_commit()).await.unwrap();
                record.tx.push("commit-ok".into());
            }
        }
    }
    let (w, p) = within("basic.qos");
    within_for(&w, p, consumer_channel.qos(1)).await.unwrap();
    let mut rejected = std::collections::HashSet::new();
    for (name, tag, count) in [
        (queue, "c1", MESSAGES),
        (plain_queue.as_str(), "c2", PLAIN_MESSAGES),
    ] {
        let (w, p) = within("basic.consume");
        let mut consumer = within_for(&w, p, consumer_channel.consume(name, tag, false))
            .await
            .unwrap();
        let mut acked = 0;
        while acked < count {
            let (w, p) = within(&format!("delivery {}", record.consumer.len()));
            let d = within_for(&w, p, consumer.next())
                .await
                .expect("the consumer lives");
            let body = String::from_utf8(d.body.to_vec()).unwrap();
            let n: usize = body[1..].parse().unwrap();
            let action = if tag == "c1" && n.is_multiple_of(7) && rejected.insert(n) {
                consumer_channel.nack(d.delivery_tag, false, true).unwrap();
                "nack-requeue"
            } else {
                consumer_channel.ack(d.delivery_tag, false).unwrap();
                acked += 1;
                "ack"
            };
            record.consumer.push(format!(
                "deliver {} {body} {} {action}",
                d.delivery_tag, d.redelivered
            ));
        }
    }
    let (w, p) = within("basic.consume on the transactional channel");
    let mut consumer = within_for(&w, p, transactional.consume(&tx_queue, "c3", false))
        .await
        .unwrap();
    for _ in 0..TX_COMMITTED / TX_SIZE {
        for _ in 0..TX_SIZE {
            let (w, p) = within(&format!("transactional delivery {}", record.tx.len()));
            let d = within_for(&w, p, consumer.next())
                .await
                .expect("the consumer lives");
            transactional.ack(d.delivery_tag, false).unwrap();
            record.tx.push(format!(
                "deliver {} {} {} ack",
                d.delivery_tag,
                String::from_utf8_lossy(&d.body),
                d.redelivered
            ));
        }
        let (w, p) = within("the commit of acks");
        within_for(&w, p, transactional.tx_commit()).await.unwrap();
        record.tx.push("commit-ok".into());
    }
    let failovers = client.failovers();
    let (w, p) = within("close");
    within_for(&w, p, client.close()).await.unwrap();
    (record, failovers)
}

/// A seeded xorshift: the random choices of a run are reproducible from its seed.
pub(crate) fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// The seeds to run: `<PREFIX>_SEEDS` (decimal or 0x-hex, comma-separated), else
/// `<PREFIX>_RUNS` seeds from `first` on, else `default` seeds from `first` on.
pub(crate) fn seeds(prefix: &str, first: u64, default: u64) -> Vec<u64> {
    let (list, runs) = (format!("{prefix}_SEEDS"), format!("{prefix}_RUNS"));
    match (std::env::var(&list), std::env::var(&runs)) {
        (Ok(list_value), _) => list_value
            .split(',')
            .map(|x| {
                let x = x.trim();
                x.strip_prefix("0x")
                    .map_or_else(|| x.parse(), |h| u64::from_str_radix(h, 16))
                    .unwrap_or_else(|e| panic!("{list}: '{x}' is not a seed: {e}"))
            })
            .collect(),
        (_, Ok(n)) => (0..n
            .parse::<u64>()
            .unwrap_or_else(|_| panic!("{runs} is a count")))
            .map(|i| first + i)
            .collect(),
        _ => (0..default).map(|i| first + i).collect(),
    }
}

/// The failover client's configuration for a scripted run on `uris` (the first tried
/// first): 1 s heartbeats, and `failover_timeout` to find a member that takes the session.
pub(crate) fn config(uris: impl IntoIterator<Item = String>, failover_timeout: Duration) -> Config {
    let mut config = Config::new(uris);
    config.heartbeat_s = 1;
    config.failover_timeout = failover_timeout;
    config
}
