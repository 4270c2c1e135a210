//! The applier: the task that feeds the cluster group's events to the map in agreed order,
//! carries out the actions the map decides (roles, sessions, rebalancing, the host's
//! callbacks), and saves the map's checkpoint.

use super::host::ClusterHost;
use super::map::{Action, Checkpoint, ClusterMap};
use super::membership::MemberInfo;
use super::message::ClusterMsg;
use super::node::{Cluster, ClusterError, GROUP};
use super::roles::QueueRoles;
use crate::core::{RebalanceStep, WiringOp};
use crate::cpg::{CpgError, CpgEvent, CpgEvents, SyncPoint};
use crate::session::directory::SessionRecord;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// The map checkpoint's file in the cluster directory.
const CHECKPOINT_FILE: &str = "map.json";

/// How often, at most, a member saves its map checkpoint.
const CHECKPOINT_EVERY: Duration = Duration::from_millis(200);

/// Feeds the cluster group's events to the map, in agreed order, carries out what it asks
/// for, and saves its checkpoint.
pub(super) struct Applier<H> {
    map: ClusterMap,
    host: H,
    cluster: Arc<Cluster>,
    info: MemberInfo,
    dir: PathBuf,
    /// The newest checkpoint saved (and reported to CPG).
    saved_through: Arc<AtomicU64>,
    /// The checkpoint being saved, if any.
    saving: Option<tokio::task::JoinHandle<()>>,
    last_save: Instant,
    /// The read index this member catches up to before it serves.
    sync_point: Option<SyncPoint>,
    /// This process asked for its share of the queues as a member new to the ring.
    share_claimed: bool,
}

impl<H: ClusterHost> Applier<H> {
    /// The applier of `cluster`'s events to `map` and `host`, saving checkpoints in `dir`.
    pub(super) fn new(
        map: ClusterMap,
        host: H,
        cluster: Arc<Cluster>,
        info: MemberInfo,
        dir: PathBuf,
    ) -> Self {
        Applier {
            map,
            host,
            cluster,
            info,
            dir,
            saved_through: Arc::new(AtomicU64::new(0)),
            saving: None,
            last_save: Instant::now(),
            sync_point: None,
            share_claimed: false,
        }
    }

    /// Applies events until the group's stream ends.
    pub(super) async fn run(mut self, mut events: CpgEvents) {
        let (sync_tx, mut sync_rx) = mpsc::channel::<SyncPoint>(1);
        let mut tick = tokio::time::interval(CHECKPOINT_EVERY);
        loop {
            tokio::select! {
                ev = events.recv() => {
                    let Some(ev) = ev else { break };
                    if let Err(e) = self.on_event(ev, &sync_tx) {
                        tracing::error!(error = %e, "cannot follow the cluster");
                        break;
                    }
                }
                Some(point) = sync_rx.recv() => self.sync_point = Some(point),
                _ = tick.tick() => {}
            }
            self.cluster.events_applied.send_replace(events.received());
            self.check_caught_up(&events);
            self.save_checkpoint();
        }
        if self.cluster.retiring.load(Ordering::SeqCst) {
            // Removed from the voters at its own request: the process's shutdown ends it.
            tracing::info!("this broker left the cluster for good");
            return;
        }
        // CPG stopped: evicted (cut off or too slow) or shut down. A member that is not in
        // the cluster must not go on serving a wiring it can no longer keep in step; its
        // supervisor restarts it and it resumes, as the same member, from its cluster state.
        tracing::error!(reason = ?self.cluster.cpg.stop_reason(), "this broker left the cluster; exiting so that it restarts and rejoins");
        self.host.shutdown();
        std::process::exit(3);
    }

    fn on_event(
        &mut self,
        ev: CpgEvent,
        sync_tx: &mpsc::Sender<SyncPoint>,
    ) -> Result<(), super::map::MapError> {
        if ev.group().is_some_and(|g| g != GROUP) {
            return Ok(());
        }
        if let CpgEvent::ConfChg {
            members,
            joined,
            left,
            failed,
            ..
        } = &ev
        {
            let addrs =
                |ms: &[crate::cpg::Member]| ms.iter().map(|m| m.addr.clone()).collect::<Vec<_>>();
            tracing::info!(members = members.len(), joined = ?addrs(joined), left = ?addrs(left), failed = ?addrs(failed), "cluster membership changed");
        }
        let started = matches!(ev, CpgEvent::Started { .. });
        let index = ev.index();
        self.cluster.event_begun.store(index, Ordering::SeqCst);
        let actions = self.map.on_event(ev, &mut self.host)?;
        self.act(actions);
        self.claim_share();
        self.cluster.event_ended.store(index, Ordering::SeqCst);
        if !started && self.map.is_synced() {
            self.host.event_applied(index);
        }
        if started {
            self.cluster.progress.lock().live = true;
            self.host.started(self.map.roles());
            self.spawn_sync(sync_tx.clone());
        }
        Ok(())
    }

    /// Asks for the read index this member must reach before serving (retrying until the
    /// cluster answers).
    fn spawn_sync(&self, tx: mpsc::Sender<SyncPoint>) {
        let cluster = self.cluster.clone();
        tokio::spawn(async move {
            loop {
                match cluster.cpg.sync().await {
                    Ok(point) => {
                        let _ = tx.send(point).await;
                        return;
                    }
                    Err(CpgError::Stopped(_)) => return,
                    Err(e) => {
                        tracing::debug!(error = %e, "read index not confirmed yet; retrying");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            }
        });
    }

    fn check_caught_up(&mut self, events: &CpgEvents) {
        let mut p = self.cluster.progress.lock();
        p.synced = self.map.is_synced();
        p.announced = self.map.is_announced();
        if let Some(point) = self.sync_point
            && events.received() >= point.events
            && !p.caught_up
        {
            p.caught_up = true;
            tracing::info!(
                index = point.index,
                "caught up with the cluster: serving clients"
            );
        }
    }

    /// Saves the map checkpoint when it moved on (at most every [`CHECKPOINT_EVERY`], one
    /// save at a time): once the journal holds every change applied before it, write
    /// `map.json`, then tell CPG that events up to it need no replay.
    fn save_checkpoint(&mut self) {
        if self.saving.as_ref().is_some_and(|h| !h.is_finished()) {
            return;
        }
        let saved = self.saved_through.load(Ordering::Acquire);
        if self.map.through() <= saved || self.last_save.elapsed() < CHECKPOINT_EVERY {
            return;
        }
        let Some(checkpoint) = self.map.checkpoint(&mut self.host) else {
            return;
        };
        self.last_save = Instant::now();
        let (submitted, mut synced) = self.host.journal();
        let dir = self.dir.clone();
        let saved = Arc::clone(&self.saved_through);
        let cpg = self.cluster.cpg.clone();
        self.saving = Some(tokio::spawn(async move {
            while *synced.borrow() < submitted {
                if synced.changed().await.is_err() {
                    return;
                }
            }
            let through = checkpoint.through;
            match tokio::task::spawn_blocking(move || write_checkpoint(&dir, &checkpoint)).await {
                Ok(Ok(())) => {
                    saved.store(through, Ordering::Release);
                    cpg.checkpointed(through);
                }
                Ok(Err(e)) => tracing::error!(error = %e, "cannot save the cluster map checkpoint"),
                Err(_) => {}
            }
        }));
    }

    fn act(&mut self, actions: Vec<Action>) {
        for action in actions {
            match action {
                Action::SendHello => self.announce(),
                Action::SendSnapshot { to, through } => {
                    // Retried like the hello: the joiner waits for nothing else, and no later
                    // event asks again (found by the roles simulation, seed 30087: a lost
                    // snapshot left a new member without the map for good). A copy that
                    // committed twice is harmless: the joiner installs the first.
                    let msg = self.map.snapshot(to, through, &mut self.host);
                    self.multicast_until_committed(msg, "sending the cluster map to a joiner");
                }
                Action::Answer { request, outcome } => self.cluster.answer(request, outcome),
                Action::HostsChanged => {
                    *self.cluster.membership.write() = self.map.membership().clone();
                    self.publish_known_hosts();
                }
                Action::MembershipChanged => {
                    *self.cluster.membership.write() = self.map.membership().clone();
                }
                Action::RebalanceChanged => {
                    *self.cluster.rebalance.write() = self.map.rebalance().cloned();
                }
                Action::Synced => {
                    let roles = self.map.roles().clone();
                    // The broker follows every queue's roles from here: which copy serves,
                    // which replicates to whom.
                    for (vhost, queue, r) in roles.iter() {
                        self.host.roles_changed(vhost, queue, Some(r));
                    }
                    *self.cluster.roles.write() = roles;
                    *self.cluster.sessions.write() = self.map.sessions().clone();
                    *self.cluster.rebalance.write() = self.map.rebalance().cloned();
                    self.cluster.progress.lock().synced = true;
                }
                Action::RolesChanged {
                    vhost,
                    queue,
                    was,
                    now,
                } => {
                    log_roles_change(&vhost, &queue, was.as_ref(), now.as_ref());
                    self.cluster.roles.write().set(&vhost, &queue, now.clone());
                    self.host.roles_changed(&vhost, &queue, now.as_ref());
                }
                Action::SessionChanged { id, was, now } => {
                    tracing::debug!(session = %id, ?was, ?now, "session directory changed");
                    let me = self.cluster.node_id.as_str();
                    let mine =
                        |r: &Option<SessionRecord>| r.as_ref().is_some_and(|r| r.member == me);
                    // Restarted in place, this member held nothing of a session the
                    // directory still named it for; ended here, it let go already.
                    if mine(&was) && !mine(&now) {
                        self.host.session_left(&id);
                    }
                    if was.is_some() && now.is_none() {
                        self.host.session_ended(&id);
                    }
                    self.cluster.sessions.write().set(&id, now);
                }
                Action::Join => self.join(false),
                Action::Rejoin => self.join(true),
            }
        }
    }

    /// Joins the cluster group (after leaving it, for a rejoin), retrying until it is done
    /// or the member stops.
    fn join(&self, leave_first: bool) {
        let cpg = self.cluster.cpg.clone();
        tokio::spawn(async move {
            if leave_first {
                while let Err(e) = cpg.leave(GROUP).await {
                    if matches!(e, CpgError::Stopped(_) | CpgError::NotInGroup { .. }) {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
            loop {
                match cpg.join(GROUP).await {
                    Ok(_) | Err(CpgError::Stopped(_)) => return,
                    Err(e) => {
                        tracing::warn!(error = %e, "joining the cluster group; retrying");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            }
        });
    }

    /// Multicasts this member's hello, retrying until it commits: the member serves only
    /// once its own hello is applied ([`ClusterMap::is_announced`]). (A retry after a timeout
    /// that committed after all makes a second hello, which the others take for a restart in
    /// place: this member's backups catch up again — extra work, never a lost op.)
    fn announce(&self) {
        let msg = ClusterMsg::Hello(self.info.clone());
        self.multicast_until_committed(msg, "announcing this member to the cluster");
    }

    /// A member new to the ring, once it holds the map, asks for its share of the queues
    /// ([`RebalanceStep::Join`]): once per process, and again by the next process if this
    /// one dies before it commits (the map keeps it a newcomer until then). Not through
    /// [`Cluster::submit`], which waits for readiness: a newcomer is not ready until then.
    fn claim_share(&mut self) {
        let me = &self.cluster.node_id;
        if self.share_claimed
            || !self.map.is_synced()
            || !self.map.is_live()
            || !self.map.membership().is_newcomer(me)
        {
            return;
        }
        self.share_claimed = true;
        let msg = ClusterMsg::Op {
            origin: self.cluster.me,
            request: self.cluster.next_request.fetch_add(1, Ordering::Relaxed),
            vhost: String::new(),
            op: WiringOp::Rebalance(RebalanceStep::Join { node: me.clone() }),
        };
        self.multicast_until_committed(msg, "claiming this new member's share of the queues");
    }

    /// Multicasts `msg` again after every failure until it commits or this member stops.
    fn multicast_until_committed(&self, msg: ClusterMsg, what: &'static str) {
        let cluster = self.cluster.clone();
        tokio::spawn(async move {
            loop {
                match cluster.mcast(&msg).await {
                    Ok(()) | Err(CpgError::Stopped(_)) => return,
                    Err(e) => {
                        tracing::warn!(error = %e, "{what}; retrying");
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                }
            }
        });
    }

    fn publish_known_hosts(&mut self) {
        let hosts = self.cluster.known_hosts();
        let nodes: Vec<String> = self
            .cluster
            .members()
            .into_iter()
            .filter_map(|m| m.info.map(|i| i.node_id))
            .collect();
        self.host.members_changed(&hosts, &nodes);
    }
}

/// One line for a change of a queue's roles a person wants to know about: an election, a
/// queue becoming unavailable or available again (at `debug`, backups coming and going).
fn log_roles_change(vhost: &str, queue: &str, was: Option<&QueueRoles>, now: Option<&QueueRoles>) {
    let (Some(was), Some(now)) = (was, now) else {
        return;
    };
    if now.unavailable && !was.unavailable {
        tracing::warn!(
            vhost,
            queue,
            lost_primary = %now.primary,
            waiting_for = ?now.in_sync,
            "queue unavailable: its primary is gone and no backup was in sync; it returns with the lost primary or one of the nodes it waits for"
        );
    } else if now.primary != was.primary {
        tracing::info!(vhost, queue, from = %was.primary, to = %now.primary, backups = ?now.backups, "queue primary elected: an in-sync backup took over");
    } else if was.unavailable && !now.unavailable {
        tracing::info!(vhost, queue, primary = %now.primary, "queue available again: its primary is back");
    } else if now.backups != was.backups || now.in_sync != was.in_sync {
        tracing::debug!(vhost, queue, backups = ?now.backups, in_sync = ?now.in_sync, "queue backups changed");
    }
}

/// Reads the map checkpoint of the cluster directory `dir`, if there is one.
pub(super) fn read_checkpoint(dir: &Path) -> Result<Option<Checkpoint>, ClusterError> {
    let path = dir.join(CHECKPOINT_FILE);
    let err = |reason: String| ClusterError::State {
        dir: dir.display().to_string(),
        reason,
    };
    match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| err(format!("{} is damaged: {e}", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(err(e.to_string())),
    }
}

/// Replaces the map checkpoint atomically.
fn write_checkpoint(dir: &Path, checkpoint: &Checkpoint) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let bytes = serde_json::to_vec(checkpoint).map_err(std::io::Error::other)?;
    crate::atomic_file::write_atomically(dir, CHECKPOINT_FILE, &bytes)
}
