//! The connection state machine under random input: after a valid handshake, frames with
//! real class and method ids and random arguments, content frames, heartbeats and junk. The
//! broker may close the connection, but only with a reply code the spec names; it must stay
//! up, and a well-behaved client beside it must keep its messages.

use lapin::BasicProperties;
use lapin::options::*;
use lapin::types::FieldTable;
use ringmq::client::{ClientError, RawClient, Target};
use ringmq_tests::{Broker, frame};
use std::time::Duration;
use tokio::io::AsyncWriteExt;

const SPEC_CODES: &[u16] = &[
    320, 402, 403, 404, 405, 406, 501, 502, 503, 504, 505, 506, 530, 540, 541,
];

#[tokio::test]
async fn random_frames_after_the_handshake_never_take_the_broker_down() {
    let cases: u64 = std::env::var("RINGMQ_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let seed: u64 = std::env::var("RINGMQ_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5eed);
    eprintln!("connection fuzz seed {seed} (RINGMQ_FUZZ_SEED to replay), {cases} cases");
    let mut rng = seed | 1;
    let mut rand = move |bound: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % bound.max(1)
    };
    let mut b = Broker::start();
    let bystander = b.connect().await;
    let ch = bystander.create_channel().await.unwrap();
    ch.queue_declare(
        "kept".into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    for i in 0..10u8 {
        ch.basic_publish(
            "".into(),
            "kept".into(),
            BasicPublishOptions::default(),
            &[i],
            BasicProperties::default(),
        )
        .await
        .unwrap();
    }
    let target = Target::parse(&b.uri()).unwrap();
    let ids: &[(u16, u16)] = &[
        (10, 50),
        (20, 10),
        (20, 20),
        (20, 40),
        (40, 10),
        (40, 20),
        (40, 30),
        (50, 10),
        (50, 20),
        (50, 30),
        (50, 40),
        (60, 10),
        (60, 20),
        (60, 30),
        (60, 40),
        (60, 70),
        (60, 80),
        (60, 90),
        (60, 110),
        (60, 120),
        (85, 10),
        (90, 10),
        (90, 20),
        (90, 30),
    ];
    for case in 0..cases {
        let mut c = RawClient::connect(&target).await.unwrap();
        let mut out = Vec::new();
        for _ in 0..(1 + rand(20)) {
            let channel = [1u16, 1, 1, 2, 0][rand(5) as usize];
            match rand(6) {
                0..=2 => {
                    let (class, method) = ids[rand(ids.len() as u64) as usize];
                    let mut p = class.to_be_bytes().to_vec();
                    p.extend_from_slice(&method.to_be_bytes());
                    for _ in 0..rand(40) {
                        p.push(rand(256) as u8);
                    }
                    out.extend(frame(1, channel, &p));
                }
                3 => {
                    let mut p = vec![0, 60, 0, 0];
                    p.extend_from_slice(&rand(64).to_be_bytes());
                    for _ in 0..rand(10) {
                        p.push(rand(256) as u8);
                    }
                    out.extend(frame(2, channel, &p));
                }
                4 => out.extend(frame(3, channel, &vec![7u8; rand(64) as usize])),
                _ => out.extend(frame(8, 0, &[])),
            }
        }
        if c.stream.write_all(&out).await.is_err() {
            continue;
        }
        let outcome = tokio::time::timeout(Duration::from_millis(300), async {
            loop {
                match c.read_method().await {
                    Ok(_) => continue,
                    Err(e) => return e,
                }
            }
        })
        .await;
        if let Ok(ClientError::Closed { code, text, .. }) = outcome {
            assert!(
                SPEC_CODES.contains(&code),
                "case {case}: close with code {code} ({text}) is not a spec code"
            );
        }
        assert!(
            b.is_running(),
            "case {case} (seed {seed}) took the broker down"
        );
        assert!(
            !b.wait_for_log("panicked", Duration::ZERO),
            "case {case} (seed {seed}) panicked a connection task"
        );
    }
    let ch = bystander
        .create_channel()
        .await
        .expect("the bystander's connection survived");
    let q = ch
        .queue_declare(
            "kept".into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    assert_eq!(q.message_count(), 10);
}
