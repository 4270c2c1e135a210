//! The rebalance of the primaries as map decisions: started, stopped or handed a new
//! member's share by an agreed op, and moved on after every event.

use super::{Action, ClusterMap};
use crate::cluster::rebalance::Rebalance;
use crate::core::{AmqpError, RebalanceStep};

impl ClusterMap {
    /// [`WiringOp::Rebalance`]: a start plans the moves from the roles now and starts the
    /// first ones (refused while another rebalance has moves left); a stop skips the moves
    /// not started yet.
    pub(super) fn apply_rebalance_op(
        &mut self,
        index: u64,
        step: RebalanceStep,
        actions: &mut Vec<Action>,
    ) -> Result<(), AmqpError> {
        match step {
            RebalanceStep::Start { concurrency } => {
                if let Some(r) = self.rebalance.as_ref().filter(|r| !r.finished()) {
                    return Err(AmqpError::precondition(format!(
                        "a rebalance is under way ({} of its {} moves left): wait for it or \
                         stop it first",
                        r.moves_left(),
                        r.moves.len()
                    )));
                }
                let plan = Rebalance::start(index, concurrency, &self.roles, &self.membership);
                self.rebalance = Some(plan);
                actions.push(Action::RebalanceChanged);
                self.advance_rebalance(actions);
            }
            RebalanceStep::Stop => {
                if self.rebalance.as_mut().is_some_and(Rebalance::stop) {
                    actions.push(Action::RebalanceChanged);
                }
            }
            RebalanceStep::Join { node } => {
                if !self.membership.take_newcomer(&node) {
                    // Its share was handed over already (a retried send).
                    return Ok(());
                }
                actions.push(Action::MembershipChanged);
                if self.roles.iter().next().is_none() {
                    return Ok(());
                }
                if let Some(r) = self.rebalance.as_ref().filter(|r| !r.finished()) {
                    tracing::warn!(
                        member = %node,
                        moves_left = r.moves_left(),
                        "a new member joined during a rebalance: it gets its share from the \
                         next `cluster rebalance --apply`"
                    );
                    return Ok(());
                }
                let plan = Rebalance::join(index, &node, &self.roles, &self.membership);
                tracing::info!(
                    member = %node,
                    between = ?plan.scope,
                    primary_moves = plan.moves.len(),
                    "handing a new member its share of the queues"
                );
                self.rebalance = Some(plan);
                actions.push(Action::RebalanceChanged);
                self.advance_rebalance(actions);
            }
        }
        Ok(())
    }

    /// Moves the rebalance on after an event: records the moves that switched or were
    /// called off, and starts the next ones (their queues' roles change here, as a
    /// [`MoveStep::Request`] would change them).
    pub(super) fn advance_rebalance(&mut self, actions: &mut Vec<Action>) {
        let Some(r) = self.rebalance.as_mut().filter(|r| !r.finished()) else {
            return;
        };
        let ring = self.membership.ring();
        let (requests, changed) = r.advance(&self.roles, &ring, self.membership.draining());
        for (vhost, queue, now) in requests {
            self.set_roles(&vhost, &queue, now, actions);
        }
        if changed {
            actions.push(Action::RebalanceChanged);
        }
    }
}
