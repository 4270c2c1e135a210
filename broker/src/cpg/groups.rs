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
    /// Voters declared failed (by a [`Command::Fail`]) and not started again since: out of
    /// every group, granted no lease, until their next incarnation starts
    /// ([`Command::Start`]).
    failed: BTreeSet<MemberId>,
    /// Each group's view: the index of its newest configuration change.
    views: BTreeMap<String, u64>,
}

impl Groups {
    /// Whether `member` currently belongs to any group (a snapshot must not skip its events).
    pub fn is_in_any_group(&self, member: MemberId) -> bool {
        self.groups.values().any(|g| g.contains(&member))
    }

    /// The groups `member` belongs to.
    pub fn groups_of(&self, member: MemberId) -> Vec<String> {
        self.groups
            .iter()
            .filter(|(_, ids)| ids.contains(&member))
            .map(|(name, _)| name.clone())
            .collect()
    }

    /// The view of `group`: the index of its newest configuration change (`None` while it
    /// has no members).
    #[cfg(test)]
    pub fn view(&self, group: &str) -> Option<u64> {
        self.groups
            .contains_key(group)
            .then(|| self.views.get(group).copied().unwrap_or(0))
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
            self.views.insert(name.clone(), index);
            // The failed members are told too: a live one stops on it anyway, and a restarted
            // one replaying its log learns where its membership ended.
            let mut to = ids.clone();
            to.extend(failed.iter().copied());
            out.push(Emitted {
                event: CpgEvent::ConfChg {
                    group: name.clone(),
                    index,
                    members: ids.iter().map(|&id| lookup(id)).collect(),
                    joined: Vec::new(),
                    left: Vec::new(),
                    failed: failed.into_iter().map(lookup).collect(),
                },
                to,
            });
        }
        self.groups.retain(|_, ids| !ids.is_empty());
        self.views.retain(|name, _| self.groups.contains_key(name));
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
        match cmd {
            Command::Fail { members } => {
                let members: BTreeSet<MemberId> = members.iter().copied().collect();
                (Outcome::Applied { index }, self.fail(index, &members))
            }
            Command::Start { member, reset, .. } => self.start(index, member, reset),
            cmd => {
                let (outcome, emitted) = self.apply_to_group(index, cmd);
                (outcome, emitted.into_iter().collect())
            }
        }
    }

    /// A new incarnation of voter `member` starts at `index`: it is no longer failed, and it
    /// is told which groups its previous incarnation still belongs to (none after `reset`,
    /// which ends those memberships as a failure would: the new incarnation could not
    /// resume them).
    fn start(&mut self, index: u64, member: MemberId, reset: bool) -> (Outcome, Vec<Emitted>) {
        if !self.voters.contains_key(&member) {
            return (Outcome::NotMember, Vec::new());
        }
        let mut out = Vec::new();
        if reset {
            out = self.fail(index, &BTreeSet::from([member]));
            for e in &mut out {
                e.to.remove(&member);
            }
        }
        self.failed.remove(&member);
        out.push(Emitted {
            event: CpgEvent::Started {
                index,
                groups: self.groups_of(member),
            },
            to: BTreeSet::from([member]),
        });
        (Outcome::Applied { index }, out)
    }

    fn apply_to_group(&mut self, index: u64, cmd: Command) -> (Outcome, Option<Emitted>) {
        match cmd {
            Command::Fail { .. } | Command::Start { .. } => (Outcome::Applied { index }, None),
            Command::Join { group, member } => {
                if !self.voters.contains_key(&member) || self.failed.contains(&member) {
                    return (Outcome::NotMember, None);
                }
                let ids = self.groups.entry(group.clone()).or_default();
                if !ids.insert(member) {
                    return (Outcome::Applied { index }, None);
                }
                let ids = ids.clone();
                self.views.insert(group.clone(), index);
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
                    self.views.remove(&group);
                } else {
                    self.views.insert(group.clone(), index);
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
                view,
                payload,
            } => {
                let Some(ids) = self.groups.get(&group) else {
                    return (Outcome::NotMember, None);
                };
                if !ids.contains(&sender) {
                    return (Outcome::NotMember, None);
                }
                let current = self.views.get(&group).copied().unwrap_or(0);
                if view.is_some_and(|v| v != current) {
                    return (Outcome::ViewChanged { view: current }, None);
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
        // The failed member is told too (a restarted one replays where its membership ended).
        assert_eq!(out[0].to, BTreeSet::from([1, 2, 3]));
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
        assert_eq!(out[0].to, BTreeSet::from([1, 2, 3]));
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
        assert_eq!(g.apply(6, join.clone()).0, Outcome::NotMember);
        // Its next incarnation can, once started.
        let (_, out) = g.apply(
            7,
            Command::Start {
                member: 3,
                incarnation: 1,
                reset: false,
            },
        );
        assert!(g.failed().is_empty());
        assert_eq!(
            out.into_iter().map(|e| e.event).collect::<Vec<_>>(),
            vec![CpgEvent::Started {
                index: 7,
                groups: Vec::new()
            }]
        );
        assert_eq!(g.apply(8, join).0, Outcome::Applied { index: 8 });
        g.apply(9, Command::Fail { members: vec![3] });
        // Removing it from the voters later reports nothing new and forgets it.
        assert!(g.set_voters(10, voters(&[1, 2])).is_empty());
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
            view: None,
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
            view: None,
            payload: vec![],
        };
        let (_, e) = g.apply(5, mcast);
        assert_eq!(
            e.into_iter().next().map(|e| e.to),
            Some(BTreeSet::from([1]))
        );
    }

    fn join(g: &mut Groups, index: u64, member: MemberId) {
        g.apply(
            index,
            Command::Join {
                group: "a".into(),
                member,
            },
        );
    }

    fn mcast(sender: MemberId, view: Option<u64>) -> Command {
        Command::Mcast {
            group: "a".into(),
            sender,
            view,
            payload: vec![7],
        }
    }

    #[test]
    fn a_multicast_for_an_older_view_is_refused() {
        let mut g = Groups::default();
        g.set_voters(1, voters(&[1, 2]));
        join(&mut g, 2, 1);
        assert_eq!(g.view("a"), Some(2));
        assert_eq!(
            g.apply(3, mcast(1, Some(2))).0,
            Outcome::Applied { index: 3 }
        );
        join(&mut g, 4, 2);
        assert_eq!(g.view("a"), Some(4));
        let (outcome, out) = g.apply(5, mcast(1, Some(2)));
        assert_eq!(outcome, Outcome::ViewChanged { view: 4 });
        assert!(out.is_empty());
        assert_eq!(g.apply(6, mcast(1, None)).0, Outcome::Applied { index: 6 });
    }

    #[test]
    fn a_restarted_member_resumes_its_groups_or_leaves_them_on_reset() {
        let mut g = Groups::default();
        g.set_voters(1, voters(&[1, 2]));
        join(&mut g, 2, 1);
        join(&mut g, 3, 2);
        let (_, out) = g.apply(
            4,
            Command::Start {
                member: 2,
                incarnation: 1,
                reset: false,
            },
        );
        assert_eq!(out.len(), 1);
        assert_eq!(
            out[0].event,
            CpgEvent::Started {
                index: 4,
                groups: vec!["a".into()]
            }
        );
        let (_, out) = g.apply(
            5,
            Command::Start {
                member: 2,
                incarnation: 2,
                reset: true,
            },
        );
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].to, BTreeSet::from([1]));
        assert!(matches!(&out[0].event, CpgEvent::ConfChg { failed, .. } if failed[0].id == 2));
        assert_eq!(
            out[1].event,
            CpgEvent::Started {
                index: 5,
                groups: Vec::new()
            }
        );
        assert_eq!(g.groups_of(2), Vec::<String>::new());
    }
}
