//! The admin HTTP API, health and metrics, against a real broker process: every endpoint's
//! happy path and errors, auth by tag, definitions round trips, and metrics that move with a
//! known load.

use futures_lite::StreamExt;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{BasicProperties, ConnectionProperties};
use ringmq::admin_client::{AdminClient, Answer};
use ringmq_tests::{Broker, reply_code};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

const USERS: &str = r#"
users:
  - name: guest
    password: guest
    tags: [administrator]
  - name: watcher
    password: w
    tags: [monitoring]
  - name: app
    password: a
"#;

fn call(c: &AdminClient, method: &str, path: &str, body: Option<Value>) -> Answer {
    c.call(method, path, body.as_ref())
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

fn expect(c: &AdminClient, method: &str, path: &str, body: Option<Value>, status: u16) -> Value {
    let a = call(c, method, path, body);
    assert_eq!(
        a.status, status,
        "{method} {path} answered {}: {}",
        a.status, a.body
    );
    a.body
}

/// Asserts an error answer is JSON with `error` and a non-empty `reason`.
fn expect_error(
    c: &AdminClient,
    method: &str,
    path: &str,
    body: Option<Value>,
    status: u16,
    error: &str,
) {
    let v = expect(c, method, path, body, status);
    assert_eq!(v["error"], error, "{method} {path}: {v}");
    assert!(
        v["reason"].as_str().is_some_and(|r| !r.is_empty()),
        "{method} {path}: {v}"
    );
}

/// The value of one sample line `name{labels} value` (or `name value`) in an exposition.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (name, value) = l.rsplit_once(' ')?;
        (name == series).then(|| value.parse().ok())?
    })
}

fn metric(b: &Broker, series: &str) -> f64 {
    let text = b.admin_client().get("/metrics/detailed").unwrap().body;
    sample(text.as_str().unwrap(), series)
        .unwrap_or_else(|| panic!("{series} missing from:\n{text}"))
}

/// Waits (bounded) until `f` holds.
fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn healthz_readyz_and_leaving_member() {
    let b = Broker::start();
    let anon = AdminClient::new(&b.admin_url(), None, None);
    assert_eq!(expect(&anon, "GET", "/healthz", None, 200)["status"], "ok");
    assert_eq!(
        expect(&anon, "GET", "/readyz", None, 200)["status"],
        "ready"
    );
    let c = b.admin_client();
    let ov = expect(&c, "GET", "/api/overview", None, 200);
    let id = ov["node"].as_str().unwrap().to_owned();
    assert_eq!(ov["members"][0]["id"], id.as_str());
    assert_eq!(ov["members"][0]["amqp"], b.addr.to_string());
    assert_eq!(ov["members"][0]["admin"], b.admin.to_string());
    assert_eq!(ov["members"][0]["state"], "running");
    assert_eq!(ov["cluster_name"], "ringmq");
    for k in [
        "connections",
        "channels",
        "consumers",
        "exchanges",
        "queues",
        "vhosts",
    ] {
        assert!(ov["object_totals"][k].is_u64(), "{k}: {ov}");
    }
    for k in [
        "published",
        "routed",
        "unroutable",
        "delivered",
        "acked",
        "redelivered",
        "confirmed",
    ] {
        assert!(ov["message_totals"][k].is_u64(), "{k}: {ov}");
    }
    expect(&c, "PUT", "/api/queues/%2F/q", Some(json!({})), 201);
    let m = expect(&c, "GET", &format!("/api/members/{id}"), None, 200);
    assert_eq!(m["owned_queues"], 1);
    expect_error(
        &c,
        "GET",
        "/api/members/ringmq@elsewhere",
        None,
        404,
        "not_found",
    );
    expect_error(
        &c,
        "POST",
        "/api/members/ringmq@elsewhere/leave",
        None,
        404,
        "not_found",
    );
    expect(&c, "POST", &format!("/api/members/{id}/leave"), None, 202);
    expect_error(&anon, "GET", "/readyz", None, 503, "not_ready");
    assert_eq!(expect(&anon, "GET", "/healthz", None, 200)["status"], "ok");
    assert_eq!(
        expect(&c, "GET", "/api/members", None, 200)[0]["state"],
        "leaving"
    );
}

#[test]
fn api_auth_by_tag_administrator_monitoring_and_none() {
    let b = Broker::start_with_config(USERS);
    let url = b.admin_url();
    let anon = AdminClient::new(&url, None, None);
    expect_error(&anon, "GET", "/api/overview", None, 401, "not_authorised");
    let wrong = AdminClient::new(&url, Some("guest"), Some("nope"));
    expect_error(&wrong, "GET", "/api/queues", None, 401, "not_authorised");
    let unknown = AdminClient::new(&url, Some("nobody"), Some("x"));
    expect_error(&unknown, "GET", "/api/queues", None, 401, "not_authorised");
    // Metrics and health need no credentials (Prometheus scrapes them).
    expect(&anon, "GET", "/metrics", None, 200);

    let watcher = b.admin_as("watcher", "w");
    expect(&watcher, "GET", "/api/overview", None, 200);
    expect(&watcher, "GET", "/api/queues", None, 200);
    expect_error(
        &watcher,
        "GET",
        "/api/definitions",
        None,
        403,
        "access_refused",
    );
    expect_error(
        &watcher,
        "PUT",
        "/api/queues/%2F/q",
        Some(json!({})),
        403,
        "access_refused",
    );
    expect_error(
        &watcher,
        "DELETE",
        "/api/vhosts/%2F",
        None,
        403,
        "access_refused",
    );
    expect_error(
        &watcher,
        "POST",
        "/api/definitions",
        Some(json!({})),
        403,
        "access_refused",
    );

    let app = b.admin_as("app", "a");
    expect_error(&app, "GET", "/api/overview", None, 403, "access_refused");

    let admin = b.admin_client();
    expect(&admin, "PUT", "/api/queues/%2F/q", Some(json!({})), 201);
    assert_eq!(
        expect(&admin, "GET", "/api/whoami", None, 200)["tags"],
        json!(["administrator"])
    );
}

#[test]
fn queues_declare_get_list_purge_delete_and_errors() {
    let b = Broker::start_with_config("vhosts: [\"/\", \"other\"]\n");
    let c = b.admin_client();
    let body = json!({"durable": true, "auto_delete": false, "arguments": {"x-max-length": 10}});
    expect(&c, "PUT", "/api/queues/%2F/orders", Some(body.clone()), 201);
    expect(&c, "PUT", "/api/queues/%2F/orders", Some(body), 204);
    expect_error(
        &c,
        "PUT",
        "/api/queues/%2F/orders",
        Some(json!({"durable": false, "arguments": {"x-max-length": 10}})),
        409,
        "conflict",
    );
    expect_error(
        &c,
        "PUT",
        "/api/queues/%2F/orders",
        Some(json!({"arguments": {"x-max-length": 11}})),
        409,
        "conflict",
    );
    expect_error(
        &c,
        "PUT",
        "/api/queues/%2F/bad",
        Some(json!({"durable": "yes"})),
        400,
        "bad_request",
    );
    expect_error(
        &c,
        "PUT",
        "/api/queues/%2F/bad",
        Some(json!({"arguments": [1]})),
        400,
        "bad_request",
    );
    expect_error(
        &c,
        "PUT",
        "/api/queues/%2F/bad",
        Some(json!({"exclusive": true})),
        400,
        "bad_request",
    );
    let a = c.call("PUT", "/api/queues/%2F/bad", None).unwrap();
    assert_eq!(a.status, 201, "an empty body declares with defaults");
    let raw = {
        let r = c
            .call(
                "PUT",
                "/api/queues/%2F/broken",
                Some(&Value::String("{".into())),
            )
            .unwrap();
        r.status
    };
    assert_eq!(raw, 400, "a JSON string is not an object body");
    expect_error(
        &c,
        "PUT",
        "/api/queues/%2F/amq.q",
        Some(json!({})),
        403,
        "access_refused",
    );
    expect_error(
        &c,
        "PUT",
        "/api/queues/nowhere/q",
        Some(json!({})),
        404,
        "not_found",
    );
    expect(
        &c,
        "PUT",
        "/api/queues/other/orders",
        Some(json!({"durable": false})),
        201,
    );

    let q = expect(&c, "GET", "/api/queues/%2F/orders", None, 200);
    for (k, v) in [
        ("name", json!("orders")),
        ("vhost", json!("/")),
        ("durable", json!(true)),
        ("auto_delete", json!(false)),
        ("exclusive", json!(false)),
        ("arguments", json!({"x-max-length": 10})),
        ("messages_ready", json!(0)),
        ("messages_unacknowledged", json!(0)),
        ("messages", json!(0)),
        ("consumers", json!(0)),
        // A single broker's queues have no backups.
        ("backup_nodes", json!([])),
        ("in_sync_backup_nodes", json!([])),
        ("unavailable", json!(false)),
    ] {
        assert_eq!(q[k], v, "{k} in {q}");
    }
    let node = expect(&c, "GET", "/api/overview", None, 200)["node"].clone();
    assert_eq!(q["owner"], node);
    expect_error(&c, "GET", "/api/queues/%2F/missing", None, 404, "not_found");
    expect_error(&c, "GET", "/api/queues/nowhere", None, 404, "not_found");
    let all = expect(&c, "GET", "/api/queues", None, 200);
    assert_eq!(all.as_array().unwrap().len(), 3, "{all}");
    let slash = expect(&c, "GET", "/api/queues/%2F", None, 200);
    assert_eq!(slash.as_array().unwrap().len(), 2, "{slash}");

    // Depth shows messages published over AMQP; purge empties it.
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (_conn, ch) = b.channel().await;
        for _ in 0..3 {
            ch.basic_publish(
                "".into(),
                "orders".into(),
                BasicPublishOptions::default(),
                b"x",
                BasicProperties::default(),
            )
            .await
            .unwrap();
        }
        ch.queue_declare(
            "orders".into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    });
    assert_eq!(
        expect(&c, "GET", "/api/queues/%2F/orders", None, 200)["messages_ready"],
        3
    );
    expect(&c, "DELETE", "/api/queues/%2F/orders/contents", None, 204);
    assert_eq!(
        expect(&c, "GET", "/api/queues/%2F/orders", None, 200)["messages_ready"],
        0
    );
    expect_error(
        &c,
        "DELETE",
        "/api/queues/%2F/missing/contents",
        None,
        404,
        "not_found",
    );

    expect(&c, "DELETE", "/api/queues/%2F/orders", None, 204);
    expect_error(
        &c,
        "DELETE",
        "/api/queues/%2F/orders",
        None,
        404,
        "not_found",
    );
    expect_error(&c, "GET", "/api/queues/%2F/orders", None, 404, "not_found");
    assert!(b.wait_for_log("queue declared", Duration::from_secs(2)));
    assert!(b.wait_for_log("queue deleted", Duration::from_secs(2)));
}

#[test]
fn exchanges_declare_get_delete_and_errors() {
    let b = Broker::start();
    let c = b.admin_client();
    let body = json!({"type": "topic", "durable": true, "arguments": {"alternate-exchange": "ae"}});
    expect(
        &c,
        "PUT",
        "/api/exchanges/%2F/events",
        Some(body.clone()),
        201,
    );
    expect(&c, "PUT", "/api/exchanges/%2F/events", Some(body), 204);
    expect_error(
        &c,
        "PUT",
        "/api/exchanges/%2F/events",
        Some(json!({"type": "fanout"})),
        409,
        "conflict",
    );
    expect_error(
        &c,
        "PUT",
        "/api/exchanges/%2F/x",
        Some(json!({})),
        400,
        "bad_request",
    );
    expect_error(
        &c,
        "PUT",
        "/api/exchanges/%2F/x",
        Some(json!({"type": "x-delayed"})),
        400,
        "bad_request",
    );
    expect_error(
        &c,
        "PUT",
        "/api/exchanges/%2F/amq.mine",
        Some(json!({"type": "direct"})),
        403,
        "access_refused",
    );
    expect_error(
        &c,
        "PUT",
        "/api/exchanges/nowhere/x",
        Some(json!({"type": "direct"})),
        404,
        "not_found",
    );
    let e = expect(&c, "GET", "/api/exchanges/%2F/events", None, 200);
    assert_eq!(
        e,
        json!({"name": "events", "vhost": "/", "type": "topic", "durable": true, "auto_delete": false,
               "internal": false, "arguments": {"alternate-exchange": "ae"}})
    );
    let list = expect(&c, "GET", "/api/exchanges/%2F", None, 200);
    let names: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "",
            "amq.direct",
            "amq.fanout",
            "amq.headers",
            "amq.match",
            "amq.topic",
            "events"
        ]
    );
    assert_eq!(
        expect(&c, "GET", "/api/exchanges", None, 200)
            .as_array()
            .unwrap()
            .len(),
        7
    );
    expect_error(
        &c,
        "GET",
        "/api/exchanges/%2F/missing",
        None,
        404,
        "not_found",
    );
    // if-unused refuses while bound.
    expect(&c, "PUT", "/api/queues/%2F/q", Some(json!({})), 201);
    expect(
        &c,
        "POST",
        "/api/bindings/%2F/e/events/q/q",
        Some(json!({"routing_key": "a.#"})),
        201,
    );
    expect_error(
        &c,
        "DELETE",
        "/api/exchanges/%2F/events?if-unused=true",
        None,
        409,
        "conflict",
    );
    expect(&c, "DELETE", "/api/exchanges/%2F/events", None, 204);
    expect_error(
        &c,
        "DELETE",
        "/api/exchanges/%2F/events",
        None,
        404,
        "not_found",
    );
    expect_error(
        &c,
        "DELETE",
        "/api/exchanges/%2F/amq.direct",
        None,
        403,
        "access_refused",
    );
}

#[test]
fn bindings_create_list_get_delete_and_errors() {
    let b = Broker::start();
    let c = b.admin_client();
    expect(&c, "PUT", "/api/queues/%2F/q", Some(json!({})), 201);
    expect(
        &c,
        "PUT",
        "/api/exchanges/%2F/src",
        Some(json!({"type": "direct"})),
        201,
    );
    expect(
        &c,
        "PUT",
        "/api/exchanges/%2F/dst",
        Some(json!({"type": "fanout"})),
        201,
    );
    let a = call(
        &c,
        "POST",
        "/api/bindings/%2F/e/src/q/q",
        Some(json!({"routing_key": "k1"})),
    );
    assert_eq!(a.status, 201, "{}", a.body);
    assert_eq!(
        a.location.as_deref(),
        Some("/api/bindings/%2F/e/src/q/q/k1")
    );
    expect(
        &c,
        "POST",
        "/api/bindings/%2F/e/src/q/q",
        Some(json!({"routing_key": "", "arguments": {"x": 1}})),
        201,
    );
    expect(
        &c,
        "POST",
        "/api/bindings/%2F/e/src/e/dst",
        Some(json!({})),
        201,
    );
    expect_error(
        &c,
        "POST",
        "/api/bindings/%2F/e/src/q/missing",
        Some(json!({})),
        404,
        "not_found",
    );
    expect_error(
        &c,
        "POST",
        "/api/bindings/%2F/e/missing/q/q",
        Some(json!({})),
        404,
        "not_found",
    );
    expect_error(
        &c,
        "POST",
        "/api/bindings/%2F/e/src/q/q",
        Some(json!({"routing_key": 5})),
        400,
        "bad_request",
    );
    expect_error(
        &c,
        "POST",
        "/api/bindings/%2F/e//q/q",
        Some(json!({})),
        403,
        "access_refused",
    );

    let all = expect(&c, "GET", "/api/bindings/%2F", None, 200);
    let all = all.as_array().unwrap();
    // The default exchange's implicit binding, two to the queue, one to the exchange.
    assert_eq!(all.len(), 4, "{all:?}");
    assert_eq!(all[0]["source"], "");
    let between = expect(&c, "GET", "/api/bindings/%2F/e/src/q/q", None, 200);
    let between = between.as_array().unwrap();
    assert_eq!(between.len(), 2);
    let with_args = between.iter().find(|x| x["routing_key"] == "").unwrap();
    let props = with_args["properties_key"].as_str().unwrap().to_owned();
    assert!(props.starts_with('~'), "{props}");
    let one = expect(&c, "GET", "/api/bindings/%2F/e/src/q/q/k1", None, 200);
    assert_eq!(one["destination"], "q");
    assert_eq!(one["destination_type"], "queue");
    expect(&c, "GET", "/api/bindings/%2F/e/src/e/dst/~", None, 200);
    expect(&c, "GET", "/api/queues/%2F/q/bindings", None, 200);
    assert_eq!(
        expect(
            &c,
            "GET",
            "/api/exchanges/%2F/src/bindings/source",
            None,
            200
        )
        .as_array()
        .unwrap()
        .len(),
        3
    );

    expect(&c, "DELETE", "/api/bindings/%2F/e/src/q/q/k1", None, 204);
    expect_error(
        &c,
        "DELETE",
        "/api/bindings/%2F/e/src/q/q/k1",
        None,
        404,
        "not_found",
    );
    let enc = ringmq::admin_client::seg(&props);
    expect(
        &c,
        "DELETE",
        &format!("/api/bindings/%2F/e/src/q/q/{enc}"),
        None,
        204,
    );
    expect(&c, "DELETE", "/api/bindings/%2F/e/src/e/dst/~", None, 204);
    assert_eq!(
        expect(&c, "GET", "/api/bindings", None, 200)
            .as_array()
            .unwrap()
            .len(),
        1
    );
    expect_error(&c, "GET", "/api/bindings/nowhere", None, 404, "not_found");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vhosts_users_and_permissions_change_at_run_time() {
    let b = Broker::start();
    let c = b.admin_client();
    expect(&c, "PUT", "/api/vhosts/apps", None, 201);
    expect(&c, "PUT", "/api/vhosts/apps", None, 204);
    let v = expect(&c, "GET", "/api/vhosts/apps", None, 200);
    assert_eq!(v["name"], "apps");
    assert_eq!(
        expect(&c, "GET", "/api/vhosts", None, 200)
            .as_array()
            .unwrap()
            .len(),
        2
    );
    expect_error(&c, "GET", "/api/vhosts/missing", None, 404, "not_found");
    // The creator (guest) may open the new vhost over AMQP at once.
    let guest_apps = format!("amqp://guest:guest@{}/apps", b.addr);
    let conn = lapin::Connection::connect(&guest_apps, ConnectionProperties::default())
        .await
        .unwrap();
    conn.close(200, "bye".into()).await.unwrap();

    // A new user, never shown with its password.
    expect(
        &c,
        "PUT",
        "/api/users/bob",
        Some(json!({"password": "pw", "tags": "monitoring"})),
        201,
    );
    expect(
        &c,
        "PUT",
        "/api/users/bob",
        Some(json!({"tags": ["monitoring"]})),
        204,
    );
    let u = expect(&c, "GET", "/api/users/bob", None, 200);
    assert_eq!(u, json!({"name": "bob", "tags": ["monitoring"]}));
    let users = expect(&c, "GET", "/api/users", None, 200);
    assert!(!users.to_string().contains("password"), "{users}");
    expect_error(
        &c,
        "PUT",
        "/api/users/carol",
        Some(json!({"tags": []})),
        400,
        "bad_request",
    );
    expect_error(
        &c,
        "PUT",
        "/api/users/carol",
        Some(json!({"password_hash": "xx"})),
        400,
        "bad_request",
    );
    expect_error(
        &c,
        "PUT",
        "/api/users/carol",
        Some(json!({"password_hash": "AAAA", "hashing_algorithm": "rabbit_password_hashing_md5"})),
        400,
        "bad_request",
    );
    expect_error(&c, "GET", "/api/users/carol", None, 404, "not_found");

    // No permission: cannot open the vhost. With one: can.
    let bob_apps = format!("amqp://bob:pw@{}/apps", b.addr);
    let e = lapin::Connection::connect(&bob_apps, ConnectionProperties::default())
        .await
        .unwrap_err();
    assert_eq!(reply_code(&e), Some(530));
    let perm = json!({"configure": ".*", "write": ".*", "read": "^amq\\.gen"});
    expect(
        &c,
        "PUT",
        "/api/permissions/apps/bob",
        Some(perm.clone()),
        201,
    );
    expect(&c, "PUT", "/api/permissions/apps/bob", Some(perm), 204);
    expect_error(
        &c,
        "PUT",
        "/api/permissions/apps/bob",
        Some(json!({"configure": "(", "write": "", "read": ""})),
        400,
        "bad_request",
    );
    expect_error(
        &c,
        "PUT",
        "/api/permissions/apps/bob",
        Some(json!({"configure": ".*"})),
        400,
        "bad_request",
    );
    expect_error(
        &c,
        "PUT",
        "/api/permissions/apps/nobody",
        Some(json!({"configure": "", "write": "", "read": ""})),
        404,
        "not_found",
    );
    expect_error(
        &c,
        "PUT",
        "/api/permissions/nowhere/bob",
        Some(json!({"configure": "", "write": "", "read": ""})),
        404,
        "not_found",
    );
    let p = expect(&c, "GET", "/api/permissions/apps/bob", None, 200);
    assert_eq!(p["read"], "^amq\\.gen");
    assert!(
        expect(&c, "GET", "/api/permissions", None, 200)
            .as_array()
            .unwrap()
            .len()
            >= 3
    );
    let conn = lapin::Connection::connect(&bob_apps, ConnectionProperties::default())
        .await
        .unwrap();
    conn.close(200, "bye".into()).await.unwrap();
    expect(&c, "DELETE", "/api/permissions/apps/bob", None, 204);
    expect_error(
        &c,
        "DELETE",
        "/api/permissions/apps/bob",
        None,
        404,
        "not_found",
    );
    let e = lapin::Connection::connect(&bob_apps, ConnectionProperties::default())
        .await
        .unwrap_err();
    assert_eq!(reply_code(&e), Some(530));

    // A user imported with a RabbitMQ password hash logs in with the password.
    let hash = rabbit_hash([7, 7, 7, 7], "hashed-pw");
    expect(
        &c,
        "PUT",
        "/api/users/dave",
        Some(
            json!({"password_hash": hash, "hashing_algorithm": "rabbit_password_hashing_sha256", "tags": ""}),
        ),
        201,
    );
    expect(
        &c,
        "PUT",
        "/api/permissions/%2F/dave",
        Some(json!({"configure": ".*", "write": ".*", "read": ".*"})),
        201,
    );
    let dave = format!("amqp://dave:hashed-pw@{}/%2f", b.addr);
    let conn = lapin::Connection::connect(&dave, ConnectionProperties::default())
        .await
        .unwrap();
    conn.close(200, "bye".into()).await.unwrap();

    expect(&c, "DELETE", "/api/users/bob", None, 204);
    expect_error(&c, "DELETE", "/api/users/bob", None, 404, "not_found");
    expect(&c, "DELETE", "/api/vhosts/apps", None, 204);
    expect_error(&c, "DELETE", "/api/vhosts/apps", None, 404, "not_found");
    let e = lapin::Connection::connect(&guest_apps, ConnectionProperties::default())
        .await
        .unwrap_err();
    assert_eq!(reply_code(&e), Some(530));
}

/// RabbitMQ's rabbit_password_hashing_sha256: base64(salt ‖ sha256(salt ‖ password)),
/// computed here independently of the broker's code.
fn rabbit_hash(salt: [u8; 4], password: &str) -> String {
    use base64::Engine;
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    h.update(salt);
    h.update(password.as_bytes());
    let mut raw = salt.to_vec();
    raw.extend_from_slice(&h.finalize());
    base64::engine::general_purpose::STANDARD.encode(raw)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_and_channels_are_listed_and_force_closed() {
    let b = Broker::start();
    let c = b.admin_client();
    let (conn, ch) = b.channel().await;
    let _ch2 = conn.create_channel().await.unwrap();
    ch.queue_declare(
        "q".into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let _consumer = ch
        .basic_consume(
            "q".into(),
            "c1".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let conns = expect(&c, "GET", "/api/connections", None, 200);
    let conns = conns.as_array().unwrap();
    assert_eq!(conns.len(), 1, "{conns:?}");
    let me = &conns[0];
    assert_eq!(me["user"], "guest");
    assert_eq!(me["vhost"], "/");
    assert_eq!(me["channels"], 2);
    assert_eq!(me["peer_host"], "127.0.0.1");
    let name = me["name"].as_str().unwrap().to_owned();
    assert!(name.contains(" -> "), "{name}");
    let enc = ringmq::admin_client::seg(&name);
    assert_eq!(
        expect(&c, "GET", &format!("/api/connections/{enc}"), None, 200)["name"],
        name.as_str()
    );
    let chans = expect(&c, "GET", "/api/channels", None, 200);
    let chans = chans.as_array().unwrap();
    assert_eq!(chans.len(), 2, "{chans:?}");
    assert_eq!(
        chans
            .iter()
            .map(|x| x["consumer_count"].as_u64().unwrap())
            .sum::<u64>(),
        1
    );
    assert_eq!(chans[0]["connection_details"]["name"], name.as_str());
    assert_eq!(
        expect(
            &c,
            "GET",
            &format!("/api/connections/{enc}/channels"),
            None,
            200
        )
        .as_array()
        .unwrap()
        .len(),
        2
    );
    assert_eq!(
        expect(&c, "GET", "/api/queues/%2F/q", None, 200)["consumers"],
        1
    );

    // Force-close one channel: the other channel and the connection keep working.
    let ch1 = chans.iter().find(|x| x["consumer_count"] == 1).unwrap()["name"]
        .as_str()
        .unwrap()
        .to_owned();
    expect(
        &c,
        "DELETE",
        &format!("/api/channels/{}", ringmq::admin_client::seg(&ch1)),
        None,
        204,
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while expect(&c, "GET", "/api/channels", None, 200)
        .as_array()
        .unwrap()
        .len()
        != 1
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the channel was not closed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        expect(&c, "GET", "/api/queues/%2F/q", None, 200)["consumers"],
        0,
        "its consumer went with it"
    );
    let again = conn
        .create_channel()
        .await
        .expect("the connection is still open");
    again
        .queue_declare(
            "q".into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    expect_error(
        &c,
        "DELETE",
        &format!("/api/channels/{}", ringmq::admin_client::seg(&ch1)),
        None,
        404,
        "not_found",
    );
    expect_error(&c, "DELETE", "/api/channels/nope", None, 404, "not_found");
    expect_error(
        &c,
        "DELETE",
        "/api/connections/nope",
        None,
        404,
        "not_found",
    );
    expect_error(&c, "GET", "/api/connections/nope", None, 404, "not_found");
    expect(&c, "DELETE", &format!("/api/connections/{enc}"), None, 204);
    // The client is told 320 CONNECTION_FORCED and the connection goes away.
    let deadline = Instant::now() + Duration::from_secs(5);
    while conn.status().connected() {
        assert!(Instant::now() < deadline, "the connection was not closed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        ch.basic_qos(1, BasicQosOptions::default()).await.is_err(),
        "the channel is gone with its connection"
    );
    eventually("the log line of the 320 close", || {
        b.log.lock().unwrap().iter().any(|l| {
            l.contains("closing connection on error")
                && l.contains("320")
                && l.contains("Closed via management API")
        })
    });
    eventually("the registry to forget it", || {
        expect(&c, "GET", "/api/connections", None, 200)
            .as_array()
            .unwrap()
            .is_empty()
    });
    assert!(b.wait_for_log("closing connection on request", Duration::from_secs(2)));
}

fn build_topology(c: &AdminClient) {
    expect(c, "PUT", "/api/vhosts/shop", None, 201);
    expect(
        c,
        "PUT",
        "/api/users/ops",
        Some(json!({"password": "ops", "tags": ["monitoring"]})),
        201,
    );
    expect(
        c,
        "PUT",
        "/api/permissions/shop/ops",
        Some(json!({"configure": "", "write": "", "read": ".*"})),
        201,
    );
    expect(
        c,
        "PUT",
        "/api/exchanges/shop/orders",
        Some(json!({"type": "topic", "arguments": {"alternate-exchange": "lost"}})),
        201,
    );
    expect(
        c,
        "PUT",
        "/api/exchanges/shop/lost",
        Some(json!({"type": "fanout", "durable": false})),
        201,
    );
    expect(
        c,
        "PUT",
        "/api/queues/shop/eu",
        Some(json!({"arguments": {"x-message-ttl": 60000, "x-dead-letter-exchange": "lost"}})),
        201,
    );
    expect(
        c,
        "PUT",
        "/api/queues/%2F/plain",
        Some(json!({"durable": false, "auto_delete": true})),
        201,
    );
    expect(
        c,
        "POST",
        "/api/bindings/shop/e/orders/q/eu",
        Some(json!({"routing_key": "eu.#"})),
        201,
    );
    expect(
        c,
        "POST",
        "/api/bindings/shop/e/orders/e/lost",
        Some(json!({"routing_key": "x", "arguments": {"k": "v"}})),
        201,
    );
}

#[test]
fn definitions_export_import_into_a_fresh_broker_gives_identical_definitions() {
    let a = Broker::start();
    let ca = a.admin_client();
    build_topology(&ca);
    let exported = expect(&ca, "GET", "/api/definitions", None, 200);
    for k in [
        "users",
        "vhosts",
        "permissions",
        "queues",
        "exchanges",
        "bindings",
    ] {
        assert!(exported[k].is_array(), "{k}: {exported}");
    }
    assert!(exported["users"].to_string().contains("password_hash"));
    assert!(!exported["users"].to_string().contains("\"password\""));
    assert_eq!(exported["queues"].as_array().unwrap().len(), 2);
    assert_eq!(exported["exchanges"].as_array().unwrap().len(), 2);
    assert_eq!(exported["bindings"].as_array().unwrap().len(), 2);

    let b = Broker::start();
    let cb = b.admin_client();
    expect(&cb, "POST", "/api/definitions", Some(exported.clone()), 204);
    let again = expect(&cb, "GET", "/api/definitions", None, 200);
    assert_eq!(again, exported);
    // Importing the same definitions again changes nothing.
    expect(&cb, "POST", "/api/definitions", Some(exported.clone()), 204);
    assert_eq!(expect(&cb, "GET", "/api/definitions", None, 200), exported);
    // The imported user logs in with its original password.
    let ops = b.admin_as("ops", "ops");
    expect(&ops, "GET", "/api/queues/shop", None, 200);
    // Conflicting and malformed documents are refused.
    let mut conflicting = exported.clone();
    conflicting["queues"][0]["durable"] =
        json!(!exported["queues"][0]["durable"].as_bool().unwrap());
    expect_error(
        &cb,
        "POST",
        "/api/definitions",
        Some(conflicting),
        409,
        "conflict",
    );
    expect_error(
        &cb,
        "POST",
        "/api/definitions",
        Some(json!({"queues": 5})),
        400,
        "bad_request",
    );
    expect_error(
        &cb,
        "POST",
        "/api/definitions",
        Some(json!({"exchanges": [{"name": "x", "vhost": "/", "type": "x-consistent-hash"}]})),
        400,
        "bad_request",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rabbitmq_definitions_export_is_accepted() {
    let b = Broker::start();
    let c = b.admin_client();
    let hash = rabbit_hash([0x90, 0x8a, 0x2b, 0x01], "rabbit-pw");
    // The shape RabbitMQ 3.x writes, with the fields ringmq ignores.
    let defs = json!({
        "rabbit_version": "3.12.13", "rabbitmq_version": "3.12.13", "product_name": "RabbitMQ",
        "product_version": "3.12.13",
        "users": [{"name": "svc", "password_hash": hash, "hashing_algorithm": "rabbit_password_hashing_sha256",
                   "tags": "administrator,management", "limits": {}},
                  {"name": "nopw", "password_hash": "", "hashing_algorithm": "rabbit_password_hashing_sha256", "tags": []}],
        "vhosts": [{"name": "/", "limits": [], "metadata": {"description": "Default virtual host", "tags": []}},
                   {"name": "legacy", "limits": [], "metadata": {}}],
        "permissions": [{"user": "svc", "vhost": "legacy", "configure": ".*", "write": ".*", "read": ".*"}],
        "topic_permissions": [], "parameters": [], "global_parameters": [{"name": "cluster_name", "value": "rabbit@h"}],
        "policies": [],
        "queues": [{"name": "jobs", "vhost": "legacy", "durable": true, "auto_delete": false,
                    "arguments": {"x-queue-type": "classic", "x-max-priority": 5}}],
        "exchanges": [{"name": "work", "vhost": "legacy", "type": "direct", "durable": true,
                       "auto_delete": false, "internal": false, "arguments": {}}],
        "bindings": [{"source": "work", "vhost": "legacy", "destination": "jobs", "destination_type": "queue",
                      "routing_key": "jobs", "arguments": {}}]
    });
    expect(&c, "POST", "/api/definitions", Some(defs), 204);
    let svc = b.admin_as("svc", "rabbit-pw");
    assert_eq!(
        expect(&svc, "GET", "/api/queues/legacy/jobs", None, 200)["arguments"]["x-max-priority"],
        5
    );
    expect_error(
        &b.admin_as("nopw", ""),
        "GET",
        "/api/overview",
        None,
        401,
        "not_authorised",
    );
    // Over AMQP: publish to the imported exchange lands in the imported queue.
    let uri = format!("amqp://svc:rabbit-pw@{}/legacy", b.addr);
    let conn = lapin::Connection::connect(&uri, ConnectionProperties::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    ch.basic_publish(
        "work".into(),
        "jobs".into(),
        BasicPublishOptions::default(),
        b"j",
        BasicProperties::default(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    assert_eq!(
        expect(&c, "GET", "/api/queues/legacy/jobs", None, 200)["messages_ready"],
        1
    );
}

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

#[test]
fn unknown_paths_and_methods_answer_json_errors() {
    let b = Broker::start();
    let c = b.admin_client();
    expect_error(&c, "GET", "/api/nothing", None, 404, "not_found");
    expect_error(&c, "GET", "/elsewhere", None, 404, "not_found");
    expect_error(&c, "PATCH", "/api/queues", None, 405, "method_not_allowed");
    expect_error(
        &c,
        "POST",
        "/api/queues/%2F/q",
        Some(json!({})),
        405,
        "method_not_allowed",
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

#[test]
fn broker_help_documents_admin_listen_and_ctl_help_lists_the_commands() {
    let out = std::process::Command::new(ringmq_tests::binary("ringmq-broker"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(
        String::from_utf8(out.stdout)
            .unwrap()
            .contains("--admin-listen")
    );
    let out = std::process::Command::new(ringmq_tests::binary("ringmqctl"))
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8(out.stdout).unwrap();
    for cmd in [
        "status",
        "list",
        "declare",
        "delete",
        "purge",
        "close",
        "definitions",
        "completions",
        "bench",
        "sink",
        "--admin",
        "--user",
        "--password",
        "--json",
    ] {
        assert!(help.contains(cmd), "ringmqctl --help lacks {cmd}:\n{help}");
    }
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
