//! Quorum-safe rolling restarts: which broker pods the StatefulSet may replace next.
//!
//! The StatefulSet's `RollingUpdate` strategy replaces the pods whose ordinal is at least its
//! `partition`, highest first. The operator keeps the partition at the replica count when
//! the pod template changes, and lowers it by one only when every pod replaced so far is
//! back and the cluster is whole: the answering member holds quorum and lists every broker
//! as `running`, and every pod has been ready for `minReadySeconds`. So one broker restarts
//! at a time, and the next only once the previous one has rejoined.
//!
//! Pure, so that a restarted operator resumes from what it reads: the partition lives in the
//! StatefulSet's spec, the progress in its status.

use crate::admin::{AdminError, Overview};

/// Seconds a restarted pod must be ready before it counts as available; the StatefulSet's
/// `minReadySeconds`. A broker that passes `/readyz` and falls over at once does not let
/// the next pod go.
pub const MIN_READY_SECONDS: i32 = 10;

/// What the StatefulSet reports about a rollout, from its status.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    /// Pods the StatefulSet should run (`spec.replicas`).
    pub replicas: i32,
    /// Its current partition (`spec.updateStrategy.rollingUpdate.partition`, 0 when unset).
    pub partition: i32,
    /// Pods at the update revision (`status.updatedReplicas`).
    pub updated: i32,
    /// Pods ready for at least `minReadySeconds` (`status.availableReplicas`).
    pub available: i32,
    /// Whether every pod runs the newest template (`currentRevision == updateRevision`).
    pub done: bool,
}

/// The partition to apply, and what the rollout waits for (`None` when none is running).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    /// `spec.updateStrategy.rollingUpdate.partition`.
    pub partition: i32,
    /// In words a person can act on; `None` when no rollout is running.
    pub waiting_for: Option<String>,
    /// The pod the StatefulSet may replace now because of this step, if it just moved.
    pub released: Option<String>,
}

/// Whether the cluster is whole enough to restart another broker: the answering member
/// holds quorum and lists every one of `name-0 … name-(replicas-1)` as `running`.
///
/// `Err` says what is missing. A broker that runs alone (no `cluster` in the overview) is
/// whole when it answers.
pub fn cluster_health(
    overview: &Result<Overview, AdminError>,
    name: &str,
    replicas: i32,
) -> Result<(), String> {
    let overview = overview
        .as_ref()
        .map_err(|e| format!("the admin API does not answer: {e}"))?;
    let Some(cluster) = &overview.cluster else {
        return Ok(());
    };
    if !cluster.quorum {
        return Err(format!("{} reports no quorum", overview.node));
    }
    let not_running: Vec<String> = (0..replicas.max(0))
        .map(|i| format!("{name}-{i}"))
        .filter(|id| {
            !overview
                .members
                .iter()
                .any(|m| &m.id == id && m.state == "running")
        })
        .collect();
    if not_running.is_empty() {
        Ok(())
    } else {
        Err(format!("not running members: {}", not_running.join(", ")))
    }
}

/// Decides the partition.
///
/// * No rollout (the template did not change and the last rollout is done): 0.
/// * The template changes with this apply: the replica count, so no pod is replaced yet.
/// * A rollout is running: one lower than now once every pod from the partition up runs the
///   new template, all pods are available and `health` is `Ok`; unchanged otherwise.
pub fn next_step(
    name: &str,
    template_changed: bool,
    progress: Progress,
    health: &Result<(), String>,
) -> Step {
    let n = progress.replicas.max(0);
    if template_changed {
        return Step {
            partition: n,
            waiting_for: Some(format!(
                "pod template changed: {n} brokers to restart one at a time"
            )),
            released: None,
        };
    }
    if progress.done {
        return Step {
            partition: 0,
            waiting_for: None,
            released: None,
        };
    }
    let partition = progress.partition.clamp(0, n);
    let replaced_so_far = n - partition;
    let waiting = |why: String| Step {
        partition,
        waiting_for: Some(format!(
            "{replaced_so_far}/{n} brokers restarted; before the next: {why}"
        )),
        released: None,
    };
    if progress.updated < replaced_so_far {
        let pod = format!("{name}-{}", partition.max(progress.updated));
        return waiting(format!(
            "{} of {replaced_so_far} replaced pods on the new template ({pod} and up restarting)",
            progress.updated
        ));
    }
    if progress.available < n {
        return waiting(format!(
            "{}/{n} pods available (ready for {MIN_READY_SECONDS} s)",
            progress.available
        ));
    }
    if let Err(why) = health {
        return waiting(why.clone());
    }
    if partition == 0 {
        // Every pod replaced and the cluster whole; the StatefulSet marks the revision
        // current on its own.
        return Step {
            partition: 0,
            waiting_for: Some(format!(
                "{n}/{n} brokers restarted; the StatefulSet to record the new revision"
            )),
            released: None,
        };
    }
    let next = partition - 1;
    Step {
        partition: next,
        waiting_for: Some(format!(
            "{replaced_so_far}/{n} brokers restarted; {name}-{next} restarting"
        )),
        released: Some(format!("{name}-{next}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admin::{ClusterInfo, MemberInfo};

    fn overview(running: &[&str], joining: &[&str], quorum: bool) -> Overview {
        let member = |id: &&str, state: &str| MemberInfo {
            id: id.to_string(),
            state: state.into(),
            ..MemberInfo::default()
        };
        Overview {
            node: "ringmq-0".into(),
            members: running
                .iter()
                .map(|id| member(id, "running"))
                .chain(joining.iter().map(|id| member(id, "joining")))
                .collect(),
            cluster: Some(ClusterInfo {
                quorum,
                voters: 3,
                leader: None,
            }),
            ..Overview::default()
        }
    }

    fn rolling(partition: i32, updated: i32, available: i32) -> Progress {
        Progress {
            replicas: 3,
            partition,
            updated,
            available,
            done: false,
        }
    }

    const ALL: [&str; 3] = ["ringmq-0", "ringmq-1", "ringmq-2"];

    #[test]
    fn a_template_change_holds_every_pod_until_the_operator_releases_one() {
        let step = next_step("ringmq", true, rolling(0, 3, 3), &Ok(()));
        assert_eq!(step.partition, 3);
        assert_eq!(step.released, None);
    }

    #[test]
    fn pods_are_released_one_at_a_time_highest_first_each_after_the_last_is_back() {
        let healthy = Ok(());
        // Held at 3: the first release is the highest ordinal.
        let step = next_step("ringmq", false, rolling(3, 0, 3), &healthy);
        assert_eq!(
            (step.partition, step.released.as_deref()),
            (2, Some("ringmq-2"))
        );
        // ringmq-2 is not on the new template yet: hold.
        let step = next_step("ringmq", false, rolling(2, 0, 2), &healthy);
        assert_eq!((step.partition, step.released), (2, None));
        // ringmq-2 replaced but not available for minReadySeconds yet: hold.
        let step = next_step("ringmq", false, rolling(2, 1, 2), &healthy);
        assert_eq!(step.partition, 2);
        assert!(
            step.waiting_for
                .unwrap_or_default()
                .contains("2/3 pods available")
        );
        // Back and available: ringmq-1 next.
        let step = next_step("ringmq", false, rolling(2, 1, 3), &healthy);
        assert_eq!(
            (step.partition, step.released.as_deref()),
            (1, Some("ringmq-1"))
        );
        let step = next_step("ringmq", false, rolling(1, 2, 3), &healthy);
        assert_eq!(
            (step.partition, step.released.as_deref()),
            (0, Some("ringmq-0"))
        );
        // All replaced: partition stays 0 until the StatefulSet marks the revision current.
        let step = next_step("ringmq", false, rolling(0, 3, 3), &healthy);
        assert_eq!((step.partition, step.released), (0, None));
        let done = Progress {
            done: true,
            ..rolling(0, 3, 3)
        };
        assert_eq!(
            next_step("ringmq", false, done, &healthy),
            Step {
                partition: 0,
                waiting_for: None,
                released: None
            }
        );
    }

    #[test]
    fn no_pod_is_released_without_quorum_or_while_a_member_is_not_running() {
        let progress = rolling(2, 1, 3);
        for (o, why) in [
            (overview(&ALL, &[], false), "no quorum"),
            (
                overview(&["ringmq-0", "ringmq-1"], &["ringmq-2"], true),
                "ringmq-2",
            ),
            (overview(&["ringmq-0", "ringmq-1"], &[], true), "ringmq-2"),
        ] {
            let health = cluster_health(&Ok(o), "ringmq", 3);
            let step = next_step("ringmq", false, progress, &health);
            assert_eq!((step.partition, step.released.clone()), (2, None), "{why}");
            assert!(
                step.waiting_for
                    .as_deref()
                    .unwrap_or_default()
                    .contains(why),
                "{step:?}"
            );
        }
        let unreachable = AdminError::Unreachable {
            url: "http://ringmq-admin.ns.svc:15672/api/overview".into(),
            reason: "timed out".into(),
        };
        let health = cluster_health(&Err(unreachable), "ringmq", 3);
        assert_eq!(next_step("ringmq", false, progress, &health).partition, 2);
        assert_eq!(
            cluster_health(&Ok(overview(&ALL, &[], true)), "ringmq", 3),
            Ok(())
        );
    }

    #[test]
    fn a_broker_alone_is_whole_when_it_answers() {
        let alone = Overview {
            node: "ringmq-0".into(),
            ..Overview::default()
        };
        assert_eq!(cluster_health(&Ok(alone), "ringmq", 1), Ok(()));
    }
}
