//! The ops that change the roles and the ring without touching the store: a backup marked
//! in or out of sync, a primary's move, a drain, the ring's layout. Every member applies them
//! at the same point of the agreed order, so every member reaches the same roles.

use super::{Action, ClusterMap};
use crate::cluster::layout::RingLayout;
use crate::cluster::roles::QueueRoles;
use crate::core::{AmqpError, MoveStep, WiringOp};
use crate::cpg::MemberId;

impl ClusterMap {
    /// Sets one queue's roles, and reports the change.
    pub(super) fn set_roles(
        &mut self,
        vhost: &str,
        queue: &str,
        now: QueueRoles,
        actions: &mut Vec<Action>,
    ) {
        let was = self.roles.set(vhost, queue, Some(now.clone()));
        actions.push(Action::RolesChanged {
            vhost: vhost.to_owned(),
            queue: queue.to_owned(),
            was,
            now: Some(now),
        });
    }

    /// Brings every queue's roles in line with the ring (after member `restarted` came back
    /// in place, if one did) and, for the queues whose `k` is the layout's, with the
    /// layout's `backups`: a queue that was unavailable when it was set takes it on once it
    /// is back.
    pub(super) fn reconcile_all(&mut self, restarted: Option<&str>, actions: &mut Vec<Action>) {
        let ring = self.membership.ring();
        let draining = self.membership.draining().clone();
        let k = self.membership.layout().backups;
        self.update_roles(actions, |r| {
            if let Some(node) = restarted {
                r.restarted(node, &ring);
            }
            r.reconcile_with(&ring, &draining);
            if let Some(k) = k.filter(|_| r.default_k) {
                r.set_wanted_backups(k, &ring, &draining);
            }
        });
    }

    /// Applies `f` to every queue's roles, and reports each change.
    pub(super) fn update_roles(
        &mut self,
        actions: &mut Vec<Action>,
        f: impl FnMut(&mut QueueRoles),
    ) {
        for (vhost, queue, was, now) in self.roles.update_all(f) {
            actions.push(Action::RolesChanged {
                vhost,
                queue,
                was: Some(was),
                now: Some(now),
            });
        }
    }

    /// [`WiringOp::BackupInSync`] and [`WiringOp::BackupOutOfSync`] change the roles only (the
    /// store never sees them), whatever a restart's store saved: `Some` with the answer for
    /// them, `None` for every other op. Out of sync always succeeds (a no-op when the node is
    /// not in sync, or the incarnation is gone), so a primary that waits for it to commit
    /// never waits for ever; in sync is refused when it changes nothing. In sync counts only when `sender` is the primary of
    /// that incarnation: a deposed primary's late op must not vouch for a backup it no longer
    /// feeds.
    pub(super) fn apply_sync_op(
        &mut self,
        index: u64,
        sender: MemberId,
        vhost: &str,
        op: &WiringOp,
        actions: &mut Vec<Action>,
    ) -> Option<Result<(), AmqpError>> {
        if let WiringOp::MovePrimary {
            queue,
            incarnation,
            to,
            step,
        } = op
        {
            return Some(self.apply_move_op(
                index,
                sender,
                vhost,
                (queue, *incarnation),
                (to, *step),
                actions,
            ));
        }
        if let WiringOp::DrainMember { node, draining } = op {
            self.apply_drain_op(node, *draining, actions);
            return Some(Ok(()));
        }
        if let WiringOp::Rebalance(step) = op {
            return Some(self.apply_rebalance_op(index, step.clone(), actions));
        }
        if let WiringOp::SetRingLayout(layout) = op {
            return Some(self.apply_layout_op(index, layout, actions));
        }
        let (queue, incarnation, node, in_sync) = match op {
            WiringOp::BackupInSync {
                queue,
                incarnation,
                node,
            } => (queue, *incarnation, node, true),
            WiringOp::BackupOutOfSync {
                queue,
                incarnation,
                node,
            } => (queue, *incarnation, node, false),
            _ => return None,
        };
        let sender_node = self.membership.node_id_of(sender);
        let Some(was) = self
            .roles
            .get(vhost, queue)
            .filter(|r| r.incarnation == incarnation)
        else {
            if !in_sync {
                // Out of sync of a queue that is gone (or declared again) holds already.
                return Some(Ok(()));
            }
            return Some(Err(AmqpError::not_found(format!(
                "no incarnation {incarnation} of queue '{queue}' in vhost '{vhost}'"
            ))));
        };
        let mut now = was.clone();
        let changed = if in_sync {
            sender_node == Some(now.primary.as_str()) && now.mark_in_sync(node)
        } else {
            now.mark_out_of_sync(node)
        };
        if changed {
            // A backup in sync may let a draining one go (`QueueRoles::reconcile_with`).
            now.reconcile_with(&self.membership.ring(), self.membership.draining());
            self.set_roles(vhost, queue, now, actions);
            Some(Ok(()))
        } else if in_sync && !now.in_sync.contains(node) {
            Some(Err(AmqpError::precondition(format!(
                "'{node}' is not a backup that the primary of queue '{queue}' in vhost                  '{vhost}' can mark in sync now"
            ))))
        } else {
            Some(Ok(()))
        }
    }

    /// [`WiringOp::MovePrimary`]: a request is refused (for its asker) when the move
    /// cannot be made now; a switch counts only from the queue's primary (a deposed
    /// primary's late switch changes nothing); a cancel always succeeds.
    pub(super) fn apply_move_op(
        &mut self,
        index: u64,
        sender: MemberId,
        vhost: &str,
        (queue, incarnation): (&str, u64),
        (to, step): (&str, MoveStep),
        actions: &mut Vec<Action>,
    ) -> Result<(), AmqpError> {
        let sender_node = self.membership.node_id_of(sender).map(str::to_owned);
        let Some(was) = self
            .roles
            .get(vhost, queue)
            .filter(|r| r.incarnation == incarnation)
        else {
            return match step {
                MoveStep::Cancel => Ok(()),
                _ => Err(AmqpError::not_found(format!(
                    "no incarnation {incarnation} of queue '{queue}' in vhost '{vhost}'"
                ))),
            };
        };
        let ring = self.membership.ring();
        let draining = self.membership.draining();
        if step == MoveStep::Request && draining.contains(to) {
            return Err(AmqpError::precondition(format!(
                "cannot move the primary of queue '{queue}' in vhost '{vhost}' to '{to}': it is being drained"
            )));
        }
        let mut now = was.clone();
        let changed = match step {
            MoveStep::Request => now.request_move(to, &ring).map_err(|why| {
                AmqpError::precondition(format!(
                    "cannot move the primary of queue '{queue}' in vhost '{vhost}' to '{to}': {why}"
                ))
            })?,
            MoveStep::Switch => {
                sender_node.as_deref() == Some(now.primary.as_str()) && now.switch(to, &ring)
            }
            MoveStep::Cancel => now.cancel_move(to),
        };
        if changed {
            now.reconcile_with(&ring, draining);
            if now.primary != was.primary {
                // Primaries follow the agreed log up to the newest ring change; a switch is
                // one for its queue (the fault suite's two-primaries checker compares claims
                // within one such index).
                self.membership.changed_at(index);
                actions.push(Action::MembershipChanged);
            }
            self.set_roles(vhost, queue, now, actions);
        }
        Ok(())
    }

    /// [`WiringOp::DrainMember`]: the member's mark changes, and with it every queue's roles
    /// (`QueueRoles::reconcile_with`: its primaries start moving, its backups are replaced).
    pub(super) fn apply_drain_op(&mut self, node: &str, draining: bool, actions: &mut Vec<Action>) {
        if !self.membership.set_draining(node, draining) {
            return;
        }
        let ring = self.membership.ring();
        let marked = self.membership.draining().clone();
        self.update_roles(actions, |r| {
            // Undrained: a move the drain started, not switched yet, is called off.
            if !draining
                && r.primary == node
                && let Some(to) = r.moving_to.clone()
            {
                r.cancel_move(&to);
            }
            r.reconcile_with(&ring, &marked);
        });
        actions.push(Action::MembershipChanged);
    }

    /// [`WiringOp::SetRingLayout`]: refused when no ring can follow it, or while a member
    /// that predates layouts is announced (it follows the ring and `k` without them); else
    /// the ring is ordered by it — again, if it is the layout in force (a member away when
    /// it was set comes to its place) — without moving any queue's copies (a rebalance puts
    /// the backups on the new successors, catch-up first), and when it sets `backups`,
    /// every queue whose `k` is not its own takes it on.
    pub(super) fn apply_layout_op(
        &mut self,
        index: u64,
        layout: &RingLayout,
        actions: &mut Vec<Action>,
    ) -> Result<(), AmqpError> {
        layout
            .validate()
            .map_err(|e| AmqpError::precondition(format!("cannot set the ring layout: {e}")))?;
        if let Some(old) = self.membership.predating_layouts() {
            return Err(AmqpError::precondition(format!(
                "cannot set the ring layout: member '{old}' runs a version without ring layouts"
            )));
        }
        if !self.membership.set_layout(layout.clone(), index) {
            return Ok(());
        }
        tracing::info!(ring = ?self.membership.ring(), ?layout, "the ring's layout changed");
        self.reconcile_all(None, actions);
        actions.push(Action::MembershipChanged);
        Ok(())
    }
}
