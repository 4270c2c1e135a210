//! `qpid.cluster.proxy` naming a cluster member, and a malformed proxy URI.

use crate::support::*;
use lapin::options::{ExchangeDeclareOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use ringmq_tests::cluster::start_cluster;
use ringmq_tests::reply_code;

#[tokio::test]
async fn a_malformed_proxy_uri_is_refused_with_a_reason() {
    let (members, _secret) = start_cluster("proxy-args", 2);
    let (_c, ch) = members[0].channel().await;
    let refused = ch
        .queue_declare(
            "p".into(),
            QueueDeclareOptions::default(),
            proxy_to("amqp://[bad"),
        )
        .await
        .expect_err("not a URI");
    assert_eq!(reply_code(&refused), Some(406));
}

#[tokio::test]
async fn a_proxy_naming_a_member_answers_whether_that_member_has_the_queue() {
    let (members, _secret) = start_cluster("proxy-member", 2);
    // "on-1" lives on member 1; declared through member 0.
    let (_c0, on_0) = members[0].channel().await;
    let mut placed = FieldTable::default();
    placed.insert(
        "qpid.cluster.primary".into(),
        lapin::types::AMQPValue::LongString("proxy-member-1".into()),
    );
    on_0.queue_declare("on-1".into(), QueueDeclareOptions::default(), placed)
        .await
        .unwrap();
    publish_confirmed(&on_0, "on-1", "m", 2).await;

    // Member 1 is its primary, by node id or AMQP address, from either member: declare-ok
    // with the primary's counts, and nothing new.
    let addr = members[1].uri();
    let addr = addr.split('@').nth(1).unwrap().split('/').next().unwrap();
    for b in &members {
        assert_eq!(
            declare_naming(b, "on-1", None, "proxy-member-1").await,
            Ok((2, 0))
        );
        assert_eq!(declare_naming(b, "on-1", None, addr).await, Ok((2, 0)));
    }
    // Not its primary, no such queue, no such member: 404.
    assert_eq!(
        declare_naming(&members[1], "on-1", None, "proxy-member-0").await,
        Err(Some(404))
    );
    assert_eq!(
        declare_naming(&members[0], "nowhere", None, "proxy-member-1").await,
        Err(Some(404))
    );
    let (_c, ch) = members[0].channel().await;
    assert!(
        ch.queue_declare(
            "nowhere".into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .is_err(),
        "the refused declare created nothing"
    );
    assert_eq!(
        declare_naming(&members[0], "on-1", None, "proxy-member-9").await,
        Err(Some(404))
    );

    // An exchange: declare-ok when the cluster's shared wiring has it, else 404.
    on_0.exchange_declare(
        "shared-x".into(),
        lapin::ExchangeKind::Topic,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    assert_eq!(
        declare_naming(&members[1], "", Some("shared-x"), "proxy-member-0").await,
        Ok((0, 0))
    );
    assert_eq!(
        declare_naming(&members[1], "", Some("no-such-x"), "proxy-member-0").await,
        Err(Some(404))
    );
    assert_eq!(
        declare_naming(&members[1], "", Some("shared-x"), "proxy-member-9").await,
        Err(Some(404))
    );
}
