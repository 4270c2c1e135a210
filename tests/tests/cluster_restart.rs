//! Whole-cluster restarts of real broker processes (issue #11): a member keeps its consensus
//! state in its data directory, so a member started again on it is the same member, and a
//! member that holds cluster state never founds a new cluster. After a full stop it waits —
//! unready (`/readyz` 503 "waiting…"), refusing AMQP clients and wiring changes, reporting
//! no quorum — until a majority of its last configuration is back. Checked here: a full
//! restart in any order loses no wiring and no confirmed message; a lone restarted member
//! serves nobody; a leader frozen with SIGSTOP claims no quorum when it resumes after the
//! others moved on; twenty one-at-a-time crashes never leave the cluster stuck; and (root,
//! network namespaces) a founder restarted while cut off founds nothing.
//!
//! Members run on ports chosen before they start (`Ports::allocate`), so a restarted member
//! comes back at the addresses its peers know.

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection};
use ringmq_tests::{Broker, Ports, reply_code};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// `cluster_failure_timeout_ms` (the default, written out in every member's YAML).
const FAILURE_TIMEOUT: Duration = Duration::from_millis(1200);
/// How long a cluster whose majority is back may take to be ready again.
const READY_LIMIT: Duration = Duration::from_secs(30);
/// Members per cluster.
const N: usize = 3;

/// The cluster secret file of one test; removed on drop.
struct Secret(PathBuf);

impl Drop for Secret {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn secret(name: &str) -> Secret {
    let path = std::env::temp_dir().join(format!(
        "ringmq-restart-secret-{}-{name}",
        std::process::id()
    ));
    std::fs::write(&path, "restart-test-secret\n").expect("temp dir is writable");
    Secret(path)
}

/// How a member finds the cluster.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Seeds {
    /// No seeds: the member founds the cluster when its data dir is empty (member 0 only).
    None,
    /// Every other member's cluster port, `cluster_founder` naming member 0 (the
    /// Kubernetes-style configuration every pod shares).
    Others,
}

fn node(name: &str, i: usize) -> String {
    format!("{name}-{i}")
}

fn member_yaml(
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
fn start_cluster(name: &str) -> (Vec<Broker>, Vec<Ports>, Secret) {
    let secret = secret(name);
    let ports: Vec<Ports> = (0..N).map(|_| Ports::allocate()).collect();
    let mut members: Vec<Broker> = Vec::new();
    for i in 0..N {
        let seeds = if i == 0 { Seeds::None } else { Seeds::Others };
        members.push(Broker::start_on_ports(
            &member_yaml(name, i, &ports, &secret.0, seeds, 60_000),
            ports[i],
        ));
        let started: Vec<usize> = (0..=i).collect();
        wait_ready(
            &mut members,
            &started,
            READY_LIMIT,
            &format!("{name}: start"),
        );
    }
    wait_settled(
        &mut members,
        &[0, 1, 2],
        READY_LIMIT,
        &format!("{name}: start"),
    );
    (members, ports, secret)
}

fn readyz(b: &Broker) -> Result<ringmq::admin_client::Answer, String> {
    ringmq::admin_client::AdminClient::new(&b.admin_url(), None, None).get("/readyz")
}

/// `/api/overview`'s `cluster` object (status and body on any other answer).
fn cluster_view(b: &Broker) -> Result<Value, String> {
    let a = b.admin_client().get("/api/overview")?;
    if a.status != 200 {
        return Err(format!("/api/overview answered {}: {}", a.status, a.body));
    }
    Ok(a.body["cluster"].clone())
}

/// One line per member for failure messages: running or exit status, `/readyz`, overview.
fn describe(members: &mut [Broker]) -> String {
    let mut out = String::new();
    for (i, m) in members.iter_mut().enumerate() {
        let state = match m.exit_status() {
            Some(s) => format!("exited ({s})"),
            None => {
                let ready = readyz(m)
                    .map(|a| format!("{} {}", a.status, a.body))
                    .unwrap_or_else(|e| e);
                let view = cluster_view(m).unwrap_or_else(Value::String);
                format!("readyz {ready}; cluster {view}")
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
fn wait_ready(members: &mut [Broker], which: &[usize], limit: Duration, what: &str) {
    let deadline = Instant::now() + limit;
    loop {
        let ready = which.iter().all(|&i| {
            let m = &mut members[i];
            m.exit_status().is_none() && readyz(m).is_ok_and(|a| a.status == 200)
        });
        if ready {
            return;
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
/// of the cluster's members) and counts three voters.
fn wait_settled(members: &mut [Broker], which: &[usize], limit: Duration, what: &str) {
    let deadline = Instant::now() + limit;
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
            v.as_ref()
                .is_some_and(|v| v["quorum"] == true && v["voters"] == N && v["leader"].is_string())
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
async fn amqp_refused(b: &Broker) -> Result<String, String> {
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
async fn assert_waiting(members: &mut [Broker], i: usize, window: Duration, what: &str) {
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
async fn declare_until_committed(
    b: &Broker,
    queue: &str,
    durable: bool,
    limit: Duration,
) -> Result<(), String> {
    let deadline = Instant::now() + limit;
    let mut last;
    loop {
        let attempt = async {
            let conn = Connection::connect(&b.uri(), Default::default())
                .await
                .map_err(|e| format!("connect: {e}"))?;
            let ch = conn
                .create_channel()
                .await
                .map_err(|e| format!("channel: {e}"))?;
            ch.queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    durable,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|e| format!("queue.declare: {e} (code {:?})", reply_code(&e)))?;
            let _ = conn.close(200, "done".into()).await;
            Ok::<(), String>(())
        };
        match tokio::time::timeout(Duration::from_secs(15), attempt).await {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => last = e,
            Err(_) => last = "no answer in 15 s".into(),
        }
        if Instant::now() > deadline {
            return Err(format!("not committed within {limit:?}; last: {last}"));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A passive declare of `queue` on `b`: its message count, or the error.
async fn passive(b: &Broker, queue: &str) -> Result<u32, String> {
    let check = async {
        let conn = Connection::connect(&b.uri(), Default::default())
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
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|e| format!("passive declare: {e} (code {:?})", reply_code(&e)))?
            .message_count();
        let _ = conn.close(200, "done".into()).await;
        Ok(n)
    };
    tokio::time::timeout(Duration::from_secs(15), check)
        .await
        .unwrap_or_else(|_| Err("no answer in 15 s".into()))
}

const MESSAGES: usize = 50;

/// Which member restarts when, and with which configuration.
struct Order {
    /// Members in the order they are started again.
    order: [usize; 3],
    /// Seeds of member 0 when started again (its first start had none).
    founder_seeds: Seeds,
}

async fn full_restart_scenario(name: &str, plan: Order) {
    let (mut members, ports, secret) = start_cluster(name);
    let queue = "kept";

    // Member 0 (the founder) dies; the other two make a change it never sees.
    members[0].kill();
    declare_until_committed(&members[1], queue, true, READY_LIMIT)
        .await
        .unwrap_or_else(|e| panic!("{name}: declare on member 1: {e}{}", describe(&mut members)));
    {
        let (conn, ch) = members[1].channel().await;
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        for n in 0..MESSAGES {
            let confirm = ch
                .basic_publish(
                    "".into(),
                    queue.into(),
                    BasicPublishOptions::default(),
                    format!("m{n}").as_bytes(),
                    BasicProperties::default().with_delivery_mode(2),
                )
                .await
                .expect("basic.publish")
                .await
                .expect("a confirm");
            assert!(confirm.is_ack(), "{name}: message {n} confirmed");
        }
        let _ = conn.close(200, "done".into()).await;
    }

    // The other two die too: a full stop.
    members[1].kill();
    members[2].kill();

    // Started again one by one: until a majority of the last configuration is back, none
    // is ready; then they all are.
    let first = plan.order[0];
    for (step, &i) in plan.order.iter().enumerate() {
        let seeds = if i == 0 {
            plan.founder_seeds
        } else {
            Seeds::Others
        };
        // Member 0 started with the founder configuration gets a short join timeout: "no seed
        // answers in time" passes while it waits alone, and still it must found nothing.
        let join_timeout = if i == 0 && seeds == Seeds::Others {
            1_500
        } else {
            60_000
        };
        members[i].restart_with_config(&member_yaml(
            name,
            i,
            &ports,
            &secret.0,
            seeds,
            join_timeout,
        ));
        if step == 0 {
            assert_waiting(
                &mut members,
                i,
                3 * FAILURE_TIMEOUT,
                &format!("{name}: member {i} started alone after a full stop"),
            )
            .await;
        }
        if step == 1 {
            // Two of three: a majority of the last configuration is back.
            wait_settled(
                &mut members,
                &[first, i],
                READY_LIMIT,
                &format!("{name}: a majority back ({first} and {i})"),
            );
        }
    }
    wait_settled(
        &mut members,
        &[0, 1, 2],
        READY_LIMIT,
        &format!("{name}: all three back"),
    );

    // Nothing lost: the queue is known everywhere, its messages are on its owner.
    for (i, m) in members.iter().enumerate() {
        let found = passive(m, queue).await;
        assert!(
            found.is_ok(),
            "{name}: queue {queue:?} on member {i} after the full restart: {found:?}"
        );
    }
    let (_conn, ch) = members[1].channel().await;
    let got = ringmq_tests::bodies(&ch, queue).await;
    let want: Vec<String> = (0..MESSAGES).map(|n| format!("m{n}")).collect();
    assert_eq!(
        got, want,
        "{name}: the {MESSAGES} confirmed messages on member 1 (the queue's owner)"
    );
}

/// The verified bug: a full restart started by the member that missed the last change
/// founded a new cluster without it, and the others joined that cluster and dropped the
/// queue with its confirmed messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_restart_in_any_order_loses_nothing() {
    full_restart_scenario(
        "full012",
        Order {
            order: [0, 1, 2],
            founder_seeds: Seeds::None,
        },
    )
    .await;
}

/// The same, restarted as n2, n0, n1, the founder with the shared seed list and itself as
/// `cluster_founder` (the Kubernetes configuration).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_restart_in_another_order_loses_nothing() {
    full_restart_scenario(
        "full201",
        Order {
            order: [2, 0, 1],
            founder_seeds: Seeds::Others,
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_restarted_member_serves_no_client() {
    let name = "lone";
    let (mut members, ports, secret) = start_cluster(name);
    declare_until_committed(&members[0], "before", true, READY_LIMIT)
        .await
        .unwrap();
    for m in members.iter_mut() {
        m.kill();
    }
    // Member 0, the configured founder, with the shared seed list and a join timeout shorter
    // than the wait: nobody answers, and still it founds nothing.
    members[0].restart_with_config(&member_yaml(
        name,
        0,
        &ports,
        &secret.0,
        Seeds::Others,
        1_500,
    ));
    assert_waiting(
        &mut members,
        0,
        3 * FAILURE_TIMEOUT,
        "lone: member 0 started alone",
    )
    .await;
    let put = members[0].admin_client().call(
        "PUT",
        "/api/queues/%2F/lone-wiring",
        Some(&json!({"durable": true})),
    );
    if let Ok(a) = &put {
        assert!(
            !(200..300).contains(&a.status),
            "lone: a queue PUT through the admin API of a member without quorum answered {} {}",
            a.status,
            a.body
        );
    }
    // Still waiting after the refused change.
    assert_waiting(
        &mut members,
        0,
        FAILURE_TIMEOUT,
        "lone: member 0 after the admin PUT",
    )
    .await;

    for i in [1, 2] {
        members[i].start_again();
    }
    wait_settled(
        &mut members,
        &[0, 1, 2],
        READY_LIMIT,
        "lone: all three back",
    );
    for (i, m) in members.iter().enumerate() {
        assert!(
            passive(m, "before").await.is_ok(),
            "lone: queue 'before' on member {i}"
        );
        assert!(
            passive(m, "lone-wiring").await.is_err(),
            "lone: the admin PUT refused while alone must not appear later (member {i})"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn force_boot_starts_a_survivor_alone_with_its_state() {
    let name = "force";
    let (mut members, _ports, _secret) = start_cluster(name);
    declare_until_committed(&members[1], "kept", true, READY_LIMIT)
        .await
        .unwrap();
    for m in members.iter_mut() {
        m.kill();
    }
    // Members 0 and 2 are lost for good; member 1 alone waits, as it must...
    members[1].start_again();
    assert_waiting(&mut members, 1, FAILURE_TIMEOUT, "force: the lone survivor").await;
    // ...until the operator force-boots it: a new cluster from its own state.
    members[1].start_again_with(&["--cluster-force-boot"]);
    wait_ready(&mut members, &[1], READY_LIMIT, "force: force-booted");
    let view = cluster_view(&members[1]).unwrap();
    assert_eq!(view["voters"], 1, "force: a new cluster of one: {view}");
    assert!(
        passive(&members[1], "kept").await.is_ok(),
        "force: the survivor's queue is there after the force boot"
    );
    declare_until_committed(&members[1], "after-force", true, READY_LIMIT)
        .await
        .expect("force: the force-booted member takes wiring changes");
    let moved_aside = std::fs::read_dir(members[1].state_dir())
        .unwrap()
        .filter_map(Result::ok)
        .any(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("cluster.before-force-boot-")
        });
    assert!(moved_aside, "force: the old cluster state is kept aside");
    assert!(
        members[1].log_tail(200).contains("FORCE BOOT"),
        "force: the force boot says loudly what it costs"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigstop_of_the_leader_keeps_no_quorum_after_resume() {
    let name = "stop";
    let (mut members, _ports, _secret) = start_cluster(name);
    let leader = cluster_view(&members[0]).unwrap()["leader"]
        .as_str()
        .expect("a leader after settling")
        .to_owned();
    let l = (0..N)
        .find(|&i| node(name, i) == leader)
        .unwrap_or_else(|| panic!("leader {leader:?} is one of the members"));
    let others: Vec<usize> = (0..N).filter(|&i| i != l).collect();

    members[l].pause();
    let stopped = Instant::now();
    // The other two elect a leader among themselves and commit a change.
    let committed =
        declare_until_committed(&members[others[0]], "during-stop", true, READY_LIMIT).await;
    if let Err(e) = committed {
        members[l].resume();
        panic!(
            "stop: the two live members did not commit while member {l} (the leader) was \
             stopped: {e}{}",
            describe(&mut members)
        );
    }
    let new_leader = cluster_view(&members[others[0]]).unwrap()["leader"].clone();
    assert!(
        new_leader.is_string() && new_leader != leader.as_str(),
        "stop: the majority has a new leader, not the stopped {leader}: {new_leader}"
    );
    let remaining = (3 * FAILURE_TIMEOUT).saturating_sub(stopped.elapsed());
    tokio::time::sleep(remaining).await;

    // The first request the resumed member answers is already waiting in its accept queue
    // when it resumes.
    let admin = members[l].admin_url();
    let first = std::thread::spawn(move || {
        ringmq::admin_client::AdminClient::new(&admin, Some("guest"), Some("guest"))
            .get("/api/overview")
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    members[l].resume();
    let first = first.join().expect("the request thread");
    let outcome = match &first {
        Ok(a) if a.status == 200 => {
            if a.body["cluster"]["quorum"] == true {
                let has_change = members[l]
                    .admin_client()
                    .get("/api/queues/%2F/during-stop")
                    .map(|a| a.status);
                panic!(
                    "stop: the resumed former leader's first overview claims quorum while the \
                     majority moved on to {new_leader}: {} (GET of the majority's queue on it \
                     right after: {has_change:?}){}",
                    a.body["cluster"],
                    describe(&mut members)
                );
            }
            format!("first answer: cluster {}", a.body["cluster"])
        }
        Ok(a) => format!("first answer: status {} {}", a.status, a.body),
        Err(e) => format!("first request failed: {e}"),
    };
    eprintln!("stop: member {l} (the stopped leader) after SIGCONT — {outcome}");

    // Afterwards it may claim quorum only once it has rejoined: it then has the change the
    // majority committed without it. It may instead be evicted and exit with status 3.
    let deadline = Instant::now() + READY_LIMIT;
    loop {
        if let Some(status) = members[l].exit_status() {
            assert_eq!(
                status.code(),
                Some(3),
                "stop: a stopped member exits with status 3 (restart me){}",
                describe(&mut members)
            );
            eprintln!("stop: member {l} exited with status 3 after resuming (evicted)");
            break;
        }
        match cluster_view(&members[l]) {
            Ok(v) if v["quorum"] == true => {
                let has = members[l]
                    .admin_client()
                    .get("/api/queues/%2F/during-stop")
                    .map(|a| a.status);
                assert_eq!(
                    has,
                    Ok(200),
                    "stop: member {l} claims quorum ({v}) without the change the majority \
                     committed while it was stopped"
                );
                eprintln!("stop: member {l} rejoined with the majority's change");
                break;
            }
            _ => {}
        }
        assert!(
            Instant::now() < deadline,
            "stop: member {l} neither rejoined nor exited within {READY_LIMIT:?}{}",
            describe(&mut members)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The majority still commits.
    declare_until_committed(&members[others[1]], "after-stop", true, READY_LIMIT)
        .await
        .unwrap_or_else(|e| panic!("stop: the majority after the resume: {e}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_crash_at_a_time_twenty_times_never_gets_stuck() {
    let name = "cycle";
    let (mut members, _ports, _secret) = start_cluster(name);
    const CYCLES: usize = 20;
    for cycle in 0..CYCLES {
        let started = Instant::now();
        let victim = cycle % N;
        let live: Vec<usize> = (0..N).filter(|&i| i != victim).collect();
        members[victim].kill();
        let queue = format!("cycle-{cycle}");
        if let Err(e) =
            declare_until_committed(&members[live[cycle % 2]], &queue, true, READY_LIMIT).await
        {
            panic!(
                "cycle {cycle}: member {victim} killed, the other two did not commit {queue}: \
                 {e}{}",
                describe(&mut members)
            );
        }
        wait_settled(
            &mut members,
            &live,
            READY_LIMIT,
            &format!("cycle {cycle}: the two survivors of killing member {victim}"),
        );
        members[victim].start_again();
        wait_settled(
            &mut members,
            &[0, 1, 2],
            READY_LIMIT,
            &format!("cycle {cycle}: member {victim} restarted on its data dir"),
        );
        eprintln!(
            "cycle {cycle}: member {victim} killed and back in {:?}",
            started.elapsed()
        );
    }
    for cycle in 0..CYCLES {
        for (i, m) in members.iter().enumerate() {
            let found = passive(m, &format!("cycle-{cycle}")).await;
            assert!(
                found.is_ok(),
                "queue cycle-{cycle} on member {i} after {CYCLES} cycles: {found:?}"
            );
        }
    }
}

/// Network namespaces, as in `partition.rs`: a founder restarted while cut off from the
/// other two founds nothing.
mod cut_off {
    use super::*;
    use ringmq_tests::netns::{Net, member_addr};

    /// This test's subnet, 10.78.0.0/24 (`partition.rs` has 10.77).
    const SUBNET: u8 = 78;

    fn addr(i: usize) -> String {
        member_addr(SUBNET, i)
    }
    use std::process::{Child, Command, Stdio};

    /// A broker in member namespace `i` on fixed addresses, its data dir kept across
    /// restarts; killed by PID on drop.
    struct Member {
        i: usize,
        child: Option<Child>,
        data: PathBuf,
        log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    }

    impl Member {
        fn new(i: usize) -> Self {
            let data =
                std::env::temp_dir().join(format!("ringmq-cut-off-{}-{i}", std::process::id()));
            let _ = std::fs::remove_dir_all(&data);
            std::fs::create_dir_all(&data).unwrap();
            Member {
                i,
                child: None,
                data,
                log: Default::default(),
            }
        }

        /// Starts (or kills and starts again) the broker with `seeds` and `join_timeout_ms`.
        fn start(&mut self, net: &Net, seeds: Seeds, join_timeout_ms: u64, secret: &Path) {
            use std::io::{BufRead, BufReader};
            self.kill();
            let i = self.i;
            let ip = addr(i);
            let seeds: Vec<String> = match seeds {
                Seeds::None => Vec::new(),
                Seeds::Others => (0..N)
                    .filter(|&j| j != i)
                    .map(|j| format!("\"{}:25672\"", addr(j)))
                    .collect(),
            };
            let config = self.data.join("ringmq.yaml");
            std::fs::write(
                &config,
                format!(
                    "node_id: m{i}\ncluster_listen: \"{ip}:25672\"\ncluster_secret_file: {}\n\
                     cluster_seeds: [{}]\ncluster_founder: m0\n\
                     cluster_join_timeout_ms: {join_timeout_ms}\n\
                     cluster_failure_timeout_ms: {}\n",
                    secret.display(),
                    seeds.join(", "),
                    FAILURE_TIMEOUT.as_millis()
                ),
            )
            .unwrap();
            let mut child = Command::new("ip")
                .args(["netns", "exec", &net.members[i]])
                .arg(ringmq_tests::binary("ringmq-broker"))
                .args(["--amqp-listen", &format!("{ip}:5672")])
                .args(["--admin-listen", &format!("{ip}:15672")])
                .arg("--data-dir")
                .arg(self.data.join("data"))
                .arg("--config")
                .arg(&config)
                .env("RINGMQ_LOG", "info,openraft=warn")
                .env("RINGMQ_DEFAULT_USER", "test")
                .env("RINGMQ_DEFAULT_PASS", "test")
                .env("RINGMQ_PASSWORD_HASH_ITERATIONS", "10000")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            for pipe in [
                Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
                Box::new(child.stderr.take().unwrap()),
            ] {
                let sink = self.log.clone();
                std::thread::spawn(move || {
                    for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                        sink.lock().unwrap().push(line);
                    }
                });
            }
            self.log
                .lock()
                .unwrap()
                .push(format!("---- member {i} started (seeds {seeds:?}) ----"));
            self.child = Some(child);
            // Bounded wait for the admin port (readiness is the test's to check).
            let admin: std::net::SocketAddr = format!("{ip}:15672").parse().unwrap();
            let deadline = Instant::now() + Duration::from_secs(30);
            while Instant::now() < deadline
                && self.exited().is_none()
                && std::net::TcpStream::connect_timeout(&admin, Duration::from_millis(200)).is_err()
            {
                std::thread::sleep(Duration::from_millis(20));
            }
        }

        fn kill(&mut self) {
            if let Some(mut c) = self.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }

        fn exited(&mut self) -> Option<std::process::ExitStatus> {
            self.child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
        }

        fn admin(&self) -> ringmq::admin_client::AdminClient {
            ringmq::admin_client::AdminClient::new(
                &format!("http://{}:15672", addr(self.i)),
                Some("test"),
                Some("test"),
            )
        }

        fn uri(&self) -> String {
            format!("amqp://test:test@{}:5672/%2f", addr(self.i))
        }

        fn state(&mut self) -> String {
            if let Some(s) = self.exited() {
                return format!("exited ({s})");
            }
            let ready = self
                .admin()
                .get("/readyz")
                .map(|a| format!("{} {}", a.status, a.body))
                .unwrap_or_else(|e| e);
            let view = self
                .admin()
                .get("/api/overview")
                .map(|a| a.body["cluster"].to_string())
                .unwrap_or_else(|e| e);
            let log = self.log.lock().unwrap();
            format!(
                "readyz {ready}; cluster {view}\n  ---- log tail ----\n{}",
                log[log.len().saturating_sub(20)..].join("\n")
            )
        }

        /// Ready, with quorum and a leader.
        fn settled(&mut self) -> bool {
            self.exited().is_none()
                && self.admin().get("/readyz").is_ok_and(|a| a.status == 200)
                && self.admin().get("/api/overview").is_ok_and(|a| {
                    a.body["cluster"]["quorum"] == true && a.body["cluster"]["leader"].is_string()
                })
        }
    }

    impl Drop for Member {
        fn drop(&mut self) {
            self.kill();
            let _ = std::fs::remove_dir_all(&self.data);
        }
    }

    fn wait_settled(members: &mut [Member], which: &[usize], what: &str) {
        let deadline = Instant::now() + READY_LIMIT;
        while !which.iter().all(|&i| members[i].settled()) {
            if Instant::now() > deadline {
                let states: Vec<String> = members.iter_mut().map(Member::state).collect();
                panic!(
                    "{what}: members {which:?} not ready with quorum within {READY_LIMIT:?}:\n{}",
                    states.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    async fn declare(uri: &str, name: &str, passive: bool) -> Result<(), String> {
        let attempt = async {
            let conn = Connection::connect(uri, Default::default())
                .await
                .map_err(|e| format!("connect: {e}"))?;
            let ch = conn
                .create_channel()
                .await
                .map_err(|e| format!("channel: {e}"))?;
            ch.queue_declare(
                name.into(),
                QueueDeclareOptions {
                    passive,
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map(|_| ())
            .map_err(|e| format!("queue.declare: {e} (code {:?})", reply_code(&e)))
        };
        tokio::time::timeout(Duration::from_secs(15), attempt)
            .await
            .unwrap_or_else(|_| Err("no answer in 15 s".into()))
    }

    /// The cut-off member stays unready, without quorum or leader, for `window`.
    fn assert_cut_off_waits(members: &mut [Member], what: &str, window: Duration) {
        let deadline = Instant::now() + window;
        while Instant::now() < deadline {
            let m = &mut members[0];
            if let Some(s) = m.exited() {
                panic!("{what}: member 0 exited ({s}) instead of waiting");
            }
            let ready = m.admin().get("/readyz");
            let view = m.admin().get("/api/overview");
            let waiting = ready
                .as_ref()
                .is_ok_and(|a| a.status == 503 && a.reason().to_lowercase().contains("waiting"));
            let no_claims = view.as_ref().is_ok_and(|a| {
                a.status == 200
                    && a.body["cluster"]["quorum"] == false
                    && a.body["cluster"]["leader"].is_null()
            });
            if !(waiting && no_claims) {
                let state = m.state();
                panic!(
                    "{what}: member 0 cut off, want /readyz 503 \"waiting…\" and no \
                     quorum or leader; got readyz {:?}, overview {:?}\n{state}",
                    ready.map(|a| (a.status, a.body)),
                    view.map(|a| (a.status, a.body["cluster"].clone()))
                );
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    fn scenario(net: &Net) {
        let secret_guard = secret("cut-off");
        let secret = secret_guard.0.as_path();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let mut members: Vec<Member> = (0..N).map(Member::new).collect();
        members[0].start(net, Seeds::None, 60_000, secret);
        wait_settled(&mut members, &[0], "cut-off: founding");
        for i in [1, 2] {
            members[i].start(net, Seeds::Others, 60_000, secret);
            wait_settled(
                &mut members,
                &(0..=i).collect::<Vec<_>>(),
                "cut-off: joining",
            );
        }
        rt.block_on(declare(&members[0].uri(), "before", false))
            .unwrap();

        // The founder stops, is cut off, and is started again with its founding
        // configuration (no seeds): it must wait, not found.
        members[0].kill();
        net.isolate(0);
        members[0].start(net, Seeds::None, 60_000, secret);
        assert_cut_off_waits(&mut members, "cut-off, no seeds", 3 * FAILURE_TIMEOUT);
        let refused = rt.block_on(declare(&members[0].uri(), "split", false));
        assert!(
            refused.is_err(),
            "cut-off: the cut-off founder took a declare"
        );
        // The majority goes on meanwhile.
        let deadline = Instant::now() + READY_LIMIT;
        loop {
            match rt.block_on(declare(&members[1].uri(), "during", false)) {
                Ok(()) => break,
                Err(e) if Instant::now() > deadline => {
                    panic!("cut-off: the majority did not commit: {e}")
                }
                Err(_) => std::thread::sleep(Duration::from_millis(200)),
            }
        }
        // Again as the configured founder whose seeds do not answer within its join timeout.
        members[0].start(net, Seeds::Others, 1_500, secret);
        assert_cut_off_waits(
            &mut members,
            "cut-off, founder with seeds",
            3 * FAILURE_TIMEOUT,
        );

        net.heal();
        wait_settled(&mut members, &[0, 1, 2], "cut-off: after healing");
        for name in ["before", "during"] {
            let found = rt.block_on(declare(&members[0].uri(), name, true));
            assert!(
                found.is_ok(),
                "cut-off: {name} on the rejoined founder: {found:?}"
            );
        }
        let split = rt.block_on(declare(&members[1].uri(), "split", true));
        assert!(
            split.is_err(),
            "cut-off: the declare sent to the cut-off founder reached the majority"
        );
    }

    #[test]
    fn a_founder_restarted_while_cut_off_founds_nothing() {
        if !ringmq_tests::prereq::root_with(
            "the cut-off founder test",
            &[("ip", "iproute2"), ("nft", "nftables")],
        ) {
            return;
        }
        let net = Net::create("rmr", SUBNET, N);
        std::thread::scope(|s| {
            s.spawn(|| {
                net.enter_hub();
                scenario(&net);
            })
            .join()
            .expect("the scenario passes");
        });
    }
}
