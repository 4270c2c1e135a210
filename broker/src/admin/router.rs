//! Matching a call against the route table ([`super::routes::ROUTES`]): which line answers
//! this method on this path, what its pattern captured, and — when no line does — whether the
//! answer is 405 (the resource exists, the method does not) or 404. The table is the only
//! list of endpoints, so that decision cannot drift from what is actually served.

use super::routes::ROUTES;
use super::wiring::{self, Planner};
use super::{ApiError, Call, Reply};
use crate::broker::Broker;
use hyper::{Method, StatusCode};
use std::sync::Arc;

/// What every handler returns: an error becomes the JSON error reply.
pub(super) type Result<T> = std::result::Result<T, ApiError>;

/// A handler answers one route from this broker: reads, and writes that are not wiring
/// changes.
pub(super) type Handler = fn(&Ctx<'_>) -> Result<Reply>;

/// A read that must ask other cluster members (a queue's numbers are its primary's).
pub(super) type Reader = for<'a> fn(&'a Ctx<'a>) -> futures::future::BoxFuture<'a, Result<Reply>>;

/// The prefix every pattern in the table is written with, so that the table reads like the
/// URLs in `docs/admin-api.md`; calls arrive with it already stripped.
const API_PREFIX: &str = "/api/";

/// Which methods a route answers. `Get` answers `HEAD` too: the API always has, and hyper
/// leaves the body out of a `HEAD` reply.
#[derive(Debug, Clone, Copy)]
pub(super) enum Verb {
    /// `GET` and `HEAD`: reads, which a `monitoring` user may make.
    Get,
    /// `PUT`: create or change an object named by the path.
    Put,
    /// `POST`: an action or an object the server names (bindings, leave, import).
    Post,
    /// `DELETE`.
    Delete,
}

impl Verb {
    fn accepts(self, method: &Method) -> bool {
        match self {
            Verb::Get => *method == Method::GET || *method == Method::HEAD,
            Verb::Put => *method == Method::PUT,
            Verb::Post => *method == Method::POST,
            Verb::Delete => *method == Method::DELETE,
        }
    }
}

/// One line of the route table: a method, a path pattern and who answers it. A pattern
/// segment is a literal (`queues`), a capture (`{vhost}`) or a capture of one of a few
/// literals (`{q|e}`); captures reach the handler in order through [`Ctx::args`].
#[derive(Debug)]
pub(super) struct Route {
    verb: Verb,
    pattern: &'static str,
    action: Action,
}

/// Who answers a route.
#[derive(Debug, Clone, Copy)]
enum Action {
    /// A handler.
    Handle(Handler),
    /// A read that awaits other members, or an action that awaits a cluster commit.
    Read(Reader),
    /// A wiring change: the planner builds its op, [`wiring::run`] applies it here or
    /// commits it through the cluster.
    Wiring(Planner),
}

impl Route {
    /// `GET` (and `HEAD`) on `pattern`.
    pub(super) const fn get(pattern: &'static str, handler: Handler) -> Self {
        Self::new(Verb::Get, pattern, handler)
    }
    /// `GET` (and `HEAD`) on `pattern`, answered by asking other members too.
    pub(super) const fn get_async(pattern: &'static str, reader: Reader) -> Self {
        Self {
            verb: Verb::Get,
            pattern,
            action: Action::Read(reader),
        }
    }
    /// `POST` on `pattern`: an action answered once the cluster committed what it asked.
    pub(super) const fn post_async(pattern: &'static str, action: Reader) -> Self {
        Self {
            verb: Verb::Post,
            pattern,
            action: Action::Read(action),
        }
    }
    /// `PUT` on `pattern`: a change answered once the cluster committed it.
    pub(super) const fn put_async(pattern: &'static str, action: Reader) -> Self {
        Self {
            verb: Verb::Put,
            pattern,
            action: Action::Read(action),
        }
    }
    /// `PUT` on `pattern`.
    pub(super) const fn put(pattern: &'static str, handler: Handler) -> Self {
        Self::new(Verb::Put, pattern, handler)
    }
    /// `POST` on `pattern`.
    pub(super) const fn post(pattern: &'static str, handler: Handler) -> Self {
        Self::new(Verb::Post, pattern, handler)
    }
    /// `DELETE` on `pattern`, answered once what it asked of other members is done.
    pub(super) const fn delete_async(pattern: &'static str, action: Reader) -> Self {
        Self {
            verb: Verb::Delete,
            pattern,
            action: Action::Read(action),
        }
    }
    /// `DELETE` on `pattern`.
    pub(super) const fn delete(pattern: &'static str, handler: Handler) -> Self {
        Self::new(Verb::Delete, pattern, handler)
    }

    /// A wiring change (declare, delete, bind) on `pattern`: `plan` turns the call into the
    /// op, which a single broker applies at once and a cluster member, when the op is shared,
    /// commits through the cluster map first.
    pub(super) const fn wiring(verb: Verb, pattern: &'static str, plan: Planner) -> Self {
        Self {
            verb,
            pattern,
            action: Action::Wiring(plan),
        }
    }

    const fn new(verb: Verb, pattern: &'static str, handler: Handler) -> Self {
        Self {
            verb,
            pattern,
            action: Action::Handle(handler),
        }
    }

    /// The pattern's segments after `/api/`.
    fn segments(&self) -> impl Iterator<Item = Segment> {
        self.pattern
            .strip_prefix(API_PREFIX)
            .unwrap_or(self.pattern)
            .split('/')
            .map(Segment::parse)
    }

    /// The captured segments when this route answers `method` on `path`, else `None`.
    fn captures<'p>(&self, method: &Method, path: &[&'p str]) -> Option<Vec<&'p str>> {
        if !self.verb.accepts(method) || self.segments().count() != path.len() {
            return None;
        }
        let mut captured = Vec::new();
        for (want, got) in self.segments().zip(path) {
            match want {
                Segment::Literal(literal) if literal == *got => {}
                Segment::Any => captured.push(*got),
                Segment::OneOf(choices) if choices.split('|').any(|c| c == *got) => {
                    captured.push(*got);
                }
                _ => return None,
            }
        }
        Some(captured)
    }

    /// The resource this route serves: the first segment of its pattern.
    fn resource(&self) -> Option<&'static str> {
        match self.segments().next() {
            Some(Segment::Literal(literal)) => Some(literal),
            _ => None,
        }
    }
}

/// One segment of a pattern as the table writes it.
#[derive(Debug, Clone, Copy)]
enum Segment {
    /// `queues`: the path segment must be exactly this.
    Literal(&'static str),
    /// `{name}`: any path segment, captured; the name is for the reader.
    Any,
    /// `{q|e}`: one of the `|`-separated choices, captured.
    OneOf(&'static str),
}

impl Segment {
    fn parse(written: &'static str) -> Self {
        match written.strip_prefix('{').and_then(|w| w.strip_suffix('}')) {
            None => Self::Literal(written),
            Some(choices) if choices.contains('|') => Self::OneOf(choices),
            Some(_) => Self::Any,
        }
    }
}

/// What a handler gets: the broker, the authenticated call, and what the route's pattern
/// captured from the path.
pub(super) struct Ctx<'a> {
    /// The broker the call acts on.
    pub(super) broker: &'a Arc<Broker>,
    /// The call: user, method, decoded path, query and body.
    pub(super) call: &'a Call,
    args: Vec<&'a str>,
}

impl<'a> Ctx<'a> {
    /// The captured path segments, in pattern order. `N` must be the number of captures in
    /// the route's pattern: the table and its handlers are written together, and a mismatch
    /// is a bug that stops the call loudly rather than reading the wrong segment.
    pub(super) fn args<const N: usize>(&self) -> [&'a str; N] {
        match <[&'a str; N]>::try_from(self.args.as_slice()) {
            Ok(args) => args,
            Err(_) => panic!(
                "route handler wants {N} path captures, its pattern has {}",
                self.args.len()
            ),
        }
    }
}

/// Answers one authenticated `/api/` call from the route table.
pub(super) async fn dispatch(broker: &Arc<Broker>, call: &Call) -> Result<Reply> {
    let path: Vec<&str> = call.path.iter().map(String::as_str).collect();
    let Some((route, args)) = ROUTES
        .iter()
        .find_map(|r| Some((r, r.captures(&call.method, &path)?)))
    else {
        return Err(unmatched(call, &path));
    };
    let c = Ctx { broker, call, args };
    match route.action {
        Action::Handle(handler) => handler(&c),
        Action::Read(reader) => reader(&c).await,
        Action::Wiring(plan) => wiring::run(&c, plan).await,
    }
}

/// 405 when some route serves the path's resource (its first segment) with another method,
/// else 404.
fn unmatched(call: &Call, path: &[&str]) -> ApiError {
    let known = ROUTES.iter().any(|r| r.resource() == path.first().copied());
    if known {
        ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            format!(
                "{} is not supported on /api/{}: see docs/admin-api.md",
                call.method,
                call.path.join("/")
            ),
        )
    } else {
        ApiError::not_found(format!(
            "no such API path /api/{}: see docs/admin-api.md",
            call.path.join("/")
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A path that `r`'s pattern matches: each capture filled with its first choice or `x`.
    fn example(r: &Route) -> Vec<&'static str> {
        r.segments()
            .map(|s| match s {
                Segment::Literal(literal) => literal,
                Segment::Any => "x",
                Segment::OneOf(choices) => choices.split('|').next().unwrap(),
            })
            .collect()
    }

    fn method(v: Verb) -> Method {
        match v {
            Verb::Get => Method::GET,
            Verb::Put => Method::PUT,
            Verb::Post => Method::POST,
            Verb::Delete => Method::DELETE,
        }
    }

    #[test]
    fn every_pattern_is_under_api_and_names_its_resource_first() {
        for r in ROUTES {
            assert!(r.pattern.starts_with(API_PREFIX), "{}", r.pattern);
            assert!(r.resource().is_some_and(|s| !s.is_empty()), "{}", r.pattern);
        }
    }

    #[test]
    fn each_route_is_the_first_to_match_its_own_paths() {
        for r in ROUTES {
            let path = example(r);
            let first = ROUTES
                .iter()
                .find(|o| o.captures(&method(r.verb), &path).is_some())
                .unwrap();
            assert!(std::ptr::eq(first, r), "{} is shadowed", r.pattern);
        }
    }

    #[test]
    fn get_routes_answer_head_and_others_only_their_method() {
        let r = Route::get("/api/queues/{vhost}", |_| unreachable!());
        assert_eq!(r.captures(&Method::HEAD, &["queues", "/"]), Some(vec!["/"]));
        assert_eq!(r.captures(&Method::POST, &["queues", "/"]), None);
        let r = Route::put("/api/queues/{vhost}", |_| unreachable!());
        assert_eq!(r.captures(&Method::HEAD, &["queues", "/"]), None);
    }

    #[test]
    fn captures_come_in_order_and_choices_are_enforced() {
        let r = Route::get(
            "/api/bindings/{vhost}/e/{src}/{q|e}/{dst}",
            |_| unreachable!(),
        );
        let get = |path: &[&'static str]| r.captures(&Method::GET, path);
        assert_eq!(
            get(&["bindings", "/", "e", "s", "q", "d"]),
            Some(vec!["/", "s", "q", "d"])
        );
        assert_eq!(get(&["bindings", "/", "e", "s", "x", "d"]), None);
        assert_eq!(get(&["bindings", "/", "q", "s", "q", "d"]), None);
        assert_eq!(get(&["bindings", "/"]), None);
    }

    #[test]
    fn the_resources_that_answer_405_are_the_documented_ones() {
        let mut known: Vec<&str> = ROUTES.iter().filter_map(Route::resource).collect();
        known.sort_unstable();
        known.dedup();
        let documented = [
            "bindings",
            "channels",
            "cluster",
            "connections",
            "definitions",
            "exchanges",
            "members",
            "overview",
            "permissions",
            "queues",
            "sessions",
            "users",
            "vhosts",
            "whoami",
        ];
        assert_eq!(known, documented);
    }
}
