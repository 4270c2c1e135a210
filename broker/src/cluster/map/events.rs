//! The map's handling of one agreed event once it holds the map: a configuration change, a
//! member's hello, a wiring op (applied to the store, or to the map alone), a snapshot sent to
//! a joiner.

use super::{Action, ClusterMap, MapError, WiringStore};
use crate::cluster::message::ClusterMsg;
use crate::cluster::rebalance;
use crate::cluster::roles::{self, QueueRoles};
use crate::core::args::QueueArgs;
use crate::core::{AmqpError, OpReply, WiringOp, is_foreign};
use crate::cpg::{CpgEvent, MemberId};
use crate::session::directory::SessionChange;

impl ClusterMap {
    pub(super) fn handle(
        &mut self,
        ev: CpgEvent,
        store: &mut impl WiringStore,
        actions: &mut Vec<Action>,
    ) -> Result<(), MapError> {
        match ev {
            CpgEvent::ConfChg { index, members, .. } => {
                let ids: Vec<MemberId> = members.iter().map(|m| m.id).collect();
                self.membership.on_conf_change(&ids);
                self.membership.changed_at(index);
                self.reconcile_all(None, actions);
                let lost = self.sessions.members_are(&self.membership.ring());
                push_session_changes(actions, lost);
                for to in self.membership.snapshot_duty(self.me) {
                    actions.push(Action::SendSnapshot { to, through: index });
                }
                actions.push(Action::HostsChanged);
            }
            CpgEvent::Deliver {
                index,
                sender,
                payload,
                ..
            } => match ClusterMsg::decode(&payload) {
                Some(ClusterMsg::Hello(info)) => {
                    // A member that announced itself before: its process restarted in place —
                    // unless the same process says it again (a retried send).
                    let restarted = self
                        .membership
                        .members()
                        .iter()
                        .find(|m| m.id == sender)
                        .and_then(|m| m.info.as_ref())
                        .is_some_and(|old| {
                            old.node_id == info.node_id
                                && (old.process == 0 || old.process != info.process)
                        })
                        .then(|| info.node_id.clone());
                    // Where it goes, if it is new to the ring (the planner's gap costs a
                    // pass over every queue; a restart keeps its place).
                    let node = info.node_id.clone();
                    let at = (!self.membership.is_placed(&node))
                        .then(|| rebalance::insertion(&self.roles, &self.membership, &info));
                    self.membership.on_hello(sender, info);
                    if let Some(at) = at
                        && self.membership.place(&node, at)
                    {
                        tracing::info!(
                            member = %node,
                            ring = ?self.membership.ring(),
                            "a new member took its place on the ring"
                        );
                    }
                    self.membership.changed_at(index);
                    if sender == self.me && self.live {
                        self.announced = true;
                    }
                    self.reconcile_all(restarted.as_deref(), actions);
                    if let Some(node) = restarted {
                        let lost = self.sessions.restarted(&node);
                        push_session_changes(actions, lost);
                    }
                    actions.push(Action::HostsChanged);
                }
                Some(ClusterMsg::Op {
                    origin,
                    request,
                    vhost,
                    op,
                }) => {
                    if let WiringOp::Session(op) = &op {
                        let outcome = self.sessions.apply(op);
                        if let Ok(change) = &outcome {
                            push_session_changes(actions, change.clone());
                        }
                        if origin == self.me {
                            actions.push(Action::Answer {
                                request,
                                outcome: outcome.map(|_| (OpReply::default(), None)),
                            });
                        }
                        return Ok(());
                    }
                    if let Some(outcome) = self.apply_sync_op(index, sender, &vhost, &op, actions) {
                        if origin == self.me {
                            actions.push(Action::Answer {
                                request,
                                outcome: outcome.map(|()| (OpReply::default(), None)),
                            });
                        }
                        return Ok(());
                    }
                    if store.applied_through(&vhost).is_some_and(|t| index <= t) {
                        // Applied and saved by the previous process: a restart's replay.
                        // What no disk holds comes back from the checkpoint and the replay.
                        store.reapply_transient(&vhost, &op);
                        self.track_queue(index, origin, &vhost, &op, None, actions);
                        return Ok(());
                    }
                    let outcome = store.apply(index, &vhost, &op);
                    self.track_queue(index, origin, &vhost, &op, Some(&outcome), actions);
                    if origin == self.me {
                        actions.push(Action::Answer { request, outcome });
                    }
                }
                Some(ClusterMsg::Snapshot(s)) => {
                    // The joiner holds the map from here: the admin API's copy says so too
                    // (it used to wait for the next membership change, which, when the
                    // joiner's hello came first, left it `joining` there for good).
                    self.membership.on_snapshot(s.to);
                    actions.push(Action::MembershipChanged);
                }
                None => return Err(MapError::Undecodable { index, sender }),
            },
            // Handled in `on_event` before any other event.
            CpgEvent::Started { .. } => {}
        }
        Ok(())
    }

    /// Keeps the roles in step with the queues: a declare that created a clustered queue
    /// gives it roles (incarnation: this op's agreed `index`), a delete takes them away.
    /// `outcome` is the store's answer; `None` for an op a restart's store had already
    /// applied, where the map decides from what it holds (a queue it has no roles for, with
    /// valid arguments, is created).
    fn track_queue(
        &mut self,
        index: u64,
        origin: MemberId,
        vhost: &str,
        op: &WiringOp,
        outcome: Option<&Result<(OpReply, Option<u64>), AmqpError>>,
        actions: &mut Vec<Action>,
    ) {
        match op {
            WiringOp::DeclareQueue {
                name,
                exclusive,
                home: Some(home),
                arguments,
                server_named,
                ..
            } if !is_foreign(home) && (!exclusive || op.declaring_session().is_some()) => {
                let Ok(args) = QueueArgs::parse(arguments, name, vhost) else {
                    return;
                };
                let created = match outcome {
                    Some(Ok((reply, _))) => reply.created,
                    Some(Err(_)) => false,
                    None => {
                        let reserved = name.starts_with("amq.")
                            && !(*server_named && name.starts_with("amq.gen-"));
                        !reserved && self.roles.get(vhost, name).is_none()
                    }
                };
                if !created {
                    return;
                }
                let declared = || {
                    self.membership
                        .members()
                        .iter()
                        .find(|m| m.id == origin)
                        .and_then(|m| m.info.as_ref())
                        .map_or(roles::DEFAULT_BACKUPS, |i| i.default_backups)
                };
                let k = (args.backups)
                    .or(self.membership.layout().backups)
                    .unwrap_or_else(declared);
                let ring = self.membership.ring();
                let mut now = QueueRoles::new(index, home, k, &ring);
                now.default_k = args.backups.is_none();
                now.reconcile_with(&ring, self.membership.draining());
                self.set_roles(vhost, name, now, actions);
            }
            WiringOp::DeleteQueue { name, .. } if !matches!(outcome, Some(Err(_))) => {
                if let Some(was) = self.roles.set(vhost, name, None) {
                    actions.push(Action::RolesChanged {
                        vhost: vhost.to_owned(),
                        queue: name.clone(),
                        was: Some(was),
                        now: None,
                    });
                }
            }
            _ => {}
        }
    }
}

/// Reports each session change as an action, in order.
fn push_session_changes(
    actions: &mut Vec<Action>,
    changes: impl IntoIterator<Item = SessionChange>,
) {
    for (id, was, now) in changes {
        actions.push(Action::SessionChanged { id, was, now });
    }
}
