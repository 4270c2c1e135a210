//! Malformed and hostile input on raw sockets: the broker answers with the reply code the
//! spec names, closes only what it must, and keeps serving everyone else with nothing lost.

use lapin::BasicProperties;
use lapin::options::*;
use lapin::types::FieldTable;
use ringmq::amqp::frame::PROTOCOL_HEADER;
use ringmq::amqp::writer::FrameWriter;
use ringmq::amqp::{AMQPClass, channel, queue};
use ringmq::client::{ClientError, RawClient, Target, encode_publish};
use ringmq_tests::{Broker, frame};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

async fn raw(b: &Broker) -> RawClient {
    RawClient::connect(&Target::parse(&b.uri()).unwrap())
        .await
        .unwrap()
}

/// Reads until the broker closes the connection; returns the reply code of its close.
async fn close_code(c: &mut RawClient) -> u16 {
    let wait = async {
        loop {
            match c.read_method().await {
                Err(ClientError::Closed {
                    scope: "connection",
                    code,
                    ..
                }) => return code,
                Err(e) => panic!("expected connection.close, got {e}"),
                Ok(_) => continue,
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(5), wait)
        .await
        .expect("connection.close within 5 s")
}

/// Reads until the broker closes channel 1; returns the reply code.
async fn channel_close_code(c: &mut RawClient) -> u16 {
    loop {
        match c.read_method().await {
            Err(ClientError::Closed {
                scope: "channel",
                code,
                ..
            }) => return code,
            Err(e) => panic!("expected channel.close, got {e}"),
            Ok(_) => continue,
        }
    }
}

/// A durable queue with messages, and a check after the abuse that they are all still there
/// and that a well-behaved client is served.
struct Bystander {
    conn: lapin::Connection,
}

impl Bystander {
    async fn new(b: &Broker) -> Self {
        let conn = b.connect().await;
        let ch = conn.create_channel().await.unwrap();
        ch.queue_declare(
            "kept".into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        for i in 0..10u8 {
            let c = ch
                .basic_publish(
                    "".into(),
                    "kept".into(),
                    BasicPublishOptions::default(),
                    &[i],
                    BasicProperties::default().with_delivery_mode(2),
                )
                .await
                .unwrap();
            assert!(c.await.unwrap().is_ack());
        }
        Bystander { conn }
    }

    async fn still_fine(&self) {
        let ch = self
            .conn
            .create_channel()
            .await
            .expect("the bystander's connection is still open");
        let q = ch
            .queue_declare(
                "kept".into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        assert_eq!(q.message_count(), 10, "nothing queued was lost");
    }
}

#[tokio::test]
async fn a_wrong_protocol_header_gets_the_servers_header_then_close() {
    let b = Broker::start();
    for junk in [
        &b"GET / HTTP/1.1\r\n\r\n"[..],
        b"AMQP\x00\x00\x09\x00",
        b"AMQP\x01\x01\x00\x0a",
    ] {
        let mut s = TcpStream::connect(b.addr).await.unwrap();
        s.write_all(junk).await.unwrap();
        let mut reply = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut reply))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(reply, PROTOCOL_HEADER, "for {junk:?}");
    }
}

#[tokio::test]
async fn a_frame_larger_than_frame_max_is_a_frame_error() {
    let b = Broker::start();
    let by = Bystander::new(&b).await;
    let mut c = raw(&b).await;
    // Only the header: the broker must refuse from the announced size, before buffering.
    c.stream.write_all(&[3, 0, 1, 0x10, 0, 0, 0]).await.unwrap();
    assert_eq!(close_code(&mut c).await, 501);
    by.still_fine().await;
}

#[tokio::test]
async fn a_bad_frame_end_octet_is_a_frame_error() {
    let b = Broker::start();
    let mut c = raw(&b).await;
    let mut f = frame(8, 0, b"");
    *f.last_mut().unwrap() = 0x00;
    c.stream.write_all(&f).await.unwrap();
    assert_eq!(close_code(&mut c).await, 501);
}

#[tokio::test]
async fn an_unknown_frame_type_is_a_frame_error() {
    let b = Broker::start();
    let mut c = raw(&b).await;
    c.stream.write_all(&frame(9, 0, b"x")).await.unwrap();
    assert_eq!(close_code(&mut c).await, 501);
}

#[tokio::test]
async fn a_method_on_a_channel_that_is_not_open_is_a_channel_error() {
    let b = Broker::start();
    let mut c = raw(&b).await;
    let mut w = FrameWriter::default();
    w.method(
        5,
        AMQPClass::Queue(queue::AMQPMethod::Purge(queue::Purge {
            queue: "q".into(),
            nowait: false,
        })),
    );
    c.stream.write_all(w.as_slice()).await.unwrap();
    assert_eq!(close_code(&mut c).await, 504);
}

#[tokio::test]
async fn an_unknown_class_or_method_is_not_implemented() {
    let b = Broker::start();
    for payload in [&[0u8, 99, 0, 10][..], &[0, 50, 0, 99]] {
        let mut c = raw(&b).await;
        c.stream.write_all(&frame(1, 1, payload)).await.unwrap();
        assert_eq!(close_code(&mut c).await, 540, "for {payload:?}");
    }
}

#[tokio::test]
async fn content_without_a_preceding_publish_is_an_unexpected_frame() {
    let b = Broker::start();
    let mut c = raw(&b).await;
    c.stream
        .write_all(&frame(3, 1, b"orphan body"))
        .await
        .unwrap();
    assert_eq!(close_code(&mut c).await, 505);
    let mut c = raw(&b).await;
    c.stream
        .write_all(&frame(2, 1, &[0, 60, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0]))
        .await
        .unwrap();
    assert_eq!(close_code(&mut c).await, 505);
}

#[tokio::test]
async fn a_method_in_the_middle_of_content_is_an_unexpected_frame() {
    let b = Broker::start();
    let mut c = raw(&b).await;
    let mut out = Vec::new();
    encode_publish(&mut out, 1, "", "q", false, &[1u8; 100], c.frame_max);
    // Cut the message after its header and send a method instead of the body.
    let cut = out.len() - (100 + 8);
    out.truncate(cut);
    let mut w = FrameWriter::default();
    w.method(
        1,
        AMQPClass::Channel(channel::AMQPMethod::Flow(channel::Flow { active: true })),
    );
    out.extend_from_slice(w.as_slice());
    c.stream.write_all(&out).await.unwrap();
    assert_eq!(close_code(&mut c).await, 505);
}

#[tokio::test]
async fn a_body_longer_than_its_header_announced_is_a_frame_error() {
    let b = Broker::start();
    let by = Bystander::new(&b).await;
    let mut c = raw(&b).await;
    let mut out = Vec::new();
    encode_publish(&mut out, 1, "", "kept", false, &[1u8; 10], c.frame_max);
    let body = out.len() - (10 + 8);
    out.truncate(body);
    out.extend_from_slice(&frame(3, 1, &[2u8; 11]));
    c.stream.write_all(&out).await.unwrap();
    assert_eq!(close_code(&mut c).await, 501);
    by.still_fine().await;
}

#[tokio::test]
async fn a_channel_number_above_channel_max_is_a_channel_error() {
    let b = Broker::start();
    let mut c = raw(&b).await;
    let mut w = FrameWriter::default();
    w.method(
        60_000,
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
    );
    c.stream.write_all(w.as_slice()).await.unwrap();
    assert_eq!(close_code(&mut c).await, 504);
}

#[tokio::test]
async fn a_field_table_that_lies_about_its_length_is_a_syntax_error() {
    let b = Broker::start();
    let by = Bystander::new(&b).await;
    let mut c = raw(&b).await;
    // queue.declare: ticket, name "q", flags, then a table claiming 1000 bytes but holding 3.
    let mut payload = vec![0, 50, 0, 10, 0, 0, 1, b'q', 0];
    payload.extend_from_slice(&1000u32.to_be_bytes());
    payload.extend_from_slice(&[1, b'a', b't']);
    c.stream.write_all(&frame(1, 1, &payload)).await.unwrap();
    assert_eq!(close_code(&mut c).await, 502);
    by.still_fine().await;
}

#[tokio::test]
async fn a_heartbeat_on_a_channel_other_than_zero_is_a_frame_error() {
    let b = Broker::start();
    let mut c = raw(&b).await;
    c.stream.write_all(&frame(8, 3, b"")).await.unwrap();
    assert_eq!(close_code(&mut c).await, 501);
}

#[tokio::test]
async fn a_second_channel_open_is_a_channel_error() {
    let b = Broker::start();
    let mut c = raw(&b).await;
    let mut w = FrameWriter::default();
    w.method(
        1,
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
    );
    c.stream.write_all(w.as_slice()).await.unwrap();
    assert_eq!(close_code(&mut c).await, 504);
}

#[tokio::test]
async fn a_channel_error_closes_only_the_channel_and_it_can_be_reopened() {
    let b = Broker::start();
    let mut c = raw(&b).await;
    c.send(
        1,
        AMQPClass::Queue(queue::AMQPMethod::Purge(queue::Purge {
            queue: "missing".into(),
            nowait: false,
        })),
    )
    .await
    .unwrap();
    assert_eq!(channel_close_code(&mut c).await, 404);
    // Frames on the closing channel are ignored until close-ok.
    c.send(
        1,
        AMQPClass::Queue(queue::AMQPMethod::Purge(queue::Purge {
            queue: "missing".into(),
            nowait: false,
        })),
    )
    .await
    .unwrap();
    c.send(
        1,
        AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
    )
    .await
    .unwrap();
    c.call(
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        |m| matches!(m, AMQPClass::Channel(channel::AMQPMethod::OpenOk(_))),
        "channel.open-ok",
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn opening_ten_thousand_channels_stops_at_channel_max_and_others_are_unaffected() {
    let b = Broker::start();
    let by = Bystander::new(&b).await;
    let mut c = raw(&b).await;
    let mut out = FrameWriter::default();
    for id in 2..=10_000u16 {
        out.method(
            id,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        );
    }
    c.stream.write_all(out.as_slice()).await.unwrap();
    let mut opened = 1;
    let code = loop {
        match c.read_method().await {
            Ok(AMQPClass::Channel(channel::AMQPMethod::OpenOk(_))) => opened += 1,
            Err(ClientError::Closed {
                scope: "connection",
                code,
                ..
            }) => break code,
            other => panic!("unexpected {other:?}"),
        }
    };
    assert_eq!(
        (opened, code),
        (2047, 504),
        "channels up to channel-max open, the next is refused"
    );
    by.still_fine().await;
}

#[tokio::test]
async fn ten_thousand_connections_in_a_loop_leave_the_broker_serving() {
    let b = Broker::start();
    let by = Bystander::new(&b).await;
    let target = Target::parse(&b.uri()).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    let mut open = Vec::new();
    for i in 0..10_000 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "10,000 handshakes took over 120 s (at {i})"
        );
        open.push(
            RawClient::connect(&target)
                .await
                .unwrap_or_else(|e| panic!("connection {i}: {e}")),
        );
    }
    by.still_fine().await;
    drop(open);
    by.still_fine().await;
}

#[tokio::test]
async fn a_client_that_sends_nothing_is_closed_after_the_handshake_timeout() {
    let b = Broker::start_with_config("handshake_timeout_s: 1\n");
    let mut s = TcpStream::connect(b.addr).await.unwrap();
    let mut buf = Vec::new();
    let n = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf))
        .await
        .expect("closed within 5 s")
        .unwrap();
    assert_eq!(n, 0);
}
