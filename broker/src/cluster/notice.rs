//! Client-visible membership: the `amq.qpid` exchange and its notices. On every membership
//! change each member publishes, in each of its vhosts, a message with an empty body and the
//! header `qpid.known.hosts` (the AMQP addresses of the live members) with routing key
//! `cluster`, so a client that bound a queue there learns its failover candidates.

use crate::amqp::{AMQPValue, FieldArray, FieldTable, Properties, ShortString};
use crate::core::exchange::ExchangeKind;
use crate::core::{Effects, Message, VHost};
use bytes::Bytes;
use std::sync::Arc;

/// The exchange the notices go to (a topic exchange: bind with `cluster` or `#`).
pub const NOTICE_EXCHANGE: &str = "amq.qpid";
/// Routing key of the notices.
pub const NOTICE_ROUTING_KEY: &str = "cluster";
/// Header carrying the list of AMQP addresses.
pub const KNOWN_HOSTS_HEADER: &str = "qpid.known.hosts";

/// Makes sure `amq.qpid` exists in `v` (every vhost of a clustered broker has it).
pub fn ensure_exchange(v: &mut VHost) {
    v.ensure_system_exchange(NOTICE_EXCHANGE, ExchangeKind::Topic);
}

/// Publishes the notice for `hosts` into `v`'s `amq.qpid`.
pub fn publish(v: &mut VHost, hosts: &[String], now_ms: u64, fx: &mut Effects) {
    ensure_exchange(v);
    let mut list = FieldArray::default();
    for h in hosts {
        list.push(AMQPValue::LongString(h.as_str().into()));
    }
    let mut headers = FieldTable::default();
    headers.insert(KNOWN_HOSTS_HEADER.into(), AMQPValue::FieldArray(list));
    let message = Message::authored(
        ShortString::from(NOTICE_EXCHANGE),
        ShortString::from(NOTICE_ROUTING_KEY),
        Properties::default().with_headers(headers),
        Bytes::new(),
    );
    // The exchange exists and is not internal, so publishing cannot fail.
    let _ = v.publish(
        NOTICE_EXCHANGE,
        NOTICE_ROUTING_KEY,
        Arc::new(message),
        now_ms,
        fx,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::QueueDeclare;

    #[test]
    fn a_queue_bound_to_amq_qpid_receives_the_host_list() {
        let mut v = VHost::new("/", 1);
        ensure_exchange(&mut v);
        v.queue_declare(
            1,
            QueueDeclare {
                name: "hosts".into(),
                ..Default::default()
            },
            0,
        )
        .unwrap();
        v.queue_bind(1, "hosts", NOTICE_EXCHANGE, "#", FieldTable::default())
            .unwrap();
        publish(
            &mut v,
            &["127.0.0.1:1".into(), "127.0.0.1:2".into()],
            0,
            &mut Effects::default(),
        );
        assert_eq!(v.queue("hosts").unwrap().ready_count(), 1);
    }
}
