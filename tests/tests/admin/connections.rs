//! Connections and channels listed and force-closed through the API.

use crate::support::*;
use lapin::options::*;
use lapin::types::FieldTable;
use ringmq_tests::Broker;
use std::time::Duration;
use std::time::Instant;

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
