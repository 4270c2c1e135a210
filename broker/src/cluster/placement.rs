//! Where a new queue's primary goes when its declare names none: a pure decision over the
//! members and the primaries the cluster map already records, so every member would decide
//! the same and it is testable without a cluster.

use serde::Deserialize;
use std::collections::HashMap;

/// The declare argument that picks the locator for one queue, under RabbitMQ's name (its
/// quorum-queue clients already send it).
pub const LOCATOR_ARGUMENT: &str = "x-queue-leader-locator";

/// How a queue declared without `qpid.cluster.primary` picks its primary: the config key
/// `queue_primary_locator`, or per queue [`LOCATOR_ARGUMENT`], with RabbitMQ's values.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PrimaryLocator {
    /// The member the declare arrived at: the client's own member serves it without a hop.
    #[default]
    ClientLocal,
    /// The member with the fewest primaries (ties: the first in ring order), so that queues
    /// declared through one member do not all load it.
    Balanced,
}

impl PrimaryLocator {
    /// The locator a declare argument names; `None` for a value RabbitMQ does not define.
    pub fn parse(value: &str) -> Option<Self> {
        match value {
            "client-local" => Some(Self::ClientLocal),
            "balanced" => Some(Self::Balanced),
            _ => None,
        }
    }

    /// The primary for a new queue declared on `here`, given the live members in ring order
    /// and the primaries of the existing queues.
    pub fn choose<'p>(
        self,
        here: &str,
        members: &[String],
        primaries: impl IntoIterator<Item = &'p str>,
    ) -> String {
        match self {
            Self::ClientLocal => here.to_owned(),
            Self::Balanced => {
                let mut load: HashMap<&str, usize> = HashMap::new();
                for p in primaries {
                    *load.entry(p).or_default() += 1;
                }
                members
                    .iter()
                    .min_by_key(|m| load.get(m.as_str()).copied().unwrap_or(0))
                    .map_or(here, String::as_str)
                    .to_owned()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn members() -> Vec<String> {
        ["a", "b", "c"].map(String::from).to_vec()
    }

    #[test]
    fn client_local_is_the_member_the_declare_arrived_at() {
        let m = members();
        assert_eq!(PrimaryLocator::ClientLocal.choose("b", &m, ["b", "b"]), "b");
    }

    #[test]
    fn balanced_picks_the_least_loaded_member_and_breaks_ties_in_ring_order() {
        let m = members();
        assert_eq!(PrimaryLocator::Balanced.choose("c", &m, []), "a");
        assert_eq!(PrimaryLocator::Balanced.choose("c", &m, ["a"]), "b");
        assert_eq!(PrimaryLocator::Balanced.choose("a", &m, ["a", "b"]), "c");
        assert_eq!(
            PrimaryLocator::Balanced.choose("a", &m, ["a", "b", "c", "c"]),
            "a"
        );
        // Primaries of members that left count for nobody.
        assert_eq!(
            PrimaryLocator::Balanced.choose("a", &m, ["x", "x", "a"]),
            "b"
        );
    }

    #[test]
    fn balanced_with_no_live_member_known_stays_here() {
        assert_eq!(PrimaryLocator::Balanced.choose("a", &[], []), "a");
    }

    #[test]
    fn only_rabbitmq_values_parse() {
        assert_eq!(
            PrimaryLocator::parse("balanced"),
            Some(PrimaryLocator::Balanced)
        );
        assert_eq!(
            PrimaryLocator::parse("client-local"),
            Some(PrimaryLocator::ClientLocal)
        );
        assert_eq!(PrimaryLocator::parse("random"), None);
    }
}
