//! The floor under `ringmqctl bench --rate`'s latency on this machine: the same two loopback
//! hops (producer → relay → consumer) with nothing in the middle but a blocking read and a
//! write. What a broker adds to a message's publish-to-delivery time is its figure minus
//! this one. Built and run by `scripts/measure-loopback-floor.sh`; std only, so it compiles
//! with `rustc` alone in a second.
//!
//!   loopback_floor relay ADDR              accept a producer, then a consumer; copy bytes
//!   loopback_floor client ADDR COUNT RATE  send COUNT 16-byte stamps at RATE per second
//!                                          through the relay; print p50/p90/p99/p99.9

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: loopback_floor relay ADDR | client ADDR COUNT RATE";
    match (args.get(1).map(String::as_str), args.len()) {
        (Some("relay"), 3) => relay(&args[2]),
        (Some("client"), 5) => {
            let count = args[3].parse().expect(usage);
            let rate = args[4].parse().expect(usage);
            client(&args[2], count, rate)
        }
        _ => {
            eprintln!("{usage}");
            std::process::exit(2);
        }
    }
}

/// Copies what the first connection sends to the second, until the first closes.
fn relay(addr: &str) {
    let listener = TcpListener::bind(addr).expect("bind");
    let (mut from, _) = listener.accept().expect("accept the producer");
    let (mut to, _) = listener.accept().expect("accept the consumer");
    from.set_nodelay(true).unwrap();
    to.set_nodelay(true).unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => to.write_all(&buf[..n]).expect("write to the consumer"),
        }
    }
}

/// Sends `count` stamps at `rate` per second on one connection, reads them back on another
/// (a thread of its own, as a consumer), and prints the latency percentiles.
fn client(addr: &str, count: usize, rate: u64) {
    let mut producer = TcpStream::connect(addr).expect("connect the producer");
    std::thread::sleep(Duration::from_millis(50));
    let mut consumer = TcpStream::connect(addr).expect("connect the consumer");
    producer.set_nodelay(true).unwrap();
    let base = Instant::now();
    let reader = std::thread::spawn(move || {
        let mut latencies = Vec::with_capacity(count);
        let mut stamp = [0u8; 16];
        for _ in 0..count {
            consumer.read_exact(&mut stamp).expect("read a stamp");
            let sent = u64::from_le_bytes(stamp[..8].try_into().unwrap());
            latencies.push(base.elapsed().as_nanos() as u64 - sent);
        }
        latencies
    });
    let interval = Duration::from_nanos(1_000_000_000 / rate.max(1));
    let mut next = Instant::now();
    for _ in 0..count {
        next += interval;
        if let Some(wait) = next.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let mut stamp = [0u8; 16];
        stamp[..8].copy_from_slice(&(base.elapsed().as_nanos() as u64).to_le_bytes());
        producer.write_all(&stamp).expect("send a stamp");
    }
    let mut latencies = reader.join().expect("the reader");
    latencies.sort_unstable();
    let at =
        |q: f64| latencies[((latencies.len() as f64 * q) as usize).min(latencies.len() - 1)] / 1000;
    println!(
        "n={} p50={}us p90={}us p99={}us p99.9={}us",
        latencies.len(),
        at(0.5),
        at(0.9),
        at(0.99),
        at(0.999)
    );
}
