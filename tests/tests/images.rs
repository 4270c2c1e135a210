//! The broker image (issue #17): `scripts/build-images.sh` builds `ringmq/broker:dev`; three
//! containers of it, non-root, on read-only root file systems with a data volume, on a
//! private Docker network, form a cluster that a real client (lapin) uses through a published
//! port; the cluster keeps serving — nothing confirmed lost — through `docker kill` of the
//! member holding the queue's primary; and `docker stop` (SIGTERM) ends a broker at once,
//! with status 0, after a graceful shutdown.
//!
//! Needs Docker. Where `docker info` fails the test says so and passes, unless
//! `RINGMQ_REQUIRE_DOCKER=1` (set by `.ci/run`) makes that a failure.

use futures_lite::StreamExt;
use lapin::BasicProperties;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use ringmq::admin_client::AdminClient;
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const IMAGE: &str = "ringmq/broker:dev";
/// The administrator every member creates (`--default-user`); guest is loopback-only, and a
/// published port is not loopback inside the container.
const USER: &str = "test";
/// Confirmed publishes before the kill, and again after it.
const MESSAGES: usize = 200;
/// The longest wait for a member to be ready, the cluster to form or a backup to take over.
const WAIT_LIMIT: Duration = Duration::from_secs(60);

fn docker(args: &[&str]) -> Output {
    Command::new("docker")
        .args(args)
        .output()
        .expect("docker runs")
}

/// Runs `docker args`, panicking with its stderr if it fails; returns its stdout, trimmed.
fn docker_ok(args: &[&str]) -> String {
    let out = docker(args);
    assert!(
        out.status.success(),
        "docker {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Whether the test can run; says why not (and fails where Docker is required).
fn docker_available() -> bool {
    let ok = Command::new("docker")
        .args(["info", "--format", "{{.ServerVersion}}"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        assert!(
            std::env::var_os("RINGMQ_REQUIRE_DOCKER").is_none_or(|v| v != "1"),
            "RINGMQ_REQUIRE_DOCKER=1 and `docker info` fails: start Docker (or install docker.io)"
        );
        eprintln!(
            "SKIPPED images test: `docker info` fails (no Docker here); it runs where Docker does"
        );
    }
    ok
}

/// Everything the test created in Docker and on disk, removed when dropped — on success and
/// on a failed assertion alike — by the ids `docker` gave back, never by name.
struct Created {
    containers: Vec<String>,
    network: Option<String>,
    dir: PathBuf,
}

impl Drop for Created {
    fn drop(&mut self) {
        for id in &self.containers {
            if std::thread::panicking() {
                let logs = docker(&["logs", "--tail", "30", id]);
                eprintln!(
                    "--- container {id} ---\n{}{}",
                    String::from_utf8_lossy(&logs.stdout),
                    String::from_utf8_lossy(&logs.stderr)
                );
            }
            // -v: the anonymous data volume goes with it.
            let _ = docker(&["rm", "-f", "-v", id]);
        }
        if let Some(net) = &self.network {
            let _ = docker(&["network", "rm", net]);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One broker container of the test.
struct Member {
    node: String,
    id: String,
    amqp: String,
    admin: AdminClient,
}

/// `host:port` that `docker port` gives for the container's `port`/tcp.
fn published(id: &str, port: u16) -> String {
    let out = docker_ok(&["port", id, &format!("{port}/tcp")]);
    out.lines()
        .find(|l| l.starts_with("127.0.0.1:"))
        .unwrap_or_else(|| panic!("port {port} of {id} is not published on 127.0.0.1: {out}"))
        .to_owned()
}

/// Starts member `i` (node id and network alias `node-<i>`) on `network`, joining through
/// `seeds`; records its id in `created` before anything else can fail.
fn start_member(
    created: &mut Created,
    network: &str,
    config_dir: &Path,
    i: usize,
    seeds: &[&str],
) -> Member {
    let node = format!("node-{i}");
    let name = format!("{network}-{node}");
    let config_mount = format!("{}:/etc/ringmq:ro", config_dir.display());
    let mut args = vec![
        "run",
        "-d",
        "--name",
        &name,
        "--network",
        network,
        "--network-alias",
        &node,
        "--hostname",
        &node,
        "--read-only",
        "--mount",
        "type=volume,dst=/data",
        "-v",
        &config_mount,
        "-p",
        "127.0.0.1::5672",
        "-p",
        "127.0.0.1::15672",
        IMAGE,
        // The broker's own flags, passed through the entrypoint.
        "--config",
        "/etc/ringmq/ringmq.yaml",
        "--node-id",
        &node,
        "--advertise-host",
        &node,
        "--data-dir",
        "/data",
        "--amqp-listen",
        "0.0.0.0:5672",
        "--admin-listen",
        "0.0.0.0:15672",
        "--cluster-listen",
        "0.0.0.0:25672",
        "--cluster-secret-file",
        "/etc/ringmq/cluster-secret",
        "--default-user",
        USER,
        "--default-pass",
        USER,
    ];
    let seeds = seeds.join(",");
    if !seeds.is_empty() {
        args.extend(["--cluster-seeds", &seeds]);
    }
    let id = docker_ok(&args);
    created.containers.push(id.clone());
    let admin = AdminClient::new(
        &format!("http://{}", published(&id, 15672)),
        Some(USER),
        Some(USER),
    );
    Member {
        amqp: published(&id, 5672),
        node,
        id,
        admin,
    }
}

/// Polls until `done` holds, for at most `limit`; panics naming `what` and the last value.
fn wait_for<T: std::fmt::Debug>(
    what: &str,
    limit: Duration,
    mut poll: impl FnMut() -> T,
    done: impl Fn(&T) -> bool,
) -> T {
    let deadline = Instant::now() + limit;
    loop {
        let v = poll();
        if done(&v) {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not within {limit:?}; last {v:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn ready(m: &Member) -> Option<u16> {
    m.admin.get("/readyz").ok().map(|a| a.status)
}

fn queue_view(m: &Member, queue: &str) -> Option<Value> {
    m.admin
        .get(&format!("/api/queues/%2f/{queue}"))
        .ok()
        .filter(|a| a.status == 200)
        .map(|a| a.body)
}

async fn connect(m: &Member) -> (lapin::Connection, lapin::Channel) {
    let uri = format!("amqp://{USER}:{USER}@{}/%2f", m.amqp);
    let conn = tokio::time::timeout(
        Duration::from_secs(15),
        lapin::Connection::connect(&uri, Default::default()),
    )
    .await
    .unwrap_or_else(|_| panic!("connecting to {} timed out", m.node))
    .unwrap_or_else(|e| panic!("connecting to {}: {e}", m.node));
    let ch = conn.create_channel().await.expect("a channel");
    (conn, ch)
}

/// Publishes `m<i>` for `range` persistent to `queue` through `m`, each confirmed (ack).
async fn publish_confirmed(m: &Member, queue: &str, range: std::ops::Range<usize>) {
    let (conn, ch) = connect(m).await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm.select");
    let mut confirms = Vec::new();
    for i in range {
        let confirm = ch
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                format!("m{i}").as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .expect("basic.publish");
        confirms.push(confirm);
    }
    for c in confirms {
        let confirm = tokio::time::timeout(Duration::from_secs(15), c)
            .await
            .expect("a confirm within 15 s")
            .expect("a confirm");
        assert!(confirm.is_ack(), "a publish was nacked");
    }
    let _ = conn.close(200, "published".into()).await;
}

#[tokio::test]
async fn three_broker_containers_form_a_cluster_that_survives_docker_kill_of_a_primary() {
    if !docker_available() {
        return;
    }
    let started = Instant::now();
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let build = Command::new(repo.join("scripts/build-images.sh"))
        .arg("broker")
        .current_dir(&repo)
        .status()
        .expect("scripts/build-images.sh runs");
    assert!(
        build.success(),
        "scripts/build-images.sh broker failed: {build}"
    );
    eprintln!("images: built (or found fresh) in {:?}", started.elapsed());
    let user = docker_ok(&["image", "inspect", "--format", "{{.Config.User}}", IMAGE]);
    assert_eq!(user, "10001:10001", "the image runs as the non-root user");

    let unique = format!(
        "ringmq-images-test-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos())
    );
    let mut created = Created {
        containers: Vec::new(),
        network: None,
        dir: std::env::temp_dir().join(&unique),
    };
    std::fs::create_dir_all(&created.dir).expect("a temp dir");
    // Readable by the container's user 10001 (the directory is mounted read-only).
    std::fs::write(created.dir.join("cluster-secret"), "images-test-secret\n").expect("the secret");
    // A starved container (the machine is shared with other tests) must not be dropped for a
    // moment's silence: the on-cluster suites' 3 s failure timeout.
    std::fs::write(
        created.dir.join("ringmq.yaml"),
        "cluster_failure_timeout_ms: 3000\ncluster_join_timeout_ms: 30000\n",
    )
    .expect("the config");
    for f in ["", "cluster-secret", "ringmq.yaml"] {
        use std::os::unix::fs::PermissionsExt;
        let mode = if f.is_empty() { 0o755 } else { 0o644 };
        std::fs::set_permissions(created.dir.join(f), std::fs::Permissions::from_mode(mode))
            .expect("chmod");
    }
    let network = docker_ok(&["network", "create", &unique]);
    created.network = Some(network);

    // node-0 founds the cluster; node-1 and node-2 join through it, by its network alias.
    let config_dir = created.dir.clone();
    let mut members = vec![start_member(&mut created, &unique, &config_dir, 0, &[])];
    wait_for(
        "node-0 ready",
        WAIT_LIMIT,
        || ready(&members[0]),
        |s| *s == Some(200),
    );
    for i in 1..3 {
        members.push(start_member(
            &mut created,
            &unique,
            &config_dir,
            i,
            &["node-0:25672"],
        ));
    }
    for m in &members {
        wait_for(
            &format!("{} ready", m.node),
            WAIT_LIMIT,
            || ready(m),
            |s| *s == Some(200),
        );
    }
    wait_for(
        "three running members",
        WAIT_LIMIT,
        || members[0].admin.get("/api/members").ok().map(|a| a.body),
        |v| {
            v.as_ref().and_then(Value::as_array).is_some_and(|a| {
                a.len() == 3
                    && a.iter().all(|m| {
                        m["state"] == "running"
                            && m["amqp"].as_str().is_some_and(|h| h.starts_with("node-"))
                    })
            })
        },
    );
    eprintln!(
        "images: cluster of 3 containers formed after {:?}",
        started.elapsed()
    );

    // The client uses node-0 only; the queue's primary is node-1, with one backup.
    let queue = "orders";
    let (conn, ch) = connect(&members[0]).await;
    let mut args = FieldTable::default();
    args.insert(
        "qpid.cluster.primary".into(),
        AMQPValue::LongString("node-1".into()),
    );
    args.insert("qpid.cluster.backups".into(), AMQPValue::LongInt(1));
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .expect("queue.declare through node-0");
    let _ = conn.close(200, "declared".into()).await;
    let view = wait_for(
        "the queue on node-1 with an in-sync backup",
        WAIT_LIMIT,
        || queue_view(&members[0], queue),
        |v| {
            v.as_ref().is_some_and(|v| {
                v["node"] == "node-1"
                    && v["in_sync_backup_nodes"]
                        .as_array()
                        .is_some_and(|a| a.len() == 1)
            })
        },
    )
    .expect("a view");
    let backup = view["in_sync_backup_nodes"][0]
        .as_str()
        .expect("a backup")
        .to_owned();
    assert_ne!(backup, "node-1");
    publish_confirmed(&members[0], queue, 0..MESSAGES).await;

    // Kill the primary's container (SIGKILL): its backup takes over, the client's member stays.
    let killed_at = Instant::now();
    docker_ok(&["kill", &members[1].id]);
    wait_for(
        "the backup elected primary",
        WAIT_LIMIT,
        || queue_view(&members[0], queue),
        |v| {
            v.as_ref()
                .is_some_and(|v| v["node"].as_str() == Some(backup.as_str()))
        },
    );
    eprintln!(
        "images: {backup} primary {:?} after docker kill of node-1",
        killed_at.elapsed()
    );
    publish_confirmed(&members[0], queue, MESSAGES..2 * MESSAGES).await;

    // Every confirmed message, from before and after the kill, through node-0.
    let (conn, ch) = connect(&members[0]).await;
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "check".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("basic.consume through node-0");
    let mut got = BTreeSet::new();
    while got.len() < 2 * MESSAGES {
        let d = tokio::time::timeout(Duration::from_secs(20), consumer.next())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "only {} of {} messages after the kill",
                    got.len(),
                    2 * MESSAGES
                )
            })
            .expect("a delivery")
            .expect("a delivery");
        got.insert(String::from_utf8_lossy(&d.data).into_owned());
    }
    let want: BTreeSet<String> = (0..2 * MESSAGES).map(|i| format!("m{i}")).collect();
    assert_eq!(got, want, "every confirmed message, once");
    let _ = conn.close(200, "checked".into()).await;

    // docker stop: SIGTERM, then SIGKILL after 20 s. The broker leaves and exits at once.
    let survivor = members
        .iter()
        .find(|m| m.node == backup)
        .expect("the new primary");
    let stop_at = Instant::now();
    docker_ok(&["stop", "-t", "20", &survivor.id]);
    let stop_took = stop_at.elapsed();
    let code = docker_ok(&["inspect", "--format", "{{.State.ExitCode}}", &survivor.id]);
    let logs = docker(&["logs", &survivor.id]);
    let logs = String::from_utf8_lossy(&logs.stderr);
    assert_eq!(
        code, "0",
        "docker stop: exit status 0, not a kill; log:\n{logs}"
    );
    assert!(
        stop_took < Duration::from_secs(10),
        "docker stop took {stop_took:?}"
    );
    assert!(
        logs.contains("SIGTERM")
            && logs.contains("leaving")
            && logs.contains("writing the journal"),
        "the log shows the graceful shutdown:\n{logs}"
    );
    eprintln!(
        "images: docker stop took {stop_took:?}; whole test {:?}",
        started.elapsed()
    );
}
