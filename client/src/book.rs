//! What the client remembers of one channel so that a failover can put it back exactly: the
//! publishes it may have to send again, the confirm numbering, the highest delivery tag the
//! application has seen, and what it set up (prefetch, consumers). Pure: no sockets, no
//! clock — the driver feeds it and asks it.

use crate::tags::TagMap;
use amq_protocol::protocol::basic::AMQPProperties;
use bytes::Bytes;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use tokio::sync::{mpsc, oneshot};

/// How many publishes a channel outside confirm mode keeps for a resend: the broker drops
/// those it processed already (by their number), so the log only has to reach back past what
/// was in flight when a connection broke — far less than this.
pub(crate) const RECENT_PUBLISHES: usize = 65_536;

/// How many of its settlements (acks, nacks) a channel remembers for a failover: those the
/// broker had not processed when the connection broke are sent again.
pub(crate) const RECENT_SETTLEMENTS: usize = 65_536;

/// How many settled deliveries' identities a channel keeps (besides those it holds): a
/// delivery whose settlement was lost with a member comes back from its queue, and is
/// recognised by its identity. The settlements a member loses are the few it had not passed
/// on, and those made after it died — of deliveries the application held, at most its
/// prefetch.
pub(crate) const SETTLED_IDENTITIES: usize = 4_096;

/// Past this many deliveries expected back, the oldest of those the application had settled
/// are forgotten at the next failover (see [`ChannelBook::consumer_lost`]).
pub(crate) const RETURNING_LIMIT: usize = 4 * SETTLED_IDENTITIES;

/// An application's ack or nack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Settle {
    Ack {
        tag: u64,
        multiple: bool,
    },
    Nack {
        tag: u64,
        multiple: bool,
        requeue: bool,
    },
}

/// How one delivery was settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Settled {
    Ack,
    Nack { requeue: bool },
}

/// A publish the client may have to send again after a failover.
#[derive(Debug)]
pub(crate) struct Logged {
    /// Its number on the channel (1-based, every `basic.publish` counted).
    pub seq: u64,
    pub exchange: String,
    pub routing_key: String,
    pub properties: AMQPProperties,
    pub body: Bytes,
    /// Told the outcome (ack: true) in confirm mode.
    pub outcome: Option<oneshot::Sender<bool>>,
}

/// A consumer to create again on the resumed channel, with its tag.
#[derive(Debug, Clone)]
pub(crate) struct ConsumerSpec {
    pub tag: String,
    pub queue: String,
    pub no_ack: bool,
    pub deliveries: mpsc::UnboundedSender<crate::Delivery>,
}

/// One channel's memory.
#[derive(Debug, Default)]
pub(crate) struct ChannelBook {
    /// `basic.publish` commands sent on the channel since it was opened.
    pub published: u64,
    /// `published` when `confirm.select` was sent: a publish's confirm number is its number
    /// less this.
    pub confirm_base: Option<u64>,
    /// Unconfirmed publishes in confirm mode; the most recent ones otherwise. By number.
    pub log: VecDeque<Logged>,
    /// Every delivery tag up to this one was handed to the application (or never used).
    pub seen_through: u64,
    /// Tags above `seen_through` handed to the application: after a failover the broker's
    /// new deliveries (new tags) can come before the ones it sends again (old tags), so what
    /// the application has is a prefix and a few beyond it.
    pub seen_above: BTreeSet<u64>,
    /// `basic.qos` as last set (prefetch count, global).
    pub prefetch: Option<(u16, bool)>,
    /// Consumers as created, in order.
    pub consumers: Vec<ConsumerSpec>,
    /// Deliveries handed to the application that it has not settled yet.
    pub outstanding: BTreeSet<u64>,
    /// Deliveries the application settled, the most recent ones: sent again after a
    /// failover if the broker still counts them unacknowledged.
    pub settled: BTreeMap<u64, Settled>,
    /// The application's delivery tags and the broker's (the same until the session is
    /// taken over by another member, `crate::tags`).
    pub tags: TagMap,
    /// What identifies the messages of the deliveries in `outstanding` and `recent` that
    /// have an identity, by application tag: how a delivery that returns after a takeover
    /// is recognised.
    pub identities: BTreeMap<u64, Identity>,
    /// The most recent [`SETTLED_IDENTITIES`] settlements, kept whatever a member said it
    /// processed: a member that processed a settlement may be lost before its queue's
    /// backups heard of it, and then the delivery comes back.
    pub recent: BTreeMap<u64, Settled>,
    /// Deliveries handed out before the session was taken over that will come again from
    /// their queues, by identity: hidden from the application when they do. With each, the
    /// failover ([`Self::failovers`]) that first expected it back.
    pub returning: HashMap<Identity, (Returning, u64)>,
    /// How many times [`Self::consumer_lost`] ran: the age of what `returning` expects.
    pub failovers: u64,
    /// Messages the application gave back to their queue lately (nack or reject with
    /// requeue), by identity, with the application tag they had: when one comes again it
    /// is marked `redelivered` — the broker may send it unmarked, under the flag of a
    /// delivery lost before the application's nack reached it (`docs/sessions.md` §5).
    pub requeued: HashMap<Identity, u64>,
    /// The channel's name on its publishes (`x-ringmq-producer`: `<session>:<channel>`).
    pub producer: String,
    /// Its transactions, once `tx.select` was sent.
    pub tx: Option<TxBook>,
}

/// What a transactional channel remembers so that a failover neither loses a transaction nor
/// applies one twice (`docs/sessions.md` §5).
#[derive(Debug, Default)]
pub(crate) struct TxBook {
    /// `tx.commit-ok`s since the channel was opened on the member it is on (started over at
    /// a takeover): after a resume on the same member, the session status's `commits`
    /// above this says a commit whose answer was lost went through.
    pub commits: u64,
    /// Application tags the open transaction settled.
    open_settled: Vec<u64>,
    /// Per `tx.commit` or `tx.rollback` sent and not answered, in order: the channel's
    /// publish count when it was sent (its transaction's publishes are those up to it), and
    /// the tags its transaction settled.
    ending: VecDeque<(u64, Vec<u64>)>,
}

/// What identifies a message across the members that may deliver it: its producer's name
/// and its number there, as its publish carried them.
pub(crate) type Identity = (String, u64);

/// A delivery of before a takeover that will come again from its queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Returning {
    /// The application still holds it, under this tag.
    Held(u64),
    /// The application settled it so (an ack, or a reject without requeue), and its broker
    /// may not have heard: settled again when it comes.
    Settled(Settled),
}

/// What becomes of a delivery that arrives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Arrival {
    /// New to the application: handed to it under this tag.
    New(u64),
    /// The application had it: not handed again.
    Seen,
    /// The application had it and settled it so: not handed again, and settled again under
    /// the broker's new tag.
    SettleAgain(Settle),
}

impl ChannelBook {
    /// Records a publish; returns its number.
    pub fn record_publish(&mut self, mut p: Logged) -> u64 {
        self.published += 1;
        p.seq = self.published;
        if self.confirm_base.is_none() {
            // Nothing will confirm it: kept only for a resend, the oldest going first.
            p.outcome = None;
            if self.log.len() == RECENT_PUBLISHES {
                self.log.pop_front();
            }
        }
        self.log.push_back(p);
        self.published
    }

    /// `confirm.select` is being sent.
    pub fn select_confirms(&mut self) {
        if self.confirm_base.is_none() {
            self.confirm_base = Some(self.published);
            self.log.clear();
        }
    }

    /// `tx.select` is being sent.
    pub fn select_tx(&mut self) {
        self.tx.get_or_insert_with(TxBook::default);
    }

    /// A `tx.commit` or `tx.rollback` is being sent: it ends the open transaction — the
    /// publishes sent so far and what the application settled since the last one.
    pub fn tx_ending(&mut self) {
        let published = self.published;
        if let Some(tx) = self.tx.as_mut() {
            let settled = std::mem::take(&mut tx.open_settled);
            tx.ending.push_back((published, settled));
        }
    }

    /// The oldest `tx.commit` (`committed`) or `tx.rollback` sent was answered (or, after a
    /// resume, found to have gone through): its transaction's publishes leave the log —
    /// applied or discarded, never to be sent again — and, rolled back, its settlements are
    /// undone: the deliveries are the application's again, to settle.
    pub fn tx_ended(&mut self, committed: bool) {
        let Some((through, settled)) = self.tx.as_mut().and_then(|tx| tx.ending.pop_front()) else {
            return;
        };
        while self.log.front().is_some_and(|p| p.seq <= through) {
            self.log.pop_front();
        }
        if committed {
            if let Some(tx) = self.tx.as_mut() {
                tx.commits += 1;
            }
            return;
        }
        for t in settled {
            self.settled.remove(&t);
            self.recent.remove(&t);
            self.outstanding.insert(t);
            if let Some(id) = self.identities.get(&t)
                && let Some(expected) = self.returning.get_mut(id)
                && matches!(expected.0, Returning::Settled(_))
            {
                expected.0 = Returning::Held(t);
            }
        }
    }

    /// A `basic.ack` (`ack`) or `basic.nack` for confirm number `tag` (`multiple`: and every
    /// one below it still open) from the broker: the publishes it settles leave the log and
    /// their senders learn the outcome. A confirm for a number already settled — the broker
    /// confirming a resent duplicate the client had its answer for — changes nothing.
    pub fn confirmed(&mut self, tag: u64, multiple: bool, ack: bool) {
        let Some(base) = self.confirm_base else {
            return;
        };
        let seq = base + tag;
        let settle = |p: Logged| {
            if let Some(tx) = p.outcome {
                let _ = tx.send(ack);
            }
        };
        if multiple {
            while self.log.front().is_some_and(|p| p.seq <= seq) {
                settle(self.log.pop_front().expect("checked"));
            }
        } else if let Ok(i) = self.log.binary_search_by_key(&seq, |p| p.seq)
            && let Some(p) = self.log.remove(i)
        {
            settle(p);
        }
    }

    /// The application settles deliveries: what it settles leaves the outstanding set and is
    /// remembered (the oldest forgotten past [`RECENT_SETTLEMENTS`]). Returns what to send
    /// the broker, in its tags: one `multiple` settlement for what the current connection
    /// handed out, one each for returned deliveries above it; nothing for a delivery of
    /// before a takeover that has not returned yet — it is settled when it does.
    pub fn settle(&mut self, settle: Settle) -> Vec<Settle> {
        let (tag, multiple, how) = match settle {
            Settle::Ack { tag, multiple } => (tag, multiple, Settled::Ack),
            Settle::Nack {
                tag,
                multiple,
                requeue,
            } => (tag, multiple, Settled::Nack { requeue }),
        };
        let tags: Vec<u64> = if multiple {
            self.outstanding.range(..=tag).copied().collect()
        } else {
            vec![tag]
        };
        let mut out = Vec::new();
        // One `multiple` covers what the current numbering handed out through `tag`.
        let covered = (multiple && self.tags.is_current(tag))
            .then(|| self.tags.broker(tag))
            .flatten();
        if let Some(b) = covered {
            out.push(in_broker_tag(b, true, how));
        }
        if let Some(tx) = self.tx.as_mut() {
            tx.open_settled.extend(&tags);
        }
        for t in tags {
            self.outstanding.remove(&t);
            self.settled.insert(t, how);
            self.recent.insert(t, how);
            if how == (Settled::Nack { requeue: true })
                && let Some(id) = self.identities.get(&t)
            {
                self.requeued.insert(id.clone(), t);
                if self.requeued.len() > SETTLED_IDENTITIES {
                    let cut = t.saturating_sub(SETTLED_IDENTITIES as u64);
                    self.requeued.retain(|_, tag| *tag > cut);
                }
            }
            if let Some(id) = self.identities.get(&t)
                && let Some(expected) = self.returning.get_mut(id)
                && expected.0 == Returning::Held(t)
            {
                // It will come back: settled then, under its new tag.
                if how == (Settled::Nack { requeue: true }) {
                    // Back to its queue in any case: it comes again as new.
                    self.returning.remove(id);
                } else {
                    expected.0 = Returning::Settled(how);
                }
            }
            match self.tags.broker(t) {
                Some(b) if covered.is_some_and(|c| b <= c) => {}
                Some(b) => out.push(in_broker_tag(b, false, how)),
                None => {}
            }
        }
        while self.settled.len() > RECENT_SETTLEMENTS {
            self.settled.pop_first();
        }
        while self.recent.len() > SETTLED_IDENTITIES {
            if let Some((t, _)) = self.recent.pop_first()
                && !self.outstanding.contains(&t)
            {
                self.identities.remove(&t);
            }
        }
        out
    }

    /// The application was handed delivery `tag` to settle (not a no-ack consumer's): held
    /// until it settles it, known by `identity` if its message has one.
    pub fn held(&mut self, tag: u64, identity: Option<Identity>) {
        self.outstanding.insert(tag);
        if let Some(identity) = identity {
            self.identities.insert(tag, identity);
        }
    }

    /// The broker cancelled a consumer of the channel because its queue's primary was lost:
    /// what the application holds or settled lately may come back from the queue (the new
    /// primary gives back what the old one had handed out), to the consumer created again.
    /// Recognised by its identity when it does, it is not handed out twice.
    pub fn consumer_lost(&mut self) {
        let now = self.count_failover();
        for t in &self.outstanding {
            if let Some(id) = self.identities.get(t) {
                let first = self.returning.get(id).map_or(now, |(_, since)| *since);
                self.returning
                    .insert(id.clone(), (Returning::Held(*t), first));
            }
        }
        self.expect_settled_back(now);
    }

    /// The session resumed on a member that kept its channels: what the application holds
    /// comes again under its old tags, but what it settled lately may still come back from
    /// its queue — the queue's primary may have been lost in the same failure, after it took
    /// the settlements and before its backups did, and the promoted backup gives those
    /// deliveries back to the session. Recognised by their identity, they are not handed
    /// out twice (the fault suite's `isolate-primary`: a window of 10 acked on the isolated
    /// primary came back after the resume).
    pub fn resumed(&mut self) {
        let now = self.count_failover();
        self.expect_settled_back(now);
    }

    /// One more failover: returns its number, the age of what it expects back, having
    /// forgotten the oldest expectations if too many piled up.
    fn count_failover(&mut self) -> u64 {
        self.failovers += 1;
        if self.returning.len() > RETURNING_LIMIT {
            self.forget_oldest_settled();
        }
        self.failovers
    }

    /// What the application settled lately, but for what it gave back itself, is expected
    /// back from failover `now` on.
    fn expect_settled_back(&mut self, now: u64) {
        for (t, how) in &self.recent {
            if *how != (Settled::Nack { requeue: true })
                && let Some(id) = self.identities.get(t)
            {
                self.returning
                    .entry(id.clone())
                    .or_insert((Returning::Settled(*how), now));
            }
        }
    }

    /// Settled deliveries that never came back (their settlement had reached the broker
    /// after all) pile up over many failovers: the oldest are forgotten, those of the most
    /// recent failovers and the held ones kept. (Forgetting every settled one, as at first,
    /// could also forget a window acked just before a whole-cluster restart, whose queue
    /// gives it back only when the member holding its newest copy returns — after more
    /// failovers — so that the application saw it twice: a cause that fits the rare
    /// failover-row failure in `docs/reliability.md`.)
    fn forget_oldest_settled(&mut self) {
        let mut settled: Vec<u64> = self
            .returning
            .values()
            .filter(|(r, _)| matches!(r, Returning::Settled(_)))
            .map(|(_, since)| *since)
            .collect();
        let excess = self.returning.len().saturating_sub(RETURNING_LIMIT / 2);
        if excess == 0 || settled.is_empty() {
            return;
        }
        settled.sort_unstable();
        // Whole failovers go: the newest one to forget, and every older one.
        let cut = settled[excess.min(settled.len()) - 1];
        self.returning
            .retain(|_, (r, since)| matches!(r, Returning::Held(_)) || *since > cut);
    }

    /// After a failover to the same member, with the broker tags it still counts
    /// unacknowledged on the channel: the settlements it did not get, to send again, in its
    /// tags. Those it got are forgotten.
    pub fn settle_again(&mut self, unacked_at_broker: &BTreeSet<u64>) -> Vec<Settle> {
        let at_broker: BTreeSet<u64> = unacked_at_broker
            .iter()
            .map(|&b| self.tags.app(b))
            .collect();
        self.settled.retain(|t, _| at_broker.contains(t));
        self.settled
            .iter()
            .filter_map(|(&t, &how)| Some(in_broker_tag(self.tags.broker(t)?, false, how)))
            .collect()
    }

    /// The channel resumed on a member that took the session over, where it starts with
    /// none of its state (`docs/sessions.md` §2): deliveries are numbered from 1 again (the
    /// application's tags go on above the highest it had, `crate::tags`); what the
    /// application had — held or settled — comes again from its queue, and is recognised by
    /// its identity and not handed out twice; confirms count from the client's numbering,
    /// which every publish carries.
    pub fn start_over(&mut self) {
        let highest = [
            self.seen_through,
            self.seen_above.last().copied().unwrap_or(0),
            self.outstanding.last().copied().unwrap_or(0),
            self.settled.last_key_value().map_or(0, |(t, _)| *t),
        ]
        .into_iter()
        .max()
        .unwrap_or(0);
        // What still has to come back from an earlier takeover stays expected.
        self.consumer_lost();
        // What they had is expected back now (`returning`): only the held need names.
        self.recent.clear();
        let outstanding = &self.outstanding;
        self.identities.retain(|t, _| outstanding.contains(t));
        self.tags.start_over(highest + 1);
        self.seen_through = highest;
        self.seen_above.clear();
        self.settled.clear();
        if self.confirm_base.is_some() {
            // The member numbers confirms from its confirm.select, at count 0, by the
            // client's numbers: the n-th confirm is publish n.
            self.confirm_base = Some(0);
        }
        if let Some(tx) = self.tx.as_mut() {
            // The member counts the channel's commits from its tx.select.
            tx.commits = 0;
        }
    }

    /// A delivery arrives under broker tag `broker`, of a message identified by `identity`
    /// if it has one: new to the application, or one it had (a redelivery after a resume on
    /// the same member, or a delivery of before a takeover returning from its queue).
    pub fn arrival(&mut self, broker: u64, identity: Option<&Identity>) -> Arrival {
        if self.tags.was_returned(broker) {
            return Arrival::Seen;
        }
        if self.tags.is_new(broker)
            && let Some((r, _)) = identity.and_then(|id| self.returning.remove(id))
        {
            return match r {
                Returning::Held(app) => {
                    self.tags.returned(broker, Some(app));
                    Arrival::Seen
                }
                Returning::Settled(how) => {
                    self.tags.returned(broker, None);
                    Arrival::SettleAgain(in_broker_tag(broker, false, how))
                }
            };
        }
        let app = self.tags.app(broker);
        if self.fresh_delivery(app) {
            Arrival::New(app)
        } else {
            Arrival::Seen
        }
    }

    /// The `redelivered` flag the application is shown for a new delivery that came with
    /// `flag`: set for a message it gave back to its queue itself (see [`Self::requeued`]).
    pub fn redelivered(&mut self, identity: Option<&Identity>, flag: bool) -> bool {
        let requeued = !self.requeued.is_empty()
            && identity.is_some_and(|id| self.requeued.remove(id).is_some());
        flag || requeued
    }

    /// Whether a delivery with application tag `tag` is new to the application (and, if
    /// so, remembers it).
    fn fresh_delivery(&mut self, tag: u64) -> bool {
        if tag <= self.seen_through || !self.seen_above.insert(tag) {
            return false;
        }
        while self.seen_above.remove(&(self.seen_through + 1)) {
            self.seen_through += 1;
        }
        // A tag that never comes (used by something else) must not let the set grow without
        // bound: past the limit, the oldest gap is taken as closed.
        while self.seen_above.len() > RECENT_SETTLEMENTS {
            if let Some(first) = self.seen_above.pop_first() {
                self.seen_through = first;
            }
        }
        true
    }
}

/// A settlement of broker tag `tag`.
fn in_broker_tag(tag: u64, multiple: bool, how: Settled) -> Settle {
    match how {
        Settled::Ack => Settle::Ack { tag, multiple },
        Settled::Nack { requeue } => Settle::Nack {
            tag,
            multiple,
            requeue,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logged(outcome: Option<oneshot::Sender<bool>>) -> Logged {
        Logged {
            seq: 0,
            exchange: String::new(),
            routing_key: "q".into(),
            properties: AMQPProperties::default(),
            body: Bytes::from_static(b"x"),
            outcome,
        }
    }

    #[test]
    fn confirms_settle_by_number_from_the_select_and_a_repeat_changes_nothing() {
        let mut b = ChannelBook::default();
        b.record_publish(logged(None));
        b.select_confirms();
        assert!(
            b.log.is_empty(),
            "what came before confirm mode is not resent"
        );
        let mut rx = Vec::new();
        for _ in 0..4 {
            let (tx, r) = oneshot::channel();
            b.record_publish(logged(Some(tx)));
            rx.push(r);
        }
        b.confirmed(2, true, true);
        b.confirmed(4, false, false);
        assert_eq!(b.log.iter().map(|p| p.seq).collect::<Vec<_>>(), [4]);
        b.confirmed(1, false, true);
        assert_eq!(b.log.len(), 1, "a repeated confirm settles nothing new");
        b.confirmed(3, false, true);
        assert!(b.log.is_empty());
        let got: Vec<bool> = rx.into_iter().map(|mut r| r.try_recv().unwrap()).collect();
        assert_eq!(got, [true, true, true, false]);
    }

    #[test]
    fn without_confirms_only_the_most_recent_publishes_are_kept() {
        let mut b = ChannelBook::default();
        for _ in 0..RECENT_PUBLISHES + 3 {
            b.record_publish(logged(None));
        }
        assert_eq!(b.log.len(), RECENT_PUBLISHES);
        assert_eq!(b.log.front().map(|p| p.seq), Some(4));
    }

    #[test]
    fn settlements_the_broker_still_misses_are_sent_again_and_the_rest_forgotten() {
        let mut b = ChannelBook::default();
        b.outstanding.extend([1, 2, 3, 4, 5]);
        b.settle(Settle::Ack {
            tag: 2,
            multiple: true,
        });
        b.settle(Settle::Nack {
            tag: 4,
            multiple: false,
            requeue: true,
        });
        assert_eq!(b.outstanding.iter().copied().collect::<Vec<_>>(), [3, 5]);
        let again = b.settle_again(&BTreeSet::from([2, 3, 4, 5]));
        assert_eq!(
            again,
            [
                Settle::Ack {
                    tag: 2,
                    multiple: false
                },
                Settle::Nack {
                    tag: 4,
                    multiple: false,
                    requeue: true
                }
            ],
            "1 reached the broker; 3 and 5 are the application's still"
        );
        assert_eq!(b.settled.len(), 2);
    }

    #[test]
    fn a_delivery_the_application_had_is_hidden_and_one_it_missed_is_not_whatever_the_order() {
        let mut b = ChannelBook::default();
        assert!(b.fresh_delivery(1) && b.fresh_delivery(2));
        assert!(!b.fresh_delivery(2) && !b.fresh_delivery(1));
        // After a failover: a new delivery (7) before the resent ones (3..=6, 3 seen).
        assert!(b.fresh_delivery(3));
        assert!(b.fresh_delivery(7));
        assert!(!b.fresh_delivery(3), "seen before the failover");
        assert!(b.fresh_delivery(4) && b.fresh_delivery(5) && b.fresh_delivery(6));
        assert!(!b.fresh_delivery(7));
        assert_eq!((b.seen_through, b.seen_above.len()), (7, 0));
    }

    fn id(n: u64) -> Identity {
        ("s:1".to_owned(), n)
    }

    fn ack(tag: u64, multiple: bool) -> Settle {
        Settle::Ack { tag, multiple }
    }

    /// Broker tag `broker` delivers message `n`; the application holds it if it is new.
    fn deliver(b: &mut ChannelBook, broker: u64, n: u64) -> Arrival {
        let arrival = b.arrival(broker, Some(&id(n)));
        if let Arrival::New(tag) = arrival {
            b.held(tag, Some(id(n)));
        }
        arrival
    }

    #[test]
    fn after_a_resume_a_delivery_the_application_acked_that_its_queue_gives_back_is_acked_again() {
        // The application acked messages 1 and 2 on the queue's primary, which was lost
        // before its backups had the acks; the session resumed on a member that kept its
        // channel (tags go on), and the promoted backup gives the two back under new tags.
        let mut b = ChannelBook::default();
        assert_eq!(deliver(&mut b, 1, 1), Arrival::New(1));
        assert_eq!(deliver(&mut b, 2, 2), Arrival::New(2));
        b.settle(ack(2, true));
        b.resumed();
        assert_eq!(deliver(&mut b, 3, 1), Arrival::SettleAgain(ack(3, false)));
        assert_eq!(deliver(&mut b, 4, 2), Arrival::SettleAgain(ack(4, false)));
        // What comes next is new, and takes the next application tag.
        assert_eq!(deliver(&mut b, 5, 3), Arrival::New(3));
    }

    #[test]
    fn a_message_the_application_requeued_comes_again_marked_redelivered() {
        let mut b = ChannelBook::default();
        assert_eq!(deliver(&mut b, 1, 1), Arrival::New(1));
        assert_eq!(deliver(&mut b, 2, 2), Arrival::New(2));
        b.settle(Settle::Nack {
            tag: 1,
            multiple: false,
            requeue: true,
        });
        b.settle(ack(2, false));
        // Message 1 comes again unmarked: a held message back under the flag of a delivery
        // lost before the nack reached the broker.
        assert_eq!(deliver(&mut b, 3, 1), Arrival::New(3));
        assert!(b.redelivered(Some(&id(1)), false));
        assert!(!b.redelivered(Some(&id(1)), false), "once");
        assert!(!b.redelivered(Some(&id(2)), false), "acked, not requeued");
        assert!(b.redelivered(None, true), "the broker's mark stays");
    }

    #[test]
    fn a_channel_started_over_keeps_the_application_tags_going_and_confirms_by_client_numbers() {
        let mut b = ChannelBook::default();
        b.select_confirms();
        for n in 1..=5 {
            assert_eq!(deliver(&mut b, n, n), Arrival::New(n));
        }
        assert_eq!(b.settle(ack(2, true)), [ack(2, true)]);
        // The ack of 3 is lost with the member; the application holds 4 and 5.
        assert_eq!(b.settle(ack(3, false)), [ack(3, false)]);
        b.start_over();
        assert!(b.settled.is_empty(), "nothing of before is the broker's");
        // The new member sends 3 again, then 4, a message the application never had (6),
        // 5, and a new one.
        assert_eq!(deliver(&mut b, 1, 3), Arrival::SettleAgain(ack(1, false)));
        assert_eq!(deliver(&mut b, 2, 4), Arrival::Seen);
        assert_eq!(deliver(&mut b, 3, 6), Arrival::New(6), "no gap");
        // The application acks 5 before it returns: acked when it does.
        assert_eq!(b.settle(ack(5, false)), []);
        assert_eq!(deliver(&mut b, 4, 5), Arrival::SettleAgain(ack(4, false)));
        assert_eq!(deliver(&mut b, 5, 7), Arrival::New(7));
        assert_eq!(
            deliver(&mut b, 2, 4),
            Arrival::Seen,
            "sent again: still seen"
        );
        assert_eq!(
            b.settle(ack(7, true)),
            [ack(5, true)],
            "4 (broker 2), 6 and 7 in one, in the broker's tags"
        );
        assert!(b.outstanding.is_empty());
        let (tx, mut rx) = oneshot::channel();
        let seq = b.record_publish(logged(Some(tx)));
        b.confirmed(seq, false, true);
        assert_eq!(rx.try_recv(), Ok(true), "confirm n is publish n");
    }

    #[test]
    fn what_a_lost_consumer_had_is_not_handed_out_again_by_the_consumer_created_again() {
        let mut b = ChannelBook::default();
        for n in 1..=3 {
            assert_eq!(deliver(&mut b, n, n), Arrival::New(n));
        }
        assert_eq!(
            b.settle(ack(1, false)),
            [ack(1, false)],
            "lost with the primary"
        );
        b.consumer_lost();
        assert_eq!(
            b.settle(ack(2, false)),
            [ack(2, false)],
            "sent to the member, which has nowhere to pass it"
        );
        // The new primary gives 1, 2 and 3 back, on the same channel's numbering.
        assert_eq!(deliver(&mut b, 4, 1), Arrival::SettleAgain(ack(4, false)));
        assert_eq!(deliver(&mut b, 5, 2), Arrival::SettleAgain(ack(5, false)));
        assert_eq!(deliver(&mut b, 6, 3), Arrival::Seen);
        assert_eq!(deliver(&mut b, 7, 4), Arrival::New(4), "no gap");
        assert_eq!(b.settle(ack(3, false)), [ack(6, false)], "the alias");
        assert_eq!(b.settle(ack(4, false)), [ack(7, false)]);
    }

    #[test]
    fn an_ack_a_member_processed_but_lost_is_settled_again_when_its_delivery_comes_back() {
        let mut b = ChannelBook::default();
        assert_eq!(deliver(&mut b, 1, 1), Arrival::New(1));
        b.settle(ack(1, false));
        // A resume on the same member, which had processed the ack: nothing to send again.
        assert!(b.settle_again(&BTreeSet::new()).is_empty());
        // That member is lost before the queue's backups heard of the ack.
        b.start_over();
        assert_eq!(deliver(&mut b, 1, 1), Arrival::SettleAgain(ack(1, false)));
    }

    #[test]
    fn a_returned_delivery_that_arrives_after_a_new_one_is_settled_on_its_own() {
        let mut b = ChannelBook::default();
        for n in 1..=2 {
            assert_eq!(deliver(&mut b, n, n), Arrival::New(n));
        }
        b.start_over();
        assert_eq!(deliver(&mut b, 1, 9), Arrival::New(3));
        assert_eq!(deliver(&mut b, 2, 2), Arrival::Seen);
        assert_eq!(
            b.settle(ack(3, true)),
            [ack(1, true), ack(2, false)],
            "1 and 3 (broker 1) in one; 2 came back after, as broker 2"
        );
        assert!(b.returning.contains_key(&id(1)), "1 has not come back yet");
        assert_eq!(deliver(&mut b, 3, 1), Arrival::SettleAgain(ack(3, false)));
    }

    #[test]
    fn a_window_acked_before_many_failovers_is_still_recognised_when_it_comes_back() {
        let mut b = ChannelBook::default();
        // The window the application acked just before the whole cluster went down.
        for n in 1..=10 {
            assert_eq!(deliver(&mut b, n, n), Arrival::New(n));
        }
        b.settle(ack(10, true));
        b.start_over();
        // Earlier takeovers left many settled deliveries that never came back …
        for stale in 0..(RETURNING_LIMIT as u64 + 10) {
            b.returning
                .insert(id(1_000_000 + stale), (Returning::Settled(Settled::Ack), 0));
        }
        // … and the client fails over a few times more while the queue is unavailable.
        for _ in 0..3 {
            b.start_over();
        }
        assert!(b.returning.len() <= RETURNING_LIMIT, "bounded");
        // The member with the queue's newest copy returns: the window comes back.
        for n in 1..=10 {
            assert!(
                matches!(deliver(&mut b, n, n), Arrival::SettleAgain(_)),
                "{n} was the application's already"
            );
        }
        assert_eq!(deliver(&mut b, 11, 11), Arrival::New(11), "no gap");
    }
}
