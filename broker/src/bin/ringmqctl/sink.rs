//! `ringmqctl sink`: a stand-in broker that does no work — it accepts publishes and drops
//! them (acking under confirms) and feeds every consumer an endless stream of deliveries. Run
//! `ringmqctl bench` against it to measure the load tool's own ceiling: a broker that is
//! measured at a rate close to this figure is being measured at the tool's limit.

use anyhow::Context;
use clap::Args;
use ringmq::amqp::frame::{self, FRAME_METHOD, PROTOCOL_HEADER};
use ringmq::amqp::writer::FrameWriter;
use ringmq::amqp::{AMQPClass, FieldTable, basic, channel, confirm, connection, queue};
use std::net::SocketAddr;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Options of `ringmqctl sink`.
#[derive(Debug, Clone, Args)]
pub struct SinkArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:5699")]
    listen: SocketAddr,
    /// Body size of the deliveries it sends to consumers.
    #[arg(long, default_value_t = 1000)]
    size: usize,
}

/// Deliveries written per batch to a consumer.
const DELIVERY_BATCH: usize = 256;

/// Runs the sink until interrupted.
pub fn run(args: SinkArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let listener = TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("cannot listen on {}", args.listen))?;
        println!("ringmqctl sink listening amqp={}", listener.local_addr()?);
        loop {
            let (stream, _) = listener.accept().await?;
            stream.set_nodelay(true)?;
            let size = args.size;
            tokio::spawn(async move {
                if let Err(e) = serve(stream, size).await {
                    eprintln!("sink connection ended: {e}");
                }
            });
        }
    })
}

async fn serve(mut stream: TcpStream, size: usize) -> anyhow::Result<()> {
    let mut header = [0u8; 8];
    stream.read_exact(&mut header).await?;
    anyhow::ensure!(&header == PROTOCOL_HEADER, "not an AMQP 0-9-1 client");
    let mut w = FrameWriter::default();
    w.method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Start(connection::Start {
            version_major: 0,
            version_minor: 9,
            server_properties: FieldTable::default(),
            mechanisms: "PLAIN".into(),
            locales: "en_US".into(),
        })),
    );
    stream.write_all(w.as_slice()).await?;
    let mut rbuf = bytes::BytesMut::with_capacity(256 * 1024);
    let mut confirm = false;
    let mut publishes = 0u64;
    let mut acked = 0u64;
    loop {
        if stream.read_buf(&mut rbuf).await? == 0 {
            return Ok(());
        }
        w.clear();
        while let Some(f) = frame::split_frame(&mut rbuf, u32::MAX)? {
            if f.kind != FRAME_METHOD {
                continue;
            }
            if f.payload.starts_with(&[0, 60, 0, 40]) {
                publishes += 1;
                continue;
            }
            if f.payload.starts_with(&[0, 60, 0, 80]) {
                continue;
            }
            let Ok((_, m)) = amq_protocol::protocol::parse_class(&f.payload[..]) else {
                continue;
            };
            let reply = match m {
                AMQPClass::Connection(connection::AMQPMethod::StartOk(_)) => Some(
                    AMQPClass::Connection(connection::AMQPMethod::Tune(connection::Tune {
                        channel_max: 2047,
                        frame_max: 131_072,
                        heartbeat: 0,
                    })),
                ),
                AMQPClass::Connection(connection::AMQPMethod::Open(_)) => Some(
                    AMQPClass::Connection(connection::AMQPMethod::OpenOk(connection::OpenOk {})),
                ),
                AMQPClass::Connection(connection::AMQPMethod::Close(_)) => Some(
                    AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
                ),
                AMQPClass::Channel(channel::AMQPMethod::Open(_)) => Some(AMQPClass::Channel(
                    channel::AMQPMethod::OpenOk(channel::OpenOk {}),
                )),
                AMQPClass::Queue(queue::AMQPMethod::Declare(d)) => Some(AMQPClass::Queue(
                    queue::AMQPMethod::DeclareOk(queue::DeclareOk {
                        queue: d.queue,
                        message_count: 0,
                        consumer_count: 0,
                    }),
                )),
                AMQPClass::Queue(queue::AMQPMethod::Delete(_)) => Some(AMQPClass::Queue(
                    queue::AMQPMethod::DeleteOk(queue::DeleteOk { message_count: 0 }),
                )),
                AMQPClass::Basic(basic::AMQPMethod::Qos(_)) => {
                    Some(AMQPClass::Basic(basic::AMQPMethod::QosOk(basic::QosOk {})))
                }
                AMQPClass::Confirm(confirm::AMQPMethod::Select(_)) => {
                    confirm = true;
                    Some(AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(
                        confirm::SelectOk {},
                    )))
                }
                AMQPClass::Basic(basic::AMQPMethod::Consume(c)) => {
                    w.method(
                        f.channel,
                        AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(basic::ConsumeOk {
                            consumer_tag: "sink".into(),
                        })),
                    );
                    stream.write_all(w.as_slice()).await?;
                    return feed(stream, f.channel, c.queue.as_str(), size).await;
                }
                _ => None,
            };
            if let Some(reply) = reply {
                w.method(f.channel, reply);
            }
        }
        if confirm && publishes > acked {
            w.method(
                1,
                AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                    delivery_tag: publishes,
                    multiple: true,
                })),
            );
            acked = publishes;
        }
        if !w.is_empty() {
            stream.write_all(w.as_slice()).await?;
        }
    }
}

/// Sends deliveries as fast as the consumer reads them and drains the consumer's acks. Bodies
/// carry no send time: latency figures against the sink mean nothing.
async fn feed(
    stream: TcpStream,
    channel: u16,
    queue_name: &str,
    size: usize,
) -> anyhow::Result<()> {
    let (mut reader, mut writer) = stream.into_split();
    tokio::spawn(async move {
        let mut sink = vec![0u8; 64 * 1024];
        while let Ok(1..) = reader.read(&mut sink).await {}
    });
    let header = FrameWriter::encode_header_payload(size as u64, &Default::default());
    let body = vec![0u8; size];
    let mut tag = 0u64;
    let mut w = FrameWriter::default();
    loop {
        w.clear();
        for _ in 0..DELIVERY_BATCH {
            tag += 1;
            w.deliver(channel, "sink", tag, false, "", queue_name);
            w.header_payload(channel, &header);
            w.body(channel, &body, 131_072);
        }
        writer.write_all(w.as_slice()).await?;
    }
}
