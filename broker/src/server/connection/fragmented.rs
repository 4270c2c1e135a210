//! A client's whole-queue methods on a fragmented queue of a cluster
//! ([`crate::core::fragments`]): declare-ok counts, purge and delete cover every queue that
//! holds its messages, on whichever members their primaries are
//! ([`crate::broker::fragments`]). Each is answered like a proxied method: the connection
//! reads nothing more until the answer is in.

use super::proxied::Answer;
use super::{Connection, Lazy};
use crate::broker::fragments;

impl Connection {
    /// Whether `queue` is a fragmented queue this connection sees as one (on a cluster; a
    /// single broker's fragmented queue is one queue).
    pub(super) fn is_fragmented(&self, queue: &str, v: &mut Lazy) -> bool {
        self.broker.cluster().is_some() && v.get().is_fragmented(queue)
    }

    /// The queue a client's consume or get of `queue` reads: for a fragmented queue, this
    /// member's fragment. Another member's link names the very queue it means (its own
    /// client's was resolved there, and a pull takes from the queue it names).
    pub(super) fn read_target(&self, queue: String, v: &mut Lazy) -> String {
        if self.link {
            return queue;
        }
        v.get().read_target(&queue)
    }

    /// queue.declare-ok of fragmented queue `queue` with the whole queue's counts; after a
    /// declare that changed the wiring (`ensure`), once every active member has its
    /// fragment, so that a publish through any member finds it.
    pub(super) fn fragmented_declare_ok(
        &mut self,
        id: u16,
        queue: String,
        nowait: bool,
        ensure: bool,
    ) {
        let (broker, vhost) = (self.broker.clone(), self.vhost_name.clone());
        self.wait_remote(id, (50, 10), async move {
            let result = async {
                if ensure {
                    fragments::ensure_all(&broker, &vhost, &queue).await?;
                }
                let totals = fragments::totals(&broker, &vhost, &queue).await?;
                Ok((totals.ready, totals.consumers))
            }
            .await;
            Answer::Counted {
                queue,
                nowait,
                result,
            }
        });
    }

    /// queue.purge of fragmented queue `queue`: every part, on its primary.
    pub(super) fn fragmented_purge(&mut self, id: u16, queue: String, nowait: bool) {
        let (broker, vhost) = (self.broker.clone(), self.vhost_name.clone());
        self.wait_remote(id, (50, 30), async move {
            let result = fragments::purge(&broker, &vhost, &queue).await;
            Answer::Purged { nowait, result }
        });
    }

    /// queue.delete of fragmented queue `queue`, its fragments with it.
    pub(super) fn fragmented_delete(
        &mut self,
        id: u16,
        queue: String,
        flags: (bool, bool),
        nowait: bool,
    ) {
        let (broker, vhost) = (self.broker.clone(), self.vhost_name.clone());
        self.wait_remote(id, (50, 40), async move {
            let result = fragments::delete(&broker, &vhost, &queue, flags).await;
            Answer::Deleted {
                queue,
                nowait,
                result,
            }
        });
    }
}
