//! The consumer side of a channel as the vhost tracks it: consumers, prefetch windows and the
//! delivery tags awaiting an ack.

use crate::core::FastHashMap;
use std::collections::VecDeque;
use std::sync::Arc;

/// Identifies a channel across the broker: connection id and channel number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChannelKey {
    /// Connection id, unique within the broker's lifetime.
    pub conn: u64,
    /// Channel number on that connection.
    pub channel: u16,
}

/// A consumer registered with basic.consume.
#[derive(Debug, Clone)]
pub struct Consumer {
    /// Its tag.
    pub tag: Arc<str>,
    /// The queue it consumes from.
    pub queue: Arc<str>,
    /// Messages count as acked when sent.
    pub no_ack: bool,
    /// Registered with the exclusive flag.
    pub exclusive: bool,
    /// Per-consumer prefetch (0 = unlimited), fixed when it was registered.
    pub prefetch_count: u32,
    /// Per-consumer prefetch window in body bytes (0 = unlimited).
    pub prefetch_bytes: u64,
    /// Deliveries not yet acked.
    pub unacked: u32,
    /// Body bytes of deliveries not yet acked.
    pub unacked_bytes: u64,
}

/// A delivery awaiting ack.
#[derive(Debug, Clone)]
pub struct Unacked {
    /// Delivery tag on the channel.
    pub tag: u64,
    /// Queue the message came from.
    pub queue: Arc<str>,
    /// Its id in that queue.
    pub id: u64,
    /// The consumer it went to (`None` for basic.get).
    pub consumer: Option<Arc<str>>,
    /// The `redelivered` flag it went out with (sent again as it was by
    /// [`crate::core::VHost::basic_resend`]).
    pub redelivered: bool,
    /// Body size, for byte windows.
    pub bytes: u64,
    /// For a delivery proxied from another cluster member: that member's node id, and `id`
    /// is the delivery tag on the upstream channel to it.
    pub upstream: Option<Arc<str>>,
}

/// How many deliveries a channel may have handed to its connection but not yet written to the
/// socket. Bounds the memory a slow reader (or a no-ack consumer on a fast queue) can pin.
pub const WRITE_WINDOW: u32 = 4096;

/// The same window in body bytes: with large messages the count alone would let one slow
/// reader pin 4096 bodies. One delivery always fits, however large.
pub const WRITE_WINDOW_BYTES: u64 = 4 * 1024 * 1024;

/// Consumer-side state of one channel.
#[derive(Debug, Default)]
pub struct ChannelState {
    /// Last delivery tag used (tags start at 1).
    pub last_delivery_tag: u64,
    /// Deliveries awaiting ack, in tag order.
    pub unacked: VecDeque<Unacked>,
    /// Consumers by tag.
    pub consumers: FastHashMap<Arc<str>, Consumer>,
    /// Prefetch count given to consumers registered from now on (qos global=false).
    pub consumer_prefetch_count: u32,
    /// Prefetch bytes given to consumers registered from now on.
    pub consumer_prefetch_bytes: u64,
    /// Channel-wide prefetch count (qos global=true), 0 = unlimited.
    pub channel_prefetch_count: u32,
    /// Channel-wide prefetch bytes, 0 = unlimited.
    pub channel_prefetch_bytes: u64,
    /// Body bytes unacked on the channel.
    pub unacked_bytes: u64,
    /// Deliveries handed to the connection and not yet written (see [`WRITE_WINDOW`]).
    pub unwritten: u32,
    /// Their body bytes (see [`WRITE_WINDOW_BYTES`]).
    pub unwritten_bytes: u64,
    /// Broker-wide cap on unacked deliveries (`max_unacked_per_channel`, 0 = none): like a
    /// channel prefetch the client cannot raise. Consumers wait at it (messages stay ready
    /// in their queues); a basic.get past it is 406.
    pub max_unacked: u32,
}

/// Whether a byte window (`limit`, 0 = none) with `used` bytes in `unacked` deliveries
/// takes one more of `bytes`: the first delivery always fits, however large.
fn bytes_window_ok(limit: u64, used: u64, unacked: u64, bytes: u64) -> bool {
    limit == 0 || unacked == 0 || used + bytes <= limit
}

impl ChannelState {
    /// Whether the consumer `tag` may take a message of `bytes` body bytes now.
    pub fn can_deliver(&self, tag: &str, bytes: u64) -> bool {
        if self.write_window_full() {
            return false;
        }
        let Some(c) = self.consumers.get(tag) else {
            return false;
        };
        if c.no_ack {
            return true;
        }
        if self.unacked_limit_reached() {
            return false;
        }
        (c.prefetch_count == 0 || c.unacked < c.prefetch_count)
            && bytes_window_ok(
                c.prefetch_bytes,
                c.unacked_bytes,
                u64::from(c.unacked),
                bytes,
            )
            && self.channel_window_open(bytes)
    }

    /// Whether the channel-wide prefetch (basic.qos global=true) lets one more delivery of
    /// `bytes` body bytes out now. Local consumers ask it through [`Self::can_deliver`];
    /// a proxy asks it for deliveries its primaries sent, which it holds back while it says
    /// no, because no primary can see the channel's whole window.
    pub fn channel_window_open(&self, bytes: u64) -> bool {
        let count = self.unacked.len() as u64;
        (self.channel_prefetch_count == 0 || count < u64::from(self.channel_prefetch_count))
            && bytes_window_ok(
                self.channel_prefetch_bytes,
                self.unacked_bytes,
                count,
                bytes,
            )
    }

    /// Whether the connection holds as many unwritten deliveries of this channel as it may.
    pub fn write_window_full(&self) -> bool {
        self.unwritten >= WRITE_WINDOW || self.unwritten_bytes >= WRITE_WINDOW_BYTES
    }

    /// Whether the broker's cap on unacked deliveries holds this channel back.
    pub fn unacked_limit_reached(&self) -> bool {
        self.max_unacked > 0 && self.unacked.len() >= self.max_unacked as usize
    }

    /// Takes the next delivery tag.
    pub fn next_tag(&mut self) -> u64 {
        self.last_delivery_tag += 1;
        self.last_delivery_tag
    }

    /// Records a delivery that needs an ack.
    pub fn track(&mut self, unacked: Unacked) {
        if let Some(tag) = &unacked.consumer
            && let Some(c) = self.consumers.get_mut(tag)
        {
            c.unacked += 1;
            c.unacked_bytes += unacked.bytes;
        }
        self.track_counted(unacked);
    }

    /// [`Self::track`] of a delivery whose consumer counted it already: the dispatch, which
    /// holds the consumer, does not look it up by tag a second time.
    pub fn track_counted(&mut self, unacked: Unacked) {
        self.unacked_bytes += unacked.bytes;
        self.unacked.push_back(unacked);
    }

    /// Removes the deliveries an ack/nack/reject with `tag` and `multiple` names, in tag order.
    /// `None` when a tag is unknown (the caller answers 406 PRECONDITION_FAILED).
    pub fn settle(&mut self, tag: u64, multiple: bool) -> Option<Vec<Unacked>> {
        let taken: Vec<Unacked> = if multiple {
            if tag == 0 {
                self.unacked.drain(..).collect()
            } else {
                if tag > self.last_delivery_tag {
                    return None;
                }
                let n = self.unacked.partition_point(|u| u.tag <= tag);
                if n == 0 {
                    return None;
                }
                self.unacked.drain(..n).collect()
            }
        } else {
            let at = match self.unacked.front() {
                Some(front) if front.tag == tag => 0,
                _ => self.unacked.binary_search_by_key(&tag, |u| u.tag).ok()?,
            };
            vec![self.unacked.remove(at)?]
        };
        // A run of deliveries to one consumer finds it once, not by tag for each.
        let mut run: Option<(&Arc<str>, Option<&mut Consumer>)> = None;
        for u in &taken {
            self.unacked_bytes -= u.bytes;
            let Some(tag) = &u.consumer else {
                continue;
            };
            if !run.as_ref().is_some_and(|(t, _)| Arc::ptr_eq(t, tag)) {
                run = Some((tag, self.consumers.get_mut(tag)));
            }
            if let Some((_, Some(c))) = &mut run {
                c.unacked -= 1;
                c.unacked_bytes -= u.bytes;
            }
        }
        Some(taken)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn channel_with_deliveries(n: u64) -> ChannelState {
        let mut ch = ChannelState::default();
        for _ in 0..n {
            let tag = ch.next_tag();
            ch.track(Unacked {
                tag,
                queue: "q".into(),
                id: tag,
                consumer: None,
                redelivered: false,
                bytes: 10,
                upstream: None,
            });
        }
        ch
    }

    #[test]
    fn settle_single_multiple_and_zero() {
        let mut ch = channel_with_deliveries(5);
        assert_eq!(ch.settle(3, false).unwrap()[0].tag, 3);
        assert!(ch.settle(3, false).is_none(), "a settled tag is unknown");
        let tags: Vec<_> = ch.settle(4, true).unwrap().iter().map(|u| u.tag).collect();
        assert_eq!(tags, vec![1, 2, 4]);
        assert!(ch.settle(9, true).is_none());
        assert_eq!(ch.settle(0, true).unwrap().len(), 1);
        assert_eq!(ch.unacked_bytes, 0);
    }

    #[test]
    fn prefetch_windows_bound_deliveries() {
        let mut ch = ChannelState::default();
        ch.consumers.insert(
            "c".into(),
            Consumer {
                tag: "c".into(),
                queue: "q".into(),
                no_ack: false,
                exclusive: false,
                prefetch_count: 2,
                prefetch_bytes: 0,
                unacked: 0,
                unacked_bytes: 0,
            },
        );
        for _ in 0..2 {
            assert!(ch.can_deliver("c", 10));
            let tag = ch.next_tag();
            ch.track(Unacked {
                tag,
                queue: "q".into(),
                id: tag,
                consumer: Some("c".into()),
                redelivered: false,
                bytes: 10,
                upstream: None,
            });
        }
        assert!(!ch.can_deliver("c", 10));
        ch.settle(1, false).unwrap();
        assert!(ch.can_deliver("c", 10));
    }

    #[test]
    fn the_broker_cap_on_unacked_holds_whatever_the_prefetch() {
        let mut ch = channel_with_deliveries(3);
        ch.consumers.insert(
            "c".into(),
            Consumer {
                tag: "c".into(),
                queue: "q".into(),
                no_ack: false,
                exclusive: false,
                prefetch_count: 0,
                prefetch_bytes: 0,
                unacked: 0,
                unacked_bytes: 0,
            },
        );
        assert!(ch.can_deliver("c", 10), "no cap by default");
        ch.max_unacked = 3;
        assert!(!ch.can_deliver("c", 10));
        ch.settle(1, false).unwrap();
        assert!(ch.can_deliver("c", 10));
    }
}
