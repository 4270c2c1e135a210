//! What a queue remembers of the publishers that number their publishes, so that a publish
//! resent after a failover is not enqueued twice.
//!
//! A session's channel numbers every publish (`x-ringmq-publish-seq`) and names itself
//! (`x-ringmq-producer`: the session and the channel). The member a session lives on drops a
//! resent publish it processed already (`session::PublishState`); a member that took the
//! session over after the loss of the first one knows nothing of what that member processed.
//! The queues do: every copy of a replicated queue applies the same enqueues, so the primary
//! it fails over to knows the highest number each producer's messages reached it with. A
//! publish numbered at or below it is one the queue holds (or held: consumed since) — a
//! resend, dropped there and confirmed (`docs/sessions.md` §3).
//!
//! Numbers only grow per producer, and a queue receives one producer's publishes in order
//! (one connection, one link, a backup's gap-free op stream), so "at or below the highest"
//! is exactly "already taken".

use super::args::int_value;
use super::message::Message;
use crate::amqp::{AMQPValue, FieldTable, Properties};
use crate::core::FastHashMap;
use std::sync::Arc;

/// Message header with which a session's client numbers each publish on its channel.
pub const PUBLISH_SEQ_HEADER: &str = "x-ringmq-publish-seq";

/// Message header naming the channel that numbered the publish: `<session id>:<channel>`,
/// unique per channel of a session for the session's life.
pub const PRODUCER_HEADER: &str = "x-ringmq-producer";

/// How many producers a queue remembers. The least recently seen are forgotten past it: a
/// resend comes within a failover (seconds), and a queue with more producers than this
/// publishing into it at once is far outside what sessions are for.
pub const MAX_PRODUCERS: usize = 4096;

/// The producer and number of a numbered publish; `None` for any other message.
/// Read in place: every enqueue asks (twice on a primary), so nothing is allocated.
pub fn producer_of(message: &Message) -> Option<(&str, u64)> {
    let headers = message.properties.headers().as_ref()?.inner();
    let seq = headers.get(PUBLISH_SEQ_HEADER).and_then(int_value)?;
    let producer = match headers.get(PRODUCER_HEADER)? {
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok()?,
        AMQPValue::ShortString(s) => s.as_str(),
        _ => return None,
    };
    Some((producer, u64::try_from(seq).ok()?))
}

/// `properties` without the producer's name: a copy of a message that enters a queue by
/// another way than its producer's publish (a dead letter, a message a fragmented queue's
/// pull moves) must not count as that producer's — it arrives out of the producer's order,
/// and a later, lower-numbered publish of the producer would be taken for a resend.
pub fn without_producer(properties: Properties) -> Properties {
    let Some(headers) = properties.headers().as_ref() else {
        return properties;
    };
    if !headers.contains_key(PRODUCER_HEADER) {
        return properties;
    }
    let mut kept = FieldTable::default();
    for (k, v) in headers.inner() {
        if k.as_str() != PRODUCER_HEADER {
            kept.insert(k.clone(), v.clone());
        }
    }
    properties.with_headers(kept)
}

/// A queue's producers and the highest number each reached it with: what the journal keeps
/// of a [`Producers`] table, so that it outlives the messages (B15 in docs/reliability.md).
pub type Highest = Vec<(Arc<str>, u64)>;

/// The highest number each producer's messages reached a queue with.
#[derive(Debug, Default, Clone)]
pub struct Producers {
    /// Producer → (highest number, when it was last seen on the `seen` clock).
    latest: FastHashMap<Arc<str>, (u64, u64)>,
    /// Counts the messages noted: orders producers by how recently they published.
    seen: u64,
}

impl Producers {
    /// Whether the queue took `message` already: a numbered publish at or below its
    /// producer's highest number.
    pub fn holds(&self, message: &Message) -> bool {
        producer_of(message).is_some_and(|(producer, seq)| {
            self.latest
                .get(producer)
                .is_some_and(|&(highest, _)| seq <= highest)
        })
    }

    /// The queue took `message`: its producer's highest number goes up to its number.
    pub fn note(&mut self, message: &Message) {
        if let Some((producer, seq)) = producer_of(message) {
            self.note_number(producer, seq);
        }
    }

    /// `producer`'s messages reached the queue up to number `seq` (a message's, or a
    /// journal's table read back on recovery).
    pub fn note_number(&mut self, producer: &str, seq: u64) {
        self.seen += 1;
        let seen = self.seen;
        match self.latest.get_mut(producer) {
            Some(entry) => *entry = (entry.0.max(seq), seen),
            None => {
                self.latest.insert(producer.into(), (seq, seen));
                if self.latest.len() > MAX_PRODUCERS {
                    self.forget_oldest();
                }
            }
        }
    }

    /// Every producer of [`Self::highest`] noted (a table read back on recovery).
    pub fn note_all(&mut self, highest: &[(Arc<str>, u64)]) {
        for (producer, seq) in highest {
            self.note_number(producer, *seq);
        }
    }

    /// Each producer remembered with its highest number, least recently seen first (so
    /// that noting them in this order keeps the recency order).
    pub fn highest(&self) -> Highest {
        let mut all: Vec<(&Arc<str>, &(u64, u64))> = self.latest.iter().collect();
        all.sort_unstable_by_key(|(_, (_, seen))| *seen);
        all.into_iter()
            .map(|(producer, (seq, _))| (producer.clone(), *seq))
            .collect()
    }

    /// How many producers are remembered.
    pub fn len(&self) -> usize {
        self.latest.len()
    }

    /// Whether no producer is remembered.
    pub fn is_empty(&self) -> bool {
        self.latest.is_empty()
    }

    /// Forgets the least recently seen quarter, so that the next forgetting is
    /// `MAX_PRODUCERS / 4` new producers away.
    fn forget_oldest(&mut self) {
        let mut seen: Vec<u64> = self.latest.values().map(|&(_, s)| s).collect();
        let cut = seen.len() / 4;
        let (_, &mut threshold, _) = seen.select_nth_unstable(cut);
        self.latest.retain(|_, &mut (_, s)| s > threshold);
    }
}

/// A message published to the default exchange for queue `q` with `body`, numbered `seq`
/// by `producer` (as a session's client numbers its publishes), for the core's tests.
#[cfg(test)]
pub(crate) fn numbered(body: &'static str, producer: &str, seq: i64) -> Message {
    let mut headers = FieldTable::default();
    headers.insert(PUBLISH_SEQ_HEADER.into(), AMQPValue::LongLongInt(seq));
    headers.insert(
        PRODUCER_HEADER.into(),
        AMQPValue::LongString(producer.into()),
    );
    Message::authored(
        "".into(),
        "q".into(),
        Properties::default().with_headers(headers),
        bytes::Bytes::from_static(body.as_bytes()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn message(properties: Properties) -> Message {
        Message::authored("".into(), "q".into(), properties, Bytes::from_static(b"b"))
    }

    #[test]
    fn a_numbered_publish_at_or_below_its_producers_highest_is_held_and_others_are_not() {
        let mut p = Producers::default();
        let plain = message(Properties::default());
        p.note(&plain);
        assert!(p.is_empty() && !p.holds(&plain), "unnumbered: never held");
        p.note(&numbered("m", "s:1", 1));
        p.note(&numbered("m", "s:1", 2));
        assert!(p.holds(&numbered("m", "s:1", 1)) && p.holds(&numbered("m", "s:1", 2)));
        assert!(!p.holds(&numbered("m", "s:1", 3)), "the next one is new");
        assert!(
            !p.holds(&numbered("m", "s:2", 1)),
            "another channel counts apart"
        );
    }

    #[test]
    fn a_copy_without_its_producers_name_is_not_counted() {
        let m = numbered("m", "s:1", 7);
        let copy = message(without_producer((*m.properties).clone()));
        assert!(producer_of(&m).is_some() && producer_of(&copy).is_none());
        let mut p = Producers::default();
        p.note(&copy);
        assert!(p.is_empty());
    }

    #[test]
    fn past_the_limit_the_least_recently_seen_producers_are_forgotten() {
        let mut p = Producers::default();
        for i in 0..MAX_PRODUCERS {
            p.note(&numbered("m", &format!("s:{i}"), 1));
        }
        p.note(&numbered("m", "s:0", 2));
        p.note(&numbered("m", "new", 1));
        assert!(p.len() <= MAX_PRODUCERS);
        assert!(p.holds(&numbered("m", "s:0", 2)), "seen again: kept");
        assert!(p.holds(&numbered("m", "new", 1)));
        assert!(!p.holds(&numbered("m", "s:1", 1)), "the oldest went");
    }

    #[test]
    fn a_table_read_back_holds_what_the_queue_took_in_the_same_recency_order() {
        let mut p = Producers::default();
        p.note(&numbered("m", "a", 3));
        p.note(&numbered("m", "b", 9));
        p.note(&numbered("m", "a", 5));
        let highest = p.highest();
        assert_eq!(
            highest,
            vec![(Arc::from("b"), 9), (Arc::from("a"), 5)],
            "least recently seen first"
        );
        let mut back = Producers::default();
        back.note_all(&highest);
        assert!(back.holds(&numbered("m", "a", 5)));
        assert!(!back.holds(&numbered("m", "a", 6)));
        assert!(back.holds(&numbered("m", "b", 1)));
        assert_eq!(back.highest(), highest);
    }
}
