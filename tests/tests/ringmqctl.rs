//! `ringmqctl` admin commands against a live broker: each command's table and `--json`
//! output, and a non-zero exit with a one-line reason on failure.

use ringmq_tests::{Broker, binary};
use serde_json::Value;
use std::process::{Command, Output};

fn ctl(b: &Broker, args: &[&str]) -> Output {
    Command::new(binary("ringmqctl"))
        .args([
            "--admin",
            &b.admin_url(),
            "--user",
            "guest",
            "--password",
            "guest",
        ])
        .args(args)
        .output()
        .expect("ringmqctl runs")
}

/// Runs a command that must succeed; returns its stdout.
fn ok(b: &Broker, args: &[&str]) -> String {
    let out = ctl(b, args);
    assert!(
        out.status.success(),
        "ringmqctl {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Runs a command that must fail; returns its stderr (one line).
fn fails(b: &Broker, args: &[&str]) -> String {
    let out = ctl(b, args);
    assert!(!out.status.success(), "ringmqctl {args:?} should fail");
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    err
}

fn json(b: &Broker, args: &[&str]) -> Value {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    serde_json::from_str(ok(b, &all).trim()).unwrap()
}

#[test]
fn status_lists_the_node_and_totals() {
    let b = Broker::start();
    let out = ok(&b, &["status"]);
    assert!(
        out.contains("node:") && out.contains("running") && out.contains(&b.addr.to_string()),
        "{out}"
    );
    let v = json(&b, &["status"]);
    assert_eq!(v["members"][0]["amqp"], b.addr.to_string());
}

#[test]
fn declare_list_purge_and_delete_queues_exchanges_and_bindings() {
    let b = Broker::start();
    assert!(
        ok(
            &b,
            &[
                "declare",
                "queue",
                "orders",
                "--arguments",
                r#"{"x-max-length": 5}"#
            ]
        )
        .contains("created")
    );
    assert!(
        ok(
            &b,
            &[
                "declare",
                "queue",
                "orders",
                "--arguments",
                r#"{"x-max-length": 5}"#
            ]
        )
        .contains("ok")
    );
    let err = fails(&b, &["declare", "queue", "orders", "--durable", "false"]);
    assert!(err.contains("409") && err.contains("durable"), "{err}");
    ok(&b, &["declare", "exchange", "events", "--type", "topic"]);
    ok(
        &b,
        &[
            "declare",
            "binding",
            "--source",
            "events",
            "--destination",
            "orders",
            "--routing-key",
            "eu.#",
        ],
    );
    ok(&b, &["declare", "exchange", "audit", "--type", "fanout"]);
    ok(
        &b,
        &[
            "declare",
            "binding",
            "--source",
            "events",
            "--destination",
            "audit",
            "--destination-type",
            "exchange",
        ],
    );

    let table = ok(&b, &["list", "queues"]);
    let header = table.lines().next().unwrap();
    assert!(
        header.starts_with("vhost")
            && header.contains("messages_ready")
            && header.contains("consumers"),
        "{table}"
    );
    assert!(table.lines().any(|l| l.contains("orders")), "{table}");
    let queues = json(&b, &["list", "queues", "--vhost", "/"]);
    assert_eq!(queues[0]["name"], "orders");
    assert_eq!(
        json(&b, &["list", "exchanges"]).as_array().unwrap().len(),
        8
    );
    let bindings = ok(&b, &["list", "bindings"]);
    assert!(
        bindings.contains("eu.#") && bindings.contains("audit"),
        "{bindings}"
    );

    ok(&b, &["purge", "queue", "orders"]);
    ok(
        &b,
        &[
            "delete",
            "binding",
            "--source",
            "events",
            "--destination",
            "orders",
            "--routing-key",
            "eu.#",
        ],
    );
    ok(
        &b,
        &[
            "delete",
            "binding",
            "--source",
            "events",
            "--destination",
            "audit",
            "--destination-type",
            "exchange",
        ],
    );
    assert_eq!(
        json(&b, &["list", "bindings"]).as_array().unwrap().len(),
        1,
        "only the default binding is left"
    );
    let err = fails(
        &b,
        &[
            "delete",
            "binding",
            "--source",
            "events",
            "--destination",
            "orders",
            "--routing-key",
            "eu.#",
        ],
    );
    assert!(err.contains("404"), "{err}");
    ok(&b, &["delete", "exchange", "audit"]);
    ok(&b, &["delete", "queue", "orders"]);
    let err = fails(&b, &["delete", "queue", "orders"]);
    assert!(
        err.starts_with("ringmqctl: 404 not_found: no queue 'orders'"),
        "{err}"
    );
    let err = fails(&b, &["purge", "queue", "orders"]);
    assert!(err.contains("404"), "{err}");
    let err = fails(&b, &["declare", "queue", "x", "--arguments", "[1]"]);
    assert!(err.contains("JSON object"), "{err}");
}

#[test]
fn vhosts_users_and_permissions() {
    let b = Broker::start();
    ok(&b, &["declare", "vhost", "apps"]);
    ok(
        &b,
        &[
            "declare",
            "user",
            "ops",
            "--new-password",
            "pw",
            "--tags",
            "monitoring",
        ],
    );
    ok(
        &b,
        &[
            "declare",
            "permission",
            "--for-user",
            "ops",
            "--vhost",
            "apps",
            "--read",
            ".*",
            "--write",
            "",
            "--configure",
            "",
        ],
    );
    let users = ok(&b, &["list", "users"]);
    assert!(
        users.contains("ops") && users.contains("monitoring") && !users.contains("pw "),
        "{users}"
    );
    assert!(ok(&b, &["list", "vhosts"]).contains("apps"));
    let perms = json(&b, &["list", "permissions"]);
    assert!(
        perms
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["user"] == "ops" && p["vhost"] == "apps")
    );
    // The monitoring user reads but cannot change.
    let as_ops = |args: &[&str]| {
        Command::new(binary("ringmqctl"))
            .args([
                "--admin",
                &b.admin_url(),
                "--user",
                "ops",
                "--password",
                "pw",
            ])
            .args(args)
            .output()
            .unwrap()
    };
    assert!(as_ops(&["list", "queues"]).status.success());
    let denied = as_ops(&["declare", "queue", "q"]);
    assert!(!denied.status.success());
    assert!(String::from_utf8_lossy(&denied.stderr).contains("403"));
    ok(
        &b,
        &[
            "delete",
            "permission",
            "--for-user",
            "ops",
            "--vhost",
            "apps",
        ],
    );
    ok(&b, &["delete", "user", "ops"]);
    ok(&b, &["delete", "vhost", "apps"]);
    assert!(fails(&b, &["delete", "vhost", "apps"]).contains("404"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_and_channels_are_listed_and_closed() {
    let b = Broker::start();
    let (conn, _ch) = b.channel().await;
    let conns = json(&b, &["list", "connections"]);
    let name = conns[0]["name"].as_str().unwrap().to_owned();
    assert!(ok(&b, &["list", "connections"]).contains(&name));
    let chans = ok(&b, &["list", "channels"]);
    assert!(chans.contains(&format!("{name} (1)")), "{chans}");
    ok(
        &b,
        &["close", "connection", &name, "--reason", "maintenance"],
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while conn.status().connected() {
        assert!(std::time::Instant::now() < deadline, "still connected");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(fails(&b, &["close", "connection", "nope"]).contains("404"));
}

#[test]
fn definitions_export_and_import_between_brokers() {
    let a = Broker::start();
    ok(&a, &["declare", "vhost", "shop"]);
    ok(&a, &["declare", "queue", "eu", "--vhost", "shop"]);
    ok(
        &a,
        &[
            "declare", "exchange", "orders", "--vhost", "shop", "--type", "direct",
        ],
    );
    ok(
        &a,
        &[
            "declare",
            "binding",
            "--vhost",
            "shop",
            "--source",
            "orders",
            "--destination",
            "eu",
            "--routing-key",
            "eu",
        ],
    );
    let file = a.data_dir.join("defs.json");
    ok(&a, &["definitions", "export", file.to_str().unwrap()]);
    let b = Broker::start();
    ok(&b, &["definitions", "import", file.to_str().unwrap()]);
    assert_eq!(
        json(&a, &["definitions", "export"]),
        json(&b, &["definitions", "export"])
    );
    let bad = b.data_dir.join("bad.json");
    std::fs::write(&bad, "{not json").unwrap();
    assert!(fails(&b, &["definitions", "import", bad.to_str().unwrap()]).contains("not JSON"));
    assert!(
        fails(&b, &["definitions", "import", "/nonexistent/defs.json"]).contains("cannot read")
    );
}

#[test]
fn failures_exit_non_zero_with_one_line() {
    let b = Broker::start();
    let wrong = Command::new(binary("ringmqctl"))
        .args([
            "--admin",
            &b.admin_url(),
            "--user",
            "guest",
            "--password",
            "nope",
            "list",
            "queues",
        ])
        .output()
        .unwrap();
    assert!(!wrong.status.success());
    assert!(String::from_utf8_lossy(&wrong.stderr).contains("401"));
    let down = Command::new(binary("ringmqctl"))
        .args(["--admin", "http://127.0.0.1:1", "status"])
        .output()
        .unwrap();
    assert!(!down.status.success());
    assert!(String::from_utf8_lossy(&down.stderr).contains("cannot reach the admin API"));
}

#[test]
fn completions_are_generated_for_each_shell() {
    for shell in ["bash", "zsh", "fish"] {
        let out = Command::new(binary("ringmqctl"))
            .args(["completions", shell])
            .output()
            .unwrap();
        assert!(out.status.success());
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(
            text.contains("ringmqctl") && text.contains("definitions"),
            "{shell}"
        );
    }
}
