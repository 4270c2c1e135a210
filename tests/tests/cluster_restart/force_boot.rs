//! `--cluster-force-boot` starts a survivor alone with its state.

use crate::harness::*;
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn force_boot_starts_a_survivor_alone_with_its_state() {
    let name = "force";
    let (mut members, _ports, _secret) = start_cluster(name);
    declare_until_committed(&members[1], "kept", true, READY_LIMIT)
        .await
        .unwrap();
    for m in members.iter_mut() {
        m.kill();
    }
    // Members 0 and 2 are lost for good; member 1 alone waits, as it must...
    members[1].start_again();
    assert_waiting(&mut members, 1, FAILURE_TIMEOUT, "force: the lone survivor").await;
    // ...until the operator force-boots it: a new cluster from its own state.
    members[1].start_again_with(&["--cluster-force-boot"]);
    wait_ready(&mut members, &[1], READY_LIMIT, "force: force-booted");
    let view = cluster_view(&members[1]).unwrap();
    assert_eq!(view["voters"], 1, "force: a new cluster of one: {view}");
    assert!(
        passive(&members[1], "kept").await.is_ok(),
        "force: the survivor's queue is there after the force boot"
    );
    declare_until_committed(&members[1], "after-force", true, READY_LIMIT)
        .await
        .expect("force: the force-booted member takes wiring changes");
    let moved_aside = std::fs::read_dir(members[1].state_dir())
        .unwrap()
        .filter_map(Result::ok)
        .any(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("cluster.before-force-boot-")
        });
    assert!(moved_aside, "force: the old cluster state is kept aside");
    assert!(
        members[1].log_tail(200).contains("FORCE BOOT"),
        "force: the force boot says loudly what it costs"
    );
}
