//! `GET /api/overview` and `GET /api/whoami`: the one-call summary a dashboard or an operator
//! polls (node, members, object and message totals, memory and disk), and who the caller is.

use super::members::members;
use super::ok;
use crate::admin::Reply;
use crate::admin::metrics;
use crate::admin::router::{Ctx, Result};
use crate::broker::Broker;
use crate::broker::resources::rss_bytes;
use serde_json::{Value, json};

/// `GET /api/overview`.
pub(super) fn show(c: &Ctx<'_>) -> Result<Reply> {
    ok(overview(c.broker))
}

/// `GET /api/whoami`: lets a client check its credentials and tags without side effects.
pub(super) fn whoami(c: &Ctx<'_>) -> Result<Reply> {
    let user = &c.call.user;
    ok(json!({"name": user.name, "tags": user.tags}))
}

fn overview(b: &Broker) -> Value {
    let t = metrics::totals(b);
    let s = &b.stats;
    json!({
        "node": b.config.node_id,
        "cluster_name": b.config.cluster_name,
        "ringmq_version": env!("CARGO_PKG_VERSION"),
        "members": members(b),
        "cluster": b.cluster().map(|c| json!({
            "member": c.node_id(),
            "cluster_port": c.addr(),
            "quorum": c.has_quorum(),
            "voters": c.voters(),
            "leader": c.leader(),
        })),
        "object_totals": {
            "connections": b.registry.connection_count(),
            "channels": t.channels,
            "consumers": t.consumers,
            "exchanges": t.exchanges,
            "queues": t.queues,
            "vhosts": t.vhosts,
        },
        "queue_totals": {
            "messages": t.ready + t.unacked,
            "messages_ready": t.ready,
            "messages_unacknowledged": t.unacked,
        },
        "message_totals": {
            "published": s.published.get(),
            "routed": s.routed.get(),
            "unroutable": s.unroutable.get(),
            "delivered": s.delivered.get(),
            "redelivered": s.redelivered.get(),
            "acked": s.acked.get(),
            "confirmed": s.confirmed.get(),
            "received_bytes": s.bytes_in.get(),
            "sent_bytes": s.bytes_out.get(),
        },
        "memory": {
            "used_bytes": rss_bytes(),
            "high_watermark_bytes": b.config.memory_high_watermark_bytes,
            "alarm": b.publishers_blocked(),
        },
        "disk_free_bytes": crate::broker::resources::disk_free_bytes(&b.config.data_dir),
        "blocked_publishers": s.blocked_publishers.get(),
    })
}
