//! The minority checker: while a member is cut off from the majority, a client that reaches
//! it must not be served — no publish confirmed, no message delivered — because the majority
//! may already have moved its queues elsewhere (DESIGN §5: a member without the majority's
//! lease serves nobody). The probe is an ordinary AMQP client of that member.

use crate::workload::History;
use lapin::options::{BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long each step of the probe may take before it counts as not served.
const STEP: Duration = Duration::from_secs(2);

/// Asks the member at `uri` to confirm a persistent publish of `id` to `queue` and to hand
/// out one of its messages. `Ok` says how it refused; `Err` what it served. The id is
/// recorded as attempted in `history`, so that if the member stored it after all, the
/// never-published checker does not count it.
pub async fn minority_serves_nobody(
    uri: &str,
    queue: &str,
    id: &str,
    history: &Arc<Mutex<History>>,
) -> Result<String, String> {
    let connected = tokio::time::timeout(
        STEP,
        Connection::connect(uri, ConnectionProperties::default()),
    )
    .await;
    let conn = match connected {
        Ok(Ok(conn)) => conn,
        Ok(Err(e)) => return Ok(format!("connection refused: {e}")),
        Err(_) => return Ok("no connection within 2 s".into()),
    };
    let outcome = probe(&conn, queue, id, history).await;
    let _ = bounded(conn.close(200, "probe done".into())).await;
    outcome
}

async fn probe(
    conn: &Connection,
    queue: &str,
    id: &str,
    history: &Arc<Mutex<History>>,
) -> Result<String, String> {
    let Ok(ch) = bounded(conn.create_channel()).await else {
        return Ok("no channel".into());
    };
    if bounded(ch.confirm_select(ConfirmSelectOptions::default()))
        .await
        .is_err()
    {
        return Ok("no confirm mode".into());
    }
    history.lock().unwrap().attempted.insert(id.to_owned());
    let published = bounded(ch.basic_publish(
        "".into(),
        queue.into(),
        BasicPublishOptions::default(),
        id.as_bytes(),
        BasicProperties::default().with_delivery_mode(2),
    ))
    .await;
    let Ok(confirm) = published else {
        return Ok("publish refused".into());
    };
    match bounded(confirm).await {
        Ok(c) if c.is_ack() => return Err(format!("confirmed the publish of {id}")),
        Ok(_) => {}
        Err(()) => return Ok("no confirm".into()),
    }
    // Manual ack, never given: whatever it hands out goes back when the probe closes.
    let got = bounded(ch.basic_get(queue.into(), BasicGetOptions { no_ack: false })).await;
    match got {
        Ok(Some(m)) => Err(format!(
            "delivered {}",
            String::from_utf8_lossy(&m.delivery.data)
        )),
        _ => Ok("nacked the publish, delivered nothing".into()),
    }
}

/// `step` within [`STEP`]: `Err(())` for an error or no answer in time.
async fn bounded<T, E>(step: impl Future<Output = Result<T, E>>) -> Result<T, ()> {
    match tokio::time::timeout(STEP, step).await {
        Ok(Ok(t)) => Ok(t),
        _ => Err(()),
    }
}
