//! A founder restarted while cut off from the other two founds nothing (members in network
//! namespaces, `ringmq_tests::netns`, as `partition.rs` uses).

use crate::harness::*;
use ringmq_tests::netns::{Net, member_addr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// This test's subnet, 10.78.0.0/24 (`partition.rs` has 10.77).
const SUBNET: u8 = 78;

fn addr(i: usize) -> String {
    member_addr(SUBNET, i)
}

/// A broker in member namespace `i` on fixed addresses, its data dir kept across
/// restarts; killed by PID on drop.
struct Member {
    i: usize,
    child: Option<Child>,
    data: PathBuf,
    log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Member {
    fn new(i: usize) -> Self {
        let data = std::env::temp_dir().join(format!("ringmq-cut-off-{}-{i}", std::process::id()));
        let _ = std::fs::remove_dir_all(&data);
        std::fs::create_dir_all(&data).unwrap();
        Member {
            i,
            child: None,
            data,
            log: Default::default(),
        }
    }

    /// Starts (or kills and starts again) the broker with `seeds` and `join_timeout_ms`.
    fn start(&mut self, net: &Net, seeds: Seeds, join_timeout_ms: u64, secret: &Path) {
        use std::io::{BufRead, BufReader};
        self.kill();
        let i = self.i;
        let ip = addr(i);
        let seeds: Vec<String> = match seeds {
            Seeds::None => Vec::new(),
            Seeds::Others => (0..N)
                .filter(|&j| j != i)
                .map(|j| format!("\"{}:25672\"", addr(j)))
                .collect(),
        };
        let config = self.data.join("ringmq.yaml");
        std::fs::write(
            &config,
            format!(
                "node_id: m{i}\ncluster_listen: \"{ip}:25672\"\ncluster_secret_file: {}\n\
                 cluster_seeds: [{}]\ncluster_founder: m0\n\
                 cluster_join_timeout_ms: {join_timeout_ms}\n\
                 cluster_failure_timeout_ms: {}\n",
                secret.display(),
                seeds.join(", "),
                FAILURE_TIMEOUT.as_millis()
            ),
        )
        .unwrap();
        let mut child = Command::new("ip")
            .args(["netns", "exec", &net.members[i]])
            .arg(ringmq_tests::binary("ringmq-broker"))
            .args(["--amqp-listen", &format!("{ip}:5672")])
            .args(["--admin-listen", &format!("{ip}:15672")])
            .arg("--data-dir")
            .arg(self.data.join("data"))
            .arg("--config")
            .arg(&config)
            .env("RINGMQ_LOG", "info,openraft=warn")
            .env("RINGMQ_DEFAULT_USER", "test")
            .env("RINGMQ_DEFAULT_PASS", "test")
            .env("RINGMQ_PASSWORD_HASH_ITERATIONS", "10000")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        for pipe in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let sink = self.log.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                    sink.lock().unwrap().push(line);
                }
            });
        }
        self.log
            .lock()
            .unwrap()
            .push(format!("---- member {i} started (seeds {seeds:?}) ----"));
        self.child = Some(child);
        // Bounded wait for the admin port (readiness is the test's to check).
        let admin: std::net::SocketAddr = format!("{ip}:15672").parse().unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline
            && self.exited().is_none()
            && std::net::TcpStream::connect_timeout(&admin, Duration::from_millis(200)).is_err()
        {
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    fn admin(&self) -> ringmq::admin_client::AdminClient {
        ringmq::admin_client::AdminClient::new(
            &format!("http://{}:15672", addr(self.i)),
            Some("test"),
            Some("test"),
        )
    }

    fn uri(&self) -> String {
        format!("amqp://test:test@{}:5672/%2f", addr(self.i))
    }

    fn state(&mut self) -> String {
        if let Some(s) = self.exited() {
            return format!("exited ({s})");
        }
        let ready = self
            .admin()
            .get("/readyz")
            .map(|a| format!("{} {}", a.status, a.body))
            .unwrap_or_else(|e| e);
        let view = self
            .admin()
            .get("/api/overview")
            .map(|a| a.body["cluster"].to_string())
            .unwrap_or_else(|e| e);
        let log = self.log.lock().unwrap();
        format!(
            "readyz {ready}; cluster {view}\n  ---- log tail ----\n{}",
            log[log.len().saturating_sub(20)..].join("\n")
        )
    }

    /// Ready, with quorum and a leader.
    fn settled(&mut self) -> bool {
        self.exited().is_none()
            && self.admin().get("/readyz").is_ok_and(|a| a.status == 200)
            && self.admin().get("/api/overview").is_ok_and(|a| {
                a.body["cluster"]["quorum"] == true && a.body["cluster"]["leader"].is_string()
            })
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.data);
    }
}

fn wait_settled(members: &mut [Member], which: &[usize], what: &str) {
    let deadline = Instant::now() + READY_LIMIT;
    while !which.iter().all(|&i| members[i].settled()) {
        if Instant::now() > deadline {
            let states: Vec<String> = members.iter_mut().map(Member::state).collect();
            panic!(
                "{what}: members {which:?} not ready with quorum within {READY_LIMIT:?}:\n{}",
                states.join("\n")
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

async fn declare(uri: &str, name: &str, passive: bool) -> Result<(), String> {
    declare_once(uri, name, passive, true).await.map(|_| ())
}

/// The cut-off member stays unready, without quorum or leader, for `window`.
fn assert_cut_off_waits(members: &mut [Member], what: &str, window: Duration) {
    let deadline = Instant::now() + window;
    while Instant::now() < deadline {
        let m = &mut members[0];
        if let Some(s) = m.exited() {
            panic!("{what}: member 0 exited ({s}) instead of waiting");
        }
        let ready = m.admin().get("/readyz");
        let view = m.admin().get("/api/overview");
        let waiting = ready
            .as_ref()
            .is_ok_and(|a| a.status == 503 && a.reason().to_lowercase().contains("waiting"));
        // A member still trying its seeds has no cluster view yet (`cluster: null`): it
        // claims neither quorum nor a leader either.
        let no_claims = view.as_ref().is_ok_and(|a| {
            a.status == 200
                && (a.body["cluster"].is_null()
                    || (a.body["cluster"]["quorum"] == false
                        && a.body["cluster"]["leader"].is_null()))
        });
        if !(waiting && no_claims) {
            let state = m.state();
            panic!(
                "{what}: member 0 cut off, want /readyz 503 \"waiting…\" and no \
                 quorum or leader; got readyz {:?}, overview {:?}\n{state}",
                ready.map(|a| (a.status, a.body)),
                view.map(|a| (a.status, a.body["cluster"].clone()))
            );
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

fn scenario(net: &Net) {
    let secret_guard = secret("cut-off");
    let secret = secret_guard.0.as_path();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut members: Vec<Member> = (0..N).map(Member::new).collect();
    members[0].start(net, Seeds::None, 60_000, secret);
    wait_settled(&mut members, &[0], "cut-off: founding");
    for i in [1, 2] {
        members[i].start(net, Seeds::Others, 60_000, secret);
        wait_settled(
            &mut members,
            &(0..=i).collect::<Vec<_>>(),
            "cut-off: joining",
        );
    }
    rt.block_on(declare(&members[0].uri(), "before", false))
        .unwrap();

    // The founder stops, is cut off, and is started again with its founding
    // configuration (no seeds): it must wait, not found.
    members[0].kill();
    net.isolate(0);
    members[0].start(net, Seeds::None, 60_000, secret);
    assert_cut_off_waits(&mut members, "cut-off, no seeds", 3 * FAILURE_TIMEOUT);
    let refused = rt.block_on(declare(&members[0].uri(), "split", false));
    assert!(
        refused.is_err(),
        "cut-off: the cut-off founder took a declare"
    );
    // The majority goes on meanwhile.
    let deadline = Instant::now() + READY_LIMIT;
    loop {
        match rt.block_on(declare(&members[1].uri(), "during", false)) {
            Ok(()) => break,
            Err(e) if Instant::now() > deadline => {
                panic!("cut-off: the majority did not commit: {e}")
            }
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    }
    // Again as the configured founder whose seeds do not answer within its join timeout.
    members[0].start(net, Seeds::Others, 1_500, secret);
    assert_cut_off_waits(
        &mut members,
        "cut-off, founder with seeds",
        3 * FAILURE_TIMEOUT,
    );

    net.heal();
    wait_settled(&mut members, &[0, 1, 2], "cut-off: after healing");
    for name in ["before", "during"] {
        let found = rt.block_on(declare(&members[0].uri(), name, true));
        assert!(
            found.is_ok(),
            "cut-off: {name} on the rejoined founder: {found:?}"
        );
    }
    let split = rt.block_on(declare(&members[1].uri(), "split", true));
    assert!(
        split.is_err(),
        "cut-off: the declare sent to the cut-off founder reached the majority"
    );
}

#[test]
fn a_founder_restarted_while_cut_off_founds_nothing() {
    if !ringmq_tests::prereq::root_with(
        "the cut-off founder test",
        &[("ip", "iproute2"), ("nft", "nftables")],
    ) {
        return;
    }
    let net = Net::create("rmr", SUBNET, N);
    std::thread::scope(|s| {
        s.spawn(|| {
            net.enter_hub();
            scenario(&net);
        })
        .join()
        .expect("the scenario passes");
    });
}
