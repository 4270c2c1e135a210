//! Status conditions with correct transition times.
//!
//! Why a helper: `lastTransitionTime` must change only when a condition's status changes,
//! which needs the previous conditions; getting that wrong makes `kubectl wait` unreliable.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

/// Builds condition `type_` with `status`, keeping the previous transition time when the
/// status did not change.
pub fn condition(
    previous: &[Condition],
    type_: &str,
    status: bool,
    reason: &str,
    message: impl Into<String>,
    observed_generation: Option<i64>,
) -> Condition {
    let status = if status { "True" } else { "False" }.to_string();
    let last_transition_time = previous
        .iter()
        .find(|c| c.type_ == type_ && c.status == status)
        .map(|c| c.last_transition_time.clone())
        .unwrap_or_else(|| Time(Timestamp::now()));
    Condition {
        type_: type_.to_string(),
        status,
        reason: reason.to_string(),
        message: message.into(),
        observed_generation,
        last_transition_time,
    }
}
