//! The client's settlements of proxied deliveries, passed to their upstream channels, with
//! the barrier round trips that make a nack or reject seen by every member before the
//! client's next reply.

use super::{Answer, reply};
use crate::core::AmqpError;
use crate::core::vhost::{RemoteSettle, Settlement};
use crate::proxy::upstream::Command;
use crate::server::connection::Connection;
use std::future::Future;
use std::sync::Arc;

impl Connection {
    /// Passes the client's settlements of proxied deliveries to their upstream channels.
    ///
    /// A message a nack or reject put back (or dropped) must be seen so by every member once
    /// the client's channel has its next reply: after a batch with such settlements the
    /// connection reads nothing more until each primary involved has processed them (a
    /// barrier round trip on its upstream channel).
    pub(in crate::server::connection) fn send_remote_settles(&mut self) {
        let settles = std::mem::take(&mut self.fx.remote_settles);
        self.settle_upstream_all(settles.iter().map(upstream_settle));
        let mut barriers: Vec<(u16, Arc<str>)> = Vec::new();
        for s in &settles {
            let channel = s.channel.channel;
            if s.settlement != Settlement::Ack
                && !barriers
                    .iter()
                    .any(|(c, p)| *c == channel && *p == s.primary)
            {
                barriers.push((channel, s.primary.clone()));
            }
        }
        self.fx.remote_settles = settles;
        self.fx.remote_settles.clear();
        if barriers.is_empty() || self.remote_wait.is_some() {
            return;
        }
        let channel = barriers[0].0;
        let processed = self.barriers(&barriers);
        self.wait_remote(channel, (60, 120), async move {
            Answer::Settled {
                result: processed.await,
            }
        });
    }

    /// tx.commit of a transaction that settled proxied deliveries: the settlements go to
    /// their upstream channels now, and commit-ok waits — reading nothing more — until every
    /// primary involved has processed them, so a committed ack is an applied ack. Returns
    /// whether commit-ok is left to that wait.
    pub(in crate::server::connection) fn commit_remote_settles(&mut self, id: u16) -> bool {
        let settles = std::mem::take(&mut self.fx.remote_settles);
        let (mine, others): (Vec<_>, Vec<_>) =
            settles.into_iter().partition(|s| s.channel.channel == id);
        self.fx.remote_settles = others;
        if mine.is_empty() {
            return false;
        }
        self.settle_upstream_all(mine.iter().map(upstream_settle));
        let mut barriers: Vec<(u16, Arc<str>)> = Vec::new();
        for s in &mine {
            if !barriers.iter().any(|(_, p)| *p == s.primary) {
                barriers.push((id, s.primary.clone()));
            }
        }
        let processed = self.barriers(&barriers);
        self.wait_remote(id, (90, 20), async move {
            Answer::Committed {
                result: processed.await,
            }
        });
        true
    }

    /// A barrier round trip on each of these upstream channels: resolves once every one has
    /// processed what was sent before it (the first failure, if any).
    fn barriers(
        &self,
        barriers: &[(u16, Arc<str>)],
    ) -> impl Future<Output = Result<(), AmqpError>> + Send + 'static {
        let mut waits = Vec::new();
        for (channel, primary) in barriers {
            if let Some(u) = self.upstreams.get(&(*channel, primary.clone())) {
                let (tx, rx) = tokio::sync::oneshot::channel();
                u.send(Command::Barrier { reply: tx });
                waits.push((rx, primary.clone()));
            }
        }
        async move {
            let mut result = Ok(());
            for (rx, primary) in waits {
                if let Err(e) = reply(rx, &primary).await {
                    result = Err(e);
                }
            }
            result
        }
    }

    pub(in crate::server::connection) fn settle_upstream(
        &self,
        channel: u16,
        primary: &Arc<str>,
        tag: u64,
        settlement: Settlement,
    ) {
        if let Some(u) = self.upstreams.get(&(channel, primary.clone())) {
            u.send(Command::Settle {
                settlements: vec![(tag, settlement)],
            });
        }
    }

    /// Passes settlements to their upstream channels in order, one command per run of
    /// settlements for the same upstream channel (usually the whole batch: one lookup and
    /// one queue push instead of one per message).
    pub(in crate::server::connection) fn settle_upstream_all(
        &self,
        settles: impl IntoIterator<Item = UpstreamSettle>,
    ) {
        let mut run: Option<SettleRun> = None;
        for (channel, primary, tag, settlement) in settles {
            if let Some((c, p, batch)) = &mut run
                && *c == channel
                && *p == primary
            {
                batch.push((tag, settlement));
                continue;
            }
            if let Some(run) = run.take() {
                self.send_settles(run);
            }
            run = Some((channel, primary, vec![(tag, settlement)]));
        }
        if let Some(run) = run {
            self.send_settles(run);
        }
    }

    fn send_settles(
        &self,
        (channel, primary, settlements): (u16, Arc<str>, Vec<(u64, Settlement)>),
    ) {
        if let Some(u) = self.upstreams.get(&(channel, primary)) {
            u.send(Command::Settle { settlements });
        }
    }
}

/// A settlement for an upstream channel: client channel, primary, upstream tag, how.
type UpstreamSettle = (u16, Arc<str>, u64, Settlement);

/// Settlements for one upstream channel: client channel, primary, (upstream tag, how).
type SettleRun = (u16, Arc<str>, Vec<(u64, Settlement)>);

fn upstream_settle(s: &RemoteSettle) -> UpstreamSettle {
    (
        s.channel.channel,
        s.primary.clone(),
        s.upstream_tag,
        s.settlement,
    )
}
