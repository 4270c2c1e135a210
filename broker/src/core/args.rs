//! Queue arguments (`x-…`) parsed and validated once at declare time.

use super::error::{AmqpError, CoreResult};
use crate::amqp::{AMQPValue, FieldTable};

/// What happens when a length limit is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Overflow {
    /// Drop (and dead-letter) the oldest ready message.
    #[default]
    DropHead,
    /// Refuse the new message (publisher gets basic.nack under confirms).
    RejectPublish,
    /// Refuse the new message and dead-letter it.
    RejectPublishDlx,
}

/// The queue arguments the broker acts on.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct QueueArgs {
    /// `x-message-ttl`, ms.
    pub message_ttl_ms: Option<u64>,
    /// `x-expires`, ms of disuse after which the queue is deleted.
    pub expires_ms: Option<u64>,
    /// `x-max-length`, ready messages.
    pub max_length: Option<u64>,
    /// `x-max-length-bytes`, ready body bytes.
    pub max_length_bytes: Option<u64>,
    /// `x-overflow`.
    pub overflow: Overflow,
    /// `x-dead-letter-exchange`.
    pub dead_letter_exchange: Option<String>,
    /// `x-dead-letter-routing-key`.
    pub dead_letter_routing_key: Option<String>,
    /// `x-dead-letter-strategy` = `at-least-once`: a rejected message stays in the queue
    /// until its dead-lettered copy is safe in its target queues (`docs/proxies.md`,
    /// dead-lettering); the default, `at-most-once`, drops it as the copy leaves.
    pub dead_letter_at_least_once: bool,
    /// `x-max-priority` (0..=255); `None` means the queue ignores priorities.
    pub max_priority: Option<u8>,
    /// `x-single-active-consumer`.
    pub single_active_consumer: bool,
    /// `qpid.cluster.backups` ([`BACKUPS_ARGUMENT`]): how many backups a clustered queue
    /// keeps (0..=[`MAX_BACKUPS`]); `None` takes the member's `default_backups`.
    pub backups: Option<u8>,
    /// `qpid.cluster.fragmented` ([`super::fragments`]): the queue is one name over a
    /// fragment per cluster member.
    pub fragmented: bool,
    /// Set on a fragment: whose fragment of which fragmented queue it is.
    pub fragment: Option<super::fragments::FragmentOf>,
}

/// The declare argument naming how many backups a clustered queue keeps.
pub const BACKUPS_ARGUMENT: &str = "qpid.cluster.backups";

/// Most backups one queue may ask for: each costs a copy of every message and an ack on
/// every confirm, and three already survive more failures than a cluster's quorum allows.
pub const MAX_BACKUPS: u8 = 3;

/// Reads an integer field of any AMQP integer type.
pub fn int_value(v: &AMQPValue) -> Option<i64> {
    Some(match *v {
        AMQPValue::ShortShortInt(n) => n.into(),
        AMQPValue::ShortShortUInt(n) => n.into(),
        AMQPValue::ShortInt(n) => n.into(),
        AMQPValue::ShortUInt(n) => n.into(),
        AMQPValue::LongInt(n) => n.into(),
        AMQPValue::LongUInt(n) => n.into(),
        AMQPValue::LongLongInt(n) => n,
        AMQPValue::Timestamp(n) => i64::try_from(n).ok()?,
        _ => return None,
    })
}

/// Reads a string field (long or short string).
pub fn str_value(v: &AMQPValue) -> Option<String> {
    match v {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

impl QueueArgs {
    /// Parses and validates `arguments` of a queue.declare, failing the way RabbitMQ does
    /// (406 PRECONDITION_FAILED, naming the argument) on a wrong type or range.
    pub fn parse(arguments: &FieldTable, queue: &str, vhost: &str) -> CoreResult<Self> {
        let mut args = QueueArgs::default();
        for (key, value) in arguments.inner() {
            let key = key.as_str();
            let bad = |why: &str| {
                AmqpError::precondition(format!(
                    "invalid arg '{key}' for queue '{queue}' in vhost '{vhost}': {why}"
                ))
            };
            let non_negative = |v: &AMQPValue| match int_value(v) {
                Some(n) if n >= 0 => Ok(n as u64),
                Some(_) => Err(bad("value must not be negative")),
                None => Err(bad("value must be an integer")),
            };
            match key {
                "x-message-ttl" => args.message_ttl_ms = Some(non_negative(value)?),
                "x-expires" => {
                    let n = non_negative(value)?;
                    if n == 0 {
                        return Err(bad("value must be positive"));
                    }
                    args.expires_ms = Some(n);
                }
                "x-max-length" => args.max_length = Some(non_negative(value)?),
                "x-max-length-bytes" => args.max_length_bytes = Some(non_negative(value)?),
                "x-max-priority" => {
                    let n = non_negative(value)?;
                    if n > 255 {
                        return Err(bad("value must be at most 255"));
                    }
                    args.max_priority = Some(n as u8);
                }
                "x-overflow" => {
                    args.overflow = match str_value(value).as_deref() {
                        Some("drop-head") => Overflow::DropHead,
                        Some("reject-publish") => Overflow::RejectPublish,
                        Some("reject-publish-dlx") => Overflow::RejectPublishDlx,
                        _ => {
                            return Err(bad(
                                "expected 'drop-head', 'reject-publish' or 'reject-publish-dlx'",
                            ));
                        }
                    }
                }
                "x-dead-letter-exchange" => {
                    args.dead_letter_exchange =
                        Some(str_value(value).ok_or_else(|| bad("expected a string"))?)
                }
                "x-dead-letter-routing-key" => {
                    args.dead_letter_routing_key =
                        Some(str_value(value).ok_or_else(|| bad("expected a string"))?)
                }
                "x-dead-letter-strategy" => {
                    args.dead_letter_at_least_once = match str_value(value).as_deref() {
                        Some("at-least-once") => true,
                        Some("at-most-once") => false,
                        _ => return Err(bad("expected 'at-most-once' or 'at-least-once'")),
                    }
                }
                BACKUPS_ARGUMENT => {
                    let range =
                        || bad(&format!("value must be an integer from 0 to {MAX_BACKUPS}"));
                    let n = int_value(value).ok_or_else(range)?;
                    args.backups = Some(
                        u8::try_from(n)
                            .ok()
                            .filter(|n| *n <= MAX_BACKUPS)
                            .ok_or_else(range)?,
                    );
                }
                super::fragments::FRAGMENTED_ARGUMENT => {
                    args.fragmented = super::fragments::parse_fragmented(value).map_err(bad)?
                }
                "x-single-active-consumer" => {
                    args.single_active_consumer = match value {
                        AMQPValue::Boolean(b) => *b,
                        _ => return Err(bad("expected a boolean")),
                    }
                }
                _ => {}
            }
        }
        if args.dead_letter_routing_key.is_some() && args.dead_letter_exchange.is_none() {
            return Err(AmqpError::precondition(format!(
                "invalid arg 'x-dead-letter-routing-key' for queue '{queue}' in vhost '{vhost}': \
                 x-dead-letter-exchange must also be set"
            )));
        }
        args.fragment = super::fragments::fragment_of(queue, arguments);
        if args.fragmented {
            check_fragmented(&args, queue, vhost)?;
        }
        Ok(args)
    }
}

/// What a fragmented queue cannot have (406): a name too long for its fragments' names,
/// and the arguments that need one queue's view of its consumers or use
/// (`x-single-active-consumer`, `x-expires`), which fragments on several members lack.
fn check_fragmented(args: &QueueArgs, queue: &str, vhost: &str) -> CoreResult<()> {
    let why = if queue.len() > super::fragments::MAX_FRAGMENTED_NAME {
        format!(
            "a fragmented queue's name is at most {} bytes",
            super::fragments::MAX_FRAGMENTED_NAME
        )
    } else if args.single_active_consumer {
        "a fragmented queue has no single active consumer (its fragments are read on every member)"
            .to_owned()
    } else if args.expires_ms.is_some() {
        "a fragmented queue cannot expire (x-expires)".to_owned()
    } else {
        return Ok(());
    };
    Err(AmqpError::precondition(format!(
        "invalid arg '{}' for queue '{queue}' in vhost '{vhost}': {why}",
        super::fragments::FRAGMENTED_ARGUMENT
    )))
}

/// The consume argument `x-priority` (RabbitMQ's consumer priorities): any AMQP integer
/// that fits 32 bits, 0 when absent; anything else is 406 PRECONDITION_FAILED naming it, as
/// RabbitMQ answers.
pub fn consumer_priority(arguments: &FieldTable, queue: &str, vhost: &str) -> CoreResult<i32> {
    let Some(v) = arguments.inner().get("x-priority") else {
        return Ok(0);
    };
    int_value(v)
        .and_then(|n| i32::try_from(n).ok())
        .ok_or_else(|| {
            AmqpError::precondition(format!(
                "invalid arg 'x-priority' for consumer of queue '{queue}' in vhost '{vhost}': \
                 {v:?} is not a 32-bit integer"
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_consumer_priority_is_any_32_bit_integer_and_anything_else_is_refused() {
        assert_eq!(consumer_priority(&table(&[]), "q", "/"), Ok(0));
        for (v, want) in [
            (AMQPValue::ShortShortInt(-3), -3),
            (AMQPValue::ShortInt(10), 10),
            (AMQPValue::LongLongInt(7), 7),
        ] {
            let t = table(&[("x-priority", v)]);
            assert_eq!(consumer_priority(&t, "q", "/"), Ok(want));
        }
        for v in [
            AMQPValue::LongString("10".into()),
            AMQPValue::LongLongInt(1 << 40),
        ] {
            let e = consumer_priority(&table(&[("x-priority", v)]), "q", "/").unwrap_err();
            assert_eq!(e.code, crate::amqp::codes::PRECONDITION_FAILED);
            assert!(e.text.contains("x-priority"), "{e:?}");
        }
    }

    fn table(pairs: &[(&str, AMQPValue)]) -> FieldTable {
        let mut t = FieldTable::default();
        for (k, v) in pairs {
            t.insert((*k).into(), v.clone());
        }
        t
    }

    #[test]
    fn parses_every_supported_argument() {
        let args = QueueArgs::parse(
            &table(&[
                ("x-message-ttl", AMQPValue::LongInt(1000)),
                ("x-expires", AMQPValue::LongLongInt(5000)),
                ("x-max-length", AMQPValue::ShortInt(10)),
                ("x-max-length-bytes", AMQPValue::LongUInt(4096)),
                ("x-overflow", AMQPValue::LongString("reject-publish".into())),
                (
                    "x-dead-letter-exchange",
                    AMQPValue::LongString("dlx".into()),
                ),
                (
                    "x-dead-letter-routing-key",
                    AMQPValue::LongString("dead".into()),
                ),
                ("x-max-priority", AMQPValue::ShortShortUInt(9)),
                ("x-single-active-consumer", AMQPValue::Boolean(true)),
                (
                    "x-dead-letter-strategy",
                    AMQPValue::LongString("at-least-once".into()),
                ),
            ]),
            "q",
            "/",
        )
        .unwrap();
        assert!(args.dead_letter_at_least_once);
        assert_eq!(args.message_ttl_ms, Some(1000));
        assert_eq!(args.expires_ms, Some(5000));
        assert_eq!(args.max_length, Some(10));
        assert_eq!(args.max_length_bytes, Some(4096));
        assert_eq!(args.overflow, Overflow::RejectPublish);
        assert_eq!(args.dead_letter_exchange.as_deref(), Some("dlx"));
        assert_eq!(args.dead_letter_routing_key.as_deref(), Some("dead"));
        assert_eq!(args.max_priority, Some(9));
        assert!(args.single_active_consumer);
    }

    #[test]
    fn refuses_bad_values_with_precondition_failed() {
        for bad in [
            table(&[("x-message-ttl", AMQPValue::LongInt(-1))]),
            table(&[("x-expires", AMQPValue::LongInt(0))]),
            table(&[("x-max-priority", AMQPValue::LongInt(256))]),
            table(&[("x-overflow", AMQPValue::LongString("nope".into()))]),
            table(&[("x-max-length", AMQPValue::LongString("10".into()))]),
            table(&[(
                "x-dead-letter-routing-key",
                AMQPValue::LongString("k".into()),
            )]),
            table(&[(BACKUPS_ARGUMENT, AMQPValue::LongInt(4))]),
            table(&[(BACKUPS_ARGUMENT, AMQPValue::LongInt(-1))]),
            table(&[(
                "x-dead-letter-strategy",
                AMQPValue::LongString("exactly-once".into()),
            )]),
        ] {
            let err = QueueArgs::parse(&bad, "q", "/").unwrap_err();
            assert_eq!(err.code, 406, "{err}");
        }
    }

    #[test]
    fn backups_take_any_integer_type_from_0_to_3_and_name_the_argument_otherwise() {
        for (value, want) in [
            (AMQPValue::ShortShortUInt(0), 0),
            (AMQPValue::ShortInt(1), 1),
            (AMQPValue::LongUInt(2), 2),
            (AMQPValue::LongLongInt(3), 3),
        ] {
            let args = QueueArgs::parse(&table(&[(BACKUPS_ARGUMENT, value)]), "q", "/").unwrap();
            assert_eq!(args.backups, Some(want));
        }
        assert_eq!(
            QueueArgs::parse(&table(&[]), "q", "/").unwrap().backups,
            None
        );
        for bad in [
            AMQPValue::LongInt(4),
            AMQPValue::ShortShortInt(-1),
            AMQPValue::LongString("2".into()),
        ] {
            let err = QueueArgs::parse(&table(&[(BACKUPS_ARGUMENT, bad)]), "q", "/").unwrap_err();
            assert_eq!(err.code, 406);
            assert!(
                err.text.contains("'qpid.cluster.backups'") && err.text.contains("from 0 to 3"),
                "{}",
                err.text
            );
        }
    }
}
