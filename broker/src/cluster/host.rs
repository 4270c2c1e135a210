//! What the cluster layer needs of the broker it runs in, as a trait the cluster owns: the
//! cluster layer never reaches up into the broker or the server.

use super::map::WiringStore;
use super::roles::{QueueRoles, Roles};
use tokio::sync::watch;

/// What the cluster layer needs of the broker it runs in: the wiring store the map changes,
/// plus the two things a member does to the broker outside the map. A trait the cluster
/// owns, so that the cluster layer never reaches up into the broker or the server.
pub trait ClusterHost: WiringStore + Send + 'static {
    /// The live members changed: `hosts` are their AMQP addresses, for the clients of every
    /// vhost (`amq.qpid`); `nodes` their node ids, for the queues they own (a queue whose
    /// primary is not among them refuses publishes).
    fn members_changed(&mut self, hosts: &[String], nodes: &[String]);
    /// Queue `queue` of `vhost` has new roles (`None`: it has none any more): its primary,
    /// where its messages live, is `roles.primary`.
    fn roles_changed(&mut self, vhost: &str, queue: &str, roles: Option<&QueueRoles>);
    /// This process's incarnation started ([`CpgEvent::Started`]): the roles a restart's
    /// replay passed through were not the last, `roles` are. A copy this member holds of a
    /// queue it is neither primary nor backup of may go now, and from here on whenever the
    /// roles say so (never during the replay: a role it lost there it may have got back
    /// later, with a copy caught up outside the agreed log).
    fn started(&mut self, roles: &Roles);
    /// Session `id` was held by this member and no longer is (another member took it over
    /// from the directory, or it ended): what this member kept of it — its channels'
    /// publishing, unacked deliveries, exclusive queues — goes, and a connection still
    /// attached to it here is closed.
    fn session_left(&mut self, id: &str);
    /// Session `id` ended (closed, or timed out), as every member applies it: what the
    /// session owned cluster-wide — its exclusive queues — goes.
    fn session_ended(&mut self, id: &str);
    /// Every cluster event up to agreed index `index` is applied here — whatever it was: a
    /// wiring op, a membership change, a hello, a change of roles or sessions. Another
    /// member's link names the index it had applied when it asks for read-your-writes
    /// (`proxy::catch_up`), and it counts every event too.
    fn event_applied(&mut self, index: u64);
    /// Saves what must survive before the process exits (the journal).
    fn shutdown(&mut self);
    /// The newest journal sequence number handed to the journal, and a watch of the newest
    /// one on disk: a map checkpoint is saved only once every change before it is.
    fn journal(&self) -> (u64, watch::Receiver<u64>);
}
