//! Vhosts, users and permissions changed at run time through the API.

use crate::support::*;
use lapin::ConnectionProperties;
use ringmq_tests::Broker;
use ringmq_tests::reply_code;
use serde_json::json;

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
