//! What the proxy tests share: declaring, counting, publishing with confirms, naming a member.

use lapin::BasicProperties;
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use ringmq_tests::{Broker, queue_counts, reply_code};

/// Declares durable queue `name` through member `b` (which becomes its primary).
pub(crate) async fn declare(b: &Broker, name: &str) {
    let (_c, ch) = b.channel().await;
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("declare");
}

/// Declares durable queue `name` through member `b` with no backups (`k` = 0): it is lost
/// with its primary, as every queue was before replication.
pub(crate) async fn declare_unreplicated(b: &Broker, name: &str) {
    let (_c, ch) = b.channel().await;
    let mut args = FieldTable::default();
    args.insert(
        "qpid.cluster.backups".into(),
        lapin::types::AMQPValue::LongInt(0),
    );
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .expect("declare");
}

/// Queue `name`'s (ready messages, consumers) as member `b` answers a passive declare.
pub(crate) async fn count(b: &Broker, name: &str) -> (u32, u32) {
    let (_c, ch) = b.channel().await;
    queue_counts(&ch, name).await.expect("passive declare")
}

/// Publishes `n` persistent messages `prefix-0` … with confirms and waits for them all.
pub(crate) async fn publish_confirmed(ch: &lapin::Channel, queue: &str, prefix: &str, n: usize) {
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut confirms = Vec::new();
    for i in 0..n {
        confirms.push(
            ch.basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                format!("{prefix}-{i}").as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .unwrap(),
        );
    }
    for c in confirms {
        assert!(c.await.unwrap().is_ack(), "every publish is confirmed");
    }
}

/// Declare arguments with `qpid.cluster.proxy` naming `target`.
pub(crate) fn proxy_to(target: &str) -> FieldTable {
    let mut args = FieldTable::default();
    args.insert(
        "qpid.cluster.proxy".into(),
        lapin::types::AMQPValue::LongString(target.into()),
    );
    args
}

/// A declare with `qpid.cluster.proxy` naming a member: `Ok` with its counts, or the code.
pub(crate) async fn declare_naming(
    b: &Broker,
    queue: &str,
    exchange: Option<&str>,
    member: &str,
) -> Result<(u32, u32), Option<u16>> {
    let (_c, ch) = b.channel().await;
    match exchange {
        Some(x) => ch
            .exchange_declare(
                x.into(),
                lapin::ExchangeKind::Topic,
                ExchangeDeclareOptions::default(),
                proxy_to(member),
            )
            .await
            .map(|()| (0, 0)),
        None => ch
            .queue_declare(
                queue.into(),
                QueueDeclareOptions::default(),
                proxy_to(member),
            )
            .await
            .map(|q| (q.message_count(), q.consumer_count())),
    }
    .map_err(|e| reply_code(&e))
}
