//! The upstream provider: where each path goes, which headers go with it,
//! and the credential it is sent with.
//!
//! Every request header goes on except the hop-by-hop ones, `host`,
//! `content-length` and `content-encoding` (the body may have been
//! decompressed or rebuilt), `accept-encoding` (the gateway reads the
//! response it passes on, so it asks for it uncompressed) and every
//! `x-contextfold-*` header. A tenant that holds its own upstream
//! credential has it replace the client's `Authorization` (OpenAI) or
//! `x-api-key` (Anthropic); it is never logged. Response headers come back
//! the same way, `retry-after` and the provider's rate-limit headers
//! included.

use crate::config::GatewayConfig;
use crate::gateway::surface::Surface;
use crate::secret::Secret;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method};
use bytes::Bytes;
use std::time::Duration;

/// Why the upstream could not be configured.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("no upstream: set `[gateway] upstream` or pass --upstream URL")]
    Missing,
    #[error("building the HTTP client: {0}")]
    Client(#[source] reqwest::Error),
}

pub struct Upstream {
    client: reqwest::Client,
    default: Option<String>,
    chat: Option<String>,
    responses: Option<String>,
    messages: Option<String>,
}

fn trim(url: &Option<String>) -> Option<String> {
    url.as_ref().map(|u| u.trim_end_matches('/').to_string())
}

/// Whether a request header goes upstream (module doc).
pub fn forwardable_request_header(name: &HeaderName) -> bool {
    let n = name.as_str();
    !(is_hop_by_hop(n)
        || n == "host"
        || n == "content-length"
        || n == "content-encoding"
        || n == "accept-encoding"
        || n.starts_with("x-contextfold-"))
}

/// Whether a response header goes back to the client.
pub fn forwardable_response_header(name: &HeaderName) -> bool {
    let n = name.as_str();
    !(is_hop_by_hop(n) || n == "content-length")
}

fn is_hop_by_hop(n: &str) -> bool {
    matches!(
        n,
        "connection"
            | "keep-alive"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
    )
}

impl Upstream {
    pub fn new(config: &GatewayConfig) -> Result<Upstream, UpstreamError> {
        if config.upstream.is_none()
            && (config.upstream_chat.is_none()
                || config.upstream_responses.is_none()
                || config.upstream_messages.is_none())
        {
            return Err(UpstreamError::Missing);
        }
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_millis(config.upstream_connect_timeout_ms))
            .timeout(Duration::from_millis(config.upstream_timeout_ms))
            .pool_max_idle_per_host(64)
            .tcp_nodelay(true)
            .build()
            .map_err(UpstreamError::Client)?;
        Ok(Upstream {
            client,
            default: trim(&config.upstream),
            chat: trim(&config.upstream_chat),
            responses: trim(&config.upstream_responses),
            messages: trim(&config.upstream_messages),
        })
    }

    /// The base URL for a surface (or for any other path).
    pub fn base(&self, surface: Option<Surface>) -> Option<&str> {
        let specific = match surface {
            Some(Surface::Chat) => self.chat.as_deref(),
            Some(Surface::Responses) => self.responses.as_deref(),
            Some(Surface::Messages) => self.messages.as_deref(),
            None => None,
        };
        specific
            .or(self.default.as_deref())
            .or(self.chat.as_deref())
    }

    /// Sends a request upstream; the response is not read.
    pub async fn send(
        &self,
        surface: Option<Surface>,
        method: Method,
        path_and_query: &str,
        headers: &HeaderMap,
        body: Bytes,
        credential: Option<&Secret>,
    ) -> Result<reqwest::Response, reqwest::Error> {
        let base = self.base(surface).unwrap_or_default();
        let url = format!("{base}{path_and_query}");
        let mut out = HeaderMap::with_capacity(headers.len());
        for (name, value) in headers {
            if forwardable_request_header(name) {
                out.append(name.clone(), value.clone());
            }
        }
        if let Some(key) = credential {
            if let Ok(v) = HeaderValue::from_str(key.expose()) {
                let mut v = v;
                v.set_sensitive(true);
                if out.contains_key("x-api-key") || surface == Some(Surface::Messages) {
                    out.insert("x-api-key", v);
                    out.remove(axum::http::header::AUTHORIZATION);
                } else if let Ok(mut bearer) =
                    HeaderValue::from_str(&format!("Bearer {}", key.expose()))
                {
                    bearer.set_sensitive(true);
                    out.insert(axum::http::header::AUTHORIZATION, bearer);
                }
            }
        }
        self.client
            .request(method, url)
            .headers(out)
            .body(body)
            .send()
            .await
    }

    /// `GET` the upstream's model list: what `doctor` checks.
    pub async fn check(&self, credential: Option<&Secret>) -> Result<u16, String> {
        let mut headers = HeaderMap::new();
        if let Ok(v) = std::env::var("OPENAI_API_KEY") {
            if let Ok(h) = HeaderValue::from_str(&format!("Bearer {v}")) {
                headers.insert(axum::http::header::AUTHORIZATION, h);
            }
        }
        match self
            .send(
                None,
                Method::GET,
                "/v1/models",
                &headers,
                Bytes::new(),
                credential,
            )
            .await
        {
            Ok(r) => Ok(r.status().as_u16()),
            Err(e) => Err(crate::secret::redact_url(&e.to_string())),
        }
    }
}
