//! The wire contract with plain clients — start, abrupt disconnect, resume, the status
//! pseudo-queue, KEEP_SESSION, normal close, timeout, and the refusals (404, 405, 530) —
//! and the deliveries a resumed session acknowledges.

use lapin::options::{BasicGetOptions, BasicPublishOptions, QueueDeclareOptions};
use lapin::types::{FieldTable as LapinTable, LongString};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use ringmq::amqp::{AMQPClass, AMQPValue, FieldTable, connection, queue};
use ringmq::client::{ClientError, Presentation, RawClient, Target};
use ringmq_tests::{Broker, reply_code};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A fresh UUID in its text form (no generator needed: unique per process and call).
pub(crate) fn new_session_id() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!(
        "{:08x}-{:04x}-4000-8000-{:012x}",
        std::process::id(),
        n & 0xffff,
        (u64::from(nanos) << 16) | (n & 0xffff)
    )
}

/// A lapin connection that starts (`resume` false) or resumes session `id`.
pub(crate) async fn lapin_session(
    b: &Broker,
    id: &str,
    resume: bool,
    timeout_s: Option<u64>,
) -> Result<Connection, lapin::Error> {
    let key = if resume {
        "qpid.session.resume"
    } else {
        "qpid.session.start"
    };
    let mut props =
        ConnectionProperties::default().with_client_property(key.into(), LongString::from(id));
    if let Some(t) = timeout_s {
        props = props.with_client_property(
            "qpid.session.timeout".into(),
            LongString::from(t.to_string()),
        );
    }
    Connection::connect(&b.uri(), props).await
}

/// A raw client that starts or resumes a session, with `extra` client properties; the
/// server's refusal comes back as [`ClientError::Closed`].
pub(crate) async fn raw_session(b: &Broker, props: FieldTable) -> Result<RawClient, ClientError> {
    let target = Target::parse(&b.uri()).unwrap();
    let stream = tokio::net::TcpStream::connect(&target.addr).await?;
    RawClient::open_presenting(
        stream,
        &target,
        "PLAIN",
        b"\0guest\0guest",
        &Presentation {
            properties: props,
            ..Presentation::default()
        },
    )
    .await
}

pub(crate) fn props(pairs: &[(&str, &str)]) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in pairs {
        t.insert((*k).into(), AMQPValue::LongString((*v).into()));
    }
    t
}

pub(crate) fn closed_code(r: Result<RawClient, ClientError>) -> (u16, String) {
    match r {
        Err(ClientError::Closed { code, text, .. }) => (code, text),
        Err(e) => panic!("expected the broker to close the connection, got {e}"),
        Ok(_) => panic!("expected the broker to refuse the session"),
    }
}

/// The session status read from `amq.session` as a plain client reads it.
pub(crate) async fn status(ch: &lapin::Channel) -> serde_json::Value {
    let got = ch
        .basic_get("amq.session".into(), BasicGetOptions { no_ack: true })
        .await
        .expect("basic.get amq.session")
        .expect("amq.session holds the status");
    assert_eq!(
        got.delivery
            .properties
            .content_type()
            .as_ref()
            .map(|c| c.as_str()),
        Some("application/json")
    );
    serde_json::from_slice(&got.delivery.data).expect("the status is JSON")
}

async fn declare_exclusive(ch: &lapin::Channel, name: &str) {
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions {
            exclusive: true,
            ..Default::default()
        },
        LapinTable::default(),
    )
    .await
    .expect("declaring the session's exclusive queue");
}

pub(crate) async fn publish(ch: &lapin::Channel, queue: &str, bodies: &[&str]) {
    for body in bodies {
        ch.basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            body.as_bytes(),
            BasicProperties::default(),
        )
        .await
        .unwrap();
    }
}

/// (message count) of a queue, or the reply code of the refusal, on a fresh plain connection.
async fn passive_on_plain_connection(b: &Broker, queue: &str) -> Result<u32, Option<u16>> {
    let (_c, ch) = b.channel().await;
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            passive: true,
            ..Default::default()
        },
        LapinTable::default(),
    )
    .await
    .map(|q| q.message_count())
    .map_err(|e| reply_code(&e))
}

#[tokio::test]
async fn the_broker_advertises_sessions_and_their_maximum_timeout() {
    let b = Broker::start_with_config("session_max_timeout_s: 120\n");
    let stream = tokio::net::TcpStream::connect(b.addr).await.unwrap();
    let mut c = RawClient::unopened(stream);
    use tokio::io::AsyncWriteExt;
    c.stream
        .write_all(ringmq::amqp::frame::PROTOCOL_HEADER)
        .await
        .unwrap();
    let AMQPClass::Connection(connection::AMQPMethod::Start(s)) = c.read_method().await.unwrap()
    else {
        panic!("expected connection.start")
    };
    let Some(AMQPValue::FieldTable(caps)) = s.server_properties.inner().get("capabilities") else {
        panic!("no capabilities")
    };
    assert_eq!(
        caps.inner().get("qpid.session"),
        Some(&AMQPValue::Boolean(true))
    );
    assert_eq!(
        s.server_properties.inner().get("qpid.session.timeout"),
        Some(&AMQPValue::LongLongInt(120))
    );
    // Asked for more than the maximum: granted the maximum.
    let id = new_session_id();
    let conn = lapin_session(&b, &id, false, Some(3600)).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    let st = status(&ch).await;
    assert_eq!(st["session"], id.as_str());
    assert_eq!(st["timeout_s"], 120);
    assert_eq!(st["resumed"], false);
}

#[tokio::test]
async fn a_session_outlives_an_abrupt_disconnect_with_its_exclusive_queue_and_its_content() {
    let b = Broker::start();
    let id = new_session_id();
    let mut first = raw_session(
        &b,
        props(&[("qpid.session.start", &id), ("qpid.session.timeout", "30")]),
    )
    .await
    .unwrap();
    let declare_ok = |m: &AMQPClass| matches!(m, AMQPClass::Queue(queue::AMQPMethod::DeclareOk(_)));
    first
        .call(
            AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
                queue: "session-owned".into(),
                exclusive: true,
                ..Default::default()
            })),
            declare_ok,
            "queue.declare-ok",
        )
        .await
        .unwrap();
    raw_publish(&mut first, "session-owned", &["one", "two", "three"]).await;
    drop(first); // the socket goes without connection.close
    // The session's exclusive queue is still there, and still exclusive to the session.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        passive_on_plain_connection(&b, "session-owned").await,
        Err(Some(405))
    );
    let resumed = lapin_session(&b, &id, true, None).await.unwrap();
    let ch = resumed.create_channel().await.unwrap();
    let st = status(&ch).await;
    assert_eq!(st["resumed"], true);
    assert_eq!(st["timeout_s"], 30);
    let q = ch
        .queue_declare(
            "session-owned".into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            LapinTable::default(),
        )
        .await
        .expect("the resumed session owns its exclusive queue");
    assert_eq!(q.message_count(), 3);
    let mut got = Vec::new();
    while let Some(m) = ch
        .basic_get("session-owned".into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        got.push(String::from_utf8(m.delivery.data.clone()).unwrap());
    }
    assert_eq!(got, ["one", "two", "three"]);
}

#[tokio::test]
async fn an_unknown_session_is_404_an_attached_one_405_and_a_malformed_id_530() {
    let b = Broker::start();
    let unknown = new_session_id();
    let (code, text) =
        closed_code(raw_session(&b, props(&[("qpid.session.resume", &unknown)])).await);
    assert_eq!(code, 404, "{text}");
    assert!(
        text.contains(&unknown),
        "the refusal names the session: {text}"
    );

    let id = new_session_id();
    let _attached = lapin_session(&b, &id, false, None).await.unwrap();
    let (code, text) = closed_code(raw_session(&b, props(&[("qpid.session.resume", &id)])).await);
    assert_eq!(code, 405, "{text}");
    let (code, text) = closed_code(raw_session(&b, props(&[("qpid.session.start", &id)])).await);
    assert_eq!(code, 405, "an id is never reused: {text}");

    let (code, text) =
        closed_code(raw_session(&b, props(&[("qpid.session.start", "not-a-uuid")])).await);
    assert_eq!(code, 530, "{text}");
    assert!(text.contains("not a UUID"), "{text}");
    let (code, text) = closed_code(
        raw_session(
            &b,
            props(&[
                ("qpid.session.start", &new_session_id()),
                ("qpid.session.timeout", "soon"),
            ]),
        )
        .await,
    );
    assert_eq!(code, 530, "{text}");
}

#[tokio::test]
async fn keep_session_keeps_it_a_normal_close_ends_it_and_the_timeout_ends_it() {
    let b = Broker::start();
    // 330 KEEP_SESSION: kept, with its queue.
    let id = new_session_id();
    let conn = lapin_session(&b, &id, false, Some(30)).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    declare_exclusive(&ch, "kept").await;
    publish(&ch, "kept", &["a"]).await;
    conn.close(330, "keep my session".into()).await.unwrap();
    let conn = lapin_session(&b, &id, true, None).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    assert_eq!(status(&ch).await["resumed"], true);
    // 200: the session ends, its exclusive queue goes.
    conn.close(200, "done".into()).await.unwrap();
    assert_eq!(
        passive_on_plain_connection(&b, "kept").await,
        Err(Some(404))
    );
    let (code, _) = closed_code(raw_session(&b, props(&[("qpid.session.resume", &id)])).await);
    assert_eq!(code, 404);

    // Kept, never resumed: gone after its timeout.
    let id = new_session_id();
    let conn = lapin_session(&b, &id, false, Some(1)).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    declare_exclusive(&ch, "expiring").await;
    conn.close(330, "keep".into()).await.unwrap();
    assert_eq!(
        passive_on_plain_connection(&b, "expiring").await,
        Err(Some(405)),
        "kept: still the session's"
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while passive_on_plain_connection(&b, "expiring").await != Err(Some(404)) {
        assert!(
            std::time::Instant::now() < deadline,
            "the expired session's queue did not go"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (code, _) = closed_code(raw_session(&b, props(&[("qpid.session.resume", &id)])).await);
    assert_eq!(code, 404);
}

#[tokio::test]
async fn a_connection_the_broker_closes_with_320_keeps_its_session() {
    let b = Broker::start();
    let id = new_session_id();
    let conn = lapin_session(&b, &id, false, Some(30)).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    declare_exclusive(&ch, "forced").await;
    let admin = b.admin_client();
    let listed = admin.get("/api/connections").unwrap().body;
    let name = listed[0]["name"]
        .as_str()
        .expect("the connection's name")
        .to_owned();
    let answer = admin
        .call(
            "DELETE",
            &format!("/api/connections/{}", ringmq::admin_client::seg(&name)),
            None,
        )
        .unwrap();
    assert!(answer.status < 300, "{answer:?}");
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while conn.status().connected() {
        assert!(std::time::Instant::now() < deadline, "not closed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let conn = lapin_session(&b, &id, true, None)
        .await
        .expect("a session closed with 320 resumes");
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(
        "forced".into(),
        QueueDeclareOptions {
            passive: true,
            ..Default::default()
        },
        LapinTable::default(),
    )
    .await
    .expect("its exclusive queue lived on");
}

#[tokio::test]
async fn amq_session_is_only_for_session_connections_and_only_with_no_ack() {
    let b = Broker::start();
    let (_c, ch) = b.channel().await;
    let e = ch
        .basic_get("amq.session".into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap_err();
    assert_eq!(reply_code(&e), Some(404));
    let conn = lapin_session(&b, &new_session_id(), false, None)
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    let q = ch
        .queue_declare(
            "amq.session".into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            LapinTable::default(),
        )
        .await
        .unwrap();
    assert_eq!((q.message_count(), q.consumer_count()), (1, 0));
    let st = status(&ch).await;
    assert_eq!(st["timeout_s"], 60, "the default timeout");
    let e = ch
        .basic_get("amq.session".into(), BasicGetOptions { no_ack: false })
        .await
        .unwrap_err();
    assert_eq!(reply_code(&e), Some(406));
}

/// Reads one basic.deliver (method, header, body) from a raw client: its delivery tag.
async fn raw_delivery_tag(c: &mut RawClient) -> u64 {
    loop {
        let frame = c.read_frame().await.expect("a delivery");
        if let Some(tag) = ringmq::client::deliver_tag(&frame.payload) {
            c.read_frame().await.expect("its header");
            c.read_frame().await.expect("its body");
            return tag;
        }
    }
}

#[tokio::test]
async fn a_resumed_session_acks_the_deliveries_of_its_lost_connection_by_their_tags() {
    use ringmq::amqp::basic;
    use tokio::io::AsyncWriteExt;
    let b = Broker::start();
    let (_c, plain) = b.channel().await;
    plain
        .queue_declare(
            "work".into(),
            QueueDeclareOptions::default(),
            LapinTable::default(),
        )
        .await
        .unwrap();
    publish(&plain, "work", &["m1", "m2", "m3"]).await;

    let id = new_session_id();
    let mut first = raw_session(
        &b,
        props(&[("qpid.session.start", &id), ("qpid.session.timeout", "30")]),
    )
    .await
    .unwrap();
    first
        .call(
            AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
                prefetch_count: 3,
                ..Default::default()
            })),
            |m| matches!(m, AMQPClass::Basic(basic::AMQPMethod::QosOk(_))),
            "basic.qos-ok",
        )
        .await
        .unwrap();
    first
        .call(
            AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
                queue: "work".into(),
                consumer_tag: "c1".into(),
                ..Default::default()
            })),
            |m| matches!(m, AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(_))),
            "basic.consume-ok",
        )
        .await
        .unwrap();
    let mut tags = Vec::new();
    for _ in 0..3 {
        tags.push(raw_delivery_tag(&mut first).await);
    }
    assert_eq!(tags, [1, 2, 3]);
    let mut ack = Vec::new();
    ringmq::client::encode_ack(&mut ack, 1, 1, false);
    first.stream.write_all(&ack).await.unwrap();
    // A round trip, so the ack was processed before the socket goes.
    first
        .call(
            AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
                prefetch_count: 3,
                ..Default::default()
            })),
            |m| matches!(m, AMQPClass::Basic(basic::AMQPMethod::QosOk(_))),
            "basic.qos-ok",
        )
        .await
        .unwrap();
    drop(first);
    tokio::time::sleep(Duration::from_millis(200)).await;
    publish(&plain, "work", &["m4"]).await;
    // Detached, not requeued: m2 and m3 wait for the session, m4 is ready.
    let q = plain
        .queue_declare(
            "work".into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            LapinTable::default(),
        )
        .await
        .unwrap();
    assert_eq!(q.message_count(), 1, "only m4 is ready");

    let resumed = lapin_session(&b, &id, true, None).await.unwrap();
    let ch = resumed.create_channel().await.unwrap();
    assert_eq!(ch.id(), 1);
    let st = status(&ch).await;
    assert_eq!(st["channels"]["1"]["unacked"], serde_json::json!([2, 3]));
    // The status read took tag 4; the lost connection's tags are acked on the resumed channel.
    assert_eq!(st["channels"]["1"]["next_delivery_tag"], 5);
    ch.basic_ack(2, lapin::options::BasicAckOptions::default())
        .await
        .unwrap();
    let got = ch
        .basic_get("work".into(), BasicGetOptions { no_ack: false })
        .await
        .unwrap()
        .expect("m4");
    assert_eq!(got.delivery.data, b"m4");
    assert_eq!(
        got.delivery.delivery_tag, 5,
        "tags go on from where the session was"
    );
    got.ack(lapin::options::BasicAckOptions::default())
        .await
        .unwrap();
    // Closing the channel ends it: m3, never acked, goes back marked redelivered.
    ch.close(200, "done".into()).await.unwrap();
    let again = plain
        .basic_get("work".into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .expect("m3 back in its queue");
    assert_eq!(again.delivery.data, b"m3");
    assert!(again.delivery.redelivered);
    assert!(
        plain
            .basic_get("work".into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
            .is_none(),
        "m1, m2 and m4 were acked"
    );
}

/// Publishes `bodies` to `queue` on a raw client's channel 1, then makes a round trip on the
/// channel (a passive declare of `amq.direct`): the broker processed the publishes before it.
pub(crate) async fn raw_publish(client: &mut RawClient, queue: &str, bodies: &[&str]) {
    use ringmq::amqp::exchange;
    use tokio::io::AsyncWriteExt;
    let mut frames = Vec::new();
    for body in bodies {
        ringmq::client::encode_publish(&mut frames, 1, "", queue, false, body.as_bytes(), 131_072);
    }
    client.stream.write_all(&frames).await.unwrap();
    client
        .call(
            AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
                exchange: "amq.direct".into(),
                kind: "direct".into(),
                passive: true,
                ..Default::default()
            })),
            |m| matches!(m, AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(_))),
            "exchange.declare-ok",
        )
        .await
        .unwrap();
}
