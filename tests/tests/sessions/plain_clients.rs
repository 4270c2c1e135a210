//! A plain client in the scenarios of the failover client: pika, knowing nothing of
//! sessions, with the reconnect loop any production pika application has, publishes with
//! confirms and consumes with acks while the member it is connected to — the queue's primary
//! — is killed with -9, and later the member it moved to. Its guarantee is 0-9-1's
//! at-least-once: nothing confirmed is lost, and every delivery beyond the copies it
//! published is marked redelivered.

use ringmq_tests::cluster::{start_cluster_on_fixed_ports, wait_voters};
use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

#[test]
fn pika_loses_nothing_confirmed_and_marks_its_redeliveries_through_member_kills() {
    let python = ringmq_tests::prereq::python_with("pika", "pika");
    let (mut m, _secret) = start_cluster_on_fixed_ports("plain-pika", 3);
    wait_voters(&m, Duration::from_secs(30));
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/clients/pika_failover.py");
    let ports: Vec<String> = m.iter().map(|b| b.addr.port().to_string()).collect();
    let mut child = Command::new(&python)
        .arg(script)
        .args(&ports)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{python} {script}: {e}"));
    let stdout = BufReader::new(child.stdout.take().unwrap());
    let mut last = String::new();
    let mut kills = 0;
    for line in stdout.lines() {
        let line = line.unwrap();
        // Halfway through publishing: the member pika is on, the queue's primary (it
        // declared the queue there), is killed, and started again at once.
        // Halfway through consuming: the member it moved to.
        let victim = match line.as_str() {
            "published 200" => Some(0),
            "consumed 200" => {
                // The member the queue's primary moved to when member 0 died.
                let q = m[0]
                    .admin_client()
                    .get("/api/queues/%2F/pika-failover")
                    .expect("admin API answers");
                let node = q.body["node"].as_str().unwrap_or_default();
                let member = node
                    .strip_prefix("plain-pika-")
                    .and_then(|i| i.parse().ok());
                Some(
                    member.unwrap_or_else(|| panic!("the queue's primary is a member: {}", q.body)),
                )
            }
            _ => None,
        };
        if let Some(i) = victim {
            m[i].kill();
            kills += 1;
            m[i].start_again();
            let ready = std::panic::catch_unwind(|| m[i].wait_ready(Duration::from_secs(60)));
            if ready.is_err() {
                for (j, b) in m.iter().enumerate() {
                    eprintln!("member {j}:\n{}", b.log_tail(40));
                }
                panic!("member {i} not ready again");
            }
        }
        last = line;
    }
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(status.success(), "pika script failed: {stderr}\n{last}");
    assert_eq!(kills, 2, "both kills landed while pika ran: {last}");
    let v: serde_json::Value = serde_json::from_str(&last).expect("the JSON summary");
    let strings = |key: &str| -> Vec<String> {
        v[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap().to_owned())
            .collect()
    };
    let (confirmed, resent) = (strings("confirmed"), strings("resent"));
    let mut copies: HashMap<&str, usize> = HashMap::new();
    for body in confirmed.iter().chain(&resent) {
        *copies.entry(body).or_default() += 1;
    }
    let mut fresh: HashMap<String, usize> = HashMap::new();
    let mut delivered = std::collections::HashSet::new();
    let mut redelivered = 0;
    for d in v["deliveries"].as_array().unwrap() {
        let body = d[0].as_str().unwrap().to_owned();
        if d[1] == true {
            redelivered += 1;
        } else {
            *fresh.entry(body.clone()).or_default() += 1;
        }
        delivered.insert(body);
    }
    let lost: Vec<&String> = confirmed
        .iter()
        .filter(|b| !delivered.contains(*b))
        .collect();
    assert!(lost.is_empty(), "confirmed, never delivered: {lost:?}");
    for (body, n) in &fresh {
        let sent = copies.get(body.as_str()).copied().unwrap_or(0);
        assert!(
            *n <= sent,
            "{body} delivered {n} times unmarked, but published {sent} times: a redelivery not marked"
        );
    }
    eprintln!(
        "pika: {} confirmed, {} sent again, {} deliveries ({redelivered} marked redelivered), {} reconnects",
        confirmed.len(),
        resent.len(),
        v["deliveries"].as_array().unwrap().len(),
        v["reconnects"]
    );
}
