//! A leader frozen with SIGSTOP claims no quorum when it resumes.

use crate::harness::*;
use ringmq_tests::Broker;
use std::time::{Duration, Instant};
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigstop_of_the_leader_keeps_no_quorum_after_resume() {
    let name = "stop";
    let (mut members, _ports, _secret) = start_cluster(name);
    let leader = cluster_view(&members[0]).unwrap()["leader"]
        .as_str()
        .expect("a leader after settling")
        .to_owned();
    let l = (0..N)
        .find(|&i| node(name, i) == leader)
        .unwrap_or_else(|| panic!("leader {leader:?} is one of the members"));
    let others: Vec<usize> = (0..N).filter(|&i| i != l).collect();

    members[l].pause();
    let stopped = Instant::now();
    // The other two elect a leader among themselves and commit a change.
    let committed =
        declare_until_committed(&members[others[0]], "during-stop", true, READY_LIMIT).await;
    if let Err(e) = committed {
        members[l].resume();
        panic!(
            "stop: the two live members did not commit while member {l} (the leader) was \
             stopped: {e}{}",
            describe(&mut members)
        );
    }
    let new_leader = cluster_view(&members[others[0]]).unwrap()["leader"].clone();
    assert!(
        new_leader.is_string() && new_leader != leader.as_str(),
        "stop: the majority has a new leader, not the stopped {leader}: {new_leader}"
    );
    let remaining = (3 * FAILURE_TIMEOUT).saturating_sub(stopped.elapsed());
    tokio::time::sleep(remaining).await;

    // The first request the resumed member answers is already waiting in its accept queue
    // when it resumes.
    let admin = members[l].admin_url();
    let first = std::thread::spawn(move || {
        ringmq::admin_client::AdminClient::new(&admin, Some("guest"), Some("guest"))
            .get("/api/overview")
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    members[l].resume();
    let first = first.join().expect("the request thread");
    let outcome = match &first {
        Ok(a) if a.status == 200 => {
            if a.body["cluster"]["quorum"] == true {
                let has_change = members[l]
                    .admin_client()
                    .get("/api/queues/%2F/during-stop")
                    .map(|a| a.status);
                panic!(
                    "stop: the resumed former leader's first overview claims quorum while the \
                     majority moved on to {new_leader}: {} (GET of the majority's queue on it \
                     right after: {has_change:?}){}",
                    a.body["cluster"],
                    describe(&mut members)
                );
            }
            format!("first answer: cluster {}", a.body["cluster"])
        }
        Ok(a) => format!("first answer: status {} {}", a.status, a.body),
        Err(e) => format!("first request failed: {e}"),
    };
    eprintln!("stop: member {l} (the stopped leader) after SIGCONT — {outcome}");

    // Afterwards it may claim quorum only once it has rejoined: it then has the change the
    // majority committed without it. It may instead be evicted and exit with status 3.
    let deadline = Instant::now() + READY_LIMIT;
    loop {
        if let Some(status) = members[l].exit_status() {
            assert_eq!(
                status.code(),
                Some(3),
                "stop: a stopped member exits with status 3 (restart me){}",
                describe(&mut members)
            );
            eprintln!("stop: member {l} exited with status 3 after resuming (evicted)");
            break;
        }
        match cluster_view(&members[l]) {
            Ok(v) if v["quorum"] == true => {
                let has = members[l]
                    .admin_client()
                    .get("/api/queues/%2F/during-stop")
                    .map(|a| a.status);
                assert_eq!(
                    has,
                    Ok(200),
                    "stop: member {l} claims quorum ({v}) without the change the majority \
                     committed while it was stopped"
                );
                eprintln!("stop: member {l} rejoined with the majority's change");
                break;
            }
            _ => {}
        }
        assert!(
            Instant::now() < deadline,
            "stop: member {l} neither rejoined nor exited within {READY_LIMIT:?}{}",
            describe(&mut members)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The majority still commits.
    declare_until_committed(&members[others[1]], "after-stop", true, READY_LIMIT)
        .await
        .unwrap_or_else(|e| panic!("stop: the majority after the resume: {e}"));
}

/// The hang report's tool works: a member that does not answer (frozen here) shows where its
/// threads are, with the project's own frames, so a hang in CI names its lock.
#[test]
fn a_member_that_does_not_answer_shows_where_its_threads_wait() {
    let b = Broker::start();
    b.pause();
    let stacks = b.thread_stacks();
    b.resume();
    assert!(
        stacks.contains("ringmq::store::journal"),
        "the journal thread's frames in the stacks:\n{stacks}"
    );
    assert!(
        stacks.matches("Thread ").count() >= 3,
        "every thread listed:\n{stacks}"
    );
}
