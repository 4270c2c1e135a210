//! Leader election: of the operator's replicas, only the holder of a `coordination.k8s.io/v1`
//! Lease runs the controllers.
//!
//! Why: two controllers reconciling one Cluster would each run the scale steps (one asking a
//! member to leave while the other shrinks the StatefulSet). The Lease is held through
//! `kube-lease-manager` (docs/dependencies.md says why that crate). A replica that loses
//! the Lease stops at once and exits, as client-go's leader election does: its process
//! restarts as a follower, so no half-run reconcile of an old leader overlaps the new one's.

use std::future::Future;
use std::time::Duration;

use kube::Client;
use kube_lease_manager::{LeaseCreateMode, LeaseManagerBuilder};
use tokio::sync::watch;

/// Name of the Lease the operator's replicas compete for.
pub const LEASE_NAME: &str = "ringmq-operator";
/// Seconds a Lease stays valid after its last renewal: how long the operator may be
/// without a leader after the leader dies without releasing it.
pub const LEASE_DURATION_SECONDS: u64 = 15;
/// Seconds before expiry at which the holder renews; also the clock skew tolerated between
/// nodes.
pub const LEASE_GRACE_SECONDS: u64 = 5;

/// Why leadership ended or could not be had; the message says what to check.
#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    /// The Lease could not be read, created or renewed.
    #[error(
        "cannot hold Lease {namespace}/{LEASE_NAME}: {reason}; check the operator's RBAC for coordination.k8s.io leases in that namespace"
    )]
    Lease {
        /// Namespace of the Lease.
        namespace: String,
        /// The underlying error.
        reason: String,
    },
    /// Another replica took the Lease while this one was leading.
    #[error("lost the leader Lease; exiting so that this replica restarts as a follower")]
    Lost,
}

/// Where and as whom to compete for the Lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaderConfig {
    /// Namespace of the Lease: the operator's own (`POD_NAMESPACE`).
    pub namespace: String,
    /// This replica's identity in `holderIdentity`: its pod name.
    pub identity: String,
}

/// Waits until `leading` says this replica leads, then runs `work` for as long as it does.
///
/// Returns `work`'s output if it ends first, or [`LeaderError::Lost`] as soon as leadership
/// is lost (the work is dropped, i.e. cancelled, at its next await). A closed channel counts
/// as lost: nobody renews the Lease any more.
pub async fn run_while_leading<T>(
    mut leading: watch::Receiver<bool>,
    work: impl Future<Output = T>,
) -> Result<T, LeaderError> {
    if leading.wait_for(|is_leader| *is_leader).await.is_err() {
        return Err(LeaderError::Lost);
    }
    tracing::info!("acquired the leader Lease; starting the controllers");
    tokio::select! {
        out = work => Ok(out),
        _ = leading.wait_for(|is_leader| !*is_leader) => {
            tracing::error!("lost the leader Lease; stopping the controllers");
            Err(LeaderError::Lost)
        }
    }
}

/// Competes for the Lease `config.namespace/`[`LEASE_NAME`] and runs `work` while leading.
///
/// The Lease is created when missing. When `work` ends, the Lease is released, so a
/// follower takes over without waiting for it to expire.
pub async fn lead<T>(
    client: Client,
    config: &LeaderConfig,
    work: impl Future<Output = T>,
) -> Result<T, LeaderError> {
    let lease_error = |e: kube_lease_manager::LeaseManagerError| LeaderError::Lease {
        namespace: config.namespace.clone(),
        reason: e.to_string(),
    };
    tracing::info!(
        namespace = %config.namespace,
        lease = LEASE_NAME,
        identity = %config.identity,
        "waiting for the leader Lease"
    );
    let manager = LeaseManagerBuilder::new(client, LEASE_NAME)
        .with_namespace(config.namespace.clone())
        .with_identity(config.identity.clone())
        .with_duration(LEASE_DURATION_SECONDS)
        .with_grace(LEASE_GRACE_SECONDS)
        .with_create_mode(LeaseCreateMode::AutoCreate)
        .build()
        .await
        .map_err(lease_error)?;
    let (leading, task) = manager.watch().await;
    let out = run_while_leading(leading, work).await;
    // Dropping the receiver closes the channel: the manager releases the Lease and ends.
    match tokio::time::timeout(Duration::from_secs(LEASE_GRACE_SECONDS), task).await {
        Ok(Ok(Ok(_))) => tracing::info!("released the leader Lease"),
        Ok(Ok(Err(e))) => tracing::warn!(error = %e, "could not release the leader Lease"),
        Ok(Err(e)) => tracing::warn!(error = %e, "the Lease task failed"),
        Err(_) => tracing::warn!("the Lease was not released in time; it expires by itself"),
    }
    out
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    use http::{Method, Request, Response};
    use kube::client::Body;
    use serde_json::{Value, json};
    use std::sync::Mutex;

    const LEASE_PATH: &str =
        "/apis/coordination.k8s.io/v1/namespaces/ringmq-system/leases/ringmq-operator";

    /// A Lease store behind kube's mocked API service: GET, POST (create) and PATCH (apply
    /// and strategic merge, both as a JSON merge of `spec`), which is all the Lease manager
    /// sends. Records `METHOD path` of every request.
    type Stored = Arc<Mutex<Option<Value>>>;
    type Calls = Arc<Mutex<Vec<String>>>;

    fn lease_api() -> (kube::Client, Stored, Calls) {
        let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let lease: Stored = Arc::default();
        let log: Calls = Arc::default();
        let (store, calls) = (lease.clone(), log.clone());
        tokio::spawn(async move {
            // Bounded: a lead, a renewal or two and a release are a few dozen requests.
            for _ in 0..500 {
                let Ok(Some((request, send))) =
                    tokio::time::timeout(Duration::from_secs(10), handle.next_request()).await
                else {
                    return;
                };
                let method = request.method().clone();
                let path = request.uri().path().to_string();
                calls.lock().expect("log").push(format!("{method} {path}"));
                let bytes = request.into_body().collect_bytes().await.expect("body");
                let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
                let mut lease = store.lock().expect("lease");
                let not_found = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                    "reason": "NotFound", "code": 404, "message": "not found"});
                let (status, reply) = match method {
                    Method::GET if path == LEASE_PATH => match lease.as_ref() {
                        Some(l) => (200, l.clone()),
                        None => (404, not_found),
                    },
                    Method::POST if LEASE_PATH.starts_with(&path) => {
                        let mut created = body.clone();
                        created["metadata"]["namespace"] = json!("ringmq-system");
                        created["metadata"]["resourceVersion"] = json!("1");
                        *lease = Some(created.clone());
                        (201, created)
                    }
                    Method::PATCH if path == LEASE_PATH => match lease.as_mut() {
                        Some(l) => {
                            if !l["spec"].is_object() {
                                l["spec"] = json!({});
                            }
                            for (k, v) in body["spec"].as_object().into_iter().flatten() {
                                if v.is_null() {
                                    l["spec"].as_object_mut().expect("object").remove(k);
                                } else {
                                    l["spec"][k] = v.clone();
                                }
                            }
                            (200, l.clone())
                        }
                        None => (404, not_found),
                    },
                    _ => (404, not_found),
                };
                drop(lease);
                send.send_response(
                    Response::builder()
                        .status(status)
                        .body(Body::from(serde_json::to_vec(&reply).expect("reply")))
                        .expect("response"),
                );
            }
        });
        (kube::Client::new(service, "default"), lease, log)
    }

    #[tokio::test]
    async fn the_leader_creates_and_holds_the_lease_in_its_namespace_then_releases_it() {
        let (client, lease, log) = lease_api();
        let config = LeaderConfig {
            namespace: "ringmq-system".into(),
            identity: "ringmq-operator-7d9f-abcde".into(),
        };
        let during = lease.clone();
        let out = tokio::time::timeout(
            Duration::from_secs(30),
            lead(client, &config, async move {
                during.lock().expect("lease").clone().expect("lease exists")["spec"]
                    ["holderIdentity"]
                    .clone()
            }),
        )
        .await
        .expect("leadership within the test's time")
        .expect("led");
        assert_eq!(
            out, "ringmq-operator-7d9f-abcde",
            "the work runs while this replica holds the Lease"
        );
        let after = lease.lock().expect("lease").clone().expect("lease kept");
        assert!(
            after["spec"].get("holderIdentity").is_none(),
            "released when the work ended, so a follower need not wait: {after}"
        );
        let calls = log.lock().expect("log").clone();
        assert!(
            calls.contains(&format!(
                "POST {}",
                LEASE_PATH.trim_end_matches("/ringmq-operator")
            )),
            "created in the operator's namespace: {calls:?}"
        );
        // The RBAC the chart grants on leases: get, create, patch.
        let verbs: std::collections::BTreeSet<&str> =
            calls.iter().filter_map(|c| c.split(' ').next()).collect();
        assert_eq!(
            verbs,
            ["GET", "PATCH", "POST"].into_iter().collect(),
            "{calls:?}"
        );
    }

    #[tokio::test]
    async fn controllers_start_only_once_the_lease_is_held() {
        let (tx, rx) = watch::channel(false);
        let started = Arc::new(AtomicBool::new(false));
        let flag = started.clone();
        let run = tokio::spawn(run_while_leading(rx, async move {
            flag.store(true, Ordering::SeqCst);
            "done"
        }));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!started.load(Ordering::SeqCst), "a follower runs nothing");
        tx.send(true).expect("receiver alive");
        let out = run.await.expect("task");
        assert_eq!(out.expect("work ran to its end"), "done");
        assert!(started.load(Ordering::SeqCst));
    }

    #[tokio::test]
    async fn losing_the_lease_stops_the_controllers_at_once() {
        let (tx, rx) = watch::channel(true);
        let stopped = Arc::new(AtomicBool::new(true));
        let flag = stopped.clone();
        let run = tokio::spawn(run_while_leading(rx, async move {
            flag.store(false, Ordering::SeqCst);
            // The controllers never end by themselves.
            std::future::pending::<()>().await;
        }));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!stopped.load(Ordering::SeqCst), "the leader runs the work");
        tx.send(false).expect("receiver alive");
        let out = tokio::time::timeout(Duration::from_secs(5), run)
            .await
            .expect("stops without waiting for the work")
            .expect("task");
        assert!(matches!(out, Err(LeaderError::Lost)), "{out:?}");
    }

    #[tokio::test]
    async fn a_closed_lease_channel_counts_as_lost() {
        let (tx, rx) = watch::channel(false);
        drop(tx);
        let out = run_while_leading(rx, async { "never" }).await;
        assert!(matches!(out, Err(LeaderError::Lost)), "{out:?}");
    }
}
