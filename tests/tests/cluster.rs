//! Three real broker processes on 127.0.0.1 as one cluster: wiring declared on one member is
//! there on every member, conflicts resolve the same way everywhere, clients learn the
//! members from `known-hosts` and `amq.qpid`, and a member killed with SIGKILL rejoins and
//! catches up with what changed while it was down.

use lapin::options::{
    BasicGetOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use ringmq_tests::cluster::{member_yaml, secret, start_cluster};
use ringmq_tests::{Broker, queue_counts, reply_code};
use std::time::{Duration, Instant};

async fn passive_queue(b: &Broker, name: &str) -> Result<u32, Option<u16>> {
    let (_c, ch) = b.channel().await;
    queue_counts(&ch, name).await.map(|(ready, _)| ready)
}

async fn passive_exchange(b: &Broker, name: &str) -> Result<(), Option<u16>> {
    let (_c, ch) = b.channel().await;
    ch.exchange_declare(
        name.into(),
        lapin::ExchangeKind::Topic,
        ExchangeDeclareOptions {
            passive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .map_err(|e| reply_code(&e))
}

#[tokio::test]
async fn wiring_declared_on_one_member_exists_on_every_member() {
    let (members, _secret) = start_cluster("wiring", 3);
    let (_ca, a) = members[0].channel().await;
    a.exchange_declare(
        "orders".into(),
        lapin::ExchangeKind::Topic,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    a.queue_declare(
        "billing".into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    a.queue_bind(
        "billing".into(),
        "orders".into(),
        "order.#".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    for m in &members {
        assert_eq!(passive_queue(m, "billing").await, Ok(0), "on {}", m.addr);
        assert_eq!(passive_exchange(m, "orders").await, Ok(()), "on {}", m.addr);
    }

    // A server-named queue made on another member has the same name everywhere.
    let (_cb, b) = members[1].channel().await;
    let named = b
        .queue_declare(
            "".into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    assert!(named.name().as_str().starts_with("amq.gen-"));
    assert_eq!(
        passive_queue(&members[2], named.name().as_str()).await,
        Ok(0)
    );

    // Redeclaring with other properties on another member is the error RabbitMQ gives.
    let e = b
        .queue_declare(
            "billing".into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(reply_code(&e), Some(406));

    // A delete on the third member removes it everywhere.
    let (_cc, c) = members[2].channel().await;
    c.queue_delete("billing".into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    for m in &members {
        assert_eq!(
            passive_queue(m, "billing").await,
            Err(Some(404)),
            "on {}",
            m.addr
        );
    }

    // The admin API of any member lists every member, in ring order.
    let listed = members[1].admin_client().get("/api/members").unwrap().body;
    let ids: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["wiring-0", "wiring-1", "wiring-2"]);

    // Every member names the same consensus leader, one of them, in its overview.
    let deadline = Instant::now() + Duration::from_secs(5);
    let leaders = loop {
        let leaders: Vec<serde_json::Value> = members
            .iter()
            .map(|m| {
                m.admin_client().get("/api/overview").unwrap().body["cluster"]["leader"].clone()
            })
            .collect();
        if leaders.iter().all(|l| *l == leaders[0] && !l.is_null()) {
            break leaders;
        }
        assert!(
            Instant::now() < deadline,
            "members disagree on the leader: {leaders:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(ids.contains(&leaders[0].as_str().unwrap()), "{leaders:?}");
}

#[tokio::test]
async fn concurrent_conflicting_declares_resolve_the_same_way_everywhere() {
    let (members, _secret) = start_cluster("conflict", 3);
    let mut tasks = Vec::new();
    for round in 0..10 {
        for (i, m) in members.iter().enumerate() {
            let uri = m.uri();
            tasks.push(tokio::spawn(async move {
                let conn = lapin::Connection::connect(&uri, Default::default())
                    .await
                    .unwrap();
                let ch = conn.create_channel().await.unwrap();
                let durable = i % 2 == 0;
                ch.queue_declare(
                    format!("contested-{round}").as_str().into(),
                    QueueDeclareOptions {
                        durable,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await
                .map(|_| durable)
                .map_err(|e| reply_code(&e))
            }));
        }
    }
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await.unwrap());
    }
    for round in 0..10 {
        let mine = &results[round * 3..round * 3 + 3];
        let winners: Vec<bool> = mine.iter().filter_map(|r| r.ok()).collect();
        assert!(!winners.is_empty(), "round {round}: {mine:?}");
        assert!(
            winners.iter().all(|d| *d == winners[0]),
            "round {round}: only one durability can win: {mine:?}"
        );
        assert!(
            mine.iter().all(|r| r.is_ok() || *r == Err(Some(406))),
            "round {round}: losers get 406: {mine:?}"
        );
        let name = format!("contested-{round}");
        let durable: Vec<bool> = members
            .iter()
            .map(|m| {
                let q = m
                    .admin_client()
                    .get(&format!("/api/queues/%2F/{name}"))
                    .unwrap()
                    .body;
                q["durable"].as_bool().unwrap()
            })
            .collect();
        assert_eq!(
            durable,
            vec![winners[0]; 3],
            "round {round}: every member agrees"
        );
    }
}

#[tokio::test]
async fn clients_learn_the_members_from_known_hosts_and_amq_qpid() {
    let (mut members, _secret) = start_cluster("hosts", 3);
    let addrs: Vec<String> = members.iter().map(|m| m.addr.to_string()).collect();
    for m in &members {
        let target = ringmq::client::Target::parse(&m.uri()).unwrap();
        let raw = ringmq::client::RawClient::connect(&target).await.unwrap();
        let mut hosts: Vec<String> = raw.known_hosts.split(',').map(str::to_owned).collect();
        hosts.sort();
        let mut want = addrs.clone();
        want.sort();
        assert_eq!(hosts, want, "known-hosts from {}", m.addr);
    }

    let (_c, ch) = members[2].channel().await;
    ch.queue_declare(
        "failover".into(),
        QueueDeclareOptions {
            exclusive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_bind(
        "failover".into(),
        "amq.qpid".into(),
        "cluster".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    members[1].kill();

    let deadline = Instant::now() + Duration::from_secs(15);
    let survivors: Vec<String> = vec![addrs[0].clone(), addrs[2].clone()];
    loop {
        let got = ch
            .basic_get("failover".into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap();
        if let Some(msg) = got {
            assert!(msg.delivery.data.is_empty(), "notices have an empty body");
            let headers = msg
                .delivery
                .properties
                .headers()
                .clone()
                .unwrap_or_default();
            let Some(AMQPValue::FieldArray(list)) = headers.inner().get("qpid.known.hosts") else {
                panic!("no qpid.known.hosts header in {headers:?}");
            };
            let hosts: Vec<String> = list
                .as_slice()
                .iter()
                .map(|v| match v {
                    AMQPValue::LongString(s) => s.to_string(),
                    other => panic!("host entry {other:?}"),
                })
                .collect();
            if hosts == survivors {
                break;
            }
        }
        assert!(
            Instant::now() < deadline,
            "no notice listing only the survivors {survivors:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn a_member_killed_with_sigkill_rejoins_and_catches_up() {
    let (mut members, secret) = start_cluster("rejoin", 3);
    let (_ca, a) = members[0].channel().await;
    for name in ["kept", "dropped"] {
        a.queue_declare(
            name.into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    }
    members[1].kill();
    // Changes while it is down: two of three members are a majority.
    a.queue_declare(
        "added".into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    a.queue_delete("dropped".into(), QueueDeleteOptions::default())
        .await
        .unwrap();

    let seeds: Vec<String> = [&members[0], &members[2]]
        .iter()
        .filter_map(|m| m.cluster.clone())
        .collect();
    let seeds: Vec<&str> = seeds.iter().map(String::as_str).collect();
    members[1].restart_with_config(&member_yaml("rejoin-1", &seeds, &secret));
    let back = &members[1];
    // A restarted member listens at once and serves clients once it has caught up.
    back.wait_ready(Duration::from_secs(30));
    assert_eq!(passive_queue(back, "kept").await, Ok(0));
    assert_eq!(passive_queue(back, "added").await, Ok(0));
    assert_eq!(
        passive_queue(back, "dropped").await,
        Err(Some(404)),
        "a queue deleted while the member was down is gone from it too"
    );
    // It takes part again: a declare on it reaches the others.
    let (_cb, b) = back.channel().await;
    b.queue_declare(
        "after".into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    assert_eq!(passive_queue(&members[0], "after").await, Ok(0));
    assert_eq!(passive_queue(&members[2], "after").await, Ok(0));
}

#[test]
fn a_member_with_the_wrong_secret_is_refused() {
    let (members, _secret) = start_cluster("stranger", 1);
    let wrong = std::env::temp_dir().join(format!("ringmq-wrong-secret-{}", std::process::id()));
    std::fs::write(&wrong, "not-the-secret").unwrap();
    let data = std::env::temp_dir().join(format!("ringmq-stranger-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&data);
    std::fs::create_dir_all(&data).unwrap();
    let config = data.join("ringmq.yaml");
    std::fs::write(&config, "cluster_join_timeout_ms: 3000\n").unwrap();
    let out = std::process::Command::new(ringmq_tests::binary("ringmq-broker"))
        .args([
            "--amqp-listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .arg("--data-dir")
        .arg(data.join("data"))
        .arg("--config")
        .arg(&config)
        .args(["--cluster-listen", "127.0.0.1:0", "--cluster-seeds"])
        .arg(members[0].cluster.as_deref().unwrap())
        .arg("--cluster-secret-file")
        .arg(&wrong)
        .env("RINGMQ_LOG", "warn")
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&data);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("cannot join the cluster"),
        "a clear reason: {stderr}"
    );
    assert!(
        members[0]
            .log
            .lock()
            .unwrap()
            .iter()
            .any(|l| l.contains("cluster peer refused")),
        "the member logs the stranger"
    );
}

#[tokio::test]
async fn ringmqctl_local_cluster_starts_a_working_cluster_and_stops_it() {
    use std::io::BufRead;
    let dir = std::env::temp_dir().join(format!("ringmq-local-cluster-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut ctl = std::process::Command::new(ringmq_tests::binary("ringmqctl"))
        .args([
            "local-cluster",
            "--members",
            "3",
            "--base-port",
            "0",
            "--data-dir",
        ])
        .arg(&dir)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(ctl.stdout.take().unwrap()).lines();
    let mut uris = Vec::new();
    while uris.len() < 3 {
        let line = lines
            .next()
            .expect("local-cluster prints one line per member")
            .unwrap();
        if let Some(uri) = line.split_whitespace().find(|w| w.starts_with("amqp://")) {
            uris.push(format!("{uri}%2f"));
        }
    }
    let connect = |uri: String| async move {
        lapin::Connection::connect(&uri, Default::default())
            .await
            .unwrap()
    };
    let first = connect(uris[0].clone()).await;
    let ch = first.create_channel().await.unwrap();
    ch.queue_declare(
        "local".into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let last = connect(uris[2].clone()).await;
    let ch = last.create_channel().await.unwrap();
    ch.queue_declare(
        "local".into(),
        QueueDeclareOptions {
            passive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("the queue declared on the first member exists on the last");

    // SAFETY: signalling the child process this test started.
    unsafe { libc::kill(ctl.id() as libc::pid_t, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(20);
    while matches!(ctl.try_wait(), Ok(None)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let status = ctl.try_wait().unwrap();
    if status.is_none() {
        let _ = ctl.kill();
    }
    assert!(
        status.is_some_and(|s| s.success()),
        "local-cluster exits cleanly"
    );
    for uri in &uris {
        let addr = uri
            .trim_start_matches("amqp://guest:guest@")
            .trim_end_matches("/%2f");
        assert!(
            std::net::TcpStream::connect(addr).is_err(),
            "member at {addr} stopped with local-cluster"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let at = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[at]
}

/// Figures for docs/cluster.md (not a pass/fail test): commit latency of a queue.declare in a
/// three-member cluster, and the time from `kill -9` of a member until a survivor lists it
/// no more. `CLUSTER_BENCH_RUNS` sets the number of kills (default 50).
/// `cargo build --workspace --bins && cargo test -p ringmq-tests --test cluster -- --ignored --nocapture`
#[tokio::test]
#[ignore = "benchmark: run by hand"]
async fn cluster_bench() {
    let (mut members, secret) = start_cluster("bench", 3);
    let single = Broker::start();
    for (label, b) in [
        ("standalone broker", &single),
        ("cluster member", &members[1]),
    ] {
        let (_c, ch) = b.channel().await;
        let mut samples = Vec::new();
        let declares: usize = std::env::var("CLUSTER_BENCH_DECLARES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1000);
        for i in 0..declares {
            let started = Instant::now();
            ch.queue_declare(
                format!("lat-{i}").as_str().into(),
                QueueDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
            samples.push(started.elapsed());
        }
        samples.sort();
        println!(
            "queue.declare round trip, {label}: median {:?} p99 {:?} ({declares} declares)",
            percentile(&samples, 0.5),
            percentile(&samples, 0.99)
        );
    }

    let runs: usize = std::env::var("CLUSTER_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50);
    let mut detect = Vec::new();
    for run in 0..runs {
        let victim = 1 + run % 2;
        let survivor = &members[0];
        let admin = survivor.admin_client();
        let listed = |admin: &ringmq::admin_client::AdminClient| {
            admin
                .get("/api/members")
                .unwrap()
                .body
                .as_array()
                .unwrap()
                .len()
        };
        assert_eq!(listed(&admin), 3);
        members[victim].kill();
        let killed = Instant::now();
        while listed(&admin) == 3 {
            if killed.elapsed() > Duration::from_secs(10) {
                for m in &members {
                    let log = m.log.lock().unwrap();
                    let tail = &log[log.len().saturating_sub(40)..];
                    eprintln!("---- {} ----\n{}", m.addr, tail.join("\n"));
                }
                panic!("run {run}: not detected");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        detect.push(killed.elapsed());
        let seeds: Vec<String> = members
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != victim)
            .filter_map(|(_, m)| m.cluster.clone())
            .collect();
        let seeds: Vec<&str> = seeds.iter().map(String::as_str).collect();
        members[victim].restart_with_config(&member_yaml(
            &format!("bench-{victim}"),
            &seeds,
            &secret,
        ));
        let rejoined = Instant::now();
        // Back to full strength: the restarted member listed and the dead voter removed (a
        // 3-member cluster tolerates the next crash only then, docs/cpg.md).
        let voters = |admin: &ringmq::admin_client::AdminClient| {
            admin.get("/api/overview").unwrap().body["cluster"]["voters"]
                .as_u64()
                .unwrap()
        };
        while listed(&admin) < 3 || voters(&admin) != 3 {
            assert!(
                rejoined.elapsed() < Duration::from_secs(10),
                "run {run}: no rejoin"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    detect.sort();
    println!(
        "kill -9 of a member -> survivors' membership change: median {:?} p99 {:?} ({} runs)",
        percentile(&detect, 0.5),
        percentile(&detect, 0.99),
        detect.len()
    );
}

#[tokio::test]
async fn the_configured_founder_founds_when_no_seed_answers() {
    let secret = secret("founder");
    // Port 1 on loopback: nobody listens, as when the first pod resolves the headless
    // Service and finds no peer.
    let yaml = format!(
        "{}cluster_founder: founder-0\n",
        member_yaml("founder-0", &["127.0.0.1:1"], &secret).replace(
            "cluster_join_timeout_ms: 10000",
            "cluster_join_timeout_ms: 1500"
        )
    );
    let founder = Broker::start_with_config(&yaml);
    let (_c, ch) = founder.channel().await;
    ch.queue_declare(
        "q".into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let joiner = Broker::start_with_config(&member_yaml(
        "founder-1",
        &[founder.cluster.as_deref().unwrap()],
        &secret,
    ));
    assert_eq!(passive_queue(&joiner, "q").await, Ok(0));
}

#[tokio::test]
async fn permissions_are_checked_before_a_change_goes_to_the_cluster() {
    let secret = secret("perms");
    let users = "users:\n  - name: guest\n    password: guest\n  - name: app\n    password: app\n    permissions:\n      \"/\": {configure: '^app-', write: '.*', read: '.*'}\n";
    let a = Broker::start_with_config(&format!("{}{users}", member_yaml("perms-0", &[], &secret)));
    let b = Broker::start_with_config(&format!(
        "{}{users}",
        member_yaml("perms-1", &[a.cluster.as_deref().unwrap()], &secret)
    ));
    let uri = format!("amqp://app:app@{}/%2f", b.addr);
    let conn = lapin::Connection::connect(&uri, Default::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(
        "app-orders".into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let ch = conn.create_channel().await.unwrap();
    let e = ch
        .queue_declare(
            "payroll".into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(reply_code(&e), Some(403));
    assert_eq!(passive_queue(&a, "app-orders").await, Ok(0));
    assert_eq!(
        passive_queue(&a, "payroll").await,
        Err(Some(404)),
        "a refused declare never reaches the cluster"
    );
}

/// A member that joined after the newest wiring change holds the map as of its join (an
/// event that changes no wiring); a primary counted only wiring changes as applied, so it
/// waited 10 s — its catch-up limit — before answering each proxied command that named the
/// joiner's index (found by the fault suite: consumers never got consume-ok after a member
/// rejoined, `docs/reliability.md` B2). Every applied event counts now.
#[tokio::test]
async fn a_member_that_joined_after_the_last_wiring_change_proxies_without_waiting() {
    let secret = secret("late-joiner");
    let first = Broker::start_with_config(&member_yaml("late-0", &[], &secret));
    first.wait_ready(Duration::from_secs(30));
    {
        let (_c, ch) = first.channel().await;
        ch.queue_declare(
            "early".into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    }
    let seed = first.cluster.clone().expect("a cluster member");
    let second = Broker::start_with_config(&member_yaml("late-1", &[&seed], &secret));
    second.wait_ready(Duration::from_secs(30));
    let (_c, ch) = second.channel().await;
    ch.basic_get("early".into(), BasicGetOptions { no_ack: true })
        .await
        .expect("a proxied basic.get answers");
    let waited = "a cluster change another member applied is still not applied here";
    assert!(
        !first.log_tail(200).contains(waited),
        "the primary waited for a change it had applied: {}",
        first.log_tail(20)
    );
}

/// A member reads its zone from a zone file, waiting for it at start (the operator labels
/// a scheduled pod with its node's zone, and the kubelet writes the pod's labels file):
/// a Kubernetes labels file that names the zone only a second after the start, and a plain
/// one; each member announces its zone and every member lists them.
#[tokio::test]
async fn a_member_waits_for_its_zone_file_and_announces_the_zone() {
    let secret = secret("zone-file");
    let labels = std::env::temp_dir().join(format!("ringmq-zone-labels-{}", std::process::id()));
    std::fs::write(&labels, "app.kubernetes.io/name=\"ringmq\"\n").unwrap();
    let writer = {
        let labels = labels.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(1));
            std::fs::write(
                &labels,
                "app.kubernetes.io/name=\"ringmq\"\ntopology.kubernetes.io/zone=\"eu-west-1a\"\n",
            )
            .unwrap();
        })
    };
    let started = Instant::now();
    let first = Broker::start_with_config(&format!(
        "{}zone_file: {}\nzone_file_wait_s: 30\n",
        member_yaml("zone-0", &[], &secret),
        labels.display()
    ));
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "it waited for its zone"
    );
    writer.join().unwrap();
    let plain = std::env::temp_dir().join(format!("ringmq-zone-plain-{}", std::process::id()));
    std::fs::write(&plain, "eu-west-1b\n").unwrap();
    let second = Broker::start_with_config(&format!(
        "{}zone_file: {}\n",
        member_yaml("zone-1", &[first.cluster.as_deref().unwrap()], &secret),
        plain.display()
    ));
    second.wait_ready(Duration::from_secs(30));
    for b in [&first, &second] {
        let members = b.admin_client().get("/api/members").unwrap().body;
        let zones: Vec<(&str, &str)> = (members.as_array().into_iter().flatten())
            .map(|m| (m["id"].as_str().unwrap(), m["zone"].as_str().unwrap()))
            .collect();
        assert_eq!(
            zones,
            [("zone-0", "eu-west-1a"), ("zone-1", "eu-west-1b")],
            "{members}"
        );
    }
    let _ = std::fs::remove_file(&labels);
    let _ = std::fs::remove_file(&plain);
}
