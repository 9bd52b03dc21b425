//! Connection options for real deployments (`[nats.connection]`): several
//! server URLs, credentials, TLS, a connection name and reconnect
//! behaviour, turned into [`async_nats::ConnectOptions`].
//!
//! # Credentials
//!
//! A connection authenticates one way, given by exactly one of: `user` and
//! `password`; `token`; `nkey_seed` or `nkey_seed_file` (an NKey user
//! seed); `credentials_file` (a `.creds` file: user JWT and NKey seed); or
//! the userinfo of the server URLs (`nats://user:password@host` gives a user
//! and password, `nats://token@host` a token, as other NATS clients read
//! them). async-nats itself ignores URL userinfo, so it is taken out of
//! the URLs here and passed as the credentials it is. Two ways at once, or
//! URLs carrying different credentials, are refused naming both: a client
//! sends the same credentials to every server, and guessing which was meant
//! would hide a mistake.
//!
//! Passwords, tokens and seeds are [`Secret`]s (printed and serialized as
//! `***`), and every URL is printed through [`redact_url`]: the start line
//! of `serve`, connect errors and `contextfold config` never show them.
//!
//! # Permissions
//!
//! Replies to requests (API answers, JetStream acknowledgements) come back
//! on `<inbox_prefix>.<random>`, `_INBOX` by default. A user allowed to
//! subscribe to `_INBOX.>` receives every other user's replies in its
//! account, so an agent's user is given its own prefix (`_INBOX.<agent>`,
//! set here as `inbox_prefix`) and may subscribe only below it
//! (docs/subjects.md, "Permissions"). Anything the server refuses (a
//! publish or subscription outside the user's permissions) is logged as a
//! warning naming the subject: the server reports it only asynchronously,
//! and the operation it broke shows up later as a timeout.

use crate::nats::version::{check_server, ServerVersion};
use crate::nats::NatsError;
use crate::secret::{redact_url, redact_urls, split_userinfo, Secret, UrlCredentials};
use async_nats::{ConnectErrorKind, ConnectOptions, ServerAddr};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// TLS settings. TLS is used when the URL is `tls://`, when the server
/// demands it, or when `require_tls` is set.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TlsOptions {
    /// Refuse to talk to a server without TLS. Default false.
    pub require_tls: bool,
    /// PEM file of CA certificates to trust for the server (in addition to
    /// the system roots).
    pub root_ca: Option<PathBuf>,
    /// PEM client certificate for mutual TLS (needs `client_key`).
    pub client_cert: Option<PathBuf>,
    /// PEM private key of `client_cert`.
    pub client_key: Option<PathBuf>,
    /// Start TLS before the server's INFO (servers configured
    /// `handshake_first`). Default false.
    pub handshake_first: bool,
}

/// How to reach and authenticate to the NATS servers. `Debug` shows the
/// URLs redacted and the secrets as `***`.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NatsOptions {
    /// Server URLs (`nats://host:4222`, `tls://host:4222`); the client
    /// fails over between them and the servers the cluster advertises.
    /// Userinfo (`nats://user:password@host`, `nats://token@host`) is used
    /// as the credentials (see the module doc). Default
    /// `["nats://127.0.0.1:4222"]`.
    pub servers: Vec<String>,
    /// Connection name shown in server monitoring. Default `contextfold`.
    pub name: Option<String>,
    /// User for user/password authentication (with `password`).
    pub user: Option<String>,
    /// Password of `user`. Never printed.
    pub password: Option<Secret>,
    /// Authentication token (`authorization { token: ... }` on the
    /// server). Never printed.
    pub token: Option<Secret>,
    /// An NKey user seed (`SU...`) itself, for deployments that pass
    /// secrets as environment variables. Never printed.
    pub nkey_seed: Option<Secret>,
    /// A `.creds` file (user JWT + NKey seed), as `nsc` generates.
    pub credentials_file: Option<PathBuf>,
    /// A file holding an NKey user seed (`SU...`).
    pub nkey_seed_file: Option<PathBuf>,
    /// Prefix of the subjects replies come back on (`_INBOX` when unset),
    /// e.g. `_INBOX.agent-7`, for a user permitted to subscribe only to
    /// `_INBOX.agent-7.>`: see the module doc.
    pub inbox_prefix: Option<String>,
    pub tls: TlsOptions,
    /// Time allowed to open one connection. Default 5000.
    pub connect_timeout_ms: u64,
    /// Time allowed for a request/reply, JetStream API calls included.
    /// Default 10000.
    pub request_timeout_ms: u64,
    /// How often the client pings the server to notice a dead connection.
    /// Default 20000.
    pub ping_interval_ms: u64,
    /// Reconnect attempts before giving up; none means for ever (a service
    /// should outlive a server restart). Default none.
    pub max_reconnects: Option<usize>,
    /// Upper bound of the exponential delay between reconnect attempts.
    /// Default 4000.
    pub reconnect_delay_max_ms: u64,
    /// Keep retrying when no server is up at start, instead of failing.
    /// Default false (a misconfigured URL should fail fast).
    pub retry_on_initial_connect: bool,
    /// Use only `servers`, not the servers a cluster advertises (for
    /// clients behind NAT or a proxy). Default false.
    pub ignore_discovered_servers: bool,
}

impl Default for NatsOptions {
    fn default() -> Self {
        NatsOptions {
            servers: vec!["nats://127.0.0.1:4222".to_string()],
            name: Some("contextfold".to_string()),
            user: None,
            password: None,
            token: None,
            nkey_seed: None,
            credentials_file: None,
            nkey_seed_file: None,
            inbox_prefix: None,
            tls: TlsOptions::default(),
            connect_timeout_ms: 5_000,
            request_timeout_ms: 10_000,
            ping_interval_ms: 20_000,
            max_reconnects: None,
            reconnect_delay_max_ms: 4_000,
            retry_on_initial_connect: false,
            ignore_discovered_servers: false,
        }
    }
}

fn read_secret(path: &Path, what: &'static str) -> Result<String, NatsError> {
    std::fs::read_to_string(path).map_err(|source| NatsError::File {
        what,
        path: path.to_path_buf(),
        source,
    })
}

fn require_file(path: &Path, what: &'static str) -> Result<(), NatsError> {
    std::fs::metadata(path)
        .map(|_| ())
        .map_err(|source| NatsError::File {
            what,
            path: path.to_path_buf(),
            source,
        })
}

impl fmt::Debug for NatsOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsOptions")
            .field("servers", &self.display_servers())
            .field("name", &self.name)
            .field("user", &self.user)
            .field("password", &self.password)
            .field("token", &self.token)
            .field("nkey_seed", &self.nkey_seed)
            .field("credentials_file", &self.credentials_file)
            .field("nkey_seed_file", &self.nkey_seed_file)
            .field("inbox_prefix", &self.inbox_prefix)
            .field("tls", &self.tls)
            .field("connect_timeout_ms", &self.connect_timeout_ms)
            .field("request_timeout_ms", &self.request_timeout_ms)
            .field("ping_interval_ms", &self.ping_interval_ms)
            .field("max_reconnects", &self.max_reconnects)
            .field("reconnect_delay_max_ms", &self.reconnect_delay_max_ms)
            .field("retry_on_initial_connect", &self.retry_on_initial_connect)
            .field("ignore_discovered_servers", &self.ignore_discovered_servers)
            .finish()
    }
}

/// The one way a connection authenticates (see the module doc). `Debug`
/// names the way, never the secret.
#[derive(Clone, PartialEq, Eq)]
pub enum Auth {
    None,
    UserPassword { user: String, password: Secret },
    Token(Secret),
    NkeySeed(Secret),
    NkeySeedFile(PathBuf),
    CredentialsFile(PathBuf),
}

impl From<UrlCredentials> for Auth {
    fn from(c: UrlCredentials) -> Auth {
        match c {
            UrlCredentials::UserPassword { user, password } => {
                Auth::UserPassword { user, password }
            }
            UrlCredentials::Token(token) => Auth::Token(token),
        }
    }
}

impl fmt::Debug for Auth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe())
    }
}

impl Auth {
    /// The secret this way of authenticating holds (a password, token,
    /// seed or credentials file), as bytes: what keys an agent's message
    /// ids (`nats::msg_id`), so that only the holder can compute them.
    /// Empty for [`Auth::None`].
    pub fn identity_secret(&self) -> Result<Vec<u8>, NatsError> {
        let read = |path: &PathBuf| {
            std::fs::read(path).map_err(|e| NatsError::Config {
                field: "credentials",
                reason: format!("cannot read {}: {e}", path.display()),
            })
        };
        Ok(match self {
            Auth::None => Vec::new(),
            Auth::UserPassword { user, password } => {
                [user.as_bytes(), &[0], password.expose().as_bytes()].concat()
            }
            Auth::Token(t) => t.expose().as_bytes().to_vec(),
            Auth::NkeySeed(s) => s.expose().as_bytes().to_vec(),
            Auth::NkeySeedFile(p) | Auth::CredentialsFile(p) => read(p)?,
        })
    }

    /// What was offered, for messages: never the secret itself.
    pub fn describe(&self) -> String {
        match self {
            Auth::None => "no credentials".to_string(),
            Auth::UserPassword { user, .. } => format!("user {user:?} and its password"),
            Auth::Token(_) => "the token given".to_string(),
            Auth::NkeySeed(_) => "the NKey seed given".to_string(),
            Auth::NkeySeedFile(p) => format!("the NKey seed in {}", p.display()),
            Auth::CredentialsFile(p) => format!("the credentials in {}", p.display()),
        }
    }
}

/// How to give credentials, for the message of a refused connection.
const HOW_TO_AUTHENTICATE: &str = "give them with --user and --password, --token, --creds FILE \
     or --nkey FILE, in [nats.connection] (user/password, token, nkey_seed, nkey_seed_file, \
     credentials_file, or CONTEXTFOLD_NATS__CONNECTION__<KEY>), or in the URL \
     (nats://user:password@host, nats://token@host)";

/// A connect error in words that say what to fix, without any secret.
fn connect_detail(err: &async_nats::ConnectError, auth: &Auth) -> String {
    match err.kind() {
        ConnectErrorKind::AuthorizationViolation => match auth {
            Auth::None => format!(
                "the server requires credentials (authorization violation) and none were \
                 given: {HOW_TO_AUTHENTICATE}"
            ),
            other => format!(
                "the server refused {} (authorization violation): check them, or {}",
                other.describe(),
                HOW_TO_AUTHENTICATE
            ),
        },
        ConnectErrorKind::Authentication => format!(
            "could not sign the server's challenge with {}: is it a valid NKey user seed (SU...)?",
            auth.describe()
        ),
        _ => err.to_string(),
    }
}

impl NatsOptions {
    /// Options for a plain connection to `servers` with defaults otherwise.
    pub fn with_servers<I, S>(servers: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        NatsOptions {
            servers: servers.into_iter().map(Into::into).collect(),
            ..NatsOptions::default()
        }
    }

    /// The server URLs as they may be printed (credentials as `***`).
    pub fn display_servers(&self) -> String {
        redact_urls(&self.servers)
    }

    /// The server list, parsed and without userinfo. Accepts
    /// comma-separated URLs inside one entry, as the `--nats` flag and
    /// `NATS_URL` conventionally do.
    pub fn server_addrs(&self) -> Result<Vec<ServerAddr>, NatsError> {
        self.resolve().map(|(addrs, _)| addrs)
    }

    /// The servers (without userinfo) and the one way to authenticate:
    /// the explicit options or the URLs' userinfo, refusing two at once.
    pub fn resolve(&self) -> Result<(Vec<ServerAddr>, Auth), NatsError> {
        let bad = |field: &'static str, reason: String| NatsError::Config { field, reason };
        let mut addrs = Vec::new();
        // The first URL with credentials, redacted, and what it carries.
        let mut in_urls: Option<(String, UrlCredentials)> = None;
        for entry in self
            .servers
            .iter()
            .flat_map(|s| s.split(','))
            .map(str::trim)
            .filter(|s| !s.is_empty())
        {
            let (credentials, bare) = split_userinfo(entry);
            let addr = bare.parse::<ServerAddr>().map_err(|e| {
                bad(
                    "connection.servers",
                    format!("{:?} is not a NATS URL: {e}", redact_url(entry)),
                )
            })?;
            if let Some(c) = credentials {
                match &in_urls {
                    Some((first, seen)) if *seen != c => {
                        return Err(bad(
                            "connection.servers",
                            format!(
                                "{first} and {} carry different credentials; a client sends the \
                                 same ones to every server: give them once",
                                redact_url(entry)
                            ),
                        ))
                    }
                    Some(_) => {}
                    None => in_urls = Some((redact_url(entry), c)),
                }
            }
            addrs.push(addr);
        }
        if addrs.is_empty() {
            return Err(bad("connection.servers", "no server URL given".to_string()));
        }

        let mut explicit: Vec<(&'static str, Auth)> = Vec::new();
        match (&self.user, &self.password) {
            (Some(user), Some(password)) => explicit.push((
                "user/password",
                Auth::UserPassword {
                    user: user.clone(),
                    password: password.clone(),
                },
            )),
            (None, None) => {}
            (Some(_), None) => {
                return Err(bad(
                    "connection.password",
                    "`user` is set without `password` (--password, or \
                     CONTEXTFOLD_NATS__CONNECTION__PASSWORD)"
                        .to_string(),
                ))
            }
            (None, Some(_)) => {
                return Err(bad(
                    "connection.user",
                    "`password` is set without `user` (--user, or \
                     CONTEXTFOLD_NATS__CONNECTION__USER)"
                        .to_string(),
                ))
            }
        }
        if let Some(token) = &self.token {
            explicit.push(("token", Auth::Token(token.clone())));
        }
        if let Some(seed) = &self.nkey_seed {
            explicit.push(("nkey_seed", Auth::NkeySeed(seed.clone())));
        }
        if let Some(path) = &self.nkey_seed_file {
            explicit.push(("nkey_seed_file", Auth::NkeySeedFile(path.clone())));
        }
        if let Some(path) = &self.credentials_file {
            explicit.push(("credentials_file", Auth::CredentialsFile(path.clone())));
        }
        if explicit.len() > 1 {
            let names: Vec<&str> = explicit.iter().map(|(name, _)| *name).collect();
            return Err(bad(
                "connection",
                format!(
                    "set one way to authenticate, not {} (a flag replaces the configured way, \
                     but two flags or two keys conflict)",
                    names.join(" and ")
                ),
            ));
        }
        let auth = match (in_urls, explicit.pop()) {
            (None, None) => Auth::None,
            (None, Some((_, auth))) => auth,
            (Some((_, c)), None) => Auth::from(c),
            (Some((url, c)), Some((name, auth))) => {
                if Auth::from(c) != auth {
                    return Err(bad(
                        "connection.servers",
                        format!(
                            "{url} carries credentials and `{name}` is set too (by a flag or \
                             [nats.connection]); give the credentials one way"
                        ),
                    ));
                }
                auth
            }
        };
        Ok((addrs, auth))
    }

    /// The async-nats options these settings describe. Reads the
    /// credentials or seed file now, so a missing file fails here.
    pub fn to_connect_options(&self) -> Result<ConnectOptions, NatsError> {
        let (_, auth) = self.resolve()?;
        self.connect_options(&auth)
    }

    fn connect_options(&self, auth: &Auth) -> Result<ConnectOptions, NatsError> {
        let mut options = ConnectOptions::new();
        match auth {
            Auth::None => {}
            Auth::UserPassword { user, password } => {
                options = options.user_and_password(user.clone(), password.expose().to_string());
            }
            Auth::Token(token) => options = options.token(token.expose().to_string()),
            Auth::NkeySeed(seed) => options = options.nkey(seed.expose().trim().to_string()),
            Auth::NkeySeedFile(path) => {
                let seed = read_secret(path, "NKey seed file")?;
                options = options.nkey(seed.trim().to_string());
            }
            Auth::CredentialsFile(path) => {
                let creds = read_secret(path, "NATS credentials file")?;
                options = options.credentials(&creds).map_err(|e| NatsError::Config {
                    field: "connection.credentials_file",
                    reason: format!("{}: {e}", path.display()),
                })?;
            }
        }
        let tls = &self.tls;
        if tls.require_tls {
            options = options.require_tls(true);
        }
        if tls.handshake_first {
            options = options.tls_first();
        }
        if let Some(ca) = &tls.root_ca {
            require_file(ca, "TLS root CA file")?;
            options = options.add_root_certificates(ca.clone());
        }
        match (&tls.client_cert, &tls.client_key) {
            (Some(cert), Some(key)) => {
                require_file(cert, "TLS client certificate")?;
                require_file(key, "TLS client key")?;
                options = options.add_client_certificate(cert.clone(), key.clone());
            }
            (None, None) => {}
            _ => {
                return Err(NatsError::Config {
                    field: "connection.tls",
                    reason: "client_cert and client_key go together".to_string(),
                })
            }
        }
        if let Some(name) = &self.name {
            options = options.name(name);
        }
        if let Some(prefix) = &self.inbox_prefix {
            check_inbox_prefix(prefix)?;
            options = options.custom_inbox_prefix(prefix);
        }
        let max_delay = Duration::from_millis(self.reconnect_delay_max_ms);
        options = options
            .connection_timeout(Duration::from_millis(self.connect_timeout_ms.max(1)))
            .request_timeout(Some(Duration::from_millis(self.request_timeout_ms.max(1))))
            .ping_interval(Duration::from_millis(self.ping_interval_ms.max(1)))
            .max_reconnects(self.max_reconnects)
            .reconnect_delay_callback(move |attempts| reconnect_delay(attempts, max_delay))
            .event_callback(|event| async move {
                match event {
                    async_nats::Event::Connected => {
                        tracing::info!("NATS connection (re)established")
                    }
                    async_nats::Event::Disconnected => {
                        tracing::warn!("NATS connection lost; reconnecting")
                    }
                    async_nats::Event::ServerError(async_nats::ServerError::Other(error))
                        if is_permission_error(&error) =>
                    {
                        tracing::warn!(
                            %error,
                            "the NATS server refused an operation: the user lacks a permission \
                             (docs/subjects.md, \"Permissions\" lists what each role needs)"
                        )
                    }
                    other => tracing::debug!(event = %other, "NATS client event"),
                }
            });
        if self.retry_on_initial_connect {
            options = options.retry_on_initial_connect();
        }
        if self.ignore_discovered_servers {
            options = options.ignore_discovered_servers();
        }
        Ok(options)
    }

    /// Connects, then refuses a server that is too old or has no JetStream.
    /// URLs and errors name the servers with their credentials redacted.
    pub async fn connect(&self) -> Result<(async_nats::Client, ServerVersion), NatsError> {
        let (addrs, auth) = self.resolve()?;
        let client = self
            .connect_options(&auth)?
            .connect(addrs)
            .await
            .map_err(|e| NatsError::Connect {
                servers: self.display_servers(),
                detail: connect_detail(&e, &auth),
            })?;
        if self.retry_on_initial_connect {
            // The client is handed back before its first connection, and
            // the server's version is known only once it is connected.
            while client.connection_state() != async_nats::connection::State::Connected {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        let version = check_server(&client)?;
        Ok((client, version))
    }
}

/// Whether a server `-ERR` is a permission refusal (`Permissions Violation
/// for Publish to "..."`, or for Subscription).
fn is_permission_error(error: &str) -> bool {
    error.to_ascii_lowercase().contains("permissions violation")
}

/// A reply-subject prefix: one or more `.`-separated tokens of printable
/// ASCII, without the wildcards `*` and `>`.
fn check_inbox_prefix(prefix: &str) -> Result<(), NatsError> {
    let valid = prefix.split('.').all(|token| {
        !token.is_empty()
            && token
                .bytes()
                .all(|b| b.is_ascii_graphic() && b != b'*' && b != b'>')
    });
    if valid {
        return Ok(());
    }
    Err(NatsError::Config {
        field: "connection.inbox_prefix",
        reason: format!(
            "{prefix:?} is not a subject prefix: use `.`-separated tokens without spaces, `*` \
             or `>` (e.g. `_INBOX.agent-7`)"
        ),
    })
}

/// Exponential backoff (0, 2, 4, 8 ... ms) capped at `max`.
fn reconnect_delay(attempts: usize, max: Duration) -> Duration {
    if attempts <= 1 {
        return Duration::ZERO;
    }
    let exp = u32::try_from(attempts - 1).unwrap_or(u32::MAX).min(32);
    Duration::from_millis(2u64.saturating_pow(exp)).min(max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_several_urls_including_comma_lists() {
        let o = NatsOptions::with_servers(["nats://a:4222,nats://b:4223", "tls://c:4222"]);
        assert_eq!(o.server_addrs().unwrap().len(), 3);
        let bad = NatsOptions::with_servers(["http://[nope"]);
        assert!(bad.server_addrs().is_err());
        let none = NatsOptions::with_servers(Vec::<String>::new());
        assert!(matches!(
            none.server_addrs(),
            Err(NatsError::Config {
                field: "connection.servers",
                ..
            })
        ));
    }

    #[test]
    fn missing_secret_files_are_reported_with_their_path() {
        let o = NatsOptions {
            nkey_seed_file: Some(PathBuf::from("/nonexistent/seed.nk")),
            ..NatsOptions::default()
        };
        let msg = o.to_connect_options().unwrap_err().to_string();
        assert!(msg.contains("/nonexistent/seed.nk"), "{msg}");
        let o = NatsOptions {
            credentials_file: Some(PathBuf::from("/x.creds")),
            nkey_seed_file: Some(PathBuf::from("/y.nk")),
            ..NatsOptions::default()
        };
        assert!(o.to_connect_options().is_err());
        let o = NatsOptions {
            tls: TlsOptions {
                client_cert: Some(PathBuf::from("/c.pem")),
                ..TlsOptions::default()
            },
            ..NatsOptions::default()
        };
        assert!(matches!(
            o.to_connect_options(),
            Err(NatsError::Config {
                field: "connection.tls",
                ..
            })
        ));
    }

    #[test]
    fn nkey_seed_is_read_from_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("user.nk");
        // A syntactically valid user seed (test vector, not a real account).
        std::fs::write(
            &path,
            "SUAMK2FG4MI6UE3ACF3FK3OIQBCEIEZV7NSWFFEW63UXMRLFM2XLAXK4GY\n",
        )
        .unwrap();
        let o = NatsOptions {
            nkey_seed_file: Some(path),
            ..NatsOptions::default()
        };
        assert!(o.to_connect_options().is_ok());
    }

    fn user_password(user: &str, password: &str) -> Auth {
        Auth::UserPassword {
            user: user.into(),
            password: Secret::new(password),
        }
    }

    #[test]
    fn url_userinfo_becomes_the_credentials_and_leaves_the_url() {
        let o = NatsOptions::with_servers(["nats://alice:s3cret@127.0.0.1:4222,nats://b:4223"]);
        let (addrs, auth) = o.resolve().unwrap();
        assert_eq!(auth, user_password("alice", "s3cret"));
        assert_eq!(addrs.len(), 2);
        assert!(addrs.iter().all(|a| !a.has_user_pass()), "{addrs:?}");
        let o = NatsOptions::with_servers(["nats://t0ken@127.0.0.1:4222"]);
        assert_eq!(o.resolve().unwrap().1, Auth::Token(Secret::new("t0ken")));
        // The same credentials on every URL are one way, not two.
        let o = NatsOptions::with_servers(["nats://a:p@h1:4222", "nats://a:p@h2:4222"]);
        assert_eq!(o.resolve().unwrap().1, user_password("a", "p"));
        let o = NatsOptions::with_servers(["nats://h:4222"]);
        assert_eq!(o.resolve().unwrap().1, Auth::None);
    }

    #[test]
    fn explicit_options_give_the_credentials() {
        let o = NatsOptions {
            user: Some("alice".into()),
            password: Some(Secret::new("s3cret")),
            ..NatsOptions::default()
        };
        assert_eq!(o.resolve().unwrap().1, user_password("alice", "s3cret"));
        assert!(o.to_connect_options().is_ok());
        let o = NatsOptions {
            token: Some(Secret::new("t")),
            ..NatsOptions::default()
        };
        assert_eq!(o.resolve().unwrap().1, Auth::Token(Secret::new("t")));
        let o = NatsOptions {
            nkey_seed: Some(Secret::new(
                "SUAMK2FG4MI6UE3ACF3FK3OIQBCEIEZV7NSWFFEW63UXMRLFM2XLAXK4GY",
            )),
            ..NatsOptions::default()
        };
        assert!(matches!(o.resolve().unwrap().1, Auth::NkeySeed(_)));
        assert!(o.to_connect_options().is_ok());
    }

    #[test]
    fn two_ways_to_authenticate_are_refused_without_showing_secrets() {
        let field_and_message = |o: NatsOptions| match o.resolve() {
            Err(e @ NatsError::Config { field, .. }) => (field, e.to_string()),
            other => panic!("expected a config error, got {other:?}"),
        };
        let (field, msg) = field_and_message(NatsOptions {
            servers: vec!["nats://alice:s3cret@h:4222".into()],
            user: Some("bob".into()),
            password: Some(Secret::new("hunter2")),
            ..NatsOptions::default()
        });
        assert_eq!(field, "connection.servers");
        assert!(
            msg.contains("nats://alice:***@h:4222") && msg.contains("user/password"),
            "{msg}"
        );
        assert!(!msg.contains("s3cret") && !msg.contains("hunter2"), "{msg}");
        let (field, msg) = field_and_message(NatsOptions {
            servers: vec!["nats://tok@h:4222".into()],
            credentials_file: Some("/x.creds".into()),
            ..NatsOptions::default()
        });
        assert_eq!(field, "connection.servers");
        assert!(
            msg.contains("credentials_file") && !msg.contains("tok@"),
            "{msg}"
        );
        let (field, msg) = field_and_message(NatsOptions::with_servers([
            "nats://a:pw1x@h1",
            "nats://a:pw2x@h2",
        ]));
        assert_eq!(field, "connection.servers");
        assert!(msg.contains("different credentials"), "{msg}");
        assert!(!msg.contains("pw1x") && !msg.contains("pw2x"), "{msg}");
        let (field, msg) = field_and_message(NatsOptions {
            token: Some(Secret::new("t")),
            user: Some("u".into()),
            password: Some(Secret::new("p")),
            ..NatsOptions::default()
        });
        assert_eq!(field, "connection");
        assert!(msg.contains("user/password and token"), "{msg}");
        let (field, _) = field_and_message(NatsOptions {
            user: Some("u".into()),
            ..NatsOptions::default()
        });
        assert_eq!(field, "connection.password");
        let (field, _) = field_and_message(NatsOptions {
            password: Some(Secret::new("p")),
            ..NatsOptions::default()
        });
        assert_eq!(field, "connection.user");
        let (_, msg) = field_and_message(NatsOptions::with_servers(["http://u:pw@[nope"]));
        assert!(msg.contains("u:***@") && !msg.contains("pw"), "{msg}");
    }

    #[test]
    fn debug_and_display_never_show_secrets() {
        let o = NatsOptions {
            servers: vec!["nats://alice:s3cret@h:4222".into(), "nats://t0k@h2".into()],
            password: Some(Secret::new("hunter2")),
            token: Some(Secret::new("t0ken")),
            nkey_seed: Some(Secret::new("SUseed")),
            ..NatsOptions::default()
        };
        let shown = format!("{o:?} {} {:?}", o.display_servers(), o.resolve());
        for secret in ["s3cret", "t0k@", "hunter2", "t0ken", "SUseed"] {
            assert!(!shown.contains(secret), "{secret} in {shown}");
        }
        assert!(
            shown.contains("nats://alice:***@h:4222,nats://***@h2"),
            "{shown}"
        );
    }

    #[test]
    fn inbox_prefix_is_checked_and_applied() {
        for ok in ["_INBOX.agent-7", "_INBOX_a", "_I.~YTpi"] {
            let o = NatsOptions {
                inbox_prefix: Some(ok.into()),
                ..NatsOptions::default()
            };
            assert!(o.to_connect_options().is_ok(), "{ok}");
        }
        for bad in ["", "_INBOX.", "_INBOX.*", "a.>", "a b", ".x", "a..b"] {
            let o = NatsOptions {
                inbox_prefix: Some(bad.into()),
                ..NatsOptions::default()
            };
            match o.to_connect_options() {
                Err(NatsError::Config { field, reason }) => {
                    assert_eq!(field, "connection.inbox_prefix");
                    assert!(reason.contains("_INBOX.agent-7"), "{reason}");
                }
                Err(other) => panic!("{bad:?}: {other}"),
                Ok(_) => panic!("{bad:?} accepted"),
            }
        }
        let o: NatsOptions = toml::from_str("inbox_prefix = \"_INBOX.a7\"\n").unwrap();
        assert_eq!(o.inbox_prefix.as_deref(), Some("_INBOX.a7"));
    }

    #[test]
    fn permission_errors_are_recognized() {
        assert!(is_permission_error(
            "Permissions Violation for Publish to \"cf.in.b\""
        ));
        assert!(is_permission_error(
            "permissions violation for subscription to \"_INBOX.>\""
        ));
        assert!(!is_permission_error("maximum payload exceeded"));
    }

    #[test]
    fn reconnect_delay_grows_and_caps() {
        let max = Duration::from_millis(4000);
        assert_eq!(reconnect_delay(1, max), Duration::ZERO);
        assert!(reconnect_delay(3, max) < reconnect_delay(5, max));
        assert_eq!(reconnect_delay(100, max), max);
    }

    #[test]
    fn toml_shape() {
        let o: NatsOptions = toml::from_str(
            "servers = [\"nats://a:4222\"]\nname = \"cf-1\"\nmax_reconnects = 10\n\
             [tls]\nrequire_tls = true\nroot_ca = \"/etc/ca.pem\"\n",
        )
        .unwrap();
        assert_eq!(o.name.as_deref(), Some("cf-1"));
        assert_eq!(o.max_reconnects, Some(10));
        assert!(o.tls.require_tls);
    }
}
