//! The documented NATS deployments (`docs/examples/*.conf`) for tests: NKey
//! users generated for the example's variables, a nats-server running the
//! example as it is shipped, the server log's permission violations, and
//! the `[nats]` settings of a `serve` running as one of those users.

use super::nats_server::NatsServer;
use contextfold::nats::config::StorageKind;
use contextfold::nats::{NatsConfig, NatsOptions};
use contextfold::secret::Secret;
use nkeys::KeyPair;
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// One account per tenant (docs/subjects.md, "Tenants", way 1).
pub const TENANTS_CONF: &str = include_str!("../../docs/examples/nats-tenants.conf");
/// One service account for several tenants (way 2).
pub const SHARED_CONF: &str = include_str!("../../docs/examples/nats-shared-service.conf");

/// Every NKey variable of `nats-tenants.conf`.
pub const TENANTS_USERS: [&str; 7] = [
    "ACME_SERVICE",
    "ACME_OPERATOR",
    "ACME_AGENT_1",
    "ACME_AGENT_2",
    "GLOBEX_SERVICE",
    "GLOBEX_OPERATOR",
    "GLOBEX_AGENT_1",
];

/// Every NKey variable of `nats-shared-service.conf`.
pub const SHARED_USERS: [&str; 5] = [
    "CF_ACME_SERVICE",
    "CF_GLOBEX_SERVICE",
    "ACME_OPERATOR",
    "ACME_AGENT_1",
    "GLOBEX_AGENT_1",
];

/// NKey users for one server: the example's variable name and a fresh
/// key pair.
pub struct Users(BTreeMap<&'static str, KeyPair>);

impl Users {
    pub fn generate(names: &[&'static str]) -> Users {
        Users(names.iter().map(|n| (*n, KeyPair::new_user())).collect())
    }

    pub fn seed(&self, name: &str) -> String {
        self.0[name]
            .seed()
            .expect("a generated key pair has a seed")
    }

    pub fn public(&self, name: &str) -> String {
        self.0[name].public_key()
    }

    /// The example's text with these users' public keys defined ahead of
    /// it, as the example's header says to.
    pub fn config_text(&self, example: &str) -> String {
        let mut text = String::new();
        for (name, key) in &self.0 {
            writeln!(text, "{name}: \"{}\"", key.public_key()).unwrap();
        }
        text.push_str(example);
        text
    }

    /// A server running `example` with these users.
    pub fn server(&self, example: &str) -> NatsServer {
        NatsServer::start_with_config(&self.config_text(example))
    }
}

/// The server log's permission violations by `user` (its public key).
pub fn violations_by(server: &NatsServer, user: &str) -> Vec<String> {
    server
        .log_tail(1_000_000)
        .lines()
        .filter(|l| l.contains("Violation") && l.contains(user))
        .map(str::to_string)
        .collect()
}

/// `[nats]` of a serve running as the NKey user `seed`, with the example's
/// prefix and inbox prefix, short leases and memory storage; every job
/// snapshot goes through the object store (`max_inline_payload_bytes`
/// 256), so the service user's permissions there are exercised too.
pub fn service_nats_config(
    url: &str,
    seed: String,
    prefix: &str,
    inbox: Option<&str>,
    partitions: u32,
) -> NatsConfig {
    NatsConfig {
        connection: NatsOptions {
            nkey_seed: Some(Secret::new(seed)),
            inbox_prefix: inbox.map(str::to_string),
            ..NatsOptions::with_servers([url])
        },
        prefix: prefix.to_string(),
        partitions,
        lease_ttl_ms: 2_000,
        lease_renew_ms: 250,
        lease_margin_ms: 700,
        job_ack_wait_ms: 2_000,
        storage: StorageKind::Memory,
        max_inline_payload_bytes: 256,
        ..NatsConfig::default()
    }
}
