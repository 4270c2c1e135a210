//! A session's exclusive queues on a cluster (`docs/sessions.md` §4): owned by the session,
//! not by a connection or a member — replicated to the queue's backups with their content,
//! kept when the session's member is killed, moved to the member the session is resumed on,
//! refused to every other connection, and gone when the session ends (closed, or timed out
//! after its member's loss).

use super::across_members::{goes_on_when_the_member_is_killed, resume_when_detached, wait_gone};
use super::wire::{lapin_session, new_session_id};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::{BasicProperties, Channel};
use ringmq_client::QueueOptions;
use ringmq_tests::cluster::start_cluster;
use ringmq_tests::{Broker, bodies, queue_counts, reply_code, wait_queue_gone};
use std::time::{Duration, Instant};

/// Declares the exclusive queue `name` on `ch`.
async fn declare_exclusive(ch: &Channel, name: &str) {
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions {
            exclusive: true,
            ..Default::default()
        },
        Default::default(),
    )
    .await
    .expect("exclusive queue declared");
}

/// Publishes `bodies` to `queue` as persistent messages and waits for every confirm.
async fn publish_confirmed(ch: &Channel, queue: &str, bodies: &[String]) {
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    for body in bodies {
        let confirm = ch
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        assert!(confirm.is_ack(), "{body} confirmed");
    }
}

/// Queue `name` as the admin API of `b` lists it.
fn listed(b: &Broker, name: &str) -> serde_json::Value {
    let answer = b
        .admin_client()
        .get(&format!("/api/queues/%2F/{name}"))
        .expect("admin API answers");
    assert_eq!(answer.status, 200, "{}", answer.reason());
    answer.body
}

/// Waits until queue `name`, as `b` lists it, satisfies `ok`; panics with the last listing.
async fn wait_listed(
    b: &Broker,
    name: &str,
    limit: Duration,
    what: &str,
    ok: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + limit;
    loop {
        let q = listed(b, name);
        if ok(&q) {
            return q;
        }
        assert!(Instant::now() < deadline, "{what} within {limit:?}: {q}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until queue `name`, as `b` lists it, has an in-sync backup; the listing.
pub(crate) async fn wait_in_sync(b: &Broker, name: &str) -> serde_json::Value {
    let has_one = |q: &serde_json::Value| {
        q["in_sync_backup_nodes"]
            .as_array()
            .is_some_and(|b| !b.is_empty())
    };
    wait_listed(
        b,
        name,
        Duration::from_secs(20),
        "an in-sync backup",
        has_one,
    )
    .await
}

/// Whether another connection (without the session) is refused the queue with 405.
async fn refused_to_others(b: &Broker, name: &str) {
    let (_c, ch) = b.channel().await;
    let e = ch
        .basic_consume(
            name.into(),
            "thief".into(),
            Default::default(),
            Default::default(),
        )
        .await
        .expect_err("another connection may not consume a session's exclusive queue");
    assert_eq!(reply_code(&e), Some(405), "{e}");
}

#[tokio::test]
async fn a_sessions_exclusive_queue_survives_its_members_loss_and_follows_the_session() {
    let (mut m, _secret) = start_cluster("sessions-excl", 3);
    let id = new_session_id();
    let conn = lapin_session(&m[0], &id, false, Some(60)).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    declare_exclusive(&ch, "mine").await;
    let sent: Vec<String> = (0..20).map(|i| format!("m{i}")).collect();
    publish_confirmed(&ch, "mine", &sent).await;
    // Every member knows the session owns it; a backup holds its content.
    let q = wait_in_sync(&m[1], "mine").await;
    assert_eq!(q["session"], id.as_str(), "{q}");
    assert_eq!(q["exclusive"], true, "{q}");
    assert_eq!(q["node"], "sessions-excl-0", "{q}");
    refused_to_others(&m[1], "mine").await;
    refused_to_others(&m[0], "mine").await;

    m[0].kill();
    // Resumed on the member that is not the queue's backup: the promoted backup serves it
    // over the link until the queue has moved to the session's member.
    let resumed = resume_when_detached(&m[2], &id, Duration::from_secs(30)).await;
    let ch = resumed.create_channel().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let got = loop {
        match queue_counts(&ch, "mine").await {
            Ok(_) => break bodies(&ch, "mine").await,
            Err(code) => {
                assert!(
                    Instant::now() < deadline,
                    "the session's queue usable after the failover: {code:?}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    assert_eq!(got, sent, "every confirmed message, in order, once");
    refused_to_others(&m[1], "mine").await;
    let q = wait_listed(
        &m[1],
        "mine",
        Duration::from_secs(30),
        "the queue's move",
        |q| q["node"] == "sessions-excl-2",
    )
    .await;
    assert_eq!(q["session"], id.as_str(), "{q}");

    // Kept and resumed on another live member: the queue moves there with its content.
    let later: Vec<String> = (0..5).map(|i| format!("later{i}")).collect();
    publish_confirmed(&ch, "mine", &later).await;
    resumed.close(330, "keep my session".into()).await.unwrap();
    let back = resume_when_detached(&m[1], &id, Duration::from_secs(10)).await;
    wait_listed(
        &m[2],
        "mine",
        Duration::from_secs(30),
        "the second move",
        |q| q["node"] == "sessions-excl-1",
    )
    .await;
    let ch = back.create_channel().await.unwrap();
    assert_eq!(bodies(&ch, "mine").await, later);
    refused_to_others(&m[2], "mine").await;

    // Ended by the client: the queue goes everywhere.
    back.close(200, "done".into()).await.unwrap();
    for member in &m[1..] {
        wait_queue_gone(member, "mine", Duration::from_secs(20)).await;
    }
}

#[tokio::test]
async fn a_sessions_exclusive_queue_lives_until_the_session_times_out_after_its_members_loss() {
    let (mut m, _secret) = start_cluster("sessions-excl-exp", 3);
    let id = new_session_id();
    let conn = lapin_session(&m[0], &id, false, Some(3)).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    declare_exclusive(&ch, "brief").await;
    publish_confirmed(&ch, "brief", &["kept".to_owned()]).await;
    wait_in_sync(&m[1], "brief").await;
    m[0].kill();
    // The backup takes over, and the queue waits for the session: still there (refused
    // to others with 405, not 404) once the failover is done.
    wait_listed(
        &m[1],
        "brief",
        Duration::from_secs(20),
        "the promoted backup",
        |q| q["node"] != "sessions-excl-exp-0",
    )
    .await;
    refused_to_others(&m[2], "brief").await;
    // Nobody resumes it: its timeout ends it, and its queue with it.
    wait_gone(&m[1], &id, Duration::from_secs(30)).await;
    for member in &m[1..] {
        wait_queue_gone(member, "brief", Duration::from_secs(20)).await;
    }
}

/// The failover client's application, consuming from its session's exclusive queue, sees
/// what a run without failure shows when the session's member — the queue's primary — is
/// killed with -9: the queue lives on in its backup, the session resumes elsewhere, and the
/// client's consumer goes on.
///
/// It was ignored after it failed once in eight CI-load runs (2026-12-06, `.ci/run` of
/// `e4009fc`: "m100 nacked", the first publish after the kill). The cause that fits — the
/// queue's planned move to the resuming member refusing a forward that crossed its switch —
/// is fixed in the broker (B23, `docs/reliability.md`); and the kill now waits for the
/// queue's backup to be in sync, without which the queue is rightly unavailable and nacks
/// (`goes_on_when_the_member_is_killed`).
#[tokio::test]
async fn the_failover_clients_exclusive_queue_goes_on_when_its_member_is_killed() {
    let exclusive = QueueOptions {
        exclusive: true,
        ..QueueOptions::default()
    };
    goes_on_when_the_member_is_killed("sessions-excl-client", exclusive).await;
}
