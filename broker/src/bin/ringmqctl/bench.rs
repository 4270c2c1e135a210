//! `ringmqctl bench`: producers publish to one queue (or spread over `--queues N`), consumers
//! drain them, and the tool reports rates and publish-to-delivery latency. It speaks raw
//! frames (see `ringmq::client`) and batches its writes, so that the broker, not the tool, is
//! what gets measured.

use anyhow::{Context, bail};
use clap::Args;
use hdrhistogram::Histogram;
use ringmq::amqp::frame::{FRAME_BODY, FRAME_METHOD};
use ringmq::amqp::{AMQPClass, FieldTable, basic, confirm, queue};
use ringmq::client::{RawClient, Target, confirm_of, deliver_tag, encode_ack, encode_publish};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;

/// Options of `ringmqctl bench`.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// Broker to load (producers connect here). With --failover, one or more, comma-separated:
    /// the clients connect to the first and fail over to the others (and the members the
    /// cluster names).
    #[arg(long, default_value = "amqp://guest:guest@127.0.0.1:5672/%2f")]
    pub(crate) uri: String,
    /// Where the consumers connect (default: --uri). With another cluster member than the
    /// queue's, they consume through a proxy.
    #[arg(long, value_name = "URI")]
    pub(crate) consumer_uri: Option<String>,
    /// Cluster members to spread the clients over, comma-separated AMQP URIs: producer i and
    /// consumer i connect to the (i mod n)-th (instead of --uri and --consumer-uri) — one
    /// producer and one consumer per member with --producers n --consumers n, as a
    /// fragmented queue is meant to be used.
    #[arg(long, value_name = "URIS", value_delimiter = ',')]
    pub(crate) spread: Vec<String>,
    /// Where the queue is declared (default: --uri): on a cluster, the member that becomes
    /// its primary.
    #[arg(long, value_name = "URI")]
    pub(crate) queue_uri: Option<String>,
    /// Publishing connections.
    #[arg(long, default_value_t = 1)]
    pub(crate) producers: u32,
    /// Consuming connections.
    #[arg(long, default_value_t = 1)]
    pub(crate) consumers: u32,
    /// Message body size in bytes (the first 8 carry the send time when it is at least 8).
    #[arg(long, default_value_t = 1000)]
    pub(crate) size: usize,
    /// How long to publish, in seconds.
    #[arg(long, default_value_t = 10)]
    pub(crate) seconds: u64,
    /// Stop each producer after this many messages (default: publish until --seconds ends).
    #[arg(long, value_name = "N")]
    pub(crate) count: Option<u64>,
    /// Publish at this many messages per second per producer (as PerfTest's --rate), to
    /// measure latency at a fixed load rather than at the most the broker takes. Message n
    /// of a producer is due n/RATE seconds after the load starts; a producer that falls
    /// behind catches up in batches.
    #[arg(long, value_name = "RATE", value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) rate: Option<u64>,
    /// Use publisher confirms with at most this many unconfirmed messages per producer.
    #[arg(long, value_name = "WINDOW")]
    pub(crate) confirm: Option<u32>,
    /// Publish persistent messages (delivery-mode 2) to a durable queue.
    #[arg(long)]
    pub(crate) persistent: bool,
    /// Queue to use (declared if missing); default: a fresh one, deleted afterwards. With
    /// --queues N above 1, the name's prefix: the queues are NAME-0 .. NAME-(N-1).
    #[arg(long)]
    pub(crate) queue: Option<String>,
    /// Spread the load over this many queues: producer i publishes to queue (i mod N) and
    /// consumer i drains queue (i mod N), as in PerfTest's multi-queue runs — to see whether
    /// throughput scales with queues or collapses.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) queues: u32,
    /// Arguments the queue is declared with, as a JSON object — e.g.
    /// '{"qpid.cluster.backups": 2}' for ringmq, '{"x-queue-type": "quorum"}' for RabbitMQ —
    /// so that one tool drives both (integers are sent as signed 64-bit).
    #[arg(long, value_name = "JSON")]
    pub(crate) queue_args: Option<String>,
    /// Consumer prefetch (basic.qos); consumers ack once per read batch with multiple=true.
    #[arg(long, default_value_t = 1000)]
    pub(crate) prefetch: u16,
    /// Print a JSON object as the last line of output.
    #[arg(long)]
    pub(crate) json: bool,
    /// Run the load on the failover client (ringmq-client): every message numbered by its
    /// producer, and the report counts failovers, lost (confirmed, never delivered),
    /// duplicates and out-of-order deliveries. Confirms are on (window: --confirm, or 256).
    #[arg(long)]
    pub(crate) failover: bool,
}

/// Publish batches: at most this many messages per write.
const PUBLISH_BATCH: usize = 256;

struct Totals {
    published: AtomicU64,
    consumed: AtomicU64,
}

/// Runs the benchmark.
pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    if args.producers == 0 && args.consumers == 0 {
        bail!("nothing to do: give --producers or --consumers a value above 0");
    }
    if args.seconds == 0 {
        bail!("--seconds must be at least 1");
    }
    if args.consumers > 0 && args.consumers < args.queues {
        bail!(
            "--queues {} with --consumers {}: some queues would fill and never drain; give every queue a consumer (--consumers at least --queues), or --consumers 0 to only publish",
            args.queues,
            args.consumers
        );
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    if args.failover {
        if args.rate.is_some() {
            bail!(
                "--rate is for the raw clients: the failover client publishes as fast as its confirm window allows"
            );
        }
        if !args.spread.is_empty() {
            bail!(
                "--spread is for the raw clients: give the failover client its members with --uri"
            );
        }
        if args.queues > 1 {
            bail!("--queues is for the raw clients: the failover client loads one queue");
        }
        return runtime.block_on(crate::bench_failover::bench(args));
    }
    runtime.block_on(bench(args))
}

/// The queue arguments `--queue-args` gives, as a field table.
pub(crate) fn queue_arguments(args: &BenchArgs) -> anyhow::Result<FieldTable> {
    match &args.queue_args {
        None => Ok(FieldTable::default()),
        Some(text) => {
            let json: serde_json::Value = serde_json::from_str(text)
                .with_context(|| format!("--queue-args is not JSON: {text}"))?;
            ringmq::admin::json::table_from_json(&json)
                .map_err(|e| anyhow::anyhow!("--queue-args: {e}"))
        }
    }
}

async fn bench(args: BenchArgs) -> anyhow::Result<()> {
    let queue_args = queue_arguments(&args)?;
    let spread: Vec<Target> = (args.spread.iter())
        .map(|uri| Target::parse(uri))
        .collect::<Result<_, _>>()?;
    let producer_targets = match spread.is_empty() {
        true => vec![Target::parse(&args.uri)?],
        false => spread.clone(),
    };
    let consumer_targets = match spread.is_empty() {
        true => vec![Target::parse(
            args.consumer_uri.as_deref().unwrap_or(&args.uri),
        )?],
        false => spread,
    };
    let queue_target = match (&args.queue_uri, args.spread.first()) {
        (Some(uri), _) | (None, Some(uri)) => Target::parse(uri)?,
        (None, None) => Target::parse(&args.uri)?,
    };
    let mut admin = RawClient::connect(&queue_target)
        .await
        .with_context(|| format!("cannot connect to {}", queue_target.addr))?;
    let own_queue = args.queue.is_none();
    let queue_names = queue_names(&args);
    for name in &queue_names {
        admin
            .call(
                AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
                    queue: name.as_str().into(),
                    passive: false,
                    durable: args.persistent,
                    exclusive: false,
                    auto_delete: false,
                    nowait: false,
                    arguments: queue_args.clone(),
                })),
                |m| matches!(m, AMQPClass::Queue(queue::AMQPMethod::DeclareOk(_))),
                "queue.declare-ok",
            )
            .await
            .with_context(|| format!("cannot declare queue '{name}'"))?;
    }

    let totals = Arc::new(Totals {
        published: AtomicU64::new(0),
        consumed: AtomicU64::new(0),
    });
    let start = Instant::now();
    // Consumers get a moment to register before the load starts.
    let load_start = start + Duration::from_millis(300);
    let deadline = load_start + Duration::from_secs(args.seconds);
    let mut consumers = Vec::new();
    for i in 0..args.consumers as usize {
        let consumer_target = &consumer_targets[i % consumer_targets.len()];
        let client = RawClient::connect(consumer_target)
            .await
            .with_context(|| format!("cannot connect to {}", consumer_target.addr))?;
        consumers.push(tokio::spawn(consume(
            client,
            queue_names[i % queue_names.len()].clone(),
            args.prefetch,
            start,
            deadline,
            totals.clone(),
        )));
    }
    tokio::time::sleep_until(load_start.into()).await;
    let consumed_at_start = totals.consumed.load(Ordering::Relaxed);
    let mut producers = Vec::new();
    for i in 0..args.producers as usize {
        let target = &producer_targets[i % producer_targets.len()];
        let client = RawClient::connect(target)
            .await
            .with_context(|| format!("cannot connect to {}", target.addr))?;
        producers.push(tokio::spawn(publish(
            client,
            queue_names[i % queue_names.len()].clone(),
            args.clone(),
            Clock {
                start,
                load_start,
                deadline,
            },
            totals.clone(),
        )));
    }
    tokio::time::sleep_until(deadline.into()).await;
    let elapsed = load_start.elapsed().as_secs_f64();
    let published = totals.published.load(Ordering::Relaxed);
    let consumed = totals.consumed.load(Ordering::Relaxed) - consumed_at_start;
    let mut latency = Histogram::<u64>::new(3).expect("3 significant figures is a valid histogram");
    for p in producers {
        p.await??;
    }
    for c in consumers {
        latency
            .add(c.await??)
            .expect("histograms of the same precision add");
    }
    if own_queue {
        for name in &queue_names {
            admin
                .call(
                    AMQPClass::Queue(queue::AMQPMethod::Delete(queue::Delete {
                        queue: name.as_str().into(),
                        if_unused: false,
                        if_empty: false,
                        nowait: false,
                    })),
                    |m| matches!(m, AMQPClass::Queue(queue::AMQPMethod::DeleteOk(_))),
                    "queue.delete-ok",
                )
                .await
                .with_context(|| format!("cannot delete the bench queue '{name}'"))?;
        }
    }
    let published_per_sec = published as f64 / elapsed;
    let consumed_per_sec = consumed as f64 / elapsed;
    let q = |p: f64| latency.value_at_quantile(p);
    println!(
        "{} producer(s), {} consumer(s), {} queue(s), {} B, {:.1} s: published {published_per_sec:.0} msg/s, consumed {consumed_per_sec:.0} msg/s, latency p50 {} us p99 {} us max {} us",
        args.producers,
        args.consumers,
        args.queues,
        args.size,
        elapsed,
        q(0.5),
        q(0.99),
        latency.max()
    );
    if args.json {
        let json = serde_json::json!({
            "published_per_sec": published_per_sec,
            "consumed_per_sec": consumed_per_sec,
            "published": published,
            "consumed": consumed,
            "seconds": elapsed,
            "producers": args.producers,
            "consumers": args.consumers,
            "queues": args.queues,
            "size": args.size,
            "confirm": args.confirm,
            "rate": args.rate,
            "persistent": args.persistent,
            "latency_us": { "p50": q(0.5), "p99": q(0.99), "p999": q(0.999), "max": latency.max(), "samples": latency.len() },
        });
        println!("{json}");
    }
    Ok(())
}

/// The queues the load runs on: `--queue` (or a fresh name), suffixed `-i` when there are
/// several.
fn queue_names(args: &BenchArgs) -> Vec<String> {
    let base = args
        .queue
        .clone()
        .unwrap_or_else(|| format!("ringmq-bench-{}-{}", std::process::id(), epoch_ms()));
    match args.queues {
        1 => vec![base],
        n => (0..n).map(|i| format!("{base}-{i}")).collect(),
    }
}

fn epoch_ms() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
}

/// The instants a producer works by: `start` is the zero of the timestamps in the bodies.
struct Clock {
    start: Instant,
    load_start: Instant,
    deadline: Instant,
}

/// Paces a producer at `--rate`: message n is due n/rate seconds after the load starts.
struct Pace {
    from: Instant,
    rate: f64,
}

impl Pace {
    /// How many more messages are due at `now`, `sent` having gone out.
    fn due(&self, sent: u64, now: Instant) -> u64 {
        let elapsed = now.saturating_duration_since(self.from).as_secs_f64();
        ((elapsed * self.rate) as u64 + 1).saturating_sub(sent)
    }

    /// When the message after the first `sent` is due.
    fn next_at(&self, sent: u64) -> Instant {
        self.from + Duration::from_secs_f64(sent as f64 / self.rate)
    }
}

async fn publish(
    mut c: RawClient,
    queue_name: String,
    args: BenchArgs,
    clock: Clock,
    totals: Arc<Totals>,
) -> anyhow::Result<()> {
    let Clock {
        start,
        load_start,
        deadline,
    } = clock;
    if args.confirm.is_some() {
        c.call(
            AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
                nowait: false,
            })),
            |m| matches!(m, AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(_))),
            "confirm.select-ok",
        )
        .await?;
    }
    let pace = args.rate.map(|rate| Pace {
        from: load_start,
        rate: rate as f64,
    });
    let window = args.confirm.map(u64::from).unwrap_or(u64::MAX);
    let mut body = vec![0u8; args.size];
    let mut out = Vec::with_capacity(PUBLISH_BATCH * (args.size + 64));
    let (mut sent, mut confirmed) = (0u64, 0u64);
    let limit = args.count.unwrap_or(u64::MAX);
    while Instant::now() < deadline && sent < limit {
        out.clear();
        let open = window
            .saturating_sub(sent - confirmed)
            .min(PUBLISH_BATCH as u64)
            .min(limit - sent);
        let room = match &pace {
            Some(pace) => open.min(pace.due(sent, Instant::now())),
            None => open,
        };
        for _ in 0..room {
            if body.len() >= 8 {
                body[..8].copy_from_slice(&(start.elapsed().as_nanos() as u64).to_be_bytes());
            }
            encode_publish(
                &mut out,
                1,
                "",
                &queue_name,
                args.persistent,
                &body,
                c.frame_max,
            );
        }
        if room > 0 {
            c.stream.write_all(&out).await?;
            sent += room;
            totals.published.fetch_add(room, Ordering::Relaxed);
        }
        let unconfirmed = sent - confirmed;
        let window_full =
            args.confirm.is_some() && unconfirmed >= window.min(PUBLISH_BATCH as u64).max(1);
        // Paced and not held by the window: wait for the next message's time, taking the
        // confirms that come meanwhile.
        let wake = match &pace {
            Some(pace) if !window_full && sent < limit => pace.next_at(sent),
            _ => deadline,
        };
        if wake >= deadline && pace.is_some() && !window_full {
            break;
        }
        if wake < deadline && (args.confirm.is_none() || unconfirmed == 0) {
            tokio::time::sleep_until(wake.into()).await;
            continue;
        }
        if window_full || (args.confirm.is_some() && wake < deadline) {
            // Wait for confirms, but not past the deadline (nor the next paced message).
            let Ok(frame) = tokio::time::timeout_at(wake.into(), c.read_frame()).await else {
                if wake < deadline {
                    continue;
                }
                break;
            };
            let frame = frame?;
            if frame.kind == FRAME_METHOD {
                match confirm_of(&frame.payload) {
                    // Acks and nacks both end a message's wait; multiple covers all below.
                    Some((tag, multiple, _)) if multiple || tag == confirmed + 1 => {
                        confirmed = confirmed.max(tag)
                    }
                    Some((_, _, _)) => confirmed += 1,
                    None => check_close(&frame.payload)?,
                }
            }
        }
    }
    Ok(())
}

fn check_close(payload: &[u8]) -> anyhow::Result<()> {
    if let Ok((_, m)) = amq_protocol::protocol::parse_class(payload) {
        match m {
            AMQPClass::Connection(ringmq::amqp::connection::AMQPMethod::Close(c)) => bail!(
                "broker closed the connection: {} {}",
                c.reply_code,
                c.reply_text
            ),
            AMQPClass::Channel(ringmq::amqp::channel::AMQPMethod::Close(c)) => bail!(
                "broker closed the channel: {} {}",
                c.reply_code,
                c.reply_text
            ),
            _ => {}
        }
    }
    Ok(())
}

async fn consume(
    mut c: RawClient,
    queue_name: String,
    prefetch: u16,
    start: Instant,
    deadline: Instant,
    totals: Arc<Totals>,
) -> anyhow::Result<Histogram<u64>> {
    let mut latency = Histogram::<u64>::new(3).expect("valid precision");
    c.call(
        AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
            prefetch_count: prefetch,
            global: false,
        })),
        |m| matches!(m, AMQPClass::Basic(basic::AMQPMethod::QosOk(_))),
        "basic.qos-ok",
    )
    .await?;
    c.call(
        AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
            queue: queue_name.as_str().into(),
            consumer_tag: "".into(),
            no_local: false,
            no_ack: false,
            exclusive: false,
            nowait: false,
            arguments: FieldTable::default(),
        })),
        |m| matches!(m, AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(_))),
        "basic.consume-ok",
    )
    .await?;
    let mut last_tag = 0u64;
    let mut acked = 0u64;
    let mut expect_body_start = false;
    let mut out = Vec::with_capacity(64);
    let mut frames = 0u64;
    loop {
        // A read from frames already buffered never waits, so the timeout below never fires
        // while a fast broker keeps the buffer full: the deadline is checked here as well.
        frames += 1;
        if frames.is_multiple_of(1024) && Instant::now() >= deadline {
            return Ok(latency);
        }
        let Ok(frame) = tokio::time::timeout_at(deadline.into(), c.read_frame()).await else {
            return Ok(latency);
        };
        let frame = frame?;
        match frame.kind {
            FRAME_METHOD => match deliver_tag(&frame.payload) {
                Some(tag) => {
                    last_tag = tag;
                    expect_body_start = true;
                    totals.consumed.fetch_add(1, Ordering::Relaxed);
                }
                None => check_close(&frame.payload)?,
            },
            FRAME_BODY if expect_body_start => {
                expect_body_start = false;
                if frame.payload.len() >= 8 {
                    let sent_ns =
                        u64::from_be_bytes(frame.payload[..8].try_into().expect("8 bytes"));
                    let now_ns = start.elapsed().as_nanos() as u64;
                    let _ = latency.record(now_ns.saturating_sub(sent_ns) / 1000);
                }
            }
            _ => {}
        }
        // Ack once per read batch: when no complete frame is buffered any more.
        if last_tag > acked && c.rbuf.len() < 7 {
            out.clear();
            encode_ack(&mut out, 1, last_tag, true);
            c.stream.write_all(&out).await?;
            acked = last_tag;
        }
    }
}
