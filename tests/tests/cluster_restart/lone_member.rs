//! A lone restarted member serves no client and takes no wiring change.

use crate::harness::*;
use serde_json::json;
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_restarted_member_serves_no_client() {
    let name = "lone";
    let (mut members, ports, secret) = start_cluster(name);
    declare_until_committed(&members[0], "before", true, READY_LIMIT)
        .await
        .unwrap();
    for m in members.iter_mut() {
        m.kill();
    }
    // Member 0, the configured founder, with the shared seed list and a join timeout shorter
    // than the wait: nobody answers, and still it founds nothing.
    members[0].restart_with_config(&member_yaml(
        name,
        0,
        &ports,
        &secret.0,
        Seeds::Others,
        1_500,
    ));
    assert_waiting(
        &mut members,
        0,
        3 * FAILURE_TIMEOUT,
        "lone: member 0 started alone",
    )
    .await;
    let put = members[0].admin_client().call(
        "PUT",
        "/api/queues/%2F/lone-wiring",
        Some(&json!({"durable": true})),
    );
    if let Ok(a) = &put {
        assert!(
            !(200..300).contains(&a.status),
            "lone: a queue PUT through the admin API of a member without quorum answered {} {}",
            a.status,
            a.body
        );
    }
    // Still waiting after the refused change.
    assert_waiting(
        &mut members,
        0,
        FAILURE_TIMEOUT,
        "lone: member 0 after the admin PUT",
    )
    .await;

    for i in [1, 2] {
        members[i].start_again();
    }
    wait_settled(
        &mut members,
        &[0, 1, 2],
        READY_LIMIT,
        "lone: all three back",
    );
    for (i, m) in members.iter().enumerate() {
        assert!(
            passive(m, "before").await.is_ok(),
            "lone: queue 'before' on member {i}"
        );
        assert!(
            passive(m, "lone-wiring").await.is_err(),
            "lone: the admin PUT refused while alone must not appear later (member {i})"
        );
    }
}
