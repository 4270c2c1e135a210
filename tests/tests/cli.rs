//! The command-line contracts: `ringmq-broker` options and errors, `ringmqctl bench`, and a
//! client in another language (pika) against the broker.

use ringmq_tests::{Broker, binary};
use std::process::Command;

#[test]
fn broker_help_documents_the_contract_options() {
    let out = Command::new(binary("ringmq-broker"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    for opt in ["--amqp-listen", "--data-dir", "--config", "--log-format"] {
        assert!(help.contains(opt), "--help lacks {opt}:\n{help}");
    }
}

#[test]
fn a_broken_config_file_is_refused_with_a_message_naming_it() {
    let dir = std::env::temp_dir().join(format!("ringmq-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("bad.yaml");
    std::fs::write(&config, "amqp_lisen: 127.0.0.1:1\n").unwrap();
    let out = Command::new(binary("ringmq-broker"))
        .arg("--config")
        .arg(&config)
        .arg("--data-dir")
        .arg(dir.join("data"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("bad.yaml") && err.contains("amqp_lisen"),
        "{err}"
    );
    std::fs::write(&config, "frame_max: 10\n").unwrap();
    let out = Command::new(binary("ringmq-broker"))
        .arg("--config")
        .arg(&config)
        .arg("--data-dir")
        .arg(dir.join("data"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("frame_max"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `ringmqctl bench --uri URI ARGS…`, run to its end.
fn bench(uri: &str, args: &[&str]) -> std::process::Output {
    Command::new(binary("ringmqctl"))
        .args(["bench", "--uri", uri])
        .args(args)
        .output()
        .unwrap()
}

/// The JSON object a successful `bench --json` ends its output with.
fn bench_json(out: std::process::Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
}

#[test]
fn bench_reports_json_with_rates_and_latency() {
    let b = Broker::start();
    let v = bench_json(bench(
        &b.uri(),
        &[
            "--seconds",
            "1",
            "--size",
            "100",
            "--confirm",
            "50",
            "--json",
        ],
    ));
    assert!(v["published_per_sec"].as_f64().unwrap() > 0.0, "{v}");
    assert!(v["consumed_per_sec"].as_f64().unwrap() > 0.0, "{v}");
    assert!(v["latency_us"]["p50"].as_u64().unwrap() <= v["latency_us"]["p99"].as_u64().unwrap());
}

#[test]
fn bench_at_a_fixed_rate_publishes_on_schedule_and_refuses_a_rate_of_zero() {
    let b = Broker::start();
    let at = |rate: &str| {
        bench(
            &b.uri(),
            &[
                "--seconds",
                "2",
                "--size",
                "16",
                "--rate",
                rate,
                "--confirm",
                "100",
                "--json",
            ],
        )
    };
    let v = bench_json(at("200"));
    // Two seconds at 200 a second: never ahead of the schedule, and not far behind it.
    let published = v["published"].as_u64().unwrap();
    assert!((100..=401).contains(&published), "{v}");
    assert_eq!(v["rate"], 200, "{v}");
    assert!(v["latency_us"]["samples"].as_u64().unwrap() > 0, "{v}");

    let out = at("0");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--rate"), "{err}");

    let out = bench(&b.uri(), &["--seconds", "1", "--rate", "100", "--failover"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--rate is for the raw clients"), "{err}");
}

#[test]
fn bench_declares_its_queue_with_the_arguments_given_as_json() {
    let b = Broker::start();
    let with_args = |args: &str| {
        bench(
            &b.uri(),
            &[
                "--seconds",
                "1",
                "--queue",
                "bench-args",
                "--queue-args",
                args,
            ],
        )
    };
    let out = with_args(r#"{"x-max-length": 5, "x-overflow": "drop-head"}"#);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let q = b.admin_client().get("/api/queues/%2f/bench-args").unwrap();
    assert_eq!(q.status, 200, "{}", q.body);
    assert_eq!(q.body["arguments"]["x-max-length"], 5, "{}", q.body);
    assert_eq!(q.body["arguments"]["x-overflow"], "drop-head", "{}", q.body);

    let out = with_args("{not json");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--queue-args is not JSON"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn bench_spreads_producers_and_consumers_over_several_queues() {
    let b = Broker::start();
    let v = bench_json(bench(
        &b.uri(),
        &[
            "--seconds",
            "1",
            "--producers",
            "4",
            "--consumers",
            "0",
            "--queues",
            "2",
            "--queue",
            "bench-multi",
            "--count",
            "10",
            "--confirm",
            "10",
            "--json",
        ],
    ));
    assert_eq!(v["queues"], 2, "{v}");
    // Producers 0 and 2 publish to bench-multi-0, 1 and 3 to bench-multi-1: ten each.
    for name in ["bench-multi-0", "bench-multi-1"] {
        let q = b
            .admin_client()
            .get(&format!("/api/queues/%2f/{name}"))
            .unwrap();
        assert_eq!(q.status, 200, "{}", q.body);
        assert_eq!(q.body["messages_ready"], 20, "{name}: {}", q.body);
    }
    let v = bench_json(bench(
        &b.uri(),
        &[
            "--seconds",
            "1",
            "--producers",
            "3",
            "--consumers",
            "3",
            "--queues",
            "3",
            "--json",
        ],
    ));
    assert!(v["consumed_per_sec"].as_f64().unwrap() > 0.0, "{v}");
    let out = bench(
        &b.uri(),
        &[
            "--seconds",
            "1",
            "--producers",
            "4",
            "--consumers",
            "2",
            "--queues",
            "4",
        ],
    );
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("some queues would fill"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = bench(&b.uri(), &["--seconds", "1", "--queues", "0"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--queues"));
    let out = bench(&b.uri(), &["--seconds", "1", "--queues", "2", "--failover"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--queues"));
}

/// The consumers stop at `--seconds` even when their read buffer never runs dry: a read of a
/// frame already buffered never waits, so a timeout around it never fired, and against
/// `ringmqctl sink` (which feeds consumers without end) the tool ran on forever.
#[test]
fn bench_consumers_stop_on_time_against_an_endless_feed() {
    use std::io::BufRead;
    use std::time::{Duration, Instant};
    let mut sink = Command::new(binary("ringmqctl"))
        .args(["sink", "--listen", "127.0.0.1:0", "--size", "16"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(sink.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line.trim().rsplit("amqp=").next().unwrap().to_owned();
    let mut run = Command::new(binary("ringmqctl"))
        .args(["bench", "--uri", &format!("amqp://guest:guest@{addr}/%2f")])
        .args([
            "--producers",
            "0",
            "--size",
            "16",
            "--seconds",
            "1",
            "--json",
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let finished = loop {
        if run.try_wait().unwrap().is_some() {
            break true;
        }
        if started.elapsed() > Duration::from_secs(30) {
            let _ = run.kill();
            break false;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = sink.kill();
    let _ = sink.wait();
    assert!(finished, "bench --seconds 1 still running after 30 s");
    let v = bench_json(run.wait_with_output().unwrap());
    assert!(v["consumed"].as_u64().unwrap() > 0, "{v}");
}

#[test]
fn bench_against_no_broker_fails_with_a_reason() {
    let out = bench("amqp://guest:guest@127.0.0.1:1/%2f", &["--seconds", "1"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot connect"));
}

#[test]
fn pika_works_unchanged() {
    let python = ringmq_tests::prereq::python_with("pika", "pika");
    let b = Broker::start();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/clients/pika_compat.py");
    let out = Command::new(&python)
        .arg(script)
        .arg(b.addr.port().to_string())
        .output()
        .unwrap_or_else(|e| panic!("{python} {script}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.trim_end().ends_with("ok"),
        "pika script failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The environment contract the operator's StatefulSet relies on: the node id and a default
/// administrator from a Kubernetes Secret.
#[test]
fn node_id_and_default_user_come_from_the_environment() {
    use std::io::BufRead;
    let dir = std::env::temp_dir().join(format!("ringmq-env-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut child = Command::new(binary("ringmq-broker"))
        .args([
            "--amqp-listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--data-dir",
        ])
        .arg(&dir)
        .env("RINGMQ_NODE_ID", "ringmq-3")
        .env("RINGMQ_DEFAULT_USER", "ops")
        .env("RINGMQ_DEFAULT_PASS", "from-a-secret")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let _amqp = lines.next().unwrap().unwrap();
    let admin = lines.next().unwrap().unwrap();
    let admin = admin
        .strip_prefix("ringmq-broker listening admin=")
        .unwrap()
        .to_owned();
    let client = ringmq::admin_client::AdminClient::new(
        &format!("http://{admin}"),
        Some("ops"),
        Some("from-a-secret"),
    );
    let overview = client.get("/api/overview").unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(overview.status, 200, "{overview:?}");
    assert_eq!(overview.body["node"], "ringmq-3", "{}", overview.body);
}
