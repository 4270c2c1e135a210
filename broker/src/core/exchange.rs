//! Exchanges and their bindings: where a published message goes.

use super::args::{int_value, str_value};
use crate::amqp::{AMQPValue, FieldTable};
use crate::core::FastHashMap;
use std::sync::Arc;

/// The exchange types the broker implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExchangeKind {
    /// Routing key equals binding key.
    Direct,
    /// Every binding.
    Fanout,
    /// Dotted words with `*` (one word) and `#` (zero or more words).
    Topic,
    /// Message headers against binding arguments, `x-match` all or any.
    Headers,
}

impl ExchangeKind {
    /// Parses the `type` field of exchange.declare.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "direct" => Self::Direct,
            "fanout" => Self::Fanout,
            "topic" => Self::Topic,
            "headers" => Self::Headers,
            _ => return None,
        })
    }

    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Direct => "direct",
            Self::Fanout => "fanout",
            Self::Topic => "topic",
            Self::Headers => "headers",
        }
    }
}

/// Where a binding leads.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Destination {
    /// A queue, by name.
    Queue(Arc<str>),
    /// Another exchange (exchange-to-exchange binding), by name.
    Exchange(Arc<str>),
}

/// One binding from an exchange.
#[derive(Debug, Clone, PartialEq)]
pub struct Binding {
    /// Where matching messages go.
    pub destination: Destination,
    /// Binding key.
    pub routing_key: String,
    /// Binding arguments (the match table of a headers exchange).
    pub arguments: FieldTable,
}

/// An exchange with its outgoing bindings.
#[derive(Debug)]
pub struct Exchange {
    /// Name.
    pub name: Arc<str>,
    /// Type.
    pub kind: ExchangeKind,
    /// Survives a restart (with persistence).
    pub durable: bool,
    /// Deleted when its last binding goes.
    pub auto_delete: bool,
    /// Clients may not publish to it directly.
    pub internal: bool,
    /// Arguments as declared.
    pub arguments: FieldTable,
    /// `alternate-exchange` argument: where unroutable messages go.
    pub alternate_exchange: Option<String>,
    /// The other AMQP broker (its `qpid.cluster.proxy` URI) whose exchange of the same name
    /// this one stands for, or `None` for an exchange of this broker. A foreign exchange
    /// routes nothing here: publishes to it go to the other broker, and its bindings say
    /// what that broker's exchange feeds into local queues ([`super::vhost::Feed`]).
    pub home: Option<Arc<str>>,
    bindings: Vec<Binding>,
    direct_index: FastHashMap<String, Vec<Destination>>,
}

impl Exchange {
    /// A new exchange with no bindings.
    pub fn new(
        name: Arc<str>,
        kind: ExchangeKind,
        durable: bool,
        auto_delete: bool,
        internal: bool,
        arguments: FieldTable,
    ) -> Self {
        let alternate_exchange = arguments
            .inner()
            .get("alternate-exchange")
            .and_then(str_value);
        let home = arguments
            .inner()
            .get(super::PROXY_ARGUMENT)
            .and_then(str_value)
            .filter(|h| super::is_foreign(h))
            .map(Arc::from);
        Self {
            name,
            kind,
            durable,
            auto_delete,
            internal,
            arguments,
            alternate_exchange,
            home,
            bindings: Vec::new(),
            direct_index: FastHashMap::default(),
        }
    }

    /// Its bindings, in the order they were made.
    pub fn bindings(&self) -> &[Binding] {
        &self.bindings
    }

    /// Adds a binding; binding twice is a no-op, as the spec asks. Returns whether it was new.
    pub fn bind(&mut self, binding: Binding) -> bool {
        if self.bindings.contains(&binding) {
            return false;
        }
        if self.kind == ExchangeKind::Direct {
            self.direct_index
                .entry(binding.routing_key.clone())
                .or_default()
                .push(binding.destination.clone());
        }
        self.bindings.push(binding);
        true
    }

    /// Removes a binding. Returns whether it existed.
    pub fn unbind(&mut self, binding: &Binding) -> bool {
        let Some(at) = self.bindings.iter().position(|b| b == binding) else {
            return false;
        };
        self.bindings.remove(at);
        if self.kind == ExchangeKind::Direct {
            self.rebuild_direct_key(&binding.routing_key);
        }
        true
    }

    /// Removes every binding to `destination`. Returns how many went.
    pub fn unbind_destination(&mut self, destination: &Destination) -> usize {
        let before = self.bindings.len();
        let mut keys = Vec::new();
        self.bindings.retain(|b| {
            let hit = &b.destination == destination;
            if hit {
                keys.push(b.routing_key.clone());
            }
            !hit
        });
        if self.kind == ExchangeKind::Direct {
            for key in keys {
                self.rebuild_direct_key(&key);
            }
        }
        before - self.bindings.len()
    }

    fn rebuild_direct_key(&mut self, key: &str) {
        let dests: Vec<_> = self
            .bindings
            .iter()
            .filter(|b| b.routing_key == key)
            .map(|b| b.destination.clone())
            .collect();
        if dests.is_empty() {
            self.direct_index.remove(key);
        } else {
            self.direct_index.insert(key.to_owned(), dests);
        }
    }

    /// Appends to `out` the destinations a message with this routing key and headers reaches
    /// through this exchange's own bindings (not following exchange-to-exchange bindings).
    pub fn matches(
        &self,
        routing_key: &str,
        headers: Option<&FieldTable>,
        out: &mut Vec<Destination>,
    ) {
        match self.kind {
            ExchangeKind::Direct => {
                if let Some(dests) = self.direct_index.get(routing_key) {
                    out.extend(dests.iter().cloned());
                }
            }
            ExchangeKind::Fanout => out.extend(self.bindings.iter().map(|b| b.destination.clone())),
            ExchangeKind::Topic => out.extend(
                self.bindings
                    .iter()
                    .filter(|b| topic_matches(&b.routing_key, routing_key))
                    .map(|b| b.destination.clone()),
            ),
            ExchangeKind::Headers => out.extend(
                self.bindings
                    .iter()
                    .filter(|b| headers_match(&b.arguments, headers))
                    .map(|b| b.destination.clone()),
            ),
        }
    }
}

/// AMQP topic matching: words separated by `.`, `*` matches exactly one word, `#` zero or more.
pub fn topic_matches(pattern: &str, key: &str) -> bool {
    topic_match_words(&words(pattern), &words(key))
}

/// The words of a topic or binding key; the empty key has none (as RabbitMQ splits it).
fn words(s: &str) -> Vec<&str> {
    if s.is_empty() {
        Vec::new()
    } else {
        s.split('.').collect()
    }
}

fn topic_match_words(pattern: &[&str], key: &[&str]) -> bool {
    // Iterative matcher with backtracking on the last `#`: linear in the common case and never
    // exponential, whatever a client binds.
    let (mut p, mut k) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while k < key.len() {
        if p < pattern.len() && pattern[p] == "#" {
            star = Some((p, k));
            p += 1;
        } else if p < pattern.len() && (pattern[p] == "*" || pattern[p] == key[k]) {
            p += 1;
            k += 1;
        } else if let Some((sp, sk)) = star {
            p = sp + 1;
            k = sk + 1;
            star = Some((sp, sk + 1));
        } else {
            return false;
        }
    }
    pattern[p..].iter().all(|w| *w == "#")
}

/// Headers-exchange matching. `x-match` = `all` (default) or `any`; `all-with-x` / `any-with-x`
/// also compare arguments starting with `x-`. A binding argument of type void matches on
/// presence alone.
pub fn headers_match(binding: &FieldTable, headers: Option<&FieldTable>) -> bool {
    let mode = binding.inner().get("x-match").and_then(str_value);
    let (any, with_x) = match mode.as_deref() {
        Some("any") => (true, false),
        Some("any-with-x") => (true, true),
        Some("all-with-x") => (false, true),
        _ => (false, false),
    };
    let empty = FieldTable::default();
    let headers = headers.unwrap_or(&empty).inner();
    let mut considered = binding
        .inner()
        .iter()
        .filter(|(k, _)| k.as_str() != "x-match" && (with_x || !k.as_str().starts_with("x-")));
    let hit = |(k, v): (&crate::amqp::ShortString, &AMQPValue)| match headers.get(k) {
        None => false,
        Some(h) => matches!(v, AMQPValue::Void) || values_equal(v, h),
    };
    if any {
        considered.any(hit)
    } else {
        considered.all(hit)
    }
}

fn values_equal(a: &AMQPValue, b: &AMQPValue) -> bool {
    match (int_value(a), int_value(b)) {
        (Some(x), Some(y)) => x == y,
        _ => match (str_value(a), str_value(b)) {
            (Some(x), Some(y)) => x == y,
            _ => a == b,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_patterns_match_like_rabbitmq() {
        let cases = [
            ("a.b.c", "a.b.c", true),
            ("a.*.c", "a.b.c", true),
            ("a.*.c", "a.c", false),
            ("a.#", "a", true),
            ("a.#", "a.b.c", true),
            ("#", "", true),
            ("#", "x.y", true),
            ("*", "", false),
            ("*", "a.b", false),
            ("#.c", "a.b.c", true),
            ("#.c", "c", true),
            ("a.#.c", "a.c", true),
            ("a.#.c", "a.x.y.c", true),
            ("a.#.c", "a.x.y.d", false),
            ("#.#", "a", true),
            ("*.#.*", "a", false),
            ("*.#.*", "a.b", true),
            ("a.b", "a.b.c", false),
            ("", "", true),
            ("", "a", false),
        ];
        for (pattern, key, want) in cases {
            assert_eq!(topic_matches(pattern, key), want, "{pattern:?} vs {key:?}");
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
    fn headers_match_all_and_any() {
        let msg = table(&[
            ("a", AMQPValue::LongString("1".into())),
            ("b", AMQPValue::LongInt(2)),
        ]);
        let all = table(&[
            ("x-match", AMQPValue::LongString("all".into())),
            ("a", AMQPValue::LongString("1".into())),
            ("b", AMQPValue::ShortInt(2)),
        ]);
        assert!(headers_match(&all, Some(&msg)));
        let all_miss = table(&[
            ("a", AMQPValue::LongString("1".into())),
            ("c", AMQPValue::LongInt(3)),
        ]);
        assert!(!headers_match(&all_miss, Some(&msg)));
        let any = table(&[
            ("x-match", AMQPValue::LongString("any".into())),
            ("a", AMQPValue::LongString("9".into())),
            ("b", AMQPValue::LongInt(2)),
        ]);
        assert!(headers_match(&any, Some(&msg)));
        let presence = table(&[("a", AMQPValue::Void)]);
        assert!(headers_match(&presence, Some(&msg)));
        assert!(!headers_match(&any, None));
    }
}
