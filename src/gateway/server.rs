//! The HTTP server: one handler for every path.
//!
//! `POST /v1/chat/completions`, `/v1/responses` and `/v1/messages` are
//! read (surface.rs), keyed (keying.rs), their new turns handed to the
//! store, rebuilt past the budget (rewrite.rs) and forwarded; the response
//! streams back through the tee (tee.rs) and its turn is stored when it
//! ends. `POST /v1/responses/compact` and Codex's compaction requests are
//! answered here (compaction.rs). `GET /contextfold/v1/report` is the
//! report (shadow.rs), `/contextfold/v1/healthz` and `/readyz` the
//! gateway's health. Every other path goes upstream unchanged.
//!
//! What a request does to the store, in order: a body that cannot be read
//! gets a provider-shaped 400 and stores nothing; the request's new items
//! are handed to the store before the upstream is called (a retry
//! republishes them under the same ids: nothing changes); the response's
//! turn is handed over when its stream ends (cut short: marked aborted).
//! An upstream error stores nothing more; an overflow among them is
//! recorded as `provider_error_observed`.

use crate::config::{GatewayConfig, GatewayMode, StoreUnavailable};
use crate::core::derived_id::DerivedId;
use crate::core::event::{
    CompactionRequested, Envelope, EventBody, ProviderErrorObserved, TurnAppended,
};
use crate::core::overflow;
use crate::core::tokens;
use crate::gateway::compaction;
use crate::gateway::item_memo::{ItemMemo, DEFAULT_MEMO_BYTES};
use crate::gateway::keying::{self, Hints, Index, Resolution};
use crate::gateway::rewrite;
use crate::gateway::shadow::{Ledger, Observed};
use crate::gateway::store::{Store, SummaryBlock};
use crate::gateway::surface::{self, Canon, ErrorKind, ItemKind, Parsed, Surface};
use crate::gateway::tee::{self, Tee};
use crate::gateway::upstream::{forwardable_response_header, Upstream};
use crate::secret::Secret;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use serde_json::Value;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::Semaphore;

/// Response headers the gateway adds.
pub const CONVERSATION_HEADER: &str = "x-contextfold-conversation";
pub const KEYED_BY_HEADER: &str = "x-contextfold-keyed-by";
pub const CONTEXT_HEADER: &str = "x-contextfold-context";
pub const TOKENS_HEADER: &str = "x-contextfold-tokens";
/// Microseconds the gateway spent before calling the upstream.
pub const ADDED_HEADER: &str = "x-contextfold-added-us";
/// Request header: the gateway key of a tenant.
pub const KEY_HEADER: &str = "x-contextfold-key";

/// A tenant, as requests find it.
pub struct Tenant {
    pub name: String,
    /// `""` (the only tenant) or `<name>/`.
    pub prefix: String,
    pub credential: Option<Secret>,
    key: Option<Secret>,
    slots: Arc<Semaphore>,
}

/// The usage the last response of a conversation reported, and the
/// budget a Codex compaction set for it.
type UsageSeen = (u64, Option<u64>);

/// Everything the handler shares.
pub struct Gateway {
    pub config: GatewayConfig,
    /// The budget when `[gateway] budget_tokens` is not set.
    pub policy_budget: u64,
    pub store: Store,
    pub index: Index,
    pub ledger: Ledger,
    upstream: Upstream,
    tenants: Vec<Arc<Tenant>>,
    canon: quick_cache::sync::Cache<[u8; 32], Arc<Canon>>,
    /// Each conversation's last request, by its items' bytes.
    memo: ItemMemo,
    rest_tokens: quick_cache::sync::Cache<[u8; 16], u64>,
    /// Per conversation: the usage the last response reported, and the
    /// budget a Codex compaction set (compaction.rs).
    usage: Mutex<HashMap<Arc<str>, UsageSeen>>,
    /// Responses streaming whose turn is not handed to the store yet.
    in_flight: std::sync::atomic::AtomicU64,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn error(surface: Surface, kind: ErrorKind, message: &str) -> Response {
    let mut r = Response::new(Body::from(surface.error_body(kind, message)));
    *r.status_mut() = StatusCode::from_u16(kind.status()).unwrap_or(StatusCode::BAD_REQUEST);
    r.headers_mut()
        .insert("content-type", HeaderValue::from_static("application/json"));
    r
}

fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty())
}

impl Gateway {
    pub fn new(
        config: GatewayConfig,
        policy_budget: u64,
        store: Store,
    ) -> Result<Gateway, crate::gateway::upstream::UpstreamError> {
        let upstream = Upstream::new(&config)?;
        let slots = config.max_in_flight_per_tenant;
        let tenants = if config.tenants.is_empty() {
            vec![Arc::new(Tenant {
                name: "default".into(),
                prefix: String::new(),
                credential: None,
                key: None,
                slots: Arc::new(Semaphore::new(slots)),
            })]
        } else {
            config
                .tenants
                .iter()
                .map(|t| {
                    Arc::new(Tenant {
                        name: t.name.clone(),
                        prefix: format!("{}/", t.name),
                        credential: t.upstream_api_key.clone(),
                        key: Some(t.key.clone()),
                        slots: Arc::new(Semaphore::new(slots)),
                    })
                })
                .collect()
        };
        let index = Index::with_max_turns(config.keying_max_turns);
        Ok(Gateway {
            config,
            policy_budget,
            store,
            index,
            ledger: Ledger::default(),
            upstream,
            tenants,
            canon: quick_cache::sync::Cache::new(200_000),
            memo: ItemMemo::new(DEFAULT_MEMO_BYTES),
            rest_tokens: quick_cache::sync::Cache::new(10_000),
            usage: Mutex::new(HashMap::new()),
            in_flight: std::sync::atomic::AtomicU64::new(0),
        })
    }

    pub fn upstream(&self) -> &Upstream {
        &self.upstream
    }

    /// The tenant a request belongs to, and whether its own credential
    /// header was the gateway key (then it does not go upstream).
    fn tenant(&self, headers: &HeaderMap) -> Option<(Arc<Tenant>, bool)> {
        if self.config.tenants.is_empty() {
            return self.tenants.first().map(|t| (t.clone(), false));
        }
        let presented = [
            (header_str(headers, KEY_HEADER), false),
            (
                header_str(headers, "authorization").and_then(|a| a.strip_prefix("Bearer ")),
                true,
            ),
            (header_str(headers, "x-api-key"), true),
        ];
        for (key, is_credential) in presented {
            let Some(key) = key else { continue };
            if let Some(t) = self
                .tenants
                .iter()
                .find(|t| t.key.as_ref().is_some_and(|k| k.expose() == key))
            {
                return Some((t.clone(), is_credential));
            }
        }
        None
    }

    fn budget(&self, conversation: &str) -> u64 {
        let base = self.config.budget_tokens.unwrap_or(self.policy_budget);
        let set = self
            .usage
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(conversation)
            .and_then(|(_, b)| *b);
        set.map_or(base, |b| b.min(base))
    }

    fn canonical(
        &self,
        surface: Surface,
        raw: &str,
        enc: tokens::Encoding,
    ) -> Result<Arc<Canon>, String> {
        let mut h = blake3::Hasher::new();
        h.update(&[surface as u8, enc as u8]);
        h.update(raw.as_bytes());
        let key = *h.finalize().as_bytes();
        if let Some(c) = self.canon.get(&key) {
            return Ok(c);
        }
        let c = Arc::new(surface::canonicalize(surface, raw, enc)?);
        self.canon.insert(key, c.clone());
        Ok(c)
    }

    fn rest_tokens(&self, body: &[u8], parsed: &Parsed<'_>, enc: tokens::Encoding) -> u64 {
        if let Some(t) = self.rest_tokens.get(&parsed.rest_digest) {
            return t;
        }
        let text = match &parsed.items_span {
            Some(span) => {
                let mut s = String::from_utf8_lossy(&body[..span.start]).into_owned();
                s.push_str(&String::from_utf8_lossy(&body[span.end..]));
                s
            }
            None => String::from_utf8_lossy(body).into_owned(),
        };
        let t = tokens::count_text(enc, &text);
        self.rest_tokens.insert(parsed.rest_digest, t);
        t
    }
}

/// The router: every path to `handle`.
pub fn router(gw: Arc<Gateway>) -> axum::Router {
    axum::Router::new()
        .fallback(handle)
        .with_state(gw)
        .layer(tower_http::decompression::RequestDecompressionLayer::new())
}

async fn handle(State(gw): State<Arc<Gateway>>, req: Request) -> Response {
    let started = Instant::now();
    let (parts, body) = req.into_parts();
    let path = parts.uri.path().to_string();
    let path_and_query = parts
        .uri
        .path_and_query()
        .map_or_else(|| path.clone(), |p| p.as_str().to_string());
    let surface = (parts.method == Method::POST)
        .then(|| Surface::of_path(&path))
        .flatten();
    let shape = surface.unwrap_or(if path.contains("messages") {
        Surface::Messages
    } else {
        Surface::Chat
    });
    match (parts.method.as_str(), path.as_str()) {
        ("GET", "/contextfold/v1/report") => {
            let mode = match gw.config.mode {
                GatewayMode::Active => "active",
                GatewayMode::Shadow => "shadow",
            };
            let body = serde_json::to_vec_pretty(&gw.ledger.report(mode)).unwrap_or_default();
            return json_response(StatusCode::OK, body);
        }
        ("GET", "/contextfold/v1/metrics") => {
            let text = crate::telemetry::install_prometheus()
                .map(|h| h.render())
                .unwrap_or_else(|e| format!("# metrics unavailable: {e}\n"));
            let mut r = Response::new(Body::from(text));
            r.headers_mut().insert(
                "content-type",
                HeaderValue::from_static("text/plain; version=0.0.4"),
            );
            return r;
        }
        ("GET", "/contextfold/v1/healthz") => {
            return json_response(StatusCode::OK, b"{\"ok\":true}".to_vec())
        }
        ("GET", "/contextfold/v1/readyz") => {
            let ready = gw.store.reachable();
            let in_flight = gw.in_flight.load(std::sync::atomic::Ordering::SeqCst);
            let pending = gw.store.pending();
            let body = serde_json::json!({
                "ready": ready || gw.config.on_store_unavailable == StoreUnavailable::FailOpen,
                "store": gw.store.kind,
                "store_reachable": ready,
                "spooled": gw.store.spool.as_ref().map_or(0, |s| s.len()),
                "responses_in_flight": in_flight,
                "turns_pending": pending,
                "settled": in_flight == 0 && pending == 0,
                "conversations": gw.index.conversations(),
            });
            let status = if ready || gw.config.on_store_unavailable == StoreUnavailable::FailOpen {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            return json_response(status, body.to_string().into_bytes());
        }
        _ => {}
    }
    // A WebSocket upgrade (Codex tries one first for Responses): the
    // gateway speaks HTTP; 426 sends the client to it at once.
    if header_str(&parts.headers, "upgrade").is_some_and(|u| u.eq_ignore_ascii_case("websocket")) {
        let mut r = error(
            shape,
            ErrorKind::InvalidRequest,
            "the contextfold gateway serves HTTP, not WebSocket: send the request over HTTP",
        );
        *r.status_mut() = StatusCode::UPGRADE_REQUIRED;
        return r;
    }
    let Some((tenant, key_is_credential)) = gw.tenant(&parts.headers) else {
        return error(
            shape,
            ErrorKind::Unauthorized,
            "no gateway key: present a tenant's key in x-contextfold-key (or as the API key)",
        );
    };
    let body = match axum::body::to_bytes(body, gw.config.max_body_bytes).await {
        Ok(b) => b,
        Err(_) => {
            crate::telemetry::GatewayRequest {
                surface: shape.as_str(),
                outcome: "rejected",
                added: started.elapsed(),
            }
            .emit();
            return error(
                shape,
                ErrorKind::TooLarge,
                &format!(
                    "request body is larger than the gateway's limit of {} bytes (or could not be read)",
                    gw.config.max_body_bytes
                ),
            );
        }
    };
    let mut headers = parts.headers;
    if key_is_credential {
        headers.remove("authorization");
        headers.remove("x-api-key");
    }
    let ctx = Ctx {
        gw: gw.clone(),
        tenant,
        headers,
        path_and_query,
        started,
    };
    if parts.method == Method::POST
        && (path == "/v1/responses/compact" || path == "/responses/compact")
    {
        return compact_endpoint(ctx, body);
    }
    match surface {
        Some(s) => surface_request(ctx, s, body).await,
        None => forward_plain(ctx, parts.method, body).await,
    }
}

fn json_response(status: StatusCode, body: Vec<u8>) -> Response {
    let mut r = Response::new(Body::from(body));
    *r.status_mut() = status;
    r.headers_mut()
        .insert("content-type", HeaderValue::from_static("application/json"));
    r
}

struct Ctx {
    gw: Arc<Gateway>,
    tenant: Arc<Tenant>,
    headers: HeaderMap,
    path_and_query: String,
    started: Instant,
}

async fn forward_plain(ctx: Ctx, method: Method, body: Bytes) -> Response {
    let permit = ctx.tenant.slots.clone().acquire_owned().await;
    let sent = ctx
        .gw
        .upstream
        .send(
            None,
            method,
            &ctx.path_and_query,
            &ctx.headers,
            body,
            ctx.tenant.credential.as_ref(),
        )
        .await;
    drop(permit);
    match sent {
        Ok(r) => passthrough(r, None),
        Err(e) => upstream_unreachable(Surface::Chat, &e),
    }
}

fn upstream_unreachable(surface: Surface, e: &reqwest::Error) -> Response {
    crate::telemetry::GatewayUpstreamError {
        surface: surface.as_str(),
        class: if e.is_timeout() {
            "timeout"
        } else {
            "unreachable"
        },
    }
    .emit();
    let mut r = error(
        surface,
        ErrorKind::UpstreamUnreachable,
        &format!(
            "the gateway could not reach the upstream: {}",
            crate::secret::redact_url(&e.to_string())
        ),
    );
    if e.is_timeout() {
        *r.status_mut() = StatusCode::GATEWAY_TIMEOUT;
    }
    r
}

/// The upstream's response as it comes, with `extra` headers, teed when
/// `tee` is given.
fn passthrough(r: reqwest::Response, tee: Option<(usize, tee::OnDone)>) -> Response {
    let status = r.status();
    let mut out = Response::builder().status(status.as_u16());
    for (name, value) in r.headers() {
        if forwardable_response_header(name) {
            out = out.header(name, value);
        }
    }
    let stream = Box::pin(r.bytes_stream());
    let body = match tee {
        Some((limit, on_done)) => Body::from_stream(Tee::new(stream, limit, on_done)),
        None => Body::from_stream(stream),
    };
    out.body(body)
        .unwrap_or_else(|_| Response::new(Body::from("gateway: bad upstream response headers")))
}

/// What the request path decided.
struct Decision {
    body: Bytes,
    /// "forwarded", "assembled" or "expanded".
    context: &'static str,
    sent_tokens: u64,
    block: Option<Arc<SummaryBlock>>,
    active_tokens: Option<u64>,
    /// What the assembled prefix is made of (the block's summaries, or the
    /// summary the client kept): a change is a new prompt-cache prefix.
    prefix_key: Vec<String>,
}

fn turn_event(
    conv: &str,
    id: String,
    message: crate::core::message::ChatMessage,
    model: Option<String>,
    meta: serde_json::Map<String, Value>,
    usage: Option<crate::core::event::ProviderUsage>,
) -> Envelope {
    Envelope::new(
        id,
        conv,
        now_ms(),
        EventBody::TurnAppended(TurnAppended {
            message,
            model,
            sender: Some("contextfold-gateway".into()),
            usage,
            metadata: if meta.is_empty() { None } else { Some(meta) },
        }),
    )
}

fn gateway_meta(surface: Surface) -> serde_json::Map<String, Value> {
    let mut m = serde_json::Map::new();
    m.insert("gateway_surface".into(), Value::from(surface.as_str()));
    m
}

async fn surface_request(ctx: Ctx, surface: Surface, body: Bytes) -> Response {
    let gw = ctx.gw.clone();
    let parsed = match surface::parse(surface, &body) {
        Ok(p) => p,
        Err(e) => {
            crate::telemetry::GatewayRequest {
                surface: surface.as_str(),
                outcome: "rejected",
                added: ctx.started.elapsed(),
            }
            .emit();
            return error(surface, ErrorKind::InvalidRequest, &e.to_string());
        }
    };
    let enc = tokens::Encoding::for_model(parsed.model.as_deref());
    let raws: Vec<&str> = parsed.items.iter().map(|r| r.get()).collect();
    let memo_key = ItemMemo::key(&ctx.tenant.prefix, surface, enc, &raws);
    let memo = memo_key.and_then(|k| gw.memo.get(&k));
    let mut canons = Vec::with_capacity(parsed.items.len() + 1);
    for (i, raw) in raws.iter().enumerate() {
        let known = memo.as_ref().and_then(|m| m.canon(i, raw));
        match known.map_or_else(|| gw.canonical(surface, raw, enc), Ok) {
            Ok(c) => canons.push(c),
            Err(reason) => {
                return error(
                    surface,
                    ErrorKind::InvalidRequest,
                    &format!("item {i} of the conversation: {reason}"),
                )
            }
        }
    }
    if let Some(key) = memo_key {
        gw.memo.put(key, &body, &raws, &canons);
    }
    let input_text_item = parsed.input_text.as_deref().map(surface::input_text_item);
    if let Some(item) = &input_text_item {
        match gw.canonical(surface, item, enc) {
            Ok(c) => canons.push(c),
            Err(reason) => return error(surface, ErrorKind::InvalidRequest, &reason),
        }
    }
    if gw.store.kind == "nats"
        && !gw.store.reachable()
        && gw.config.on_store_unavailable == StoreUnavailable::Refuse
    {
        crate::telemetry::GatewayRequest {
            surface: surface.as_str(),
            outcome: "refused",
            added: ctx.started.elapsed(),
        }
        .emit();
        let mut r = error(
            surface,
            ErrorKind::Unavailable,
            "contextfold's store (NATS) is unreachable and the gateway is set to refuse \
             ([gateway] on_store_unavailable = \"refuse\"); retry later",
        );
        r.headers_mut()
            .insert("retry-after", HeaderValue::from_static("5"));
        return r;
    }
    let hints = Hints {
        explicit: header_str(&ctx.headers, CONVERSATION_HEADER)
            .map(str::to_string)
            .or(parsed.metadata_conversation.clone()),
        previous_response_id: parsed.previous_response_id.clone(),
        harness: header_str(&ctx.headers, "session-id")
            .or_else(|| header_str(&ctx.headers, "session_id"))
            .or_else(|| header_str(&ctx.headers, "x-claude-code-session-id"))
            .map(|s| format!("session-{s}")),
    };
    let Some(res) = gw.index.resolve(&ctx.tenant.prefix, &hints, &canons) else {
        // No turn at all (only system items): nothing to store or key.
        return forward(
            ctx,
            surface,
            &parsed,
            body.clone(),
            None,
            Decision {
                sent_tokens: 0,
                context: "forwarded",
                block: None,
                active_tokens: None,
                prefix_key: Vec::new(),
                body: body.clone(),
            },
        )
        .await;
    };
    let conv = res.conversation.clone();
    let turn_metadata = header_str(&ctx.headers, "x-codex-turn-metadata").map(str::to_string);
    let codex_compaction = compaction::is_codex_compaction(turn_metadata.as_deref())
        || (surface == Surface::Messages && compaction::is_claude_code_compaction(&canons));
    let trigger = canons
        .last()
        .is_some_and(|c| c.kind == ItemKind::CompactionTrigger);
    let active = gw.config.mode == GatewayMode::Active;

    // The request's new turns, before anything else can fail.
    let mut events = Vec::new();
    for &i in &res.new_items {
        let (Some(chain), c) = (res.prevs[i], &canons[i]) else {
            continue;
        };
        if codex_compaction
            && c.kind == ItemKind::User
            && c.messages
                .iter()
                .any(|m| compaction::is_harness_prompt(&m.text_content()))
        {
            continue;
        }
        for (n, m) in c.messages.iter().enumerate() {
            events.push(turn_event(
                &conv,
                keying::event_id(&conv, &chain, n),
                m.clone(),
                parsed.model.clone(),
                gateway_meta(surface),
                None,
            ));
        }
    }
    if surface == Surface::Responses {
        merge_calls(&mut events);
    }
    let published = events.len();
    gw.store.publish(events);
    crate::telemetry::GatewayTurnsPublished { turns: published }.emit();

    let client_tokens =
        gw.rest_tokens(&body, &parsed, enc) + canons.iter().map(|c| c.tokens).sum::<u64>();
    let head = rewrite::head_len(surface, &canons);
    let block = gw.store.blocks.get(&conv);
    let tail = block
        .as_deref()
        .and_then(|b| rewrite::tail_start(&canons, head, b));

    if active && (trigger || codex_compaction) {
        return answer_compaction(
            &ctx,
            surface,
            &parsed,
            &res,
            &canons,
            block.as_deref(),
            tail,
            trigger,
            client_tokens,
        );
    }

    let decision = decide(
        &gw,
        surface,
        &body,
        &parsed,
        &canons,
        &res,
        head,
        block,
        tail,
        client_tokens,
    );
    gw.ledger.observe(
        &conv,
        Observed {
            client_tokens,
            sent_tokens: decision.sent_tokens,
            active: decision
                .active_tokens
                .map(|t| (t, decision.prefix_key.as_slice())),
        },
    );
    if decision.context == "assembled" {
        crate::telemetry::GatewayTokensSaved {
            surface: surface.as_str(),
            tokens: client_tokens.saturating_sub(decision.sent_tokens),
        }
        .emit();
    }
    let _ = input_text_item;
    forward(ctx, surface, &parsed, body.clone(), Some(res), decision).await
}

/// What goes upstream (module doc of rewrite.rs).
#[allow(clippy::too_many_arguments)]
fn decide(
    gw: &Gateway,
    surface: Surface,
    body: &Bytes,
    parsed: &Parsed<'_>,
    canons: &[Arc<Canon>],
    res: &Resolution,
    head: usize,
    block: Option<Arc<SummaryBlock>>,
    tail: Option<usize>,
    client_tokens: u64,
) -> Decision {
    let active = gw.config.mode == GatewayMode::Active;
    let budget = gw.budget(&res.conversation);
    let rest = client_tokens - canons.iter().map(|c| c.tokens).sum::<u64>();
    let mut decision = Decision {
        body: body.clone(),
        context: "forwarded",
        sent_tokens: client_tokens,
        block: block.clone(),
        active_tokens: None,
        prefix_key: Vec::new(),
    };
    let Some(span) = parsed.items_span.clone() else {
        return decision;
    };
    if parsed.previous_response_id.is_some() {
        // The upstream holds the history: nothing to rebuild.
        return decision;
    }
    // A contextfold summary the client kept (Codex): what precedes it is
    // covered by it; a compaction handle is expanded for the upstream.
    let boundary = canons.iter().rposition(|c| c.summary_of.is_some());
    let expansions: Vec<Option<String>> = parsed
        .items
        .iter()
        .map(|r| {
            if surface == Surface::Responses && r.get().contains(surface::COMPACTION_HANDLE_PREFIX)
            {
                compaction::expanded(r.get())
            } else {
                None
            }
        })
        .collect();
    let item_str = |i: usize| -> &str { expansions[i].as_deref().unwrap_or(parsed.items[i].get()) };
    let over = client_tokens > budget;
    if over {
        if let (Some(b), Some(t)) = (&block, tail) {
            if boundary.is_none_or(|k| t > k) {
                let kept: u64 = canons[..head]
                    .iter()
                    .chain(&canons[t..])
                    .map(|c| c.tokens)
                    .sum();
                let tokens = rest + kept + b.tokens;
                if tokens < client_tokens {
                    decision.active_tokens = Some(tokens);
                    decision.prefix_key = b.summary_ids.clone();
                    if active {
                        let items: Vec<&str> = (0..head)
                            .map(&item_str)
                            .chain(std::iter::once(b.item(surface)))
                            .chain((t..parsed.items.len()).map(&item_str))
                            .collect();
                        decision.body = Bytes::from(rebuild_items(body, &span, &items));
                        decision.context = "assembled";
                        decision.sent_tokens = tokens;
                    }
                    return decision;
                }
            }
        }
        if let Some(k) = boundary {
            if k >= head {
                let kept: u64 = canons[..head]
                    .iter()
                    .chain(&canons[k..])
                    .map(|c| c.tokens)
                    .sum();
                let tokens = rest + kept;
                if tokens < client_tokens {
                    decision.active_tokens = Some(tokens);
                    decision.block = None;
                    decision.prefix_key = vec![canons[k]
                        .digest
                        .iter()
                        .map(|b| format!("{b:02x}"))
                        .collect()];
                    if active {
                        let items: Vec<&str> = (0..head)
                            .chain(k..parsed.items.len())
                            .map(&item_str)
                            .collect();
                        decision.body = Bytes::from(rebuild_items(body, &span, &items));
                        decision.context = "assembled";
                        decision.sent_tokens = tokens;
                    }
                    return decision;
                }
            }
        }
    }
    if active && expansions.iter().any(Option::is_some) {
        let items: Vec<&str> = (0..parsed.items.len()).map(&item_str).collect();
        decision.body = Bytes::from(rebuild_items(body, &span, &items));
        decision.context = "expanded";
    }
    decision
}

fn rebuild_items(body: &[u8], span: &std::ops::Range<usize>, items: &[&str]) -> Vec<u8> {
    let len: usize = items.iter().map(|s| s.len() + 1).sum();
    let mut out = Vec::with_capacity(body.len() - span.len() + len + 2);
    out.extend_from_slice(&body[..span.start]);
    out.push(b'[');
    for (i, s) in items.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(s.as_bytes());
    }
    out.push(b']');
    out.extend_from_slice(&body[span.end..]);
    out
}

async fn forward(
    ctx: Ctx,
    surface: Surface,
    parsed: &Parsed<'_>,
    original: Bytes,
    res: Option<Resolution>,
    decision: Decision,
) -> Response {
    let gw = ctx.gw.clone();
    let added = ctx.started.elapsed();
    let permit = ctx.tenant.slots.clone().acquire_owned().await;
    let sent = gw
        .upstream
        .send(
            Some(surface),
            Method::POST,
            &ctx.path_and_query,
            &ctx.headers,
            decision.body.clone(),
            ctx.tenant.credential.as_ref(),
        )
        .await;
    let r = match sent {
        Ok(r) => r,
        Err(e) => {
            drop(permit);
            return upstream_unreachable(surface, &e);
        }
    };
    let status = r.status();
    if !status.is_success() {
        // The error, passed back as the provider shaped it (Retry-After and
        // all), after recording an overflow.
        let headers = r.headers().clone();
        let bytes = r.bytes().await.unwrap_or_default();
        drop(permit);
        let text = String::from_utf8_lossy(&bytes);
        let verdict = overflow::classify(&text);
        let class = if verdict.overflow {
            "overflow"
        } else if status.as_u16() == 429 {
            "rate_limited"
        } else if status.is_client_error() {
            "client_error"
        } else {
            "server_error"
        };
        crate::telemetry::GatewayUpstreamError {
            surface: surface.as_str(),
            class,
        }
        .emit();
        if let (true, Some(res)) = (verdict.overflow, &res) {
            let turn_id = keying::event_id(&res.conversation, &res.tail.1, 0);
            let id = DerivedId::GatewayOverflow { turn_id: &turn_id }.to_string();
            gw.store.publish(vec![Envelope::new(
                id,
                &*res.conversation,
                now_ms(),
                EventBody::ProviderErrorObserved(ProviderErrorObserved {
                    error: text.chars().take(4000).collect(),
                    model: parsed.model.clone(),
                }),
            )]);
            if gw.config.retry_overflow && decision.context != "assembled" {
                if let Some(retry) = overflow_retry(&gw, surface, parsed, &original, res).await {
                    let permit = ctx.tenant.slots.clone().acquire_owned().await;
                    let again = gw
                        .upstream
                        .send(
                            Some(surface),
                            Method::POST,
                            &ctx.path_and_query,
                            &ctx.headers,
                            retry,
                            ctx.tenant.credential.as_ref(),
                        )
                        .await;
                    drop(permit);
                    if let Ok(r) = again {
                        if r.status().is_success() {
                            return stream_back(
                                gw,
                                surface,
                                parsed,
                                Some(res.clone()),
                                r,
                                "assembled",
                                added,
                            );
                        }
                    }
                }
            }
        }
        let mut out = Response::builder().status(status.as_u16());
        for (name, value) in &headers {
            if forwardable_response_header(name) {
                out = out.header(name, value);
            }
        }
        crate::telemetry::GatewayRequest {
            surface: surface.as_str(),
            outcome: "upstream_error",
            added,
        }
        .emit();
        return out
            .body(Body::from(bytes))
            .unwrap_or_else(|_| Response::new(Body::empty()));
    }
    let context = decision.context;
    let mut resp = stream_back(gw, surface, parsed, res, r, context, added);
    drop(permit);
    if let Ok(v) = HeaderValue::from_str(&decision.sent_tokens.to_string()) {
        resp.headers_mut().insert(TOKENS_HEADER, v);
    }
    resp
}

/// The assembled body for a retry after an overflow, when a block can
/// stand for the history.
async fn overflow_retry(
    gw: &Gateway,
    surface: Surface,
    parsed: &Parsed<'_>,
    original: &Bytes,
    res: &Resolution,
) -> Option<Bytes> {
    // The fold forces a compaction on the overflow; give it a moment.
    gw.store.flush().await;
    let block = gw.store.blocks.get(&res.conversation)?;
    let enc = tokens::Encoding::for_model(parsed.model.as_deref());
    let canons: Vec<Arc<Canon>> = parsed
        .items
        .iter()
        .filter_map(|r| gw.canonical(surface, r.get(), enc).ok())
        .collect();
    let head = rewrite::head_len(surface, &canons);
    let tail = rewrite::tail_start(&canons, head, &block)?;
    let span = parsed.items_span.clone()?;
    Some(Bytes::from(rewrite::rebuild(
        original,
        &span,
        &parsed.items,
        head,
        block.item(surface),
        tail,
    )))
}

fn stream_back(
    gw: Arc<Gateway>,
    surface: Surface,
    parsed: &Parsed<'_>,
    res: Option<Resolution>,
    r: reqwest::Response,
    context: &'static str,
    added: std::time::Duration,
) -> Response {
    crate::telemetry::GatewayRequest {
        surface: surface.as_str(),
        outcome: context,
        added,
    }
    .emit();
    let is_sse = r
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| t.starts_with("text/event-stream"));
    let stream = parsed.stream || is_sse;
    let model = parsed.model.clone();
    let conv_header = res.as_ref().map(|r| (r.conversation.clone(), r.keyed_by));
    let limit = gw.config.max_stored_response_bytes;
    let tee = res.map(|res| {
        let gw = gw.clone();
        gw.in_flight
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let on_done: tee::OnDone = Box::new(move |bytes, complete| {
            let work = move || {
                store_response(&gw, surface, stream, &bytes, complete, &res, model);
                gw.in_flight
                    .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
            };
            // Before the client sees the end of the response: its next
            // request (`previous_response_id`, the answer in its history)
            // finds this one registered. Handing turns to the store never
            // waits.
            work();
        });
        (limit, on_done)
    });
    let mut resp = passthrough(r, tee);
    if let Some((conv, by)) = conv_header {
        if let Ok(v) = HeaderValue::from_str(&conv) {
            resp.headers_mut().insert(CONVERSATION_HEADER, v);
        }
        resp.headers_mut()
            .insert(KEYED_BY_HEADER, HeaderValue::from_static(by.as_str()));
    }
    resp.headers_mut()
        .insert(CONTEXT_HEADER, HeaderValue::from_static(context));
    if let Ok(v) = HeaderValue::from_str(&added.as_micros().to_string()) {
        resp.headers_mut().insert(ADDED_HEADER, v);
    }
    resp
}

/// The response's items, stored as turns (module doc of tee.rs).
fn store_response(
    gw: &Gateway,
    surface: Surface,
    stream: bool,
    bytes: &[u8],
    complete: bool,
    res: &Resolution,
    model: Option<String>,
) {
    let done = tee::completed(surface, stream, bytes);
    if done.items.is_empty() {
        return;
    }
    let enc = tokens::Encoding::for_model(model.as_deref());
    let mut tail = res.tail;
    let mut events = Vec::new();
    let last = done.items.len() - 1;
    for (k, item) in done.items.iter().enumerate() {
        let Ok(c) = gw.canonical(surface, item, enc) else {
            continue;
        };
        let id = if k == last {
            done.response_id.as_deref()
        } else {
            None
        };
        let before = tail.1;
        let Some(chain) = gw
            .index
            .append_response(&res.conversation, tail, &c.digest, id)
        else {
            // Another answer is stored here already (a retry).
            return;
        };
        for (n, m) in c.messages.iter().enumerate() {
            let mut meta = gateway_meta(surface);
            if !complete {
                meta.insert("aborted".into(), Value::Bool(true));
            }
            if let Some(id) = &done.response_id {
                meta.insert("response_id".into(), Value::from(id.as_str()));
            }
            events.push(turn_event(
                &res.conversation,
                keying::event_id(&res.conversation, &before, n),
                m.clone(),
                done.model.clone().or(model.clone()),
                meta,
                if k == last { done.usage } else { None },
            ));
        }
        tail = (tail.0 + 1, chain);
    }
    if let Some(total) = done.usage.and_then(|u| u.total_tokens.or(u.prompt_tokens)) {
        let mut usage = gw.usage.lock().unwrap_or_else(|p| p.into_inner());
        let entry = usage.entry(res.conversation.clone()).or_insert((0, None));
        entry.0 = total;
    }
    if surface == Surface::Responses {
        merge_calls(&mut events);
    }
    let n = events.len();
    gw.store.publish(events);
    crate::telemetry::GatewayTurnsPublished { turns: n }.emit();
}

/// Responses lists parallel calls as one item each; a stored turn holds
/// them together (one assistant turn, its results after it), as the other
/// surfaces do and as tool pairing expects. The turn keeps the first
/// call's id, so either side storing the same calls stores one turn.
fn merge_calls(events: &mut Vec<Envelope>) {
    fn calls_only(e: &Envelope) -> bool {
        matches!(&e.body, EventBody::TurnAppended(t)
            if t.message.role == crate::core::message::Role::Assistant
                && t.message.content.is_none()
                && !t.message.tool_calls.is_empty())
    }
    let mut out: Vec<Envelope> = Vec::with_capacity(events.len());
    for e in events.drain(..) {
        if calls_only(&e) && out.last().is_some_and(calls_only) {
            if let (Some(prev), EventBody::TurnAppended(t)) = (out.last_mut(), e.body) {
                if let EventBody::TurnAppended(p) = &mut prev.body {
                    p.message.tool_calls.extend(t.message.tool_calls);
                    if p.usage.is_none() {
                        p.usage = t.usage;
                    }
                }
            }
            continue;
        }
        out.push(e);
    }
    *events = out;
}

#[allow(clippy::too_many_arguments)]
fn answer_compaction(
    ctx: &Ctx,
    surface: Surface,
    parsed: &Parsed<'_>,
    res: &Resolution,
    canons: &[Arc<Canon>],
    block: Option<&SummaryBlock>,
    tail: Option<usize>,
    trigger: bool,
    client_tokens: u64,
) -> Response {
    let gw = &ctx.gw;
    let conv = &res.conversation;
    let text = compaction::summary_text(conv, canons, block, tail);
    // Codex compacted at the usage it last saw: keep what goes upstream
    // under 80% of it from now on.
    {
        let mut usage = gw.usage.lock().unwrap_or_else(|p| p.into_inner());
        let entry = usage.entry(conv.clone()).or_insert((0, None));
        let seen = if entry.0 > 0 { entry.0 } else { client_tokens };
        entry.1 = Some((seen * 4 / 5).max(1));
    }
    // The store compacts too, so later blocks cover what this summary does.
    gw.store.publish(vec![Envelope::new(
        DerivedId::GatewayCompaction {
            turn_id: &keying::event_id(conv, &res.tail.1, 0),
        }
        .to_string(),
        &**conv,
        now_ms(),
        EventBody::CompactionRequested(CompactionRequested::default()),
    )]);
    let id = format!("resp_cf{}", &keying::event_id(conv, &res.tail.1, 0)[2..]).replace('.', "_");
    let model = parsed.model.clone().unwrap_or_default();
    let text_tokens = tokens::count_text(tokens::Encoding::O200kBase, &text);
    let (bytes, content_type) = match (surface, trigger) {
        (Surface::Responses, true) => compaction::responses_answer(
            &id,
            &model,
            vec![compaction::compaction_item(
                &format!("cmp{}", &id[4..]),
                conv,
                &text,
            )],
            text_tokens,
            parsed.stream,
        ),
        (Surface::Responses, false) => compaction::responses_answer(
            &id,
            &model,
            vec![compaction::checkpoint_item(
                &format!("msg{}", &id[4..]),
                &text,
            )],
            text_tokens,
            parsed.stream,
        ),
        (Surface::Messages, _) => compaction::messages_answer(
            &id,
            &model,
            // Claude Code keeps what is inside <summary>.
            &format!("<summary>\n{text}\n</summary>"),
            text_tokens,
            parsed.stream,
        ),
        _ => {
            // Chat has no compaction contract: a plain answer.
            let v = serde_json::json!({
                    "id": id, "object": "chat.completion", "model": model,
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": text}}],
                    "usage": {"prompt_tokens": text_tokens, "completion_tokens": 0, "total_tokens": text_tokens},
            });
            (v.to_string().into_bytes(), "application/json")
        }
    };
    crate::telemetry::GatewayRequest {
        surface: surface.as_str(),
        outcome: "answered",
        added: ctx.started.elapsed(),
    }
    .emit();
    crate::telemetry::GatewayCompactionAnswered {
        surface: surface.as_str(),
    }
    .emit();
    gw.ledger.compaction_answered(conv);
    let mut r = Response::new(Body::from(bytes));
    r.headers_mut()
        .insert("content-type", HeaderValue::from_static(content_type));
    if let Ok(v) = HeaderValue::from_str(conv) {
        r.headers_mut().insert(CONVERSATION_HEADER, v);
    }
    r.headers_mut()
        .insert(CONTEXT_HEADER, HeaderValue::from_static("compaction"));
    r
}

/// `POST /v1/responses/compact`: the history in `input`, one
/// `compaction` item back.
fn compact_endpoint(ctx: Ctx, body: Bytes) -> Response {
    let surface = Surface::Responses;
    let parsed = match surface::parse(surface, &body) {
        Ok(p) => p,
        Err(e) => return error(surface, ErrorKind::InvalidRequest, &e.to_string()),
    };
    let enc = tokens::Encoding::for_model(parsed.model.as_deref());
    let mut canons = Vec::new();
    for (i, raw) in parsed.items.iter().enumerate() {
        match ctx.gw.canonical(surface, raw.get(), enc) {
            Ok(c) => canons.push(c),
            Err(reason) => {
                return error(
                    surface,
                    ErrorKind::InvalidRequest,
                    &format!("item {i}: {reason}"),
                )
            }
        }
    }
    let hints = Hints {
        explicit: header_str(&ctx.headers, CONVERSATION_HEADER).map(str::to_string),
        previous_response_id: None,
        harness: header_str(&ctx.headers, "session-id").map(|s| format!("session-{s}")),
    };
    let Some(res) = ctx.gw.index.resolve(&ctx.tenant.prefix, &hints, &canons) else {
        return error(
            surface,
            ErrorKind::InvalidRequest,
            "`input` holds no conversation to compact",
        );
    };
    let block = ctx.gw.store.blocks.get(&res.conversation);
    let head = rewrite::head_len(surface, &canons);
    let tail = block
        .as_deref()
        .and_then(|b| rewrite::tail_start(&canons, head, b));
    let text = compaction::summary_text(&res.conversation, &canons, block.as_deref(), tail);
    let id = format!(
        "cmp{}",
        &keying::event_id(&res.conversation, &res.tail.1, 0)[2..]
    )
    .replace('.', "_");
    let tokens = canons.iter().map(|c| c.tokens).sum();
    crate::telemetry::GatewayCompactionAnswered {
        surface: surface.as_str(),
    }
    .emit();
    let mut r = json_response(
        StatusCode::OK,
        compaction::compact_endpoint_answer(&id, &res.conversation, &text, tokens),
    );
    if let Ok(v) = HeaderValue::from_str(&res.conversation) {
        r.headers_mut().insert(CONVERSATION_HEADER, v);
    }
    r
}
