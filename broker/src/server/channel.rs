//! The connection-side half of a channel: assembling published content from its frames,
//! publisher confirms and transactions. Consumer state lives in the vhost core.

use crate::core::{ChannelKey, Message};
use crate::proxy::forward::ForwardFate;
use crate::session::PublishState;
use bytes::{Bytes, BytesMut};
use std::sync::Arc;

/// A publish whose content is still arriving.
#[derive(Debug)]
pub struct PendingPublish {
    /// Exchange named by basic.publish, as it was decoded (it moves into the message).
    pub exchange: crate::amqp::ShortString,
    /// Routing key, likewise.
    pub routing_key: crate::amqp::ShortString,
    /// Mandatory flag.
    pub mandatory: bool,
    /// The content header, once it came: decoded properties, raw payload and body size.
    pub header: Option<(Box<crate::amqp::Properties>, Bytes, u64)>,
    /// Body frames so far.
    pub body: BodyParts,
}

/// Body frames of one message: one frame stays a zero-copy slice, more are joined once.
#[derive(Debug, Default)]
pub enum BodyParts {
    /// Nothing yet.
    #[default]
    Empty,
    /// One frame.
    One(Bytes),
    /// Several frames, joined.
    Many(BytesMut),
}

impl BodyParts {
    /// Bytes received so far.
    pub fn len(&self) -> usize {
        match self {
            BodyParts::Empty => 0,
            BodyParts::One(b) => b.len(),
            BodyParts::Many(b) => b.len(),
        }
    }

    /// True before the first body frame.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Adds a frame.
    pub fn push(&mut self, part: Bytes, expected_total: usize) {
        *self = match std::mem::take(self) {
            BodyParts::Empty => BodyParts::One(part),
            BodyParts::One(first) => {
                let mut joined = BytesMut::with_capacity(expected_total);
                joined.extend_from_slice(&first);
                joined.extend_from_slice(&part);
                BodyParts::Many(joined)
            }
            BodyParts::Many(mut joined) => {
                joined.extend_from_slice(&part);
                BodyParts::Many(joined)
            }
        };
    }

    /// The whole body.
    pub fn finish(self) -> Bytes {
        match self {
            BodyParts::Empty => Bytes::new(),
            BodyParts::One(b) => b,
            BodyParts::Many(b) => b.freeze(),
        }
    }
}

/// A publish held back by a transaction until tx.commit.
#[derive(Debug)]
pub struct HeldPublish {
    /// Exchange.
    pub exchange: String,
    /// Routing key.
    pub routing_key: String,
    /// Mandatory flag.
    pub mandatory: bool,
    /// The message.
    pub message: Arc<Message>,
}

/// An acknowledgement held back by a transaction.
#[derive(Debug, Clone, Copy)]
pub enum HeldAck {
    /// basic.ack.
    Ack {
        /// Delivery tag.
        tag: u64,
        /// Multiple flag.
        multiple: bool,
    },
    /// basic.nack / basic.reject.
    Nack {
        /// Delivery tag.
        tag: u64,
        /// Multiple flag.
        multiple: bool,
        /// Requeue flag.
        requeue: bool,
    },
}

/// Work held by a transactional channel.
#[derive(Debug, Default)]
pub struct Transaction {
    /// Publishes in order.
    pub publishes: Vec<HeldPublish>,
    /// Acks in order.
    pub acks: Vec<HeldAck>,
}

/// Connection-side state of an open channel.
#[derive(Debug)]
pub struct ChannelCtx {
    /// The channel's key in the vhost.
    pub key: ChannelKey,
    /// The broker sent channel.close and waits for close-ok; everything else is dropped.
    pub closing: bool,
    /// While closing, the client's own channel.close crossed the broker's and was answered
    /// with close-ok: the channel is still the client's to finish with close-ok, but a
    /// client that reopens it instead has evidently finished with it.
    pub crossing_close_answered: bool,
    /// Content being assembled.
    pub pending: Option<PendingPublish>,
    /// Confirms decided since the last flush: (sequence number, ack?).
    pub confirms: Vec<(u64, bool)>,
    /// On a member's link: the publishes nacked because they reached a queue sealed for a
    /// planned move ([`crate::core::vhost::PublishOutcome::Moving`]), whose nack says
    /// `requeue` until it is written.
    pub moving: std::collections::BTreeSet<u64>,
    /// Publishes whose confirm waits for the primaries they were forwarded to, and every
    /// later publish of the channel (confirms go out in publish order, so that a `multiple`
    /// ack never covers a publish still undecided).
    pub awaiting: std::collections::VecDeque<AwaitingConfirm>,
    /// On a session's channel without confirms: the publishes (and committed transactions)
    /// forwarded to other members' primaries that no primary has answered yet. A session
    /// kept while one is unanswered (or failed) counts the channel's publishes processed
    /// only up to before it, and its commits only up to before its transaction, so that the
    /// client sends it and every later one again (the queues drop what they took by producer
    /// and number) — counted processed, a publish lost with its forward would be lost for
    /// good, and a commit counted would tell the client its transaction went through.
    pub unanswered_forwards: std::collections::VecDeque<UnansweredForward>,
    /// tx.select was sent.
    pub tx: Option<Transaction>,
    /// Name of the queue declared last on this channel (the spec's empty-name shortcut).
    pub last_queue: Option<String>,
    /// Its publish count, confirm mode (and so confirm numbers), transactional mode and recent
    /// nacks: what a session keeps of the channel when the connection goes
    /// (`docs/sessions.md`).
    pub publishing: PublishState,
}

impl ChannelCtx {
    /// A freshly opened channel.
    pub fn new(key: ChannelKey) -> Self {
        Self {
            key,
            closing: false,
            crossing_close_answered: false,
            pending: None,
            confirms: Vec::new(),
            moving: std::collections::BTreeSet::new(),
            awaiting: std::collections::VecDeque::new(),
            unanswered_forwards: std::collections::VecDeque::new(),
            tx: None,
            last_queue: None,
            publishing: PublishState::default(),
        }
    }

    /// A session's channel opened again on a new connection, with the publishing it had:
    /// still in confirm mode (numbering on: it is the publish count's) or transactional.
    pub fn resumed(key: ChannelKey, publishing: PublishState) -> Self {
        let mut ch = Self::new(key);
        if publishing.transactional {
            ch.tx = Some(Transaction::default());
        }
        ch.publishing = publishing;
        ch
    }

    /// The publishing a session keeps of this channel as its connection goes: confirms
    /// decided but never written count with their outcome, and any still waiting for a
    /// primary have an unknown fate (a resend of one is routed again). An open transaction
    /// is dropped uncounted.
    pub fn publish_state(&self) -> PublishState {
        let mut p = self.publishing.clone();
        for &(seq, ack) in &self.confirms {
            if !ack {
                p.record_nack(seq);
            }
        }
        for waiting in &self.awaiting {
            if waiting.accepted {
                p.record_unknown(waiting.seq);
            } else {
                p.record_nack(waiting.seq);
            }
        }
        p
    }

    /// Resolves the spec's shortcut: an empty queue name means the last declared one.
    pub fn queue_name(&self, name: &str) -> Option<String> {
        if name.is_empty() {
            self.last_queue.clone()
        } else {
            Some(name.to_owned())
        }
    }

    /// Forgets the unconfirmed forwarded publishes every forward of which was answered by
    /// `answered_through`, stopping at the first whose forwards include the first that
    /// failed (`failed`): that one and every later stay unanswered.
    pub fn prune_unanswered_forwards(&mut self, answered_through: u64, failed: Option<u64>) {
        while let Some(&UnansweredForward { last, .. }) = self.unanswered_forwards.front() {
            if last > answered_through || failed.is_some_and(|f| f <= last) {
                break;
            }
            self.unanswered_forwards.pop_front();
        }
    }

    /// What a session keeps of the channel ([`ChannelCtx::publish_state`]), with its publish
    /// and commit counts cut to before the first forwarded publish no primary answered (see
    /// [`ChannelCtx::unanswered_forwards`]; prune them first).
    pub fn kept_publish_state(&self) -> PublishState {
        let mut state = self.publish_state();
        if let Some(first) = self.unanswered_forwards.front() {
            state.published = state.published.min(first.number - 1);
            state.commits = state.commits.min(first.commits_before);
        }
        state
    }

    /// Records the confirm of publish `seq`: decided now (`accepted`) unless it was
    /// forwarded (`forwards`, the first and last of its forwards' numbers) or an earlier one
    /// still waits.
    pub fn confirm_publish(&mut self, seq: u64, accepted: bool, forwards: Option<(u64, u64)>) {
        if forwards.is_none() && self.awaiting.is_empty() {
            self.confirms.push((seq, accepted));
        } else {
            self.awaiting.push_back(AwaitingConfirm {
                seq,
                accepted,
                forwards,
            });
        }
    }

    /// Decides the waiting confirms, in order, whose forwards were all answered by
    /// `answered_through`: an ack unless the publish was refused here or by a primary
    /// (`fate(first, last)`). One whose forward failed has an unknown fate and is not
    /// decided, nor anything after it: no confirm at all — the connection closes with 320
    /// and its client sends them again (a nack would tell the application "not taken",
    /// which may be untrue). Returns how many it decided.
    pub fn decide_awaiting(
        &mut self,
        answered_through: u64,
        mut fate: impl FnMut(u64, u64) -> ForwardFate,
    ) -> usize {
        let mut decided = 0;
        while let Some(front) = self.awaiting.front() {
            let ack = match front.forwards {
                Some((_, last)) if last > answered_through => break,
                Some((first, last)) => match fate(first, last) {
                    ForwardFate::Taken => front.accepted,
                    ForwardFate::Refused => false,
                    // Never decided: the connection gives up on it and everything after it
                    // (a 320), and a session keeps them as unknown (`publish_state`).
                    ForwardFate::Unknown => break,
                },
                None => front.accepted,
            };
            self.confirms.push((front.seq, ack));
            self.awaiting.pop_front();
            decided += 1;
        }
        decided
    }

    /// Takes the confirms decided so far as (delivery-tag, multiple, ack?) frames: runs of
    /// acks on consecutive numbers collapse into one `multiple` ack (a resent duplicate's
    /// confirm, out of the sequence, stands alone). Nacks are remembered for a session.
    pub fn take_confirms(&mut self, out: &mut Vec<(u64, bool, bool)>) {
        let mut run_end: Option<u64> = None;
        let mut run_len = 0;
        for &(seq, ack) in &self.confirms {
            if ack {
                if run_end.is_some_and(|end| end + 1 != seq) {
                    let end = run_end.take().expect("checked");
                    out.push((end, run_len > 1, true));
                    run_len = 0;
                }
                run_end = Some(seq);
                run_len += 1;
            } else {
                if let Some(end) = run_end.take() {
                    out.push((end, run_len > 1, true));
                }
                run_len = 0;
                out.push((seq, false, false));
                self.publishing.record_nack(seq);
            }
        }
        if let Some(end) = run_end {
            out.push((end, run_len > 1, true));
        }
        self.confirms.clear();
    }
}

/// A session channel's publish without a confirm (or a committed transaction's first
/// publish) that was forwarded to another member's primary and not answered yet
/// ([`ChannelCtx::unanswered_forwards`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnansweredForward {
    /// The (first) publish's number on the channel.
    pub number: u64,
    /// The last of its forwards' numbers (the connection's forward tracker).
    pub last: u64,
    /// The channel's commit count before it: a transaction's commit stays uncounted until
    /// its forwards are answered.
    pub commits_before: u64,
}

/// A publisher confirm that waits for the primaries its publish was forwarded to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AwaitingConfirm {
    /// The publish's sequence number (its confirm's delivery tag).
    pub seq: u64,
    /// Whether this member accepted it (false: refused here, a nack whatever the primaries say).
    pub accepted: bool,
    /// The first and last number of its forwards in the connection's forward tracker.
    pub forwards: Option<(u64, u64)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forwarded_confirms_wait_in_publish_order_and_a_refused_forward_is_a_nack() {
        let mut ch = ChannelCtx::new(ChannelKey {
            conn: 1,
            channel: 1,
        });
        ch.confirm_publish(1, true, None);
        ch.confirm_publish(2, true, Some((1, 2)));
        ch.confirm_publish(3, true, None);
        ch.confirm_publish(4, true, Some((3, 3)));
        assert_eq!(
            ch.confirms,
            vec![(1, true)],
            "only what precedes the first forward"
        );
        let taken = |_, _| ForwardFate::Taken;
        assert_eq!(ch.decide_awaiting(1, taken), 0, "forward 2 is out");
        let refused = |first, _| match first {
            1 => ForwardFate::Refused,
            _ => ForwardFate::Taken,
        };
        assert_eq!(ch.decide_awaiting(2, refused), 2);
        assert_eq!(ch.confirms, vec![(1, true), (2, false), (3, true)]);
        assert_eq!(ch.decide_awaiting(3, taken), 1);
        assert_eq!(ch.confirms.last(), Some(&(4, true)));
        ch.confirm_publish(5, false, None);
        assert_eq!(
            ch.confirms.last(),
            Some(&(5, false)),
            "nothing waits: decided at once"
        );
    }

    #[test]
    fn a_failed_forward_leaves_its_publish_and_the_later_ones_unknown_and_unconfirmed() {
        let mut ch = ChannelCtx::new(ChannelKey {
            conn: 1,
            channel: 1,
        });
        ch.publishing.confirm_base = Some(0);
        ch.confirm_publish(1, true, Some((1, 1)));
        ch.confirm_publish(2, true, Some((2, 2)));
        assert_eq!(ch.decide_awaiting(2, |_, _| ForwardFate::Unknown), 0);
        let mut out = Vec::new();
        ch.take_confirms(&mut out);
        assert!(out.is_empty(), "no confirm for an unknown fate");
        let kept = ch.publish_state();
        assert_eq!(kept.unknown, [1, 2]);
        assert!(kept.nacks.is_empty());
        let mut kept = kept;
        assert!(
            kept.retry_unknown(2) && !kept.retry_unknown(2),
            "retried once"
        );
    }

    #[test]
    fn runs_of_acks_collapse_and_nacks_stay_single() {
        let mut ch = ChannelCtx::new(ChannelKey {
            conn: 1,
            channel: 1,
        });
        ch.confirms = vec![
            (1, true),
            (2, true),
            (3, false),
            (4, true),
            (5, true),
            (6, true),
        ];
        let mut out = Vec::new();
        ch.take_confirms(&mut out);
        assert_eq!(
            out,
            vec![(2, true, true), (3, false, false), (6, true, true)]
        );
        ch.confirms = vec![(7, true)];
        out.clear();
        ch.take_confirms(&mut out);
        assert_eq!(out, vec![(7, false, true)]);
        assert_eq!(ch.publishing.nacks, [3], "the nack is remembered");
    }

    #[test]
    fn a_resent_duplicates_confirm_out_of_sequence_stands_alone() {
        let mut ch = ChannelCtx::new(ChannelKey {
            conn: 1,
            channel: 1,
        });
        ch.confirms = vec![(2, true), (9, true), (10, true)];
        let mut out = Vec::new();
        ch.take_confirms(&mut out);
        assert_eq!(
            out,
            vec![(2, false, true), (10, true, true)],
            "an ack of 9 and 10 as one multiple ack of 10 would also cover 3..=8"
        );
    }

    #[test]
    fn a_resumed_channel_goes_on_numbering_and_a_kept_state_counts_unsent_nacks_and_unknowns() {
        let key = ChannelKey {
            conn: 1,
            channel: 3,
        };
        let mut ch = ChannelCtx::resumed(
            key,
            PublishState {
                published: 12,
                confirm_base: Some(2),
                ..PublishState::default()
            },
        );
        assert!(ch.publishing.confirming() && ch.tx.is_none());
        let mut next = ch.publishing.clone();
        assert_eq!(
            next.count_publish(),
            Some(11),
            "confirm numbers go on from 10"
        );
        ch.confirms = vec![(11, false)];
        ch.awaiting.push_back(AwaitingConfirm {
            seq: 12,
            accepted: true,
            forwards: Some((1, 1)),
        });
        let kept = ch.publish_state();
        assert_eq!(kept.nacks, [11], "an unsent nack counts");
        assert_eq!(
            kept.unknown,
            [12],
            "one still waiting for its primary is unknown"
        );
        assert_eq!(kept.confirm_of(13), Some((11, false)));
        assert_eq!(kept.confirm_of(9), Some((7, true)));
        assert_eq!(kept.confirm_of(2), None, "sent before confirm.select");
        let tx = ChannelCtx::resumed(
            key,
            PublishState {
                transactional: true,
                ..PublishState::default()
            },
        );
        assert!(tx.tx.is_some() && !tx.publishing.confirming());
    }

    #[test]
    fn a_kept_channel_without_confirms_counts_up_to_its_first_unanswered_forward() {
        let key = ChannelKey {
            conn: 1,
            channel: 1,
        };
        let mut ch = ChannelCtx::new(key);
        for _ in 0..6 {
            ch.publishing.count_publish();
        }
        // Publishes 2 and 4 went to other members' primaries: forwards 1 and 2..=3.
        ch.unanswered_forwards
            .extend([(2, 1), (4, 3)].map(|(number, last)| UnansweredForward {
                number,
                last,
                commits_before: 0,
            }));
        ch.prune_unanswered_forwards(1, None);
        assert_eq!(ch.kept_publish_state().published, 3, "publish 4 unanswered");
        ch.prune_unanswered_forwards(3, Some(2));
        assert_eq!(ch.kept_publish_state().published, 3, "its forward 2 failed");
        ch.prune_unanswered_forwards(3, None);
        assert_eq!(ch.kept_publish_state().published, 6, "all answered");
    }

    #[test]
    fn a_kept_channel_counts_a_commit_only_once_its_forwards_were_answered() {
        let key = ChannelKey {
            conn: 1,
            channel: 1,
        };
        let mut ch = ChannelCtx::new(key);
        ch.publishing.transactional = true;
        ch.publishing.published = 10;
        ch.publishing.commits = 3;
        // The fourth commit applies publishes 11..=15; two went to other members' primaries.
        ch.unanswered_forwards.push_back(UnansweredForward {
            number: 11,
            last: 2,
            commits_before: 3,
        });
        ch.publishing.published = 15;
        ch.publishing.commits = 4;
        let kept = ch.kept_publish_state();
        assert_eq!(
            (kept.published, kept.commits),
            (10, 3),
            "its outcome is unknown: the client sends the transaction again"
        );
        ch.prune_unanswered_forwards(2, None);
        let kept = ch.kept_publish_state();
        assert_eq!((kept.published, kept.commits), (15, 4));
    }

    #[test]
    fn body_parts_keep_one_frame_and_join_several() {
        let mut b = BodyParts::default();
        b.push(Bytes::from_static(b"ab"), 4);
        assert!(matches!(b, BodyParts::One(_)));
        b.push(Bytes::from_static(b"cd"), 4);
        assert_eq!(&b.finish()[..], b"abcd");
    }
}
