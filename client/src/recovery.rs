//! Consumers the broker cancelled while the application still reads them. A ringmq member
//! cancels the consumers it proxies to a queue's primary when that primary is lost; the
//! queue itself lives on (a backup becomes its primary within a second or so). The client
//! asks for the queue on a channel of its own (a passive `queue.declare`, so that a refusal
//! closes only that channel) until it answers, then creates the consumer again under its tag
//! on the application's channel: the application sees one stream of deliveries, as it does
//! across a failover of the connection. A queue that is gone (deleted, or no primary came
//! back within the failover limit) ends the consumer, as the cancel would have. Pure: the
//! driver sends and reads; this decides.

use crate::book::ConsumerSpec;
use std::collections::VecDeque;
use std::time::Duration;
use tokio::time::Instant;

/// Whether a refusal (`code`, `text`) says that the queue's primary cannot be reached: the
/// member lost its link to it, and the cluster names another primary a moment later.
pub fn is_unreachable(code: u16, text: &str) -> bool {
    code == NOT_FOUND && text.contains("cannot be reached")
}

/// The first pause before asking for a queue again; it doubles up to [`MAX_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(100);

/// The longest pause between two asks.
const MAX_PAUSE: Duration = Duration::from_secs(1);

/// One cancelled consumer waiting to be created again.
#[derive(Debug)]
pub(crate) struct Recovering {
    /// The application's channel it consumes on.
    pub channel: u16,
    /// What creates it again (and the sender its deliveries go to).
    pub spec: ConsumerSpec,
    /// When it is given up.
    until: Instant,
    /// When its queue is asked for next.
    at: Instant,
    /// The pause before the ask after a refused one.
    pause: Duration,
}

/// A passive declare in flight on a scratch channel.
#[derive(Debug)]
struct Probe {
    scratch: u16,
    /// `None` once the queue answered and the consumer went back to its channel.
    item: Option<Recovering>,
}

/// What a refused ask means.
#[derive(Debug)]
pub(crate) enum Refused {
    /// Asked again later.
    Again,
    /// Given up: the consumer ends.
    GivenUp(ConsumerSpec, String),
}

/// Every consumer being created again.
#[derive(Debug, Default)]
pub(crate) struct Recoveries {
    waiting: VecDeque<Recovering>,
    probe: Option<Probe>,
}

impl Recoveries {
    /// The broker cancelled `spec` on `channel` at `now`; it is given up at `until`.
    pub fn cancelled(&mut self, channel: u16, spec: ConsumerSpec, now: Instant, until: Instant) {
        self.waiting.push_back(Recovering {
            channel,
            spec,
            until,
            at: now,
            pause: FIRST_PAUSE,
        });
    }

    /// When the next ask is due: none while one is in flight.
    pub fn due(&self) -> Option<Instant> {
        if self.probe.is_some() {
            return None;
        }
        self.waiting.iter().map(|r| r.at).min()
    }

    /// The scratch channel of the ask in flight.
    pub fn scratch(&self) -> Option<u16> {
        self.probe.as_ref().map(|p| p.scratch)
    }

    /// Starts the ask that is due at `now` on channel `scratch`: the queue to declare
    /// passively. Consumers past their limit are given up first (returned in `gone`).
    pub fn start(
        &mut self,
        now: Instant,
        scratch: u16,
        gone: &mut Vec<ConsumerSpec>,
    ) -> Option<String> {
        while let Some(i) = self.waiting.iter().position(|r| r.until <= now) {
            gone.extend(self.waiting.remove(i).map(|r| r.spec));
        }
        let next = self
            .waiting
            .iter()
            .enumerate()
            .filter(|(_, r)| r.at <= now)
            .min_by_key(|(_, r)| r.at)
            .map(|(i, _)| i)?;
        let item = self.waiting.remove(next)?;
        let queue = item.spec.queue.clone();
        self.probe = Some(Probe {
            scratch,
            item: Some(item),
        });
        Some(queue)
    }

    /// The queue answered: the consumer to create again on its channel.
    pub fn found(&mut self) -> Option<(u16, ConsumerSpec)> {
        let item = self.probe.as_mut()?.item.take()?;
        Some((item.channel, item.spec))
    }

    /// The scratch channel is closed (after an answer): the next ask may start.
    pub fn closed(&mut self) {
        self.probe = None;
    }

    /// The broker refused the ask with `code` and `text` at `now` (and closed the scratch
    /// channel): a queue whose primary "cannot be reached" (404; the election has not
    /// happened yet, or its primary is still being brought back) is asked for again; any
    /// other refusal (the queue is gone, or belongs to another connection) gives the
    /// consumer up.
    pub fn refused(&mut self, code: u16, text: &str, now: Instant) -> Option<Refused> {
        let mut item = self.probe.take()?.item?;
        let transient = is_unreachable(code, text);
        if !transient || now >= item.until {
            return Some(Refused::GivenUp(item.spec, format!("{code} {text}")));
        }
        item.at = now + item.pause;
        item.pause = (item.pause * 2).min(MAX_PAUSE);
        self.waiting.push_back(item);
        Some(Refused::Again)
    }

    /// The connection is lost: every consumer being created again goes back to its channel,
    /// for the failover's restore to create with the others.
    pub fn take_all(&mut self) -> Vec<(u16, ConsumerSpec)> {
        let probed = self.probe.take().and_then(|p| p.item);
        probed
            .into_iter()
            .chain(self.waiting.drain(..))
            .map(|r| (r.channel, r.spec))
            .collect()
    }
}

/// 404: what a member answers for a queue it cannot reach the primary of, and for a queue
/// that does not exist.
const NOT_FOUND: u16 = 404;

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::mpsc;

    fn spec(queue: &str) -> ConsumerSpec {
        let (deliveries, _rx) = mpsc::unbounded_channel();
        ConsumerSpec {
            tag: format!("c-{queue}"),
            queue: queue.to_owned(),
            no_ack: false,
            deliveries,
        }
    }

    #[test]
    fn a_queue_whose_primary_is_unavailable_is_asked_again_with_longer_pauses() {
        let t0 = Instant::now();
        let mut r = Recoveries::default();
        r.cancelled(3, spec("q"), t0, t0 + Duration::from_secs(30));
        assert_eq!(r.due(), Some(t0));
        let mut gone = Vec::new();
        assert_eq!(r.start(t0, 2047, &mut gone).as_deref(), Some("q"));
        assert_eq!(r.scratch(), Some(2047));
        assert_eq!(r.due(), None, "one ask at a time");
        let text = "the queue's primary, 'm0', cannot be reached: it closed the link";
        assert!(matches!(r.refused(404, text, t0), Some(Refused::Again)));
        assert_eq!(r.due(), Some(t0 + FIRST_PAUSE));
        let t1 = t0 + FIRST_PAUSE;
        assert!(r.start(t1, 2047, &mut gone).is_some());
        assert!(matches!(r.refused(404, text, t1), Some(Refused::Again)));
        assert_eq!(r.due(), Some(t1 + FIRST_PAUSE * 2));
        let t2 = t1 + FIRST_PAUSE * 2;
        assert!(r.start(t2, 2047, &mut gone).is_some());
        let (channel, found) = r.found().expect("the queue answered");
        assert_eq!((channel, found.tag.as_str()), (3, "c-q"));
        assert_eq!(r.due(), None, "until the scratch channel is closed");
        r.closed();
        assert_eq!(r.due(), None, "nothing left");
        assert!(gone.is_empty());
    }

    #[test]
    fn a_queue_that_is_gone_ends_the_consumer() {
        let t0 = Instant::now();
        let mut r = Recoveries::default();
        r.cancelled(1, spec("q"), t0, t0 + Duration::from_secs(30));
        r.start(t0, 9, &mut Vec::new());
        match r.refused(404, "no queue 'q' in vhost '/'", t0) {
            Some(Refused::GivenUp(s, why)) => {
                assert_eq!(s.tag, "c-q");
                assert!(why.contains("no queue"), "{why}");
            }
            other => panic!("given up, not {other:?}"),
        }
        assert_eq!(r.due(), None);
    }

    #[test]
    fn a_consumer_past_its_limit_is_given_up_and_a_lost_connection_takes_the_rest_back() {
        let t0 = Instant::now();
        let mut r = Recoveries::default();
        r.cancelled(1, spec("old"), t0, t0 + Duration::from_secs(1));
        r.cancelled(2, spec("new"), t0, t0 + Duration::from_secs(30));
        let mut gone = Vec::new();
        let later = t0 + Duration::from_secs(2);
        assert_eq!(r.start(later, 9, &mut gone).as_deref(), Some("new"));
        assert_eq!(gone.len(), 1);
        assert_eq!(gone[0].queue, "old");
        r.cancelled(4, spec("third"), later, later + Duration::from_secs(30));
        let back: Vec<(u16, String)> = r
            .take_all()
            .into_iter()
            .map(|(c, s)| (c, s.queue))
            .collect();
        assert_eq!(back, vec![(2, "new".into()), (4, "third".into())]);
        assert_eq!(r.scratch(), None);
        assert_eq!(r.due(), None);
    }
}
