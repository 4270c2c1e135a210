//! Read-your-writes across members. A client that declared a queue through one member and
//! was answered declare-ok may at once publish to it, consume from it or get from it
//! through that member; its primary applies the same committed declare a moment later. So a
//! link channel that carries a client's work first tells the primary which cluster change
//! the sending member had applied (a passive `exchange.declare` of the default exchange
//! with [`AFTER_INDEX_ARGUMENT`]), and the primary answers it only once it has applied that
//! change too. Sent only when the index moved since the channel last said it: wiring
//! changes are rare next to messages.

use crate::amqp::{AMQPClass, AMQPValue, FieldTable, ShortString, exchange};
use std::time::Duration;
use tokio::sync::watch;

/// The argument of the passive default-exchange declare that names the cluster change the
/// sender had applied; honoured on links only.
pub const AFTER_INDEX_ARGUMENT: &str = "x-ringmq-after-index";

/// The argument of the passive default-exchange declare that tells the member at the other
/// end of a forwarding link on whose behalf the publishes after it were made (a member's
/// node id): it puts what they route to a fragmented queue in that member's fragment, as
/// the sender did ([`crate::core::VHost::publish_forwarded_as`]). Honoured on links only.
pub const ORIGIN_ARGUMENT: &str = "x-ringmq-publish-origin";

/// How long a member waits to apply a change another member already applied before it
/// answers anyway (and logs it): the cluster layer delivers committed changes to every
/// live member within a failure timeout.
pub const CATCH_UP_LIMIT: Duration = Duration::from_secs(10);

/// The newest cluster change (its agreed index) applied on this member.
#[derive(Debug)]
pub struct Applied {
    index: watch::Sender<u64>,
}

impl Default for Applied {
    fn default() -> Self {
        Self {
            index: watch::Sender::new(0),
        }
    }
}

impl Applied {
    /// The cluster layer applied the change at `index` (indexes only grow).
    pub fn advance(&self, index: u64) {
        self.index.send_if_modified(|i| {
            let newer = index > *i;
            if newer {
                *i = index;
            }
            newer
        });
    }

    /// The newest index applied.
    pub fn index(&self) -> u64 {
        *self.index.borrow()
    }

    /// Resolves once `index` is applied here, or after [`CATCH_UP_LIMIT`] (false).
    pub fn reached(&self, index: u64) -> impl Future<Output = bool> + Send + 'static {
        let mut rx = self.index.subscribe();
        async move {
            tokio::time::timeout(CATCH_UP_LIMIT, rx.wait_for(|i| *i >= index))
                .await
                .is_ok_and(|r| r.is_ok())
        }
    }
}

/// The passive default-exchange declare that tells the member at the other end of a link
/// channel that what follows on the channel needs the cluster change `index` applied. The
/// member reads nothing after it on that channel until it has applied it (or gave up after
/// [`CATCH_UP_LIMIT`]), so the sender need not wait for its declare-ok before what follows.
pub fn declare(index: u64) -> AMQPClass {
    let index = AMQPValue::LongLongInt(i64::try_from(index).unwrap_or(i64::MAX));
    marker(AFTER_INDEX_ARGUMENT, index, false)
}

/// The passive default-exchange declare (no reply asked) that names the origin of the
/// publishes after it on a link channel ([`ORIGIN_ARGUMENT`]); sent when it changes.
pub fn origin_declare(origin: &str) -> AMQPClass {
    marker(ORIGIN_ARGUMENT, AMQPValue::LongString(origin.into()), true)
}

/// A passive declare of the default exchange carrying `key: value`: how a link says
/// something about what follows on its channel in order with it, with a method every
/// member already answers.
fn marker(key: &str, value: AMQPValue, nowait: bool) -> AMQPClass {
    let mut arguments = FieldTable::default();
    arguments.insert(key.into(), value);
    AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
        exchange: ShortString::from(""),
        kind: ShortString::from("direct"),
        passive: true,
        durable: false,
        auto_delete: false,
        internal: false,
        nowait,
        arguments,
    }))
}

/// The origin an [`ORIGIN_ARGUMENT`] names, if the arguments carry one.
pub fn origin(arguments: &FieldTable) -> Option<String> {
    crate::core::args::str_value(arguments.inner().get(ORIGIN_ARGUMENT)?)
}

/// The index an [`AFTER_INDEX_ARGUMENT`] names, if the arguments carry one.
pub fn after_index(arguments: &FieldTable) -> Option<u64> {
    match arguments.inner().get(AFTER_INDEX_ARGUMENT)? {
        AMQPValue::LongLongInt(i) => u64::try_from(*i).ok(),
        _ => None,
    }
}
