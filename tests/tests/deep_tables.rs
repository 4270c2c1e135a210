//! A field table nested thousands of levels deep must not overflow the decoder's stack.

use ringmq::client::{ClientError, RawClient, Target};
use ringmq_tests::{Broker, frame};
use std::time::Duration;
use tokio::io::AsyncWriteExt;

/// A field table value nested `depth` levels: { "a": { "a": { ... } } }.
fn nested_table(depth: usize) -> Vec<u8> {
    // Build from the inside out: an empty table, then wrap it depth times.
    let mut inner: Vec<u8> = 0u32.to_be_bytes().to_vec();
    for _ in 0..depth {
        let mut entry = vec![1u8, b'a', b'F'];
        entry.extend_from_slice(&inner);
        let mut table = (entry.len() as u32).to_be_bytes().to_vec();
        table.extend(entry);
        inner = table;
    }
    inner
}

#[tokio::test]
async fn a_deeply_nested_field_table_is_refused_without_crashing() {
    let mut b = Broker::start();
    let target = Target::parse(&b.uri()).unwrap();
    let mut c = RawClient::connect(&target).await.unwrap();
    // queue.declare with the nested table as its arguments.
    let mut payload = vec![0, 50, 0, 10, 0, 0, 1, b'q', 0];
    payload.extend(nested_table(15_000));
    c.stream.write_all(&frame(1, 1, &payload)).await.unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(5), c.read_method())
        .await
        .expect("an answer");
    assert!(
        matches!(answer, Err(ClientError::Closed { code: 502, .. })),
        "{answer:?}"
    );
    assert!(b.is_running(), "the broker died on a deeply nested table");

    // The same in message headers: a content header whose headers table nests 15,000 deep.
    let mut c = RawClient::connect(&target).await.unwrap();
    let mut out = Vec::new();
    ringmq::client::encode_publish(&mut out, 1, "", "q", false, b"", c.frame_max);
    let publish_len = 8 + u32::from_be_bytes(out[3..7].try_into().unwrap()) as usize;
    out.truncate(publish_len);
    let mut header = vec![0, 60, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x20, 0x00];
    header.extend(nested_table(15_000));
    out.extend(frame(2, 1, &header));
    c.stream.write_all(&out).await.unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(5), c.read_method())
        .await
        .expect("an answer");
    assert!(
        matches!(answer, Err(ClientError::Closed { code: 502, .. })),
        "{answer:?}"
    );
    assert!(b.is_running(), "the broker died on deeply nested headers");
    let (_conn, ch) = b.channel().await;
    ch.queue_declare("after".into(), Default::default(), Default::default())
        .await
        .unwrap();
}
