//! Prometheus metrics: reconciles, failures by reason, reconcile duration.
//!
//! Why prometheus-client: the official Rust client with OpenMetrics text output and typed
//! label sets, so a label can only take the values the code gives it.

use std::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::controller::Error;

/// Labels of `ringmq_operator_reconciles_total` and the duration histogram.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ControllerLabels {
    /// `Cluster` or `Queue`.
    pub controller: String,
}

/// Labels of `ringmq_operator_reconcile_failures_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FailureLabels {
    /// `Cluster` or `Queue`.
    pub controller: String,
    /// Bounded failure reason, see [`Error::metric_label`].
    pub reason: String,
}

/// The operator's metrics and the registry that exposes them.
pub struct Metrics {
    /// Registry rendered at `/metrics`.
    pub registry: Registry,
    reconciles: Family<ControllerLabels, Counter>,
    failures: Family<FailureLabels, Counter>,
    duration: Family<ControllerLabels, Histogram>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("ringmq_operator");
        let reconciles = Family::<ControllerLabels, Counter>::default();
        let failures = Family::<FailureLabels, Counter>::default();
        let duration = Family::<ControllerLabels, Histogram>::new_with_constructor(|| {
            Histogram::new([0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0])
        });
        registry.register("reconciles", "Reconciles started", reconciles.clone());
        registry.register(
            "reconcile_failures",
            "Reconciles failed, by reason",
            failures.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "Reconcile duration",
            duration.clone(),
        );
        Self {
            registry,
            reconciles,
            failures,
            duration,
        }
    }
}

/// Observes one reconcile's duration when dropped, so early returns are measured too.
pub struct ReconcileTimer {
    start: Instant,
    histogram: Histogram,
}

impl Drop for ReconcileTimer {
    fn drop(&mut self) {
        self.histogram.observe(self.start.elapsed().as_secs_f64());
    }
}

impl Metrics {
    /// Counts a reconcile of `controller` and returns a timer for its duration.
    pub fn reconcile(&self, controller: &str) -> ReconcileTimer {
        let labels = ControllerLabels {
            controller: controller.to_string(),
        };
        self.reconciles.get_or_create(&labels).inc();
        ReconcileTimer {
            start: Instant::now(),
            histogram: self.duration.get_or_create(&labels).clone(),
        }
    }

    /// Counts a failed reconcile of `controller`.
    pub fn failure(&self, controller: &str, error: &Error) {
        let labels = FailureLabels {
            controller: controller.to_string(),
            reason: error.metric_label().to_string(),
        };
        self.failures.get_or_create(&labels).inc();
    }

    /// Renders the registry in OpenMetrics text format.
    pub fn render(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconciles_failures_and_durations_are_exported() {
        let metrics = Metrics::default();
        drop(metrics.reconcile("Cluster"));
        metrics.failure("Queue", &Error::MissingObjectKey("namespace"));
        let text = metrics.render().expect("renders");
        assert!(
            text.contains(r#"ringmq_operator_reconciles_total{controller="Cluster"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(r#"ringmq_operator_reconcile_failures_total{controller="Queue",reason="missing_object_key"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(
                r#"ringmq_operator_reconcile_duration_seconds_count{controller="Cluster"} 1"#
            ),
            "{text}"
        );
    }
}
