//! Create-or-validate of everything contextfold keeps in JetStream:
//!
//! - the events stream (`CF_EVENTS`): subjects `cf.in.*` (agents) and
//!   `cf.svc.*` (the service), stored as `cf.ev.<partition>.<in|svc>.<conv>`
//!   through a stream subject transform with `{{partition(N,2)}}`,
//!   deduplicating `Nats-Msg-Id` within the window;
//! - the compaction job work queue (`CF_JOBS`, subjects `cf.job.*`) and its
//!   shared durable consumer for the summarizers;
//! - the dead-letter stream (`CF_DEAD`, subjects `cf.dead.*` and
//!   `cf.dead.partition.*`);
//! - the partition lease KV bucket (`cf_leases`, `max_age` 30 s or the lease
//!   TTL if longer: it only removes what dead members leave);
//! - the large-payload object store (`cf_payloads`, `max_age` =
//!   `payload_max_age_ms`: job snapshots a crash left behind expire).
//!
//! [`ensure`] is idempotent and safe to run from several processes at once:
//! what is missing is created, what exists is compared with the settings.
//! Settings that can change in place (dedup window, size limits, replicas,
//! age) are updated; settings whose change would corrupt the data model
//! (subjects, partition count, retention, storage, a lease bucket whose
//! `max_age` is shorter than the lease TTL) are refused
//! with an explanation instead of being silently applied.

use crate::nats::config::{NatsConfig, StorageKind};
use crate::nats::leases::LEASE_KEY_MAX_AGE;
use crate::nats::subjects::Subjects;
use crate::nats::NatsError;
use async_nats::jetstream::consumer::pull;
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy};
use async_nats::jetstream::context::{
    CreateStreamErrorKind, GetStreamErrorKind, KeyValueErrorKind,
};
use async_nats::jetstream::stream::{
    self, DiscardPolicy, RetentionPolicy, StorageType, SubjectTransform,
};
use async_nats::jetstream::ErrorCode;
use async_nats::jetstream::{kv, object_store, Context};
use std::time::Duration;

/// Handles to everything [`ensure`] created or validated.
pub struct Infrastructure {
    pub subjects: Subjects,
    pub events: stream::Stream,
    pub jobs: stream::Stream,
    pub dead_letters: stream::Stream,
    pub leases: kv::Store,
    pub payloads: object_store::ObjectStore,
}

fn storage(kind: StorageKind) -> StorageType {
    match kind {
        StorageKind::File => StorageType::File,
        StorageKind::Memory => StorageType::Memory,
    }
}

fn max_message_size(cfg: &NatsConfig) -> i32 {
    i32::try_from(cfg.max_message_bytes).unwrap_or(i32::MAX)
}

/// The events stream as configured.
pub fn events_stream_config(cfg: &NatsConfig) -> Result<stream::Config, NatsError> {
    let s = cfg.subjects()?;
    Ok(stream::Config {
        name: s.events_stream(),
        description: Some(format!(
            "contextfold events, {} partitions by conversation",
            cfg.partitions
        )),
        // Agents publish to `cf.in.*`, the service to `cf.svc.*`; the
        // stored subject keeps which, so the fold (and every replay) knows
        // who wrote each event.
        subjects: s.events_stream_subjects(),
        subject_transform: Some(SubjectTransform {
            source: s.partition_transform_source(),
            destination: s.partition_transform_destination(cfg.partitions),
        }),
        retention: RetentionPolicy::Limits,
        discard: DiscardPolicy::Old,
        storage: storage(cfg.storage),
        num_replicas: cfg.replicas,
        duplicate_window: cfg.dedup_window(),
        max_message_size: max_message_size(cfg),
        max_age: Duration::from_millis(cfg.events_max_age_ms),
        // Events are facts: nobody removes one from the middle of the log.
        deny_delete: true,
        // Readers fetch by sequence without a consumer.
        allow_direct: true,
        ..Default::default()
    })
}

/// The compaction job work queue as configured.
pub fn jobs_stream_config(cfg: &NatsConfig) -> Result<stream::Config, NatsError> {
    let s = cfg.subjects()?;
    Ok(stream::Config {
        name: s.jobs_stream(),
        description: Some("contextfold compaction jobs (work queue)".to_string()),
        subjects: vec![s.jobs_wildcard()],
        retention: RetentionPolicy::WorkQueue,
        storage: storage(cfg.storage),
        num_replicas: cfg.replicas,
        // A job republished after a folder crash carries the same id.
        duplicate_window: cfg.dedup_window(),
        max_message_size: max_message_size(cfg),
        ..Default::default()
    })
}

/// The dead-letter stream as configured.
pub fn dead_letter_stream_config(cfg: &NatsConfig) -> Result<stream::Config, NatsError> {
    let s = cfg.subjects()?;
    Ok(stream::Config {
        name: s.dead_letter_stream(),
        description: Some(
            "contextfold jobs that failed too often, and records a partition refused, with the \
             reason"
                .to_string(),
        ),
        subjects: s.dead_letter_stream_subjects(),
        retention: RetentionPolicy::Limits,
        storage: storage(cfg.storage),
        num_replicas: cfg.replicas,
        duplicate_window: cfg.dedup_window(),
        max_message_size: max_message_size(cfg),
        max_age: Duration::from_millis(cfg.dead_letter_max_age_ms),
        ..Default::default()
    })
}

/// The partition lease bucket: one revision per key. Leases are taken
/// over by watching them (`nats::leases`); `max_age` only removes what dead
/// members leave, and must be at least the lease TTL.
pub fn lease_bucket_config(cfg: &NatsConfig) -> Result<kv::Config, NatsError> {
    let s = cfg.subjects()?;
    Ok(kv::Config {
        bucket: s.lease_bucket(),
        description: "contextfold partition leases and member heartbeats".to_string(),
        history: 1,
        max_age: cfg.lease_ttl().max(LEASE_KEY_MAX_AGE),
        storage: storage(cfg.storage),
        num_replicas: cfg.replicas,
        ..Default::default()
    })
}

/// The large-payload object store.
pub fn payload_bucket_config(cfg: &NatsConfig) -> Result<object_store::Config, NatsError> {
    let s = cfg.subjects()?;
    Ok(object_store::Config {
        bucket: s.payload_bucket(),
        description: Some("contextfold payloads too large to travel inline".to_string()),
        storage: storage(cfg.storage),
        num_replicas: cfg.replicas,
        max_age: cfg.payload_max_age(),
        ..Default::default()
    })
}

/// The summarizers' shared durable pull consumer on the job queue: a job
/// not acknowledged (or progress-acked) within `job_ack_wait_ms` goes to
/// another worker, at most `job_max_deliver` times.
pub fn summarizer_consumer_config(cfg: &NatsConfig) -> Result<pull::Config, NatsError> {
    let s = cfg.subjects()?;
    Ok(pull::Config {
        durable_name: Some(s.summarizer_consumer()),
        description: Some("contextfold summarizers".to_string()),
        ack_policy: AckPolicy::Explicit,
        ack_wait: Duration::from_millis(cfg.job_ack_wait_ms),
        max_deliver: cfg.job_max_deliver,
        deliver_policy: DeliverPolicy::All,
        ..Default::default()
    })
}

/// A folder's durable pull consumer for one partition, starting after
/// `after` (the stream position the folder's state already reflects). The
/// folder acknowledges a whole batch with one ack of its last message.
pub fn folder_consumer_config(
    subjects: &Subjects,
    partition: u32,
    after: u64,
    max_ack_pending: i64,
) -> pull::Config {
    pull::Config {
        durable_name: Some(subjects.folder_consumer(partition)),
        description: Some(format!("contextfold folder of partition {partition}")),
        filter_subject: subjects.partition_filter(partition),
        ack_policy: AckPolicy::All,
        ack_wait: Duration::from_secs(60),
        max_ack_pending,
        deliver_policy: if after == 0 {
            DeliverPolicy::All
        } else {
            DeliverPolicy::ByStartSequence {
                start_sequence: after + 1,
            }
        },
        ..Default::default()
    }
}

/// Creates or validates every stream, bucket and shared consumer.
pub async fn ensure(js: &Context, cfg: &NatsConfig) -> Result<Infrastructure, NatsError> {
    cfg.validate()?;
    check_server_limits(js, cfg)?;
    let subjects = cfg.subjects()?;
    let events = ensure_stream(js, events_stream_config(cfg)?).await?;
    let jobs = ensure_stream(js, jobs_stream_config(cfg)?).await?;
    let dead_letters = ensure_stream(js, dead_letter_stream_config(cfg)?).await?;
    let summarizers = summarizer_consumer_config(cfg)?;
    let name = subjects.summarizer_consumer();
    jobs.create_consumer(summarizers)
        .await
        .map_err(|e| classify(format!("creating consumer {name}"), e, cfg.replicas))?;
    let leases = ensure_lease_bucket(js, cfg).await?;
    let payloads = ensure_payload_bucket(js, cfg).await?;
    Ok(Infrastructure {
        subjects,
        events,
        jobs,
        dead_letters,
        leases,
        payloads,
    })
}

fn check_server_limits(js: &Context, cfg: &NatsConfig) -> Result<(), NatsError> {
    let server_max = js.client().server_info().max_payload;
    if server_max > 0 && cfg.max_message_bytes as usize > server_max {
        return Err(NatsError::Config {
            field: "max_message_bytes",
            reason: format!(
                "{} exceeds the server's max_payload of {server_max} bytes: lower it, or raise \
                 max_payload in the server configuration",
                cfg.max_message_bytes
            ),
        });
    }
    Ok(())
}

/// Turns a JetStream error into one that says what to do, for the cases an
/// operator can hit by configuration.
fn classify(
    operation: String,
    err: impl std::error::Error + Send + Sync + 'static,
    replicas: usize,
) -> NatsError {
    let detail = err.to_string();
    let lower = detail.to_ascii_lowercase();
    if replicas > 1 && (lower.contains("replicas") || lower.contains("insufficient resources")) {
        return NatsError::Config {
            field: "replicas",
            reason: format!(
                "{operation}: the server refused {replicas} replicas ({detail}); replicas > 1 \
                 needs a JetStream cluster of at least that many nodes"
            ),
        };
    }
    NatsError::js(operation, err)
}

async fn get_stream(js: &Context, name: &str) -> Result<Option<stream::Stream>, NatsError> {
    match js.get_stream(name).await {
        Ok(s) => Ok(Some(s)),
        Err(e) => match e.kind() {
            GetStreamErrorKind::JetStream(inner)
                if inner.error_code() == ErrorCode::STREAM_NOT_FOUND =>
            {
                Ok(None)
            }
            _ => Err(NatsError::js(format!("looking up stream {name}"), e)),
        },
    }
}

/// Creates `desired` or reconciles an existing stream with it.
pub async fn ensure_stream(
    js: &Context,
    desired: stream::Config,
) -> Result<stream::Stream, NatsError> {
    let name = desired.name.clone();
    let replicas = desired.num_replicas;
    if let Some(existing) = get_stream(js, &name).await? {
        return reconcile_stream(js, existing, desired).await;
    }
    match js.create_stream(desired.clone()).await {
        Ok(s) => Ok(s),
        Err(e) => {
            // Another process may have created it between our look-up and
            // our create, with settings of its own: validate those.
            let lost_race = matches!(e.kind(),
                CreateStreamErrorKind::JetStream(inner)
                    if inner.error_code() == ErrorCode::STREAM_NAME_EXIST);
            if lost_race {
                if let Some(existing) = get_stream(js, &name).await? {
                    return reconcile_stream(js, existing, desired).await;
                }
            }
            Err(classify(format!("creating stream {name}"), e, replicas))
        }
    }
}

async fn reconcile_stream(
    js: &Context,
    existing: stream::Stream,
    desired: stream::Config,
) -> Result<stream::Stream, NatsError> {
    let current = existing.cached_info().config.clone();
    let problems = incompatibilities(&current, &desired);
    if !problems.is_empty() {
        return Err(NatsError::Incompatible {
            resource: format!("stream {}", desired.name),
            detail: problems.join("; "),
        });
    }
    if !needs_update(&current, &desired) {
        return Ok(existing);
    }
    let mut updated = current.clone();
    updated.subjects = desired.subjects.clone();
    updated.duplicate_window = desired.duplicate_window;
    updated.max_message_size = desired.max_message_size;
    updated.num_replicas = desired.num_replicas;
    updated.max_age = desired.max_age;
    updated.description = desired.description.clone();
    updated.deny_delete = desired.deny_delete;
    updated.allow_direct = desired.allow_direct;
    let name = desired.name.clone();
    js.update_stream(updated)
        .await
        .map_err(|e| classify(format!("updating stream {name}"), e, desired.num_replicas))?;
    js.get_stream(&name)
        .await
        .map_err(|e| NatsError::js(format!("looking up stream {name}"), e))
}

/// Differences that cannot be applied in place without breaking the data
/// model; each says what to do.
pub fn incompatibilities(current: &stream::Config, desired: &stream::Config) -> Vec<String> {
    let mut problems = Vec::new();
    let mut have = current.subjects.clone();
    let mut want = desired.subjects.clone();
    have.sort();
    want.sort();
    // Subjects may be added in place (nothing stored moves); any other
    // difference means another layout or another owner.
    let only_added = have.iter().all(|h| want.contains(h));
    let before_origins = desired.subject_transform.is_some()
        && have.len() == 1
        && want.len() == 2
        && want.contains(&have[0]);
    if before_origins {
        problems.push(format!(
            "it was created by an older contextfold, whose stored subjects do not say who \
             published an event (it listens on {have:?}; this version needs {want:?}, agents on \
             `in` and the service on `svc`): start this version on a new `[nats] prefix`, or \
             delete the stream while no process runs (its history is lost)"
        ));
        return problems;
    }
    if !only_added {
        problems.push(format!(
            "subjects are {have:?}, expected {want:?} (another prefix or another application \
             owns this stream name)"
        ));
    }
    if current.subject_transform != desired.subject_transform {
        let show = |t: &Option<SubjectTransform>| match t {
            Some(t) => format!("{} -> {}", t.source, t.destination),
            None => "none".to_string(),
        };
        problems.push(format!(
            "subject transform is {}, expected {}: the partition count cannot change once \
             events are stored (conversations would move between partitions); keep the old \
             `partitions` setting or migrate to a new prefix",
            show(&current.subject_transform),
            show(&desired.subject_transform)
        ));
    }
    if current.retention != desired.retention {
        problems.push(format!(
            "retention is {:?}, expected {:?}",
            current.retention, desired.retention
        ));
    }
    if current.storage != desired.storage {
        problems.push(format!(
            "storage is {:?}, expected {:?} (storage cannot change in place)",
            current.storage, desired.storage
        ));
    }
    problems
}

fn needs_update(current: &stream::Config, desired: &stream::Config) -> bool {
    let mut have = current.subjects.clone();
    let mut want = desired.subjects.clone();
    have.sort();
    want.sort();
    have != want
        || current.duplicate_window != desired.duplicate_window
        || current.max_message_size != desired.max_message_size
        || current.num_replicas != desired.num_replicas
        || current.max_age != desired.max_age
        || current.deny_delete != desired.deny_delete
        || current.allow_direct != desired.allow_direct
}

async fn ensure_lease_bucket(js: &Context, cfg: &NatsConfig) -> Result<kv::Store, NatsError> {
    let desired = lease_bucket_config(cfg)?;
    let bucket = desired.bucket.clone();
    let store = match js.get_key_value(&bucket).await {
        Ok(store) => store,
        Err(e) if e.kind() == KeyValueErrorKind::GetBucket => {
            match js.create_key_value(desired.clone()).await {
                Ok(store) => store,
                // Lost a creation race: use (and validate) the winner's.
                Err(create_err) => js.get_key_value(&bucket).await.map_err(|_| {
                    classify(
                        format!("creating KV bucket {bucket}"),
                        create_err,
                        cfg.replicas,
                    )
                })?,
            }
        }
        Err(e) => return Err(NatsError::js(format!("opening KV bucket {bucket}"), e)),
    };
    let info = &store.stream.cached_info().config;
    // A bucket created by an older version has max_age = its lease TTL
    // (10 s by default): fine as long as no lease outlives its key.
    if info.max_age < cfg.lease_ttl() {
        return Err(NatsError::Incompatible {
            resource: format!("KV bucket {bucket}"),
            detail: format!(
                "its max_age is {} ms, shorter than lease_ttl_ms {}: a lease could vanish \
                 before its holder stops using it; lower lease_ttl_ms to at most {}, or delete \
                 the bucket while no process runs",
                info.max_age.as_millis(),
                cfg.lease_ttl_ms,
                info.max_age.as_millis()
            ),
        });
    }
    if info.max_messages_per_subject != 1 {
        return Err(NatsError::Incompatible {
            resource: format!("KV bucket {bucket}"),
            detail: format!("history is {}, expected 1", info.max_messages_per_subject),
        });
    }
    if info.num_replicas != cfg.replicas {
        let mut updated = info.clone();
        updated.num_replicas = cfg.replicas;
        js.update_stream(updated)
            .await
            .map_err(|e| classify(format!("updating KV bucket {bucket}"), e, cfg.replicas))?;
    }
    Ok(store)
}

/// The stream behind object store `bucket`.
pub fn payload_stream_name(bucket: &str) -> String {
    format!("OBJ_{bucket}")
}

async fn ensure_payload_bucket(
    js: &Context,
    cfg: &NatsConfig,
) -> Result<object_store::ObjectStore, NatsError> {
    let desired = payload_bucket_config(cfg)?;
    let bucket = desired.bucket.clone();
    let max_age = desired.max_age;
    let store = match js.get_object_store(&bucket).await {
        Ok(store) => store,
        Err(_) => match js.create_object_store(desired).await {
            Ok(store) => return Ok(store),
            Err(e) => js.get_object_store(&bucket).await.map_err(|_| {
                classify(format!("creating object store {bucket}"), e, cfg.replicas)
            })?,
        },
    };
    // A bucket made before `payload_max_age_ms` (or under another value)
    // gets this one: a safe change, applied in place.
    let name = payload_stream_name(&bucket);
    let Some(stream) = get_stream(js, &name).await? else {
        return Ok(store);
    };
    let current = stream.cached_info().config.clone();
    if current.max_age != max_age {
        let mut updated = current;
        updated.max_age = max_age;
        js.update_stream(updated)
            .await
            .map_err(|e| classify(format!("updating object store {bucket}"), e, cfg.replicas))?;
    }
    Ok(store)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_stream_partitions_inbound_subjects() {
        let cfg = NatsConfig {
            partitions: 8,
            ..NatsConfig::default()
        };
        let c = events_stream_config(&cfg).unwrap();
        assert_eq!(c.name, "CF_EVENTS");
        assert_eq!(c.subjects, ["cf.in.*", "cf.svc.*"]);
        let t = c.subject_transform.unwrap();
        assert_eq!(t.source, "cf.*.*");
        assert_eq!(
            t.destination,
            "cf.ev.{{partition(8,2)}}.{{wildcard(1)}}.{{wildcard(2)}}"
        );
        assert_eq!(c.duplicate_window, Duration::from_secs(120));
        assert_eq!(c.max_message_size, 1024 * 1024);
    }

    #[test]
    fn a_changed_partition_count_is_incompatible_but_a_window_is_not() {
        let old = events_stream_config(&NatsConfig::default()).unwrap();
        let more = events_stream_config(&NatsConfig {
            partitions: 32,
            ..NatsConfig::default()
        })
        .unwrap();
        let problems = incompatibilities(&old, &more);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("partition count"), "{problems:?}");

        let wider = events_stream_config(&NatsConfig {
            dedup_window_ms: 600_000,
            ..NatsConfig::default()
        })
        .unwrap();
        assert!(incompatibilities(&old, &wider).is_empty());
        assert!(needs_update(&old, &wider));
        assert!(!needs_update(&old, &old.clone()));
    }

    #[test]
    fn a_stream_from_before_origins_is_refused_with_a_way_out_and_subjects_may_be_added() {
        let new = events_stream_config(&NatsConfig::default()).unwrap();
        let mut old = new.clone();
        old.subjects = vec!["cf.in.*".into()];
        old.subject_transform = Some(SubjectTransform {
            source: "cf.in.*".into(),
            destination: "cf.ev.{{partition(16,1)}}.{{wildcard(1)}}".into(),
        });
        let problems = incompatibilities(&old, &new);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("older contextfold"), "{problems:?}");
        assert!(problems[0].contains("prefix"), "{problems:?}");

        let dead = dead_letter_stream_config(&NatsConfig::default()).unwrap();
        let mut jobs_only = dead.clone();
        jobs_only.subjects = vec!["cf.dead.*".into()];
        assert!(incompatibilities(&jobs_only, &dead).is_empty());
        assert!(needs_update(&jobs_only, &dead));
        let mut foreign = dead.clone();
        foreign.subjects = vec!["other.*".into()];
        assert!(!incompatibilities(&foreign, &dead).is_empty());
    }

    #[test]
    fn jobs_are_a_work_queue_and_lease_keys_outlive_an_election() {
        let cfg = NatsConfig::default();
        let jobs = jobs_stream_config(&cfg).unwrap();
        assert_eq!(jobs.retention, RetentionPolicy::WorkQueue);
        assert_eq!(jobs.subjects, vec!["cf.job.*".to_string()]);
        let kv = lease_bucket_config(&cfg).unwrap();
        assert_eq!(kv.max_age, Duration::from_secs(30));
        assert_eq!(kv.history, 1);
        let long = NatsConfig {
            lease_ttl_ms: 45_000,
            lease_margin_ms: 5_000,
            lease_renew_ms: 5_000,
            ..NatsConfig::default()
        };
        assert_eq!(
            lease_bucket_config(&long).unwrap().max_age,
            Duration::from_secs(45)
        );
        let c = folder_consumer_config(&cfg.subjects().unwrap(), 3, 41, 5000);
        assert_eq!(c.filter_subject, "cf.ev.3.*.*");
        assert_eq!(
            c.deliver_policy,
            DeliverPolicy::ByStartSequence { start_sequence: 42 }
        );
    }
}
