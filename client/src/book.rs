//! What the client remembers of one channel so that a failover can put it back exactly: the
//! publishes it may have to send again, the confirm numbering, the highest delivery tag the
//! application has seen, and what it set up (prefetch, consumers). Pure: no sockets, no
//! clock — the driver feeds it and asks it.

use amq_protocol::protocol::basic::AMQPProperties;
use bytes::Bytes;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use tokio::sync::{mpsc, oneshot};

/// How many publishes a channel outside confirm mode keeps for a resend: the broker drops
/// those it processed already (by their number), so the log only has to reach back past what
/// was in flight when a connection broke — far less than this.
pub(crate) const RECENT_PUBLISHES: usize = 65_536;

/// How many of its settlements (acks, nacks) a channel remembers for a failover: those the
/// broker had not processed when the connection broke are sent again.
pub(crate) const RECENT_SETTLEMENTS: usize = 65_536;

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
    /// The application's delivery tag for the broker's tag `t` is `t + tag_offset`: zero
    /// until the channel resumes on a member that took the session over and numbers its
    /// deliveries from 1 again ([`ChannelBook::start_over`]); the application's tags go on.
    /// Every tag above is the application's.
    pub tag_offset: u64,
    /// Number every publish (`x-ringmq-publish-seq`), not only the resent ones: a channel
    /// started over on another member takes its numbering from the client's.
    pub number_all: bool,
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
    /// remembered (the oldest forgotten past [`RECENT_SETTLEMENTS`]).
    pub fn settle(&mut self, settle: Settle) {
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
        for t in tags {
            self.outstanding.remove(&t);
            self.settled.insert(t, how);
        }
        while self.settled.len() > RECENT_SETTLEMENTS {
            self.settled.pop_first();
        }
    }

    /// After a failover, with the tags the broker still counts unacknowledged on the
    /// channel: the settlements it did not get, to send again. Those it got are forgotten.
    pub fn settle_again(&mut self, unacked_at_broker: &BTreeSet<u64>) -> Vec<(u64, Settled)> {
        self.settled.retain(|t, _| unacked_at_broker.contains(t));
        self.settled.iter().map(|(t, s)| (*t, *s)).collect()
    }

    /// The channel resumed on a member that took the session over, where it starts with
    /// none of its state (`docs/sessions.md` §2): deliveries are numbered from 1 again (the
    /// application's tags go on above the highest it had), what the application had not
    /// settled is no longer the broker's to settle (it went back to its queue and comes again,
    /// redelivered), confirms count from the client's numbering, which every publish carries
    /// from now on.
    pub fn start_over(&mut self) {
        let highest = [
            self.tag_offset,
            self.seen_through,
            self.seen_above.last().copied().unwrap_or(0),
            self.outstanding.last().copied().unwrap_or(0),
            self.settled.last_key_value().map_or(0, |(t, _)| *t),
        ]
        .into_iter()
        .max()
        .unwrap_or(0);
        self.tag_offset = highest;
        self.seen_through = highest;
        self.seen_above.clear();
        self.settled.clear();
        if self.confirm_base.is_some() {
            // The member numbers confirms from its confirm.select, at count 0, by the
            // client's numbers: the n-th confirm is publish n.
            self.confirm_base = Some(0);
        }
        self.number_all = true;
    }

    /// The broker's form of an application's settlement: its tag less the offset; `None` for
    /// one that names only deliveries from before the channel started over (their broker
    /// lost them to their queues).
    pub fn to_broker(&self, settle: Settle) -> Option<Settle> {
        let tag = match settle {
            Settle::Ack { tag, .. } | Settle::Nack { tag, .. } => tag,
        };
        let tag = tag.checked_sub(self.tag_offset).filter(|&t| t > 0)?;
        Some(match settle {
            Settle::Ack { multiple, .. } => Settle::Ack { tag, multiple },
            Settle::Nack {
                multiple, requeue, ..
            } => Settle::Nack {
                tag,
                multiple,
                requeue,
            },
        })
    }

    /// Whether a delivery with `tag` is new to the application (and, if so, remembers it).
    pub fn fresh_delivery(&mut self, tag: u64) -> bool {
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
            [(2, Settled::Ack), (4, Settled::Nack { requeue: true })],
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

    #[test]
    fn a_channel_started_over_keeps_the_application_tags_going_and_confirms_by_client_numbers() {
        let mut b = ChannelBook::default();
        b.select_confirms();
        for tag in 1..=5 {
            assert!(b.fresh_delivery(tag));
        }
        b.outstanding.extend([4, 5]);
        b.settle(Settle::Ack {
            tag: 3,
            multiple: false,
        });
        b.start_over();
        assert_eq!(b.tag_offset, 5);
        assert!(b.settled.is_empty(), "nothing of before is the broker's");
        assert_eq!(
            b.to_broker(Settle::Ack {
                tag: 4,
                multiple: false
            }),
            None,
            "a delivery the broker gave back to its queue"
        );
        assert_eq!(
            b.to_broker(Settle::Ack {
                tag: 7,
                multiple: true
            }),
            Some(Settle::Ack {
                tag: 2,
                multiple: true
            })
        );
        assert!(b.fresh_delivery(1 + b.tag_offset), "the broker's tag 1");
        let (tx, mut rx) = oneshot::channel();
        let seq = b.record_publish(logged(Some(tx)));
        b.confirmed(seq, false, true);
        assert_eq!(rx.try_recv(), Ok(true), "confirm n is publish n");
        assert!(b.number_all);
    }
}
