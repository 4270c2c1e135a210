//! `/api/permissions`: which vhosts a user may open over AMQP and the configure/write/read
//! expressions checked on every command there, changed at run time.

use super::users::no_user;
use super::vhosts::vhost;
use super::{created, ok};
use crate::admin::router::{Ctx, Result};
use crate::admin::{ApiError, Reply, empty_reply};
use crate::auth::Permission;
use crate::broker::Broker;
use hyper::StatusCode;
use serde_json::{Value, json};

/// `GET /api/permissions`.
pub(super) fn list(c: &Ctx<'_>) -> Result<Reply> {
    ok(Value::Array(
        c.broker
            .users
            .permissions()
            .iter()
            .map(|(u, v, p)| permission_json(u, v, p))
            .collect(),
    ))
}

/// `GET /api/permissions/{vhost}/{user}`.
pub(super) fn get(c: &Ctx<'_>) -> Result<Reply> {
    let [vh, user] = c.args();
    let p = c
        .broker
        .users
        .permissions()
        .into_iter()
        .find(|(u, v, _)| u == user && v == vh)
        .ok_or_else(|| no_permission(user, vh))?;
    ok(permission_json(&p.0, &p.1, &p.2))
}

/// `PUT /api/permissions/{vhost}/{user}`: all three expressions are required, so a typo
/// cannot silently grant or deny.
pub(super) fn put(c: &Ctx<'_>) -> Result<Reply> {
    let [vh, user] = c.args();
    let body = c.call.json()?;
    let field = |k: &str| -> Result<String> {
        match body.get(k) {
            Some(Value::String(s)) => Ok(s.clone()),
            None => Err(ApiError::bad_request(format!(
                "the body needs \"{k}\": a regex such as \".*\""
            ))),
            Some(_) => Err(ApiError::bad_request(format!("{k} must be a string"))),
        }
    };
    let p = Permission {
        configure: field("configure")?,
        write: field("write")?,
        read: field("read")?,
    };
    Ok(created(set_permission(c.broker, vh, user, p)?))
}

/// `DELETE /api/permissions/{vhost}/{user}`.
pub(super) fn delete(c: &Ctx<'_>) -> Result<Reply> {
    let [vh, user] = c.args();
    if !c.broker.users.clear_permission(user, vh) {
        return Err(no_permission(user, vh));
    }
    Ok(empty_reply(StatusCode::NO_CONTENT))
}

fn permission_json(user: &str, vhost: &str, p: &Permission) -> Value {
    json!({
        "user": user,
        "vhost": vhost,
        "configure": p.configure,
        "write": p.write,
        "read": p.read,
    })
}

/// Sets a permission after checking the user and vhost exist (a permission on nothing would
/// never apply); returns whether it is new.
pub(in crate::admin) fn set_permission(
    b: &Broker,
    vh: &str,
    user: &str,
    p: Permission,
) -> Result<bool> {
    vhost(b, vh)?;
    if b.users.user(user).is_none() {
        return Err(no_user(user));
    }
    b.users
        .set_permission(user, vh, p)
        .map_err(|e| ApiError::bad_request(e.to_string()))
}

fn no_permission(user: &str, vh: &str) -> ApiError {
    ApiError::not_found(format!("user '{user}' has no permission on vhost '{vh}'"))
}
