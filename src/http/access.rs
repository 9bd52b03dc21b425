//! Who may read the audit page and its API (`/`, `/app.js`, `/api/…`):
//! they show conversation content, unlike `/metrics`, `/healthz` and
//! `/readyz`, which stay open (they carry no conversation data).
//!
//! Every request of the page passes, in this order:
//!
//! 1. **Host.** The `Host` header (or the URI's authority) must name the
//!    server as it listens: the listen address itself, any IP address when
//!    it listens on all of them (`0.0.0.0`, `::`), a loopback address when
//!    it listens on loopback, the names `localhost` and `*.localhost`
//!    (browsers resolve them to loopback themselves), or a name of
//!    `[http] allowed_hosts`. Anything else is `403`: a web page an
//!    operator visits can point its own name at 127.0.0.1 (DNS
//!    rebinding) and would otherwise read every conversation through the
//!    operator's browser. No port is compared: a rebinding attack needs a
//!    name it controls, never an address.
//! 2. **Origin**, when the request carries one: its host must pass the
//!    same check (`403` otherwise; `Origin: null` included).
//! 3. **Token**, when `[http] token` is set (`CONTEXTFOLD_HTTP__TOKEN`), and
//!    it must be set when the page listens beyond loopback ([`PageAccess::new`]
//!    refuses to start the page otherwise, saying how to set it): the
//!    request carries it as `Authorization: Bearer <token>` or in the
//!    cookie the page sets; `GET /?token=<token>` sets that cookie
//!    (`HttpOnly`, `SameSite=Strict`) and redirects to `/`, so the token
//!    leaves the address bar. A missing or wrong token is `401`, saying
//!    how to give it. Tokens are compared as BLAKE3 digests, whose
//!    equality is constant-time; the token is never logged or echoed.
//!
//! Each refusal is counted (`contextfold_http_requests_refused_total`, by
//! reason) and logged at DEBUG with the path asked.

use crate::http::HttpConfig;
use crate::secret::Secret;
use crate::telemetry::{HttpRefusal, HttpRequestRefused};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

/// The cookie the page keeps its token in.
pub const TOKEN_COOKIE: &str = "contextfold_audit_token";
/// Shortest token accepted: guessable tokens protect nothing.
pub const MIN_TOKEN_CHARS: usize = 16;

/// Why the audit page may not start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AccessError {
    #[error(
        "the audit page would listen on {listen}, beyond loopback, where anyone who reaches the \
         port reads every conversation: set a token of at least {MIN_TOKEN_CHARS} characters \
         ([http] token, or CONTEXTFOLD_HTTP__TOKEN=$(openssl rand -hex 16)) and open \
         http://HOST:PORT/?token=TOKEN once; or listen on 127.0.0.1 and reach it through an SSH \
         tunnel"
    )]
    TokenRequired { listen: SocketAddr },
    #[error(
        "[http] token is {0} characters: use at least {MIN_TOKEN_CHARS} (e.g. `openssl rand -hex \
         16`)"
    )]
    TokenTooShort(usize),
    #[error(
        "[http] token holds characters other than letters, digits and `-._~`: it travels in a \
         URL and a cookie (e.g. `openssl rand -hex 16`)"
    )]
    TokenCharacters,
    #[error(
        "[http] allowed_hosts entry {0:?} is not a host name or address (no scheme, port or path)"
    )]
    Host(String),
}

/// What the audit page lets in (see the module doc).
#[derive(Clone)]
pub struct PageAccess {
    listen: SocketAddr,
    allowed_hosts: Vec<String>,
    token: Option<Arc<blake3::Hash>>,
}

impl std::fmt::Debug for PageAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageAccess")
            .field("listen", &self.listen)
            .field("allowed_hosts", &self.allowed_hosts)
            .field(
                "token",
                &self.token.as_ref().map(|_| crate::secret::REDACTED),
            )
            .finish()
    }
}

impl PageAccess {
    /// The page's access on `listen` (the bound address) under `http`:
    /// refuses a page beyond loopback without a token.
    pub fn new(listen: SocketAddr, http: &HttpConfig) -> Result<PageAccess, AccessError> {
        let token = match &http.token {
            Some(t) if t.expose().chars().count() < MIN_TOKEN_CHARS => {
                return Err(AccessError::TokenTooShort(t.expose().chars().count()))
            }
            Some(t)
                if !t
                    .expose()
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-._~".contains(&b)) =>
            {
                return Err(AccessError::TokenCharacters)
            }
            Some(t) => Some(Arc::new(digest(t))),
            None if !listen.ip().is_loopback() => {
                return Err(AccessError::TokenRequired { listen })
            }
            None => None,
        };
        let mut allowed_hosts = Vec::new();
        for h in &http.allowed_hosts {
            let name = normalize(h);
            if name.is_empty() || name.contains(['/', ' ', '@', '?', '#']) || host_and_port(&name).1
            {
                return Err(AccessError::Host(h.clone()));
            }
            allowed_hosts.push(name);
        }
        Ok(PageAccess {
            listen,
            allowed_hosts,
            token,
        })
    }

    /// Whether a token is required.
    pub fn needs_token(&self) -> bool {
        self.token.is_some()
    }

    /// Whether `host` (a Host header or an authority: name or address,
    /// maybe with a port) names this server.
    pub fn host_allowed(&self, host: &str) -> bool {
        let (name, _) = host_and_port(&normalize(host));
        if name.is_empty() {
            return false;
        }
        if name == "localhost" || name.ends_with(".localhost") {
            return true;
        }
        if let Ok(ip) = name
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<IpAddr>()
        {
            let listen = self.listen.ip();
            return listen.is_unspecified()
                || ip == listen
                || (listen.is_loopback() && ip.is_loopback());
        }
        self.allowed_hosts.iter().any(|h| h == &name)
    }

    fn origin_allowed(&self, origin: &str) -> bool {
        let Some((scheme, rest)) = origin.split_once("://") else {
            return false;
        };
        if !matches!(scheme.to_ascii_lowercase().as_str(), "http" | "https") {
            return false;
        }
        let authority = rest.split('/').next().unwrap_or_default();
        !authority.contains('@') && self.host_allowed(authority)
    }

    fn token_matches(&self, given: &str) -> bool {
        match &self.token {
            // blake3::Hash's equality is constant-time.
            Some(expected) => digest(&Secret::new(given)) == **expected,
            None => true,
        }
    }

    /// The token a request carries: bearer, then cookie.
    fn carried_token(headers: &HeaderMap) -> Option<String> {
        let bearer = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        if let Some(t) = bearer {
            return Some(t.to_string());
        }
        headers
            .get_all(header::COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(';'))
            .filter_map(|c| c.trim().split_once('='))
            .find(|(k, _)| *k == TOKEN_COOKIE)
            .map(|(_, v)| v.to_string())
    }
}

fn digest(token: &Secret) -> blake3::Hash {
    blake3::hash(token.expose().as_bytes())
}

/// Lower case, without a trailing `.` of a fully qualified name.
fn normalize(host: &str) -> String {
    let lower = host.trim().to_ascii_lowercase();
    match lower.rsplit_once(':') {
        Some((name, port)) if !name.contains(':') || name.ends_with(']') => {
            format!("{}:{port}", name.trim_end_matches('.'))
        }
        _ => lower.trim_end_matches('.').to_string(),
    }
}

/// The host of `authority` (`[v6]` keeps its brackets) and whether it
/// carried a port.
fn host_and_port(authority: &str) -> (String, bool) {
    if authority.starts_with('[') {
        return match authority.split_once(']') {
            Some((v6, rest)) => (format!("{v6}]"), rest.starts_with(':')),
            None => (String::new(), false),
        };
    }
    match authority.rsplit_once(':') {
        // A bare IPv6 address has several colons and no port.
        Some(_) if authority.matches(':').count() > 1 => (authority.to_string(), false),
        Some((name, _)) => (name.to_string(), true),
        None => (authority.to_string(), false),
    }
}

fn refuse(reason: HttpRefusal, path: &str, status: StatusCode, message: &str) -> Response {
    HttpRequestRefused {
        reason,
        path: &crate::telemetry::log_excerpt(path, 128),
    }
    .emit();
    let body = serde_json::json!({ "error": message }).to_string();
    (
        status,
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        body,
    )
        .into_response()
}

/// The middleware of the page's router: Host, Origin, token (module doc).
pub async fn guard(State(access): State<PageAccess>, request: Request, next: Next) -> Response {
    let path = request.uri().path().to_string();
    let host = request
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .or_else(|| request.uri().authority().map(|a| a.to_string()));
    if !host.as_deref().is_some_and(|h| access.host_allowed(h)) {
        return refuse(
            HttpRefusal::Host,
            &path,
            StatusCode::FORBIDDEN,
            "the Host header does not name this server: open the page at the address it listens \
             on, localhost, or a name listed in [http] allowed_hosts",
        );
    }
    if let Some(origin) = request.headers().get(header::ORIGIN) {
        if !origin.to_str().is_ok_and(|o| access.origin_allowed(o)) {
            return refuse(
                HttpRefusal::Origin,
                &path,
                StatusCode::FORBIDDEN,
                "cross-site request refused: the Origin is not this server",
            );
        }
    }
    if !access.needs_token() {
        return next.run(request).await;
    }
    if let Some(t) = PageAccess::carried_token(request.headers()) {
        if access.token_matches(&t) {
            return next.run(request).await;
        }
    }
    // `GET /?token=…`: keep it in a cookie and drop it from the address.
    if path == "/" {
        let given = request.uri().query().and_then(|q| {
            q.split('&')
                .filter_map(|kv| kv.split_once('='))
                .find(|(k, _)| *k == "token")
                .map(|(_, v)| v.to_string())
        });
        if let Some(t) = given.filter(|t| access.token_matches(t)) {
            let cookie = format!("{TOKEN_COOKIE}={t}; HttpOnly; SameSite=Strict; Path=/");
            return (
                StatusCode::SEE_OTHER,
                [
                    (header::LOCATION, "/".to_string()),
                    (header::SET_COOKIE, cookie),
                    (header::CACHE_CONTROL, "no-store".to_string()),
                    (header::REFERRER_POLICY, "no-referrer".to_string()),
                ],
            )
                .into_response();
        }
    }
    refuse(
        HttpRefusal::Token,
        &path,
        StatusCode::UNAUTHORIZED,
        "this audit page needs its token ([http] token): open /?token=TOKEN once (it is kept in \
         a cookie), or send `Authorization: Bearer TOKEN`",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn access(
        listen: &str,
        hosts: &[&str],
        token: Option<&str>,
    ) -> Result<PageAccess, AccessError> {
        PageAccess::new(
            listen.parse().unwrap(),
            &HttpConfig {
                allowed_hosts: hosts.iter().map(|h| h.to_string()).collect(),
                token: token.map(Secret::new),
                ..HttpConfig::default()
            },
        )
    }

    #[test]
    fn hosts_name_the_server_as_it_listens() {
        let loopback = access("127.0.0.1:8765", &["audit.internal"], None).unwrap();
        for ok in [
            "127.0.0.1:8765",
            "127.0.0.1",
            "127.0.0.2:8765",
            "[::1]:8765",
            "localhost:8765",
            "LOCALHOST.",
            "app.localhost:1",
            "audit.internal",
            "Audit.Internal.:8765",
        ] {
            assert!(loopback.host_allowed(ok), "{ok}");
        }
        for bad in [
            "attacker.example:8765",
            "attacker.example",
            "10.0.0.5:8765",
            "localhost.attacker.example",
            "",
            "[::1",
        ] {
            assert!(!loopback.host_allowed(bad), "{bad}");
        }
        let any = access("0.0.0.0:9464", &[], Some("0123456789abcdef")).unwrap();
        assert!(any.host_allowed("10.0.0.5:9464"));
        assert!(any.host_allowed("[fe80::1]:9464"));
        assert!(!any.host_allowed("attacker.example:9464"));
        let one = access("10.0.0.5:9464", &[], Some("0123456789abcdef")).unwrap();
        assert!(one.host_allowed("10.0.0.5:9464"));
        assert!(!one.host_allowed("10.0.0.6:9464"));
        assert!(!one.host_allowed("127.0.0.1:9464"));
    }

    #[test]
    fn origins_follow_the_hosts_and_null_is_refused() {
        let a = access("127.0.0.1:8765", &[], None).unwrap();
        assert!(a.origin_allowed("http://127.0.0.1:8765"));
        assert!(a.origin_allowed("http://localhost:8765"));
        assert!(!a.origin_allowed("http://attacker.example"));
        assert!(!a.origin_allowed("null"));
        assert!(!a.origin_allowed("file://"));
        assert!(!a.origin_allowed("http://127.0.0.1@attacker.example"));
    }

    #[test]
    fn beyond_loopback_a_token_is_required_and_checked() {
        let err = access("0.0.0.0:8765", &[], None).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("CONTEXTFOLD_HTTP__TOKEN"), "{text}");
        assert!(matches!(
            access("0.0.0.0:8765", &[], Some("short")),
            Err(AccessError::TokenTooShort(5))
        ));
        assert!(matches!(
            access("0.0.0.0:8765", &[], Some("0123456789abcdef;x=1")),
            Err(AccessError::TokenCharacters)
        ));
        assert!(matches!(
            access("127.0.0.1:1", &["http://x"], None),
            Err(AccessError::Host(_))
        ));
        assert!(matches!(
            access("127.0.0.1:1", &["x:80"], None),
            Err(AccessError::Host(_))
        ));
        let a = access("0.0.0.0:8765", &[], Some("0123456789abcdef")).unwrap();
        assert!(a.needs_token());
        assert!(a.token_matches("0123456789abcdef"));
        assert!(!a.token_matches("0123456789abcdeF"));
        assert!(!a.token_matches(""));
        assert!(!format!("{a:?}").contains("0123456789abcdef"));
        assert!(!access("127.0.0.1:1", &[], None).unwrap().needs_token());
    }

    #[test]
    fn the_token_travels_as_bearer_or_cookie() {
        let mut h = HeaderMap::new();
        assert_eq!(PageAccess::carried_token(&h), None);
        h.insert(
            header::COOKIE,
            "a=b; contextfold_audit_token=t1; c=d".parse().unwrap(),
        );
        assert_eq!(PageAccess::carried_token(&h).as_deref(), Some("t1"));
        h.insert(header::AUTHORIZATION, "Bearer t2".parse().unwrap());
        assert_eq!(PageAccess::carried_token(&h).as_deref(), Some("t2"));
    }
}
