//! AMQP field tables ↔ JSON, and the naming rules the management API shares with RabbitMQ's
//! (binding properties keys).

use crate::amqp::{AMQPValue, FieldArray, FieldTable, ShortString};
use serde_json::{Map, Number, Value};

/// How deep nested arrays and tables in an `arguments` object may go.
const MAX_DEPTH: usize = 16;

/// An `arguments` JSON object as a field table: integers become signed 64-bit, other numbers
/// doubles, strings long strings, objects tables. `Err` names the key that cannot be
/// converted.
pub fn table_from_json(v: &Value) -> Result<FieldTable, String> {
    match v {
        Value::Null => Ok(FieldTable::default()),
        Value::Object(m) => table_from_map(m, 0),
        _ => Err("arguments must be a JSON object".into()),
    }
}

fn table_from_map(m: &Map<String, Value>, depth: usize) -> Result<FieldTable, String> {
    let mut t = FieldTable::default();
    for (k, v) in m {
        let key = ShortString::try_new(k.clone())
            .map_err(|_| format!("argument name '{k}' is longer than 255 bytes"))?;
        t.insert(
            key,
            value_from_json(v, depth + 1).map_err(|e| format!("{k}: {e}"))?,
        );
    }
    Ok(t)
}

fn value_from_json(v: &Value, depth: usize) -> Result<AMQPValue, String> {
    if depth > MAX_DEPTH {
        return Err(format!("nested deeper than {MAX_DEPTH} levels"));
    }
    Ok(match v {
        Value::Null => AMQPValue::Void,
        Value::Bool(b) => AMQPValue::Boolean(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => AMQPValue::LongLongInt(i),
            None => AMQPValue::Double(n.as_f64().ok_or("number out of range")?),
        },
        Value::String(s) => AMQPValue::LongString(s.as_str().into()),
        Value::Array(a) => AMQPValue::FieldArray(FieldArray::from(
            a.iter()
                .map(|x| value_from_json(x, depth + 1))
                .collect::<Result<Vec<_>, _>>()?,
        )),
        Value::Object(m) => AMQPValue::FieldTable(table_from_map(m, depth)?),
    })
}

/// A field table as a JSON object.
pub fn table_to_json(t: &FieldTable) -> Value {
    Value::Object(
        t.inner()
            .iter()
            .map(|(k, v)| (k.as_str().to_owned(), value_to_json(v)))
            .collect(),
    )
}

fn value_to_json(v: &AMQPValue) -> Value {
    let int = |i: i64| Value::Number(i.into());
    match v {
        AMQPValue::Boolean(b) => Value::Bool(*b),
        AMQPValue::ShortShortInt(i) => int(i64::from(*i)),
        AMQPValue::ShortShortUInt(i) => int(i64::from(*i)),
        AMQPValue::ShortInt(i) => int(i64::from(*i)),
        AMQPValue::ShortUInt(i) => int(i64::from(*i)),
        AMQPValue::LongInt(i) => int(i64::from(*i)),
        AMQPValue::LongUInt(i) => int(i64::from(*i)),
        AMQPValue::LongLongInt(i) => int(*i),
        AMQPValue::Timestamp(t) => Value::Number((*t).into()),
        AMQPValue::Float(f) => Number::from_f64(f64::from(*f))
            .map(Value::Number)
            .unwrap_or(Value::Null),
        AMQPValue::Double(f) => Number::from_f64(*f)
            .map(Value::Number)
            .unwrap_or(Value::Null),
        AMQPValue::DecimalValue(d) => {
            Number::from_f64(f64::from(d.value) / 10f64.powi(i32::from(d.scale)))
                .map(Value::Number)
                .unwrap_or(Value::Null)
        }
        AMQPValue::ShortString(s) => Value::String(s.as_str().to_owned()),
        AMQPValue::LongString(s) => Value::String(String::from_utf8_lossy(s.as_bytes()).into()),
        AMQPValue::ByteArray(b) => Value::String(String::from_utf8_lossy(b.as_slice()).into()),
        AMQPValue::FieldArray(a) => Value::Array(a.as_slice().iter().map(value_to_json).collect()),
        AMQPValue::FieldTable(t) => table_to_json(t),
        AMQPValue::Void => Value::Null,
    }
}

/// RabbitMQ's `properties_key` of a binding: the routing key when it has no arguments (`~`
/// for an empty key), else the key, `~` and a hash of the arguments. It names one binding in
/// `DELETE /api/bindings/...`.
pub fn properties_key(routing_key: &str, arguments: &FieldTable) -> String {
    if arguments.inner().is_empty() {
        if routing_key.is_empty() {
            "~".to_owned()
        } else {
            routing_key.to_owned()
        }
    } else {
        // FNV-1a over the canonical JSON: stable across runs and processes.
        let text = table_to_json(arguments).to_string();
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in text.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x100_0000_01b3);
        }
        format!("{routing_key}~{h:016x}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_round_trip_through_json() {
        let v = serde_json::json!({"x-message-ttl": 1000, "x-dead-letter-exchange": "dlx",
            "ratio": 0.5, "flag": true, "list": [1, "a"], "nested": {"k": "v"}});
        let t = table_from_json(&v).unwrap();
        assert_eq!(table_to_json(&t), v);
        assert!(table_from_json(&serde_json::json!([1])).is_err());
    }

    #[test]
    fn properties_keys_follow_rabbitmq() {
        let empty = FieldTable::default();
        assert_eq!(properties_key("", &empty), "~");
        assert_eq!(properties_key("rk", &empty), "rk");
        let mut args = FieldTable::default();
        args.insert("x-match".into(), AMQPValue::LongString("all".into()));
        assert!(properties_key("rk", &args).starts_with("rk~"));
    }
}
