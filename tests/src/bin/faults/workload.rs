//! The clients: confirmed publishers with unique ids and consumers that ack, on plain AMQP
//! connections (lapin) that go to a member picked at random and reconnect elsewhere when it
//! fails. What they did is the history the checkers read.

use futures_lite::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, BasicRejectOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Publishes awaited at a time per publisher.
pub const WINDOW: usize = 10;
/// A confirm not back within this is indeterminate (not counted as confirmed).
pub const CONFIRM_LIMIT: Duration = Duration::from_secs(10);
/// A consumer with no delivery for this long subscribes again (on another member).
const IDLE_RESUBSCRIBE: Duration = Duration::from_secs(5);

/// Everything the clients saw.
#[derive(Default)]
pub struct History {
    /// Ids sent (confirmed or not).
    pub attempted: HashSet<String>,
    /// Ids the broker confirmed (ack).
    pub confirmed: HashSet<String>,
    /// Ids delivered, with how many times.
    pub delivered: HashMap<String, u32>,
    /// First deliveries (`redelivered` false) that came after a later one of the same
    /// producer: the order the broker promises for messages delivered once.
    pub order_violations: u64,
    /// Per producer channel, the highest sequence number first-delivered so far.
    highest_first: HashMap<String, u64>,
    /// Longest time between two confirms of one publisher while it was running.
    pub longest_gap: Duration,
    /// Operations: publishes sent and deliveries received.
    pub operations: u64,
    /// When each id was confirmed (wall clock, to match with the members' logs).
    pub confirmed_at: HashMap<String, std::time::SystemTime>,
    /// The member each publisher connection (`P:E`) went to.
    pub connections: HashMap<String, String>,
    /// Sessions of the failover client that ended under a publisher: the client could not
    /// move them to another member within its failover limit, which the faults the suite
    /// injects never justify (a failed row).
    pub sessions_lost: u64,
    /// Where the failover client's application saw other commands than a run without
    /// failure shows it: a confirm that is not an ack, an error, a delivery tag out of turn,
    /// a message behind a later one of its producer without the `redelivered` mark. The
    /// seed's transparent failover (DESIGN §2), checked, with the one difference
    /// `docs/sessions.md` §2 allows (a message the application never had may come back
    /// marked redelivered, behind later ones); repeats are `duplicated`.
    pub sequence_breaks: u64,
    /// Per producer session of the failover client, the number of the last message its
    /// consumer got.
    failover_last: HashMap<String, u64>,
    /// Deliveries the failover client handed to its application twice (printed, the first
    /// ten; counted in `duplicated`).
    failover_repeats: u64,
    /// Deliveries from a dead-letter queue.
    pub dead_lettered: u64,
}

impl History {
    /// Publisher confirmed `id`; `last_confirm` is when its previous confirm came (the
    /// longest gap between two is the publisher's unavailability).
    pub fn confirmed(&mut self, id: String, last_confirm: &mut Instant) {
        self.confirmed_at
            .insert(id.clone(), std::time::SystemTime::now());
        self.confirmed.insert(id);
        self.operations += 1;
        self.longest_gap = self.longest_gap.max(last_confirm.elapsed());
        *last_confirm = Instant::now();
    }

    /// A publisher stopped; its last confirm came at `last_confirm`. A publisher that got no
    /// confirm for the rest of the schedule was unavailable that long too.
    pub fn stopped(&mut self, last_confirm: Instant) {
        self.longest_gap = self.longest_gap.max(last_confirm.elapsed());
    }

    /// The dead-letter queue's consumer got `id`: it arrived, out of the order checks (a
    /// copy dead-lettered again after its original went back comes behind later ones).
    pub fn dead_lettered(&mut self, id: &str) {
        self.operations += 1;
        self.dead_lettered += 1;
        *self.delivered.entry(id.to_owned()).or_default() += 1;
    }

    /// A consumer got `id` (`P:E-SEQ`); a first delivery (not `redelivered`, and the first
    /// time the id comes: a second copy of a message published twice is counted as
    /// duplicated, not as out of order) that comes after a later one of its channel breaks
    /// the order the broker promises.
    pub fn delivered(&mut self, id: &str, redelivered: bool) {
        self.operations += 1;
        let times = self.delivered.entry(id.to_owned()).or_default();
        *times += 1;
        if *times == 1
            && !redelivered
            && let Some((channel, s)) = id.split_once('-')
            && let Ok(s) = s.parse::<u64>()
        {
            let highest = self.highest_first.entry(channel.to_owned()).or_default();
            let violated = s < *highest;
            *highest = (*highest).max(s);
            if violated {
                self.order_violations += 1;
                if self.order_violations <= 10 {
                    eprintln!(
                        "faults: {id} first delivered after {channel}-{} (not marked redelivered)",
                        *highest
                    );
                }
            }
        }
    }
}

impl History {
    /// The failover client's publish `id` was nacked.
    pub fn nacked(&mut self, id: &str) {
        self.sequence_break(&format!("{id} nacked"));
    }

    /// The failover client's application saw something a run without failure would not show.
    pub fn sequence_break(&mut self, what: &str) {
        self.sequence_breaks += 1;
        if self.sequence_breaks <= 10 {
            eprintln!("faults: failover client: {what}");
        }
    }

    /// The failover client's consumer got `id` (`F:S-SEQ`): in a run without failure each
    /// producer session's messages come once each, in order. A failure may move a message
    /// the application never had back behind later ones (it was on its way to a member the
    /// session left, and came back from its queue later), marked `redelivered`: that one is
    /// not held to the order — it must still come once, which `duplicated` and `lost` check.
    pub fn failover_delivered(&mut self, id: &str, redelivered: bool) {
        let Some((producer, n)) = id
            .split_once('-')
            .and_then(|(p, n)| Some((p, n.parse::<u64>().ok()?)))
        else {
            return self.sequence_break(&format!("a message that is not the workload's: {id}"));
        };
        if self.delivered.get(id).is_some_and(|&times| times > 1) {
            self.failover_repeats += 1;
            if self.failover_repeats <= 10 {
                eprintln!(
                    "faults: failover client: {id} handed to the application again (redelivered: {redelivered})"
                );
            }
        }
        let last = self.failover_last.entry(producer.to_owned()).or_default();
        let before = *last;
        *last = before.max(n);
        if n <= before && !redelivered {
            self.sequence_break(&format!(
                "{id} delivered after {producer}-{before} (not marked redelivered)"
            ));
        }
    }
}

/// A seeded xorshift, so that a schedule's choices rerun exactly.
#[derive(Clone)]
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    pub fn below(&mut self, n: usize) -> usize {
        usize::try_from(self.next() % n as u64).unwrap_or(0)
    }
}

/// The clients of one schedule on one queue: plain AMQP connections ([`Workload::start`])
/// or the failover client's sessions (`crate::failover::start`), drained and finished alike.
pub struct Workload {
    pub history: Arc<Mutex<History>>,
    stop_publishing: Arc<AtomicBool>,
    stop_consuming: Arc<AtomicBool>,
    publishers: Vec<tokio::task::JoinHandle<()>>,
    consumers: Vec<tokio::task::JoinHandle<()>>,
    pub reconnects: Arc<AtomicU64>,
}

/// What a workload's consumer does with a delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Takes {
    /// Acks every message: it arrived.
    All,
    /// Rejects (`requeue=false`) the messages whose number ends in an odd digit, which go to
    /// the queue's dead-letter queue; acks the others, which arrived.
    RejectOdd,
    /// The dead-letter queue's consumer: acks every message, which arrived (its order is
    /// not held against the publisher's: a copy dead-lettered again comes later).
    DeadLetters,
}

impl Takes {
    /// Whether this consumer rejects `id` (`P:E-SEQ`).
    fn rejects(self, id: &str) -> bool {
        self == Takes::RejectOdd
            && id
                .bytes()
                .last()
                .is_some_and(|d| d.is_ascii_digit() && (d - b'0') % 2 == 1)
    }
}

/// What a workload's client tasks share: the history they add to, when publishers and the
/// consumer stop, and the count of their reconnects.
#[derive(Clone)]
pub struct Shared {
    pub history: Arc<Mutex<History>>,
    pub stop_publishing: Arc<AtomicBool>,
    pub stop_consuming: Arc<AtomicBool>,
    pub reconnects: Arc<AtomicU64>,
}

impl Workload {
    /// Declares `queue` (durable, with `args`) through any member that takes it, then starts
    /// `producers` publishers and one consumer.
    pub async fn start(
        uris: Vec<String>,
        queue: String,
        args: FieldTable,
        producers: usize,
        rng: Rng,
    ) -> Workload {
        declare(&uris, &queue, &args).await;
        let consumers = vec![(queue.clone(), Takes::All)];
        Workload::clients(uris, queue, consumers, producers, rng)
    }

    /// [`Workload::start`] on a queue that dead-letters at least once (`k` backups, and
    /// its dead-letter queue `<queue>-dlq` as well): its consumer rejects half of the
    /// messages (by their numbers), a second consumer takes them from the dead-letter queue.
    /// Every confirmed message must arrive at one of the two.
    pub async fn start_dead_lettering(
        uris: Vec<String>,
        queue: String,
        k: i64,
        producers: usize,
        rng: Rng,
    ) -> Workload {
        let dlq = format!("{queue}-dlq");
        declare(&uris, &dlq, &queue_arguments(k, false)).await;
        let mut args = queue_arguments(k, false);
        for (key, value) in &ringmq_tests::dead_letter_args(&dlq, "at-least-once") {
            args.insert(key.clone(), value.clone());
        }
        declare(&uris, &queue, &args).await;
        let consumers = vec![(queue.clone(), Takes::RejectOdd), (dlq, Takes::DeadLetters)];
        Workload::clients(uris, queue, consumers, producers, rng)
    }

    /// `producers` publishers to `queue` and a consumer per `consumers` entry (its queue,
    /// and what it does with a delivery), each with random choices of its own.
    fn clients(
        uris: Vec<String>,
        queue: String,
        consumers: Vec<(String, Takes)>,
        producers: usize,
        rng: Rng,
    ) -> Workload {
        Workload::spawn(|shared| {
            let client = |queue: &str, stop: &Arc<AtomicBool>, rng: Rng| Client {
                uris: uris.clone(),
                queue: queue.to_owned(),
                history: Arc::clone(&shared.history),
                stop: Arc::clone(stop),
                reconnects: Arc::clone(&shared.reconnects),
                rng,
            };
            let publishers = (0..producers)
                .map(|p| {
                    let mut rng = rng.clone();
                    rng.0 ^= (p as u64 + 1) * 0x9e37_79b9;
                    tokio::spawn(publisher(p, client(&queue, &shared.stop_publishing, rng)))
                })
                .collect();
            let consumers = consumers
                .into_iter()
                .enumerate()
                .map(|(i, (q, takes))| {
                    let mut rng = rng.clone();
                    rng.0 ^= 0x5bd1_e995 + i as u64;
                    tokio::spawn(consumer(client(&q, &shared.stop_consuming, rng), takes))
                })
                .collect();
            (publishers, consumers)
        })
    }

    /// A workload whose publishers and consumer `tasks` spawns on the state they share.
    pub fn spawn(
        tasks: impl FnOnce(
            &Shared,
        ) -> (
            Vec<tokio::task::JoinHandle<()>>,
            Vec<tokio::task::JoinHandle<()>>,
        ),
    ) -> Workload {
        let shared = Shared {
            history: Arc::new(Mutex::new(History::default())),
            stop_publishing: Arc::new(AtomicBool::new(false)),
            stop_consuming: Arc::new(AtomicBool::new(false)),
            reconnects: Arc::new(AtomicU64::new(0)),
        };
        let (publishers, consumers) = tasks(&shared);
        Workload {
            history: shared.history,
            stop_publishing: shared.stop_publishing,
            stop_consuming: shared.stop_consuming,
            publishers,
            consumers,
            reconnects: shared.reconnects,
        }
    }

    /// Stops the publishers — each once the confirms of its last window are in, or
    /// indeterminate — then lets the consumer take what is left until every confirmed id was
    /// delivered or nothing new came for `quiet`.
    pub async fn drain(&mut self, quiet: Duration) {
        self.stop_publishing.store(true, Ordering::SeqCst);
        for mut p in self.publishers.drain(..) {
            // A publisher still running would record confirms the drain no longer waits
            // for: each ends (its last window's confirms wait at most CONFIRM_LIMIT) or is
            // stopped.
            if tokio::time::timeout(Duration::from_secs(30), &mut p)
                .await
                .is_err()
            {
                eprintln!("faults: a publisher did not stop within 30 s: aborted");
                p.abort();
            }
        }
        wait_for_deliveries(&self.history, quiet).await;
    }

    /// Stops the consumers; the history is complete.
    pub async fn finish(self) -> Arc<Mutex<History>> {
        self.stop_consuming.store(true, Ordering::SeqCst);
        for consumer in self.consumers {
            let _ = tokio::time::timeout(Duration::from_secs(15), consumer).await;
        }
        self.history
    }
}

/// Returns once every id `history` has confirmed was delivered, or nothing new was delivered
/// for `quiet`.
async fn wait_for_deliveries(history: &Mutex<History>, quiet: Duration) {
    let mut last = (0, Instant::now());
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let h = history.lock().unwrap();
        let delivered = h.delivered.len();
        if h.confirmed.iter().all(|id| h.delivered.contains_key(id)) && delivered > 0 {
            break;
        }
        if delivered != last.0 {
            last = (delivered, Instant::now());
        } else if last.1.elapsed() > quiet {
            break;
        }
    }
}

async fn connect(uri: &str) -> Option<Connection> {
    match tokio::time::timeout(
        Duration::from_secs(5),
        Connection::connect(uri, ConnectionProperties::default()),
    )
    .await
    {
        Ok(Ok(c)) => Some(c),
        _ => None,
    }
}

/// The arguments of a workload's queue: `k` backups, and fragmented or not.
pub fn queue_arguments(k: i64, fragmented: bool) -> FieldTable {
    let mut args = FieldTable::default();
    args.insert("qpid.cluster.backups".into(), AMQPValue::LongLongInt(k));
    if fragmented {
        args.insert("qpid.cluster.fragmented".into(), AMQPValue::Boolean(true));
    }
    args
}

/// Declares durable `queue` with `args` through any member that takes it.
pub async fn declare(uris: &[String], queue: &str, args: &FieldTable) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        for uri in uris {
            let Some(conn) = connect(uri).await else {
                continue;
            };
            let Ok(ch) = conn.create_channel().await else {
                continue;
            };
            let declared = ch
                .queue_declare(
                    queue.into(),
                    QueueDeclareOptions {
                        durable: true,
                        ..Default::default()
                    },
                    args.clone(),
                )
                .await;
            let _ = conn.close(200, "declared".into()).await;
            if declared.is_ok() {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "no member declared {queue} within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// What a client task needs: where to connect, its queue, the history it adds to, when to
/// stop, a count of its reconnects, and its own random choices.
struct Client {
    uris: Vec<String>,
    queue: String,
    history: Arc<Mutex<History>>,
    stop: Arc<AtomicBool>,
    reconnects: Arc<AtomicU64>,
    rng: Rng,
}

async fn publisher(producer: usize, client: Client) {
    let Client {
        uris,
        queue,
        history,
        stop,
        reconnects,
        mut rng,
    } = client;
    let mut seq = 0u64;
    let mut last_confirm = Instant::now();
    // Order holds per channel: ids name the producer's connection (`P:E-SEQ`).
    let mut epoch = 0u64;
    while !stop.load(Ordering::SeqCst) {
        epoch += 1;
        let uri = &uris[rng.below(uris.len())];
        let Some(conn) = connect(uri).await else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        history
            .lock()
            .unwrap()
            .connections
            .insert(format!("{producer}:{epoch}"), uri.clone());
        let Ok(ch) = conn.create_channel().await else {
            continue;
        };
        if ch
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .is_err()
        {
            continue;
        }
        'publishing: while !stop.load(Ordering::SeqCst) {
            let mut window = Vec::with_capacity(WINDOW);
            for _ in 0..WINDOW {
                seq += 1;
                let id = format!("{producer}:{epoch}-{seq}");
                history.lock().unwrap().attempted.insert(id.clone());
                let sent = ch
                    .basic_publish(
                        "".into(),
                        queue.as_str().into(),
                        BasicPublishOptions::default(),
                        id.as_bytes(),
                        BasicProperties::default().with_delivery_mode(2),
                    )
                    .await;
                match sent {
                    Ok(confirm) => window.push((id, confirm)),
                    Err(_) => break,
                }
            }
            let mut failed = window.len() < WINDOW;
            for (id, confirm) in window {
                match tokio::time::timeout(CONFIRM_LIMIT, confirm).await {
                    Ok(Ok(c)) if c.is_ack() => {
                        history.lock().unwrap().confirmed(id, &mut last_confirm);
                    }
                    Ok(Ok(_)) => {}
                    _ => failed = true,
                }
            }
            if failed {
                break 'publishing;
            }
        }
        reconnects.fetch_add(1, Ordering::Relaxed);
        let _ = tokio::time::timeout(
            Duration::from_secs(1),
            conn.close(200, "reconnecting".into()),
        )
        .await;
    }
    history.lock().unwrap().stopped(last_confirm);
}

async fn consumer(client: Client, takes: Takes) {
    let Client {
        uris,
        queue,
        history,
        stop,
        reconnects,
        mut rng,
    } = client;
    while !stop.load(Ordering::SeqCst) {
        let uri = &uris[rng.below(uris.len())];
        let Some(conn) = connect(uri).await else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        // Each step bounded: a broker that never answers one is a finding, not a hang.
        let setup = async {
            let ch = conn.create_channel().await.map_err(|e| e.to_string())?;
            ch.basic_qos(50, BasicQosOptions::default())
                .await
                .map_err(|e| e.to_string())?;
            let deliveries = ch
                .basic_consume(
                    queue.as_str().into(),
                    "faults".into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(|e| e.to_string())?;
            Ok::<_, String>(deliveries)
        };
        let mut deliveries = match tokio::time::timeout(Duration::from_secs(10), setup).await {
            Ok(Ok(d)) => d,
            Ok(Err(e)) => {
                debug(&format!("consumer of {queue} through {uri}: {e}"));
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
            Err(_) => {
                eprintln!("faults: consumer of {queue} through {uri}: no consume-ok within 10 s");
                continue;
            }
        };
        debug(&format!("consumer of {queue} consuming through {uri}"));
        let mut last_delivery = Instant::now();
        while !stop.load(Ordering::SeqCst) {
            let next = tokio::time::timeout(Duration::from_millis(500), deliveries.next()).await;
            let d = match next {
                // A consumer the broker cancelled (its queue's primary moved) may end
                // without the stream saying so: after a quiet spell, subscribe again.
                Err(_) if last_delivery.elapsed() > IDLE_RESUBSCRIBE => {
                    debug(&format!(
                        "consumer of {queue} through {uri}: idle, subscribing again"
                    ));
                    break;
                }
                Err(_) => continue,
                Ok(Some(Ok(d))) => d,
                Ok(end) => {
                    debug(&format!("consumer of {queue} through {uri} ended: {end:?}"));
                    break;
                }
            };
            last_delivery = Instant::now();
            let id = String::from_utf8_lossy(&d.data).into_owned();
            let rejected = takes.rejects(&id);
            match takes {
                _ if rejected => history.lock().unwrap().operations += 1,
                Takes::DeadLetters => history.lock().unwrap().dead_lettered(&id),
                _ => history.lock().unwrap().delivered(&id, d.redelivered),
            }
            // Bounded: an ack on a connection that died without lapin noticing never ends.
            let settled = async {
                if rejected {
                    let reject = BasicRejectOptions { requeue: false };
                    d.reject(reject).await
                } else {
                    d.ack(BasicAckOptions::default()).await
                }
            };
            let acked = tokio::time::timeout(Duration::from_secs(5), settled).await;
            if !matches!(acked, Ok(Ok(_))) {
                debug(&format!(
                    "consumer of {queue} through {uri}: ack failed: {acked:?}"
                ));
                break;
            }
        }
        reconnects.fetch_add(1, Ordering::Relaxed);
        let _ = tokio::time::timeout(
            Duration::from_secs(1),
            conn.close(200, "reconnecting".into()),
        )
        .await;
    }
}

/// A line about the clients' connections when `FAULTS_DEBUG` is set.
pub fn debug(line: &str) {
    if std::env::var_os("FAULTS_DEBUG").is_some() {
        eprintln!("faults: {line}");
    }
}
