//! The amqps listener: TLS with rustls (ring), plaintext switched off, client certificates
//! and SASL EXTERNAL, certificate rotation without a restart.

use ringmq::amqp::frame::{FRAME_BODY, PROTOCOL_HEADER};
use ringmq::amqp::{AMQPClass, basic, connection, queue};
use ringmq::client::{ClientError, RawClient, Target, encode_publish};
use ringmq_tests::Broker;
use ringmq_tests::tls::{Pki, client_config, connect, server_cert_cn};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;

fn pki(test: &str) -> Pki {
    let dir: PathBuf =
        std::env::temp_dir().join(format!("ringmq-tls-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let pki = Pki::new(&dir, "ringmq test CA");
    pki.write_server("server-1");
    pki
}

fn guest(b: &Broker) -> Target {
    Target::parse(&b.uri()).unwrap()
}

/// The mechanisms the broker offers on this stream (reads connection.start).
async fn mechanisms<S>(stream: S) -> String
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let mut c = RawClient::unopened(stream);
    c.stream.write_all(PROTOCOL_HEADER).await.unwrap();
    c.stream.flush().await.unwrap();
    match c.read_method().await.unwrap() {
        AMQPClass::Connection(connection::AMQPMethod::Start(s)) => s.mechanisms.to_string(),
        m => panic!("expected connection.start, got {m:?}"),
    }
}

#[tokio::test]
async fn messages_flow_over_the_tls_listener() {
    let pki = pki("flow");
    let b = Broker::start_with_config(&pki.broker_yaml(false));
    let amqps = b.amqps.expect("the broker printed amqps=");
    assert_ne!(amqps, b.addr, "plaintext stays on by default");
    let stream = connect(amqps, client_config(pki.ca_der(), None))
        .await
        .unwrap();
    assert_eq!(server_cert_cn(&stream).as_deref(), Some("server-1"));
    let mut c = RawClient::open(stream, &guest(&b), "PLAIN", b"\0guest\0guest")
        .await
        .unwrap();
    c.call(
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: "over-tls".into(),
            ..Default::default()
        })),
        |m| matches!(m, AMQPClass::Queue(queue::AMQPMethod::DeclareOk(_))),
        "queue.declare-ok",
    )
    .await
    .unwrap();
    let body = vec![7u8; 300_000]; // several frames and several TLS records
    let mut out = Vec::new();
    encode_publish(&mut out, 1, "", "over-tls", false, &body, c.frame_max);
    c.stream.write_all(&out).await.unwrap();
    c.stream.flush().await.unwrap();
    // basic.get until the message is there (the publish has no reply to wait for).
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let got = c
            .call(
                AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
                    queue: "over-tls".into(),
                    no_ack: true,
                })),
                |m| {
                    matches!(
                        m,
                        AMQPClass::Basic(
                            basic::AMQPMethod::GetOk(_) | basic::AMQPMethod::GetEmpty(_)
                        )
                    )
                },
                "basic.get-ok",
            )
            .await
            .unwrap();
        if matches!(got, AMQPClass::Basic(basic::AMQPMethod::GetOk(_))) {
            break;
        }
        assert!(Instant::now() < deadline, "the message never arrived");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut received = Vec::new();
    while received.len() < body.len() {
        let f = c.read_frame().await.unwrap();
        if f.kind == FRAME_BODY {
            received.extend_from_slice(&f.payload);
        }
    }
    assert_eq!(received, body);
}

#[tokio::test]
async fn the_plaintext_listener_can_be_switched_off() {
    let pki = pki("noplain");
    let yaml = format!("{}amqp_listen_enabled: false\n", pki.broker_yaml(false));
    let b = Broker::start_with_config(&yaml);
    assert_eq!(b.amqps, Some(b.addr), "only the amqps address was printed");
    let stream = connect(b.addr, client_config(pki.ca_der(), None))
        .await
        .unwrap();
    RawClient::open(stream, &guest(&b), "PLAIN", b"\0guest\0guest")
        .await
        .unwrap();
}

#[tokio::test]
async fn a_plaintext_client_on_the_tls_port_gets_no_amqp() {
    let pki = pki("plain-on-tls");
    let b = Broker::start_with_config(&pki.broker_yaml(false));
    let tcp = tokio::net::TcpStream::connect(b.amqps.unwrap())
        .await
        .unwrap();
    let mut c = RawClient::unopened(tcp);
    c.stream.write_all(PROTOCOL_HEADER).await.unwrap();
    let r = tokio::time::timeout(Duration::from_secs(5), c.read_method())
        .await
        .expect("the broker ends the connection instead of waiting");
    assert!(r.is_err(), "no connection.start in the clear: {r:?}");
}

#[tokio::test]
async fn external_logs_in_as_the_client_certificate_common_name() {
    let pki = pki("external");
    let yaml = format!(
        "{}users:\n  - name: guest\n    password: guest\n    tags: [administrator]\n  - name: app\n    password: unused-by-external\n",
        pki.broker_yaml(true)
    );
    let b = Broker::start_with_config(&yaml);
    let amqps = b.amqps.unwrap();
    let app = pki.client("app");
    // With a verified certificate EXTERNAL is offered, and logs in as its CN.
    let stream = connect(amqps, client_config(pki.ca_der(), Some(&app)))
        .await
        .unwrap();
    assert!(mechanisms(stream).await.split(' ').any(|m| m == "EXTERNAL"));
    let stream = connect(amqps, client_config(pki.ca_der(), Some(&app)))
        .await
        .unwrap();
    let _app = RawClient::open(stream, &guest(&b), "EXTERNAL", b"")
        .await
        .expect("EXTERNAL login as app");
    let listed = b.admin_client().get("/api/connections").unwrap().body;
    assert!(
        listed
            .as_array()
            .is_some_and(|conns| conns.iter().any(|c| c["user"] == "app")),
        "{listed}"
    );
    // Without a certificate it is not offered, and asking for it is refused.
    let stream = connect(amqps, client_config(pki.ca_der(), None))
        .await
        .unwrap();
    assert!(!mechanisms(stream).await.contains("EXTERNAL"));
    let stream = connect(amqps, client_config(pki.ca_der(), None))
        .await
        .unwrap();
    assert!(
        RawClient::open(stream, &guest(&b), "EXTERNAL", b"")
            .await
            .is_err()
    );
    // On plaintext it is never offered.
    let tcp = tokio::net::TcpStream::connect(b.addr).await.unwrap();
    assert!(!mechanisms(tcp).await.contains("EXTERNAL"));
}

#[tokio::test]
async fn external_for_a_certificate_naming_no_user_is_refused() {
    let pki = pki("external-unknown");
    let b = Broker::start_with_config(&pki.broker_yaml(true));
    let stranger = pki.client("stranger");
    let stream = connect(
        b.amqps.unwrap(),
        client_config(pki.ca_der(), Some(&stranger)),
    )
    .await
    .unwrap();
    match RawClient::open(stream, &guest(&b), "EXTERNAL", b"").await {
        Err(ClientError::Closed { code, .. }) => assert_eq!(code, 403),
        Err(e) => panic!("expected 403, got {e}"),
        Ok(_) => panic!("a certificate for an unknown user logged in"),
    }
}

#[tokio::test]
async fn a_certificate_from_another_ca_is_refused() {
    let pki = pki("other-ca");
    let b = Broker::start_with_config(&pki.broker_yaml(true));
    let other = Pki::new(&pki.dir.join("other"), "someone else's CA");
    let forged = other.client("guest");
    let r = async {
        let stream = connect(b.amqps.unwrap(), client_config(pki.ca_der(), Some(&forged))).await?;
        RawClient::open(stream, &guest(&b), "EXTERNAL", b"")
            .await
            .map_err(|e| std::io::Error::other(e.to_string()))
    }
    .await;
    assert!(r.is_err(), "a certificate of an unknown CA was accepted");
}

#[tokio::test]
async fn fail_if_no_peer_cert_refuses_clients_without_one() {
    let pki = pki("require-cert");
    let yaml = format!("{}tls_fail_if_no_peer_cert: true\n", pki.broker_yaml(true));
    let b = Broker::start_with_config(&yaml);
    let amqps = b.amqps.unwrap();
    let r = async {
        let stream = connect(amqps, client_config(pki.ca_der(), None)).await?;
        RawClient::open(stream, &guest(&b), "PLAIN", b"\0guest\0guest")
            .await
            .map_err(|e| std::io::Error::other(e.to_string()))
    }
    .await;
    assert!(r.is_err(), "a client without a certificate got in");
    let app = pki.client("guest");
    let stream = connect(amqps, client_config(pki.ca_der(), Some(&app)))
        .await
        .unwrap();
    RawClient::open(stream, &guest(&b), "PLAIN", b"\0guest\0guest")
        .await
        .expect("with a certificate PLAIN still works");
}

#[tokio::test]
async fn a_rotated_certificate_is_served_to_new_connections_without_a_restart() {
    let pki = pki("rotate");
    let b = Broker::start_with_config(&pki.broker_yaml(false));
    let amqps = b.amqps.unwrap();
    let config = client_config(pki.ca_der(), None);
    let old = connect(amqps, config.clone()).await.unwrap();
    assert_eq!(server_cert_cn(&old).as_deref(), Some("server-1"));
    let mut old = RawClient::open(old, &guest(&b), "PLAIN", b"\0guest\0guest")
        .await
        .unwrap();
    pki.write_server("server-2");
    // The broker checks the files every second (tls_reload_interval_s: 1).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = connect(amqps, config.clone()).await.unwrap();
        if server_cert_cn(&s).as_deref() == Some("server-2") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the new certificate was never served"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(b.wait_for_log("TLS certificate reloaded", Duration::from_secs(1)));
    // The connection opened before the rotation still works.
    old.call(
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: "still-here".into(),
            ..Default::default()
        })),
        |m| matches!(m, AMQPClass::Queue(queue::AMQPMethod::DeclareOk(_))),
        "queue.declare-ok",
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn a_broken_certificate_file_keeps_the_previous_one() {
    let pki = pki("broken");
    let b = Broker::start_with_config(&pki.broker_yaml(false));
    std::fs::write(
        pki.server_key_file(),
        "-----BEGIN PRIVATE KEY-----\nbroken\n",
    )
    .unwrap();
    assert!(b.wait_for_log("keeping the previous certificate", Duration::from_secs(10)));
    let s = connect(b.amqps.unwrap(), client_config(pki.ca_der(), None))
        .await
        .unwrap();
    assert_eq!(server_cert_cn(&s).as_deref(), Some("server-1"));
}
