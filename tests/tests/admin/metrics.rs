//! `/metrics`: series that move with a known load, per-queue series by config, the dashboard's
//! queries, blocked publishers, the journal's series.

use crate::support::*;
use futures_lite::StreamExt;
use lapin::BasicProperties;
use lapin::options::*;
use lapin::types::FieldTable;
use ringmq_tests::Broker;
use serde_json::Value;
use serde_json::json;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_move_with_a_known_load() {
    let b = Broker::start();
    let c = b.admin_client();
    let before = |s: &str| metric(&b, s);
    let published0 = before("ringmq_messages_published_total");
    let (conn, ch) = b.channel().await;
    ch.queue_declare(
        "load".into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut confirms = Vec::new();
    for _ in 0..1000 {
        confirms.push(
            ch.basic_publish(
                "".into(),
                "load".into(),
                BasicPublishOptions::default(),
                &[0u8; 100],
                BasicProperties::default(),
            )
            .await
            .unwrap(),
        );
    }
    for cf in confirms {
        cf.await.unwrap();
    }
    ch.basic_publish(
        "amq.direct".into(),
        "nowhere".into(),
        BasicPublishOptions::default(),
        b"u",
        BasicProperties::default(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    eventually("published +1001", || {
        metric(&b, "ringmq_messages_published_total") - published0 == 1001.0
    });
    assert_eq!(metric(&b, "ringmq_messages_routed_total"), 1000.0);
    assert_eq!(metric(&b, "ringmq_messages_unroutable_total"), 1.0);
    assert_eq!(metric(&b, "ringmq_messages_confirmed_total"), 1001.0);
    assert_eq!(
        metric(
            &b,
            "ringmq_queue_messages_ready{vhost=\"/\",queue=\"load\"}"
        ),
        1000.0
    );
    assert_eq!(metric(&b, "ringmq_messages_ready"), 1000.0);
    assert_eq!(metric(&b, "ringmq_connections"), 1.0);
    assert_eq!(metric(&b, "ringmq_channels"), 1.0);
    assert!(metric(&b, "ringmq_received_bytes_total") > 100_000.0);
    assert!(metric(&b, "ringmq_memory_used_bytes") > 0.0);
    assert!(metric(&b, "ringmq_memory_high_watermark_bytes") > 0.0);
    assert!(metric(&b, "ringmq_disk_free_bytes") > 0.0);

    // Consume them all with manual acks (multiple acks count every message).
    ch.basic_qos(100, BasicQosOptions::default()).await.unwrap();
    let mut consumer = ch
        .basic_consume(
            "load".into(),
            "c".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    assert_eq!(metric(&b, "ringmq_consumers"), 1.0);
    assert_eq!(
        metric(&b, "ringmq_queue_consumers{vhost=\"/\",queue=\"load\"}"),
        1.0
    );
    for i in 0..1000 {
        let d = tokio::time::timeout(Duration::from_secs(5), consumer.next())
            .await
            .expect("delivery")
            .unwrap()
            .unwrap();
        if i % 10 == 9 {
            d.ack(BasicAckOptions { multiple: true }).await.unwrap();
        }
    }
    eventually("acked 1000", || {
        metric(&b, "ringmq_messages_acked_total") == 1000.0
    });
    assert_eq!(metric(&b, "ringmq_messages_delivered_total"), 1000.0);
    assert!(metric(&b, "ringmq_sent_bytes_total") > 100_000.0);
    assert_eq!(
        metric(
            &b,
            "ringmq_queue_messages_ready{vhost=\"/\",queue=\"load\"}"
        ),
        0.0
    );
    let ov = expect(&c, "GET", "/api/overview", None, 200);
    assert_eq!(ov["message_totals"]["published"], 1001);
    assert_eq!(ov["message_totals"]["acked"], 1000);
    conn.close(200, "bye".into()).await.unwrap();
    eventually("connections 0", || metric(&b, "ringmq_connections") == 0.0);
    // Per-queue series stay off /metrics unless configured.
    let plain = c.get("/metrics").unwrap().body;
    assert!(
        !plain
            .as_str()
            .unwrap()
            .contains("ringmq_queue_messages_ready")
    );
}

#[test]
fn per_queue_metrics_can_be_put_on_metrics_by_config() {
    let b = Broker::start_with_config("metrics_per_queue: true\n");
    let c = b.admin_client();
    expect(&c, "PUT", "/api/queues/%2F/q", Some(json!({})), 201);
    let text = c.get("/metrics").unwrap().body;
    assert!(
        text.as_str()
            .unwrap()
            .contains("ringmq_queue_messages_ready{vhost=\"/\",queue=\"q\"} 0")
    );
}

/// Every metric a Grafana panel queries exists on a live broker.
#[test]
fn dashboard_queries_only_metrics_the_broker_exports() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../dashboards/ringmq-overview.json"
    );
    let dash: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut exprs = Vec::new();
    collect_exprs(&dash, &mut exprs);
    assert!(
        exprs.len() >= 7,
        "the dashboard has too few queries: {exprs:?}"
    );
    let b = Broker::start();
    let c = b.admin_client();
    expect(&c, "PUT", "/api/queues/%2F/q", Some(json!({})), 201);
    let text = format!(
        "{}\n{}",
        c.get("/metrics").unwrap().body.as_str().unwrap(),
        c.get("/metrics/detailed").unwrap().body.as_str().unwrap()
    );
    let exported: std::collections::HashSet<&str> = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| l.split(['{', ' ']).next().unwrap())
        .collect();
    let mut names = Vec::new();
    for e in &exprs {
        for n in metric_names(e) {
            assert!(
                exported.contains(n.as_str()),
                "dashboard query `{e}` uses {n}, which /metrics lacks"
            );
            names.push(n);
        }
    }
    assert!(names.len() >= 7, "{names:?}");
}

fn collect_exprs(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                if k == "expr" {
                    out.push(x.as_str().unwrap().to_owned());
                } else {
                    collect_exprs(x, out);
                }
            }
        }
        Value::Array(a) => a.iter().for_each(|x| collect_exprs(x, out)),
        _ => {}
    }
}

/// Identifiers in a PromQL expression that name ringmq metrics.
fn metric_names(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut in_label_block = false;
    for ch in expr.chars().chain(std::iter::once(' ')) {
        if ch.is_ascii_alphanumeric() || ch == '_' || ch == ':' {
            cur.push(ch);
            continue;
        }
        if !in_label_block && cur.starts_with("ringmq_") {
            out.push(std::mem::take(&mut cur));
        }
        cur.clear();
        match ch {
            '{' => in_label_block = true,
            '}' => in_label_block = false,
            _ => {}
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocked_publishers_are_counted_and_logged() {
    use tokio::io::AsyncWriteExt;
    let b = Broker::start_with_config("memory_high_watermark_bytes: 1\n");
    let target = ringmq::client::Target::parse(&b.uri()).unwrap();
    // The raw client announces connection.blocked and opens channel 1.
    let mut raw = ringmq::client::RawClient::connect(&target).await.unwrap();
    let mut out = Vec::new();
    ringmq::client::encode_publish(&mut out, 1, "", "q", false, b"x", 131_072);
    raw.stream.write_all(&out).await.unwrap();
    eventually("a blocked publisher", || {
        metric(&b, "ringmq_blocked_publishers") == 1.0
    });
    assert_eq!(metric(&b, "ringmq_memory_alarm"), 1.0);
    assert!(b.wait_for_log("publisher blocked", Duration::from_secs(2)));
    let ov = expect(&b.admin_client(), "GET", "/api/overview", None, 200);
    assert_eq!(ov["blocked_publishers"], 1);
    assert_eq!(ov["memory"]["alarm"], true);
    // (A blocked connection is not read, so its close is only noticed once the alarm
    // clears or heartbeats time it out: the gauge keeps counting it until then.)
    drop(raw);
}

#[tokio::test]
async fn journal_metrics_move_with_persistent_publishes() {
    let b = Broker::start();
    let (_c, ch) = b.channel().await;
    ch.queue_declare(
        "dq".into(),
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
    for i in 0..100u8 {
        let c = ch
            .basic_publish(
                "".into(),
                "dq".into(),
                BasicPublishOptions::default(),
                &[i],
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .unwrap();
        assert!(c.await.unwrap().is_ack());
    }
    assert!(metric(&b, "ringmq_journal_fsyncs_total") >= 1.0);
    assert!(metric(&b, "ringmq_journal_records_written_total") >= 100.0);
    assert!(metric(&b, "ringmq_journal_fsync_seconds_count") >= 1.0);
    assert!(metric(&b, "ringmq_journal_written_bytes_total") > 100.0);
}
