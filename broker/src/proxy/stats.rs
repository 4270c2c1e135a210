//! Counts of queues owned by other members, for the admin API: a proxy member answers for
//! every queue of the cluster with its primary's numbers. Asked over the link with two
//! passive declares marked with [`STATS_ARGUMENT`] (honoured only on links): one for the
//! ready count and consumers, one for the unacknowledged count. Marked, because a plain
//! passive declare is a use of the queue (it renews `x-expires`) and looking is not.

use super::link::Links;
use crate::amqp::{AMQPValue, FieldTable};
use lapin::options::QueueDeclareOptions;
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

/// The numbers of `queues` (in `vhost`) on `primary`; a queue that could not be asked
/// about (gone meanwhile, or the member unreachable) is left out.
pub async fn queue_stats(
    links: &Links,
    primary: &str,
    vhost: &str,
    queues: &[String],
) -> HashMap<String, QueueStats> {
    let mut out = HashMap::new();
    let mut channel: Option<lapin::Channel> = None;
    for name in queues {
        if channel.as_ref().is_none_or(|c| !c.status().connected()) {
            channel = links.channel(primary, vhost).await.ok();
        }
        let Some(ch) = &channel else {
            break;
        };
        let asking = |which: &str| {
            let mut args = FieldTable::default();
            args.insert(STATS_ARGUMENT.into(), AMQPValue::LongString(which.into()));
            args
        };
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let plain = ch
            .queue_declare(name.as_str().into(), passive, asking("ready"))
            .await;
        let unacked = ch
            .queue_declare(name.as_str().into(), passive, asking("unacked"))
            .await;
        if let (Ok(plain), Ok(unacked)) = (plain, unacked) {
            out.insert(
                name.clone(),
                QueueStats {
                    ready: plain.message_count(),
                    unacked: unacked.message_count(),
                    consumers: plain.consumer_count(),
                },
            );
        }
    }
    if let Some(ch) = channel {
        let _ = ch.close(200, "done".into()).await;
    }
    out
}
