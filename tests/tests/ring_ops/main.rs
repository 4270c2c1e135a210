//! Ring operations on a live cluster of real broker processes (issue #15): a queue's primary
//! moved to another member under confirmed load, by the admin API and by `ringmqctl`, a
//! member drained, the primaries rebalanced, the ring laid out in another order and k, and
//! fragmented queues.

mod drain;
mod fragmented;
mod layout;
mod move_queue;
mod rebalance;

use ringmq_tests::{Broker, binary};

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
