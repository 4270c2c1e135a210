//! The upstream link's writer task: everything the channels queued goes out in one write,
//! heartbeats when idle, and a member that takes nothing is a failed link.

use super::{HEARTBEAT_S, IO_TIMEOUT, Inner};
use crate::amqp::writer::FrameWriter;
use crate::core::AmqpError;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::OwnedWriteHalf;

/// How often the writer sends a heartbeat when it has nothing to write: twice per agreed
/// heartbeat.
pub(super) fn heartbeat_period(heartbeat_s: u16) -> Duration {
    match heartbeat_s {
        0 => Duration::from_secs(u64::from(HEARTBEAT_S)),
        s => Duration::from_millis(u64::from(s) * 500),
    }
}

/// Writes what the channels queued, all of it per `write`, and heartbeats when idle.
pub(super) async fn write_loop(
    inner: Arc<Inner>,
    mut write: OwnedWriteHalf,
    heartbeat_every: Duration,
) {
    let mut out = FrameWriter::default();
    loop {
        let idle = tokio::time::timeout(heartbeat_every, inner.wake.notified())
            .await
            .is_err();
        {
            let mut shared = inner.shared.lock();
            if shared.failed.is_some() {
                return;
            }
            std::mem::swap(&mut shared.out, &mut out);
        }
        if out.is_empty() {
            if !idle {
                continue;
            }
            out.heartbeat();
        }
        if let Err(e) = flush(&inner, &mut write, &out).await {
            inner.mark_failed(e);
            return;
        }
        out.clear();
    }
}

/// Writes `out`. A member that takes nothing for [`IO_TIMEOUT`] fails the link — unless it
/// said it is blocked (a memory or disk alarm), which is waited out; the reader's silence
/// limit still ends the wait if the member is gone.
async fn flush(
    inner: &Inner,
    write: &mut OwnedWriteHalf,
    out: &FrameWriter,
) -> Result<(), AmqpError> {
    let mut writing = std::pin::pin!(write.write_all(out.as_slice()));
    loop {
        match tokio::time::timeout(IO_TIMEOUT, writing.as_mut()).await {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => return Err(inner.unreachable(e)),
            Err(_) => {
                let shared = inner.shared.lock();
                if let Some(e) = &shared.failed {
                    return Err(e.clone());
                }
                if !shared.blocked {
                    return Err(inner.unreachable(format!("it took nothing for {IO_TIMEOUT:?}")));
                }
            }
        }
    }
}
