//! Clusters of brokers on loopback for tests: a shared secret, member configurations, and
//! a cluster started member by member.

use crate::Broker;
use std::path::PathBuf;
use std::time::Duration;

/// A cluster secret file shared by the members of one test.
pub fn secret(name: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!(
        "ringmq-cluster-secret-{}-{name}",
        std::process::id()
    ));
    std::fs::write(&path, "test-cluster-secret\n").expect("temp dir is writable");
    path
}

/// The configuration of cluster member `node` that joins through `seeds`.
pub fn member_yaml(node: &str, seeds: &[&str], secret: &std::path::Path) -> String {
    let seeds: Vec<String> = seeds.iter().map(|s| format!("\"{s}\"")).collect();
    format!(
        "node_id: {node}\ncluster_listen: 127.0.0.1:0\ncluster_secret_file: {}\ncluster_seeds: [{}]\ncluster_join_timeout_ms: 10000\n",
        secret.display(),
        seeds.join(", ")
    )
}

/// Starts `n` members (node ids `{name}-0` …): the first founds the cluster, each next one
/// asks the ones before. Returns once every member is ready (`/readyz` 200): a member prints
/// its listening lines once admitted, which may be before it has applied its own
/// announcement or holds the majority's lease, and until then it refuses clients.
pub fn start_cluster(name: &str, n: usize) -> (Vec<Broker>, PathBuf) {
    start_cluster_with(name, n, "")
}

/// [`start_cluster`], each member's configuration ending with `extra` (YAML lines).
pub fn start_cluster_with(name: &str, n: usize, extra: &str) -> (Vec<Broker>, PathBuf) {
    let secret = secret(name);
    let mut members: Vec<Broker> = Vec::new();
    for i in 0..n {
        let seeds: Vec<String> = members.iter().filter_map(|m| m.cluster.clone()).collect();
        let seeds: Vec<&str> = seeds.iter().map(String::as_str).collect();
        members.push(Broker::start_with_config(
            &(member_yaml(&format!("{name}-{i}"), &seeds, &secret) + extra),
        ));
    }
    for m in &members {
        m.wait_ready(Duration::from_secs(30));
    }
    (members, secret)
}

/// Like [`start_cluster`], on ports fixed for the members' lives: a member killed and
/// started again ([`Broker::start_again`]) comes back at once on the same addresses, as a
/// restarted pod does behind its stable name — where a restart on new ports would leave
/// the others looking for it at the old ones.
pub fn start_cluster_on_fixed_ports(name: &str, n: usize) -> (Vec<Broker>, PathBuf) {
    let secret = secret(name);
    let ports: Vec<crate::Ports> = (0..n).map(|_| crate::Ports::allocate()).collect();
    let mut members: Vec<Broker> = Vec::new();
    for i in 0..n {
        let seeds: Vec<String> = ports[..i].iter().map(|p| p.cluster.to_string()).collect();
        let seeds: Vec<&str> = seeds.iter().map(String::as_str).collect();
        let yaml = member_yaml(&format!("{name}-{i}"), &seeds, &secret).replace(
            "cluster_listen: 127.0.0.1:0",
            &format!("cluster_listen: \"{}\"", ports[i].cluster),
        );
        members.push(Broker::start_on_ports(&yaml, ports[i]));
        members[i].wait_ready(Duration::from_secs(30));
    }
    (members, secret)
}

/// Waits until every member of `members` counts them all as consensus voters
/// (`/api/overview`'s `cluster.voters`): a member admitted a moment ago may still be a
/// learner, and until it votes, the loss of another member loses the majority. Tests that
/// kill members right after [`start_cluster`] wait for this first.
pub fn wait_voters(members: &[Broker], limit: Duration) {
    let deadline = std::time::Instant::now() + limit;
    for m in members {
        let admin = m.admin_client();
        loop {
            let overview = admin.get("/api/overview").expect("admin API answers");
            let voters = overview.body["cluster"]["voters"].as_u64().unwrap_or(0);
            if voters == members.len() as u64 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{} counts {voters} voters of {} within {limit:?}: {}",
                m.addr,
                members.len(),
                overview.body
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// A three-member cluster that stands in for one [`Broker`] in the single-broker suites
/// (`tests/suites/`), so that they run unchanged against one virtual broker: each new
/// connection goes to the next member in turn, and the members place new queues' primaries
/// with `queue_primary_locator: balanced`, so a queue declared on one member mostly lives on
/// another and the suites' publishes, consumes and acks cross the proxies.
pub struct VirtualBroker {
    members: Vec<Broker>,
    next: std::sync::atomic::AtomicUsize,
    _secret: SecretFile,
}

/// The cluster secret of a [`VirtualBroker`], removed with it.
struct SecretFile(PathBuf);

impl Drop for SecretFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Distinguishes the secret files of the virtual brokers of one test process.
static NEXT_VIRTUAL: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl VirtualBroker {
    /// Starts three members with balanced queue placement and waits until all are ready.
    pub fn start() -> Self {
        let n = NEXT_VIRTUAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let secret = secret(&format!("virtual-{n}"));
        let mut members: Vec<Broker> = Vec::new();
        for i in 0..3 {
            let seeds: Vec<String> = members.iter().filter_map(|m| m.cluster.clone()).collect();
            let seeds: Vec<&str> = seeds.iter().map(String::as_str).collect();
            // The suites check single-broker behaviour on a cluster, not failure detection:
            // a longer failure timeout gives the members a serving grace of 1.35 s (instead
            // of 0.2 s), so that a member starved of CPU for a moment on a loaded test
            // machine does not close the suite's clients with 320 (seen in CI).
            let yaml = member_yaml(&format!("virtual-{n}-{i}"), &seeds, &secret)
                + "queue_primary_locator: balanced\ncluster_failure_timeout_ms: 3000\n";
            members.push(Broker::start_with_config(&yaml));
        }
        for m in &members {
            m.wait_ready(std::time::Duration::from_secs(30));
        }
        VirtualBroker {
            members,
            // The first connection goes to the second member: placement breaks ties towards
            // the first, so a test's first queue lives elsewhere than its first client.
            next: std::sync::atomic::AtomicUsize::new(1),
            _secret: SecretFile(secret),
        }
    }

    fn next_member(&self) -> &Broker {
        let i = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        &self.members[i % self.members.len()]
    }

    /// A lapin connection to the next member.
    pub async fn connect(&self) -> lapin::Connection {
        self.next_member().connect().await
    }

    /// A lapin connection to the next member, and one channel.
    pub async fn channel(&self) -> (lapin::Connection, lapin::Channel) {
        self.next_member().channel().await
    }
}

/// Everything else (raw-socket helpers, the admin API) talks to the third member, which a
/// suite's first connection does not use.
impl std::ops::Deref for VirtualBroker {
    type Target = Broker;

    fn deref(&self) -> &Broker {
        &self.members[2]
    }
}
