//! The failover: when the connection breaks, the session moves to a new one — a candidate
//! at random, resumed there — and the session's channels are put back as the crate
//! documentation describes (the broker's status read on a channel of its own, settlements the
//! broker misses, consumers created again, unanswered methods and unconfirmed publishes sent
//! again).

use super::{Driver, Ended, Pending, consume_method, publish_method, settle_method};
use crate::Error;
use crate::wire::{Incoming, Wire};
use amq_protocol::protocol::{AMQPClass, basic, channel, confirm};
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
        let unacked = self.broker_unacked().await?;
        let ids: Vec<u16> = self.books.keys().copied().collect();
        for id in ids {
            // A channel.open the application is still waiting for is answered by this one.
            let queue = self.pending.remove(&id).unwrap_or_default();
            let mut queue: VecDeque<Pending> = queue;
            let open_waiting = queue
                .front()
                .is_some_and(|p| matches!(p.method, AMQPClass::Channel(_)));
            let open = open_waiting.then(|| queue.pop_front()).flatten();
            self.rpc(
                id,
                AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
            )
            .await?;
            if let Some(r) = open.and_then(|p| p.open) {
                let _ = r.send(Ok(id));
            }
            let book = self.books.get_mut(&id).expect("listed above");
            // A channel the status does not list: the session was taken over from another
            // member, and the channel starts over here.
            let started_over = !unacked.contains_key(&id);
            if started_over {
                book.start_over();
            }
            let prefetch = book.prefetch;
            let consumers = book.consumers.clone();
            let confirming = book.confirm_base.is_some();
            let again = book.settle_again(&unacked.get(&id).cloned().unwrap_or_default());
            if started_over && confirming {
                self.rpc(
                    id,
                    AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
                        nowait: false,
                    })),
                )
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
            // What the application asked before the publishes it sent after (a
            // confirm.select before the publishes it numbers), then the publishes.
            for p in &queue {
                self.wire.method(id, p.method.clone());
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
            // Each was numbered when first sent.
            for p in &book.log {
                self.wire
                    .publish(id, publish_method(p), &p.properties, &p.body);
            }
            self.pending.insert(id, queue);
            self.wire.flush().await?;
        }
        Ok(())
    }

    /// Reads the session's status (`amq.session`) on a channel of its own — so that the
    /// application's channels keep their delivery tags — and returns, per channel, the tags
    /// the broker counts unacknowledged.
    async fn broker_unacked(&mut self) -> Result<BTreeMap<u16, BTreeSet<u64>>, Error> {
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
        Ok(parse_unacked(&body))
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
            Some(Ended::Broken(why) | Ended::Fatal(why)) => Err(Error::Protocol(why)),
        }
    }
}

/// The per-channel `unacked` lists of a session status (`docs/sessions.md`).
fn parse_unacked(status: &[u8]) -> BTreeMap<u16, BTreeSet<u64>> {
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
                tags.iter().filter_map(serde_json::Value::as_u64).collect(),
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_unacked_tags_of_each_channel_are_read_from_the_status() {
        let status = br#"{"session":"x","timeout_s":60,"resumed":true,"channels":{"1":{"next_delivery_tag":9,"unacked":[3, 5],"publishes_processed":4,"confirm":true,"transactional":false,"commits":0},"12":{"next_delivery_tag":1,"unacked":[],"publishes_processed":0,"confirm":false,"transactional":false,"commits":0}}}"#;
        let got = parse_unacked(status);
        assert_eq!(got.get(&1), Some(&BTreeSet::from([3, 5])));
        assert_eq!(got.get(&12), Some(&BTreeSet::new()));
        assert_eq!(got.len(), 2);
    }
}
