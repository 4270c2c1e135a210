//! The scale state machine: which operation is in force and what replicas it allows.
//!
//! Pure, so that resuming after a restart is just calling it again with the status that was
//! written before the restart.

use crate::crd::{Operation, OperationKind, OperationStep};

/// Decides the operation to work on from the wanted replicas, the StatefulSet's current
/// replicas (`None` before it exists) and the operation recorded in status.
///
/// * No StatefulSet yet: nothing to orchestrate, it is created at the wanted size.
/// * A recorded operation that still leads to the wanted size is resumed at its step.
/// * Otherwise a new operation starts from the StatefulSet's current size (a changed target
///   mid-operation restarts the plan from where the pods actually are).
pub fn start_or_resume(
    desired: i32,
    sts_replicas: Option<i32>,
    recorded: Option<&Operation>,
) -> Option<Operation> {
    let current = sts_replicas?;
    if let Some(op) = recorded
        && op.to == desired
    {
        return Some(op.clone());
    }
    match desired.cmp(&current) {
        std::cmp::Ordering::Greater => Some(Operation {
            kind: OperationKind::ScaleUp,
            from: current,
            to: desired,
            step: OperationStep::WaitingForMembers,
            waiting_for: None,
        }),
        std::cmp::Ordering::Less => Some(Operation {
            kind: OperationKind::ScaleDown,
            from: current,
            to: desired,
            step: OperationStep::Draining,
            waiting_for: None,
        }),
        std::cmp::Ordering::Equal => None,
    }
}

/// Member ids (pod names) that leave when scaling `name` from `from` down to `to`.
pub fn leaving_members(name: &str, from: i32, to: i32) -> Vec<String> {
    (to.max(0)..from).map(|i| format!("{name}-{i}")).collect()
}

/// Member ids (pod names) that join when scaling `name` from `from` up to `to`.
pub fn joining_members(name: &str, from: i32, to: i32) -> Vec<String> {
    (from.max(0)..to).map(|i| format!("{name}-{i}")).collect()
}
