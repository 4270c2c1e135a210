//! The replicated state of the CPG layer — which members are in which group — as a pure state
//! machine: agreed log entries in, events and their recipients out. Every member runs the same
//! entries through it, which is what makes every member see the same events.

use std::collections::{BTreeMap, BTreeSet};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::event::{CpgEvent, Member};
use super::types::{Command, MemberId, Outcome};

/// An event and the members that must receive it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Emitted {
    /// The event.
    pub event: CpgEvent,
    /// Members that deliver it.
    pub to: BTreeSet<MemberId>,
}

/// Group membership plus the addresses of the cluster's voting members.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Groups {
    groups: BTreeMap<String, BTreeSet<MemberId>>,
    voters: BTreeMap<MemberId, String>,
    /// Voters declared failed (by a [`Command::Fail`]) that are still Raft voters: out of every
    /// group for good, but still voting until the cluster replaces them.
    failed: BTreeSet<MemberId>,
}

impl Groups {
    /// Whether `member` currently belongs to any group (a snapshot must not skip its events).
    pub fn is_in_any_group(&self, member: MemberId) -> bool {
        self.groups.values().any(|g| g.contains(&member))
    }

    fn member(&self, id: MemberId) -> Member {
        let addr = self.voters.get(&id).cloned().unwrap_or_default();
        Member { id, addr }
    }

    fn members(&self, ids: impl IntoIterator<Item = MemberId>) -> Vec<Member> {
        ids.into_iter().map(|id| self.member(id)).collect()
    }

    /// The cluster's voting membership became `voters` at `index`. Group members no longer
    /// voting have failed (if no [`Command::Fail`] said so already); the remaining members of
    /// each of their groups are told.
    pub fn set_voters(&mut self, index: u64, voters: BTreeMap<MemberId, String>) -> Vec<Emitted> {
        let removed: BTreeSet<MemberId> = self
            .voters
            .keys()
            .filter(|id| !voters.contains_key(id))
            .copied()
            .collect();
        let out = self.fail(index, &removed);
        self.failed.retain(|id| voters.contains_key(id));
        self.voters = voters;
        out
    }

    /// Voters declared failed that are still voters.
    pub fn failed(&self) -> &BTreeSet<MemberId> {
        &self.failed
    }

    /// `members` failed at `index` (a [`Command::Fail`], or removed from the voters): they leave
    /// every group, and the remaining members of each of those groups are told.
    pub fn fail(&mut self, index: u64, members: &BTreeSet<MemberId>) -> Vec<Emitted> {
        let mut out = Vec::new();
        for (name, ids) in &mut self.groups {
            let failed: Vec<MemberId> = ids.intersection(members).copied().collect();
            if failed.is_empty() {
                continue;
            }
            for id in &failed {
                ids.remove(id);
            }
            let lookup = |id: MemberId| Member {
                id,
                addr: self.voters.get(&id).cloned().unwrap_or_default(),
            };
            out.push(Emitted {
                event: CpgEvent::ConfChg {
                    group: name.clone(),
                    index,
                    members: ids.iter().map(|&id| lookup(id)).collect(),
                    joined: Vec::new(),
                    left: Vec::new(),
                    failed: failed.into_iter().map(lookup).collect(),
                },
                to: ids.clone(),
            });
        }
        self.groups.retain(|_, ids| !ids.is_empty());
        self.failed.extend(
            members
                .iter()
                .filter(|id| self.voters.contains_key(id))
                .copied(),
        );
        out
    }

    /// Applies one agreed command at `index`.
    pub fn apply(&mut self, index: u64, cmd: Command) -> (Outcome, Vec<Emitted>) {
        if let Command::Fail { members } = &cmd {
            let members: BTreeSet<MemberId> = members.iter().copied().collect();
            return (Outcome::Applied { index }, self.fail(index, &members));
        }
        let (outcome, emitted) = self.apply_to_group(index, cmd);
        (outcome, emitted.into_iter().collect())
    }

    fn apply_to_group(&mut self, index: u64, cmd: Command) -> (Outcome, Option<Emitted>) {
        match cmd {
            Command::Fail { .. } => (Outcome::Applied { index }, None),
            Command::Join { group, member } => {
                if !self.voters.contains_key(&member) || self.failed.contains(&member) {
                    return (Outcome::NotMember, None);
                }
                let ids = self.groups.entry(group.clone()).or_default();
                if !ids.insert(member) {
                    return (Outcome::Applied { index }, None);
                }
                let ids = ids.clone();
                let event = CpgEvent::ConfChg {
                    group,
                    index,
                    members: self.members(ids.iter().copied()),
                    joined: vec![self.member(member)],
                    left: Vec::new(),
                    failed: Vec::new(),
                };
                (Outcome::Applied { index }, Some(Emitted { event, to: ids }))
            }
            Command::Leave { group, member } => {
                let Some(ids) = self.groups.get_mut(&group) else {
                    return (Outcome::NotMember, None);
                };
                if !ids.remove(&member) {
                    return (Outcome::NotMember, None);
                }
                let remaining = ids.clone();
                if remaining.is_empty() {
                    self.groups.remove(&group);
                }
                let mut to = remaining.clone();
                to.insert(member);
                let event = CpgEvent::ConfChg {
                    group,
                    index,
                    members: self.members(remaining),
                    joined: Vec::new(),
                    left: vec![self.member(member)],
                    failed: Vec::new(),
                };
                (Outcome::Applied { index }, Some(Emitted { event, to }))
            }
            Command::Mcast {
                group,
                sender,
                payload,
            } => {
                let Some(ids) = self.groups.get(&group) else {
                    return (Outcome::NotMember, None);
                };
                if !ids.contains(&sender) {
                    return (Outcome::NotMember, None);
                }
                let event = CpgEvent::Deliver {
                    group,
                    index,
                    sender,
                    payload: Bytes::from(payload),
                };
                let to = ids.clone();
                (Outcome::Applied { index }, Some(Emitted { event, to }))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn voters(ids: &[MemberId]) -> BTreeMap<MemberId, String> {
        ids.iter().map(|&id| (id, format!("n{id}"))).collect()
    }

    #[test]
    fn failed_member_is_reported_to_the_rest_of_each_of_its_groups() {
        let mut g = Groups::default();
        assert!(g.set_voters(1, voters(&[1, 2, 3])).is_empty());
        for m in [1, 2, 3] {
            g.apply(
                1 + m,
                Command::Join {
                    group: "a".into(),
                    member: m,
                },
            );
        }
        let out = g.set_voters(9, voters(&[1, 2]));
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].to, BTreeSet::from([1, 2]));
        let CpgEvent::ConfChg {
            failed, members, ..
        } = &out[0].event
        else {
            panic!("expected a configuration change");
        };
        assert_eq!(failed.iter().map(|m| m.id).collect::<Vec<_>>(), vec![3]);
        assert_eq!(members.len(), 2);
    }

    #[test]
    fn declared_failure_ends_group_membership_but_not_the_vote() {
        let mut g = Groups::default();
        g.set_voters(1, voters(&[1, 2, 3]));
        for m in [1, 2, 3] {
            g.apply(
                1 + m,
                Command::Join {
                    group: "a".into(),
                    member: m,
                },
            );
        }
        let (outcome, out) = g.apply(5, Command::Fail { members: vec![3] });
        assert_eq!(outcome, Outcome::Applied { index: 5 });
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].to, BTreeSet::from([1, 2]));
        let CpgEvent::ConfChg { failed, .. } = &out[0].event else {
            panic!("expected a configuration change");
        };
        assert_eq!(failed.iter().map(|m| m.id).collect::<Vec<_>>(), vec![3]);
        assert_eq!(g.failed(), &BTreeSet::from([3]));
        // A failed member cannot come back under the same incarnation.
        let join = Command::Join {
            group: "a".into(),
            member: 3,
        };
        assert_eq!(g.apply(6, join).0, Outcome::NotMember);
        // Removing it from the voters later reports nothing new and forgets it.
        assert!(g.set_voters(7, voters(&[1, 2])).is_empty());
        assert!(g.failed().is_empty());
    }

    #[test]
    fn non_member_cannot_join_or_multicast() {
        let mut g = Groups::default();
        g.set_voters(1, voters(&[1]));
        let join = Command::Join {
            group: "a".into(),
            member: 7,
        };
        assert_eq!(g.apply(2, join).0, Outcome::NotMember);
        let mcast = Command::Mcast {
            group: "a".into(),
            sender: 1,
            payload: vec![1],
        };
        assert_eq!(g.apply(3, mcast).0, Outcome::NotMember);
    }

    #[test]
    fn leaver_sees_its_own_leave_and_nothing_after() {
        let mut g = Groups::default();
        g.set_voters(1, voters(&[1, 2]));
        g.apply(
            2,
            Command::Join {
                group: "a".into(),
                member: 1,
            },
        );
        g.apply(
            3,
            Command::Join {
                group: "a".into(),
                member: 2,
            },
        );
        let (_, e) = g.apply(
            4,
            Command::Leave {
                group: "a".into(),
                member: 2,
            },
        );
        assert_eq!(
            e.into_iter().next().map(|e| e.to),
            Some(BTreeSet::from([1, 2]))
        );
        let mcast = Command::Mcast {
            group: "a".into(),
            sender: 1,
            payload: vec![],
        };
        let (_, e) = g.apply(5, mcast);
        assert_eq!(
            e.into_iter().next().map(|e| e.to),
            Some(BTreeSet::from([1]))
        );
    }
}
