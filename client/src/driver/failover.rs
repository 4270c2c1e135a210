//! The failover: when the connection breaks, the session moves to a new one — a candidate
//! at random, resumed there — and the session's channels are put back as the crate
//! documentation describes (the broker's status read on a channel of its own, settlements the
//! broker misses, consumers created again, unanswered methods and unconfirmed publishes sent
//! again).

use super::{Driver, Ended, Pending, consume_method, publish_method, settle_method};
use crate::Error;
use crate::book::ChannelBook;
use crate::wire::{Incoming, Wire};
use amq_protocol::protocol::{AMQPClass, basic, channel, confirm, tx};
use amq_protocol::types::{AMQPValue, FieldTable};
use bytes::Bytes;
use rand08::seq::SliceRandom;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::time::Instant;

/// How long one connection attempt may take: a failover's, and the first connection's.
pub(super) const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

impl Driver {
    /// Moves the session to a new connection: a candidate at random, again and again until
    /// one takes it or the failover timeout passes.
    pub(super) async fn failover(&mut self, why: &str) -> Result<(), String> {
        let n = self.shared.failovers.fetch_add(1, Ordering::AcqRel) + 1;
        tracing::info!(session = %self.shared.session, failover = n, reason = why, "connection lost: failing over");
        self.assembling = None;
        for (ch, spec) in self.recoveries.take_all() {
            if let Some(book) = self.books.get_mut(&ch) {
                book.consumers.push(spec);
            }
        }
        let deadline = Instant::now() + self.config.failover_timeout;
        let mut props = FieldTable::default();
        props.insert(
            "qpid.session.resume".into(),
            AMQPValue::LongString(self.shared.session.to_string().as_str().into()),
        );
        let mut pause = Duration::from_millis(20);
        let mut last = why.to_owned();
        while Instant::now() < deadline {
            let mut order = self.candidates.clone();
            order.shuffle(&mut rand08::thread_rng());
            for target in order {
                let attempt = tokio::time::timeout(
                    CONNECT_TIMEOUT,
                    Wire::open(&target, props.clone(), self.config.heartbeat_s),
                )
                .await;
                match attempt {
                    Ok(Ok((wire, known_hosts))) => {
                        self.channel_max = wire.channel_max;
                        self.wire = wire;
                        self.learn(&known_hosts);
                        match self.restore().await {
                            Ok(()) => {
                                tracing::info!(session = %self.shared.session, at = %target.addr, "session resumed");
                                return Ok(());
                            }
                            Err(e) => last = format!("resuming at {}: {e}", target.addr),
                        }
                    }
                    Ok(Err(Error::Refused { code: 404, text })) => {
                        return Err(format!("the session is gone: {text}"));
                    }
                    Ok(Err(e)) => last = format!("{}: {e}", target.addr),
                    Err(_) => {
                        last = format!("{}: no answer within {CONNECT_TIMEOUT:?}", target.addr)
                    }
                }
                tracing::debug!(session = %self.shared.session, attempt = %last, "resume attempt failed");
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(500));
        }
        Err(format!(
            "no member took the session back within {:?}; last: {last}",
            self.config.failover_timeout
        ))
    }

    /// Puts the session's channels back on the new connection (see the crate documentation),
    /// then sends again what the application asked and got no answer for.
    async fn restore(&mut self) -> Result<(), Error> {
        let status = self.session_status().await?;
        let ids: Vec<u16> = self.books.keys().copied().collect();
        for id in ids {
            // What the application waits for stays waiting if this attempt fails: the next
            // one sends it again.
            let mut queue = self.pending.remove(&id).unwrap_or_default();
            let restored = self.restore_channel(id, &status, &mut queue).await;
            self.pending.insert(id, queue);
            restored?;
            self.wire.flush().await?;
        }
        Ok(())
    }

    /// Puts channel `id` back, with `queue`, the methods sent on it and not answered.
    async fn restore_channel(
        &mut self,
        id: u16,
        status: &BTreeMap<u16, KeptChannel>,
        queue: &mut VecDeque<Pending>,
    ) -> Result<(), Error> {
        self.rpc(
            id,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        )
        .await?;
        // A channel.open the application is still waiting for is answered by this one.
        if queue
            .front()
            .is_some_and(|p| matches!(p.method, AMQPClass::Channel(_)))
            && let Some(r) = queue.pop_front().and_then(|p| p.open)
        {
            let _ = r.send(Ok(id));
        }
        let book = self.books.get_mut(&id).expect("listed above");
        // A channel the status does not list: the session was taken over from another
        // member, and the channel starts over here.
        let kept = status.get(&id);
        let started_over = kept.is_none();
        if started_over {
            book.start_over();
        } else {
            book.resumed();
        }
        let prefetch = book.prefetch;
        let consumers = book.consumers.clone();
        let confirming = book.confirm_base.is_some();
        let transactional = book.tx.is_some();
        let again = book.settle_again(&kept.map(|k| k.unacked.clone()).unwrap_or_default());
        if let Some(kept) = kept {
            answer_what_went_through(book, queue, kept.commits);
        }
        if started_over && confirming {
            self.rpc(
                id,
                AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
                    nowait: false,
                })),
            )
            .await?;
        }
        if started_over && transactional {
            self.rpc(id, AMQPClass::Tx(tx::AMQPMethod::Select(tx::Select {})))
                .await?;
        }
        if let Some((prefetch_count, global)) = prefetch {
            self.rpc(
                id,
                AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
                    prefetch_count,
                    global,
                })),
            )
            .await?;
        }
        // Settlements first, so that the consumers created again below are not sent
        // what the application settled already.
        for settle in again {
            self.wire
                .method(id, AMQPClass::Basic(settle_method(settle)));
        }
        // On a resumed session the broker sends each consumer created again what its
        // predecessor left unacknowledged, under the old tags, before anything new; the
        // book lets through only what the application has not had.
        for spec in &consumers {
            self.rpc(
                id,
                AMQPClass::Basic(basic::AMQPMethod::Consume(consume_method(spec))),
            )
            .await?;
        }
        let book = self.books.get(&id).expect("listed above");
        tracing::debug!(
            channel = id,
            resent = book.log.len(),
            first = book.log.front().map(|p| p.seq),
            last = book.log.back().map(|p| p.seq),
            base = book.confirm_base,
            pending = queue.len(),
            "restoring the channel"
        );
        // What the application asked and the publishes, in the order it sent them (a
        // confirm.select before the publishes it numbers, a tx.commit after its
        // transaction's); each publish was numbered when first sent.
        let mut log = book.log.iter().peekable();
        for p in queue.iter() {
            while let Some(l) = log.next_if(|l| l.seq <= p.published_before) {
                self.wire
                    .publish(id, publish_method(l), &l.properties, &l.body);
            }
            self.wire.method(id, p.method.clone());
        }
        for l in log {
            self.wire
                .publish(id, publish_method(l), &l.properties, &l.body);
        }
        Ok(())
    }

    /// Reads the session's status (`amq.session`) on a channel of its own — so that the
    /// application's channels keep their delivery tags — and returns what it says of each
    /// channel.
    async fn session_status(&mut self) -> Result<BTreeMap<u16, KeptChannel>, Error> {
        let scratch = (1..=self.channel_max)
            .rev()
            .find(|id| !self.books.contains_key(id))
            .ok_or_else(|| Error::Protocol("no channel number left for the status".into()))?;
        self.rpc(
            scratch,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        )
        .await?;
        self.wire.method(
            scratch,
            AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
                queue: "amq.session".into(),
                no_ack: true,
            })),
        );
        self.wire.flush().await?;
        let body = loop {
            match self.wire.read().await? {
                Incoming::Method(ch, AMQPClass::Basic(basic::AMQPMethod::GetOk(_)))
                    if ch == scratch => {}
                Incoming::Header(ch, 0, _) if ch == scratch => break Bytes::new(),
                Incoming::Body(ch, body) if ch == scratch => break body,
                Incoming::Method(ch, m) if ch == scratch => {
                    return Err(Error::Protocol(format!(
                        "reading the session status: {m:?}"
                    )));
                }
                other => self.unexpected(other)?,
            }
        };
        self.rpc(
            scratch,
            AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
                reply_code: 200,
                reply_text: "status read".into(),
                class_id: 0,
                method_id: 0,
            })),
        )
        .await?;
        tracing::debug!(status = %String::from_utf8_lossy(&body), "session status");
        Ok(parse_status(&body))
    }

    /// Sends `method` on `ch` and reads until its reply.
    async fn rpc(&mut self, ch: u16, method: AMQPClass) -> Result<AMQPClass, Error> {
        self.wire.method(ch, method);
        self.wire.flush().await?;
        loop {
            match self.wire.read().await? {
                Incoming::Method(c, AMQPClass::Channel(channel::AMQPMethod::Close(close)))
                    if c == ch =>
                {
                    return Err(Error::ChannelClosed {
                        channel: ch,
                        code: close.reply_code,
                        text: close.reply_text.to_string(),
                    });
                }
                Incoming::Method(c, m)
                    if c == ch
                        && !matches!(
                            m,
                            AMQPClass::Basic(
                                basic::AMQPMethod::Deliver(_)
                                    | basic::AMQPMethod::Ack(_)
                                    | basic::AMQPMethod::Nack(_)
                                    | basic::AMQPMethod::Return(_)
                                    | basic::AMQPMethod::Cancel(_)
                            )
                        ) =>
                {
                    return Ok(m);
                }
                other => self.unexpected(other)?,
            }
        }
    }

    /// A frame that arrived while the restore waited for something else: handled as usual.
    fn unexpected(&mut self, frame: Incoming) -> Result<(), Error> {
        match self.on_frame(frame) {
            None | Some(Ended::Closed) => Ok(()),
            Some(Ended::Broken(why) | Ended::Unserved(why) | Ended::Fatal(why)) => {
                Err(Error::Protocol(why))
            }
        }
    }
}

/// What the member the session resumed on kept of one of its channels.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct KeptChannel {
    /// The delivery tags it counts unacknowledged.
    unacked: BTreeSet<u64>,
    /// The `tx.commit`s it applied.
    commits: u64,
}

/// After a resume on the same member: the `tx.commit`s sent whose `commit-ok` the lost
/// connection did not bring, but that the member applied (`commits`, its count, above the
/// channel's), are answered now and not sent again — nor is their transaction; so are the
/// `tx.rollback`s sent before them. The rest stay to be sent again.
fn answer_what_went_through(book: &mut ChannelBook, queue: &mut VecDeque<Pending>, commits: u64) {
    let Some(known) = book.tx.as_ref().map(|tx| tx.commits) else {
        return;
    };
    let mut went_through = commits.saturating_sub(known);
    let mut still = VecDeque::with_capacity(queue.len());
    while let Some(p) = queue.pop_front() {
        let reply = match p.method {
            AMQPClass::Tx(tx::AMQPMethod::Commit(_)) if went_through > 0 => {
                went_through -= 1;
                book.tx_ended(true);
                tx::AMQPMethod::CommitOk(tx::CommitOk {})
            }
            AMQPClass::Tx(tx::AMQPMethod::Rollback(_)) if went_through > 0 => {
                book.tx_ended(false);
                tx::AMQPMethod::RollbackOk(tx::RollbackOk {})
            }
            _ => {
                still.push_back(p);
                continue;
            }
        };
        if let Some(r) = p.reply {
            let _ = r.send(Ok(AMQPClass::Tx(reply)));
        }
    }
    *queue = still;
}

/// What a session status (`docs/sessions.md`) says of each channel.
fn parse_status(status: &[u8]) -> BTreeMap<u16, KeptChannel> {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(status) else {
        return BTreeMap::new();
    };
    let Some(channels) = v.get("channels").and_then(|c| c.as_object()) else {
        return BTreeMap::new();
    };
    channels
        .iter()
        .filter_map(|(id, c)| {
            let tags = c.get("unacked")?.as_array()?;
            Some((
                id.parse().ok()?,
                KeptChannel {
                    unacked: tags.iter().filter_map(serde_json::Value::as_u64).collect(),
                    commits: c
                        .get("commits")
                        .and_then(serde_json::Value::as_u64)
                        .unwrap_or(0),
                },
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::book::Logged;
    use tokio::sync::oneshot;

    #[test]
    fn the_unacked_tags_and_commits_of_each_channel_are_read_from_the_status() {
        let status = br#"{"session":"x","timeout_s":60,"resumed":true,"channels":{"1":{"next_delivery_tag":9,"unacked":[3, 5],"publishes_processed":4,"confirm":true,"transactional":false,"commits":0},"12":{"next_delivery_tag":1,"unacked":[],"publishes_processed":0,"confirm":false,"transactional":true,"commits":7}}}"#;
        let got = parse_status(status);
        let kept = |unacked: &[u64], commits| KeptChannel {
            unacked: unacked.iter().copied().collect(),
            commits,
        };
        assert_eq!(got.get(&1), Some(&kept(&[3, 5], 0)));
        assert_eq!(got.get(&12), Some(&kept(&[], 7)));
        assert_eq!(got.len(), 2);
    }

    fn pending(
        method: AMQPClass,
        published_before: u64,
    ) -> (Pending, oneshot::Receiver<Result<AMQPClass, Error>>) {
        let (reply, rx) = oneshot::channel();
        let p = Pending {
            method,
            consumer: None,
            reply: Some(reply),
            open: None,
            published_before,
        };
        (p, rx)
    }

    #[test]
    fn a_commit_the_member_applied_is_answered_and_one_it_did_not_is_sent_again() {
        let mut book = ChannelBook::default();
        book.select_tx();
        let commit = || AMQPClass::Tx(tx::AMQPMethod::Commit(tx::Commit {}));
        let mut queue = VecDeque::new();
        let mut answers = Vec::new();
        for through in [2, 4] {
            for _ in 0..2 {
                book.record_publish(Logged {
                    seq: 0,
                    exchange: String::new(),
                    routing_key: "q".into(),
                    properties: Default::default(),
                    body: Bytes::from_static(b"x"),
                    outcome: None,
                });
            }
            book.tx_ending();
            let (p, rx) = pending(commit(), through);
            queue.push_back(p);
            answers.push(rx);
        }
        // The member applied the first commit; its answer was lost with the connection.
        answer_what_went_through(&mut book, &mut queue, 1);
        assert!(matches!(
            answers[0].try_recv(),
            Ok(Ok(AMQPClass::Tx(tx::AMQPMethod::CommitOk(_))))
        ));
        assert!(answers[1].try_recv().is_err(), "the second is still open");
        assert_eq!(queue.len(), 1);
        assert_eq!(
            book.log.iter().map(|l| l.seq).collect::<Vec<_>>(),
            [3, 4],
            "only the second transaction is sent again"
        );
        assert_eq!(book.tx.as_ref().map(|t| t.commits), Some(1));
    }
}
