//! Clusters of brokers on loopback for tests: a shared secret, member configurations, and
//! a cluster started member by member.

use crate::Broker;
use std::path::PathBuf;

/// A cluster secret file shared by the members of one test.
pub fn secret(name: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!(
        "ringmq-cluster-secret-{}-{name}",
        std::process::id()
    ));
    std::fs::write(&path, "test-cluster-secret\n").expect("temp dir is writable");
    path
}

/// The configuration of cluster member `node` that joins through `seeds`.
pub fn member_yaml(node: &str, seeds: &[&str], secret: &std::path::Path) -> String {
    let seeds: Vec<String> = seeds.iter().map(|s| format!("\"{s}\"")).collect();
    format!(
        "node_id: {node}\ncluster_listen: 127.0.0.1:0\ncluster_secret_file: {}\ncluster_seeds: [{}]\ncluster_join_timeout_ms: 10000\n",
        secret.display(),
        seeds.join(", ")
    )
}

/// Starts `n` members (node ids `{name}-0` …): the first founds the cluster, each next one
/// asks the ones before.
pub fn start_cluster(name: &str, n: usize) -> (Vec<Broker>, PathBuf) {
    let secret = secret(name);
    let mut members: Vec<Broker> = Vec::new();
    for i in 0..n {
        let seeds: Vec<String> = members.iter().filter_map(|m| m.cluster.clone()).collect();
        let seeds: Vec<&str> = seeds.iter().map(String::as_str).collect();
        members.push(Broker::start_with_config(&member_yaml(
            &format!("{name}-{i}"),
            &seeds,
            &secret,
        )));
    }
    (members, secret)
}
