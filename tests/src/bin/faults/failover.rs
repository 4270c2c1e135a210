//! The failover-aware client (`ringmq-client`, docs/sessions.md) as a workload: one publisher
//! and one consumer, each one session that the client moves between the members by itself
//! (known-hosts, resume), on a queue of its own. The same checkers read its history: nothing
//! confirmed lost, nothing delivered that was never sent, first deliveries in order — and one
//! more: what the application saw is what a run without failure shows (`History::
//! sequence_breaks`): every confirm an ack, no error, delivery tags one by one, each
//! producer session's messages in order (but for one the application never had that a
//! failure moved back, marked redelivered). Here `duplicated` counts deliveries the
//! *application* saw twice (reported, not failed: `docs/reliability.md`).

use crate::workload::{CONFIRM_LIMIT, History, WINDOW, Workload, debug, declare};
use ringmq_client::{Client, Config, Properties};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A consumer session with no delivery for this long starts a new session: the client should
/// have re-created its consumer after a failover, and the suite must not wait for ever if it
/// did not (the broker's consumers are checked by the lost checker either way).
const IDLE_NEW_SESSION: Duration = Duration::from_secs(15);

/// Declares `queue` (durable, `k` backups) and starts the failover client's two sessions,
/// each first on a member of `uris` picked by `first`. Its `reconnects` count the client's
/// failovers and the sessions it had to start anew.
pub async fn start(uris: Vec<String>, queue: String, k: i64, first: usize) -> Workload {
    declare(&uris, &queue, &super::workload::queue_arguments(k, false)).await;
    Workload::spawn(|shared| {
        let session = |by: usize, stop: &Arc<AtomicBool>| {
            let mut rotated = uris.clone();
            rotated.rotate_left(by % uris.len());
            Session {
                uris: rotated,
                queue: queue.clone(),
                history: Arc::clone(&shared.history),
                stop: Arc::clone(stop),
                reconnects: Arc::clone(&shared.reconnects),
            }
        };
        let publisher = tokio::spawn(publisher(session(first, &shared.stop_publishing)));
        let consumer = tokio::spawn(consumer(session(first + 1, &shared.stop_consuming)));
        (vec![publisher], vec![consumer])
    })
}

/// What a session task needs.
struct Session {
    uris: Vec<String>,
    queue: String,
    history: Arc<Mutex<History>>,
    stop: Arc<AtomicBool>,
    reconnects: Arc<AtomicU64>,
}

/// A client on `uris`: a short session timeout would end sessions the suite's faults only
/// interrupt, so the default (60 s) stays.
async fn connect(uris: &[String], what: &str) -> Option<Client> {
    match Client::connect(Config::new(uris.iter().cloned())).await {
        Ok(c) => Some(c),
        Err(e) => {
            debug(&format!("failover {what}: no session: {e}"));
            tokio::time::sleep(Duration::from_millis(200)).await;
            None
        }
    }
}

/// Publishes windows of [`WINDOW`] persistent messages with confirms, ids `F:S-SEQ` (`S` the
/// session: the order holds along one session, across its failovers).
async fn publisher(s: Session) {
    let mut session = 0u64;
    let mut last_confirm = Instant::now();
    while !s.stop.load(Ordering::SeqCst) {
        let Some(client) = connect(&s.uris, "publisher").await else {
            continue;
        };
        session += 1;
        let mut seq = 0u64;
        let mut ended = None;
        if let Ok(ch) = client.channel().await
            && ch.confirm_select().await.is_ok()
        {
            'publishing: while !s.stop.load(Ordering::SeqCst) {
                let mut window = Vec::with_capacity(WINDOW);
                for _ in 0..WINDOW {
                    seq += 1;
                    let id = format!("F:{session}-{seq}");
                    s.history.lock().unwrap().attempted.insert(id.clone());
                    let props = Properties::default().with_delivery_mode(2);
                    match ch.publish("", &s.queue, props, id.clone().into_bytes()) {
                        Ok(confirm) => window.push((id, confirm)),
                        Err(e) => {
                            ended = ended.or_else(|| session_ended(e));
                            break;
                        }
                    }
                }
                let mut failed = window.len() < WINDOW;
                for (id, confirm) in window {
                    match tokio::time::timeout(CONFIRM_LIMIT, confirm.wait()).await {
                        Ok(Ok(true)) => s.history.lock().unwrap().confirmed(id, &mut last_confirm),
                        Ok(Ok(false)) => s.history.lock().unwrap().nacked(&id),
                        Ok(Err(e)) => {
                            s.history
                                .lock()
                                .unwrap()
                                .sequence_break(&format!("{id}: the application got {e}"));
                            ended = ended.or_else(|| session_ended(e));
                            failed = true;
                        }
                        // Late is not another command: indeterminate, as for every
                        // workload (the lost checker decides).
                        Err(_) => failed = true,
                    }
                }
                if failed {
                    break 'publishing;
                }
            }
        }
        if let Some(why) = ended {
            eprintln!("faults: the failover client gave its publisher's session up: {why}");
            s.history.lock().unwrap().sessions_lost += 1;
        }
        s.reconnects
            .fetch_add(client.failovers() + 1, Ordering::Relaxed);
        let _ = tokio::time::timeout(Duration::from_secs(2), client.close()).await;
    }
    s.history.lock().unwrap().stopped(last_confirm);
}

/// Why the client gave its session up, if `e` says it did.
fn session_ended(e: ringmq_client::Error) -> Option<String> {
    match e {
        ringmq_client::Error::Ended(why) => Some(why),
        _ => None,
    }
}

/// Consumes with manual acks (prefetch 50), each delivery acked at once.
async fn consumer(s: Session) {
    while !s.stop.load(Ordering::SeqCst) {
        let Some(client) = connect(&s.uris, "consumer").await else {
            continue;
        };
        let setup = async {
            let ch = client.channel().await?;
            ch.qos(50).await?;
            let consumer = ch.consume(&s.queue, "faults-failover", false).await?;
            Ok::<_, ringmq_client::Error>((ch, consumer))
        };
        match tokio::time::timeout(Duration::from_secs(10), setup).await {
            Ok(Ok((ch, mut consumer))) => {
                let mut last_delivery = Instant::now();
                let mut next_tag = 1;
                while !s.stop.load(Ordering::SeqCst) {
                    match tokio::time::timeout(Duration::from_millis(500), consumer.next()).await {
                        Err(_) if last_delivery.elapsed() > IDLE_NEW_SESSION => {
                            debug("failover consumer idle: a new session");
                            break;
                        }
                        Err(_) => {}
                        Ok(None) => {
                            debug("failover consumer's session ended");
                            break;
                        }
                        Ok(Some(d)) => {
                            last_delivery = Instant::now();
                            let id = String::from_utf8_lossy(&d.body).into_owned();
                            let mut h = s.history.lock().unwrap();
                            h.delivered(&id, d.redelivered);
                            h.failover_delivered(&id, d.redelivered);
                            if d.delivery_tag != next_tag {
                                h.sequence_break(&format!(
                                    "{id} under delivery tag {} where {next_tag} was due",
                                    d.delivery_tag
                                ));
                            }
                            drop(h);
                            next_tag = d.delivery_tag + 1;
                            if ch.ack(d.delivery_tag, false).is_err() {
                                break;
                            }
                        }
                    }
                }
            }
            Ok(Err(e)) => {
                debug(&format!("failover consumer: {e}"));
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(_) => eprintln!("faults: failover consumer: no consume-ok within 10 s"),
        }
        s.reconnects
            .fetch_add(client.failovers() + 1, Ordering::Relaxed);
        let _ = tokio::time::timeout(Duration::from_secs(2), client.close()).await;
    }
}
