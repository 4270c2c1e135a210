//! The scale state machine: which operation is in force and what replicas it allows.
//!
//! Pure, so that resuming after a restart is just calling it again with the status that was
//! written before the restart.

use crate::admin::{AdminError, Overview};
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

/// Member ids (pod names) that join when scaling `name` from `from` up to `to`.
pub fn joining_members(name: &str, from: i32, to: i32) -> Vec<String> {
    (from.max(0)..to).map(|i| format!("{name}-{i}")).collect()
}

/// Whether the cluster is settled at `current` brokers (the StatefulSet's size, `pods` its
/// pods), so that a scale-down may go on; `Err` says what it waits for. `removing`: the
/// next step removes the highest pod, `name-(current-1)` (else the scale-down is at its
/// target and only checks that it may close).
///
/// One pod at a time, highest ordinal first, for two reasons:
/// * The StatefulSet (`OrderedReady`) removes a pod only while the pods before it are
///   ready, and a drained broker is not (`/readyz` 503): only the highest pod may be drained.
/// * A drained broker leaves the consensus voters when it stops (the broker's
///   `retire_if_drained`). Until it has, the cluster still counts its vote, and removing the
///   next pod could leave a minority of live voters (five voters of which two are gone
///   survive no further failure).
///
/// Settled: the pod removed last is gone, the answering member holds quorum, every broker
/// that stays is a member (`running`, or `draining` — alive and voting; the leaving one is
/// the drain's to judge), and there are no more voters than brokers. `forced` (members
/// removed with queues, which stay voters) relaxes the voters' check to what quorum needs:
/// the brokers that stay are a majority of the voters.
pub fn settled(
    name: &str,
    current: i32,
    pods: i32,
    overview: &Result<Overview, AdminError>,
    forced: bool,
    removing: bool,
) -> Result<(), Unsettled> {
    let waiting = |why: String| Err(Unsettled::Waiting(why));
    if pods > current {
        return waiting(format!(
            "{name}-{current} and up to stop ({pods} pods for {current})"
        ));
    }
    let overview = match overview {
        Ok(o) => o,
        Err(e) => return waiting(format!("the admin API does not answer: {e}")),
    };
    let Some(cluster) = &overview.cluster else {
        return Ok(());
    };
    if !cluster.quorum {
        return waiting(format!("{} reports no quorum", overview.node));
    }
    let staying = if removing { current - 1 } else { current };
    let absent: Vec<String> = (0..staying.max(0))
        .map(|i| format!("{name}-{i}"))
        .filter(|id| {
            !overview
                .members
                .iter()
                .any(|m| &m.id == id && (m.state == "running" || m.state == "draining"))
        })
        .collect();
    if !absent.is_empty() {
        return waiting(format!("not running members: {}", absent.join(", ")));
    }
    let voters = i32::try_from(cluster.voters).unwrap_or(i32::MAX);
    if voters <= current {
        return Ok(());
    }
    if !forced {
        return Err(Unsettled::StaleVoters(format!(
            "{voters} consensus voters for {current} brokers: {} stopped broker(s) still vote (a broker leaves the voters when it stops drained and holding nothing; it could not, or is still on its way out); if this lasts, scale up to {voters} to start them again, then down again",
            voters - current
        )));
    }
    if staying * 2 <= voters {
        return Err(Unsettled::StaleVoters(format!(
            "{staying} brokers would be left of {voters} consensus voters, no majority; scale up to {voters} to bring the stopped members back, then down again without the force annotation"
        )));
    }
    Ok(())
}

/// Why a scale-down is not settled ([`settled`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unsettled {
    /// A pod still stopping, no quorum, a broker not back: it passes on its own.
    Waiting(String),
    /// Stopped brokers still vote: it may pass on its own (a broker on its way out), or need
    /// the user (one that could not leave the voters).
    StaleVoters(String),
}

impl std::fmt::Display for Unsettled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unsettled::Waiting(why) | Unsettled::StaleVoters(why) => f.write_str(why),
        }
    }
}

/// The ordinal of pod `id` of the StatefulSet `name` (`name-N`), if it is one.
pub fn ordinal(name: &str, id: &str) -> Option<i32> {
    id.strip_prefix(name)?.strip_prefix('-')?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admin::{ClusterInfo, MemberInfo};

    /// An overview from a member of a cluster of `running` members and `voters` voters.
    fn overview(running: usize, voters: u64) -> Result<Overview, AdminError> {
        Ok(Overview {
            node: "ringmq-0".into(),
            members: (0..running)
                .map(|i| MemberInfo {
                    id: format!("ringmq-{i}"),
                    state: "running".into(),
                    ..MemberInfo::default()
                })
                .collect(),
            cluster: Some(ClusterInfo {
                quorum: true,
                voters,
                leader: Some("ringmq-0".into()),
            }),
            ..Overview::default()
        })
    }

    #[test]
    fn a_whole_cluster_is_settled_and_a_terminating_pod_is_waited_for() {
        assert_eq!(
            settled("ringmq", 5, 5, &overview(5, 5), false, true),
            Ok(())
        );
        let why = settled("ringmq", 4, 5, &overview(4, 5), false, true)
            .unwrap_err()
            .to_string();
        assert!(why.contains("ringmq-4 and up to stop"), "{why}");
    }

    #[test]
    fn the_leaving_broker_need_not_be_a_member_for_the_others_to_be_settled() {
        // ringmq-2 (leaving) crashed: the drain judges it, not the settled check.
        assert_eq!(
            settled("ringmq", 3, 3, &overview(2, 3), false, true),
            Ok(())
        );
        assert!(settled("ringmq", 3, 3, &overview(2, 3), false, false).is_err());
        assert_eq!(ordinal("ringmq", "ringmq-12"), Some(12));
        assert_eq!(ordinal("ringmq", "ringmq-x"), None);
        assert_eq!(ordinal("ringmq", "other-1"), None);
    }

    #[test]
    fn a_drained_member_is_alive_and_a_joining_one_is_not() {
        let mut o = overview(3, 3);
        if let Ok(o) = o.as_mut() {
            o.members[2].state = "draining".into();
        }
        assert_eq!(settled("ringmq", 3, 3, &o, false, false), Ok(()));
        if let Ok(o) = o.as_mut() {
            o.members[2].state = "joining".into();
        }
        let why = settled("ringmq", 3, 3, &o, false, false)
            .unwrap_err()
            .to_string();
        assert!(why.contains("ringmq-2"), "{why}");
    }

    #[test]
    fn a_stopped_broker_that_still_votes_unsettles_the_cluster() {
        let why = settled("ringmq", 4, 4, &overview(4, 5), false, true)
            .unwrap_err()
            .to_string();
        assert!(why.contains("5 consensus voters for 4 brokers"), "{why}");
        assert!(why.contains("scale up to 5"), "{why}");
        assert_eq!(
            settled("ringmq", 2, 2, &overview(2, 2), false, false),
            Ok(())
        );
    }

    #[test]
    fn a_forced_shrink_goes_on_with_stale_voters_only_while_the_rest_stay_a_majority() {
        // 5 voters, 4 brokers: after ringmq-3 goes, 3 of 5 is still a majority.
        assert_eq!(settled("ringmq", 4, 4, &overview(4, 5), true, true), Ok(()));
        // 5 voters, 3 brokers: 2 of 5 would not be.
        let why = settled("ringmq", 3, 3, &overview(3, 5), true, true)
            .unwrap_err()
            .to_string();
        assert!(why.contains("no majority"), "{why}");
        // At its target, 3 brokers of 5 voters is a majority: the scale-down may close.
        assert_eq!(
            settled("ringmq", 3, 3, &overview(3, 5), true, false),
            Ok(())
        );
        // 4 to 3 forced: 3 brokers of 4 voters.
        assert_eq!(
            settled("ringmq", 3, 3, &overview(3, 4), true, false),
            Ok(())
        );
    }

    #[test]
    fn without_quorum_or_an_answer_or_a_member_nothing_is_settled() {
        let mut cut = overview(3, 3);
        if let Ok(o) = cut.as_mut() {
            o.cluster.as_mut().unwrap().quorum = false;
        }
        for o in [
            cut,
            Err(AdminError::Unreachable {
                url: "http://ringmq-0.ringmq-nodes:15672/api/overview".into(),
                reason: "connection refused".into(),
            }),
            overview(2, 3),
        ] {
            assert!(settled("ringmq", 3, 3, &o, false, false).is_err(), "{o:?}");
        }
    }
}
