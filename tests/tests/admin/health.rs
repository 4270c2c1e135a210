//! Health, readiness and the API's access rules: `/healthz`, `/readyz` and a leaving member, auth by
//! tag, JSON errors for unknown paths and methods, the binaries' help.

use crate::support::*;
use ringmq::admin_client::AdminClient;
use ringmq_tests::Broker;
use serde_json::json;

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
