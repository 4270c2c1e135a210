//! `/api/definitions`: the HTTP face of [`crate::admin::definitions`] — who may export (the
//! export holds password hashes) and what an import answers.

use super::ok;
use crate::admin::router::{Ctx, Result};
use crate::admin::{ApiError, Reply, TAG_ADMINISTRATOR, definitions, empty_reply};
use hyper::StatusCode;

/// `GET /api/definitions`: administrators only, as in RabbitMQ, although a `monitoring` user
/// may make every other read.
pub(super) fn export(c: &Ctx<'_>) -> Result<Reply> {
    if !c.call.user.tags.iter().any(|t| t == TAG_ADMINISTRATOR) {
        return Err(ApiError::forbidden(
            "exporting definitions (with password hashes) needs the administrator tag",
        ));
    }
    ok(definitions::export(c.broker))
}

/// `POST /api/definitions`: 204 once everything in the document is applied.
pub(super) fn import(c: &Ctx<'_>) -> Result<Reply> {
    let body = c.call.json()?;
    definitions::import(c.broker, &body, &c.call.user.name)?;
    Ok(empty_reply(StatusCode::NO_CONTENT))
}
