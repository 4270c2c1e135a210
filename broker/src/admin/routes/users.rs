//! `/api/users`: the broker's users (the same ones AMQP logs in with) created, changed and
//! deleted at run time. Passwords and hashes go in, never out.

use super::{created, ok};
use crate::admin::router::{Ctx, Result};
use crate::admin::{ApiError, Reply, empty_reply};
use crate::auth::{PasswordHash, UserRecord};
use crate::broker::Broker;
use hyper::StatusCode;
use serde_json::{Value, json};

/// `GET /api/users`.
pub(super) fn list(c: &Ctx<'_>) -> Result<Reply> {
    ok(Value::Array(
        c.broker.users.users().iter().map(user_json).collect(),
    ))
}

/// `GET /api/users/{name}`.
pub(super) fn get(c: &Ctx<'_>) -> Result<Reply> {
    let [name] = c.args();
    ok(user_json(
        &c.broker.users.user(name).ok_or_else(|| no_user(name))?,
    ))
}

/// `PUT /api/users/{name}`.
pub(super) fn put(c: &Ctx<'_>) -> Result<Reply> {
    let [name] = c.args();
    let body = c.call.json()?;
    Ok(created(put_user(c.broker, name, &body)?))
}

/// `DELETE /api/users/{name}`: the user's connections are closed, so a deleted user loses
/// access at once rather than at its next login.
pub(super) fn delete(c: &Ctx<'_>) -> Result<Reply> {
    let [name] = c.args();
    let b = c.broker;
    if !b.users.delete_user(name) {
        return Err(no_user(name));
    }
    tracing::info!(user = %name, by = %c.call.user.name, "user deleted");
    for ci in b.registry.connections() {
        if ci.user == name {
            b.force_close(ci.id, &format!("user '{name}' was deleted"));
        }
    }
    Ok(empty_reply(StatusCode::NO_CONTENT))
}

fn user_json(u: &UserRecord) -> Value {
    json!({"name": u.name, "tags": u.tags})
}

/// Parses `tags` as RabbitMQ writes it: a comma-separated string (3.x) or a list (3.10+), so
/// both generations' scripts and exports work.
pub(in crate::admin) fn parse_tags(v: Option<&Value>) -> Result<Vec<String>> {
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(s
            .split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(str::to_owned)
            .collect()),
        Some(Value::Array(a)) => a
            .iter()
            .map(|t| {
                t.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| ApiError::bad_request("tags must be strings"))
            })
            .collect(),
        Some(_) => Err(ApiError::bad_request(
            "tags must be a list of strings or a comma-separated string",
        )),
    }
}

/// Creates or changes a user from a RabbitMQ-style body (`password`, or `password_hash` with
/// `hashing_algorithm` ringmq_pbkdf2_sha256 or rabbit_password_hashing_sha256, and `tags`);
/// returns whether it is new. Shared with the definitions import so both accept the same.
pub(in crate::admin) fn put_user(b: &Broker, name: &str, body: &Value) -> Result<bool> {
    if name.is_empty() {
        return Err(ApiError::bad_request("a user needs a non-empty name"));
    }
    let tags = parse_tags(body.get("tags"))?;
    let existing = b.users.user(name);
    let password = match (body.get("password"), body.get("password_hash")) {
        (Some(Value::String(p)), _) => b.users.hash_password(p),
        (_, Some(Value::String(h))) => {
            PasswordHash::parse(h, body.get("hashing_algorithm").and_then(Value::as_str))
                .map_err(|e| ApiError::bad_request(e.to_string()))?
        }
        _ => match &existing {
            Some(u) => u.password.clone(),
            None => {
                return Err(ApiError::bad_request(
                    "a new user needs \"password\" or \"password_hash\"",
                ));
            }
        },
    };
    let loopback_only = existing.as_ref().is_some_and(|u| u.loopback_only);
    let new = b.users.put_user(UserRecord {
        name: name.to_owned(),
        password,
        tags,
        loopback_only,
    });
    tracing::info!(user = %name, new, "user saved");
    Ok(new)
}

/// The 404 for a missing user, on the user and the permission paths.
pub(super) fn no_user(name: &str) -> ApiError {
    ApiError::not_found(format!("no user '{name}'"))
}
