//! The operators' HTTP server of `serve` (an adapter): one axum router on
//! one listener, off unless `[http] listen` or `--http ADDR` is given.
//!
//! | path | answers |
//! |---|---|
//! | `GET /metrics` | every family of [`crate::telemetry`], Prometheus text format 0.0.4 |
//! | `GET /healthz` | `200 ok` while the process runs (liveness: restart it when this fails) |
//! | `GET /readyz` | `200` with a JSON report when every check passes, else `503` with the same report naming the failing check |
//!
//! Readiness is computed on each request by a [`ReadyProbe`]; for `serve`
//! ([`crate::nats::serve::Service::readiness`]) its checks are: JetStream
//! streams and consumers validated, connected to NATS, partition leases
//! joined (folder role), no held partition retrying a failed fold or
//! publish. A scrape of `/metrics` first runs the [`Refresh`] hook, which
//! reads the gauges that cost a request (consumer lag, queued jobs), so
//! nothing is polled while nobody scrapes.
//!
//! These endpoints carry no authentication and reveal no conversation data
//! (metric labels are bounded, see [`crate::telemetry`]); still, listen on
//! loopback or a private network. The audit page, merged into the same
//! router by `serve --audit-page`, shows conversations: its routes pass
//! [`access::guard`] (Host, Origin, and a token beyond loopback).

pub mod access;
pub mod audit_page;

use crate::telemetry;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use futures::future::BoxFuture;
use metrics_exporter_prometheus::PrometheusHandle;
use serde::{Deserialize, Serialize};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

/// `[http]`: the operators' HTTP server of `serve`, and who may read the
/// audit page (`serve --audit-page`, `contextfold ui`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpConfig {
    /// Address to listen on (`127.0.0.1:9464`); unset (the default): no
    /// HTTP server. `serve --http ADDR` overrides it. `/metrics`,
    /// `/healthz` and `/readyz` carry no authentication and no conversation
    /// data: keep them on loopback or a private network.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listen: Option<std::net::SocketAddr>,
    /// Host names (or addresses) besides the listen address and
    /// `localhost` under which the audit page may be opened, e.g. the
    /// machine's name or a reverse proxy's (`["audit.internal"]`); a
    /// request naming any other host is refused (DNS rebinding). Default
    /// none.
    pub allowed_hosts: Vec<String>,
    /// Token the audit page and its API require (at least 16 letters,
    /// digits or `-._~`; `CONTEXTFOLD_HTTP__TOKEN`); needed when the page
    /// listens beyond loopback, which is refused without it. Never
    /// printed. Default none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token: Option<crate::secret::Secret>,
}

/// One readiness check.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Check {
    pub name: &'static str,
    pub ok: bool,
    /// What is wrong (or what was seen), for the operator.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub detail: String,
}

impl Check {
    pub fn ok(name: &'static str) -> Self {
        Check {
            name,
            ok: true,
            detail: String::new(),
        }
    }

    pub fn failing(name: &'static str, detail: impl Into<String>) -> Self {
        Check {
            name,
            ok: false,
            detail: detail.into(),
        }
    }
}

/// What `/readyz` answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReadyReport {
    pub ready: bool,
    pub checks: Vec<Check>,
}

impl ReadyReport {
    pub fn new(checks: Vec<Check>) -> Self {
        ReadyReport {
            ready: checks.iter().all(|c| c.ok),
            checks,
        }
    }
}

/// Computes readiness on each `/readyz` request.
pub type ReadyProbe = Arc<dyn Fn() -> ReadyReport + Send + Sync>;

/// Updates the gauges that cost a request, before `/metrics` renders.
pub type Refresh = Arc<dyn Fn() -> BoxFuture<'static, ()> + Send + Sync>;

/// What the router serves.
#[derive(Clone)]
pub struct OpsState {
    /// The installed Prometheus recorder's handle.
    pub metrics: PrometheusHandle,
    pub ready: ReadyProbe,
    pub refresh: Option<Refresh>,
}

/// Why the HTTP server could not run.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error(
        "cannot listen for HTTP on {addr}: {source} (is another process using the port? \
         choose another with --http or [http] listen)"
    )]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("the HTTP server on {addr} stopped: {source}")]
    Serve {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// The router: `/metrics`, `/healthz`, `/readyz`.
pub fn router(state: OpsState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(state)
}

async fn metrics(State(state): State<OpsState>) -> Response {
    if let Some(refresh) = &state.refresh {
        refresh().await;
    }
    telemetry::Readiness {
        ready: (state.ready)().ready,
    }
    .emit();
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics.render(),
    )
        .into_response()
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(state): State<OpsState>) -> Response {
    let report = (state.ready)();
    let status = if report.ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let mut body = serde_json::to_string(&report).unwrap_or_else(|_| "{}".to_string());
    body.push('\n');
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// A bound, not yet serving, HTTP listener.
pub struct HttpListener {
    listener: tokio::net::TcpListener,
    addr: SocketAddr,
}

impl HttpListener {
    /// Binds `addr` (port 0: a free port, see [`HttpListener::local_addr`]).
    pub async fn bind(addr: SocketAddr) -> Result<Self, HttpError> {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| HttpError::Bind { addr, source })?;
        let addr = listener
            .local_addr()
            .map_err(|source| HttpError::Bind { addr, source })?;
        Ok(HttpListener { listener, addr })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Serves `state` until `shutdown` resolves (requests in flight finish).
    pub async fn serve(
        self,
        state: OpsState,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), HttpError> {
        self.serve_router(router(state), shutdown).await
    }

    /// Serves `router` (the operators' [`router`], maybe merged with the
    /// audit page's) until `shutdown` resolves.
    pub async fn serve_router(
        self,
        router: Router,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), HttpError> {
        let addr = self.addr;
        axum::serve(self.listener, router)
            .with_graceful_shutdown(shutdown)
            .await
            .map_err(|source| HttpError::Serve { addr, source })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::Request;
    use metrics_exporter_prometheus::PrometheusBuilder;
    use std::sync::atomic::{AtomicBool, Ordering};
    use tower::ServiceExt;

    async fn call(router: &Router, path: &str) -> (StatusCode, String, String) {
        let resp = router
            .clone()
            .oneshot(Request::get(path).body(Body::empty()).unwrap_or_default())
            .await
            .unwrap_or_else(|e| match e {});
        let status = resp.status();
        let ctype = resp
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .unwrap_or_default();
        (status, ctype, String::from_utf8_lossy(&bytes).into_owned())
    }

    #[tokio::test]
    async fn readyz_follows_the_probe_and_healthz_always_answers() {
        let ready = Arc::new(AtomicBool::new(false));
        let probe: ReadyProbe = {
            let ready = ready.clone();
            Arc::new(move || {
                ReadyReport::new(vec![if ready.load(Ordering::SeqCst) {
                    Check::ok("leases")
                } else {
                    Check::failing("leases", "the first lease round has not completed")
                }])
            })
        };
        let router = router(OpsState {
            metrics: PrometheusBuilder::new().build_recorder().handle(),
            ready: probe,
            refresh: None,
        });
        let (status, _, body) = call(&router, "/healthz").await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "ok\n"));
        let (status, ctype, body) = call(&router, "/readyz").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        assert_eq!(ctype, "application/json");
        assert!(body.contains("first lease round"), "{body}");
        ready.store(true, Ordering::SeqCst);
        let (status, _, body) = call(&router, "/readyz").await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let (status, ctype, _) = call(&router, "/metrics").await;
        assert_eq!(status, StatusCode::OK);
        assert!(ctype.starts_with("text/plain; version=0.0.4"), "{ctype}");
        let (status, _, _) = call(&router, "/nope").await;
        assert_eq!(status, StatusCode::NOT_FOUND);
    }

    #[test]
    fn a_report_is_ready_only_when_every_check_passes() {
        assert!(ReadyReport::new(vec![Check::ok("a"), Check::ok("b")]).ready);
        let r = ReadyReport::new(vec![Check::ok("a"), Check::failing("b", "not yet")]);
        assert!(!r.ready);
        let json = serde_json::to_value(&r).unwrap_or_default();
        assert_eq!(json["checks"][1]["detail"], "not yet");
        assert!(json["checks"][0].get("detail").is_none());
    }
}
