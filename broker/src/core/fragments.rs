//! Fragmented shared queues (issue #15; the seed's "same producer to same consumer"): a
//! queue declared with [`FRAGMENTED_ARGUMENT`] is one name over several **fragments**, one
//! per active cluster member. Each fragment is an ordinary replicated queue whose primary is
//! its member at first, with a reserved name ([`fragment_name`]) and two reserved arguments
//! that say whose fragment of what it is. The fragmented queue's own record holds the
//! bindings and the arguments; messages live in the fragments:
//!
//! * a publish goes to the fragment of its **origin** — the member it arrived at, or the
//!   member a resumed session started on — so one producer's messages stay in one fragment,
//!   in order ([`crate::core::VHost::fragment_for`]);
//! * a consumer on a member reads that member's fragment, and the member pulls from the
//!   others when its own runs dry (`broker/fragments.rs`);
//! * the queue's own record stands in for a fragment that does not exist yet (a member
//!   that has not made its own): it takes what such a member publishes and is emptied into
//!   the fragments the same way.
//!
//! Pure: names and arguments only.

use super::error::{AmqpError, CoreResult};
use crate::amqp::{AMQPValue, FieldTable};
use sha2::{Digest, Sha256};
use std::sync::Arc;

/// The declare argument that makes a shared queue fragmented (a boolean).
pub const FRAGMENTED_ARGUMENT: &str = "qpid.cluster.fragmented";

/// The reserved argument naming the fragmented queue a fragment belongs to.
pub const FRAGMENT_OF_ARGUMENT: &str = "x-ringmq-fragment-of";

/// The reserved argument naming the member whose fragment it is.
pub const FRAGMENT_MEMBER_ARGUMENT: &str = "x-ringmq-fragment-member";

/// The consume argument (honoured on links only) that marks a member's pull of a
/// fragmented queue's messages from another queue (`proxy/fragment_pull.rs`): such a
/// consumer takes only what the queue's own consumers have no room for, and is no consumer
/// in the queue's counts.
pub const PULL_ARGUMENT: &str = "x-ringmq-pull";

/// The consumer priority of a pull: below any client's.
pub const PULL_PRIORITY: i32 = i32::MIN;

/// Every fragment's name starts with this: `amq.` keeps clients from declaring one.
pub const FRAGMENT_PREFIX: &str = "amq.fragment.";

/// Hex digits of the member's hash in a fragment's name.
const MEMBER_HASH_DIGITS: usize = 8;

/// The longest name a fragmented queue may have: its fragments' names add the prefix, the
/// member's hash and a dot, and a queue name is a short string (255 bytes).
pub const MAX_FRAGMENTED_NAME: usize = 255 - FRAGMENT_PREFIX.len() - MEMBER_HASH_DIGITS - 1;

/// Which fragment a queue is: of which queue, and whose.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FragmentOf {
    /// The fragmented queue.
    pub queue: Arc<str>,
    /// Node id of the member whose fragment it is.
    pub member: Arc<str>,
}

/// The name of `member`'s fragment of `queue`: the same on every member, short whatever the
/// node id's length (a hash of it), and readable (the queue's name at the end). The admin
/// API shows whose it is from its arguments.
pub fn fragment_name(member: &str, queue: &str) -> String {
    fragment_name_by_prefix(&fragment_prefix(member), queue)
}

/// What every fragment name of `member` starts with (the prefix and its hash, dotted): a
/// member keeps its own, so a publish does not hash its node id again.
pub fn fragment_prefix(member: &str) -> String {
    let digest = Sha256::digest(member.as_bytes());
    let hash: String = digest[..MEMBER_HASH_DIGITS / 2]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("{FRAGMENT_PREFIX}{hash}.")
}

/// The name of a fragment of `queue` whose member's [`fragment_prefix`] is `prefix`.
pub fn fragment_name_by_prefix(prefix: &str, queue: &str) -> String {
    let mut name = String::with_capacity(prefix.len() + queue.len());
    name.push_str(prefix);
    name.push_str(queue);
    name
}

/// Arguments of a fragmented queue that its fragments do not take: the flag itself (a
/// fragment is an ordinary queue) and where to put a primary (a fragment's is its member).
const NOT_FOR_FRAGMENTS: [&str; 3] = [
    FRAGMENTED_ARGUMENT,
    "qpid.cluster.primary",
    "x-queue-leader-locator",
];

/// The arguments of `member`'s fragment of `queue` (declared with `arguments`): the
/// queue's own (its limits, TTLs, dead-lettering, backups), less those in
/// [`NOT_FOR_FRAGMENTS`], plus whose fragment of what it is.
pub fn fragment_arguments(arguments: &FieldTable, queue: &str, member: &str) -> FieldTable {
    let mut table = arguments.inner().clone();
    for key in NOT_FOR_FRAGMENTS {
        table.remove(key);
    }
    table.insert(
        FRAGMENT_OF_ARGUMENT.into(),
        AMQPValue::LongString(queue.into()),
    );
    table.insert(
        FRAGMENT_MEMBER_ARGUMENT.into(),
        AMQPValue::LongString(member.into()),
    );
    FieldTable::from(table)
}

/// Reads [`FRAGMENTED_ARGUMENT`]: a boolean; anything else is refused with `bad`.
pub fn parse_fragmented(value: &AMQPValue) -> Result<bool, &'static str> {
    match value {
        AMQPValue::Boolean(b) => Ok(*b),
        _ => Err("expected a boolean"),
    }
}

/// Whose fragment of what a queue named `name` with `arguments` is, if it is a fragment:
/// both reserved arguments present and the name the one [`fragment_name`] gives them.
pub fn fragment_of(name: &str, arguments: &FieldTable) -> Option<FragmentOf> {
    let text = |key: &str| super::args::str_value(arguments.inner().get(key)?);
    let (queue, member) = (text(FRAGMENT_OF_ARGUMENT)?, text(FRAGMENT_MEMBER_ARGUMENT)?);
    (fragment_name(&member, &queue) == name).then(|| FragmentOf {
        queue: queue.into(),
        member: member.into(),
    })
}

/// Refuses a client's declare that carries a reserved fragment argument (403, as for the
/// reserved `amq.` names): only members declare fragments.
pub fn refuse_reserved(arguments: &FieldTable, queue: &str) -> CoreResult<()> {
    for key in [FRAGMENT_OF_ARGUMENT, FRAGMENT_MEMBER_ARGUMENT] {
        if arguments.inner().contains_key(key) {
            return Err(AmqpError::access_refused(format!(
                "queue '{queue}': argument '{key}' is reserved for the cluster's fragments"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fragment_names_are_stable_short_and_say_whose_fragment_of_what() {
        let long_member = "ringmq@".to_owned() + &"x".repeat(300);
        let name = fragment_name(&long_member, "orders");
        assert_eq!(name, fragment_name(&long_member, "orders"));
        assert!(name.starts_with(FRAGMENT_PREFIX) && name.ends_with(".orders"));
        assert_eq!(
            name.len(),
            FRAGMENT_PREFIX.len() + MEMBER_HASH_DIGITS + 1 + "orders".len()
        );
        assert_ne!(name, fragment_name("other", "orders"));
        let longest = "q".repeat(MAX_FRAGMENTED_NAME);
        assert_eq!(fragment_name("a", &longest).len(), 255);

        let args = fragment_arguments(&FieldTable::default(), "orders", &long_member);
        let of = fragment_of(&name, &args).expect("a fragment");
        assert_eq!((&*of.queue, &*of.member), ("orders", long_member.as_str()));
        assert_eq!(fragment_of("amq.fragment.00000000.orders", &args), None);
        assert_eq!(fragment_of(&name, &FieldTable::default()), None);
    }

    #[test]
    fn clients_cannot_send_the_reserved_arguments() {
        let args = fragment_arguments(&FieldTable::default(), "q", "m");
        let e = refuse_reserved(&args, "q").unwrap_err();
        assert_eq!(e.code, crate::amqp::codes::ACCESS_REFUSED);
        assert!(refuse_reserved(&FieldTable::default(), "q").is_ok());
        assert_eq!(
            parse_fragmented(&AMQPValue::LongString("yes".into())),
            Err("expected a boolean")
        );
    }
}
