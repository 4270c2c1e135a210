//! Queues, exchanges and bindings through the API: declare, get, list, purge, delete, and their
//! errors.

use crate::support::*;
use lapin::BasicProperties;
use lapin::options::*;
use lapin::types::FieldTable;
use ringmq_tests::Broker;
use serde_json::Value;
use serde_json::json;
use std::time::Duration;

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
        (
            "local_copy",
            json!({"role": "primary", "messages": 0, "message_bytes_ram": 0}),
        ),
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
