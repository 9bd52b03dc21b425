//! The audit page: a small static page (HTML and vanilla JavaScript, in
//! the binary) over JSON endpoints, for `contextfold ui` (the embedded
//! store, or a deployment with `--nats`) and `serve --http ADDR
//! --audit-page` (beside `/metrics`).
//!
//! | path | answers |
//! |---|---|
//! | `GET /` | the page; `#c=CONV&event=ID` selects a conversation and clicks an event (`&summary=ID`: and a summary of the DAG) |
//! | `GET /api/conversations` | every conversation's `status` (health, tokens, summaries) |
//! | `GET /api/audit?c=CONV` | the audit ([`crate::core::audit::Audit`]) and the summary DAG |
//! | `GET /api/context?c=CONV&at=ID` | what the model saw after event ID: `assemble --at ID --json` |
//! | `GET /api/describe?c=CONV&id=ID` | a summary, or a turn by event id or number (`describe`) |
//! | `GET /api/expand?c=CONV&id=SUMMARY&skip=N` | the children or raw turns under a summary (`expand`) |
//! | `GET /api/plot.svg?c=CONV` | the picture of `contextfold plot` |
//!
//! What answers is an [`AuditSource`]; its calls block (they fold a log),
//! so each runs on the blocking pool. The page shows conversation content:
//! every route passes [`crate::http::access::guard`] (a Host naming the
//! server, a same-site Origin, and the token when one is set, which it
//! must be beyond loopback).

use crate::http::access::{guard, PageAccess};
use axum::extract::{Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use serde::Deserialize;
use std::sync::Arc;

const INDEX_HTML: &str = include_str!("audit_page/index.html");
const APP_JS: &str = include_str!("audit_page/app.js");

/// Why a request of the page failed.
#[derive(Debug, thiserror::Error)]
pub enum PageError {
    /// Unknown conversation, event or summary.
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Failed(String),
}

/// What the page reads. Every call may block.
pub trait AuditSource: Send + Sync + 'static {
    /// Each conversation's `status` answer, in key order.
    fn conversations(&self) -> Result<serde_json::Value, PageError>;
    /// `{"audit": Audit, "dag": Dag}` of one conversation.
    fn audit(&self, conversation: &str) -> Result<serde_json::Value, PageError>;
    /// The assembled context after event `at` (what `assemble --at` prints).
    fn context_at(&self, conversation: &str, at: &str) -> Result<serde_json::Value, PageError>;
    /// The `describe` answer for `id`.
    fn describe(&self, conversation: &str, id: &str) -> Result<serde_json::Value, PageError>;
    /// The `expand` answer for summary `id`.
    fn expand(
        &self,
        conversation: &str,
        id: &str,
        skip: usize,
    ) -> Result<serde_json::Value, PageError>;
    /// The SVG of `contextfold plot`.
    fn plot(&self, conversation: &str) -> Result<String, PageError>;
}

type Source = Arc<dyn AuditSource>;

/// A source set once it can be had (`serve` mounts the page before it has
/// reached NATS); until then every request says so.
#[derive(Default)]
pub struct Late(std::sync::RwLock<Option<Source>>);

impl Late {
    pub fn set(&self, source: Source) {
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = Some(source);
    }

    fn get(&self) -> Result<Source, PageError> {
        self.0
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| {
                PageError::Failed("not connected to NATS yet: try again in a moment".into())
            })
    }
}

impl AuditSource for Late {
    fn conversations(&self) -> Result<serde_json::Value, PageError> {
        self.get()?.conversations()
    }
    fn audit(&self, conversation: &str) -> Result<serde_json::Value, PageError> {
        self.get()?.audit(conversation)
    }
    fn context_at(&self, conversation: &str, at: &str) -> Result<serde_json::Value, PageError> {
        self.get()?.context_at(conversation, at)
    }
    fn describe(&self, conversation: &str, id: &str) -> Result<serde_json::Value, PageError> {
        self.get()?.describe(conversation, id)
    }
    fn expand(
        &self,
        conversation: &str,
        id: &str,
        skip: usize,
    ) -> Result<serde_json::Value, PageError> {
        self.get()?.expand(conversation, id, skip)
    }
    fn plot(&self, conversation: &str) -> Result<String, PageError> {
        self.get()?.plot(conversation)
    }
}

/// The page's router over `source`, behind `access`.
pub fn router(source: Source, access: PageAccess) -> Router {
    Router::new()
        .route("/", get(index))
        .route("/app.js", get(app_js))
        .route("/api/conversations", get(conversations))
        .route("/api/audit", get(audit))
        .route("/api/context", get(context))
        .route("/api/describe", get(describe))
        .route("/api/expand", get(expand))
        .route("/api/plot.svg", get(plot))
        .with_state(source)
        .layer(axum::middleware::from_fn_with_state(access, guard))
}

async fn index() -> Response {
    (
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        INDEX_HTML,
    )
        .into_response()
}

async fn app_js() -> Response {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        APP_JS,
    )
        .into_response()
}

#[derive(Debug, Deserialize)]
struct Params {
    c: Option<String>,
    at: Option<String>,
    id: Option<String>,
    #[serde(default)]
    skip: usize,
}

impl Params {
    fn need(value: &Option<String>, name: &str) -> Result<String, PageError> {
        value
            .clone()
            .filter(|v| !v.is_empty())
            .ok_or_else(|| PageError::NotFound(format!("the query parameter {name} is missing")))
    }
}

fn error_response(e: PageError) -> Response {
    let status = match e {
        PageError::NotFound(_) => StatusCode::NOT_FOUND,
        PageError::Failed(_) => StatusCode::INTERNAL_SERVER_ERROR,
    };
    let body = serde_json::json!({ "error": e.to_string() }).to_string();
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// Runs `f` on the blocking pool and answers its JSON.
async fn json_of<F>(source: Source, f: F) -> Response
where
    F: FnOnce(&dyn AuditSource) -> Result<serde_json::Value, PageError> + Send + 'static,
{
    let joined = tokio::task::spawn_blocking(move || f(source.as_ref())).await;
    match joined {
        Ok(Ok(value)) => (
            [(header::CONTENT_TYPE, "application/json")],
            value.to_string(),
        )
            .into_response(),
        Ok(Err(e)) => error_response(e),
        Err(e) => error_response(PageError::Failed(format!("the request failed: {e}"))),
    }
}

async fn conversations(State(source): State<Source>) -> Response {
    json_of(source, |s| s.conversations()).await
}

async fn audit(State(source): State<Source>, Query(p): Query<Params>) -> Response {
    json_of(source, move |s| s.audit(&Params::need(&p.c, "c")?)).await
}

async fn context(State(source): State<Source>, Query(p): Query<Params>) -> Response {
    json_of(source, move |s| {
        s.context_at(&Params::need(&p.c, "c")?, &Params::need(&p.at, "at")?)
    })
    .await
}

async fn describe(State(source): State<Source>, Query(p): Query<Params>) -> Response {
    json_of(source, move |s| {
        s.describe(&Params::need(&p.c, "c")?, &Params::need(&p.id, "id")?)
    })
    .await
}

async fn expand(State(source): State<Source>, Query(p): Query<Params>) -> Response {
    json_of(source, move |s| {
        s.expand(
            &Params::need(&p.c, "c")?,
            &Params::need(&p.id, "id")?,
            p.skip,
        )
    })
    .await
}

async fn plot(State(source): State<Source>, Query(p): Query<Params>) -> Response {
    let joined = tokio::task::spawn_blocking(move || source.plot(&Params::need(&p.c, "c")?)).await;
    match joined {
        Ok(Ok(svg)) => ([(header::CONTENT_TYPE, "image/svg+xml")], svg).into_response(),
        Ok(Err(e)) => error_response(e),
        Err(e) => error_response(PageError::Failed(format!("the request failed: {e}"))),
    }
}
