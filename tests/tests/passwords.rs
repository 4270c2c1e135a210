//! Stored passwords: PBKDF2 for everything the broker hashes, `password_hash:` in the
//! config, `ringmqctl hash-password`, and the verification cache that keeps logins fast.

use ringmq::client::{ClientError, RawClient, Target};
use ringmq_tests::{Broker, binary};
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn target(b: &Broker, user: &str, password: &str) -> Target {
    Target::parse(&format!("amqp://{user}:{password}@{}/%2f", b.addr)).unwrap()
}

async fn login(b: &Broker, user: &str, password: &str) -> Result<(), ClientError> {
    RawClient::connect(&target(b, user, password))
        .await
        .map(drop)
}

fn hash_password(args: &[&str], stdin: Option<&str>) -> String {
    let mut child = Command::new(binary("ringmqctl"))
        .arg("hash-password")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    if let Some(text) = stdin {
        input.write_all(text.as_bytes()).unwrap();
    }
    drop(input);
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

#[tokio::test]
async fn config_passwords_are_stored_as_pbkdf2_and_exported_so() {
    let b = Broker::start_with_config(
        "password_hash_iterations: 2000\nusers:\n  - name: guest\n    password: guest\n    tags: [administrator]\n  - name: app\n    password: s3cret\n",
    );
    login(&b, "app", "s3cret").await.unwrap();
    assert!(login(&b, "app", "guest").await.is_err());
    let defs = b.admin_client().get("/api/definitions").unwrap().body;
    let app = defs["users"]
        .as_array()
        .unwrap()
        .iter()
        .find(|u| u["name"] == "app")
        .unwrap()
        .clone();
    assert_eq!(app["hashing_algorithm"], "ringmq_pbkdf2_sha256");
    let hash = app["password_hash"].as_str().unwrap();
    assert!(hash.starts_with("$pbkdf2-sha256$i=2000$"), "{hash}");
    assert!(!defs.to_string().contains("s3cret"));
    // The export imports back into another broker and the password still works there.
    let other = Broker::start();
    let answer = other
        .admin_client()
        .call("POST", "/api/definitions", Some(&defs))
        .unwrap();
    assert!(answer.status < 300, "{answer:?}");
    login(&other, "app", "s3cret").await.unwrap();
}

#[tokio::test]
async fn a_config_user_may_give_a_hash_printed_by_ringmqctl() {
    let hash = hash_password(&["--iterations", "3000", "from-ctl"], None);
    assert!(hash.starts_with("$pbkdf2-sha256$i=3000$"), "{hash}");
    let b = Broker::start_with_config(&format!(
        "users:\n  - name: ops\n    password_hash: \"{hash}\"\n"
    ));
    login(&b, "ops", "from-ctl").await.unwrap();
    match login(&b, "ops", "from-ctx").await {
        Err(ClientError::Closed { code, .. }) => assert_eq!(code, 403),
        r => panic!("expected 403, got {r:?}"),
    }
}

#[test]
fn hash_password_reads_stdin_and_defaults_to_600000_iterations() {
    let hash = hash_password(&[], Some("typed-in\n"));
    assert!(hash.starts_with("$pbkdf2-sha256$i=600000$"), "{hash}");
    let again = hash_password(&[], Some("typed-in\n"));
    assert_ne!(hash, again, "each hash has its own salt");
}

#[test]
fn a_config_user_with_both_or_neither_password_is_refused_at_start() {
    for user in [
        "  - name: a\n    password: x\n    password_hash: \"\"\n",
        "  - name: a\n",
        "  - name: a\n    password_hash: \"$pbkdf2-sha256$i=1$AAAA$AAAA\"\n",
    ] {
        let dir = std::env::temp_dir().join(format!("ringmq-pw-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("bad.yaml");
        std::fs::write(&config, format!("users:\n{user}")).unwrap();
        let out = Command::new(binary("ringmq-broker"))
            .args([
                "--amqp-listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
            ])
            .arg("--data-dir")
            .arg(dir.join("data"))
            .arg("--config")
            .arg(&config)
            .output()
            .unwrap();
        assert!(!out.status.success(), "started with {user:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("user 'a'"),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// A cold login pays the full PBKDF2 cost; a repeated one with the same password is
/// answered from the verification cache.
#[tokio::test]
async fn a_repeated_login_skips_the_slow_hash() {
    let b = Broker::start_with_config(
        "password_hash_iterations: 200000\nusers:\n  - name: app\n    password: s3cret\n",
    );
    let timed = |b: &Broker| {
        let t = target(b, "app", "s3cret");
        async move {
            let start = Instant::now();
            RawClient::connect(&t).await.unwrap();
            start.elapsed()
        }
    };
    let cold = timed(&b).await;
    let mut warm = Duration::MAX;
    for _ in 0..5 {
        warm = warm.min(timed(&b).await);
    }
    println!("login: cold {cold:?}, warm {warm:?}");
    assert!(
        warm * 5 < cold,
        "cold {cold:?} should be far slower than warm {warm:?}"
    );
    // A wrong password is never cached: it costs the full hash every time.
    let start = Instant::now();
    assert!(login(&b, "app", "wrong").await.is_err());
    assert!(start.elapsed() > warm * 5);
}
