//! Test fixtures: a scripted Kubernetes API (kube's mocked service, as in controller-rs) and
//! a fake broker admin API.
//!
//! Every request the reconciler sends to the API server is asserted in order and answered
//! from the script; a request the script does not expect fails the test.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use http::{Method, Request, Response};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::client::Body;
use kube::{Client, Resource};
use serde_json::{Value, json};

use crate::admin::{
    AdminApi, AdminConnector, AdminEndpoint, AdminError, ClusterInfo, Declared, LayoutOrder,
    MemberInfo, Overview, QueueDeclaration, QueueInfo, RebalanceProgress, RebalanceView,
    RingLayout,
};
use crate::controller::Context;
use crate::crd::{Cluster, ClusterSpec, ClusterStatus, Queue, QueueSpec, QueueStatus};
use crate::metrics::Metrics;

type ApiServerHandle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

/// The scripted API server side of a mocked kube client.
pub struct ApiServerVerifier(ApiServerHandle);

/// A request the verifier received, for assertions on its body.
pub struct Seen {
    /// Path and query.
    pub uri: String,
    /// JSON body (`Null` when empty).
    pub body: Value,
}

impl ApiServerVerifier {
    /// Asserts the next request is `method path` and answers `status` with `reply`
    /// (or, when `reply` is `None`, echoes the request body, as an API server does for apply).
    pub async fn expect(
        &mut self,
        method: Method,
        path: &str,
        status: u16,
        reply: Option<Value>,
    ) -> Seen {
        self.expect_reply(method, path, status, move |body| {
            reply.unwrap_or_else(|| body.clone())
        })
        .await
    }

    /// Like [`Self::expect`], building the reply from the request body.
    pub async fn expect_reply(
        &mut self,
        method: Method,
        path: &str,
        status: u16,
        reply: impl FnOnce(&Value) -> Value,
    ) -> Seen {
        let (request, send) = tokio::time::timeout(Duration::from_secs(5), self.0.next_request())
            .await
            .unwrap_or_else(|_| panic!("timed out waiting for {method} {path}"))
            .unwrap_or_else(|| panic!("client dropped before {method} {path}"));
        assert_eq!(
            request.method(),
            &method,
            "method of request to {}",
            request.uri()
        );
        assert_eq!(request.uri().path(), path, "path of the {method} request");
        let uri = request.uri().to_string();
        let bytes = request
            .into_body()
            .collect_bytes()
            .await
            .expect("request body");
        let body: Value = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).expect("JSON body")
        };
        let reply = reply(&body);
        let response = Response::builder()
            .status(status)
            .body(Body::from(
                serde_json::to_vec(&reply).expect("reply serializes"),
            ))
            .expect("response builds");
        send.send_response(response);
        Seen { uri, body }
    }

    /// Answers a GET with 404 Not Found.
    pub async fn not_found(&mut self, path: &str) {
        let status = json!({"kind":"Status","apiVersion":"v1","status":"Failure","reason":"NotFound","code":404,"message":"not found"});
        self.expect(Method::GET, path, 404, Some(status)).await;
    }

    /// Answers a GET with `object`.
    pub async fn get(&mut self, path: &str, object: Value) {
        self.expect(Method::GET, path, 200, Some(object)).await;
    }

    /// Expects a server-side apply PATCH (field manager and force asserted) and echoes it.
    pub async fn apply(&mut self, path: &str) -> Seen {
        let seen = self.expect(Method::PATCH, path, 200, None).await;
        assert!(
            seen.uri.contains("fieldManager=ringmq-operator"),
            "apply uses our field manager: {}",
            seen.uri
        );
        assert!(
            seen.uri.contains("force=true"),
            "apply forces ownership: {}",
            seen.uri
        );
        seen
    }

    /// Expects an Event to be created with `reason` and returns its body.
    pub async fn event(&mut self, reason: &str) -> Seen {
        let seen = self
            .expect(
                Method::POST,
                "/apis/events.k8s.io/v1/namespaces/default/events",
                201,
                None,
            )
            .await;
        assert_eq!(seen.body["reason"], reason, "event reason");
        seen
    }

    /// Expects a repeat of an Event already published by this context: the recorder patches
    /// the existing Event's series instead of creating a new one.
    pub async fn event_repeated(&mut self, reason: &str) -> Seen {
        let (request, send) = tokio::time::timeout(Duration::from_secs(5), self.0.next_request())
            .await
            .expect("timed out waiting for an event patch")
            .expect("client dropped before the event patch");
        assert_eq!(request.method(), Method::PATCH);
        assert!(
            request
                .uri()
                .path()
                .starts_with("/apis/events.k8s.io/v1/namespaces/default/events/")
        );
        let uri = request.uri().to_string();
        let bytes = request
            .into_body()
            .collect_bytes()
            .await
            .expect("request body");
        let body: Value = serde_json::from_slice(&bytes).expect("JSON body");
        assert_eq!(body["reason"], reason, "event reason");
        assert_eq!(body["series"]["count"], 2, "second occurrence");
        send.send_response(
            Response::builder()
                .body(Body::from(bytes.to_vec()))
                .expect("response builds"),
        );
        Seen { uri, body }
    }

    /// Takes the next request, whatever it is, and returns its method and path; answers it
    /// with an empty list (a watcher's initial list) so the client carries on.
    pub async fn next_any(&mut self) -> Option<(Method, String)> {
        let (request, send) = tokio::time::timeout(Duration::from_secs(5), self.0.next_request())
            .await
            .ok()??;
        let method = request.method().clone();
        let path = request.uri().path().to_string();
        let list = json!({"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": "1"}, "items": []});
        send.send_response(
            Response::builder()
                .body(Body::from(
                    serde_json::to_vec(&list).expect("list serializes"),
                ))
                .expect("response builds"),
        );
        Some((method, path))
    }

    /// Asserts no further request arrives.
    pub async fn done(mut self) {
        let next = tokio::time::timeout(Duration::from_millis(100), self.0.next_request()).await;
        if let Ok(Some((request, _))) = next {
            panic!("unexpected request {} {}", request.method(), request.uri());
        }
    }
}

/// Runs `script` against the verifier while `reconcile` runs, checks both finish and that no
/// request was left unscripted; returns the reconcile result and what the script returned.
pub async fn run_scripted<F, S, T, R>(
    verifier: ApiServerVerifier,
    reconcile: F,
    script: impl FnOnce(ApiServerVerifier) -> S,
) -> (T, R)
where
    F: std::future::Future<Output = T>,
    S: std::future::Future<Output = (ApiServerVerifier, R)> + Send + 'static,
    R: Send + 'static,
{
    let server = tokio::spawn(script(verifier));
    let result = reconcile.await;
    let (verifier, out) = tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .expect("script finished")
        .expect("script did not panic");
    verifier.done().await;
    (result, out)
}

/// A fake broker cluster behind the admin API.
#[derive(Default)]
pub struct FakeBroker {
    /// Queues by (vhost, name).
    pub queues: BTreeMap<(String, String), QueueDeclaration>,
    /// Queue roles (primaries and backups) held per member id; absent = member unknown.
    pub owned: BTreeMap<String, u64>,
    /// Members listed by the overview.
    pub members: Vec<String>,
    /// Members the overview lists as `joining` (not caught up yet) instead of `running`.
    pub joining: Vec<String>,
    /// Drain marks by member id, as the brokers keep them: set by a drain, cleared by an
    /// undrain, kept while the member is away. A marked member that caught up is listed
    /// `draining`.
    pub draining: Vec<String>,
    /// Members that stopped without a drain: no longer listed, but still consensus voters
    /// (counted in `cluster.voters`), as a real broker keeps a stopped member's vote for its
    /// restart. A drained member that stops leaves the voters: remove it from `members`.
    pub stopped_voters: Vec<String>,
    /// The answering member has lost the majority's lease (`cluster.quorum: false`).
    pub no_quorum: bool,
    /// What `GET /api/cluster/rebalance` answers; a start makes `current` a running one
    /// over the plan (as the brokers do), refused while one runs.
    pub rebalance: RebalanceView,
    /// The ring's layout, as `GET /api/cluster/ring` answers it (`ring` follows `members`,
    /// ordered by the layout as the brokers order theirs).
    pub layout: RingLayout,
    /// The fake's agreed index: every committed change (a layout, a rebalance start) takes
    /// the next, so `changed_at` and `started_at` compare as the brokers' do.
    pub index: u64,
    /// Calls received, e.g. `leave ringmq-3`.
    pub calls: Vec<String>,
    /// Endpoints connected to.
    pub endpoints: Vec<AdminEndpoint>,
}

impl FakeBroker {
    /// The layout, with `members` as the ring.
    fn ring_now(&self) -> RingLayout {
        RingLayout {
            ring: self.members.clone(),
            ..self.layout.clone()
        }
    }
}

/// Shared handle to a [`FakeBroker`]; implements both admin traits.
#[derive(Clone, Default)]
pub struct FakeAdmin(pub Arc<Mutex<FakeBroker>>);

impl FakeAdmin {
    /// Locks the fake's state.
    pub fn state(&self) -> std::sync::MutexGuard<'_, FakeBroker> {
        self.0.lock().expect("fake admin lock")
    }
}

impl AdminConnector for FakeAdmin {
    fn connect(&self, endpoint: AdminEndpoint) -> Arc<dyn AdminApi> {
        self.state().endpoints.push(endpoint);
        Arc::new(self.clone())
    }
}

impl AdminApi for FakeAdmin {
    fn overview(&self) -> BoxFuture<'_, Result<Overview, AdminError>> {
        Box::pin(async move {
            let mut s = self.state();
            s.calls.push("overview".into());
            let members = s
                .members
                .iter()
                .map(|id| MemberInfo {
                    id: id.clone(),
                    zone: "zone-a".into(),
                    // The states a clustered broker reports (`admin/routes/members.rs`).
                    state: if s.joining.contains(id) {
                        "joining"
                    } else if s.draining.contains(id) {
                        "draining"
                    } else {
                        "running"
                    }
                    .into(),
                    draining: s.draining.contains(id),
                    ..MemberInfo::default()
                })
                .collect();
            // The shape of a clustered broker's `cluster` object (`admin/routes/overview.rs`):
            // the leader is unknown without quorum.
            let cluster = ClusterInfo {
                quorum: !s.no_quorum,
                voters: (s.members.len() + s.stopped_voters.len()) as u64,
                leader: (!s.no_quorum).then(|| s.members.first().cloned()).flatten(),
            };
            Ok(Overview {
                node: "ringmq-0".into(),
                cluster_name: "ringmq".into(),
                members,
                cluster: Some(cluster),
            })
        })
    }

    fn member<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<MemberInfo>, AdminError>> {
        Box::pin(async move {
            let mut s = self.state();
            s.calls.push(format!("member {id}"));
            // As a cluster member answers: what it holds by the cluster map, and its mark.
            let draining = s.draining.iter().any(|d| d == id);
            Ok(s.owned.get(id).map(|n| MemberInfo {
                id: id.into(),
                state: if draining { "draining" } else { "running" }.into(),
                draining,
                owned_queues: *n,
                primaries: *n,
                ..MemberInfo::default()
            }))
        })
    }

    fn drain<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), AdminError>> {
        Box::pin(async move {
            let mut s = self.state();
            s.calls.push(format!("drain {id}"));
            if !s.draining.iter().any(|d| d == id) {
                s.draining.push(id.into());
            }
            Ok(())
        })
    }

    fn undrain<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), AdminError>> {
        Box::pin(async move {
            let mut s = self.state();
            s.calls.push(format!("undrain {id}"));
            // As the brokers answer: a member that is neither here nor marked is unknown.
            let marked = s.draining.iter().any(|d| d == id);
            if !marked && !s.members.iter().any(|m| m == id) {
                return Err(AdminError::Unexpected {
                    url: format!("/api/members/{id}/undrain"),
                    status: 404,
                    body: format!("no member '{id}' in the cluster"),
                });
            }
            s.draining.retain(|d| d != id);
            Ok(())
        })
    }

    fn rebalance(&self) -> BoxFuture<'_, Result<RebalanceView, AdminError>> {
        Box::pin(async move {
            let mut s = self.state();
            s.calls.push("rebalance".into());
            Ok(s.rebalance.clone())
        })
    }

    fn start_rebalance(&self, concurrency: u32) -> BoxFuture<'_, Result<(), AdminError>> {
        Box::pin(async move {
            let mut s = self.state();
            s.calls.push(format!("start-rebalance {concurrency}"));
            if (s.rebalance.current.as_ref()).is_some_and(|c| c.status == "running") {
                return Err(AdminError::Busy("a rebalance is under way".into()));
            }
            let total = (s.rebalance.plan.len() + s.rebalance.backup_plan.len()) as u64;
            s.index += 1;
            s.rebalance.current = Some(RebalanceProgress {
                status: "running".into(),
                total,
                pending: total,
                started_at: s.index,
                ..RebalanceProgress::default()
            });
            Ok(())
        })
    }

    fn ring_layout(&self) -> BoxFuture<'_, Result<RingLayout, AdminError>> {
        Box::pin(async move {
            let mut s = self.state();
            s.calls.push("ring-layout".into());
            Ok(s.ring_now())
        })
    }

    fn set_ring_layout<'a>(
        &'a self,
        order: &'a LayoutOrder,
        backups: Option<u8>,
    ) -> BoxFuture<'a, Result<RingLayout, AdminError>> {
        Box::pin(async move {
            let mut s = self.state();
            s.calls.push(format!(
                "set-ring-layout {} {backups:?}",
                serde_json::to_string(order).expect("an order serialises")
            ));
            // The broker's refusals (`cluster::layout::RingLayout::validate`), as a 400.
            let refuse = |reason: String| AdminError::Unexpected {
                url: "/api/cluster/ring".into(),
                status: 400,
                body: json!({"error": "bad_request", "reason": reason}).to_string(),
            };
            // In the broker's order: the body's fields as they parse, then the list.
            if let LayoutOrder::Named(name) = order
                && name != "placement"
                && name != "zone-aware"
            {
                return Err(refuse(format!(
                    "order must be \"placement\", \"zone-aware\" or a list of node ids, not \"{name}\""
                )));
            }
            if let Some(k) = backups.filter(|k| *k > 3) {
                return Err(refuse(format!(
                    "backups must be a whole number from 0 to 3, or null, not {k}"
                )));
            }
            if let LayoutOrder::Explicit(list) = order {
                if list.is_empty() {
                    return Err(refuse(
                        "an explicit ring order names at least one member".into(),
                    ));
                }
                for (i, n) in list.iter().enumerate() {
                    if n.is_empty() {
                        return Err(refuse(
                            "a member's node id in the ring order is empty".into(),
                        ));
                    }
                    if list[..i].contains(n) {
                        return Err(refuse(format!(
                            "member '{n}' is listed twice in the ring order"
                        )));
                    }
                }
            }
            let new = (&s.layout.order, s.layout.backups) != (order, backups);
            s.layout.order = order.clone();
            s.layout.backups = backups;
            // The brokers order the ring by the layout each time it is set: an explicit
            // order's listed members first, then the rest (every fake member is in one
            // zone, so a zone-aware ring keeps its order). The change is recorded only
            // when the layout or the order changed.
            let mut reordered = false;
            if let LayoutOrder::Explicit(list) = order {
                let members: Vec<String> = (list.iter())
                    .filter(|n| s.members.contains(n))
                    .chain(s.members.iter().filter(|n| !list.contains(n)))
                    .cloned()
                    .collect();
                reordered = members != s.members;
                s.members = members;
            }
            if new || reordered {
                s.index += 1;
                s.layout.changed_at = s.index;
            }
            Ok(s.ring_now())
        })
    }

    fn queue<'a>(
        &'a self,
        vhost: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<QueueInfo>, AdminError>> {
        Box::pin(async move {
            let mut s = self.state();
            s.calls.push(format!("get {vhost} {name}"));
            Ok(s.queues
                .contains_key(&(vhost.into(), name.into()))
                .then(|| QueueInfo {
                    name: name.into(),
                    vhost: vhost.into(),
                    messages: 7,
                    owner: Some("ringmq-1".into()),
                }))
        })
    }

    fn declare_queue<'a>(
        &'a self,
        vhost: &'a str,
        name: &'a str,
        declaration: &'a QueueDeclaration,
    ) -> BoxFuture<'a, Result<Declared, AdminError>> {
        Box::pin(async move {
            let mut s = self.state();
            s.calls.push(format!("declare {vhost} {name}"));
            match s.queues.get(&(vhost.into(), name.into())) {
                Some(existing) if existing == declaration => Ok(Declared::AlreadyThere),
                Some(_) => Err(AdminError::Conflict("inequivalent arg 'durable'".into())),
                None => {
                    s.queues
                        .insert((vhost.into(), name.into()), declaration.clone());
                    Ok(Declared::Created)
                }
            }
        })
    }

    fn delete_queue<'a>(
        &'a self,
        vhost: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<bool, AdminError>> {
        Box::pin(async move {
            let mut s = self.state();
            s.calls.push(format!("delete {vhost} {name}"));
            Ok(s.queues.remove(&(vhost.into(), name.into())).is_some())
        })
    }
}

impl Context {
    /// A context whose client talks to a scripted API server and whose brokers are `admin`.
    pub fn test(admin: FakeAdmin) -> (Arc<Context>, ApiServerVerifier) {
        Self::test_with(Arc::new(admin))
    }

    /// A context whose client talks to a scripted API server and whose brokers are reached
    /// through `connector` (a real broker's admin API in the real-broker tests).
    pub fn test_with(connector: Arc<dyn AdminConnector>) -> (Arc<Context>, ApiServerVerifier) {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = Client::new(service, "default");
        let ctx = Context::new(client, Arc::new(Metrics::default()), connector);
        (Arc::new(ctx), ApiServerVerifier(handle))
    }
}

/// A `Cluster` named `ringmq` in `default`, as the API server would hand it over.
pub fn cluster(replicas: i32, status: Option<ClusterStatus>) -> Cluster {
    let spec: ClusterSpec =
        serde_json::from_value(json!({"replicas": replicas, "image": "ringmq:test"}))
            .expect("fixture spec");
    let mut c = Cluster::new("ringmq", spec);
    c.meta_mut().namespace = Some("default".into());
    c.meta_mut().uid = Some("cluster-uid".into());
    c.meta_mut().generation = Some(2);
    c.status = status;
    c
}

/// A `Queue` named `orders` on cluster `ringmq`, with our finalizer unless told otherwise.
pub fn queue(extra_spec: Value, finalizer: bool, status: Option<QueueStatus>) -> Queue {
    let mut spec = json!({"clusterRef": {"name": "ringmq"}});
    if let (Some(base), Some(extra)) = (spec.as_object_mut(), extra_spec.as_object()) {
        base.extend(extra.clone());
    }
    let spec: QueueSpec = serde_json::from_value(spec).expect("fixture spec");
    let mut q = Queue::new("orders", spec);
    q.meta_mut().namespace = Some("default".into());
    q.meta_mut().uid = Some("queue-uid".into());
    q.meta_mut().generation = Some(1);
    if finalizer {
        q.meta_mut().finalizers = Some(vec![crate::controller::queue::QUEUE_FINALIZER.into()]);
    }
    q.status = status;
    q
}

/// The default-user Secret as the API server returns it.
pub fn user_secret() -> Value {
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some("ringmq-default-user".into()),
            namespace: Some("default".into()),
            ..Default::default()
        },
        data: Some(BTreeMap::from([
            ("username".to_string(), ByteString(b"admin".to_vec())),
            ("password".to_string(), ByteString(b"s3cret".to_vec())),
        ])),
        ..Default::default()
    };
    serde_json::to_value(secret).expect("secret serializes")
}

/// The cluster peer Secret as the API server returns it.
pub fn cluster_secret() -> Value {
    json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "ringmq-cluster", "namespace": "default"},
           "data": {"cluster-secret": "c2VjcmV0"}})
}
