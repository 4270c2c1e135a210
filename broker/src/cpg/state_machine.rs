//! Applies the committed log to [`Groups`] and hands this member's events to its application.
//! Applying only committed entries is what makes delivery "safe": nothing reaches the
//! application before a majority of voters holds it.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Cursor;
use std::sync::Arc;

use openraft::storage::RaftStateMachine;
use openraft::{
    EntryPayload, LogId, RaftSnapshotBuilder, Snapshot, SnapshotMeta, StorageError, StorageIOError,
    StoredMembership,
};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};

use super::error::StopReason;
use super::event::CpgEvent;
use super::groups::{Emitted, Groups};
use super::types::{Command, CpgTypes, MemberId, Outcome};

type Membership = StoredMembership<MemberId, openraft::BasicNode>;

/// What a snapshot holds: enough for a new member to apply the log from there on.
#[derive(Clone, Default, Serialize, Deserialize)]
struct SnapshotData {
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
}

impl EventSink {
    fn stopped(&self) -> bool {
        self.stop.borrow().is_some()
    }

    /// Publishes the applied set of failed voters; a member that finds itself in it is evicted
    /// (its Raft node keeps voting until the cluster removes it, see `monitor.rs`).
    fn failed_now(&self, groups: &Groups) {
        let failed = groups.failed();
        if failed.contains(&self.local) {
            self.stop
                .send_if_modified(|s| s.replace(StopReason::Evicted).is_none());
        }
        let mut shared = self.failed.lock();
        if *shared != *failed {
            shared.clone_from(failed);
        }
    }

    fn emit(&self, emitted: Emitted) {
        if self.stopped() || !emitted.to.contains(&self.local) {
            return;
        }
        if self.tx.try_send(emitted.event).is_err() {
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
    snapshot: CurrentSnapshot,
    sink: EventSink,
}

/// The latest snapshot, shared with the builder that writes it.
type CurrentSnapshot = Arc<Mutex<Option<(SnapshotMeta<MemberId, openraft::BasicNode>, Vec<u8>)>>>;

impl StateMachine {
    /// A fresh state machine delivering to `sink`.
    pub fn new(sink: EventSink) -> Self {
        Self {
            data: SnapshotData::default(),
            snapshot: CurrentSnapshot::default(),
            sink,
        }
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
    current: CurrentSnapshot,
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
        *self.current.lock() = Some((meta.clone(), bytes.clone()));
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
                    let fail = matches!(cmd, Command::Fail { .. });
                    let (outcome, emitted) = self.data.groups.apply(index, cmd);
                    for e in emitted {
                        self.sink.emit(e);
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
            current: Arc::clone(&self.snapshot),
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
        if self.data.groups.is_in_any_group(self.sink.local) {
            // The entries the snapshot skips may hold events for this member: rather than a gap,
            // stop (the majority then removes it and it can rejoin as a new member).
            self.sink
                .stop
                .send_if_modified(|s| s.replace(StopReason::FellBehind).is_none());
        }
        self.data = data;
        self.sink.failed_now(&self.data.groups);
        *self.snapshot.lock() = Some((meta.clone(), bytes));
        Ok(())
    }

    async fn get_current_snapshot(
        &mut self,
    ) -> Result<Option<Snapshot<CpgTypes>>, StorageError<MemberId>> {
        Ok(self.snapshot.lock().as_ref().map(|(meta, bytes)| Snapshot {
            meta: meta.clone(),
            snapshot: Box::new(Cursor::new(bytes.clone())),
        }))
    }
}
