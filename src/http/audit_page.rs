//! The audit page: a small static page (HTML and vanilla JavaScript, in
//! the binary) over JSON endpoints, for `contextfold ui` (the embedded
//! store, or a deployment with `--nats`) and `serve --http ADDR
//! --audit-page` (beside `/metrics`).
//!
//! | path | answers |
//! |---|---|
//! | `GET /` | the page; `#c=CONV&event=ID` selects a conversation and clicks an event (`&summary=ID`: and a summary of the DAG); `#q=TEXT&sort=S&page=N` searches, sorts and turns the list's pages |
//! | `GET /api/conversations?q=&sort=key\|health\|recent&offset=N&limit=N` | one page of the conversation list ([`list`]: searched, naturally sorted, paged, with the count of all) |
//! | `GET /api/audit?c=CONV` | the audit ([`crate::core::audit::Audit`], each entry with its `sentence`, as `contextfold audit` prints it, each chart point with its type's `label` ([`crate::core::event::EventKind::label`]) and whether it `sets_scale`), the summary DAG, and the chart's scale (`chart_top`) |
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

pub mod list;

use crate::http::access::{guard, PageAccess};
use crate::runtime::audit::Audited;
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
    /// Every conversation's key, in any order.
    fn conversation_keys(&self) -> Result<Vec<String>, PageError>;
    /// The list rows of `keys` (from each one's `status`), in any order; a
    /// key without a row is listed as unknown.
    fn rows(&self, keys: &[String]) -> Result<Vec<list::Row>, PageError>;
    /// The audit and the summary DAG of one conversation.
    fn audit(&self, conversation: &str) -> Result<Audited, PageError>;
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
    fn conversation_keys(&self) -> Result<Vec<String>, PageError> {
        self.get()?.conversation_keys()
    }
    fn rows(&self, keys: &[String]) -> Result<Vec<list::Row>, PageError> {
        self.get()?.rows(keys)
    }
    fn audit(&self, conversation: &str) -> Result<Audited, PageError> {
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
}

/// What the router holds: the source, and the list rows read for sorts.
#[derive(Clone)]
struct PageState {
    source: Source,
    rows: Arc<list::RowCache>,
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
        .with_state(PageState {
            source,
            rows: Arc::default(),
        })
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

fn failed(e: impl std::fmt::Display) -> PageError {
    PageError::Failed(e.to_string())
}

async fn conversations(
    State(state): State<PageState>,
    Query(query): Query<list::ListQuery>,
) -> Response {
    let cache = state.rows.clone();
    json_of(state.source, move |s| {
        let keys = s.conversation_keys()?;
        let page = list::page(keys, &query, |keys| cache.rows(keys, |k| s.rows(k)))?;
        serde_json::to_value(page).map_err(failed)
    })
    .await
}

/// The audit as the page reads it: every entry with its sentence, every
/// point with its type's label and whether its levels set the chart's
/// scale, the DAG, and the top of the chart's y-axis
/// ([`crate::plot::chart_top`]). The page keeps no table of event types
/// of its own.
pub fn audit_json(a: &Audited) -> Result<serde_json::Value, PageError> {
    let mut audit = serde_json::to_value(&a.audit).map_err(failed)?;
    if let Some(points) = audit
        .get_mut("points")
        .and_then(serde_json::Value::as_array_mut)
    {
        for (json, point) in points.iter_mut().zip(&a.audit.points) {
            if let Some(obj) = json.as_object_mut() {
                obj.insert("label".into(), point.event_type.label().into());
                obj.insert("sets_scale".into(), crate::plot::sets_scale(point).into());
            }
        }
    }
    if let Some(entries) = audit
        .get_mut("entries")
        .and_then(serde_json::Value::as_array_mut)
    {
        for (json, entry) in entries.iter_mut().zip(&a.audit.entries) {
            if let Some(obj) = json.as_object_mut() {
                obj.insert(
                    "sentence".into(),
                    crate::audit_text::sentence(&entry.what).into(),
                );
            }
        }
    }
    Ok(serde_json::json!({
        "audit": audit,
        "dag": a.dag,
        "chart_top": crate::plot::chart_top(&a.audit),
    }))
}

async fn audit(State(state): State<PageState>, Query(p): Query<Params>) -> Response {
    json_of(state.source, move |s| {
        audit_json(&s.audit(&Params::need(&p.c, "c")?)?)
    })
    .await
}

async fn context(State(state): State<PageState>, Query(p): Query<Params>) -> Response {
    json_of(state.source, move |s| {
        s.context_at(&Params::need(&p.c, "c")?, &Params::need(&p.at, "at")?)
    })
    .await
}

async fn describe(State(state): State<PageState>, Query(p): Query<Params>) -> Response {
    json_of(state.source, move |s| {
        s.describe(&Params::need(&p.c, "c")?, &Params::need(&p.id, "id")?)
    })
    .await
}

async fn expand(State(state): State<PageState>, Query(p): Query<Params>) -> Response {
    json_of(state.source, move |s| {
        s.expand(
            &Params::need(&p.c, "c")?,
            &Params::need(&p.id, "id")?,
            p.skip,
        )
    })
    .await
}

async fn plot(State(state): State<PageState>, Query(p): Query<Params>) -> Response {
    let source = state.source;
    let joined = tokio::task::spawn_blocking(move || {
        let a = source.audit(&Params::need(&p.c, "c")?)?;
        crate::plot::svg(&a.audit, &a.dag).map_err(failed)
    })
    .await;
    match joined {
        Ok(Ok(svg)) => ([(header::CONTENT_TYPE, "image/svg+xml")], svg).into_response(),
        Ok(Err(e)) => error_response(e),
        Err(e) => error_response(PageError::Failed(format!("the request failed: {e}"))),
    }
}
