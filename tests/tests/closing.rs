//! Closing channels and connections the way real clients do it, concurrently and untidily:
//! a channel.close that crosses the broker's own, a connection closed while the client is
//! still sending, and channel.flow, which RabbitMQ refuses to stop.

use amq_protocol::protocol::{AMQPClass, channel, connection, queue};
use ringmq::amqp::frame::{FRAME_HEARTBEAT, FRAME_METHOD};
use ringmq::amqp::writer::FrameWriter;
use ringmq::client::{ClientError, RawClient, Target};
use ringmq_tests::{Broker, frame};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn raw(b: &Broker) -> RawClient {
    let target = Target::parse(&b.uri()).expect("the harness URI parses");
    RawClient::connect(&target).await.expect("raw handshake")
}

/// Reads method frames until one matches, returning its channel; a connection.close from the
/// broker fails the test with its code.
async fn next_method(c: &mut RawClient) -> (u16, AMQPClass) {
    let read = async {
        loop {
            let f = c.read_frame().await.expect("the connection stays up");
            if f.kind != FRAME_METHOD {
                continue;
            }
            let (_, m) = amq_protocol::protocol::parse_class(&f.payload[..]).expect("decodes");
            if let AMQPClass::Connection(connection::AMQPMethod::Close(close)) = &m {
                panic!(
                    "the broker closed the connection: {} {}",
                    close.reply_code, close.reply_text
                );
            }
            return (f.channel, m);
        }
    };
    tokio::time::timeout(Duration::from_secs(5), read)
        .await
        .expect("a method within 5 s")
}

/// Opens channel `id` and waits for open-ok.
async fn open_channel(c: &mut RawClient, id: u16) {
    c.send(
        id,
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
    )
    .await
    .unwrap();
    assert!(matches!(
        next_method(c).await,
        (got, AMQPClass::Channel(channel::AMQPMethod::OpenOk(_))) if got == id
    ));
}

/// Sends, in one write on channel 1, a publish the broker refuses with a channel error (404,
/// no such exchange) and the client's own channel.close, sent before it could see the
/// broker's: the two closes cross.
async fn cross_closes_on_channel_1(c: &mut RawClient) {
    let mut bytes =
        ringmq_tests::publish_frames("no-such-exchange", "k", &Default::default(), b"x");
    let mut w = FrameWriter::default();
    w.method(
        1,
        AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
            reply_code: 200,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        })),
    );
    bytes.extend_from_slice(w.as_slice());
    c.stream.write_all(&bytes).await.unwrap();
}

#[tokio::test]
async fn a_channel_close_that_crosses_the_brokers_leaves_the_other_channels_alone() {
    let b = Broker::start();
    let mut c = raw(&b).await;
    open_channel(&mut c, 2).await;
    cross_closes_on_channel_1(&mut c).await;

    // The broker's close (404), then close-ok for the client's close.
    let (id, m) = next_method(&mut c).await;
    assert_eq!(id, 1);
    match m {
        AMQPClass::Channel(channel::AMQPMethod::Close(close)) => {
            assert_eq!(close.reply_code, 404, "{}", close.reply_text)
        }
        m => panic!("expected channel.close, got {m:?}"),
    }
    let (id, m) = next_method(&mut c).await;
    assert_eq!(id, 1);
    assert!(
        matches!(m, AMQPClass::Channel(channel::AMQPMethod::CloseOk(_))),
        "expected channel.close-ok, got {m:?}"
    );
    // The spec's rule for the client: it answers the broker's close with close-ok.
    c.send(
        1,
        AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
    )
    .await
    .unwrap();

    // Channel 2 never noticed, and channel 1 can be opened again.
    c.send(
        2,
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: "still-here".into(),
            ..Default::default()
        })),
    )
    .await
    .unwrap();
    assert!(matches!(
        next_method(&mut c).await,
        (2, AMQPClass::Queue(queue::AMQPMethod::DeclareOk(_)))
    ));
    open_channel(&mut c, 1).await;
}

#[tokio::test]
async fn a_client_that_reopens_a_channel_after_a_crossing_close_gets_it() {
    let b = Broker::start();
    let mut c = raw(&b).await;
    cross_closes_on_channel_1(&mut c).await;
    for _ in 0..2 {
        assert_eq!(next_method(&mut c).await.0, 1);
    }
    // No close-ok for the broker's close: the client treats the channel as gone and reuses
    // the number.
    open_channel(&mut c, 1).await;
}

#[tokio::test]
async fn closing_a_connection_while_the_client_still_sends_ends_in_close_ok_and_no_reset() {
    let b = Broker::start();
    let mut c = raw(&b).await;
    let close = |w: &mut FrameWriter| {
        w.method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
                reply_code: 200,
                reply_text: "bye".into(),
                class_id: 0,
                method_id: 0,
            })),
        )
    };
    // Two threads of the client close the connection at once, and more frames follow
    // (heartbeats): the broker has not read them when it answers the first close.
    let mut w = FrameWriter::default();
    close(&mut w);
    close(&mut w);
    let mut bytes = w.as_slice().to_vec();
    for _ in 0..4_000 {
        bytes.extend(frame(FRAME_HEARTBEAT, 0, &[]));
    }
    c.stream.write_all(&bytes).await.unwrap();
    // Give the broker time to answer and close, as a client busy elsewhere would.
    tokio::time::sleep(Duration::from_millis(300)).await;
    c.stream.shutdown().await.unwrap();
    let mut got = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), c.stream.read_to_end(&mut got))
        .await
        .expect("the broker closes within 5 s");
    read.expect("the broker closes gracefully: no 'connection reset by peer'");
    let close_ok = frame(
        FRAME_METHOD,
        0,
        &[0, 10, 0, 51], // connection.close-ok
    );
    assert!(
        got.windows(close_ok.len()).any(|w| w == close_ok),
        "connection.close-ok arrives: {got:?}"
    );
}

#[tokio::test]
async fn channel_flow_active_false_is_not_implemented_as_in_rabbitmq() {
    let b = Broker::start();
    let mut c = raw(&b).await;
    let flow = |active| AMQPClass::Channel(channel::AMQPMethod::Flow(channel::Flow { active }));
    let ok = c
        .call(
            flow(true),
            |m| matches!(m, AMQPClass::Channel(channel::AMQPMethod::FlowOk(_))),
            "channel.flow-ok",
        )
        .await
        .expect("active=true is answered");
    assert!(matches!(
        ok,
        AMQPClass::Channel(channel::AMQPMethod::FlowOk(channel::FlowOk {
            active: true
        }))
    ));
    c.send(1, flow(false)).await.unwrap();
    match c.read_method().await {
        Err(ClientError::Closed { scope, code, text }) => {
            assert_eq!((scope, code), ("connection", 540), "{text}");
            assert!(text.contains("active=false"), "{text}");
        }
        other => panic!("expected connection.close 540, got {other:?}"),
    }
}
