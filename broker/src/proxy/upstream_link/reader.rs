//! The upstream link's reader task: the member's frames split, messages assembled and handed
//! to their consumers' client connections, replies matched to their channels' waiters, and
//! closes and cancels from the member carried out.

use super::*;

/// How long the member may send nothing before the link counts as dead: two heartbeats, or
/// when it wants none, long enough for any reply.
pub(super) fn silence_limit(heartbeat_s: u16) -> Duration {
    match heartbeat_s {
        0 => Duration::from_secs(300),
        s => Duration::from_secs(2 * u64::from(s)),
    }
}

/// A message whose method frame came and whose content is still arriving.
struct Partial {
    what: Content,
    /// Properties, the header payload as it came, and the body size it announced.
    header: Option<(Properties, Bytes, u64)>,
    body: BodyParts,
}

enum Content {
    Deliver(Deliver),
    Got { ok: basic::GetOk },
}

/// A basic.deliver, read by hand: it comes once per message.
#[derive(Debug, PartialEq, Eq)]
struct Deliver {
    consumer_tag: Bytes,
    delivery_tag: u64,
    redelivered: bool,
    exchange: ShortString,
    routing_key: ShortString,
}

/// Reads a basic.deliver payload (class and method ids included); `None` if malformed.
fn parse_deliver(p: &Bytes) -> Option<Deliver> {
    fn short(p: &[u8], at: &mut usize) -> Option<ShortString> {
        let len = usize::from(*p.get(*at)?);
        let s = std::str::from_utf8(p.get(*at + 1..*at + 1 + len)?).ok()?;
        *at += 1 + len;
        Some(ShortString::from(s))
    }
    if p.get(..4)? != [0, 60, 0, 60] {
        return None;
    }
    let tag_len = usize::from(*p.get(4)?);
    p.get(5..5 + tag_len)?;
    let consumer_tag = p.slice(5..5 + tag_len);
    let mut at = 5 + tag_len;
    let delivery_tag = u64::from_be_bytes(p.get(at..at + 8)?.try_into().ok()?);
    at += 8;
    let redelivered = p.get(at)? & 1 == 1;
    at += 1;
    let exchange = short(p, &mut at)?;
    let routing_key = short(p, &mut at)?;
    Some(Deliver {
        consumer_tag,
        delivery_tag,
        redelivered,
        exchange,
        routing_key,
    })
}

/// The reader task's state.
pub(super) struct Reader {
    inner: Arc<Inner>,
    /// Channels by number, as the reader last saw them (a number is freed only after the
    /// reader saw its close or close-ok, so the cache cannot go stale).
    chans: HashMap<u16, Arc<Chan>>,
    /// Messages being assembled, by channel.
    partial: HashMap<u16, Partial>,
    /// Consumers with deliveries batched, to hand on before the next read.
    dirty: Vec<(Arc<Chan>, Arc<str>)>,
}

impl Reader {
    /// The reader of the link `inner`, before it read anything.
    pub(super) fn new(inner: Arc<Inner>) -> Self {
        Self {
            inner,
            chans: HashMap::new(),
            partial: HashMap::new(),
            dirty: Vec::new(),
        }
    }

    /// Reads the member's frames until the link ends (an error, a close, `silence`), then
    /// fails every channel with why.
    pub(super) async fn run(
        mut self,
        mut read: OwnedReadHalf,
        mut rbuf: BytesMut,
        silence: Duration,
    ) {
        let frame_max = self.inner.frame_max;
        let error = loop {
            match split_frame(&mut rbuf, frame_max) {
                Err(e) => break self.inner.unreachable(format!("it sent a bad frame: {e}")),
                Ok(Some(f)) => {
                    let handled = match f.kind {
                        FRAME_METHOD if f.channel == 0 => self.on_connection_method(&f.payload),
                        FRAME_METHOD => self.on_method(f.channel, f.payload),
                        FRAME_HEADER => self.on_header(f.channel, f.payload),
                        FRAME_BODY => self.on_body(f.channel, f.payload),
                        _ => Ok(()),
                    };
                    if let Err(e) = handled {
                        break e;
                    }
                }
                Ok(None) => {
                    self.hand_on();
                    if rbuf.capacity() - rbuf.len() < READ_RESERVE {
                        rbuf.reserve(4 * READ_RESERVE);
                    }
                    tokio::select! {
                        r = tokio::time::timeout(silence, read.read_buf(&mut rbuf)) => match r {
                            Ok(Ok(0)) => break self.inner.unreachable("it closed the link"),
                            Ok(Ok(_)) => {}
                            Ok(Err(e)) => break self.inner.unreachable(e),
                            Err(_) => break self.inner.unreachable(format!("silent for {silence:?}")),
                        },
                        () = self.inner.stop.notified() => {
                            break self.inner.shared.lock().failed.clone()
                                .unwrap_or_else(|| self.inner.unreachable("the link stopped"));
                        }
                    }
                }
            }
        };
        tracing::warn!(node = %self.inner.member, reason = %error.text, "upstream link failed");
        self.hand_on();
        self.fail_all(error);
    }

    /// Fails every channel: waiters get `error`, consumers end.
    fn fail_all(&mut self, error: AmqpError) {
        let chans: Vec<Arc<Chan>> = {
            let mut shared = self.inner.shared.lock();
            shared.failed.get_or_insert(error.clone());
            shared.channels.drain().map(|(_, c)| c).collect()
        };
        self.inner.wake.notify_one();
        for chan in chans {
            close_chan(&chan, &error);
        }
    }

    fn chan(&mut self, id: u16) -> Option<Arc<Chan>> {
        if let Some(c) = self.chans.get(&id) {
            return Some(c.clone());
        }
        let c = self.inner.channel(id)?;
        self.chans.insert(id, c.clone());
        Some(c)
    }

    fn on_connection_method(&mut self, payload: &[u8]) -> Result<(), AmqpError> {
        let method = match amq_protocol::protocol::parse_class(payload) {
            Ok((_, m)) => m,
            Err(e) => return Err(self.inner.unreachable(format!("it sent {e:?}"))),
        };
        match method {
            AMQPClass::Connection(connection::AMQPMethod::Close(c)) => {
                self.inner.queue_control(
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
                );
                Err(AmqpError::new(c.reply_code, c.reply_text.to_string()))
            }
            AMQPClass::Connection(connection::AMQPMethod::Blocked(_)) => {
                self.inner.shared.lock().blocked = true;
                Ok(())
            }
            AMQPClass::Connection(connection::AMQPMethod::Unblocked(_)) => {
                self.inner.shared.lock().blocked = false;
                Ok(())
            }
            _ => Ok(()),
        }
    }

    fn on_method(&mut self, id: u16, payload: Bytes) -> Result<(), AmqpError> {
        if method_ids(&payload) == Some((60, 60)) {
            let Some(d) = parse_deliver(&payload) else {
                return Err(self.inner.unreachable("it sent a malformed basic.deliver"));
            };
            return self.start_content(id, Content::Deliver(d));
        }
        let method = match amq_protocol::protocol::parse_class(&payload[..]) {
            Ok((_, m)) => m,
            Err(e) => return Err(self.inner.unreachable(format!("it sent {e:?}"))),
        };
        match method {
            AMQPClass::Basic(basic::AMQPMethod::GetOk(ok)) => {
                self.start_content(id, Content::Got { ok })
            }
            AMQPClass::Channel(channel::AMQPMethod::Close(c)) => {
                self.closed_by_member(id, AmqpError::new(c.reply_code, c.reply_text.to_string()));
                Ok(())
            }
            AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)) => {
                self.forget(id);
                if let Some(chan) = self.inner.shared.lock().channels.remove(&id) {
                    let e = self.inner.unreachable("the channel was closed");
                    close_chan(&chan, &e);
                }
                Ok(())
            }
            AMQPClass::Basic(basic::AMQPMethod::Cancel(c)) => {
                // The member cancelled the consumer (its queue went).
                if let Some(chan) = self.chan(id) {
                    let sink = chan.state.lock().consumers.remove(c.consumer_tag.as_str());
                    if let Some(sink) = sink {
                        sink.end();
                    }
                }
                if !c.nowait {
                    self.inner.queue_control(
                        id,
                        AMQPClass::Basic(basic::AMQPMethod::CancelOk(basic::CancelOk {
                            consumer_tag: c.consumer_tag,
                        })),
                    );
                }
                Ok(())
            }
            AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(ok)) => {
                if let Some(chan) = self.chan(id)
                    && let Some(sink) = chan
                        .state
                        .lock()
                        .consumers
                        .get_mut(ok.consumer_tag.as_str())
                {
                    sink.started = true;
                }
                self.answer(
                    id,
                    Ok(Replied::Method(AMQPClass::Basic(
                        basic::AMQPMethod::ConsumeOk(ok),
                    ))),
                )
            }
            AMQPClass::Basic(basic::AMQPMethod::CancelOk(ok)) => {
                if let Some(chan) = self.chan(id) {
                    let sink = chan.state.lock().consumers.remove(ok.consumer_tag.as_str());
                    if let Some(sink) = sink {
                        sink.end();
                    }
                }
                self.answer(
                    id,
                    Ok(Replied::Method(AMQPClass::Basic(
                        basic::AMQPMethod::CancelOk(ok),
                    ))),
                )
            }
            AMQPClass::Channel(channel::AMQPMethod::Flow(f)) => {
                // Nothing is published on this link: nothing to pause.
                self.inner.queue_control(
                    id,
                    AMQPClass::Channel(channel::AMQPMethod::FlowOk(channel::FlowOk {
                        active: f.active,
                    })),
                );
                Ok(())
            }
            // Nothing is published on this link: no confirms or returns come.
            AMQPClass::Basic(
                basic::AMQPMethod::Ack(_)
                | basic::AMQPMethod::Nack(_)
                | basic::AMQPMethod::Return(_),
            ) => Ok(()),
            m => self.answer(id, Ok(Replied::Method(m))),
        }
    }

    /// Gives a reply to the channel's oldest waiter.
    fn answer(&mut self, id: u16, reply: Result<Replied, AmqpError>) -> Result<(), AmqpError> {
        let Some(chan) = self.chan(id) else {
            return Err(self
                .inner
                .unreachable(format!("it answered on channel {id}, which is not open")));
        };
        let mut st = chan.state.lock();
        if st.closing {
            // Answers to what was sent before this side closed the channel.
            return Ok(());
        }
        match st.waiters.pop_front() {
            Some(w) => {
                let _ = w.send(reply);
                Ok(())
            }
            None => {
                drop(st);
                Err(self.inner.unreachable(format!(
                    "it answered nothing asked on channel {id}: {reply:?}"
                )))
            }
        }
    }

    /// The member closed channel `id` with `error`: its waiters fail with it, its
    /// consumers end, and close-ok goes back.
    fn closed_by_member(&mut self, id: u16, error: AmqpError) {
        self.forget(id);
        if let Some(chan) = self.inner.channel(id) {
            let closing = close_chan(&chan, &error);
            if closing {
                // Both sides closed at once: nobody else frees the number.
                self.inner.shared.lock().channels.remove(&id);
            }
        }
        self.inner.queue_control(
            id,
            AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
        );
    }

    /// Forgets what the reader held of channel `id` (it closed).
    fn forget(&mut self, id: u16) {
        self.chans.remove(&id);
        self.partial.remove(&id);
    }

    fn start_content(&mut self, id: u16, what: Content) -> Result<(), AmqpError> {
        if self.partial.contains_key(&id) {
            return Err(self.inner.unreachable(format!(
                "it sent a method on channel {id} before the content it announced"
            )));
        }
        self.partial.insert(
            id,
            Partial {
                what,
                header: None,
                body: BodyParts::default(),
            },
        );
        Ok(())
    }

    fn on_header(&mut self, id: u16, payload: Bytes) -> Result<(), AmqpError> {
        let Some(p) = self.partial.get_mut(&id) else {
            return Err(self.inner.unreachable(format!(
                "it sent a content header on channel {id} without a method"
            )));
        };
        if p.header.is_some() {
            return Err(self
                .inner
                .unreachable("it sent a second content header for one message"));
        }
        let header = match amq_protocol::frame::parsing::parse_content_header(&payload[..]) {
            Ok(([], h)) if h.class_id == 60 && h.body_size <= MAX_BODY_BYTES => h,
            _ => {
                return Err(self
                    .inner
                    .unreachable("it sent a content header this link cannot take"));
            }
        };
        let size = header.body_size;
        p.header = Some((header.properties, payload, size));
        if size == 0 {
            self.complete(id);
        }
        Ok(())
    }

    fn on_body(&mut self, id: u16, payload: Bytes) -> Result<(), AmqpError> {
        let Some(p) = self.partial.get_mut(&id) else {
            return Err(self.inner.unreachable(format!(
                "it sent a content body on channel {id} without a method"
            )));
        };
        let Some((_, _, size)) = &p.header else {
            return Err(self
                .inner
                .unreachable("it sent a content body before its header"));
        };
        let size = *size as usize;
        if p.body.len() + payload.len() > size {
            return Err(self
                .inner
                .unreachable("it sent a content body longer than announced"));
        }
        p.body.push(payload, size);
        if p.body.len() == size {
            self.complete(id);
        }
        Ok(())
    }

    /// A message is complete: a delivery goes to its consumer's batch, a get-ok to its
    /// waiter.
    fn complete(&mut self, id: u16) {
        let Some(p) = self.partial.remove(&id) else {
            return;
        };
        let Some((properties, header, _)) = p.header else {
            return;
        };
        let Some(chan) = self.chan(id) else {
            return;
        };
        let body = p.body.finish();
        match p.what {
            Content::Got { ok } => {
                let got = Message::new(ok.exchange, ok.routing_key, properties, header, body)
                    .map_err(|e| AmqpError::precondition(e.0))
                    .map(|m| {
                        Replied::Got(ProxiedGet {
                            upstream_tag: ok.delivery_tag,
                            redelivered: ok.redelivered,
                            message_count: ok.message_count,
                            message: Arc::new(m),
                        })
                    });
                let mut st = chan.state.lock();
                if !st.closing
                    && let Some(w) = st.waiters.pop_front()
                {
                    let _ = w.send(got);
                }
            }
            Content::Deliver(d) => self.deliver(&chan, d, properties, header, body),
        }
    }

    fn deliver(
        &mut self,
        chan: &Arc<Chan>,
        d: Deliver,
        properties: Properties,
        header: Bytes,
        body: Bytes,
    ) {
        let message = Message::new(d.exchange, d.routing_key, properties, header, body);
        let mut guard = chan.state.lock();
        let st = &mut *guard;
        if st.closing {
            return;
        }
        let tag = std::str::from_utf8(&d.consumer_tag).unwrap_or_default();
        let Some(sink) = st.consumers.get_mut(tag) else {
            // No such consumer (any more): back to its queue.
            drop(guard);
            self.refuse(
                chan,
                Upstreamed::Nack {
                    tag: d.delivery_tag,
                    requeue: true,
                },
            );
            return;
        };
        let message = match message {
            Ok(m) => m,
            Err(e) => {
                drop(guard);
                tracing::warn!(node = %self.inner.member, expiration = %e.0, "dropping a proxied delivery whose expiration the broker cannot take");
                self.refuse(
                    chan,
                    Upstreamed::Ack {
                        tag: d.delivery_tag,
                        multiple: false,
                    },
                );
                return;
            }
        };
        let to = &sink.to;
        sink.batch.push(ProxiedDelivery {
            channel: to.channel,
            consumer_tag: to.tag.clone(),
            serial: to.serial,
            queue: to.queue.clone(),
            primary: to.primary.clone(),
            upstream_tag: d.delivery_tag,
            redelivered: d.redelivered,
            message: Arc::new(message),
            no_ack: to.no_ack,
        });
        st.unsettled.insert(d.delivery_tag);
        if sink.batch.len() == 1 {
            self.dirty.push((chan.clone(), sink.to.tag.clone()));
        } else if sink.batch.len() >= PUMP_BATCH {
            let outbox = sink.to.outbox.clone();
            let mut batch = std::mem::take(&mut sink.batch);
            drop(guard);
            outbox.push(|p| p.proxied.append(&mut batch));
        }
    }

    /// Settles at once a delivery no client will see.
    fn refuse(&self, chan: &Chan, frame: Upstreamed) {
        let id = chan.id;
        let _ = self
            .inner
            .queue(chan, None, |w, _| w.method(id, frame.method()));
    }

    /// Hands every consumer's batched deliveries to its client connection.
    fn hand_on(&mut self) {
        for (chan, tag) in self.dirty.drain(..) {
            let taken = chan.state.lock().consumers.get_mut(&tag).and_then(|sink| {
                (!sink.batch.is_empty())
                    .then(|| (sink.to.outbox.clone(), std::mem::take(&mut sink.batch)))
            });
            if let Some((outbox, mut batch)) = taken {
                outbox.push(|p| p.proxied.append(&mut batch));
            }
        }
    }
}

/// Closes `chan` for good with `error`: nothing more is written on it, its waiters fail,
/// its consumers end. Whether this side had closed it already.
fn close_chan(chan: &Chan, error: &AmqpError) -> bool {
    let (closing, waiters, sinks) = {
        let mut st = chan.state.lock();
        st.closed.get_or_insert_with(|| error.clone());
        (
            st.closing,
            std::mem::take(&mut st.waiters),
            std::mem::take(&mut st.consumers),
        )
    };
    for w in waiters {
        let _ = w.send(Err(error.clone()));
    }
    sinks.into_values().for_each(Sink::end);
    closing
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hand_read_deliver_matches_the_encoder() {
        let mut w = FrameWriter::default();
        w.deliver(3, "ctag", 77, true, "ex", "rk");
        let frame = split_frame(&mut BytesMut::from(w.as_slice()), FRAME_MAX)
            .unwrap()
            .unwrap();
        assert_eq!(
            parse_deliver(&frame.payload),
            Some(Deliver {
                consumer_tag: Bytes::from_static(b"ctag"),
                delivery_tag: 77,
                redelivered: true,
                exchange: ShortString::from("ex"),
                routing_key: ShortString::from("rk"),
            })
        );
        let truncated = frame.payload.slice(..frame.payload.len() - 1);
        assert_eq!(parse_deliver(&truncated), None);
    }
}
