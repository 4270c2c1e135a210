//! Definitions: export and import into a fresh broker, and a RabbitMQ export accepted.

use crate::support::*;
use lapin::BasicProperties;
use lapin::ConnectionProperties;
use lapin::options::*;
use ringmq::admin_client::AdminClient;
use ringmq_tests::Broker;
use serde_json::json;

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
