//! What every restart test uses: members on fixed ports with a shared secret, waiting for
//! readiness and settling, and the checks a waiting member must pass.

use futures_lite::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection};
use ringmq_tests::{Broker, Ports, reply_code};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// `cluster_failure_timeout_ms` (the default, written out in every member's YAML).
pub(crate) const FAILURE_TIMEOUT: Duration = Duration::from_millis(700);
/// How long a cluster whose majority is back may take to be ready again.
pub(crate) const READY_LIMIT: Duration = Duration::from_secs(30);
/// Members per cluster.
pub(crate) const N: usize = 3;

/// The cluster secret file of one test; removed on drop.
pub(crate) struct Secret(pub(crate) PathBuf);

impl Drop for Secret {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

pub(crate) fn secret(name: &str) -> Secret {
    let path = std::env::temp_dir().join(format!(
        "ringmq-restart-secret-{}-{name}",
        std::process::id()
    ));
    std::fs::write(&path, "restart-test-secret\n").expect("temp dir is writable");
    Secret(path)
}

/// How a member finds the cluster.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Seeds {
    /// No seeds: the member founds the cluster when its data dir is empty (member 0 only).
    None,
    /// Every other member's cluster port, `cluster_founder` naming member 0 (the
    /// Kubernetes-style configuration every pod shares).
    Others,
}

pub(crate) fn node(name: &str, i: usize) -> String {
    format!("{name}-{i}")
}

pub(crate) fn member_yaml(
    name: &str,
    i: usize,
    ports: &[Ports],
    secret: &Path,
    seeds: Seeds,
    join_timeout_ms: u64,
) -> String {
    let seeds: Vec<String> = match seeds {
        Seeds::None => Vec::new(),
        Seeds::Others => ports
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .map(|(_, p)| format!("\"{}\"", p.cluster))
            .collect(),
    };
    format!(
        "node_id: {}\ncluster_listen: \"{}\"\ncluster_secret_file: {}\ncluster_seeds: [{}]\n\
         cluster_founder: {}\ncluster_join_timeout_ms: {join_timeout_ms}\n\
         cluster_failure_timeout_ms: {}\n",
        node(name, i),
        ports[i].cluster,
        secret.display(),
        seeds.join(", "),
        node(name, 0),
        FAILURE_TIMEOUT.as_millis(),
    )
}

/// Three members on fixed ports: member 0 founds (no seeds), 1 and 2 join; returns once all
/// three are ready and agree on a leader.
pub(crate) fn start_cluster(name: &str) -> (Vec<Broker>, Vec<Ports>, Secret) {
    start_cluster_of(name, N)
}

/// `n` members on fixed ports, as [`start_cluster`] starts three.
pub(crate) fn start_cluster_of(name: &str, n: usize) -> (Vec<Broker>, Vec<Ports>, Secret) {
    start_cluster_with(name, n, "")
}

/// `n` members on fixed ports, as [`start_cluster_of`] starts them, each with `extra_yaml`
/// (whole lines) added to its configuration.
pub(crate) fn start_cluster_with(
    name: &str,
    n: usize,
    extra_yaml: &str,
) -> (Vec<Broker>, Vec<Ports>, Secret) {
    let secret = secret(name);
    let ports: Vec<Ports> = (0..n).map(|_| Ports::allocate()).collect();
    let mut members: Vec<Broker> = Vec::new();
    for i in 0..n {
        let seeds = if i == 0 { Seeds::None } else { Seeds::Others };
        let yaml = member_yaml(name, i, &ports, &secret.0, seeds, 60_000) + extra_yaml;
        members.push(Broker::start_on_ports(&yaml, ports[i]));
        let started: Vec<usize> = (0..=i).collect();
        wait_ready(
            &mut members,
            &started,
            READY_LIMIT,
            &format!("{name}: start"),
        );
    }
    let all: Vec<usize> = (0..n).collect();
    wait_settled(&mut members, &all, READY_LIMIT, &format!("{name}: start"));
    (members, ports, secret)
}

pub(crate) fn readyz(b: &Broker) -> Result<ringmq::admin_client::Answer, String> {
    ringmq::admin_client::AdminClient::new(&b.admin_url(), None, None).get("/readyz")
}

/// `/api/overview`'s `cluster` object (status and body on any other answer).
pub(crate) fn cluster_view(b: &Broker) -> Result<Value, String> {
    let a = b.admin_client().get("/api/overview")?;
    if a.status != 200 {
        return Err(format!("/api/overview answered {}: {}", a.status, a.body));
    }
    Ok(a.body["cluster"].clone())
}

/// One line per member for failure messages: running or exit status, `/readyz`, overview.
pub(crate) fn describe(members: &mut [Broker]) -> String {
    let mut out = String::new();
    for (i, m) in members.iter_mut().enumerate() {
        let state = match m.exit_status() {
            Some(s) => format!("exited ({s})"),
            None => {
                let ready = readyz(m)
                    .map(|a| format!("{} {}", a.status, a.body))
                    .unwrap_or_else(|e| e);
                if ready.contains("cannot reach") {
                    // Hung, not slow: where its threads wait says why.
                    format!(
                        "readyz {ready}\n  ---- its threads ----\n{}",
                        m.thread_stacks()
                    )
                } else {
                    let view = cluster_view(m).unwrap_or_else(Value::String);
                    format!("readyz {ready}; cluster {view}")
                }
            }
        };
        out.push_str(&format!(
            "\n  member {i}: {state}\n  ---- log tail ----\n{}\n",
            m.log_tail(25)
        ));
    }
    out
}

/// Waits until every member in `which` answers `/readyz` 200.
pub(crate) fn wait_ready(members: &mut [Broker], which: &[usize], limit: Duration, what: &str) {
    let deadline = Instant::now() + limit;
    loop {
        let ready = which.iter().all(|&i| {
            let m = &mut members[i];
            m.exit_status().is_none() && readyz(m).is_ok_and(|a| a.status == 200)
        });
        if ready {
            return;
        }
        // A member that exited will not become ready: say so now, with its log, instead of
        // waiting out the limit (give its last lines a moment to reach the log).
        if which.iter().any(|&i| members[i].exit_status().is_some()) {
            std::thread::sleep(Duration::from_millis(200));
            panic!(
                "{what}: a member of {which:?} exited while the test waited for it to be ready:{}",
                describe(members)
            );
        }
        if Instant::now() > deadline {
            panic!(
                "{what}: members {which:?} not all ready within {limit:?}:{}",
                describe(members)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits until every member in `which` is ready, reports quorum, names the same leader (one
/// of the cluster's members) and counts every member as a voter.
pub(crate) fn wait_settled(members: &mut [Broker], which: &[usize], limit: Duration, what: &str) {
    let deadline = Instant::now() + limit;
    let voters = members.len();
    loop {
        let views: Vec<Option<Value>> = which
            .iter()
            .map(|&i| {
                let m = &mut members[i];
                if m.exit_status().is_some() || !readyz(m).is_ok_and(|a| a.status == 200) {
                    return None;
                }
                cluster_view(m).ok()
            })
            .collect();
        let settled = views.iter().all(|v| {
            v.as_ref().is_some_and(|v| {
                v["quorum"] == true && v["voters"] == voters && v["leader"].is_string()
            })
        }) && views
            .iter()
            .all(|v| v.as_ref().map(|v| &v["leader"]) == views[0].as_ref().map(|v| &v["leader"]));
        if settled {
            return;
        }
        if Instant::now() > deadline {
            panic!(
                "{what}: members {which:?} not ready with one leader and quorum within \
                 {limit:?}: {views:?}{}",
                describe(members)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `Ok(how)` if an AMQP client gets no working connection: refused with 320
/// CONNECTION_FORCED, or not accepted at all (closed, reset, or no answer in 5 s).
pub(crate) async fn amqp_refused(b: &Broker) -> Result<String, String> {
    let uri = b.uri();
    let attempt = Connection::connect(&uri, Default::default());
    match tokio::time::timeout(Duration::from_secs(5), attempt).await {
        Err(_) => Ok("no connection.open-ok within 5 s".into()),
        Ok(Err(e)) => match reply_code(&e) {
            Some(320) => Ok("refused with 320 CONNECTION_FORCED".into()),
            Some(code) => Err(format!(
                "refused with reply code {code}, the contract says 320: {e}"
            )),
            None => Ok(format!("not accepted: {e}")),
        },
        Ok(Ok(conn)) => {
            let _ = conn.close(200, "test".into()).await;
            Err("a working AMQP connection".into())
        }
    }
}

/// Checks, for `window`, that member `i` (alone with less than a majority of its last
/// configuration) stays running and unready: `/readyz` 503 saying it is waiting, overview
/// `cluster.quorum` false and no leader; then that AMQP refuses it and (if `wiring`) that
/// a queue PUT through the admin API does not succeed.
pub(crate) async fn assert_waiting(members: &mut [Broker], i: usize, window: Duration, what: &str) {
    let deadline = Instant::now() + window;
    let mut polls = 0;
    loop {
        if let Some(status) = members[i].exit_status() {
            panic!(
                "{what}: member {i} exited ({status}) while it should wait for a majority of \
                 its last configuration:{}",
                describe(members)
            );
        }
        let fail = |members: &mut [Broker], why: String| -> ! {
            panic!(
                "{what}: member {i}, {:?} into the wait (poll {polls}): {why}{}",
                window.saturating_sub(deadline.saturating_duration_since(Instant::now())),
                describe(members)
            )
        };
        match readyz(&members[i]) {
            Ok(a) if a.status == 503 && a.reason().to_lowercase().contains("waiting") => {}
            Ok(a) if a.status == 200 => fail(
                members,
                "/readyz answered 200 (ready) with less than a majority of its last \
                 configuration back: it founded or joined a new cluster"
                    .into(),
            ),
            Ok(a) => fail(
                members,
                format!(
                    "/readyz answered {} {} (want 503 with a reason saying it is waiting)",
                    a.status, a.body
                ),
            ),
            Err(e) => fail(members, format!("/readyz: {e}")),
        }
        match cluster_view(&members[i]) {
            // Still trying its seeds, it has no cluster view yet: it claims nothing either.
            Ok(v) if v.is_null() => {}
            Ok(v) if v["quorum"] == false && v["leader"].is_null() => {}
            Ok(v) => fail(
                members,
                format!("overview's cluster claims {v} (want quorum false, leader null)"),
            ),
            Err(e) => fail(members, e),
        }
        polls += 1;
        if Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    if let Err(e) = amqp_refused(&members[i]).await {
        panic!(
            "{what}: member {i} while waiting for a majority: {e}{}",
            describe(members)
        );
    }
}

/// Declares `queue` through member `b`, retrying (new connection each time) while the
/// cluster cannot commit (506) or the member refuses clients, for at most `limit`.
pub(crate) async fn declare_until_committed(
    b: &Broker,
    queue: &str,
    durable: bool,
    limit: Duration,
) -> Result<(), String> {
    let deadline = Instant::now() + limit;
    loop {
        let last = match declare_once(&b.uri(), queue, false, durable).await {
            Ok(_) => return Ok(()),
            Err(e) => e,
        };
        if Instant::now() > deadline {
            return Err(format!("not committed within {limit:?}; last: {last}"));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A passive declare of `queue` on `b`: its message count, or the error.
pub(crate) async fn passive(b: &Broker, queue: &str) -> Result<u32, String> {
    declare_once(&b.uri(), queue, true, false).await
}

/// One `queue.declare` (passive or not) on a new connection to `uri`: the queue's message
/// count, or what went wrong (connecting, the reply code, or no answer in 15 s).
pub(crate) async fn declare_once(
    uri: &str,
    queue: &str,
    passive: bool,
    durable: bool,
) -> Result<u32, String> {
    let attempt = async {
        let conn = Connection::connect(uri, Default::default())
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let ch = conn
            .create_channel()
            .await
            .map_err(|e| format!("channel: {e}"))?;
        let n = ch
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    passive,
                    durable,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|e| format!("queue.declare: {e} (code {:?})", reply_code(&e)))?
            .message_count();
        let _ = conn.close(200, "done".into()).await;
        Ok(n)
    };
    tokio::time::timeout(Duration::from_secs(15), attempt)
        .await
        .unwrap_or_else(|_| Err("no answer in 15 s".into()))
}

/// Queue `queue` as `b`'s admin API shows it (`None` while it answers anything but 200).
pub(crate) fn queue_view(b: &Broker, queue: &str) -> Option<Value> {
    let a = b
        .admin_client()
        .get(&format!("/api/queues/%2f/{queue}"))
        .ok()?;
    (a.status == 200).then_some(a.body)
}

/// Polls `b`'s view of `queue` until it satisfies `done`; panics with the last view after
/// `limit`.
pub(crate) fn wait_queue_view(
    b: &Broker,
    queue: &str,
    limit: Duration,
    what: &str,
    done: impl Fn(&Value) -> bool,
) -> Value {
    let deadline = Instant::now() + limit;
    loop {
        let view = queue_view(b, queue);
        if let Some(v) = view.as_ref().filter(|v| done(v)) {
            return v.clone();
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not within {limit:?}; last view {view:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Publishes `range` as `m<i>` through `b`; returns the ones confirmed (a connection that
/// fails mid-way leaves the rest unconfirmed).
pub(crate) async fn publish_range(
    b: &ringmq_tests::Broker,
    queue: &str,
    range: std::ops::Range<usize>,
) -> Vec<usize> {
    let Ok(conn) = lapin::Connection::connect(&b.uri(), Default::default()).await else {
        return Vec::new();
    };
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut pending = Vec::new();
    for i in range {
        let Ok(c) = ch
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                format!("m{i}").as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
        else {
            break;
        };
        pending.push((i, c));
    }
    let mut confirmed = Vec::new();
    for (i, c) in pending {
        if c.await.is_ok_and(|c| c.is_ack()) {
            confirmed.push(i);
        }
    }
    let _ = conn.close(200, "done".into()).await;
    confirmed
}

/// Consumes `count` messages through `b` and acks each; returns their numbers.
pub(crate) async fn consume_and_ack(
    b: &ringmq_tests::Broker,
    queue: &str,
    count: usize,
) -> Vec<usize> {
    let (conn, ch) = b.channel().await;
    ch.basic_qos(count as u16, BasicQosOptions::default())
        .await
        .unwrap();
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "cycle".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut acked = Vec::new();
    while acked.len() < count {
        let Ok(Some(Ok(d))) = tokio::time::timeout(Duration::from_secs(10), consumer.next()).await
        else {
            break;
        };
        d.acker.ack(BasicAckOptions::default()).await.unwrap();
        acked.push(
            String::from_utf8(d.data.clone()).unwrap()[1..]
                .parse()
                .unwrap(),
        );
    }
    // A round trip after the acks: the member has read them before the channel closes.
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            passive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    let _ = conn.close(200, "done".into()).await;
    acked
}

/// Starts member `i` again on its data directory, as a supervisor would: a member the
/// majority already declared failed exits (status 3) to rejoin as a new incarnation, and is
/// started once more.
pub(crate) fn restart_member(members: &mut [ringmq_tests::Broker], i: usize, what: &str) {
    let deadline = Instant::now() + READY_LIMIT;
    members[i].start_again();
    loop {
        if members[i].exit_status().is_some() {
            members[i].start_again();
        }
        if readyz(&members[i]).is_ok_and(|a| a.status == 200) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: member {i} not back");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Declares durable `queue` with `backups` backups through `b` (its primary), waits up to
/// `limit` until all of them are in sync, and returns their node ids in ring order.
pub(crate) async fn declare_replicated(
    b: &Broker,
    queue: &str,
    backups: i32,
    limit: Duration,
) -> Vec<String> {
    let mut args = FieldTable::default();
    args.insert(
        "qpid.cluster.backups".into(),
        lapin::types::AMQPValue::LongInt(backups),
    );
    // A member whose lease lapsed for a moment (a loaded machine) closes its clients with
    // 320 and says so; the declare is idempotent and asked again, for at most 10 s.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (conn, ch) = b.channel().await;
        let declared = ch
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                args.clone(),
            )
            .await;
        let _ = conn.close(200, "declared".into()).await;
        match declared {
            Ok(_) => break,
            Err(e) if reply_code(&e) == Some(320) && Instant::now() < deadline => {
                eprintln!("declare on its primary: {e}; asking again");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("declare on its primary: {e:?}"),
        }
    }
    let want = usize::try_from(backups).expect("backups >= 0");
    let view = wait_queue_view(b, queue, limit, "the backups in sync", |v| {
        v["in_sync_backup_nodes"]
            .as_array()
            .is_some_and(|a| a.len() == want)
    });
    view["in_sync_backup_nodes"]
        .as_array()
        .expect("in_sync_backup_nodes")
        .iter()
        .map(|n| n.as_str().expect("a node id").to_owned())
        .collect()
}

/// The index, among the first `n` members of cluster `name`, of the one whose node id is
/// `node`.
pub(crate) fn member_of(name: &str, n: usize, node: &str) -> usize {
    (0..n)
        .find(|&i| crate::harness::node(name, i) == node)
        .expect("a member's node id")
}

/// A counter or gauge of `b`'s `/metrics` (0 when absent).
pub(crate) fn metric(b: &Broker, series: &str) -> f64 {
    let Ok(a) = b.admin_client().get("/metrics") else {
        return 0.0;
    };
    let text = a.body.as_str().unwrap_or_default().to_owned();
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            (name == series).then(|| value.parse().ok())?
        })
        .unwrap_or(0.0)
}

/// The value of `series` — its name and labels as exposed, e.g.
/// `ringmq_replication_queue_backups{vhost="/",queue="q"}` — on `b`'s `/metrics/detailed`
/// (which has the per-queue series too); `None` while it is absent or `b` does not answer.
pub(crate) fn detailed_metric(b: &Broker, series: &str) -> Option<f64> {
    let a = b.admin_client().get("/metrics/detailed").ok()?;
    a.body
        .as_str()?
        .lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            (name == series).then(|| value.parse().ok())?
        })
}
