//! The application's delivery tags and the broker's, per channel, and which is which.
//!
//! While a session stays on one member the two are the same. When the session is taken over
//! by another member (its first member was lost), that member numbers its deliveries from 1
//! again, and what the lost member had handed out comes again from the queues, redelivered.
//! The application must see neither: its tags go on from the highest it had, one by one, and
//! a delivery it had already — recognised by the message's identity, its producer and number
//! (`x-ringmq-producer`, `x-ringmq-publish-seq`) — is not handed to it again. Such a
//! *returning* delivery takes a broker tag and gives the application none, so the mapping
//! is piecewise: a run of broker tags maps onto a run of application tags, and each returning
//! delivery starts a new run. A returning delivery the application has not settled yet is an
//! *alias*: its old application tag now stands for the new broker tag.
//!
//! Pure bookkeeping, no I/O (unit-tested below).

use std::collections::{BTreeMap, BTreeSet};

/// Application tags ↔ broker tags of one channel.
#[derive(Debug)]
pub(crate) struct TagMap {
    /// Runs by their first broker tag: that tag's application tag (the run goes on one by
    /// one). Starts as `{1: 1}`: the same numbers.
    runs: BTreeMap<u64, u64>,
    /// Returning deliveries the application held when they came: broker tag → its old
    /// application tag (kept after it settles them, for a resend of the settlement).
    aliases: BTreeMap<u64, u64>,
    /// The same, application tag → broker tag.
    alias_of_app: BTreeMap<u64, u64>,
    /// Every returning delivery's broker tag on the current numbering, aliases or not: a
    /// redelivery of one after a resume on the same member is not new either.
    returned: BTreeSet<u64>,
    /// The first application tag of the current connection's numbering: lower ones were
    /// handed out before the session was taken over.
    first_app: u64,
    /// The highest broker tag seen on the current numbering.
    highest_broker: u64,
}

impl Default for TagMap {
    fn default() -> Self {
        TagMap {
            runs: BTreeMap::from([(1, 1)]),
            aliases: BTreeMap::new(),
            alias_of_app: BTreeMap::new(),
            returned: BTreeSet::new(),
            first_app: 1,
            highest_broker: 0,
        }
    }
}

impl TagMap {
    /// The session was taken over: the broker's tags start from 1 again, and its tag 1 will
    /// be application tag `next_app`. The old aliases' broker is gone.
    pub fn start_over(&mut self, next_app: u64) {
        *self = TagMap {
            runs: BTreeMap::from([(1, next_app)]),
            first_app: next_app,
            ..TagMap::default()
        };
    }

    /// Whether `broker` is a tag this numbering has not seen yet (and, if so, remembers it).
    pub fn is_new(&mut self, broker: u64) -> bool {
        if broker > self.highest_broker {
            self.highest_broker = broker;
            true
        } else {
            false
        }
    }

    /// The application tag of broker tag `broker`: its alias's, or its run's.
    pub fn app(&self, broker: u64) -> u64 {
        if let Some(&app) = self.aliases.get(&broker) {
            return app;
        }
        let (&first, &app) = self
            .runs
            .range(..=broker)
            .next_back()
            .expect("the first run starts at broker tag 1");
        app + (broker - first)
    }

    /// Whether broker tag `broker` is a returning delivery.
    pub fn was_returned(&self, broker: u64) -> bool {
        self.returned.contains(&broker)
    }

    /// Broker tag `broker` is a returning delivery: it takes no application tag, so the next
    /// broker tag gets the one it would have had. `held` is the application tag the
    /// application still holds it under, if it does.
    pub fn returned(&mut self, broker: u64, held: Option<u64>) {
        let app = self.app(broker);
        self.runs.insert(broker + 1, app);
        self.returned.insert(broker);
        if let Some(held) = held {
            self.aliases.insert(broker, held);
            self.alias_of_app.insert(held, broker);
        }
    }

    /// The broker tag of application tag `app` on the current numbering; `None` for one
    /// handed out before the session was taken over that has not returned.
    pub fn broker(&self, app: u64) -> Option<u64> {
        if let Some(&broker) = self.alias_of_app.get(&app) {
            return Some(broker);
        }
        if app < self.first_app {
            return None;
        }
        // The run holding `app`: the last whose first application tag is at or below it,
        // and whose next run does not start at or before the broker tag it gives.
        let mut found = None;
        for (&first, &start) in &self.runs {
            if start > app {
                break;
            }
            found = Some(first + (app - start));
        }
        found
    }

    /// Whether `app` was handed out on the current numbering (not before a takeover).
    pub fn is_current(&self, app: u64) -> bool {
        app >= self.first_app
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn on_one_member_the_tags_are_the_brokers() {
        let mut t = TagMap::default();
        for b in 1..=5 {
            assert!(t.is_new(b));
            assert_eq!(t.app(b), b);
            assert_eq!(t.broker(b), Some(b));
        }
        assert!(
            !t.is_new(3),
            "a redelivery after a resume on the same member"
        );
    }

    #[test]
    fn after_a_takeover_returning_deliveries_take_no_application_tag() {
        let mut t = TagMap::default();
        // The application had 1..=5; 4 and 5 it still holds. The new member sends 4 again
        // (broker 1), a message the application never had (broker 2), 5 again (broker 3),
        // and a new one (broker 4).
        t.start_over(6);
        assert!(t.is_new(1));
        t.returned(1, Some(4));
        assert!(t.is_new(2));
        assert_eq!(t.app(2), 6, "the next application tag, no gap");
        assert!(t.is_new(3));
        t.returned(3, Some(5));
        assert!(t.is_new(4));
        assert_eq!(t.app(4), 7);
        assert_eq!(t.broker(4), Some(1), "the alias");
        assert_eq!(t.broker(5), Some(3));
        assert_eq!(t.broker(6), Some(2));
        assert_eq!(t.broker(7), Some(4));
        assert_eq!(t.broker(3), None, "handed out before, not returned");
        assert!(t.was_returned(1) && !t.was_returned(2));
        assert_eq!(t.app(1), 4, "the alias names the old tag");
    }

    #[test]
    fn a_returning_delivery_the_application_settled_still_takes_its_broker_tag() {
        let mut t = TagMap::default();
        t.start_over(10);
        t.is_new(1);
        t.returned(1, None);
        t.is_new(2);
        assert_eq!(t.app(2), 10);
        assert_eq!(t.broker(10), Some(2));
        assert!(t.is_current(10) && !t.is_current(9));
    }
}
