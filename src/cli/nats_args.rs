//! The NATS flags every subcommand that reaches NATS takes (`serve`,
//! `gateway`, `doctor`, `audit`, `ui`, ...): each overrides
//! `[nats.connection]`.

use clap::Args;
use contextfold::nats::NatsConfig;
use contextfold::secret::Secret;
use std::path::PathBuf;

/// How to reach NATS; each flag overrides `[nats.connection]`.
#[derive(Debug, Clone, Args)]
pub struct NatsArgs {
    /// Server URL(s), repeatable or comma-separated
    /// (`nats://a:4222,nats://b:4222`).
    #[arg(long = "nats", value_name = "URL", value_delimiter = ',')]
    pub servers: Vec<String>,
    /// User name, with --password or the configured password. A
    /// credentials flag replaces the other ways `[nats.connection]`
    /// configures.
    #[arg(long, value_name = "USER")]
    pub user: Option<String>,
    /// Password of the user (other local users can read it in the process
    /// list: prefer CONTEXTFOLD_NATS__CONNECTION__PASSWORD).
    #[arg(long, value_name = "PASSWORD")]
    pub password: Option<String>,
    /// Authentication token (prefer CONTEXTFOLD_NATS__CONNECTION__TOKEN).
    #[arg(long, value_name = "TOKEN", conflicts_with_all = ["user", "password", "creds", "nkey"])]
    pub token: Option<String>,
    /// Credentials file (JWT + NKey seed).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["user", "password", "nkey"])]
    pub creds: Option<PathBuf>,
    /// NKey seed file.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["user", "password"])]
    pub nkey: Option<PathBuf>,
    /// Require TLS.
    #[arg(long)]
    pub tls: bool,
    /// CA certificate(s) to trust (PEM).
    #[arg(long, value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// Client certificate (PEM), with --tls-key.
    #[arg(long, value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// Client key (PEM), with --tls-cert.
    #[arg(long, value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
    /// Connection name shown by the server (also the stem of the lease
    /// member id).
    #[arg(long)]
    pub name: Option<String>,
    /// Subject prefix (default `[nats] prefix`, `cf`).
    #[arg(long)]
    pub prefix: Option<String>,
}

impl NatsArgs {
    /// The configured `[nats]` section with these flags applied.
    pub fn apply(&self, base: &NatsConfig) -> NatsConfig {
        let mut cfg = base.clone();
        let c = &mut cfg.connection;
        if !self.servers.is_empty() {
            c.servers = self.servers.clone();
        }
        // A credentials flag names the way to authenticate: the other
        // configured ways go (clap refuses two ways among the flags). The
        // user and password may come one by flag, one from the config.
        let user_password = self.user.is_some() || self.password.is_some();
        if user_password || self.token.is_some() || self.creds.is_some() || self.nkey.is_some() {
            if !user_password {
                c.user = None;
                c.password = None;
            }
            if let Some(user) = &self.user {
                c.user = Some(user.clone());
            }
            if let Some(password) = &self.password {
                c.password = Some(Secret::new(password.clone()));
            }
            c.token = self.token.clone().map(Secret::new);
            c.nkey_seed = None;
            c.credentials_file = self.creds.clone();
            c.nkey_seed_file = self.nkey.clone();
        }
        if self.tls {
            c.tls.require_tls = true;
        }
        if let Some(p) = &self.tls_ca {
            c.tls.root_ca = Some(p.clone());
        }
        if let Some(p) = &self.tls_cert {
            c.tls.client_cert = Some(p.clone());
        }
        if let Some(p) = &self.tls_key {
            c.tls.client_key = Some(p.clone());
        }
        if let Some(n) = &self.name {
            c.name = Some(n.clone());
        }
        if let Some(p) = &self.prefix {
            cfg.prefix = p.clone();
        }
        cfg
    }
}
