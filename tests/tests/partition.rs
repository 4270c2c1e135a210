//! A network partition between real broker processes, each in its own network namespace,
//! joined by veth pairs to a bridge in a hub namespace; nftables rules on the bridge cut one
//! member off. Checks: the cut-off member reports lost quorum, closes its clients' connections
//! and refuses new ones and wiring changes (no split brain), the majority removes it and goes
//! on, and after the cut heals the removed member stops (exit 3) and rejoins when restarted. Needs root, `ip` and `nft`; without them
//! it fails saying what to install, unless `RINGMQ_SKIP_ROOT_TESTS=1` skips it. Everything
//! runs in namespaces the test creates and deletes.

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use ringmq_tests::netns::Net;
use ringmq_tests::{binary, reply_code};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A broker process inside a member namespace; killed by PID on drop (its data dir stays
/// for a restart; the scenario removes it at the end).
struct Member {
    child: Child,
    amqp: String,
    admin: String,
    data: std::path::PathBuf,
}

impl Member {
    fn start(net: &Net, i: usize, seeds: &[String], secret: &std::path::Path) -> Self {
        let ip = net.addr(i);
        let data =
            std::env::temp_dir().join(format!("ringmq-partition-{}-{i}", std::process::id()));
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &net.members[i]])
            .arg(binary("ringmq-broker"))
            .args(["--amqp-listen", &format!("{ip}:5672")])
            .args(["--admin-listen", &format!("{ip}:15672")])
            .args(["--cluster-listen", &format!("{ip}:25672")])
            .arg("--cluster-secret-file")
            .arg(secret)
            .arg("--data-dir")
            .arg(&data)
            .args(["--node-id", &format!("m{i}")])
            .env("RINGMQ_LOG", "warn")
            .env("RINGMQ_DEFAULT_USER", "test")
            .env("RINGMQ_DEFAULT_PASS", "test")
            // PBKDF2 at the default cost takes over a second per login in a debug build.
            .env("RINGMQ_PASSWORD_HASH_ITERATIONS", "10000")
            .stdout(Stdio::piped());
        if !seeds.is_empty() {
            cmd.args(["--cluster-seeds", &seeds.join(",")]);
        }
        let mut child = cmd.spawn().unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        for _ in 0..3 {
            line.clear();
            out.read_line(&mut line).unwrap();
            assert!(
                line.starts_with("ringmq-broker listening"),
                "member {i}: {line:?}"
            );
        }
        std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
        let member = Member {
            child,
            amqp: format!("amqp://test:test@{ip}:5672/%2f"),
            admin: format!("http://{ip}:15672"),
            data,
        };
        // Listening is not serving: a member serves once it holds the majority's lease and
        // the newest map (a restarted one catches up first).
        let client =
            ringmq::admin_client::AdminClient::new(&member.admin, Some("test"), Some("test"));
        wait_for(
            &format!("member {i} ready"),
            Duration::from_secs(30),
            || client.get("/readyz").is_ok_and(|a| a.status == 200),
        );
        member
    }

    fn overview(&self) -> serde_json::Value {
        ringmq::admin_client::AdminClient::new(&self.admin, Some("test"), Some("test"))
            .get("/api/overview")
            .unwrap()
            .body
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn declare(uri: &str, name: &str) -> Result<(), Option<u16>> {
    let conn = lapin::Connection::connect(uri, Default::default())
        .await
        .map_err(|e| reply_code(&e))?;
    let ch = conn.create_channel().await.map_err(|_| None)?;
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .map(|_| ())
    .map_err(|e| reply_code(&e))
}

fn wait_for(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "{what} within {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_cut_off_member_stops_changing_wiring_and_rejoins_after_the_cut_heals() {
    if !ringmq_tests::prereq::root_with(
        "the partition test",
        &[("ip", "iproute2"), ("nft", "nftables")],
    ) {
        return;
    }
    let net = Net::create("rmq", 77, 3);
    // Only this thread moves into the hub namespace; the test's other threads stay put.
    std::thread::scope(|s| {
        s.spawn(|| {
            net.enter_hub();
            partition_scenario(&net);
        })
        .join()
        .expect("the scenario passes");
    });
}

fn partition_scenario(net: &Net) {
    let secret =
        std::env::temp_dir().join(format!("ringmq-partition-secret-{}", std::process::id()));
    std::fs::write(&secret, "partition-test-secret").unwrap();
    let cluster_addr = |i: usize| format!("{}:25672", net.addr(i));
    let mut members = vec![Member::start(net, 0, &[], &secret)];
    members.push(Member::start(net, 1, &[cluster_addr(0)], &secret));
    members.push(Member::start(
        net,
        2,
        &[cluster_addr(0), cluster_addr(1)],
        &secret,
    ));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    assert_eq!(rt.block_on(declare(&members[0].amqp, "before")), Ok(()));
    // A client of the member about to be cut off.
    let client = rt
        .block_on(lapin::Connection::connect(
            &members[0].amqp,
            Default::default(),
        ))
        .unwrap();

    net.isolate(0);
    wait_for(
        "the cut-off member reports lost quorum",
        Duration::from_secs(5),
        || members[0].overview()["cluster"]["quorum"] == false,
    );
    // Polled inside the runtime: lapin's I/O runs on it.
    rt.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(2);
        while client.status().connected() {
            assert!(
                Instant::now() < deadline,
                "the cut-off member closes its clients' connections (320) within 2 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    wait_for(
        "the majority removes the cut-off member",
        Duration::from_secs(10),
        || members[1].overview()["members"].as_array().map(Vec::len) == Some(2),
    );
    assert_eq!(
        rt.block_on(declare(&members[1].amqp, "during")),
        Ok(()),
        "the majority goes on"
    );
    let started = Instant::now();
    assert_eq!(
        rt.block_on(declare(&members[0].amqp, "split-brain")),
        Err(Some(320)),
        "the minority refuses clients (320 CONNECTION_FORCED at connection.open)"
    );
    assert!(started.elapsed() < Duration::from_secs(15));
    assert_eq!(
        rt.block_on(async {
            let conn = lapin::Connection::connect(&members[1].amqp, Default::default())
                .await
                .unwrap();
            let ch = conn.create_channel().await.unwrap();
            ch.queue_declare(
                "split-brain".into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|e| reply_code(&e))
            .map(|_| ())
        }),
        Err(Some(404)),
        "nothing the minority was asked for reached the majority"
    );

    net.heal();
    let mut exit = None;
    wait_for(
        "the removed member stops once it hears of its removal",
        Duration::from_secs(15),
        || {
            exit = members[0].child.try_wait().unwrap();
            exit.is_some()
        },
    );
    assert_eq!(
        exit.and_then(|s| s.code()),
        Some(3),
        "exit status 3: restart me"
    );
    members[0] = Member::start(net, 0, &[cluster_addr(1), cluster_addr(2)], &secret);
    assert_eq!(
        rt.block_on(async {
            let conn = lapin::Connection::connect(&members[0].amqp, Default::default())
                .await
                .unwrap();
            let ch = conn.create_channel().await.unwrap();
            ch.queue_declare(
                "during".into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map(|_| ())
            .map_err(|e| reply_code(&e))
        }),
        Ok(()),
        "the rejoined member has what the majority did meanwhile"
    );
    let _ = std::fs::remove_file(&secret);
    for m in members.drain(..) {
        let data = m.data.clone();
        drop(m);
        let _ = std::fs::remove_dir_all(data);
    }
}

/// The primary of a replicated queue is cut off (issue #13): it confirms nothing more (its
/// backup is out of reach, and within its lease it stops serving), the majority elects the
/// backup, which has every confirmed message and confirms new ones; after the cut heals the
/// old primary rejoins as a backup and every member names one primary.
#[test]
fn a_cut_off_primary_stops_confirming_and_the_majority_elects_its_backup() {
    if !ringmq_tests::prereq::root_with(
        "the partition test",
        &[("ip", "iproute2"), ("nft", "nftables")],
    ) {
        return;
    }
    let net = Net::create("rmp", 79, 3);
    std::thread::scope(|s| {
        s.spawn(|| {
            net.enter_hub();
            replicated_partition_scenario(&net);
        })
        .join()
        .expect("the scenario passes");
    });
}

/// Queue `queue`'s view on a member's admin API.
fn queue_view(m: &Member, queue: &str) -> serde_json::Value {
    ringmq::admin_client::AdminClient::new(&m.admin, Some("test"), Some("test"))
        .get(&format!("/api/queues/%2f/{queue}"))
        .map(|a| a.body)
        .unwrap_or_default()
}

fn replicated_partition_scenario(net: &Net) {
    use futures_lite::StreamExt;
    use lapin::BasicProperties;
    use lapin::options::{BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions};
    const CONFIRMED: usize = 500;
    let secret = std::env::temp_dir().join(format!(
        "ringmq-partition-repl-secret-{}",
        std::process::id()
    ));
    std::fs::write(&secret, "partition-test-secret").unwrap();
    let cluster_addr = |i: usize| format!("{}:25672", net.addr(i));
    let mut members = vec![Member::start(net, 0, &[], &secret)];
    members.push(Member::start(net, 1, &[cluster_addr(0)], &secret));
    members.push(Member::start(
        net,
        2,
        &[cluster_addr(0), cluster_addr(1)],
        &secret,
    ));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let queue = "ledger";
    let publisher = rt.block_on(async {
        let conn = lapin::Connection::connect(&members[0].amqp, Default::default())
            .await
            .unwrap();
        let ch = conn.create_channel().await.unwrap();
        let mut args = FieldTable::default();
        args.insert(
            "qpid.cluster.backups".into(),
            lapin::types::AMQPValue::LongInt(1),
        );
        ch.queue_declare(
            queue.into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        )
        .await
        .unwrap();
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        (conn, ch)
    });
    wait_for("the backup in sync", Duration::from_secs(15), || {
        queue_view(&members[0], queue)["in_sync_backup_nodes"] == serde_json::json!(["m1"])
    });
    let publish = |ch: &lapin::Channel, body: String| {
        let ch = ch.clone();
        async move {
            ch.basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
        }
    };
    rt.block_on(async {
        for i in 0..CONFIRMED {
            let confirm = publish(&publisher.1, format!("m{i}")).await.unwrap();
            assert!(confirm.await.unwrap().is_ack(), "m{i} confirmed");
        }
    });

    net.isolate(0);
    let cut = rt.block_on(async {
        match publish(&publisher.1, "during-cut".into()).await {
            Ok(confirm) => tokio::time::timeout(Duration::from_secs(10), confirm).await,
            Err(e) => Ok(Err(e)),
        }
    });
    assert!(
        !matches!(&cut, Ok(Ok(c)) if c.is_ack()),
        "a primary cut off from its backup confirms nothing: {cut:?}"
    );
    wait_for(
        "the majority elects the backup",
        Duration::from_secs(15),
        || queue_view(&members[1], queue)["node"] == "m1",
    );
    rt.block_on(async {
        let conn = lapin::Connection::connect(&members[1].amqp, Default::default())
            .await
            .unwrap();
        let ch = conn.create_channel().await.unwrap();
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        let confirm = publish(&ch, "after".into()).await.unwrap();
        assert!(confirm.await.unwrap().is_ack(), "the new primary confirms");
    });

    net.heal();
    wait_for(
        "the removed member stops once it hears of its removal",
        Duration::from_secs(15),
        || members[0].child.try_wait().unwrap().is_some(),
    );
    members[0] = Member::start(net, 0, &[cluster_addr(1), cluster_addr(2)], &secret);
    wait_for("one primary everywhere", Duration::from_secs(15), || {
        members.iter().all(|m| queue_view(m, queue)["node"] == "m1")
    });
    let bodies = rt.block_on(async {
        let conn = lapin::Connection::connect(&members[0].amqp, Default::default())
            .await
            .unwrap();
        let ch = conn.create_channel().await.unwrap();
        let mut consumer = ch
            .basic_consume(
                queue.into(),
                "audit".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        let mut bodies = Vec::new();
        while let Ok(Some(Ok(d))) =
            tokio::time::timeout(Duration::from_secs(3), consumer.next()).await
        {
            bodies.push(String::from_utf8(d.data.clone()).unwrap());
        }
        bodies
    });
    let expected: Vec<String> = (0..CONFIRMED)
        .map(|i| format!("m{i}"))
        .chain(["after".to_owned()])
        .collect();
    let kept: Vec<String> = bodies
        .iter()
        .filter(|b| *b != "during-cut")
        .cloned()
        .collect();
    assert_eq!(kept, expected, "every confirmed message, once, in order");
    drop(publisher);
    let _ = std::fs::remove_file(&secret);
    for m in members.drain(..) {
        let data = m.data.clone();
        drop(m);
        let _ = std::fs::remove_dir_all(data);
    }
}
