//! What the admin tests share: calls with expected statuses, metric samples, waiting, RabbitMQ's
//! password hash.

use ringmq::admin_client::AdminClient;
use ringmq::admin_client::Answer;
use ringmq_tests::Broker;
use serde_json::Value;
use std::time::Duration;
use std::time::Instant;

pub(crate) fn call(c: &AdminClient, method: &str, path: &str, body: Option<Value>) -> Answer {
    c.call(method, path, body.as_ref())
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

pub(crate) fn expect(
    c: &AdminClient,
    method: &str,
    path: &str,
    body: Option<Value>,
    status: u16,
) -> Value {
    let a = call(c, method, path, body);
    assert_eq!(
        a.status, status,
        "{method} {path} answered {}: {}",
        a.status, a.body
    );
    a.body
}

/// Asserts an error answer is JSON with `error` and a non-empty `reason`.
pub(crate) fn expect_error(
    c: &AdminClient,
    method: &str,
    path: &str,
    body: Option<Value>,
    status: u16,
    error: &str,
) {
    let v = expect(c, method, path, body, status);
    assert_eq!(v["error"], error, "{method} {path}: {v}");
    assert!(
        v["reason"].as_str().is_some_and(|r| !r.is_empty()),
        "{method} {path}: {v}"
    );
}

/// The value of one sample line `name{labels} value` (or `name value`) in an exposition.
pub(crate) fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (name, value) = l.rsplit_once(' ')?;
        (name == series).then(|| value.parse().ok())?
    })
}

pub(crate) fn metric(b: &Broker, series: &str) -> f64 {
    let text = b.admin_client().get("/metrics/detailed").unwrap().body;
    sample(text.as_str().unwrap(), series)
        .unwrap_or_else(|| panic!("{series} missing from:\n{text}"))
}

/// Waits (bounded) until `f` holds.
pub(crate) fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// RabbitMQ's rabbit_password_hashing_sha256: base64(salt ‖ sha256(salt ‖ password)),
/// computed here independently of the broker's code.
pub(crate) fn rabbit_hash(salt: [u8; 4], password: &str) -> String {
    use base64::Engine;
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    h.update(salt);
    h.update(password.as_bytes());
    let mut raw = salt.to_vec();
    raw.extend_from_slice(&h.finalize());
    base64::engine::general_purpose::STANDARD.encode(raw)
}
