//! Counts of queues owned by other members, for the admin API: a proxy member answers for
//! every queue of the cluster with its primary's numbers. Asked over the link with two
//! passive declares marked with [`STATS_ARGUMENT`] (honoured only on links): one for the
//! ready count and consumers, one for the unacknowledged count. Marked, because a plain
//! passive declare is a use of the queue (it renews `x-expires`) and looking is not.

use super::link::Links;
use super::upstream_link::{Replied, UpstreamChannel};
use crate::amqp::{AMQPClass, AMQPValue, FieldTable, queue};
use std::collections::HashMap;

/// The passive-declare argument with which a link asks for a queue's numbers without using
/// it: `"ready"` or `"unacked"` says which count declare-ok's message-count carries.
/// Ignored on client connections.
pub const STATS_ARGUMENT: &str = "x-ringmq-stats";

/// A queue's numbers on its primary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueStats {
    /// Ready messages.
    pub ready: u32,
    /// Delivered, not yet acknowledged.
    pub unacked: u32,
    /// Consumers (on every member: proxied consumers are the primary's).
    pub consumers: u32,
}

/// The numbers of `queues` (in `vhost`) on member `primary`, asked on a channel of its
/// upstream link ([`super::upstream_link`]); a queue that could not be asked about (gone
/// meanwhile, or the member unreachable) is left out.
pub async fn queue_stats(
    links: &Links,
    primary: &str,
    vhost: &str,
    queues: &[String],
) -> HashMap<String, QueueStats> {
    let mut out = HashMap::new();
    let Ok(link) = links.upstream_link(primary, vhost).await else {
        return out;
    };
    let mut channel: Option<UpstreamChannel> = None;
    for name in queues {
        // A 404 closes the channel on the member: the next queue gets a new one.
        let ch = match channel.take() {
            Some(ch) => ch,
            None => match link.open_channel().await {
                Ok(ch) => ch,
                Err(_) => break,
            },
        };
        let ask = |which: &str| {
            let mut arguments = FieldTable::default();
            arguments.insert(STATS_ARGUMENT.into(), AMQPValue::LongString(which.into()));
            AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
                queue: name.as_str().into(),
                passive: true,
                durable: false,
                exclusive: false,
                auto_delete: false,
                nowait: false,
                arguments,
            }))
        };
        let counts = |r: Result<Replied, _>| match r {
            Ok(Replied::Method(AMQPClass::Queue(queue::AMQPMethod::DeclareOk(ok)))) => {
                Some((ok.message_count, ok.consumer_count))
            }
            _ => None,
        };
        let ready = counts(ch.call(ask("ready")).await);
        let unacked = counts(ch.call(ask("unacked")).await);
        if let (Some((ready, consumers)), Some((unacked, _))) = (ready, unacked) {
            out.insert(
                name.clone(),
                QueueStats {
                    ready,
                    unacked,
                    consumers,
                },
            );
            channel = Some(ch);
        } else {
            ch.close();
        }
    }
    if let Some(ch) = channel {
        ch.close();
    }
    out
}
