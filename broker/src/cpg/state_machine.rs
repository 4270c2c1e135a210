//! Applies the committed log to [`Groups`] and hands this member's events to its application.
//! Applying only committed entries is what makes delivery "safe": nothing reaches the
//! application before a majority of voters holds it.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Cursor;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use openraft::storage::RaftStateMachine;
use openraft::{
    EntryPayload, LogId, RaftSnapshotBuilder, Snapshot, SnapshotMeta, StorageError, StorageIOError,
    StoredMembership,
};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};

use super::disk::{Disk, StoredSnapshot};
use super::error::StopReason;
use super::event::CpgEvent;
use super::groups::{Emitted, Groups};
use super::lease::Lease;
use super::types::{Command, CpgTypes, MemberId, Outcome};

type Membership = StoredMembership<MemberId, openraft::BasicNode>;

/// What a snapshot holds: enough for a new member to apply the log from there on.
#[derive(Clone, Default, Serialize, Deserialize)]
pub(crate) struct SnapshotData {
    last_applied: Option<LogId<MemberId>>,
    membership: Membership,
    groups: Groups,
}

/// Where this member's events go, and the signal that stops the member when they cannot.
pub(crate) struct EventSink {
    /// This member.
    pub local: MemberId,
    /// Bounded queue to the application.
    pub tx: mpsc::Sender<CpgEvent>,
    /// Set once the member must stop; the node task watches it.
    pub stop: Arc<watch::Sender<Option<StopReason>>>,
    /// The voters declared failed as of the applied log, for the lease (a leader grants them
    /// nothing).
    pub failed: Arc<Mutex<BTreeSet<MemberId>>>,
    /// This member's lease and failure clocks: another member's [`Command::Start`] applied
    /// here is word from its new process ([`StateMachine`]'s apply).
    pub lease: Arc<Mutex<Lease>>,
    /// Events up to this index reached the application before a restart: a replay skips them.
    pub resume_after: u64,
    /// This process's incarnation: random per start, so that a restart replaying the log
    /// tells its own [`Command::Start`] from its predecessors'.
    pub incarnation: u64,
    /// The index at which this process's incarnation started ([`Command::Start`]), 0 before.
    pub started: Arc<AtomicU64>,
    /// Events queued for the application so far (for `sync`).
    pub sent: Arc<AtomicU64>,
    /// The application cannot resume (see [`cannot_resume`]): nothing before this process's
    /// own start reaches it, since it starts afresh.
    pub reset: bool,
}

impl EventSink {
    fn stopped(&self) -> bool {
        self.stop.borrow().is_some()
    }

    /// Publishes the applied set of failed voters. A member that finds itself in it is
    /// evicted — unless its incarnation has not started yet: then the failure was its previous
    /// incarnation's (a restart replaying its log).
    fn failed_now(&self, groups: &Groups) {
        let failed = groups.failed();
        if failed.contains(&self.local) && self.started.load(Ordering::Acquire) > 0 {
            self.stop
                .send_if_modified(|s| s.replace(StopReason::Evicted).is_none());
        }
        let mut shared = self.failed.lock();
        if *shared != *failed {
            shared.clone_from(failed);
        }
    }

    fn emit(&self, emitted: Emitted) {
        if self.stopped()
            || !emitted.to.contains(&self.local)
            || emitted.event.index() <= self.resume_after
            || (self.reset && self.started.load(Ordering::Acquire) == 0)
        {
            return;
        }
        if self.tx.try_send(emitted.event).is_ok() {
            self.sent.fetch_add(1, Ordering::AcqRel);
        } else {
            // A gap would break virtual synchrony, so deliver nothing more and let the majority
            // remove this member.
            self.stop
                .send_if_modified(|s| s.replace(StopReason::Overrun).is_none());
        }
    }
}

/// The CPG state machine of one member.
pub(crate) struct StateMachine {
    data: SnapshotData,
    snapshots: Arc<Snapshots>,
    sink: EventSink,
}

/// The member's snapshots: the newest (what openraft sends a lagging follower) and, with a
/// disk, the durable one a restart starts from. A snapshot becomes durable only once the
/// application has made durable every event up to it ([`Snapshots::checkpointed`]), so that
/// a restart can replay, from the log the disk keeps after it, every event the application
/// has not yet got for good; the log is purged only up to it (`purge_below`).
pub(crate) struct Snapshots {
    disk: Option<Arc<dyn Disk>>,
    purge_below: Arc<AtomicU64>,
    state: Mutex<SnapshotState>,
}

#[derive(Default)]
struct SnapshotState {
    current: Option<StoredSnapshot>,
    /// Built but newer than the application's checkpoint, oldest first.
    pending: Vec<StoredSnapshot>,
    checkpointed: u64,
    /// Whether this member is in no group, so there is nothing to replay to it.
    idle: bool,
}

impl Snapshots {
    /// The snapshots of a member with `disk` (or none), starting from `recovered`, purging
    /// the log up to `purge_below` only.
    pub fn new(
        disk: Option<Arc<dyn Disk>>,
        recovered: Option<StoredSnapshot>,
        purge_below: Arc<AtomicU64>,
        checkpointed: u64,
    ) -> Self {
        let state = SnapshotState {
            current: recovered,
            checkpointed,
            ..SnapshotState::default()
        };
        Self {
            disk,
            purge_below,
            state: Mutex::new(state),
        }
    }

    /// The application has made durable every event up to `index`.
    pub fn checkpointed(&self, index: u64) {
        let mut state = self.state.lock();
        state.checkpointed = state.checkpointed.max(index);
        self.promote(&mut state);
    }

    /// A snapshot was built; it becomes durable once the application has caught up with it.
    fn built(&self, snapshot: StoredSnapshot, idle: bool) {
        let mut state = self.state.lock();
        state.current = Some(snapshot.clone());
        if self.disk.is_some() {
            state.pending.push(snapshot);
            state.idle = idle;
            self.promote(&mut state);
        }
    }

    /// A snapshot from the leader replaced the state machine: durable at once (openraft
    /// purges the log it covers).
    fn installed(&self, snapshot: StoredSnapshot) -> std::io::Result<()> {
        let mut state = self.state.lock();
        let index = snapshot_index(&snapshot);
        if let Some(disk) = &self.disk {
            disk.save_snapshot(&snapshot)?;
            self.purge_below
                .store(purge_limit(&snapshot), Ordering::Release);
        }
        state.pending.retain(|p| snapshot_index(p) > index);
        state.current = Some(snapshot);
        Ok(())
    }

    /// Makes the newest pending snapshot the application has caught up with durable.
    fn promote(&self, state: &mut SnapshotState) {
        let Some(disk) = &self.disk else { return };
        let ready = |p: &StoredSnapshot| state.idle || snapshot_index(p) <= state.checkpointed;
        let Some(pos) = state.pending.iter().rposition(ready) else {
            return;
        };
        let snapshot = state.pending[pos].clone();
        match disk.save_snapshot(&snapshot) {
            Ok(()) => {
                self.purge_below
                    .store(purge_limit(&snapshot), Ordering::Release);
                state.pending.drain(..=pos);
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot save the consensus snapshot; keeping the log")
            }
        }
    }

    fn current(&self) -> Option<StoredSnapshot> {
        self.state.lock().current.clone()
    }
}

/// Whether member `local`, whose application saved events up to `resume_after`, cannot resume
/// from `snapshot`: it is newer than that while the member belongs to a group, so the events
/// between are gone.
pub(crate) fn cannot_resume(
    snapshot: &StoredSnapshot,
    local: MemberId,
    resume_after: u64,
) -> Result<bool, postcard::Error> {
    let data: SnapshotData = postcard::from_bytes(&snapshot.data)?;
    let index = data.last_applied.map_or(0, |l| l.index);
    Ok(index > resume_after && data.groups.is_in_any_group(local))
}

fn snapshot_index(s: &StoredSnapshot) -> u64 {
    s.meta.last_log_id.map_or(0, |l| l.index)
}

/// One past the snapshot's last index: the log below it may be purged (nothing for an empty
/// snapshot).
fn purge_limit(s: &StoredSnapshot) -> u64 {
    s.meta.last_log_id.map_or(0, |l| l.index + 1)
}

impl StateMachine {
    /// A state machine delivering to `sink`, starting from `snapshot` (a restart's durable
    /// one) or from nothing.
    pub fn new(sink: EventSink, snapshots: Arc<Snapshots>) -> Result<Self, postcard::Error> {
        let data = match snapshots.current() {
            Some(s) => postcard::from_bytes(&s.data)?,
            None => SnapshotData::default(),
        };
        sink.failed_now(&data.groups);
        Ok(Self {
            data,
            snapshots,
            sink,
        })
    }

    fn voters(membership: &Membership) -> BTreeMap<MemberId, String> {
        let m = membership.membership();
        m.voter_ids()
            .map(|id| {
                let addr = m.get_node(&id).map(|n| n.addr.clone()).unwrap_or_default();
                (id, addr)
            })
            .collect()
    }
}

/// Builds snapshots from a copy of the state taken when openraft asks.
pub(crate) struct SnapshotBuilder {
    data: SnapshotData,
    local: MemberId,
    snapshots: Arc<Snapshots>,
}

impl RaftSnapshotBuilder<CpgTypes> for SnapshotBuilder {
    async fn build_snapshot(&mut self) -> Result<Snapshot<CpgTypes>, StorageError<MemberId>> {
        let bytes =
            postcard::to_stdvec(&self.data).map_err(|e| StorageIOError::write_state_machine(&e))?;
        let last = self.data.last_applied;
        let meta = SnapshotMeta {
            last_log_id: last,
            last_membership: self.data.membership.clone(),
            snapshot_id: format!(
                "{}-{}",
                last.map_or(0, |l| l.leader_id.term),
                last.map_or(0, |l| l.index)
            ),
        };
        let idle = !self.data.groups.is_in_any_group(self.local);
        self.snapshots.built(
            StoredSnapshot {
                meta: meta.clone(),
                data: bytes.clone(),
            },
            idle,
        );
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(bytes)),
        })
    }
}

impl RaftStateMachine<CpgTypes> for StateMachine {
    type SnapshotBuilder = SnapshotBuilder;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogId<MemberId>>, Membership), StorageError<MemberId>> {
        Ok((self.data.last_applied, self.data.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<Outcome>, StorageError<MemberId>>
    where
        I: IntoIterator<Item = openraft::Entry<CpgTypes>> + Send,
        I::IntoIter: Send,
    {
        let mut outcomes = Vec::new();
        for entry in entries {
            let index = entry.log_id.index;
            self.data.last_applied = Some(entry.log_id);
            match entry.payload {
                EntryPayload::Blank => outcomes.push(Outcome::Applied { index }),
                EntryPayload::Normal(cmd) => {
                    // Both change who is failed (a start ends it), which the lease reads.
                    let fail = matches!(cmd, Command::Fail { .. } | Command::Start { .. });
                    // A start of this member by an earlier process (replayed, or committed
                    // after that process died) is not this incarnation's.
                    let other_start = match &cmd {
                        Command::Start {
                            member,
                            incarnation,
                            ..
                        } if *member == self.sink.local => {
                            let mine = *incarnation == self.sink.incarnation;
                            if mine {
                                self.sink.started.store(index, Ordering::Release);
                            }
                            !mine
                        }
                        Command::Start { member, .. } => {
                            // Another member's new process wrote this a moment ago: on the
                            // leader its failure clock starts here, not at its previous
                            // process's last ping — else a restart that lands just after (or
                            // just before) that process was declared failed is declared failed
                            // again at once, its start clearing the mark before its first ping
                            // (the new process is quiet for a while after a restart), and the
                            // new process is evicted.
                            self.sink
                                .lease
                                .lock()
                                .heard(*member, tokio::time::Instant::now());
                            false
                        }
                        _ => false,
                    };
                    let (outcome, emitted) = self.data.groups.apply(index, cmd);
                    for e in emitted {
                        if !(other_start && matches!(e.event, CpgEvent::Started { .. })) {
                            self.sink.emit(e);
                        }
                    }
                    if fail {
                        self.sink.failed_now(&self.data.groups);
                    }
                    outcomes.push(outcome);
                }
                EntryPayload::Membership(m) => {
                    self.data.membership = StoredMembership::new(Some(entry.log_id), m);
                    let voters = Self::voters(&self.data.membership);
                    for e in self.data.groups.set_voters(index, voters) {
                        self.sink.emit(e);
                    }
                    self.sink.failed_now(&self.data.groups);
                    outcomes.push(Outcome::Applied { index });
                }
            }
        }
        Ok(outcomes)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        SnapshotBuilder {
            data: self.data.clone(),
            local: self.sink.local,
            snapshots: Arc::clone(&self.snapshots),
        }
    }

    async fn begin_receiving_snapshot(
        &mut self,
    ) -> Result<Box<Cursor<Vec<u8>>>, StorageError<MemberId>> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<MemberId, openraft::BasicNode>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError<MemberId>> {
        let bytes = snapshot.into_inner();
        let data: SnapshotData = postcard::from_bytes(&bytes)
            .map_err(|e| StorageIOError::read_snapshot(Some(meta.signature()), &e))?;
        let local = self.sink.local;
        if self.data.groups.is_in_any_group(local) || data.groups.is_in_any_group(local) {
            // The entries the snapshot skips may hold events for this member (its own join
            // among them, when it is a member only in the snapshot): rather than a gap, stop.
            // Restarted, it finds its application behind the snapshot and starts afresh.
            self.sink
                .stop
                .send_if_modified(|s| s.replace(StopReason::FellBehind).is_none());
        }
        self.snapshots
            .installed(StoredSnapshot {
                meta: meta.clone(),
                data: bytes,
            })
            .map_err(|e| StorageIOError::write_snapshot(Some(meta.signature()), &e))?;
        self.data = data;
        self.sink.failed_now(&self.data.groups);
        Ok(())
    }

    async fn get_current_snapshot(
        &mut self,
    ) -> Result<Option<Snapshot<CpgTypes>>, StorageError<MemberId>> {
        Ok(self.snapshots.current().map(|s| Snapshot {
            meta: s.meta,
            snapshot: Box::new(Cursor::new(s.data)),
        }))
    }
}
