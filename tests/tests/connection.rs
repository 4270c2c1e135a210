//! The connection handshake, login, vhosts, heartbeats and flow notices.

use lapin::ConnectionProperties;
use ringmq::amqp::frame::PROTOCOL_HEADER;
use ringmq::amqp::writer::FrameWriter;
use ringmq::amqp::{AMQPClass, AMQPValue, FieldTable, connection};
use ringmq::client::{ClientError, RawClient, Target};
use ringmq_tests::{Broker, reply_code};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Opens a socket, sends the header and returns the raw client and connection.start.
async fn start(b: &Broker) -> (RawClient, connection::Start) {
    let stream = tokio::net::TcpStream::connect(b.addr).await.unwrap();
    let mut c = RawClient::unopened(stream);
    c.stream.write_all(PROTOCOL_HEADER).await.unwrap();
    match c.read_method().await.unwrap() {
        AMQPClass::Connection(connection::AMQPMethod::Start(s)) => (c, s),
        m => panic!("expected start, got {m:?}"),
    }
}

fn amqplain(user: &str, password: &str) -> Vec<u8> {
    let mut t = Vec::new();
    for (k, v) in [("LOGIN", user), ("PASSWORD", password)] {
        t.push(k.len() as u8);
        t.extend_from_slice(k.as_bytes());
        t.push(b'S');
        t.extend_from_slice(&(v.len() as u32).to_be_bytes());
        t.extend_from_slice(v.as_bytes());
    }
    t
}

async fn start_ok(c: &mut RawClient, mechanism: &str, response: &[u8], caps: &[&str]) {
    let mut table = FieldTable::default();
    for cap in caps {
        table.insert((*cap).into(), AMQPValue::Boolean(true));
    }
    let mut props = FieldTable::default();
    props.insert("capabilities".into(), AMQPValue::FieldTable(table));
    c.send(
        0,
        AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
            client_properties: props,
            mechanism: mechanism.into(),
            response: response.into(),
            locale: "en_US".into(),
        })),
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn server_properties_advertise_the_capabilities_it_implements() {
    let b = Broker::start();
    let (_c, s) = start(&b).await;
    assert_eq!((s.version_major, s.version_minor), (0, 9));
    let Some(AMQPValue::FieldTable(caps)) = s.server_properties.inner().get("capabilities") else {
        panic!("no capabilities")
    };
    for cap in [
        "publisher_confirms",
        "exchange_exchange_bindings",
        "basic.nack",
        "consumer_cancel_notify",
        "connection.blocked",
        "authentication_failure_close",
        "per_consumer_qos",
    ] {
        assert_eq!(
            caps.inner().get(cap),
            Some(&AMQPValue::Boolean(true)),
            "{cap}"
        );
    }
    assert_eq!(
        String::from_utf8_lossy(s.mechanisms.as_bytes()),
        "PLAIN AMQPLAIN"
    );
}

#[tokio::test]
async fn amqplain_login_reaches_tune() {
    let b = Broker::start();
    let (mut c, _) = start(&b).await;
    start_ok(&mut c, "AMQPLAIN", &amqplain("guest", "guest"), &[]).await;
    assert!(matches!(
        c.read_method().await.unwrap(),
        AMQPClass::Connection(connection::AMQPMethod::Tune(_))
    ));
}

#[tokio::test]
async fn a_wrong_password_is_refused_with_access_refused() {
    let b = Broker::start();
    let uri = format!("amqp://guest:wrong@{}/%2f", b.addr);
    let e = lapin::Connection::connect(&uri, ConnectionProperties::default())
        .await
        .unwrap_err();
    assert_eq!(reply_code(&e), Some(403), "{e:?}");
    // Without authentication_failure_close the broker just closes the socket.
    let (mut c, _) = start(&b).await;
    start_ok(&mut c, "PLAIN", b"\0guest\0wrong", &[]).await;
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), c.stream.read_to_end(&mut rest))
        .await
        .unwrap()
        .unwrap();
    assert!(rest.is_empty());
}

#[tokio::test]
async fn an_unknown_mechanism_is_command_invalid() {
    let b = Broker::start();
    let (mut c, _) = start(&b).await;
    start_ok(
        &mut c,
        "SCRAM-SHA-1",
        b"x",
        &["authentication_failure_close"],
    )
    .await;
    match c.read_method().await {
        Err(ClientError::Closed { code, .. }) => assert_eq!(code, 503),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn configured_users_and_vhosts_are_enforced() {
    let b = Broker::start_with_config(
        "vhosts: [\"/\", \"apps\"]\nusers:\n  - name: app\n    password: s3cret\n    vhosts: [apps]\n",
    );
    let ok = format!("amqp://app:s3cret@{}/apps", b.addr);
    let conn = lapin::Connection::connect(&ok, ConnectionProperties::default())
        .await
        .unwrap();
    conn.create_channel().await.unwrap();
    let denied = format!("amqp://app:s3cret@{}/%2f", b.addr);
    let e = lapin::Connection::connect(&denied, ConnectionProperties::default())
        .await
        .unwrap_err();
    assert_eq!(reply_code(&e), Some(530));
    let missing = format!("amqp://app:s3cret@{}/nowhere", b.addr);
    let e = lapin::Connection::connect(&missing, ConnectionProperties::default())
        .await
        .unwrap_err();
    assert_eq!(reply_code(&e), Some(530));
    let guest = lapin::Connection::connect(&b.uri(), ConnectionProperties::default())
        .await
        .unwrap_err();
    assert_eq!(
        reply_code(&guest),
        Some(403),
        "guest is not configured any more"
    );
}

#[tokio::test]
async fn the_broker_sends_heartbeats_and_closes_a_silent_client() {
    let b = Broker::start();
    let (mut c, _) = start(&b).await;
    start_ok(&mut c, "PLAIN", b"\0guest\0guest", &[]).await;
    assert!(matches!(
        c.read_method().await.unwrap(),
        AMQPClass::Connection(connection::AMQPMethod::Tune(_))
    ));
    let mut w = FrameWriter::default();
    w.method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
            channel_max: 0,
            frame_max: 131_072,
            heartbeat: 1,
        })),
    );
    w.method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
            virtual_host: "/".into(),
        })),
    );
    c.stream.write_all(w.as_slice()).await.unwrap();
    let started = std::time::Instant::now();
    let mut heartbeats = 0;
    let end = loop {
        match tokio::time::timeout(Duration::from_secs(10), c.read_frame())
            .await
            .expect("closed within 10 s")
        {
            Ok(f) if f.kind == 8 => heartbeats += 1,
            Ok(_) => {}
            Err(e) => break e,
        }
    };
    assert!(matches!(end, ClientError::Io(_)), "{end}");
    assert!(heartbeats >= 1, "the broker sent heartbeats");
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(1500),
        "closed after {waited:?}: too early for two missed 1 s heartbeats"
    );
}

#[tokio::test]
async fn publishers_are_told_when_memory_is_over_the_watermark() {
    let b = Broker::start_with_config("memory_high_watermark_bytes: 1\n");
    let (mut c, _) = start(&b).await;
    start_ok(&mut c, "PLAIN", b"\0guest\0guest", &["connection.blocked"]).await;
    let _tune = c.read_method().await.unwrap();
    let mut w = FrameWriter::default();
    w.method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
            channel_max: 0,
            frame_max: 131_072,
            heartbeat: 0,
        })),
    );
    w.method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
            virtual_host: "/".into(),
        })),
    );
    c.stream.write_all(w.as_slice()).await.unwrap();
    let mut blocked = false;
    for _ in 0..3 {
        match tokio::time::timeout(Duration::from_secs(5), c.read_method())
            .await
            .expect("a frame within 5 s")
            .unwrap()
        {
            AMQPClass::Connection(connection::AMQPMethod::Blocked(b)) => {
                assert_eq!(b.reason.as_str(), "low on memory");
                blocked = true;
                break;
            }
            _ => continue,
        }
    }
    assert!(blocked);
}

#[tokio::test]
async fn a_tune_ok_with_frame_max_below_the_minimum_is_refused() {
    let b = Broker::start();
    let target = Target::parse(&b.uri()).unwrap();
    assert!(RawClient::connect(&target).await.is_ok());
    let (mut c, _) = start(&b).await;
    start_ok(&mut c, "PLAIN", b"\0guest\0guest", &[]).await;
    let _tune = c.read_method().await.unwrap();
    c.send(
        0,
        AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
            channel_max: 0,
            frame_max: 100,
            heartbeat: 0,
        })),
    )
    .await
    .unwrap();
    match c.read_method().await {
        Err(ClientError::Closed { code, .. }) => assert_eq!(code, 502),
        other => panic!("{other:?}"),
    }
}
