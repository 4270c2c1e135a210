//! Sessions on a cluster: the session directory lets any member answer a resume, a session
//! moves to the member a client resumes it on, the sessions of a killed member wait for a
//! resume elsewhere (or their timeout), and the failover client goes on on another member
//! when its own is killed with -9 (`docs/sessions.md` §4).

use super::wire::{
    closed_code, lapin_session, new_session_id, props, raw_publish, raw_session, status,
};
use ringmq_client::{Client, Config, Confirmation, Properties, QueueOptions, Table};
use ringmq_tests::cluster::start_cluster;
use ringmq_tests::{Broker, Ports};
use std::time::{Duration, Instant};

/// A failover client on `uris` (the first tried first) that notices a dead member within two
/// seconds (1 s heartbeats) and gives a failover 30 s.
pub(crate) async fn failover_client(uris: impl IntoIterator<Item = String>) -> Client {
    let mut config = Config::new(uris);
    config.heartbeat_s = 1;
    config.failover_timeout = Duration::from_secs(30);
    tokio::time::timeout(Duration::from_secs(20), Client::connect(config))
        .await
        .expect("connect in time")
        .expect("connect")
}

/// Whether publish `m{i}` was acked (not nacked), its confirm awaited up to 60 s; an error
/// never reaches the failover client's application.
pub(crate) async fn acked(i: usize, c: Confirmation) -> bool {
    tokio::time::timeout(Duration::from_secs(60), c.wait())
        .await
        .unwrap_or_else(|_| panic!("the confirm of m{i} in time"))
        .expect("no error reaches the application")
}

/// Resumes session `id` on `b`, again while the directory still shows it attached (its
/// lost connection's detach, or its member's loss, not yet committed), for up to `limit`.
pub(crate) async fn resume_when_detached(
    b: &Broker,
    id: &str,
    limit: Duration,
) -> lapin::Connection {
    let deadline = Instant::now() + limit;
    loop {
        match lapin_session(b, id, true, None).await {
            Ok(conn) => return conn,
            Err(e) if Instant::now() < deadline => {
                let code = ringmq_tests::reply_code(&e);
                assert!(
                    matches!(code, Some(405 | 320 | 506) | None),
                    "only 'still attached' or 'not ready' may delay a resume: {e}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!(
                "session {id} not resumable on {} within {limit:?}: {e}",
                b.uri()
            ),
        }
    }
}

/// Waits until the admin API of `b` no longer lists session `id` (its end committed) and a
/// resume of it is refused with 404 naming it.
pub(crate) async fn wait_gone(b: &Broker, id: &str, limit: Duration) {
    let deadline = Instant::now() + limit;
    let admin = b.admin_client();
    loop {
        let answer = admin
            .get(&format!("/api/sessions/{id}"))
            .expect("admin API answers");
        if answer.status == 404 {
            break;
        }
        assert_eq!(answer.status, 200, "{}", answer.reason());
        assert!(
            Instant::now() < deadline,
            "session {id} still there: {:?}",
            answer.body
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (code, text) = closed_code(raw_session(b, props(&[("qpid.session.resume", id)])).await);
    assert_eq!(code, 404, "{text}");
    assert!(text.contains(id), "the refusal names the session: {text}");
}

#[tokio::test]
async fn any_member_answers_a_resume_and_the_session_moves_to_it() {
    let (m, _secret) = start_cluster("sessions-move", 3);
    let unknown = new_session_id();
    let (code, text) =
        closed_code(raw_session(&m[1], props(&[("qpid.session.resume", &unknown)])).await);
    assert_eq!(code, 404, "{text}");

    let id = new_session_id();
    let mut first = raw_session(
        &m[0],
        props(&[("qpid.session.start", &id), ("qpid.session.timeout", "30")]),
    )
    .await
    .expect("session started on member 0");
    let (code, text) =
        closed_code(raw_session(&m[1], props(&[("qpid.session.resume", &id)])).await);
    assert_eq!(code, 405, "attached on member 0: {text}");
    let (code, text) = closed_code(raw_session(&m[2], props(&[("qpid.session.start", &id)])).await);
    assert_eq!(code, 405, "an id is taken cluster-wide: {text}");
    // Three publishes on channel 1: the channel has state on member 0.
    raw_publish(&mut first, "nowhere", &["one", "two", "three"]).await;
    drop(first); // the socket goes without connection.close
    let moved = resume_when_detached(&m[1], &id, Duration::from_secs(10)).await;
    let ch = moved.create_channel().await.unwrap();
    let s = status(&ch).await;
    assert_eq!(s["resumed"], true);
    assert_eq!(s["session"], id.as_str());
    assert_eq!(
        s["channels"]["1"]["publishes_processed"], 0,
        "taken over from another member, the session starts with none of its channels' state: {s}"
    );
    // Back to member 0, which let go of it: a move again, not its old state.
    moved.close(330, "keep my session".into()).await.unwrap();
    let back = resume_when_detached(&m[0], &id, Duration::from_secs(10)).await;
    let ch = back.create_channel().await.unwrap();
    assert_eq!(status(&ch).await["resumed"], true);
    // A normal close ends it everywhere.
    back.close(200, "done".into()).await.unwrap();
    for member in &m {
        wait_gone(member, &id, Duration::from_secs(10)).await;
    }
}

#[tokio::test]
async fn the_sessions_of_a_killed_member_resume_elsewhere_or_expire() {
    let (mut m, _secret) = start_cluster("sessions-kill", 3);
    let resumed = new_session_id();
    let forgotten = new_session_id();
    let _a = lapin_session(&m[0], &resumed, false, Some(60))
        .await
        .unwrap();
    let _b = lapin_session(&m[0], &forgotten, false, Some(2))
        .await
        .unwrap();
    m[0].kill();
    let conn = resume_when_detached(&m[1], &resumed, Duration::from_secs(20)).await;
    let ch = conn.create_channel().await.unwrap();
    assert_eq!(status(&ch).await["resumed"], true);
    // Every member gives the same answer: the session is member 1's now.
    let listed = m[2]
        .admin_client()
        .get(&format!("/api/sessions/{resumed}"))
        .unwrap();
    assert_eq!(listed.status, 200, "{}", listed.reason());
    assert_eq!(listed.body["member"], "sessions-kill-1");
    assert_eq!(listed.body["attached"], true);
    // Nobody resumes the other: the member keeping it for the lost one ends it after its
    // 2 s timeout.
    wait_gone(&m[2], &forgotten, Duration::from_secs(20)).await;
    // Member 0 comes back: the session is member 1's, not the restarted member's.
    m[0].start_again();
    m[0].wait_ready(Duration::from_secs(30));
    let refused = raw_session(&m[0], props(&[("qpid.session.resume", &resumed)])).await;
    if refused.is_ok() {
        eprintln!("m0:\n{}\nm1:\n{}", m[0].log_tail(80), m[1].log_tail(80));
    }
    let (code, text) = closed_code(refused);
    assert_eq!(code, 405, "attached on member 1: {text}");
}

/// The failover client publishes with confirms and consumes with acks on a queue of its
/// member; that member is killed with -9 halfway. The client resumes the session on another
/// member and goes on, and the application sees what a run without the kill shows: no
/// error, delivery tags one by one from 1, every confirmed message delivered once, in the
/// order it was published — the queue drops what the client sends again and had reached it,
/// and the client hides what comes back from the queue that the application had
/// (`docs/sessions.md` §2).
#[tokio::test]
async fn the_failover_client_goes_on_when_its_member_is_killed() {
    goes_on_when_the_member_is_killed("sessions-client-kill", QueueOptions::default()).await;
}

/// The failover client publishes to and consumes from a queue declared with `options` on
/// member 0 of a new cluster `name`, which is killed with -9 halfway: the application sees
/// what a run without the kill shows.
pub(crate) async fn goes_on_when_the_member_is_killed(name: &str, options: QueueOptions) {
    const MESSAGES: usize = 200;
    let (mut m, _secret) = start_cluster(name, 3);
    let client = failover_client(m.iter().map(Broker::uri)).await;
    let publisher = client.channel().await.unwrap();
    publisher.confirm_select().await.unwrap();
    publisher
        .queue_declare("across", options, Table::default())
        .await
        .unwrap();
    let consumer_channel = client.channel().await.unwrap();
    consumer_channel.qos(10).await.unwrap();
    let mut consumer = consumer_channel
        .consume("across", "c1", false)
        .await
        .unwrap();
    let mut confirmed = std::collections::BTreeSet::new();
    let mut delivered = std::collections::BTreeSet::new();
    let mut last_tag = 0;
    let mut last_n = None;
    let mut seen = |tag: u64, body: &[u8]| {
        assert_eq!(tag, last_tag + 1, "tags one by one");
        last_tag = tag;
        let n: usize = String::from_utf8_lossy(body)[1..].parse().unwrap();
        assert!(
            last_n.is_none_or(|l| n > l),
            "m{n} after m{last_n:?}: each once, in publish order"
        );
        last_n = Some(n);
        n
    };
    let mut window = Vec::new();
    for i in 0..MESSAGES {
        if i == MESSAGES / 2 {
            // A queue survives its primary's loss through an in-sync backup; killed before
            // there is one, it is rightly unavailable and nacks (docs/replication.md).
            super::exclusive_queues::wait_in_sync(&m[1], "across").await;
            m[0].kill();
        }
        let confirmation = publisher
            .publish(
                "",
                "across",
                Properties::default(),
                format!("m{i}").into_bytes(),
            )
            .unwrap();
        window.push((i, confirmation));
        if window.len() == 20 || i + 1 == MESSAGES {
            for (i, c) in window.drain(..) {
                let ack = acked(i, c).await;
                if !ack {
                    // What the surviving members said around the nack: the cause.
                    for (k, b) in m.iter().enumerate().skip(1) {
                        eprintln!("member {k}:\n{}", b.log_tail(80));
                    }
                }
                assert!(ack, "m{i} nacked");
                confirmed.insert(i);
            }
        }
        while let Some(d) = consumer.try_next() {
            delivered.insert(seen(d.delivery_tag, &d.body));
            consumer_channel.ack(d.delivery_tag, false).unwrap();
        }
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while !confirmed.is_subset(&delivered) {
        let d = tokio::time::timeout(deadline - Instant::now(), consumer.next())
            .await
            .unwrap_or_else(|_| {
                let missing: Vec<_> = confirmed.difference(&delivered).take(10).collect();
                panic!("confirmed messages never delivered, e.g. {missing:?}")
            })
            .expect("the consumer lives");
        delivered.insert(seen(d.delivery_tag, &d.body));
        consumer_channel.ack(d.delivery_tag, false).unwrap();
    }
    assert!(client.failovers() >= 1, "the client failed over");
    client.close().await.unwrap();
}

/// The failover client's member is killed with -9 while windows of its confirmed publishes
/// are on their way to a queue whose primary is another member. What reached the queue
/// before the kill has no confirm yet; the client sends it again from the member it resumes
/// on, where nothing of the session's channels is known — and the queue drops it by its
/// number (`core::producers`). Every confirmed message is in the queue exactly once.
#[tokio::test]
async fn a_publish_resent_after_its_members_loss_is_taken_once() {
    const WINDOWS: usize = 8;
    const WINDOW: usize = 250;
    let (mut m, _secret) = start_cluster("sessions-resent-once", 3);
    let admin = m[1].connect().await;
    let ch = admin.create_channel().await.unwrap();
    ch.queue_declare(
        "resent".into(),
        lapin::options::QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        lapin::types::FieldTable::default(),
    )
    .await
    .expect("declared on member 1, its primary");
    let client = failover_client(m.iter().map(Broker::uri)).await;
    let publisher = client.channel().await.unwrap();
    publisher.confirm_select().await.unwrap();
    for w in 0..WINDOWS {
        let mut window = Vec::with_capacity(WINDOW);
        for j in 0..WINDOW {
            let n = w * WINDOW + j;
            let confirmation = publisher
                .publish(
                    "",
                    "resent",
                    Properties::default(),
                    format!("m{n}").into_bytes(),
                )
                .unwrap();
            window.push((n, confirmation));
        }
        if w == WINDOWS / 2 {
            // Some of the window is forwarded to member 1 by now, none of it confirmed.
            tokio::time::sleep(Duration::from_millis(2)).await;
            m[0].kill();
        }
        for (n, c) in window {
            let ack = tokio::time::timeout(Duration::from_secs(60), c.wait())
                .await
                .unwrap_or_else(|_| panic!("the confirm of m{n} in time"))
                .expect("no error reaches the application");
            assert!(ack, "m{n} nacked");
        }
    }
    assert!(client.failovers() >= 1, "the client failed over");
    // Read through a new connection: member 1 closes its plain clients with 320 when the
    // consensus leader's loss (member 0 founded the cluster) outlasts its serving grace, as
    // it may on a loaded machine (`broker/src/broker/majority.rs`).
    drop(ch);
    let reader = m[1].connect().await;
    let ch = reader.create_channel().await.unwrap();
    let mut taken = vec![0u32; WINDOWS * WINDOW];
    while let Some(m) = ch
        .basic_get(
            "resent".into(),
            lapin::options::BasicGetOptions { no_ack: true },
        )
        .await
        .expect("get")
    {
        let n: usize = String::from_utf8_lossy(&m.delivery.data)[1..]
            .parse()
            .unwrap();
        taken[n] += 1;
    }
    let twice: Vec<usize> = (0..taken.len()).filter(|&n| taken[n] > 1).collect();
    let never: Vec<usize> = (0..taken.len()).filter(|&n| taken[n] == 0).collect();
    assert!(
        twice.is_empty() && never.is_empty(),
        "every confirmed message once: {} twice (e.g. {:?}), {} never (e.g. {:?})",
        twice.len(),
        &twice[..twice.len().min(10)],
        never.len(),
        &never[..never.len().min(10)]
    );
    client.close().await.unwrap();
}

/// The failover client consumes through a proxy: its member is not the queue's primary.
/// The primary is killed with -9; the member cancels the consumer it proxied, and the client
/// asks for the queue until a backup has taken over, then creates the consumer again under
/// its tag (`client/src/recovery.rs`). The application's consumer never ends, its
/// connection never fails over, and every message published after the kill reaches it. The
/// primary is not the founder (the consensus leader), whose loss is an election as well.
#[tokio::test]
async fn the_failover_clients_consumer_goes_on_when_its_queues_primary_is_killed() {
    const MESSAGES: usize = 40;
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let (mut m, _secret) = start_cluster("sessions-relayed", 3);
    let consuming = failover_client([m[1].uri()]).await;
    let ch = consuming.channel().await.unwrap();
    let mut args = Table::default();
    args.insert(
        "qpid.cluster.primary".into(),
        ringmq_client::AMQPValue::LongString("sessions-relayed-2".into()),
    );
    let durable = QueueOptions {
        durable: true,
        ..QueueOptions::default()
    };
    ch.queue_declare("relayed", durable, args).await.unwrap();
    ch.qos(10).await.unwrap();
    let mut consumer = ch.consume("relayed", "relayed-c", false).await.unwrap();
    // The publisher is a failover client of its own on the founder: the primary's loss may
    // close its connection (320), and it resends what was not confirmed.
    let publishing = failover_client([m[0].uri(), m[1].uri()]).await;
    let publisher = publishing.channel().await.unwrap();
    publisher.confirm_select().await.unwrap();
    // Each message until it is confirmed: while no primary holds the queue, publishes to it
    // are nacked.
    let publish = |from: usize| {
        let publisher = &publisher;
        async move {
            for i in from..from + MESSAGES / 2 {
                let deadline = Instant::now() + Duration::from_secs(60);
                loop {
                    let c = publisher
                        .publish(
                            "",
                            "relayed",
                            Properties::default().with_delivery_mode(2),
                            format!("m{i}").into_bytes(),
                        )
                        .unwrap();
                    let ack = tokio::time::timeout(Duration::from_secs(60), c.wait())
                        .await
                        .unwrap_or_else(|_| panic!("the confirm of m{i} in time"))
                        .expect("no error reaches the publisher");
                    if ack {
                        break;
                    }
                    assert!(Instant::now() < deadline, "m{i} nacked for a minute");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    };
    // The application holds the last few of the first half unacked through the kill: the
    // new primary gives them back, and the client does not hand them out again.
    let held_from = MESSAGES / 2 - 4;
    let mut delivered = std::collections::BTreeSet::new();
    let mut held = Vec::new();
    let mut last_tag = 0;
    let mut receive = async |upto: usize, held: &mut Vec<u64>| {
        let deadline = Instant::now() + Duration::from_secs(60);
        while (0..upto).any(|i| !delivered.contains(&i)) {
            let d = tokio::time::timeout(deadline - Instant::now(), consumer.next())
                .await
                .unwrap_or_else(|_| {
                    let missing: Vec<_> = (0..upto).filter(|i| !delivered.contains(i)).collect();
                    panic!("never delivered: {missing:?}")
                })
                .expect("the application's consumer never ends");
            assert_eq!(d.delivery_tag, last_tag + 1, "tags one by one");
            last_tag = d.delivery_tag;
            let n: usize = String::from_utf8_lossy(&d.body)[1..].parse().unwrap();
            assert!(delivered.insert(n), "m{n} handed to the application twice");
            if (held_from..MESSAGES / 2).contains(&n) {
                held.push(d.delivery_tag);
            } else {
                ch.ack(d.delivery_tag, false).unwrap();
            }
        }
    };
    publish(0).await;
    receive(MESSAGES / 2, &mut held).await;
    m[2].kill();
    publish(MESSAGES / 2).await;
    for tag in held.drain(..) {
        ch.ack(tag, false).unwrap();
    }
    receive(MESSAGES, &mut held).await;
    // Nothing is left unacknowledged on the queue: the held acks reached their new tags.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let q = m[1]
            .admin_client()
            .get("/api/queues/%2f/relayed")
            .expect("admin API answers");
        let unacked = q.body["messages_unacknowledged"].as_u64();
        if unacked == Some(0) && q.body["messages_ready"].as_u64() == Some(0) {
            break;
        }
        assert!(Instant::now() < deadline, "left on the queue: {:?}", q.body);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        tokio::time::timeout(Duration::from_millis(500), consumer.next())
            .await
            .is_err(),
        "nothing more comes"
    );
    assert_eq!(
        consuming.failovers(),
        0,
        "the consumer's own member lived: its connection never failed over"
    );
    consuming.close().await.unwrap();
    publishing.close().await.unwrap();
}

/// A restart of the whole cluster: the first member back holds no majority yet, and its
/// session directory may be older than the session (it has not replayed the log). It refuses
/// a resume with 320, as it refuses `connection.open` — try again, or elsewhere — not with
/// the 404 that would end a session that lives (the fault suite's `kill-all` found that).
/// Once the others are back, the session resumes.
#[tokio::test]
async fn a_member_back_without_a_majority_refuses_a_resume_for_now_not_for_good() {
    // Fixed ports: the members come back at the addresses their peers know them by.
    let secret = ringmq_tests::cluster::secret("sessions-all-down");
    let ports: Vec<Ports> = (0..3).map(|_| Ports::allocate()).collect();
    let mut m: Vec<Broker> = Vec::new();
    for (i, p) in ports.iter().enumerate() {
        let seeds = match i {
            0 => String::new(),
            _ => format!("\"{}\"", ports[0].cluster),
        };
        let yaml = format!(
            "node_id: sessions-all-down-{i}\ncluster_listen: \"{}\"\ncluster_secret_file: {}\n\
             cluster_seeds: [{seeds}]\ncluster_join_timeout_ms: 10000\n",
            p.cluster,
            secret.display()
        );
        m.push(Broker::start_on_ports(&yaml, *p));
        m[i].wait_ready(Duration::from_secs(30));
    }
    let id = new_session_id();
    let conn = lapin_session(&m[1], &id, false, Some(60)).await.unwrap();
    for b in m.iter_mut() {
        b.kill();
    }
    drop(conn);
    m[0].start_again();
    let deadline = Instant::now() + Duration::from_secs(20);
    let (code, text) = loop {
        match raw_session(&m[0], props(&[("qpid.session.resume", &id)])).await {
            // Its AMQP port may not be open yet.
            Err(ringmq::client::ClientError::Io(_)) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            r => break closed_code(r),
        }
    };
    assert_eq!(code, 320, "not ready, not gone: {text}");
    m[1].start_again();
    m[2].start_again();
    for b in &m {
        b.wait_ready(Duration::from_secs(30));
    }
    let conn = resume_when_detached(&m[0], &id, Duration::from_secs(20)).await;
    let ch = conn.create_channel().await.unwrap();
    assert_eq!(status(&ch).await["resumed"], true);
}
