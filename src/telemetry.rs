//! Telemetry in one place: every metric contextfold exports, and one struct
//! per operational event whose `emit()` logs with fixed field names and
//! counts (the pattern of vector's `internal_events`).
//!
//! # Metric names are an interface
//!
//! Dashboards and alert rules (`deploy/`) are written against the names
//! below: renaming one breaks them, so names only ever get added. Every
//! name carries its unit (`_total`, `_seconds`, `_bytes`, `_micros`).
//!
//! # Labels are bounded
//!
//! A label value comes from a closed set known at build time (a rejection
//! kind, an outcome, a reason), from the configuration (a model name, a
//! partition number below `[nats] partitions`), never from input: no
//! conversation key, event id or job id ever becomes a label. Those go to
//! the log, under the fixed field names [`fields`] lists.
//!
//! # Every family exists from start-up
//!
//! A family that appears only with its first event breaks what is written
//! against it: a dashboard panel shows "no data", and an alert on
//! `increase()` misses the first incident (a series first seen at 1 shows
//! no increase). So [`register_known`] exports every family of [`FAMILIES`]
//! when the exporter is installed, whatever roles the process runs: each
//! counter at 0 and each gauge at 0 for every label set of [`LABELS`] (the
//! cross product of its labels' values), each histogram empty. A family a
//! role does not feed stays at 0 there. A label value not listed still
//! counts, from its first event.
//!
//! # Where the numbers go
//!
//! The macros of the `metrics` crate record into whatever recorder is
//! installed; [`install_prometheus`] installs the Prometheus one (once per
//! process) and its handle renders the text format for `/metrics`. Without
//! a recorder (the library in tests, `contextfold local`) every emit is a
//! no-op beside its log line.
//!
//! `clippy.toml` forbids the raw `metrics::counter!`/`histogram!`/`gauge!`
//! macros outside this module, so a new metric is added here, with its
//! name, description and label set, or not at all.

#![allow(clippy::disallowed_macros)]

use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder, PrometheusHandle};
use std::sync::Mutex;
use std::time::Duration;

/// The field names every operational log line uses for the same things.
pub mod fields {
    pub const CONVERSATION_ID: &str = "conversation_id";
    pub const STREAM_SEQ: &str = "stream_seq";
    pub const PARTITION: &str = "partition";
    pub const JOB_ID: &str = "job_id";
    pub const ERROR: &str = "error";
}

// ---- folder: intake and the fold -------------------------------------------

/// Events the fold applied.
pub const EVENTS_FOLDED: &str = "contextfold_events_folded_total";
/// Events that changed nothing because their id was already folded;
/// label `origin`: `redelivery` (the transport delivered it again) or
/// `own_decision` (the copy of a decision this process published itself).
pub const EVENTS_DUPLICATE: &str = "contextfold_events_duplicate_total";
/// Events or records refused; label `kind`: the refusal kind (`fold`,
/// `undecodable`, `oversized`, `forged`, ...).
pub const EVENTS_REJECTED: &str = "contextfold_events_rejected_total";
/// Events the policy ignores (ignored or stateless sessions).
pub const EVENTS_IGNORED: &str = "contextfold_events_ignored_total";
/// Agent events refused over their conversation's intake quota without a
/// record each (the first of an episode counts among the rejections,
/// `kind="over_quota"`).
pub const EVENTS_THROTTLED: &str = "contextfold_events_throttled_total";
/// State-store commits (state and stream position written together).
pub const STATE_COMMITS: &str = "contextfold_state_commits_total";
/// Records per folder batch (histogram).
pub const BATCH_SIZE: &str = "contextfold_folder_batch_records";
/// Time to commit a folder batch to the state store (histogram).
pub const COMMIT_SECONDS: &str = "contextfold_state_commit_seconds";
/// Messages of a partition's event consumer not yet delivered (gauge);
/// label `partition`.
pub const CONSUMER_PENDING: &str = "contextfold_consumer_pending_messages";
/// Partitions this process folds right now (gauge).
pub const PARTITIONS_HELD: &str = "contextfold_partitions_held";

// ---- leases ----------------------------------------------------------------

/// Partition leases acquired.
pub const LEASE_ACQUISITIONS: &str = "contextfold_lease_acquisitions_total";
/// Partition leases lost (not renewed in time, taken over).
pub const LEASE_LOSSES: &str = "contextfold_lease_losses_total";
/// Partition leases handed over on purpose (rebalance, graceful leave).
pub const LEASE_HANDOVERS: &str = "contextfold_lease_handovers_total";

// ---- jobs ------------------------------------------------------------------

/// Compaction jobs the fold issued.
pub const JOBS_ISSUED: &str = "contextfold_jobs_issued_total";
/// Jobs waiting in the work queue, not yet taken (gauge).
pub const JOBS_QUEUED: &str = "contextfold_jobs_queued";
/// Jobs taken by a summarizer (of any process) and not yet acknowledged
/// (gauge).
pub const JOBS_RUNNING: &str = "contextfold_jobs_running";
/// Jobs handed back to be retried after a delay (rate limit, spend window).
pub const JOBS_RETRIED: &str = "contextfold_jobs_retried_total";
/// Jobs dead-lettered; label `reason`: `undecodable`, `max_deliveries`,
/// `deferred_too_often`, `unrunnable`.
pub const JOBS_DEAD_LETTERED: &str = "contextfold_jobs_dead_lettered_total";

// ---- sweeps and the summarizer ---------------------------------------------

/// Sweeps ended; label `outcome`: how the sweep stopped (`done`,
/// `deadline`, `spend_limit`, `rate_limited`, `failed`, `no_progress`, ...).
pub const SWEEPS_ENDED: &str = "contextfold_sweeps_ended_total";
/// Sweep duration (histogram); label `outcome` as above.
pub const SWEEP_SECONDS: &str = "contextfold_sweep_seconds";
/// Summaries a sweep wrote.
pub const SUMMARIES_WRITTEN: &str = "contextfold_summaries_written_total";
/// Summarizer (model) calls; labels `model`, `outcome` (`ok`, `fallback`,
/// `rate_limited`, `failed`, `spend_limit`, `deadline`).
pub const SUMMARIZER_CALLS: &str = "contextfold_summarizer_calls_total";
/// Summarizer pass latency (histogram); labels `model`, `outcome`.
pub const SUMMARIZER_SECONDS: &str = "contextfold_summarizer_call_seconds";
/// Tokens the summarizer spent (prompt and completion); label `model`.
pub const SUMMARIZER_TOKENS: &str = "contextfold_summarizer_tokens_total";
/// Money the summarizer spent, in millionths of the configured currency
/// unit; label `model`.
pub const SUMMARIZER_COST_MICROS: &str = "contextfold_summarizer_cost_micros_total";
/// Summaries refused by validation; label `kind` (`empty`,
/// `reasoning_only`, `chain_of_thought`, `continuation`, `too_short`,
/// `not_smaller`, `oversized`, `truncated`, `unusable`).
pub const VALIDATION_REJECTIONS: &str = "contextfold_validation_rejections_total";
/// Escalations after a refused or failed summary; label `kind`
/// (`aggressive`, `fallback`).
pub const ESCALATIONS: &str = "contextfold_escalations_total";
/// Spend windows closed on a debt (its summarizer calls, tokens or money
/// ran out), counted once per closing; label `window` (`spend_window`,
/// `urgent_spend_window`, `partition_window`, `tenant_window`).
pub const SPEND_WINDOWS_CLOSED: &str = "contextfold_spend_windows_closed_total";
/// Backoffs after a compaction round that made no progress.
pub const NO_PROGRESS_BACKOFFS: &str = "contextfold_no_progress_backoffs_total";
/// Jobs given up because no `sweep_ended` came by their expiry (their
/// worker vanished).
pub const JOBS_EXPIRED: &str = "contextfold_jobs_expired_total";
/// Jobs the log showed pending that were queued again when a partition's
/// history ended (their work item was not in the queue).
pub const JOBS_REQUEUED: &str = "contextfold_jobs_requeued_total";
/// `clock_ticked` events recorded for quiet partitions; label `partition`.
pub const CLOCK_TICKS: &str = "contextfold_clock_ticks_total";
/// Processes seen folding one stream under different policies: a policy
/// recorded by another process after this one recorded its own, or a live
/// member announcing another policy fingerprint.
pub const POLICY_CONFLICTS: &str = "contextfold_policy_conflicts_total";

// ---- API -------------------------------------------------------------------

/// Assemble latency, request to reply (histogram).
pub const ASSEMBLE_SECONDS: &str = "contextfold_assemble_seconds";
/// Assembled reply size in bytes (histogram).
pub const ASSEMBLE_REPLY_BYTES: &str = "contextfold_assemble_reply_bytes";

// ---- state store -----------------------------------------------------------

/// Bytes of turn bodies in the body cache (gauge; one cache per process).
pub const BODY_CACHE_BYTES: &str = "contextfold_body_cache_bytes";
/// Body reads the cache answered.
pub const BODY_CACHE_HITS: &str = "contextfold_body_cache_hits_total";
/// Body reads that went to the state store.
pub const BODY_CACHE_MISSES: &str = "contextfold_body_cache_misses_total";

// ---- HTTP ------------------------------------------------------------------

/// Whether this process is ready (`/readyz`), 1 or 0 (gauge).
pub const READY: &str = "contextfold_ready";

// ---- trust boundary ----------------------------------------------------------

/// API requests refused unanswered because their reply subject is no
/// inbox; label `family`: what the subject is
/// ([`crate::nats::replies::ReplyFamily`]: `kv`, `jetstream_api`,
/// `service_events`, `inbound`, `jobs`, `other`, ...).
pub const API_REPLIES_REFUSED: &str = "contextfold_api_replies_refused_total";
/// Requests of the audit page refused; label `reason`: `host` (a Host
/// header naming no allowed address: DNS rebinding), `origin` (a
/// cross-site Origin) or `token` (missing or wrong token).
pub const HTTP_REQUESTS_REFUSED: &str = "contextfold_http_requests_refused_total";
// ---- gateway ---------------------------------------------------------------

/// Requests the gateway answered; labels `surface` (`chat_completions`,
/// `responses`, `messages`) and `outcome` (`forwarded`, `assembled`,
/// `expanded`, `answered`, `rejected`, `refused`, `upstream_error`).
pub const GATEWAY_REQUESTS: &str = "contextfold_gateway_requests_total";
/// Time the gateway added before the upstream was called (histogram);
/// label `surface`.
pub const GATEWAY_ADDED_SECONDS: &str = "contextfold_gateway_added_latency_seconds";
/// Tokens not sent upstream because the assembled context replaced the
/// client's history; label `surface`.
pub const GATEWAY_TOKENS_SAVED: &str = "contextfold_gateway_tokens_saved_total";
/// Times a conversation's summary block changed: each is one change of the
/// prefix the provider's prompt cache sees.
pub const GATEWAY_CACHE_PREFIX_CHANGES: &str = "contextfold_gateway_cache_prefix_changes_total";
/// Turns the gateway handed to the store.
pub const GATEWAY_TURNS_PUBLISHED: &str = "contextfold_gateway_turns_published_total";
/// Upstream failures; labels `surface` and `class` (`overflow`,
/// `rate_limited`, `client_error`, `server_error`, `unreachable`,
/// `timeout`).
pub const GATEWAY_UPSTREAM_ERRORS: &str = "contextfold_gateway_upstream_errors_total";
/// Compactions the gateway answered from contextfold; label `surface`.
pub const GATEWAY_COMPACTIONS_ANSWERED: &str = "contextfold_gateway_compactions_answered_total";
/// Turns waiting in the spool for NATS (gauge).
pub const GATEWAY_SPOOLED: &str = "contextfold_gateway_spooled_turns";
/// Turns the store could not take (embedded write failures, permanent
/// NATS refusals).
pub const GATEWAY_STORE_FAILURES: &str = "contextfold_gateway_store_failures_total";

/// Every metric with its kind, unit and description, for `describe_*` and
/// docs/operations.md.
pub const FAMILIES: &[(&str, Kind, &str)] = &[
    (EVENTS_FOLDED, Kind::Counter, "events the fold applied"),
    (
        EVENTS_THROTTLED,
        Kind::Counter,
        "agent events refused over their conversation's intake quota without a record each",
    ),
    (
        EVENTS_DUPLICATE,
        Kind::Counter,
        "events already folded, by origin (redelivery, own_decision)",
    ),
    (
        EVENTS_REJECTED,
        Kind::Counter,
        "events or records refused, by kind",
    ),
    (
        EVENTS_IGNORED,
        Kind::Counter,
        "events of ignored or stateless sessions",
    ),
    (STATE_COMMITS, Kind::Counter, "state-store commits"),
    (BATCH_SIZE, Kind::Histogram, "records per folder batch"),
    (
        COMMIT_SECONDS,
        Kind::Histogram,
        "time to commit a batch to the state store",
    ),
    (
        CONSUMER_PENDING,
        Kind::Gauge,
        "undelivered messages of a partition's event consumer, by partition",
    ),
    (
        PARTITIONS_HELD,
        Kind::Gauge,
        "partitions this process folds",
    ),
    (
        LEASE_ACQUISITIONS,
        Kind::Counter,
        "partition leases acquired",
    ),
    (LEASE_LOSSES, Kind::Counter, "partition leases lost"),
    (
        LEASE_HANDOVERS,
        Kind::Counter,
        "partition leases released on purpose",
    ),
    (JOBS_ISSUED, Kind::Counter, "compaction jobs issued"),
    (JOBS_QUEUED, Kind::Gauge, "jobs waiting in the work queue"),
    (
        JOBS_RUNNING,
        Kind::Gauge,
        "jobs taken by a summarizer, not yet acknowledged",
    ),
    (
        JOBS_RETRIED,
        Kind::Counter,
        "jobs handed back for a retry after a delay",
    ),
    (
        JOBS_DEAD_LETTERED,
        Kind::Counter,
        "jobs dead-lettered, by reason",
    ),
    (SWEEPS_ENDED, Kind::Counter, "sweeps ended, by outcome"),
    (SWEEP_SECONDS, Kind::Histogram, "sweep duration, by outcome"),
    (SUMMARIES_WRITTEN, Kind::Counter, "summaries written"),
    (
        SUMMARIZER_CALLS,
        Kind::Counter,
        "summarizer calls, by model and outcome",
    ),
    (
        SUMMARIZER_SECONDS,
        Kind::Histogram,
        "summarizer pass latency, by model and outcome",
    ),
    (
        SUMMARIZER_TOKENS,
        Kind::Counter,
        "summarizer tokens, by model",
    ),
    (
        SUMMARIZER_COST_MICROS,
        Kind::Counter,
        "summarizer cost in micro-units, by model",
    ),
    (
        VALIDATION_REJECTIONS,
        Kind::Counter,
        "summaries refused by validation, by kind",
    ),
    (ESCALATIONS, Kind::Counter, "summary escalations, by kind"),
    (
        SPEND_WINDOWS_CLOSED,
        Kind::Counter,
        "spend windows closed on a debt, by window",
    ),
    (
        NO_PROGRESS_BACKOFFS,
        Kind::Counter,
        "backoffs after a compaction round without progress",
    ),
    (
        JOBS_EXPIRED,
        Kind::Counter,
        "jobs given up with no sweep_ended by their expiry",
    ),
    (
        JOBS_REQUEUED,
        Kind::Counter,
        "pending jobs queued again when a partition's history ended",
    ),
    (
        CLOCK_TICKS,
        Kind::Counter,
        "clock ticks recorded for quiet partitions, by partition",
    ),
    (
        POLICY_CONFLICTS,
        Kind::Counter,
        "processes folding one stream under different policies",
    ),
    (ASSEMBLE_SECONDS, Kind::Histogram, "assemble latency"),
    (
        ASSEMBLE_REPLY_BYTES,
        Kind::Histogram,
        "assembled reply size in bytes",
    ),
    (
        BODY_CACHE_BYTES,
        Kind::Gauge,
        "bytes of turn bodies in the body cache",
    ),
    (
        BODY_CACHE_HITS,
        Kind::Counter,
        "body reads the cache answered",
    ),
    (
        BODY_CACHE_MISSES,
        Kind::Counter,
        "body reads that went to the state store",
    ),
    (READY, Kind::Gauge, "1 when /readyz answers 200, else 0"),
    (
        API_REPLIES_REFUSED,
        Kind::Counter,
        "API requests left unanswered because their reply subject is no inbox, by family",
    ),
    (
        HTTP_REQUESTS_REFUSED,
        Kind::Counter,
        "audit page requests refused, by reason (host, origin, token)",
    ),
    (
        GATEWAY_REQUESTS,
        Kind::Counter,
        "gateway requests, by surface and outcome",
    ),
    (
        GATEWAY_ADDED_SECONDS,
        Kind::Histogram,
        "time the gateway added before calling the upstream, by surface",
    ),
    (
        GATEWAY_TOKENS_SAVED,
        Kind::Counter,
        "tokens the assembled context kept from the upstream, by surface",
    ),
    (
        GATEWAY_CACHE_PREFIX_CHANGES,
        Kind::Counter,
        "summary block changes (prompt-cache prefix changes)",
    ),
    (
        GATEWAY_TURNS_PUBLISHED,
        Kind::Counter,
        "turns the gateway handed to the store",
    ),
    (
        GATEWAY_UPSTREAM_ERRORS,
        Kind::Counter,
        "upstream failures, by surface and class",
    ),
    (
        GATEWAY_COMPACTIONS_ANSWERED,
        Kind::Counter,
        "compactions answered from contextfold, by surface",
    ),
    (
        GATEWAY_SPOOLED,
        Kind::Gauge,
        "turns waiting for NATS in the spool",
    ),
    (
        GATEWAY_STORE_FAILURES,
        Kind::Counter,
        "turns the store could not take",
    ),
];

/// Where a label's values come from (see [`LABELS`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Values {
    /// A closed set known at build time.
    Closed(&'static [&'static str]),
    /// The partition numbers below `[nats] partitions`.
    Partition,
    /// The configured model names ([`Known::models`]), the deterministic
    /// summarizer's and `unknown` (a pass that failed before a model
    /// answered).
    Model,
}

/// `origin` of [`EVENTS_DUPLICATE`]: [`DuplicateOrigin::as_str`].
pub const DUPLICATE_ORIGINS: &[&str] = &["redelivery", "own_decision"];
/// `kind` of [`EVENTS_REJECTED`]: the intake's refusals
/// (`core::intake::Refusal::kind`) and the fold's rejections
/// (`core::fold::rejection::Rejection::kind`).
pub const REJECTION_KINDS: &[&str] = &[
    "undecodable",
    "unroutable",
    "wrong_conversation",
    "not_an_agent_event",
    "too_long",
    "time_out_of_range",
    "replay_flood",
    "tool_pairing",
    "summary_stale",
    "summary_invalid",
    "over_quota",
];
/// `reason` of [`JOBS_DEAD_LETTERED`].
pub const DEAD_LETTER_REASONS: &[&str] = &[
    "undecodable",
    "max_deliveries",
    "deferred_too_often",
    "unrunnable",
];
/// `outcome` of [`SWEEPS_ENDED`] and [`SWEEP_SECONDS`]: `SweepStop::as_str`.
pub const SWEEP_OUTCOMES: &[&str] = &[
    "done",
    "deadline",
    "iteration_cap",
    "spend_limit",
    "no_progress",
    "failed",
];
/// `outcome` of [`SUMMARIZER_CALLS`] and [`SUMMARIZER_SECONDS`].
pub const SUMMARIZER_OUTCOMES: &[&str] = &[
    "ok",
    "fallback",
    "rate_limited",
    "failed",
    "spend_limit",
    "deadline",
];
/// `kind` of [`VALIDATION_REJECTIONS`]: the validation's rejections
/// (`summarizer::checks::Rejection::kind`), and `unusable`,
/// `not_better`, `rolling_state_unparsed` for answers refused before or
/// after them.
pub const VALIDATION_KINDS: &[&str] = &[
    "empty",
    "reasoning_only",
    "chain_of_thought",
    "continuation",
    "too_short",
    "not_smaller",
    "oversized",
    "truncated",
    "refusal",
    "delimiter",
    "copy",
    "agent_voice",
    "unsupported_claim",
    "unusable",
    "not_better",
    "rolling_state_unparsed",
];
/// `kind` of [`ESCALATIONS`].
pub const ESCALATION_KINDS: &[&str] = &["aggressive", "fallback"];
/// `window` of [`SPEND_WINDOWS_CLOSED`]: the spend waits of
/// `core::spend::Wait`.
pub const SPEND_WINDOWS: &[&str] = &[
    "spend_window",
    "urgent_spend_window",
    "partition_window",
    "tenant_window",
];
/// `family` of [`API_REPLIES_REFUSED`]: `nats::replies::ReplyFamily::as_str`.
pub const REPLY_FAMILIES: &[&str] = &[
    "kv",
    "object_store",
    "jetstream_api",
    "jetstream",
    "system",
    "reserved",
    "inbound",
    "service_events",
    "events",
    "jobs",
    "dead_letters",
    "api",
    "service",
    "invalid",
    "other",
];
/// `reason` of [`HTTP_REQUESTS_REFUSED`]: [`HttpRefusal::as_str`].
pub const HTTP_REFUSALS: &[&str] = &["host", "origin", "token"];

/// The labels of every labelled family, in the order they are given, with
/// where their values come from; a family not listed has no label.
pub const LABELS: &[(&str, &[(&str, Values)])] = &[
    (
        EVENTS_DUPLICATE,
        &[("origin", Values::Closed(DUPLICATE_ORIGINS))],
    ),
    (
        EVENTS_REJECTED,
        &[("kind", Values::Closed(REJECTION_KINDS))],
    ),
    (CONSUMER_PENDING, &[("partition", Values::Partition)]),
    (
        JOBS_DEAD_LETTERED,
        &[("reason", Values::Closed(DEAD_LETTER_REASONS))],
    ),
    (SWEEPS_ENDED, &[("outcome", Values::Closed(SWEEP_OUTCOMES))]),
    (
        SWEEP_SECONDS,
        &[("outcome", Values::Closed(SWEEP_OUTCOMES))],
    ),
    (
        SUMMARIZER_CALLS,
        &[
            ("model", Values::Model),
            ("outcome", Values::Closed(SUMMARIZER_OUTCOMES)),
        ],
    ),
    (
        SUMMARIZER_SECONDS,
        &[
            ("model", Values::Model),
            ("outcome", Values::Closed(SUMMARIZER_OUTCOMES)),
        ],
    ),
    (SUMMARIZER_TOKENS, &[("model", Values::Model)]),
    (SUMMARIZER_COST_MICROS, &[("model", Values::Model)]),
    (
        VALIDATION_REJECTIONS,
        &[("kind", Values::Closed(VALIDATION_KINDS))],
    ),
    (ESCALATIONS, &[("kind", Values::Closed(ESCALATION_KINDS))]),
    (
        SPEND_WINDOWS_CLOSED,
        &[("window", Values::Closed(SPEND_WINDOWS))],
    ),
    (CLOCK_TICKS, &[("partition", Values::Partition)]),
    (
        API_REPLIES_REFUSED,
        &[("family", Values::Closed(REPLY_FAMILIES))],
    ),
    (
        HTTP_REQUESTS_REFUSED,
        &[("reason", Values::Closed(HTTP_REFUSALS))],
    ),
];

/// What the configuration knows of the open label sets.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Known {
    /// `[nats] partitions`.
    pub partitions: u32,
    /// The summarizer's models: `[summarizer] model` and
    /// `fallback_models` (none without `[summarizer]`).
    pub models: Vec<String>,
}

impl Known {
    fn values(&self, values: Values) -> Vec<String> {
        match values {
            Values::Closed(set) => set.iter().map(|v| v.to_string()).collect(),
            Values::Partition => (0..self.partitions).map(|p| p.to_string()).collect(),
            Values::Model => {
                let mut models: Vec<String> = Vec::new();
                let fixed = [crate::core::fallback_summary::MODEL, "unknown"];
                for m in self.models.iter().map(String::as_str).chain(fixed) {
                    if !models.iter().any(|have| have == m) {
                        models.push(m.to_string());
                    }
                }
                models
            }
        }
    }

    /// Every label set `family` is exported with from start-up: the cross
    /// product of its labels' values (one empty set for a family without
    /// labels).
    pub fn label_sets(&self, family: &str) -> Vec<Vec<(&'static str, String)>> {
        let labels = LABELS
            .iter()
            .find(|(name, _)| *name == family)
            .map_or(&[][..], |(_, labels)| *labels);
        let mut sets: Vec<Vec<(&'static str, String)>> = vec![Vec::new()];
        for &(label, values) in labels {
            let values = self.values(values);
            sets = sets
                .into_iter()
                .flat_map(|set| {
                    values.iter().map(move |v| {
                        let mut next = set.clone();
                        next.push((label, v.clone()));
                        next
                    })
                })
                .collect();
        }
        sets
    }
}

/// Exports every family of [`FAMILIES`] in the installed recorder (see the
/// module doc): counters and gauges at their current value (0 when new)
/// for every label set of [`Known::label_sets`], histograms registered
/// (empty when new). Idempotent: nothing already counted changes.
pub fn register_known(known: &Known) {
    if cfg!(feature = "telemetry-off") {
        return;
    }
    for &(name, kind, _) in FAMILIES {
        for labels in known.label_sets(name) {
            match kind {
                Kind::Counter => metrics::counter!(name, &labels).increment(0),
                Kind::Gauge => metrics::gauge!(name, &labels).increment(0.0),
                Kind::Histogram => {
                    // Registering is enough: the exporter renders a
                    // registered histogram with empty buckets.
                    let _ = metrics::histogram!(name, &labels);
                }
            }
        }
    }
}

/// What kind of metric a family is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

fn unit_of(name: &str) -> Option<Unit> {
    if name.ends_with("_seconds") {
        Some(Unit::Seconds)
    } else if name.ends_with("_bytes") {
        Some(Unit::Bytes)
    } else {
        None
    }
}

/// Describes every family to the installed recorder (help text and unit).
pub fn describe() {
    for &(name, kind, help) in FAMILIES {
        match (kind, unit_of(name)) {
            (Kind::Counter, Some(u)) => describe_counter!(name, u, help),
            (Kind::Counter, None) => describe_counter!(name, help),
            (Kind::Gauge, Some(u)) => describe_gauge!(name, u, help),
            (Kind::Gauge, None) => describe_gauge!(name, help),
            (Kind::Histogram, Some(u)) => describe_histogram!(name, u, help),
            (Kind::Histogram, None) => describe_histogram!(name, help),
        }
    }
}

/// Why the Prometheus recorder could not be installed.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error(
        "cannot install the Prometheus recorder: {0} (another metrics recorder is already \
         installed in this process; install contextfold's first)"
    )]
    Install(#[source] BuildError),
    #[error("invalid histogram buckets for {family}: {source} (a bug: please report it)")]
    Buckets {
        family: &'static str,
        #[source]
        source: BuildError,
    },
}

static PROMETHEUS: Mutex<Option<PrometheusHandle>> = Mutex::new(None);

const SECONDS_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0, 300.0,
];
const BYTES_BUCKETS: &[f64] = &[
    256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0, 1048576.0, 4194304.0,
];
const BATCH_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];

/// Installs the Prometheus recorder for the whole process (once; later
/// calls return the same handle) and describes every family.
pub fn install_prometheus() -> Result<PrometheusHandle, TelemetryError> {
    let mut slot = PROMETHEUS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(h) = slot.as_ref() {
        return Ok(h.clone());
    }
    let buckets = |b: PrometheusBuilder, family: &'static str, m: Matcher, v: &[f64]| {
        b.set_buckets_for_metric(m, v)
            .map_err(|source| TelemetryError::Buckets { family, source })
    };
    let builder = PrometheusBuilder::new();
    let builder = buckets(
        builder,
        "*_seconds",
        Matcher::Suffix("_seconds".into()),
        SECONDS_BUCKETS,
    )?;
    let builder = buckets(
        builder,
        "*_bytes",
        Matcher::Suffix("_bytes".into()),
        BYTES_BUCKETS,
    )?;
    let builder = buckets(
        builder,
        BATCH_SIZE,
        Matcher::Full(BATCH_SIZE.into()),
        BATCH_BUCKETS,
    )?;
    let handle = builder
        .install_recorder()
        .map_err(TelemetryError::Install)?;
    describe();
    *slot = Some(handle.clone());
    Ok(handle)
}

// ---- operational events ----------------------------------------------------

/// An event was folded.
/// What a batch's fold did, event by event: counted in the engine and
/// emitted once per batch (a metric registry lookup per event was a
/// measurable share of the folder's CPU).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct FoldTally {
    /// Events the fold applied.
    pub applied: u64,
    /// Events already folded that the transport delivered again.
    pub redelivered: u64,
    /// The log's copies of decisions this process published itself.
    pub own_decisions: u64,
    /// Events of ignored or stateless sessions.
    pub ignored: u64,
    /// Agent events refused over their conversation's intake quota without
    /// a record each (the first of an episode is a rejection).
    pub throttled: u64,
}

impl FoldTally {
    pub fn emit(self) {
        if cfg!(feature = "telemetry-off") {
            return;
        }
        if self.applied > 0 {
            metrics::counter!(EVENTS_FOLDED).increment(self.applied);
        }
        for (origin, n) in [
            (DuplicateOrigin::Redelivery, self.redelivered),
            (DuplicateOrigin::OwnDecision, self.own_decisions),
        ] {
            if n > 0 {
                metrics::counter!(EVENTS_DUPLICATE, "origin" => origin.as_str()).increment(n);
            }
        }
        if self.ignored > 0 {
            metrics::counter!(EVENTS_IGNORED).increment(self.ignored);
        }
        if self.throttled > 0 {
            metrics::counter!(EVENTS_THROTTLED).increment(self.throttled);
        }
    }
}

/// Where a duplicate came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DuplicateOrigin {
    /// The transport delivered an event already folded.
    Redelivery,
    /// The log's copy of a decision this process published itself.
    OwnDecision,
}

impl DuplicateOrigin {
    pub fn as_str(self) -> &'static str {
        match self {
            DuplicateOrigin::Redelivery => "redelivery",
            DuplicateOrigin::OwnDecision => "own_decision",
        }
    }
}

/// An event changed nothing: its id was already folded.
/// The fold rejected an event (the caller logs it at WARN with its reason).
pub struct EventRejected<'a> {
    pub conversation_id: &'a str,
    pub event_id: &'a str,
    pub stream_seq: u64,
    /// A closed set: the refusal kind, or `fold` for a fold rejection.
    pub kind: &'static str,
    pub reason: &'a str,
}

impl EventRejected<'_> {
    pub fn emit(self) {
        if cfg!(feature = "telemetry-off") {
            return;
        }
        tracing::warn!(
            conversation_id = self.conversation_id,
            event_id = self.event_id,
            stream_seq = self.stream_seq,
            kind = self.kind,
            reason = self.reason,
            "event rejected"
        );
        metrics::counter!(EVENTS_REJECTED, "kind" => self.kind).increment(1);
    }
}

/// A record was refused before the fold (undecodable, forged, oversized).
pub struct RecordRefused<'a> {
    pub conversation_id: &'a str,
    pub stream_seq: u64,
    pub kind: &'static str,
    pub reason: &'a str,
}

impl RecordRefused<'_> {
    pub fn emit(self) {
        if cfg!(feature = "telemetry-off") {
            return;
        }
        tracing::warn!(
            stream_seq = self.stream_seq,
            conversation_id = self.conversation_id,
            kind = self.kind,
            reason = self.reason,
            "record refused"
        );
        metrics::counter!(EVENTS_REJECTED, "kind" => self.kind).increment(1);
    }
}

/// The policy ignores the event's session.
/// The fold issued compaction jobs.
pub struct JobsIssued {
    pub count: usize,
}

impl JobsIssued {
    pub fn emit(self) {
        if cfg!(feature = "telemetry-off") {
            return;
        }
        if self.count > 0 {
            metrics::counter!(JOBS_ISSUED).increment(self.count as u64);
        }
    }
}

/// State and position were committed to the store.
pub struct StateCommitted {
    pub elapsed: Duration,
}

impl StateCommitted {
    pub fn emit(self) {
        if cfg!(feature = "telemetry-off") {
            return;
        }
        metrics::counter!(STATE_COMMITS).increment(1);
        metrics::histogram!(COMMIT_SECONDS).record(self.elapsed.as_secs_f64());
    }
}

/// The body cache after a commit (its counts are the cache's own totals).
pub struct BodyCacheState {
    pub bytes: u64,
    pub hits: u64,
    pub misses: u64,
}

impl BodyCacheState {
    pub fn emit(self) {
        if cfg!(feature = "telemetry-off") {
            return;
        }
        metrics::gauge!(BODY_CACHE_BYTES).set(self.bytes as f64);
        metrics::counter!(BODY_CACHE_HITS).absolute(self.hits);
        metrics::counter!(BODY_CACHE_MISSES).absolute(self.misses);
    }
}

/// A folder batch was folded.
pub struct BatchFolded {
    pub partition: u32,
    pub records: usize,
}

impl BatchFolded {
    pub fn emit(self) {
        if cfg!(feature = "telemetry-off") {
            return;
        }
        tracing::debug!(
            partition = self.partition,
            records = self.records,
            "batch folded"
        );
        metrics::histogram!(BATCH_SIZE).record(self.records as f64);
    }
}

/// The pending count of a partition's consumer was read.
pub struct ConsumerLag {
    pub partition: u32,
    pub pending: u64,
}

impl ConsumerLag {
    pub fn emit(self) {
        if cfg!(feature = "telemetry-off") {
            return;
        }
        metrics::gauge!(CONSUMER_PENDING, "partition" => self.partition.to_string())
            .set(self.pending as f64);
    }
}

/// How many partitions this process holds.
pub struct PartitionsHeld {
    pub count: usize,
}

impl PartitionsHeld {
    pub fn emit(self) {
        if cfg!(feature = "telemetry-off") {
            return;
        }
        metrics::gauge!(PARTITIONS_HELD).set(self.count as f64);
    }
}

/// What happened to a partition lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseChange {
    Acquired,
    Lost,
    HandedOver,
}

/// A partition lease changed hands.
pub struct LeaseChanged<'a> {
    pub partition: u32,
    pub change: LeaseChange,
    pub reason: &'a str,
}

impl LeaseChanged<'_> {
    pub fn emit(self) {
        if cfg!(feature = "telemetry-off") {
            return;
        }
        let name = match self.change {
            LeaseChange::Acquired => LEASE_ACQUISITIONS,
            LeaseChange::Lost => LEASE_LOSSES,
            LeaseChange::HandedOver => LEASE_HANDOVERS,
        };
        if self.change == LeaseChange::Lost {
            tracing::warn!(
                partition = self.partition,
                reason = self.reason,
                "partition lease lost"
            );
        } else {
            tracing::info!(partition = self.partition, change = ?self.change, reason = self.reason, "partition lease");
        }
        metrics::counter!(name).increment(1);
        if self.change != LeaseChange::Acquired {
            // The new holder reports the partition's lag: a stale value
            // here would alert on a partition this process no longer reads.
            ConsumerLag {
                partition: self.partition,
                pending: 0,
            }
            .emit();
        }
    }
}

/// A sweep (one job) ended.
pub struct SweepFinished<'a> {
    pub conversation_id: &'a str,
    pub job_id: &'a str,
    /// A closed set: the stop reason's name.
    pub outcome: &'static str,
    pub elapsed: Duration,
    pub summaries: u32,
}

impl SweepFinished<'_> {
    pub fn emit(self) {
        if cfg!(feature = "telemetry-off") {
            return;
        }
        tracing::debug!(
            conversation_id = self.conversation_id,
            job_id = self.job_id,
            outcome = self.outcome,
            summaries = self.summaries,
            elapsed_ms = self.elapsed.as_millis() as u64,
            "sweep ended"
        );
        metrics::counter!(SWEEPS_ENDED, "outcome" => self.outcome).increment(1);
        metrics::histogram!(SWEEP_SECONDS, "outcome" => self.outcome)
            .record(self.elapsed.as_secs_f64());
    }
}

/// A summary was written.
pub struct SummaryWritten;

impl SummaryWritten {
    pub fn emit(self) {
        if cfg!(feature = "telemetry-off") {
            return;
        }
        metrics::counter!(SUMMARIES_WRITTEN).increment(1);
    }
}

/// A summarizer pass returned (its calls, tokens and cost).
pub struct SummarizerPass<'a> {
    /// Configured model name (bounded by the configuration).
    pub model: &'a str,
    pub outcome: &'static str,
    pub calls: u64,
    pub tokens: u64,
    pub cost_micros: u64,
    pub elapsed: Duration,
}

impl SummarizerPass<'_> {
    pub fn emit(self) {
        if cfg!(feature = "telemetry-off") {
            return;
        }
        let model = self.model.to_string();
        metrics::counter!(SUMMARIZER_CALLS, "model" => model.clone(), "outcome" => self.outcome)
            .increment(self.calls);
        metrics::histogram!(SUMMARIZER_SECONDS, "model" => model.clone(), "outcome" => self.outcome)
            .record(self.elapsed.as_secs_f64());
        metrics::counter!(SUMMARIZER_TOKENS, "model" => model.clone()).increment(self.tokens);
        metrics::counter!(SUMMARIZER_COST_MICROS, "model" => model).increment(self.cost_micros);
    }
}

/// A job was handed back to be retried after a delay.
pub struct JobRetried<'a> {
    pub job_id: &'a str,
    pub delay: Duration,
}

impl JobRetried<'_> {
    pub fn emit(self) {
        if cfg!(feature = "telemetry-off") {
            return;
        }
        tracing::info!(
            job_id = self.job_id,
            delay_ms = self.delay.as_millis() as u64,
            "job retried after a delay"
        );
        metrics::counter!(JOBS_RETRIED).increment(1);
    }
}

/// A job was dead-lettered.
pub struct JobDeadLettered<'a> {
    pub conversation_id: &'a str,
    pub job_id: &'a str,
    /// Deliveries so far.
    pub delivered: i64,
    /// A closed set: `undecodable`, `max_deliveries`, `deferred_too_often`,
    /// `unrunnable`.
    pub reason: &'static str,
    /// The full reason, for the log only.
    pub error: &'a str,
}

impl JobDeadLettered<'_> {
    pub fn emit(self) {
        if cfg!(feature = "telemetry-off") {
            return;
        }
        tracing::warn!(
            conversation_id = self.conversation_id,
            job_id = self.job_id,
            delivered = self.delivered,
            reason = self.reason,
            error = self.error,
            "dead-lettering job"
        );
        metrics::counter!(JOBS_DEAD_LETTERED, "reason" => self.reason).increment(1);
    }
}

/// Validation rejections and escalations by kind, counted in this process
/// (beside the metrics), so a report such as `contextfold eval` can say
/// why summaries were refused without a metrics exporter.
static SUMMARY_TALLY: std::sync::Mutex<
    std::collections::BTreeMap<(&'static str, &'static str), u64>,
> = std::sync::Mutex::new(std::collections::BTreeMap::new());

fn tally(what: &'static str, kind: &'static str) {
    if let Ok(mut t) = SUMMARY_TALLY.lock() {
        *t.entry((what, kind)).or_default() += 1;
    }
}

/// The process's counts so far: `(("rejected" | "escalated", kind), n)`.
/// Take two and subtract to count what happened in between.
pub fn summary_tally() -> std::collections::BTreeMap<(&'static str, &'static str), u64> {
    SUMMARY_TALLY.lock().map(|t| t.clone()).unwrap_or_default()
}

/// Validation refused a summary text.
pub struct ValidationRejected {
    /// A closed set: [`crate::summarizer::checks::Rejection::kind`],
    /// or `unusable` for an answer that carried no text.
    pub kind: &'static str,
}

impl ValidationRejected {
    pub fn emit(self) {
        tally("rejected", self.kind);
        if cfg!(feature = "telemetry-off") {
            return;
        }
        metrics::counter!(VALIDATION_REJECTIONS, "kind" => self.kind).increment(1);
    }
}

/// A summary escalated after a refusal or failure.
pub struct Escalated {
    /// `aggressive` (a retry with a tighter target) or `fallback` (the
    /// deterministic summary, marked).
    pub kind: &'static str,
}

impl Escalated {
    pub fn emit(self) {
        tally("escalated", self.kind);
        if cfg!(feature = "telemetry-off") {
            return;
        }
        metrics::counter!(ESCALATIONS, "kind" => self.kind).increment(1);
    }
}

/// A conversation's spend window closed: its allowance ran out and its
/// compaction waits for the backoff.
pub struct SpendWindowClosed<'a> {
    pub conversation_id: &'a str,
    /// `core::spend::Wait::as_str` of a spend wait.
    pub window: &'static str,
}

impl SpendWindowClosed<'_> {
    pub fn emit(self) {
        if cfg!(feature = "telemetry-off") {
            return;
        }
        tracing::info!(
            conversation_id = self.conversation_id,
            window = self.window,
            "spend window closed"
        );
        metrics::counter!(SPEND_WINDOWS_CLOSED, "window" => self.window).increment(1);
    }
}

/// A compaction round made no progress: the conversation backs off.
pub struct NoProgressBackoff<'a> {
    pub conversation_id: &'a str,
    /// The end of the backoff (the partition's clock, ms).
    pub until: u64,
}

impl NoProgressBackoff<'_> {
    pub fn emit(self) {
        if cfg!(feature = "telemetry-off") {
            return;
        }
        tracing::info!(
            conversation_id = self.conversation_id,
            until = self.until,
            "compaction round made no progress; backing off"
        );
        metrics::counter!(NO_PROGRESS_BACKOFFS).increment(1);
    }
}

/// A pending job whose work item was not in the queue was queued again.
pub struct JobRequeued<'a> {
    pub conversation_id: &'a str,
    pub job_id: &'a str,
}

impl JobRequeued<'_> {
    pub fn emit(self) {
        if cfg!(feature = "telemetry-off") {
            return;
        }
        tracing::info!(
            conversation_id = self.conversation_id,
            job_id = self.job_id,
            "pending job was not in the queue; queued again"
        );
        metrics::counter!(JOBS_REQUEUED).increment(1);
    }
}

/// A quiet partition recorded a `clock_ticked`.
pub struct ClockTicked {
    pub partition: u32,
}

impl ClockTicked {
    pub fn emit(self) {
        if cfg!(feature = "telemetry-off") {
            return;
        }
        tracing::debug!(partition = self.partition, "clock tick recorded");
        metrics::counter!(CLOCK_TICKS, "partition" => self.partition.to_string()).increment(1);
    }
}

/// A job's worker vanished: the fold gave the job up at its expiry.
pub struct JobExpired<'a> {
    pub conversation_id: &'a str,
    pub job_id: &'a str,
}

impl JobExpired<'_> {
    pub fn emit(self) {
        if cfg!(feature = "telemetry-off") {
            return;
        }
        tracing::warn!(
            conversation_id = self.conversation_id,
            job_id = self.job_id,
            "job expired without a sweep_ended; its worker vanished"
        );
        metrics::counter!(JOBS_EXPIRED).increment(1);
    }
}

/// Two processes fold one stream under different policies (see
/// [`POLICY_CONFLICTS`]): never silent.
pub struct PolicyConflict<'a> {
    /// The event that recorded the other policy (empty for a member's).
    pub event_id: &'a str,
    /// This process's configured policy fingerprint.
    pub ours: &'a str,
    /// The other one.
    pub recorded: &'a str,
    /// Who folds under it (member name), when known.
    pub recorded_by: &'a str,
}

impl PolicyConflict<'_> {
    pub fn emit(self) {
        if cfg!(feature = "telemetry-off") {
            return;
        }
        tracing::warn!(
            event_id = self.event_id,
            ours = self.ours,
            recorded = self.recorded,
            recorded_by = self.recorded_by,
            "processes fold this stream under different policies: this one under {}, {} under {}; \
             give them one [policy] (contextfold doctor lists who folds under what)",
            self.ours,
            if self.recorded_by.is_empty() {
                "another"
            } else {
                self.recorded_by
            },
            self.recorded
        );
        metrics::counter!(POLICY_CONFLICTS).increment(1);
    }
}

/// Jobs waiting and running.
pub struct JobQueue {
    pub queued: u64,
    pub running: u64,
}

impl JobQueue {
    pub fn emit(self) {
        if cfg!(feature = "telemetry-off") {
            return;
        }
        metrics::gauge!(JOBS_QUEUED).set(self.queued as f64);
        metrics::gauge!(JOBS_RUNNING).set(self.running as f64);
    }
}

/// An assemble request was answered.
pub struct Assembled {
    pub elapsed: Duration,
    pub reply_bytes: usize,
}

impl Assembled {
    pub fn emit(self) {
        if cfg!(feature = "telemetry-off") {
            return;
        }
        metrics::histogram!(ASSEMBLE_SECONDS).record(self.elapsed.as_secs_f64());
        metrics::histogram!(ASSEMBLE_REPLY_BYTES).record(self.reply_bytes as f64);
    }
}

/// Readiness changed (or was recomputed).
pub struct Readiness {
    pub ready: bool,
}

impl Readiness {
    pub fn emit(self) {
        if cfg!(feature = "telemetry-off") {
            return;
        }
        metrics::gauge!(READY).set(if self.ready { 1.0 } else { 0.0 });
    }
}

/// Seconds since the epoch of the last refused-reply log line, and the
/// refusals not logged since: a flood of refused requests is counted in
/// full but logged at most once a second.
static REPLY_REFUSALS_LOGGED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static REPLY_REFUSALS_UNLOGGED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// An API request was left unanswered: its reply subject is no inbox.
pub struct ReplyRefused<'a> {
    /// A closed set: [`crate::nats::replies::ReplyFamily::as_str`].
    pub family: &'static str,
    /// The operation asked (a closed set, `unknown` when none).
    pub op: &'static str,
    /// The conversation the request subject names (bounded by the subject
    /// parser; empty for `admin`).
    pub conversation_id: &'a str,
    /// A bounded, escaped start of the reply subject
    /// ([`log_excerpt`]).
    pub reply: &'a str,
}

impl ReplyRefused<'_> {
    pub fn emit(self) {
        use std::sync::atomic::Ordering;
        if cfg!(feature = "telemetry-off") {
            return;
        }
        metrics::counter!(API_REPLIES_REFUSED, "family" => self.family).increment(1);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let last = REPLY_REFUSALS_LOGGED.load(Ordering::Relaxed);
        if now <= last
            || REPLY_REFUSALS_LOGGED
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            REPLY_REFUSALS_UNLOGGED.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let unlogged = REPLY_REFUSALS_UNLOGGED.swap(0, Ordering::Relaxed);
        tracing::warn!(
            family = self.family,
            op = self.op,
            conversation_id = self.conversation_id,
            reply = self.reply,
            unlogged,
            "API request refused unanswered: its reply subject is no inbox (a requester may \
             name only an inbox; see [nats] reply_prefixes); `unlogged` more since the last \
             such line, all counted in contextfold_api_replies_refused_total"
        );
    }
}

/// Why the audit page refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HttpRefusal {
    /// The Host header names no allowed address (DNS rebinding).
    Host,
    /// A cross-site Origin.
    Origin,
    /// The token is missing or wrong.
    Token,
}

impl HttpRefusal {
    pub fn as_str(self) -> &'static str {
        match self {
            HttpRefusal::Host => "host",
            HttpRefusal::Origin => "origin",
            HttpRefusal::Token => "token",
        }
    }
}

/// The audit page refused a request (answered 403 or 401).
pub struct HttpRequestRefused<'a> {
    pub reason: HttpRefusal,
    /// The path asked (bounded and escaped by the caller).
    pub path: &'a str,
}

impl HttpRequestRefused<'_> {
    pub fn emit(self) {
        if cfg!(feature = "telemetry-off") {
            return;
        }
        tracing::debug!(
            reason = self.reason.as_str(),
            path = self.path,
            "audit page request refused"
        );
        metrics::counter!(HTTP_REQUESTS_REFUSED, "reason" => self.reason.as_str()).increment(1);
    }
}

/// The gateway answered a request.
pub struct GatewayRequest {
    /// A closed set: the surface's label.
    pub surface: &'static str,
    /// A closed set (see [`GATEWAY_REQUESTS`]).
    pub outcome: &'static str,
    /// Time from the request's arrival to the upstream call (or the answer).
    pub added: Duration,
}

impl GatewayRequest {
    pub fn emit(self) {
        if cfg!(feature = "telemetry-off") {
            return;
        }
        tracing::debug!(
            surface = self.surface,
            outcome = self.outcome,
            added_us = self.added.as_micros() as u64,
            "gateway request"
        );
        metrics::counter!(GATEWAY_REQUESTS, "surface" => self.surface, "outcome" => self.outcome)
            .increment(1);
        metrics::histogram!(GATEWAY_ADDED_SECONDS, "surface" => self.surface)
            .record(self.added.as_secs_f64());
    }
}

/// The assembled context kept tokens from the upstream.
pub struct GatewayTokensSaved {
    pub surface: &'static str,
    pub tokens: u64,
}

impl GatewayTokensSaved {
    pub fn emit(self) {
        if cfg!(feature = "telemetry-off") {
            return;
        }
        metrics::counter!(GATEWAY_TOKENS_SAVED, "surface" => self.surface).increment(self.tokens);
    }
}

/// A conversation's summary block changed (a new prompt-cache prefix).
pub struct GatewayBlockChanged;

impl GatewayBlockChanged {
    pub fn emit(self) {
        if cfg!(feature = "telemetry-off") {
            return;
        }
        metrics::counter!(GATEWAY_CACHE_PREFIX_CHANGES).increment(1);
    }
}

/// Turns handed to the store.
pub struct GatewayTurnsPublished {
    pub turns: usize,
}

impl GatewayTurnsPublished {
    pub fn emit(self) {
        if cfg!(feature = "telemetry-off") {
            return;
        }
        metrics::counter!(GATEWAY_TURNS_PUBLISHED).increment(self.turns as u64);
    }
}

/// The upstream failed or answered with an error.
pub struct GatewayUpstreamError {
    pub surface: &'static str,
    /// A closed set (see [`GATEWAY_UPSTREAM_ERRORS`]).
    pub class: &'static str,
}

impl GatewayUpstreamError {
    pub fn emit(self) {
        if cfg!(feature = "telemetry-off") {
            return;
        }
        tracing::info!(surface = self.surface, class = self.class, "upstream error");
        metrics::counter!(GATEWAY_UPSTREAM_ERRORS, "surface" => self.surface, "class" => self.class).increment(1);
    }
}

/// A compaction was answered from contextfold.
pub struct GatewayCompactionAnswered {
    pub surface: &'static str,
}

impl GatewayCompactionAnswered {
    pub fn emit(self) {
        if cfg!(feature = "telemetry-off") {
            return;
        }
        tracing::info!(surface = self.surface, "compaction answered");
        metrics::counter!(GATEWAY_COMPACTIONS_ANSWERED, "surface" => self.surface).increment(1);
    }
}

/// The spool changed.
pub struct GatewaySpooled {
    pub pending: usize,
}

impl GatewaySpooled {
    pub fn emit(self) {
        if cfg!(feature = "telemetry-off") {
            return;
        }
        metrics::gauge!(GATEWAY_SPOOLED).set(self.pending as f64);
    }
}

/// The store could not take turns.
pub struct GatewayStoreFailed<'a> {
    pub error: &'a str,
}

impl GatewayStoreFailed<'_> {
    pub fn emit(self) {
        if cfg!(feature = "telemetry-off") {
            return;
        }
        tracing::warn!(error = self.error, "gateway store failure");
        metrics::counter!(GATEWAY_STORE_FAILURES).increment(1);
    }
}

/// At most `max` characters of `subject`, escaped, for a log line: a
/// requester chose these bytes.
pub fn log_excerpt(subject: &str, max: usize) -> String {
    let mut out: String = subject
        .chars()
        .take(max)
        .flat_map(char::escape_debug)
        .collect();
    if subject.chars().count() > max {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_excerpts_are_bounded_and_escaped() {
        assert_eq!(log_excerpt("$KV.a", 64), "$KV.a");
        let long = "x".repeat(10_000);
        assert_eq!(log_excerpt(&long, 8), "xxxxxxxx…");
        assert_eq!(log_excerpt("a\nb\u{1b}", 64), "a\\nb\\u{1b}");
    }

    #[test]
    fn names_are_unique_prefixed_and_carry_their_unit() {
        let mut seen = std::collections::BTreeSet::new();
        for &(name, kind, help) in FAMILIES {
            assert!(seen.insert(name), "{name} listed twice");
            assert!(name.starts_with("contextfold_"), "{name}");
            assert!(!help.is_empty());
            match kind {
                Kind::Counter => assert!(name.ends_with("_total"), "{name}"),
                Kind::Histogram => assert!(
                    name.ends_with("_seconds")
                        || name.ends_with("_bytes")
                        || name.ends_with("_records"),
                    "{name}"
                ),
                Kind::Gauge => assert!(!name.ends_with("_total"), "{name}"),
            }
        }
    }

    #[test]
    fn docs_operations_lists_every_family() {
        let doc = include_str!("../docs/operations.md");
        for &(name, _, _) in FAMILIES {
            assert!(
                doc.contains(&format!("`{name}`")),
                "docs/operations.md does not list {name}"
            );
        }
    }

    /// The exposition of a fresh recorder after [`describe`] and
    /// [`register_known`].
    #[cfg(not(feature = "telemetry-off"))]
    fn exported_at_start(known: &Known) -> String {
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)
            .and_then(|b| b.set_buckets_for_metric(Matcher::Suffix("_bytes".into()), BYTES_BUCKETS))
            .and_then(|b| b.set_buckets_for_metric(Matcher::Full(BATCH_SIZE.into()), BATCH_BUCKETS))
            .unwrap_or_else(|e| panic!("{e}"))
            .build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            describe();
            register_known(known);
        });
        handle.render()
    }

    #[test]
    #[cfg(not(feature = "telemetry-off"))]
    fn every_family_is_exported_before_its_first_event() {
        let known = Known {
            partitions: 4,
            models: vec!["gpt-x".into(), "gpt-y".into(), "gpt-x".into()],
        };
        let text = exported_at_start(&known);
        for &(name, kind, _) in FAMILIES {
            let kind = match kind {
                Kind::Counter => "counter",
                Kind::Gauge => "gauge",
                Kind::Histogram => "histogram",
            };
            assert!(
                text.contains(&format!("# TYPE {name} {kind}\n")),
                "{name} is not exported as a {kind} at start-up:\n{text}"
            );
            for labels in known.label_sets(name) {
                let labels: Vec<String> =
                    labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
                let sample = match kind {
                    "histogram" => {
                        let mut with_le = labels.clone();
                        with_le.push("le=\"+Inf\"".into());
                        format!("{name}_bucket{{{}}} 0\n", with_le.join(","))
                    }
                    _ if labels.is_empty() => format!("{name} 0\n"),
                    _ => format!("{name}{{{}}} 0\n", labels.join(",")),
                };
                assert!(text.contains(&sample), "no `{sample}` at start-up:\n{text}");
            }
        }
        for sample in [
            "contextfold_jobs_dead_lettered_total{reason=\"max_deliveries\"} 0",
            "contextfold_spend_windows_closed_total{window=\"spend_window\"} 0",
            "contextfold_clock_ticks_total{partition=\"3\"} 0",
            "contextfold_summarizer_calls_total{model=\"gpt-y\",outcome=\"ok\"} 0",
            "contextfold_summarizer_tokens_total{model=\"deterministic\"} 0",
            "contextfold_assemble_seconds_count 0",
        ] {
            assert!(text.contains(sample), "no `{sample}`:\n{text}");
        }
        assert!(!text.contains("partition=\"4\""), "{text}");
        assert_eq!(
            known.label_sets(SUMMARIZER_CALLS).len(),
            4 * SUMMARIZER_OUTCOMES.len(),
            "gpt-x, gpt-y, deterministic, unknown: each once"
        );
    }

    #[test]
    #[cfg(not(feature = "telemetry-off"))]
    fn registering_again_changes_nothing_already_counted() {
        let recorder = PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let known = Known {
            partitions: 2,
            models: Vec::new(),
        };
        metrics::with_local_recorder(&recorder, || {
            register_known(&known);
            JobDeadLettered {
                conversation_id: "c",
                job_id: "j",
                delivered: 5,
                reason: "max_deliveries",
                error: "e",
            }
            .emit();
            PartitionsHeld { count: 2 }.emit();
            register_known(&known);
        });
        let text = handle.render();
        assert!(
            text.contains("contextfold_jobs_dead_lettered_total{reason=\"max_deliveries\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("contextfold_jobs_dead_lettered_total{reason=\"unrunnable\"} 0"),
            "{text}"
        );
        assert!(text.contains("contextfold_partitions_held 2"), "{text}");
    }

    /// The closed label sets hold every value the code emits (the enums'
    /// names), so what is exported at start-up is what will be counted.
    #[test]
    fn the_closed_label_sets_hold_every_kind_the_code_counts() {
        use crate::core::event::SweepStop;
        use crate::core::spend::Wait;
        let sweeps = [
            SweepStop::Done,
            SweepStop::Deadline,
            SweepStop::IterationCap,
            SweepStop::SpendLimit,
            SweepStop::NoProgress,
            SweepStop::Failed,
        ];
        for s in sweeps {
            // A new variant breaks this match: add its name to
            // SWEEP_OUTCOMES, and the variant above.
            match s {
                SweepStop::Done
                | SweepStop::Deadline
                | SweepStop::IterationCap
                | SweepStop::SpendLimit
                | SweepStop::NoProgress
                | SweepStop::Failed => {}
            }
            assert!(SWEEP_OUTCOMES.contains(&s.as_str()), "{}", s.as_str());
        }
        assert_eq!(sweeps.len(), SWEEP_OUTCOMES.len());
        let waits = [
            Wait::RetryAfter,
            Wait::Backoff,
            Wait::SpendWindow,
            Wait::UrgentSpendWindow,
            Wait::PartitionWindow,
            Wait::TenantWindow,
        ];
        let spend: Vec<&str> = waits
            .iter()
            .filter(|w| w.is_spend())
            .map(|w| w.as_str())
            .collect();
        assert_eq!(spend, SPEND_WINDOWS);
        for w in waits {
            match w {
                Wait::RetryAfter
                | Wait::Backoff
                | Wait::SpendWindow
                | Wait::UrgentSpendWindow
                | Wait::PartitionWindow
                | Wait::TenantWindow => {}
            }
        }
        let origins: Vec<&str> = [DuplicateOrigin::Redelivery, DuplicateOrigin::OwnDecision]
            .iter()
            .map(|o| o.as_str())
            .collect();
        assert_eq!(origins, DUPLICATE_ORIGINS);
        let refusals: Vec<&str> = [HttpRefusal::Host, HttpRefusal::Origin, HttpRefusal::Token]
            .iter()
            .map(|r| r.as_str())
            .collect();
        assert_eq!(refusals, HTTP_REFUSALS);
        let families: Vec<&str> = crate::nats::replies::ReplyFamily::ALL
            .iter()
            .map(|f| f.as_str())
            .collect();
        assert_eq!(families, REPLY_FAMILIES);

        use crate::core::intake::Refusal;
        let intake = [
            Refusal::Undecodable(crate::core::event::DecodeError::Empty { field: "id" }),
            Refusal::Unroutable("x".into()),
            Refusal::WrongConversation {
                named: "a".into(),
                addressed: "b".into(),
            },
            Refusal::NotAnAgentEvent {
                event_type: "summary_recorded",
            },
            Refusal::TooLong {
                field: "id",
                bytes: 2,
                limit: 1,
            },
            Refusal::TooManyCharacters {
                field: "id",
                chars: 2,
                limit: 1,
            },
            Refusal::TimeOutOfRange { time: 2, limit: 1 },
        ];
        use crate::core::fold::{QuotaScope, Rejection, SummaryRejection, TurnRejection};
        let fold = [
            Rejection::Turn(TurnRejection::ReplayFlood {
                count: 4,
                role: "user",
                limit: 3,
            }),
            Rejection::Turn(TurnRejection::ToolTurnWithoutCallId),
            Rejection::Summary(SummaryRejection::AlreadyRecorded),
            Rejection::Summary(SummaryRejection::Empty),
            Rejection::OverQuota {
                scope: QuotaScope::Partition,
                limit: "100 events/s".into(),
            },
        ];
        for r in &fold {
            // A new kind of rejection breaks this match: add its name to
            // REJECTION_KINDS, and a rejection of it above.
            match r {
                Rejection::Turn(_) | Rejection::Summary(_) | Rejection::OverQuota { .. } => {}
            }
        }
        let mut kinds: Vec<&str> = intake.iter().map(Refusal::kind).collect();
        kinds.extend(fold.iter().map(Rejection::kind));
        kinds.dedup();
        assert_eq!(kinds, REJECTION_KINDS);

        use crate::summarizer::checks::{Copied, Rejection as Invalid};
        let validation = [
            Invalid::Empty,
            Invalid::ReasoningOnly,
            Invalid::ChainOfThought("x".into()),
            Invalid::Continuation("x".into()),
            Invalid::TooShort {
                tokens: 1,
                source_tokens: 9,
            },
            Invalid::NotSmaller {
                tokens: 9,
                source_tokens: 1,
            },
            Invalid::Oversized { tokens: 9, cap: 1 },
            Invalid::Truncated,
            Invalid::Refusal("x".into()),
            Invalid::Delimiter("x".into()),
            Invalid::Copy(Copied::PreviousSummary),
            Invalid::AgentVoice("x".into()),
            Invalid::UnsupportedClaim("x".into()),
        ];
        for v in &validation {
            assert!(VALIDATION_KINDS.contains(&v.kind()), "{}", v.kind());
        }
        for reason in [
            "finish_reason length",
            "reasoning only",
            "refused",
            "rolling state",
            "other",
        ] {
            let kind = crate::summarizer::checks::unusable_kind(reason);
            assert!(VALIDATION_KINDS.contains(&kind), "{kind}");
        }
        // Every list names each value once; every labelled family is one
        // of FAMILIES.
        for (family, labels) in LABELS {
            assert!(
                FAMILIES.iter().any(|(name, _, _)| name == family),
                "{family}"
            );
            for (_, values) in labels.iter() {
                if let Values::Closed(set) = values {
                    let unique: std::collections::BTreeSet<_> = set.iter().collect();
                    assert_eq!(unique.len(), set.len(), "{family}: {set:?}");
                }
            }
        }
    }

    #[test]
    fn the_recorder_renders_what_emits_count() {
        let recorder = PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            FoldTally {
                applied: 2,
                own_decisions: 1,
                ..FoldTally::default()
            }
            .emit();
        });
        let text = handle.render();
        assert!(text.contains("contextfold_events_folded_total 2"), "{text}");
        assert!(
            text.contains("contextfold_events_duplicate_total{origin=\"own_decision\"} 1"),
            "{text}"
        );
    }
}
