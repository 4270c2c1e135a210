//! Ring operations on a live cluster of real broker processes (issue #15): a queue's primary
//! moved to another member under confirmed load, by the admin API and by `ringmqctl`, a
//! member drained, the primaries rebalanced, the ring laid out in another order and k, and
//! fragmented queues.

mod drain;
mod fragmented;
mod layout;
mod move_queue;
mod rebalance;
mod retire;

use lapin::BasicProperties;
use lapin::options::BasicPublishOptions;
use ringmq_tests::{Broker, binary};
use serde_json::Value;

/// `ringmqctl` against `b`'s admin API (as guest), off the async runtime: whether it
/// succeeded, and its stdout and stderr.
pub(crate) async fn ctl(b: &Broker, args: &[&str]) -> (bool, String) {
    let admin = b.admin_url();
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(binary("ringmqctl"))
            .args(["--admin", &admin, "--user", "guest", "--password", "guest"])
            .args(&args)
            .output()
            .expect("ringmqctl runs")
    })
    .await
    .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// `GET path` on `b`'s admin API, off the async runtime: the body it answered.
pub(crate) async fn get(b: &Broker, path: &str) -> Value {
    let admin = b.admin_client();
    let path = path.to_owned();
    tokio::task::spawn_blocking(move || admin.get(&path).expect("admin API answers").body)
        .await
        .unwrap()
}

/// Publishes each of `bodies` to `queue` through the default exchange, persistent, on `ch`
/// (in confirm mode), one after another; panics unless each is acked.
pub(crate) async fn publish_confirmed(
    ch: &lapin::Channel,
    queue: &str,
    bodies: impl IntoIterator<Item = String>,
) {
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
            .unwrap();
        assert!(confirm.await.unwrap().is_ack(), "{body} nacked");
    }
}
