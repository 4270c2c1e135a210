//! One crash at a time with restarts, twenty times, never leaves the cluster stuck.

use crate::harness::*;
use std::time::Instant;
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_crash_at_a_time_twenty_times_never_gets_stuck() {
    let name = "cycle";
    let (mut members, _ports, _secret) = start_cluster(name);
    const CYCLES: usize = 20;
    for cycle in 0..CYCLES {
        let started = Instant::now();
        let victim = cycle % N;
        let live: Vec<usize> = (0..N).filter(|&i| i != victim).collect();
        members[victim].kill();
        let queue = format!("cycle-{cycle}");
        if let Err(e) =
            declare_until_committed(&members[live[cycle % 2]], &queue, true, READY_LIMIT).await
        {
            panic!(
                "cycle {cycle}: member {victim} killed, the other two did not commit {queue}: \
                 {e}{}",
                describe(&mut members)
            );
        }
        wait_settled(
            &mut members,
            &live,
            READY_LIMIT,
            &format!("cycle {cycle}: the two survivors of killing member {victim}"),
        );
        members[victim].start_again();
        wait_settled(
            &mut members,
            &[0, 1, 2],
            READY_LIMIT,
            &format!("cycle {cycle}: member {victim} restarted on its data dir"),
        );
        eprintln!(
            "cycle {cycle}: member {victim} killed and back in {:?}",
            started.elapsed()
        );
    }
    for cycle in 0..CYCLES {
        for (i, m) in members.iter().enumerate() {
            // A proxied passive declare on a member just restarted can be slow under load
            // (docs/replication.md, known issues): three tries of 15 s each.
            let asked = Instant::now();
            let mut found = passive(m, &format!("cycle-{cycle}")).await;
            for _ in 0..2 {
                if found.is_ok() {
                    break;
                }
                found = passive(m, &format!("cycle-{cycle}")).await;
            }
            if asked.elapsed() > std::time::Duration::from_secs(2) {
                eprintln!(
                    "queue cycle-{cycle} on member {i}: answered in {:?}",
                    asked.elapsed()
                );
            }
            assert!(
                found.is_ok(),
                "queue cycle-{cycle} on member {i} after {CYCLES} cycles: {found:?}"
            );
        }
    }
}
