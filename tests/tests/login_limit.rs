//! Failed logins per source address: after the configured number of failures within the
//! window, the address is refused without a password check until the window ends — on the
//! AMQP port and the admin API alike.

use ringmq::client::{ClientError, RawClient, Target};
use ringmq_tests::Broker;
use std::time::{Duration, Instant};

async fn login(b: &Broker, password: &str) -> Result<(), ClientError> {
    let t = Target::parse(&format!("amqp://guest:{password}@{}/%2f", b.addr)).unwrap();
    RawClient::connect(&t).await.map(drop)
}

fn refusal(r: Result<(), ClientError>) -> String {
    match r {
        Err(ClientError::Closed {
            code: 403, text, ..
        }) => text,
        r => panic!("expected ACCESS_REFUSED, got {r:?}"),
    }
}

#[tokio::test]
async fn an_address_over_its_failure_budget_is_refused_until_the_window_ends() {
    let b = Broker::start_with_config("login_failures_max: 3\nlogin_failures_window_s: 3\n");
    let first_failure = Instant::now();
    for _ in 0..3 {
        let text = refusal(login(&b, "wrong").await);
        assert!(text.contains("Login was refused"), "{text}");
    }
    // The right password does not help now: it is not even checked.
    let text = refusal(login(&b, "guest").await);
    assert!(text.contains("too many failed logins"), "{text}");
    // The admin API shares the budget.
    let answer = b.admin_client().get("/api/overview").unwrap();
    assert_eq!(answer.status, 401);
    assert!(
        answer.reason().contains("too many failed logins"),
        "{answer:?}"
    );
    // Once the window that began with the first failure is over, the address may log in.
    let wait = Duration::from_secs(3).saturating_sub(first_failure.elapsed());
    tokio::time::sleep(wait + Duration::from_millis(200)).await;
    login(&b, "guest").await.expect("the window has passed");
    assert!(b.wait_for_log("too many failed logins", Duration::from_secs(1)));
}

#[tokio::test]
async fn failures_below_the_budget_do_not_lock_anyone_out() {
    let b = Broker::start_with_config("login_failures_max: 3\nlogin_failures_window_s: 60\n");
    for _ in 0..2 {
        refusal(login(&b, "wrong").await);
    }
    login(&b, "guest").await.unwrap();
    login(&b, "guest").await.unwrap();
}

#[tokio::test]
async fn zero_switches_the_limit_off() {
    let b = Broker::start_with_config("login_failures_max: 0\n");
    for _ in 0..20 {
        refusal(login(&b, "wrong").await);
    }
    login(&b, "guest").await.unwrap();
}
