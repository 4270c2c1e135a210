//! Per-user, per-vhost configure/write/read permissions, with RabbitMQ's semantics and reply
//! texts: configure = declare/delete, write = publish and bind destination, read =
//! consume/get/purge and bind source; the default exchange is `amq.default`.

use ringmq::amqp::{AMQPClass, basic, channel, exchange, queue};
use ringmq::client::{ClientError, RawClient, Target, encode_publish};
use ringmq_tests::{Broker, binary};
use serde_json::json;
use tokio::io::AsyncWriteExt;

const CONFIG: &str = r#"
users:
  - name: guest
    password: guest
    tags: [administrator]
  - name: app
    password: app
    permissions:
      "/": {configure: '^app-', write: '^(app-.*|amq\.default)$', read: '^app-'}
"#;

async fn connect(b: &Broker, user: &str) -> RawClient {
    let t = Target::parse(&format!("amqp://{user}:{user}@{}/%2f", b.addr)).unwrap();
    RawClient::connect(&t).await.unwrap()
}

fn declare_queue(name: &str) -> AMQPClass {
    AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
        queue: name.into(),
        ..Default::default()
    }))
}

fn declare_exchange(name: &str) -> AMQPClass {
    AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
        exchange: name.into(),
        kind: "direct".into(),
        ..Default::default()
    }))
}

fn bind(queue: &str, exchange: &str) -> AMQPClass {
    AMQPClass::Queue(queue::AMQPMethod::Bind(queue::Bind {
        queue: queue.into(),
        exchange: exchange.into(),
        routing_key: "k".into(),
        ..Default::default()
    }))
}

fn get(queue: &str) -> AMQPClass {
    AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
        queue: queue.into(),
        no_ack: true,
    }))
}

/// Sends `m` and expects its reply (any method other than a close).
async fn allowed(c: &mut RawClient, m: AMQPClass) {
    c.call(m, |_| true, "a reply").await.unwrap();
}

/// Sends `m`, expects the channel closed with 403, reopens channel 1, returns the text.
async fn refused(c: &mut RawClient, m: AMQPClass) -> String {
    c.send(1, m).await.unwrap();
    closed_and_reopened(c).await
}

async fn closed_and_reopened(c: &mut RawClient) -> String {
    let text = match c.read_method().await {
        Err(ClientError::Closed {
            scope: "channel",
            code: 403,
            text,
        }) => text,
        r => panic!("expected channel.close 403, got {r:?}"),
    };
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
    text
}

async fn publish(c: &mut RawClient, exchange: &str, routing_key: &str) {
    let mut out = Vec::new();
    encode_publish(&mut out, 1, exchange, routing_key, false, b"m", c.frame_max);
    c.stream.write_all(&out).await.unwrap();
}

#[tokio::test]
async fn configure_governs_declare_and_delete() {
    let b = Broker::start_with_config(CONFIG);
    let mut app = connect(&b, "app").await;
    allowed(&mut app, declare_queue("app-q")).await;
    allowed(&mut app, declare_exchange("app-x")).await;
    assert_eq!(
        refused(&mut app, declare_queue("orders")).await,
        "ACCESS_REFUSED - access to queue 'orders' in vhost '/' refused for user 'app'"
    );
    assert_eq!(
        refused(&mut app, declare_exchange("events")).await,
        "ACCESS_REFUSED - access to exchange 'events' in vhost '/' refused for user 'app'"
    );
    // A server-named queue is checked under the name it would get.
    let text = refused(&mut app, declare_queue("")).await;
    assert!(text.contains("access to queue 'amq.gen-"), "{text}");
    // Passive declares only look.
    let mut guest = connect(&b, "guest").await;
    allowed(&mut guest, declare_queue("orders")).await;
    allowed(
        &mut app,
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: "orders".into(),
            passive: true,
            ..Default::default()
        })),
    )
    .await;
    let text = refused(
        &mut app,
        AMQPClass::Queue(queue::AMQPMethod::Delete(queue::Delete {
            queue: "orders".into(),
            ..Default::default()
        })),
    )
    .await;
    assert!(text.contains("queue 'orders'"), "{text}");
    // A dead-letter exchange needs write on it.
    let mut args = ringmq::amqp::FieldTable::default();
    args.insert(
        "x-dead-letter-exchange".into(),
        ringmq::amqp::AMQPValue::LongString("events".into()),
    );
    let text = refused(
        &mut app,
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: "app-dl".into(),
            arguments: args,
            ..Default::default()
        })),
    )
    .await;
    assert!(text.contains("exchange 'events'"), "{text}");
}

#[tokio::test]
async fn write_governs_publish_with_the_default_exchange_as_amq_default() {
    let b = Broker::start_with_config(CONFIG);
    let mut app = connect(&b, "app").await;
    allowed(&mut app, declare_queue("app-q")).await;
    publish(&mut app, "", "app-q").await;
    publish(&mut app, "amq.direct", "app-q").await;
    let text = closed_and_reopened(&mut app).await;
    assert_eq!(
        text,
        "ACCESS_REFUSED - access to exchange 'amq.direct' in vhost '/' refused for user 'app'"
    );
    // The first publish (default exchange, allowed) went through.
    match app
        .call(get("app-q"), |_| true, "basic.get-ok")
        .await
        .unwrap()
    {
        AMQPClass::Basic(basic::AMQPMethod::GetOk(ok)) => assert_eq!(ok.message_count, 0),
        m => panic!("expected get-ok, got {m:?}"),
    }
}

#[tokio::test]
async fn read_governs_get_consume_and_purge() {
    let b = Broker::start_with_config(CONFIG);
    let mut guest = connect(&b, "guest").await;
    allowed(&mut guest, declare_queue("secret")).await;
    let mut app = connect(&b, "app").await;
    for m in [
        get("secret"),
        AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
            queue: "secret".into(),
            ..Default::default()
        })),
        AMQPClass::Queue(queue::AMQPMethod::Purge(queue::Purge {
            queue: "secret".into(),
            ..Default::default()
        })),
    ] {
        let text = refused(&mut app, m).await;
        assert!(text.contains("access to queue 'secret'"), "{text}");
    }
    allowed(&mut app, declare_queue("app-q")).await;
    allowed(&mut app, get("app-q")).await;
}

#[tokio::test]
async fn a_binding_needs_write_on_the_queue_and_read_on_the_exchange() {
    let b = Broker::start_with_config(CONFIG);
    let mut app = connect(&b, "app").await;
    allowed(&mut app, declare_queue("app-q")).await;
    allowed(&mut app, declare_exchange("app-x")).await;
    allowed(&mut app, bind("app-q", "app-x")).await;
    let text = refused(&mut app, bind("app-q", "amq.direct")).await;
    assert!(text.contains("exchange 'amq.direct'"), "{text}");
    let mut guest = connect(&b, "guest").await;
    allowed(&mut guest, declare_queue("orders")).await;
    let text = refused(&mut app, bind("orders", "app-x")).await;
    assert!(text.contains("queue 'orders'"), "{text}");
}

#[tokio::test]
async fn a_permission_changed_through_the_admin_api_applies_without_a_reconnect() {
    let b = Broker::start_with_config(CONFIG);
    let mut app = connect(&b, "app").await;
    allowed(&mut app, declare_queue("app-q")).await;
    allowed(&mut app, get("app-q")).await;
    let answer = b
        .admin_client()
        .call(
            "PUT",
            "/api/permissions/%2F/app",
            Some(&json!({"configure": "^app-", "write": "^app-", "read": ""})),
        )
        .unwrap();
    assert!(answer.status < 300, "{answer:?}");
    let text = refused(&mut app, get("app-q")).await;
    assert!(text.contains("queue 'app-q'"), "{text}");
    // An invalid expression is refused by the API.
    let answer = b
        .admin_client()
        .call(
            "PUT",
            "/api/permissions/%2F/app",
            Some(&json!({"configure": "(", "write": "", "read": ""})),
        )
        .unwrap();
    assert_eq!(answer.status, 400, "{answer:?}");
    assert!(answer.reason().contains("configure"), "{answer:?}");
}

#[test]
fn a_config_with_an_invalid_expression_does_not_start() {
    let dir = std::env::temp_dir().join(format!("ringmq-perm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("bad.yaml");
    std::fs::write(
        &config,
        "users:\n  - name: a\n    password: a\n    permissions:\n      \"/\": {configure: '(', write: '', read: ''}\n",
    )
    .unwrap();
    let out = std::process::Command::new(binary("ringmq-broker"))
        .args([
            "--amqp-listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .arg("--data-dir")
        .arg(dir.join("data"))
        .arg("--config")
        .arg(&config)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("configure is not a valid regular expression"),
        "{stderr}"
    );
}
