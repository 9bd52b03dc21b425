//! NATS settings of contextfold (`[nats]` in the configuration file).
//!
//! Every field has a default, so an empty `[nats]` table (or none) gives a
//! single-node setup talking to `nats://127.0.0.1:4222`.

use crate::nats::connect::NatsOptions;
use crate::nats::replies::{ReplyPolicy, DEFAULT_REPLY_PREFIXES};
use crate::nats::subjects::{validate_prefix, Subjects};
use crate::nats::NatsError;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Where JetStream keeps the streams and buckets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StorageKind {
    /// On disk: survives a server restart (the default; the log is the truth).
    #[default]
    File,
    /// In memory: for tests and throw-away setups.
    Memory,
}

/// NATS settings. Durations are in milliseconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NatsConfig {
    /// How to reach the servers (URLs, credentials, TLS, reconnects).
    pub connection: NatsOptions,
    /// First subject token(s) of every subject, and stem of stream and
    /// bucket names (`cf` -> `cf.in.<conv>`, stream `CF_EVENTS`). Default `cf`.
    pub prefix: String,
    /// Partitions of the events stream; fixed once the stream exists,
    /// because changing it moves conversations between partitions. Default 16.
    pub partitions: u32,
    /// Replicas of every stream and bucket (1, or 3 in a 3-node cluster).
    /// Default 1.
    pub replicas: usize,
    /// Storage of streams and buckets. Default `file`.
    pub storage: StorageKind,
    /// Window in which a republished event id (`Nats-Msg-Id`) is dropped by
    /// the server. Default 120000 (2 minutes).
    pub dedup_window_ms: u64,
    /// Largest message the events and job streams accept, in bytes; must not
    /// exceed the server's `max_payload`. Default 1048576 (the server's
    /// default `max_payload`).
    pub max_message_bytes: u32,
    /// Payloads larger than this go to the object store and the event
    /// carries a reference. Default 262144.
    pub max_inline_payload_bytes: u32,
    /// Age after which events are dropped from the stream; 0 keeps them for
    /// ever (the log is the truth: only set this with snapshots elsewhere).
    /// Default 0.
    pub events_max_age_ms: u64,
    /// Lifetime of a partition lease and of a member heartbeat without
    /// renewal (the lease bucket's `max_age`). Every process must agree.
    /// Default 10000.
    pub lease_ttl_ms: u64,
    /// How often leases and heartbeats are renewed and partitions
    /// rebalanced. Default 2000.
    pub lease_renew_ms: u64,
    /// A holder stops using a lease this long before it could expire for
    /// others (covers clock drift and in-flight work). Default 3000.
    pub lease_margin_ms: u64,
    /// A summarizer that neither acks nor reports progress for this long
    /// loses the job to another. Default 30000.
    pub job_ack_wait_ms: u64,
    /// Deliveries of a job before it goes to the dead-letter subject.
    /// Default 5.
    pub job_max_deliver: i64,
    /// How long dead letters are kept. Default 604800000 (7 days).
    pub dead_letter_max_age_ms: u64,
    /// Age after which a job snapshot left in the object store
    /// (`cf_payloads`) is removed by the server (the bucket's `max_age`).
    /// A summarizer deletes a job's snapshot as soon as the job ends
    /// (acknowledged or dead-lettered); this removes what a crash or a lost
    /// acknowledgement left behind. It must outlast a job's whole life,
    /// deferrals and redeliveries included: a job whose snapshot expired
    /// cannot run and is dead-lettered at its last delivery (its
    /// conversation then gets its next job). At least
    /// `job_ack_wait_ms * job_max_deliver` and one minute. Default
    /// 86400000 (1 day).
    pub payload_max_age_ms: u64,
    /// Subject prefixes (whole tokens) the API answers on: a request whose
    /// reply subject lies below none of them, nor below
    /// `connection.inbox_prefix`, gets no answer and is counted
    /// (`contextfold_api_replies_refused_total`), so no requester can make
    /// the service publish on a lease key, another conversation's subject
    /// or a JetStream API (docs/subjects.md, "Replies and inboxes"). None may
    /// start with `$` or overlap `prefix`. Default `["_INBOX", "_R_"]`
    /// (client inboxes; replies through imported services).
    pub reply_prefixes: Vec<String>,
}

impl Default for NatsConfig {
    fn default() -> Self {
        NatsConfig {
            connection: NatsOptions::default(),
            prefix: "cf".to_string(),
            partitions: 16,
            replicas: 1,
            storage: StorageKind::File,
            dedup_window_ms: 120_000,
            max_message_bytes: 1024 * 1024,
            max_inline_payload_bytes: 256 * 1024,
            events_max_age_ms: 0,
            lease_ttl_ms: 10_000,
            lease_renew_ms: 2_000,
            lease_margin_ms: 3_000,
            job_ack_wait_ms: 30_000,
            job_max_deliver: 5,
            dead_letter_max_age_ms: 7 * 24 * 3600 * 1000,
            payload_max_age_ms: DEFAULT_PAYLOAD_MAX_AGE_MS,
            reply_prefixes: DEFAULT_REPLY_PREFIXES.map(str::to_string).to_vec(),
        }
    }
}

/// Default `payload_max_age_ms`: one day.
pub const DEFAULT_PAYLOAD_MAX_AGE_MS: u64 = 24 * 3600 * 1000;

/// Most partitions accepted: each has a durable consumer and a lease.
pub const MAX_PARTITIONS: u32 = 1024;

impl NatsConfig {
    /// Refuses settings that cannot work, with the field to fix.
    pub fn validate(&self) -> Result<(), NatsError> {
        let bad = |field: &'static str, reason: String| NatsError::Config { field, reason };
        validate_prefix(&self.prefix).map_err(|e| bad("prefix", e.to_string()))?;
        if self.partitions == 0 || self.partitions > MAX_PARTITIONS {
            return Err(bad(
                "partitions",
                format!("must be 1..={MAX_PARTITIONS}, got {}", self.partitions),
            ));
        }
        if self.replicas == 0 || self.replicas > 5 {
            return Err(bad(
                "replicas",
                format!("must be 1..=5, got {}", self.replicas),
            ));
        }
        if self.dedup_window_ms == 0 {
            return Err(bad(
                "dedup_window_ms",
                "must be > 0: deduplication of republished events depends on it".into(),
            ));
        }
        if self.events_max_age_ms != 0 && self.events_max_age_ms < self.dedup_window_ms {
            return Err(bad(
                "events_max_age_ms",
                "must be 0 (keep for ever) or at least dedup_window_ms".into(),
            ));
        }
        if self.max_inline_payload_bytes > self.max_message_bytes {
            return Err(bad(
                "max_inline_payload_bytes",
                format!(
                    "{} exceeds max_message_bytes {}",
                    self.max_inline_payload_bytes, self.max_message_bytes
                ),
            ));
        }
        if self.lease_ttl_ms < 1_000 {
            return Err(bad(
                "lease_ttl_ms",
                "must be at least 1000 (the server expires keys with about 1 s precision)".into(),
            ));
        }
        if self.lease_margin_ms == 0 || self.lease_margin_ms >= self.lease_ttl_ms {
            return Err(bad(
                "lease_margin_ms",
                "must be > 0 and < lease_ttl_ms".into(),
            ));
        }
        if self.lease_renew_ms == 0
            || self.lease_renew_ms >= self.lease_ttl_ms - self.lease_margin_ms
        {
            return Err(bad(
                "lease_renew_ms",
                format!(
                    "must be > 0 and < lease_ttl_ms - lease_margin_ms ({} ms), or holders stop \
                     between renewals",
                    self.lease_ttl_ms - self.lease_margin_ms
                ),
            ));
        }
        if self.job_max_deliver < 1 {
            return Err(bad("job_max_deliver", "must be at least 1".into()));
        }
        if self.job_ack_wait_ms < 1_000 {
            return Err(bad("job_ack_wait_ms", "must be at least 1000".into()));
        }
        let job_life = self
            .job_ack_wait_ms
            .saturating_mul(u64::try_from(self.job_max_deliver).unwrap_or(u64::MAX))
            .max(60_000);
        if self.payload_max_age_ms < job_life {
            return Err(bad(
                "payload_max_age_ms",
                format!(
                    "must be at least {job_life} (job_ack_wait_ms * job_max_deliver, and one \
                     minute): a job's snapshot must outlast the job, got {}",
                    self.payload_max_age_ms
                ),
            ));
        }
        self.reply_policy()?;
        Ok(())
    }

    /// The reply subjects the API answers on: `reply_prefixes` and the
    /// connection's own inbox prefix (forwarded requests come back there).
    pub fn reply_policy(&self) -> Result<ReplyPolicy, NatsError> {
        ReplyPolicy::new(&self.reply_prefixes, &self.prefix).map_err(|e| NatsError::Config {
            field: "reply_prefixes",
            reason: e.to_string(),
        })?;
        let own = self.connection.inbox_prefix.as_deref().unwrap_or("_INBOX");
        ReplyPolicy::new(
            self.reply_prefixes.iter().map(String::as_str).chain([own]),
            &self.prefix,
        )
        .map_err(|e| NatsError::Config {
            field: "connection.inbox_prefix",
            reason: format!("the service's replies come back there: {e}"),
        })
    }

    /// Subject and resource names for this prefix.
    pub fn subjects(&self) -> Result<Subjects, NatsError> {
        Subjects::new(&self.prefix).map_err(|e| NatsError::Config {
            field: "prefix",
            reason: e.to_string(),
        })
    }

    pub fn dedup_window(&self) -> Duration {
        Duration::from_millis(self.dedup_window_ms)
    }

    pub fn payload_max_age(&self) -> Duration {
        Duration::from_millis(self.payload_max_age_ms)
    }

    pub fn lease_ttl(&self) -> Duration {
        Duration::from_millis(self.lease_ttl_ms)
    }

    pub fn lease_renew(&self) -> Duration {
        Duration::from_millis(self.lease_renew_ms)
    }

    pub fn lease_margin(&self) -> Duration {
        Duration::from_millis(self.lease_margin_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_documented_values() {
        let c = NatsConfig::default();
        c.validate().unwrap();
        assert_eq!(c.prefix, "cf");
        assert_eq!(c.partitions, 16);
        assert_eq!(c.replicas, 1);
        assert_eq!(c.dedup_window_ms, 120_000);
        assert_eq!(c.lease_ttl_ms, 10_000);
        assert_eq!(c.payload_max_age_ms, 86_400_000);
        assert_eq!(c.reply_prefixes, ["_INBOX", "_R_"]);
    }

    #[test]
    fn empty_toml_table_gives_defaults_and_fields_are_snake_case() {
        let c: NatsConfig = toml::from_str("").unwrap();
        assert_eq!(c, NatsConfig::default());
        let c: NatsConfig = toml::from_str(
            "prefix = \"acme.cf\"\npartitions = 32\nstorage = \"memory\"\n\
             [connection]\nservers = [\"nats://a:4222\", \"nats://b:4222\"]\n",
        )
        .unwrap();
        assert_eq!(c.partitions, 32);
        assert_eq!(c.storage, StorageKind::Memory);
        assert_eq!(c.connection.servers.len(), 2);
        assert!(toml::from_str::<NatsConfig>("partitons = 3").is_err());
    }

    #[test]
    fn impossible_settings_name_their_field() {
        type Change = Box<dyn Fn(&mut NatsConfig)>;
        let cases: Vec<(&str, Change)> = vec![
            ("prefix", Box::new(|c| c.prefix = "a b".into())),
            ("partitions", Box::new(|c| c.partitions = 0)),
            ("replicas", Box::new(|c| c.replicas = 7)),
            ("dedup_window_ms", Box::new(|c| c.dedup_window_ms = 0)),
            ("events_max_age_ms", Box::new(|c| c.events_max_age_ms = 10)),
            (
                "max_inline_payload_bytes",
                Box::new(|c| c.max_inline_payload_bytes = c.max_message_bytes + 1),
            ),
            (
                "lease_margin_ms",
                Box::new(|c| c.lease_margin_ms = c.lease_ttl_ms),
            ),
            ("lease_renew_ms", Box::new(|c| c.lease_renew_ms = 8_000)),
            ("job_max_deliver", Box::new(|c| c.job_max_deliver = 0)),
            ("payload_max_age_ms", Box::new(|c| c.payload_max_age_ms = 0)),
            (
                "payload_max_age_ms",
                Box::new(|c| c.payload_max_age_ms = c.job_ack_wait_ms * 4),
            ),
            (
                "reply_prefixes",
                Box::new(|c| c.reply_prefixes = vec!["$KV".into()]),
            ),
            (
                "reply_prefixes",
                Box::new(|c| c.reply_prefixes.push("cf.svc".into())),
            ),
            (
                "connection.inbox_prefix",
                Box::new(|c| c.connection.inbox_prefix = Some("cf.inbox".into())),
            ),
        ];
        for (field, change) in cases {
            let mut c = NatsConfig::default();
            change(&mut c);
            match c.validate() {
                Err(NatsError::Config { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{field}: expected a config error, got {other:?}"),
            }
        }
    }
}
