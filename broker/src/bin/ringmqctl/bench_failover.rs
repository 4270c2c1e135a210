//! `ringmqctl bench --failover`: the load of `bench`, carried by the failover client
//! (`ringmq-client`), with every message numbered by its producer so that the run can count
//! what a failover cost: confirmed publishes never delivered (`lost`), deliveries seen twice
//! (`duplicates`) and deliveries that came before an earlier one of the same producer on the
//! same consumer (`out_of_order`). Producers stop after `--seconds`; consumers then drain what
//! is left (until everything confirmed has come, or nothing came for 5 s) before counting.

use crate::bench::BenchArgs;
use anyhow::{Context, bail};
use ringmq_client::{Client, Config, Properties, QueueOptions};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Unconfirmed publishes per producer when `--confirm` is not given (the count of lost
/// messages needs confirms).
const DEFAULT_WINDOW: u32 = 256;
/// The drain stops once nothing arrived for this long.
const DRAIN_QUIET: Duration = Duration::from_secs(5);
/// And in any case after this long.
const DRAIN_LIMIT: Duration = Duration::from_secs(60);
/// Bytes of a message that say who sent it: send time (8), producer (4), number (8).
const STAMP: usize = 20;

/// Which numbers of each producer a set holds: one bit per number.
#[derive(Default)]
struct Seen(HashMap<u32, Vec<u64>>);

impl Seen {
    /// Adds `(producer, n)`; false if it was there.
    fn insert(&mut self, producer: u32, n: u64) -> bool {
        let bits = self.0.entry(producer).or_default();
        let (word, bit) = ((n / 64) as usize, n % 64);
        if bits.len() <= word {
            bits.resize(word + 1, 0);
        }
        let had = bits[word] & (1 << bit) != 0;
        bits[word] |= 1 << bit;
        !had
    }

    fn contains(&self, producer: u32, n: u64) -> bool {
        self.0
            .get(&producer)
            .and_then(|b| b.get((n / 64) as usize))
            .is_some_and(|w| w & (1 << (n % 64)) != 0)
    }

    fn iter(&self) -> impl Iterator<Item = (u32, u64)> + '_ {
        self.0.iter().flat_map(|(p, bits)| {
            bits.iter().enumerate().flat_map(move |(w, word)| {
                (0..64)
                    .filter(move |b| word & (1 << b) != 0)
                    .map(move |b| (*p, w as u64 * 64 + b))
            })
        })
    }
}

#[derive(Default)]
struct Counts {
    published: AtomicU64,
    consumed: AtomicU64,
    duplicates: AtomicU64,
    /// Of `duplicates`, those marked redelivered: a delivery the client did not recognise
    /// as one the application had (unmarked: a second copy of the message in its queue).
    duplicates_redelivered: AtomicU64,
    out_of_order: AtomicU64,
    nacked: AtomicU64,
}

/// Runs the failover benchmark (`args.failover`).
pub async fn bench(args: BenchArgs) -> anyhow::Result<()> {
    let uris: Vec<String> = args
        .uri
        .split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .map(str::to_owned)
        .collect();
    if uris.is_empty() {
        bail!("--uri names no broker");
    }
    if args.size < STAMP {
        bail!("--failover needs --size of at least {STAMP} bytes (send time, producer, number)");
    }
    let config = Config::new(uris.clone());
    let window = args.confirm.unwrap_or(DEFAULT_WINDOW).max(1) as usize;
    let queue = args
        .queue
        .clone()
        .unwrap_or_else(|| format!("ringmq-bench-failover-{}", std::process::id()));
    let declarer = Client::connect(config.clone())
        .await
        .with_context(|| format!("cannot connect to {}", uris[0]))?;
    declarer
        .channel()
        .await?
        .queue_declare(
            &queue,
            QueueOptions {
                durable: args.persistent,
                ..QueueOptions::default()
            },
            crate::bench::queue_arguments(&args)?,
        )
        .await
        .with_context(|| format!("cannot declare queue '{queue}'"))?;
    declarer.close().await?;

    let counts = Arc::new(Counts::default());
    let confirmed = Arc::new(Mutex::new(Seen::default()));
    let delivered = Arc::new(Mutex::new(Seen::default()));
    let start = Instant::now();
    let (stop_consuming, stop) = tokio::sync::watch::channel(false);
    let pauses = Arc::new(Pauses::default());
    let mut clients = Vec::new();
    let mut consumers = Vec::new();
    for i in 0..args.consumers {
        let client = Arc::new(Client::connect(config.clone()).await?);
        let ch = client.channel().await?;
        ch.qos(args.prefetch).await?;
        let mut consumer = ch.consume(&queue, &format!("bench-{i}"), false).await?;
        let (counts, delivered, mut stop) = (counts.clone(), delivered.clone(), stop.clone());
        let (pauses, watched) = (pauses.clone(), client.clone());
        consumers.push(tokio::spawn(async move {
            let mut last: HashMap<u32, u64> = HashMap::new();
            let mut progress = Progress::new(&watched);
            loop {
                let d = tokio::select! {
                    d = consumer.next() => d,
                    _ = stop.changed() => return,
                };
                let Some(mut d) = d else { return };
                progress.made(&watched, &pauses);
                let mut tag = d.delivery_tag;
                loop {
                    if d.body.len() >= STAMP {
                        let producer = u32::from_be_bytes(d.body[8..12].try_into().expect("4"));
                        let n = u64::from_be_bytes(d.body[12..20].try_into().expect("8"));
                        counts.consumed.fetch_add(1, Ordering::Relaxed);
                        if !delivered.lock().expect("not poisoned").insert(producer, n) {
                            counts.duplicates.fetch_add(1, Ordering::Relaxed);
                            if d.redelivered {
                                counts
                                    .duplicates_redelivered
                                    .fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        let previous = last.insert(producer, n);
                        if previous.is_some_and(|p| p > n) {
                            counts.out_of_order.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    tag = tag.max(d.delivery_tag);
                    match consumer.try_next() {
                        Some(next) => d = next,
                        None => break,
                    }
                }
                // One ack per batch of what had arrived.
                if ch.ack(tag, true).is_err() {
                    return;
                }
            }
        }));
        clients.push(client);
    }
    let deadline = start + Duration::from_secs(args.seconds);
    let mut producers = Vec::new();
    for p in 0..args.producers {
        let client = Arc::new(Client::connect(config.clone()).await?);
        let ch = client.channel().await?;
        ch.confirm_select().await?;
        let (counts, confirmed, queue) = (counts.clone(), confirmed.clone(), queue.clone());
        let (pauses, watched) = (pauses.clone(), client.clone());
        let (size, persistent, limit) = (args.size, args.persistent, args.count);
        producers.push(tokio::spawn(async move {
            let mut body = vec![0u8; size];
            body[8..12].copy_from_slice(&p.to_be_bytes());
            let properties = if persistent {
                Properties::default().with_delivery_mode(2)
            } else {
                Properties::default()
            };
            let mut waiting = VecDeque::new();
            let mut n = 0u64;
            let mut progress = Progress::new(&watched);
            while Instant::now() < deadline && limit.is_none_or(|l| n < l) {
                body[..8].copy_from_slice(&(start.elapsed().as_nanos() as u64).to_be_bytes());
                body[12..20].copy_from_slice(&n.to_be_bytes());
                let confirmation = ch.publish("", &queue, properties.clone(), body.clone())?;
                counts.published.fetch_add(1, Ordering::Relaxed);
                waiting.push_back((n, confirmation));
                n += 1;
                if waiting.len() >= window {
                    settle(&mut waiting, 1, p, &counts, &confirmed).await?;
                    progress.made(&watched, &pauses);
                }
            }
            let all = waiting.len();
            tokio::time::timeout(
                DRAIN_LIMIT,
                settle(&mut waiting, all, p, &counts, &confirmed),
            )
            .await
            .context("confirms still missing 60 s after the producers stopped")??;
            anyhow::Ok(())
        }));
        clients.push(client);
    }
    let mut producer_errors = Vec::new();
    for p in producers {
        if let Err(e) = p.await? {
            producer_errors.push(e.to_string());
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    // Drain: until everything confirmed came, or nothing came for a while.
    let drain_start = Instant::now();
    let mut before = counts.consumed.load(Ordering::Relaxed);
    let mut quiet_since = Instant::now();
    while drain_start.elapsed() < DRAIN_LIMIT && quiet_since.elapsed() < DRAIN_QUIET {
        let missing = {
            let c = confirmed.lock().expect("not poisoned");
            let d = delivered.lock().expect("not poisoned");
            c.iter().any(|(p, n)| !d.contains(p, n))
        };
        if !missing || args.consumers == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = counts.consumed.load(Ordering::Relaxed);
        if now != before {
            before = now;
            quiet_since = Instant::now();
        }
    }
    let _ = stop_consuming.send(true);
    for c in consumers {
        let _ = c.await;
    }
    let failovers: u64 = clients.iter().map(|c| c.failovers()).sum();
    let pauses = pauses.summary();
    for c in &clients {
        let _ = c.close().await;
    }
    let lost = if args.consumers == 0 {
        0
    } else {
        let c = confirmed.lock().expect("not poisoned");
        let d = delivered.lock().expect("not poisoned");
        c.iter().filter(|(p, n)| !d.contains(*p, *n)).count() as u64
    };
    let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
    let (published, consumed) = (load(&counts.published), load(&counts.consumed));
    println!(
        "failover bench: {} producer(s), {} consumer(s), {} B, {elapsed:.1} s: published {published} ({:.0} msg/s), consumed {consumed}, failovers {failovers} (pause median {:.0} ms, p99 {:.0} ms, longest {:.0} ms), lost {lost}, duplicates {}, out of order {}, nacked {}",
        args.producers,
        args.consumers,
        args.size,
        published as f64 / elapsed,
        pauses.median_ms,
        pauses.p99_ms,
        pauses.max_ms,
        load(&counts.duplicates),
        load(&counts.out_of_order),
        load(&counts.nacked),
    );
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "published_per_sec": published as f64 / elapsed,
                "published": published,
                "consumed": consumed,
                "failovers": failovers,
                "failover_pauses": pauses.count,
                "pause_ms_median": pauses.median_ms,
                "pause_ms_p99": pauses.p99_ms,
                "pause_ms_max": pauses.max_ms,
                "pauses_ms": pauses.all,
                "lost": lost,
                "duplicates": load(&counts.duplicates),
                "duplicates_redelivered": load(&counts.duplicates_redelivered),
                "out_of_order": load(&counts.out_of_order),
                "nacked": load(&counts.nacked),
                "seconds": elapsed,
                "producers": args.producers,
                "consumers": args.consumers,
                "size": args.size,
                "confirm": window,
                "persistent": args.persistent,
                "errors": producer_errors,
            })
        );
    }
    if !producer_errors.is_empty() {
        bail!("producers failed: {}", producer_errors.join("; "));
    }
    Ok(())
}

/// The pauses the application saw across failovers: for each producer and consumer, the
/// time from its last progress (a confirm, a delivery) before a failover of its client to
/// its first progress after it.
#[derive(Default)]
struct Pauses(Mutex<Vec<f64>>);

/// [`Pauses`] summed up, in milliseconds (0 without a failover).
struct PauseSummary {
    all: Vec<f64>,
    count: usize,
    median_ms: f64,
    p99_ms: f64,
    max_ms: f64,
}

impl Pauses {
    fn summary(&self) -> PauseSummary {
        let mut v = self.0.lock().expect("not poisoned").clone();
        v.sort_by(f64::total_cmp);
        let at = |q: f64| match v.len() {
            0 => 0.0,
            n => v[((n - 1) as f64 * q).round() as usize],
        };
        PauseSummary {
            count: v.len(),
            median_ms: at(0.5),
            p99_ms: at(0.99),
            max_ms: at(1.0),
            all: v,
        }
    }
}

/// One producer's or consumer's progress: when it last moved on, and how many failovers
/// its client had made by then.
struct Progress {
    at: Instant,
    failovers: u64,
}

impl Progress {
    fn new(client: &Client) -> Self {
        Self {
            at: Instant::now(),
            failovers: client.failovers(),
        }
    }

    /// It moved on: a failover since the last time makes the time between a pause.
    fn made(&mut self, client: &Client, pauses: &Pauses) {
        let now = Instant::now();
        let failovers = client.failovers();
        if failovers != self.failovers {
            let pause = now.duration_since(self.at).as_secs_f64() * 1000.0;
            pauses.0.lock().expect("not poisoned").push(pause);
            self.failovers = failovers;
        }
        self.at = now;
    }
}

/// Waits for the oldest `n` confirmations of producer `p`, recording the acked ones.
async fn settle(
    waiting: &mut VecDeque<(u64, ringmq_client::Confirmation)>,
    n: usize,
    p: u32,
    counts: &Counts,
    confirmed: &Mutex<Seen>,
) -> anyhow::Result<()> {
    for _ in 0..n {
        let Some((seq, confirmation)) = waiting.pop_front() else {
            break;
        };
        if confirmation.wait().await? {
            confirmed.lock().expect("not poisoned").insert(p, seq);
        } else {
            counts.nacked.fetch_add(1, Ordering::Relaxed);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seen_set_counts_each_number_once_per_producer() {
        let mut s = Seen::default();
        assert!(s.insert(1, 0) && s.insert(1, 64) && s.insert(2, 0));
        assert!(!s.insert(1, 64));
        assert!(s.contains(1, 64) && !s.contains(1, 63) && !s.contains(3, 0));
        let mut all: Vec<(u32, u64)> = s.iter().collect();
        all.sort_unstable();
        assert_eq!(all, [(1, 0), (1, 64), (2, 0)]);
    }
}
