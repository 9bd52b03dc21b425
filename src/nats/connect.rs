//! Connection options for real deployments (`[nats.connection]`): several
//! server URLs, a credentials file or an NKey seed file, TLS, a connection
//! name and reconnect behaviour, turned into [`async_nats::ConnectOptions`].
//!
//! Secrets are only ever read from files named here, never written into the
//! configuration itself.

use crate::nats::version::{check_server, ServerVersion};
use crate::nats::NatsError;
use async_nats::{ConnectOptions, ServerAddr};
use serde::{Deserialize, Serialize};
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

/// How to reach and authenticate to the NATS servers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NatsOptions {
    /// Server URLs (`nats://host:4222`, `tls://host:4222`); the client
    /// fails over between them and the servers the cluster advertises.
    /// Default `["nats://127.0.0.1:4222"]`.
    pub servers: Vec<String>,
    /// Connection name shown in server monitoring. Default `contextfold`.
    pub name: Option<String>,
    /// A `.creds` file (user JWT + NKey seed), as `nsc` generates.
    pub credentials_file: Option<PathBuf>,
    /// A file holding an NKey user seed (`SU...`).
    pub nkey_seed_file: Option<PathBuf>,
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
            credentials_file: None,
            nkey_seed_file: None,
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

    /// The server list, parsed. Accepts comma-separated URLs inside one
    /// entry, as the `--nats` flag and `NATS_URL` conventionally do.
    pub fn server_addrs(&self) -> Result<Vec<ServerAddr>, NatsError> {
        let addrs: Vec<ServerAddr> = self
            .servers
            .iter()
            .flat_map(|s| s.split(','))
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| {
                s.parse::<ServerAddr>().map_err(|e| NatsError::Config {
                    field: "connection.servers",
                    reason: format!("{s:?} is not a NATS URL: {e}"),
                })
            })
            .collect::<Result<_, _>>()?;
        if addrs.is_empty() {
            return Err(NatsError::Config {
                field: "connection.servers",
                reason: "no server URL given".to_string(),
            });
        }
        Ok(addrs)
    }

    /// The async-nats options these settings describe. Reads the
    /// credentials or seed file now, so a missing file fails here.
    pub fn to_connect_options(&self) -> Result<ConnectOptions, NatsError> {
        if self.credentials_file.is_some() && self.nkey_seed_file.is_some() {
            return Err(NatsError::Config {
                field: "connection.credentials_file",
                reason: "set either credentials_file or nkey_seed_file, not both".to_string(),
            });
        }
        let mut options = ConnectOptions::new();
        if let Some(path) = &self.credentials_file {
            let creds = read_secret(path, "NATS credentials file")?;
            options = options.credentials(&creds).map_err(|e| NatsError::Config {
                field: "connection.credentials_file",
                reason: format!("{}: {e}", path.display()),
            })?;
        }
        if let Some(path) = &self.nkey_seed_file {
            let seed = read_secret(path, "NKey seed file")?;
            options = options.nkey(seed.trim().to_string());
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
    pub async fn connect(&self) -> Result<(async_nats::Client, ServerVersion), NatsError> {
        let addrs = self.server_addrs()?;
        let shown = self.servers.join(",");
        let client = self
            .to_connect_options()?
            .connect(addrs)
            .await
            .map_err(|e| NatsError::Connect {
                servers: shown,
                detail: e.to_string(),
            })?;
        let version = check_server(&client)?;
        Ok((client, version))
    }
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
