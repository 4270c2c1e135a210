//! `/api/sessions`: the resumable sessions (`docs/sessions.md`) — on a cluster every
//! member's, from the session directory, so any member gives the same answer; on a single
//! broker its own. What an operator checks before draining a member, and how a test sees
//! that a session ended without resuming it.

use super::ok;
use crate::admin::router::{Ctx, Result};
use crate::admin::{ApiError, Reply};
use crate::broker::Broker;
use serde_json::{Value, json};

/// `GET /api/sessions`.
pub(super) fn list(c: &Ctx<'_>) -> Result<Reply> {
    ok(Value::Array(sessions(c.broker)))
}

/// `GET /api/sessions/{id}`.
pub(super) fn get(c: &Ctx<'_>) -> Result<Reply> {
    let [id] = c.args();
    sessions(c.broker)
        .into_iter()
        .find(|s| s["id"] == *id)
        .map_or_else(
            || Err(ApiError::not_found(format!("no session '{id}'"))),
            ok,
        )
}

fn sessions(b: &Broker) -> Vec<Value> {
    match b.cluster() {
        Some(cluster) => cluster
            .sessions()
            .iter()
            .map(|(id, r)| {
                json!({
                    "id": id,
                    "user": r.user,
                    "member": r.member,
                    "attached": r.attached,
                    "timeout_s": r.timeout_s,
                })
            })
            .collect(),
        None => b
            .sessions()
            .list()
            .into_iter()
            .map(|s| {
                json!({
                    "id": s.id.to_string(),
                    "user": s.user,
                    "member": b.config.node_id,
                    "attached": s.attached,
                    "timeout_s": s.timeout.as_secs(),
                })
            })
            .collect(),
    }
}
