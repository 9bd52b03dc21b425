//! `contextfold doctor`: what an operator would check by hand on a NATS
//! deployment, one line per check (`ok`, `warn` or `FAIL` and what to do).
//! It only reads: nothing is created, updated or deleted (no stream,
//! consumer or lease), so it is safe beside a running `serve`. The exit code
//! is 1 when any check fails.

use super::local::runtime;
use super::nats_args::NatsArgs;
use anyhow::Result;
use async_nats::jetstream::{self, stream};
use contextfold::api::status::{GlobalStatus, HealthCode};
use contextfold::api::{decode_reply, Op, ReplyError, StatusRequest, StatusResponse};
use contextfold::config::Config;
use contextfold::nats::leases::{live_member_records, owner_of, LiveMember};
use contextfold::nats::setup::{
    dead_letter_stream_config, events_stream_config, incompatibilities, jobs_stream_config,
    payload_stream_name,
};
use contextfold::nats::NatsConfig;
use contextfold::nats::Subjects;
use contextfold::runtime::engine::policy_fingerprint;
use contextfold::store::redb_backend::{inspect, InspectError};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

/// How long a running serve may take to answer the status request.
const STATUS_TIMEOUT: Duration = Duration::from_secs(5);

/// How a check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Ok,
    Warn,
    Fail,
}

impl Level {
    fn label(self) -> &'static str {
        match self {
            Level::Ok => "ok",
            Level::Warn => "warn",
            Level::Fail => "FAIL",
        }
    }
}

/// One check: what was looked at and what was found (with what to do when
/// it is not ok).
#[derive(Debug, Clone)]
pub struct Finding {
    pub level: Level,
    pub check: String,
    pub detail: String,
}

impl Finding {
    fn new(level: Level, check: impl Into<String>, detail: impl Into<String>) -> Self {
        Finding {
            level,
            check: check.into(),
            detail: detail.into(),
        }
    }

    fn line(&self) -> String {
        format!("{:<4} {}: {}", self.level.label(), self.check, self.detail)
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "level": self.level.label().to_ascii_lowercase(),
            "check": self.check,
            "detail": self.detail,
        })
    }
}

/// Looks a stream up; `Ok(None)` when it does not exist.
async fn stream_info(js: &jetstream::Context, name: &str) -> Result<Option<stream::Info>, String> {
    match js.get_stream(name).await {
        Ok(mut s) => s
            .info()
            .await
            .map(|i| Some(i.clone()))
            .map_err(|e| e.to_string()),
        Err(e) => match e.kind() {
            jetstream::context::GetStreamErrorKind::JetStream(inner)
                if inner.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND =>
            {
                Ok(None)
            }
            _ => Err(e.to_string()),
        },
    }
}

/// The stream `desired` names exists with settings this version can use.
async fn check_stream(
    js: &jetstream::Context,
    desired: &stream::Config,
) -> (Finding, Option<stream::Info>) {
    let check = format!("stream {}", desired.name);
    match stream_info(js, &desired.name).await {
        Ok(Some(info)) => {
            let problems = incompatibilities(&info.config, desired);
            let finding = if problems.is_empty() {
                Finding::new(
                    Level::Ok,
                    check,
                    format!(
                        "{} messages, settings as this version needs",
                        info.state.messages
                    ),
                )
            } else {
                Finding::new(Level::Fail, check, problems.join("; "))
            };
            (finding, Some(info))
        }
        Ok(None) => (
            Finding::new(
                Level::Fail,
                check,
                "missing: start `contextfold serve` once (it creates it), with the same \
                 [nats] prefix as here",
            ),
            None,
        ),
        Err(e) => (
            Finding::new(
                Level::Fail,
                check,
                format!("cannot read it ({e}): check this user's JetStream permissions"),
            ),
            None,
        ),
    }
}

/// A durable consumer's info; `Ok(None)` when it does not exist.
async fn consumer_info(
    js: &jetstream::Context,
    stream: &str,
    name: &str,
) -> Result<Option<jetstream::consumer::Info>, String> {
    let s = js.get_stream(stream).await.map_err(|e| e.to_string())?;
    match s.consumer_info(name).await {
        Ok(info) => Ok(Some(info)),
        Err(e) if e.kind() == jetstream::context::ConsumerInfoErrorKind::NotFound => Ok(None),
        Err(e) => Err(e.to_string()),
    }
}

/// A partition with events waiting and no folder holding it makes no
/// progress: that is a failure, not lag.
fn stalled(lags: &std::collections::BTreeMap<u32, u64>, unowned: &[u32]) -> Finding {
    let stuck: Vec<String> = unowned
        .iter()
        .filter_map(|p| match lags.get(p) {
            Some(&n) if n > 0 => Some(format!("{p} ({n} waiting)")),
            _ => None,
        })
        .collect();
    if stuck.is_empty() {
        Finding::new(Level::Ok, "stalled partitions", "none")
    } else {
        Finding::new(
            Level::Fail,
            "stalled partitions",
            format!(
                "{}: events wait and no folder holds them; start `contextfold serve` with role \
                 folder, or check why running folders do not take these leases (their logs)",
                stuck.join(", ")
            ),
        )
    }
}

/// Where this host's serve keeps the partition state stores, and the
/// policy fingerprint this configuration folds under.
pub struct Stores {
    pub dir: PathBuf,
    pub fingerprint: String,
}

/// The partition state stores under `stores.dir`, read without writing:
/// readable, not ahead of the events stream, folded under this policy.
fn check_stores(stores: &Stores, partitions: u32, last_sequence: Option<u64>) -> Finding {
    let check = format!("state stores ({})", stores.dir.display());
    if !stores.dir.is_dir() {
        return Finding::new(
            Level::Warn,
            check,
            "none on this host: run doctor with the --data (and [nats] prefix) of a serve to \
             check its stores",
        );
    }
    let (mut read, mut in_use, mut absent) = (0, 0, 0);
    let mut unclean = Vec::new();
    let (mut broken, mut ahead, mut other_policy) = (Vec::new(), Vec::new(), Vec::new());
    for p in 0..partitions {
        let path = stores.dir.join(format!("partition-{p}.redb"));
        if !path.is_file() {
            absent += 1;
            continue;
        }
        match inspect(&path) {
            Ok(summary) => {
                read += 1;
                if last_sequence.is_some_and(|last| summary.position > last) {
                    ahead.push(format!("{p} (at {})", summary.position));
                }
                if summary
                    .policy_fingerprint
                    .as_deref()
                    .is_some_and(|f| f != stores.fingerprint)
                {
                    other_policy.push(p);
                }
            }
            Err(InspectError::InUse(_)) => in_use += 1,
            Err(InspectError::NeedsRepair(_)) => unclean.push(p),
            Err(InspectError::Store(e)) => broken.push(format!("{p}: {e}")),
        }
    }
    let counts = format!("{read} read, {in_use} in use by a running serve, {absent} absent");
    if !broken.is_empty() {
        Finding::new(
            Level::Fail,
            check,
            format!(
                "{counts}; unreadable: {}; stop that partition's serve, move the file away and \
                 restart it (it refolds from the stream)",
                broken.join("; ")
            ),
        )
    } else if !ahead.is_empty() {
        Finding::new(
            Level::Fail,
            check,
            format!(
                "{counts}; ahead of the events stream (last sequence {}): partition(s) {}; the \
                 stream was recreated or purged under them: restore the stream, or stop serve \
                 and move these stores away so they refold",
                last_sequence.unwrap_or_default(),
                ahead.join(", ")
            ),
        )
    } else if !unclean.is_empty() {
        Finding::new(
            Level::Warn,
            check,
            format!(
                "{counts}; partition(s) {unclean:?} were not closed cleanly: the next serve \
                 repairs them on open (nothing to do unless it fails to start)"
            ),
        )
    } else if !other_policy.is_empty() {
        Finding::new(
            Level::Warn,
            check,
            format!(
                "{counts}; partition(s) {other_policy:?} were folded under another policy than \
                 this configuration's: make every process's [policy] agree (a folder with \
                 another policy records it in the partition's log and folds under it from there)"
            ),
        )
    } else {
        Finding::new(Level::Ok, check, counts)
    }
}

/// Every check against the servers `cfg` names.
pub async fn diagnose(cfg: &NatsConfig, stores: &Stores) -> Vec<Finding> {
    let mut out = Vec::new();
    let servers = cfg.connection.display_servers();
    if let Err(e) = cfg.validate() {
        out.push(Finding::new(
            Level::Fail,
            "configuration",
            format!("{e}: fix it in the configuration file or CONTEXTFOLD_NATS__* variables"),
        ));
        return out;
    }
    let subjects = match cfg.subjects() {
        Ok(s) => s,
        Err(e) => {
            out.push(Finding::new(Level::Fail, "configuration", e.to_string()));
            return out;
        }
    };
    // Connecting checks the server version and that JetStream is enabled.
    let client = match cfg.connection.connect().await {
        Ok((client, version)) => {
            out.push(Finding::new(
                Level::Ok,
                "server",
                format!("nats-server {version} at {servers}, JetStream enabled"),
            ));
            client
        }
        Err(e) => {
            out.push(Finding::new(Level::Fail, "server", e.to_string()));
            return out;
        }
    };
    let js = jetstream::new(client.clone());

    let desired = [
        events_stream_config(cfg),
        jobs_stream_config(cfg),
        dead_letter_stream_config(cfg),
    ];
    let mut infos = Vec::new();
    for d in desired {
        match d {
            Ok(d) => {
                let (finding, info) = check_stream(&js, &d).await;
                out.push(finding);
                infos.push(info);
            }
            Err(e) => {
                out.push(Finding::new(Level::Fail, "configuration", e.to_string()));
                return out;
            }
        }
    }
    let (events, jobs, dead) = (&infos[0], &infos[1], &infos[2]);
    let last_sequence = events.as_ref().map(|i| i.state.last_sequence);
    out.push(check_stores(stores, cfg.partitions, last_sequence));

    // Events waiting per partition, for the stalled-partition check.
    let mut lags = std::collections::BTreeMap::<u32, u64>::new();
    if events.is_some() {
        let events_name = subjects.events_stream();
        let mut missing = Vec::new();
        let mut lag = 0u64;
        let mut unreadable = Vec::new();
        for p in 0..cfg.partitions {
            let name = subjects.folder_consumer(p);
            match consumer_info(&js, &events_name, &name).await {
                Ok(Some(info)) => {
                    let waiting = info.num_pending + info.num_ack_pending as u64;
                    lags.insert(p, waiting);
                    lag += waiting;
                }
                Ok(None) => missing.push(p),
                Err(e) => unreadable.push(format!("{name}: {e}")),
            }
        }
        let check = "folder consumers";
        if !missing.is_empty() {
            out.push(Finding::new(
                Level::Fail,
                check,
                format!(
                    "missing for partition(s) {missing:?} ({}): restart `contextfold serve` with \
                     role folder; it recreates them from its store's position (the state is not \
                     lost)",
                    missing
                        .iter()
                        .map(|p| subjects.folder_consumer(*p))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        } else if !unreadable.is_empty() {
            out.push(Finding::new(
                Level::Fail,
                check,
                format!("cannot read {}", unreadable.join("; ")),
            ));
        } else {
            out.push(Finding::new(
                Level::Ok,
                check,
                format!("{} present", cfg.partitions),
            ));
        }
        let level = if lag == 0 { Level::Ok } else { Level::Warn };
        let detail = if lag == 0 {
            "0 events not yet folded".to_string()
        } else {
            format!(
                "{lag} events not yet folded: fine while turns arrive; if it does not fall, \
                 check that a folder holds every partition (leases) and its logs"
            )
        };
        out.push(Finding::new(level, "consumer lag", detail));
    }

    if jobs.is_some() {
        let name = subjects.summarizer_consumer();
        let check = format!("summarizer consumer {name}");
        match consumer_info(&js, &subjects.jobs_stream(), &name).await {
            Ok(Some(info)) => {
                let (level, detail) = if info.num_redelivered > 0 {
                    (
                        Level::Warn,
                        format!(
                            "{} job(s) redelivered, {} in flight, {} waiting: a summarizer \
                             timed out or failed; see its logs (LLM endpoint, job_ack_wait_ms)",
                            info.num_redelivered, info.num_ack_pending, info.num_pending
                        ),
                    )
                } else {
                    (
                        Level::Ok,
                        format!(
                            "{} in flight, {} waiting, none redelivered",
                            info.num_ack_pending, info.num_pending
                        ),
                    )
                };
                out.push(Finding::new(level, check, detail));
            }
            Ok(None) => out.push(Finding::new(
                Level::Fail,
                check,
                "missing: restart `contextfold serve` (it recreates it); jobs wait meanwhile",
            )),
            Err(e) => out.push(Finding::new(
                Level::Fail,
                check,
                format!("cannot read: {e}"),
            )),
        }
    }

    if let Some(dead) = dead {
        let n = dead.state.messages;
        let check = "dead letters";
        if n == 0 {
            out.push(Finding::new(Level::Ok, check, "none"));
        } else {
            out.push(Finding::new(
                Level::Fail,
                check,
                format!(
                    "{n} in stream {}: read them (`nats stream view {}`), fix the cause, then \
                     purge the stream",
                    subjects.dead_letter_stream(),
                    subjects.dead_letter_stream()
                ),
            ));
        }
    }

    out.push(check_payloads(&js, cfg, &subjects).await);

    let bucket = subjects.lease_bucket();
    let check = format!("leases ({bucket})");
    match js.get_key_value(&bucket).await {
        Ok(kv) => {
            let mut owners = std::collections::BTreeMap::<String, u32>::new();
            let mut unowned: Vec<u32> = Vec::new();
            for p in 0..cfg.partitions {
                match owner_of(&kv, p).await {
                    Ok(Some(owner)) => *owners.entry(owner).or_default() += 1,
                    Ok(None) => unowned.push(p),
                    Err(e) => {
                        out.push(Finding::new(Level::Fail, check.clone(), e.to_string()));
                        return out;
                    }
                }
            }
            match live_member_records(&kv).await {
                Ok(members) => out.push(judge_policies(&members, &stores.fingerprint)),
                Err(e) => out.push(Finding::new(
                    Level::Fail,
                    "policy agreement",
                    format!("cannot list the members in {bucket}: {e}"),
                )),
            }
            let held = owners
                .iter()
                .map(|(o, n)| format!("{o} holds {n}"))
                .collect::<Vec<_>>()
                .join(", ");
            out.push(stalled(&lags, &unowned));
            if unowned.is_empty() {
                out.push(Finding::new(Level::Ok, check, held));
            } else {
                out.push(Finding::new(
                    Level::Warn,
                    check,
                    format!(
                        "no folder holds partition(s) {unowned:?}{}: their turns wait; start \
                         `contextfold serve` with role folder",
                        if held.is_empty() {
                            String::new()
                        } else {
                            format!(" ({held})")
                        }
                    ),
                ));
            }
        }
        Err(e) => out.push(Finding::new(
            Level::Fail,
            check,
            format!("cannot open the bucket ({e}): start `contextfold serve` once (it creates it)"),
        )),
    }
    out.extend(serve_status(&client, &subjects).await);
    out
}

/// The job-snapshot object store: present, and its `max_age` the
/// configured `payload_max_age_ms`, so snapshots a crash left behind
/// expire.
async fn check_payloads(js: &jetstream::Context, cfg: &NatsConfig, subjects: &Subjects) -> Finding {
    let bucket = subjects.payload_bucket();
    let check = format!("object store {bucket}");
    let want = cfg.payload_max_age();
    match stream_info(js, &payload_stream_name(&bucket)).await {
        Ok(Some(info)) => {
            let held = format!("{} bytes held", info.state.bytes);
            let have = info.config.max_age;
            if have == want {
                Finding::new(
                    Level::Ok,
                    check,
                    format!("{held}, snapshots expire after {} ms", want.as_millis()),
                )
            } else if have.is_zero() {
                Finding::new(
                    Level::Warn,
                    check,
                    format!(
                        "{held}; no max_age: job snapshots a crash left behind are kept for ever; \
                         restart `contextfold serve` of this version (it sets max_age = \
                         payload_max_age_ms, {} ms)",
                        want.as_millis()
                    ),
                )
            } else {
                Finding::new(
                    Level::Warn,
                    check,
                    format!(
                        "{held}; max_age is {} ms, this configuration's payload_max_age_ms is {} \
                         ms: give every process the same setting (serve applies it at start)",
                        have.as_millis(),
                        want.as_millis()
                    ),
                )
            }
        }
        Ok(None) => Finding::new(
            Level::Fail,
            check,
            "missing: start `contextfold serve` once (it creates it), with the same [nats] \
             prefix as here",
        ),
        Err(e) => Finding::new(
            Level::Fail,
            check,
            format!("cannot read it ({e}): check this user's JetStream permissions"),
        ),
    }
}

/// Whether the live members (processes that fold: roles folder or api)
/// fold under one policy, and this configuration's. Two policies fold the
/// same conversation two ways: a partition moving between them switches
/// policy each time (each records its own in the log) and answers differ
/// with the member that holds it.
fn judge_policies(members: &[LiveMember], own: &str) -> Finding {
    let check = "policy agreement";
    let mut by_policy = std::collections::BTreeMap::<&str, Vec<&str>>::new();
    let mut unknown = Vec::new();
    for m in members {
        match m
            .record
            .as_ref()
            .and_then(|r| r.policy_fingerprint.as_deref())
        {
            Some(fp) => by_policy.entry(fp).or_default().push(&m.member),
            None => unknown.push(m.member.as_str()),
        }
    }
    let listed = |by: &std::collections::BTreeMap<&str, Vec<&str>>| {
        by.iter()
            .map(|(fp, who)| format!("{} under {fp}", who.join(", ")))
            .collect::<Vec<_>>()
            .join("; ")
    };
    if by_policy.len() > 1 {
        return Finding::new(
            Level::Fail,
            check,
            format!(
                "live members fold under different policies: {}; give every process the same \
                 [policy] (this configuration's is {own}) and restart the ones that differ",
                listed(&by_policy)
            ),
        );
    }
    let mut warnings = Vec::new();
    if !unknown.is_empty() {
        warnings.push(format!(
            "member(s) {} publish no policy fingerprint (an older contextfold): upgrade them \
             to have their policy checked",
            unknown.join(", ")
        ));
    }
    if let Some((fp, _)) = by_policy.iter().next() {
        if *fp != own {
            warnings.push(format!(
                "this config folds under {own}, the cluster under {fp}: run doctor with the \
                 serves' configuration (its state-store check compares with this one's policy), \
                 or give the serves this [policy]"
            ));
        }
    }
    if !warnings.is_empty() {
        let mut detail = warnings.join("; ");
        if !by_policy.is_empty() {
            detail = format!("{}; {detail}", listed(&by_policy));
        }
        return Finding::new(Level::Warn, check, detail);
    }
    if by_policy.is_empty() {
        return Finding::new(Level::Ok, check, "no live member folds: nothing to compare");
    }
    Finding::new(
        Level::Ok,
        check,
        format!(
            "{} live member(s) fold under {own}, this configuration's policy",
            members.len()
        ),
    )
}

/// What a running serve (role api) says of the partitions it folds and of
/// its jobs, through the global status any client can ask for.
async fn serve_status(client: &async_nats::Client, subjects: &Subjects) -> Vec<Finding> {
    let subject = subjects.admin(Op::Status);
    let check = "serve status";
    let body = match serde_json::to_vec(&StatusRequest { conversation: None }) {
        Ok(b) => b,
        Err(e) => return vec![Finding::new(Level::Fail, check, e.to_string())],
    };
    let request = async_nats::Request::new()
        .payload(body.into())
        .timeout(Some(STATUS_TIMEOUT));
    let reply = match client.send_request(subject.clone(), request).await {
        Ok(m) => m.payload.to_vec(),
        Err(e) => {
            let why = match e.kind() {
                async_nats::client::RequestErrorKind::NoResponders => {
                    "no serve with role api answers".to_string()
                }
                _ => e.to_string(),
            };
            return vec![Finding::new(
                Level::Warn,
                check,
                format!(
                    "{why} on {subject}: partition and job health not checked; run \
                     `contextfold serve` with role api (the default roles include it)"
                ),
            )];
        }
    };
    match decode_reply::<StatusResponse>(&reply) {
        Ok(StatusResponse::Global(g)) => {
            let mut out = vec![Finding::new(
                Level::Ok,
                check,
                format!("a serve answers on {subject}"),
            )];
            out.extend(judge_status(&g));
            out
        }
        Ok(StatusResponse::Conversation(_)) => vec![Finding::new(
            Level::Warn,
            check,
            format!("{subject} answered with a conversation's status: is it a contextfold API?"),
        )],
        Err(ReplyError::Api(e)) => vec![Finding::new(
            Level::Warn,
            check,
            format!("{} ({})", e.message, e.code.as_str()),
        )],
        Err(ReplyError::Malformed(m)) => vec![Finding::new(
            Level::Warn,
            check,
            format!("malformed reply on {subject}: {m}; is serve of another version?"),
        )],
    }
}

/// Partitions and jobs as one serve reports them.
fn judge_status(g: &GlobalStatus) -> Vec<Finding> {
    let mut out = Vec::new();
    let retrying: Vec<String> = g
        .partitions
        .iter()
        .filter(|p| p.retrying)
        .map(|p| {
            format!(
                "{} ({})",
                p.partition,
                p.last_error.as_deref().unwrap_or("unknown error")
            )
        })
        .collect();
    let catching_up = g.partitions.iter().filter(|p| p.catching_up).count();
    if !retrying.is_empty() {
        out.push(Finding::new(
            Level::Fail,
            "partition health",
            format!(
                "retrying: {}; fix the cause the error names (state store, disk, permissions), \
                 the folder retries by itself",
                retrying.join(", ")
            ),
        ));
    } else if catching_up > 0 {
        out.push(Finding::new(
            Level::Warn,
            "partition health",
            format!(
                "{catching_up} of {} partitions still folding history; wait",
                g.partitions.len()
            ),
        ));
    } else {
        out.push(Finding::new(
            Level::Ok,
            "partition health",
            format!(
                "{} partitions folding, none retrying, {} conversations",
                g.partitions.len(),
                g.conversations
            ),
        ));
    }
    out.push(judge_spend(g));
    out.push(judge_debts(g));
    let stuck: Vec<&str> = g
        .health
        .reasons
        .iter()
        .filter(|r| matches!(r.code, HealthCode::OverdueJob | HealthCode::StalledDebt))
        .map(|r| r.message.as_str())
        .collect();
    if stuck.is_empty() {
        out.push(Finding::new(
            Level::Ok,
            "stuck jobs",
            format!("none ({} pending)", g.pending_jobs),
        ));
    } else {
        out.push(Finding::new(
            Level::Warn,
            "stuck jobs",
            format!(
                "{}: check that a summarizer runs and reaches its model (its logs)",
                stuck.join("; ")
            ),
        ));
    }
    out
}

/// Debts that should move and do not (stuck), or cannot (blocked): the
/// "every debt ends" invariant, as the service sees it now.
fn judge_debts(g: &GlobalStatus) -> Finding {
    let check = "debts";
    if g.stuck_conversations == 0 && g.blocked_conversations == 0 {
        return Finding::new(
            Level::Ok,
            check,
            format!("{} owed, each with a job out or a wait that ends", g.debts),
        );
    }
    let mut what = Vec::new();
    if g.stuck_conversations > 0 {
        what.push(format!(
            "{} stuck (no job out and no wait ending, e.g. {}): their partitions folded no record \
             or tick since their time came; check the partition health above and the serve logs, \
             or send `compact` to one to make it go on now",
            g.stuck_conversations,
            g.stuck.join(", ")
        ));
    }
    if g.blocked_conversations > 0 {
        what.push(format!(
            "{} blocked: a spend limit of [policy] is 0, so no summarizer call is ever allowed; \
             raise summary_max_*_per_window in every process's [policy]",
            g.blocked_conversations
        ));
    }
    Finding::new(Level::Warn, check, what.join("; "))
}

/// Spend windows closed now (at the newest event time the serve folded):
/// conversations whose routine summarization waits, and partitions whose
/// partition-wide window is used up.
fn judge_spend(g: &GlobalStatus) -> Finding {
    let check = "spend windows";
    let mut closed = Vec::new();
    if g.spend_backoff_conversations > 0 {
        closed.push(format!(
            "{} conversation(s) in backoff after a round without progress \
             (no_progress_backoff_ms, doubling up to summary_spend_backoff_ms)",
            g.spend_backoff_conversations
        ));
    }
    if g.spend_exhausted_conversations > 0 {
        closed.push(format!(
            "{} conversation(s) used up their window (summary_max_calls_per_window, \
             summary_max_tokens_per_window, summary_max_cost_micros_per_window)",
            g.spend_exhausted_conversations
        ));
    }
    let partitions: Vec<String> = g
        .partitions
        .iter()
        .filter_map(|p| {
            let w = p.spend_window.as_ref().filter(|w| w.closed)?;
            Some(match w.reopens_at {
                Some(t) => format!("{} (until {t})", p.partition),
                None => p.partition.to_string(),
            })
        })
        .collect();
    if !partitions.is_empty() {
        closed.push(format!(
            "partition-wide window used up (summary_max_*_per_window_global) in partition(s) {}",
            partitions.join(", ")
        ));
    }
    if closed.is_empty() {
        return Finding::new(Level::Ok, check, "none closed");
    }
    let until = g
        .spend_paused_until
        .map(|t| format!(" until {t} (the partitions' clock, ms)"))
        .unwrap_or_default();
    Finding::new(
        Level::Warn,
        check,
        format!(
            "{}: routine summarization is paused{until} (urgent compaction still runs); raise \
             the limit named (or shorten summary_spend_backoff_ms) in every process's [policy], \
             which the partitions record and fold under from there, or wait",
            closed.join("; ")
        ),
    )
}

/// Runs every check, prints one line each (or one JSON object) and fails
/// when any check fails.
pub fn doctor(config: &Config, nats: &NatsArgs, json: bool) -> Result<ExitCode> {
    let cfg = nats.apply(&config.nats);
    let stores = Stores {
        dir: config.data_dir.join("nats").join(&cfg.prefix),
        fingerprint: policy_fingerprint(&config.policy),
    };
    let rt = runtime()?;
    let mut findings = rt.block_on(diagnose(&cfg, &stores));
    findings.extend(rt.block_on(gateway_upstream(config)));
    let failed = findings.iter().any(|f| f.level == Level::Fail);
    let mut out = std::io::stdout().lock();
    let written = if json {
        let v = serde_json::json!({
            "ok": !failed,
            "checks": findings.iter().map(Finding::json).collect::<Vec<_>>(),
        });
        writeln!(out, "{v}")
    } else {
        findings
            .iter()
            .try_for_each(|f| writeln!(out, "{}", f.line()))
    };
    match written {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
        other => other?,
    }
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// The gateway's upstream, when `[gateway]` names one: does it answer
/// `GET /v1/models`? (Credentials: `OPENAI_API_KEY` when set; a 401 or 403
/// is a warning, since clients bring their own.)
async fn gateway_upstream(config: &Config) -> Option<Finding> {
    let g = &config.gateway;
    g.upstream.as_ref().or(g.upstream_chat.as_ref())?;
    let check = "gateway upstream";
    let upstream = match contextfold::gateway::upstream::Upstream::new(g) {
        Ok(u) => u,
        Err(e) => return Some(Finding::new(Level::Fail, check, e.to_string())),
    };
    let url = contextfold::secret::redact_url(upstream.base(None).unwrap_or_default());
    Some(match upstream.check(None).await {
        Ok(status) if (200..300).contains(&status) => {
            Finding::new(Level::Ok, check, format!("{url} answers GET /v1/models ({status})"))
        }
        Ok(status @ (401 | 403)) => Finding::new(
            Level::Warn,
            check,
            format!(
                "{url} answers but refuses the credential ({status}): clients bring their own,                  or set the tenants' upstream_api_key"
            ),
        ),
        Ok(status) => Finding::new(
            Level::Fail,
            check,
            format!("{url} answers GET /v1/models with {status}: check [gateway] upstream"),
        ),
        Err(e) => Finding::new(
            Level::Fail,
            check,
            format!("{url} is unreachable ({e}): check [gateway] upstream and the network"),
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_name_level_check_and_what_to_do() {
        let f = Finding::new(Level::Fail, "dead letters", "3 in stream CF_DEAD: purge");
        assert_eq!(f.line(), "FAIL dead letters: 3 in stream CF_DEAD: purge");
        assert_eq!(f.json()["level"], "fail");
        assert_eq!(Finding::new(Level::Ok, "x", "y").line(), "ok   x: y");
    }

    #[test]
    fn a_retrying_partition_fails_and_catching_up_warns() {
        use contextfold::api::status::{global_status, with_partitions, PartitionHealth};
        let g = global_status(&Default::default(), &Default::default()).unwrap();
        let mut bad = PartitionHealth::new(3);
        bad.retrying = true;
        bad.last_error = Some("disk full".into());
        let mut busy = PartitionHealth::new(4);
        busy.catching_up = true;
        let healthy = judge_status(&with_partitions(g.clone(), vec![PartitionHealth::new(0)]));
        assert!(healthy.iter().all(|f| f.level == Level::Ok), "{healthy:?}");
        let failing = judge_status(&with_partitions(g.clone(), vec![bad, busy.clone()]));
        assert_eq!(failing[0].level, Level::Fail);
        assert!(failing[0].detail.contains("3 (disk full)"), "{failing:?}");
        let waiting = judge_status(&with_partitions(g, vec![busy]));
        assert_eq!(waiting[0].level, Level::Warn);
    }

    #[test]
    fn closed_spend_windows_warn_with_what_they_mean() {
        use contextfold::api::status::PartitionWindow;
        use contextfold::api::status::{global_status, with_partitions, PartitionHealth};
        let g = global_status(&Default::default(), &Default::default()).unwrap();
        let spend = |g: &GlobalStatus| {
            judge_status(g)
                .into_iter()
                .find(|f| f.check == "spend windows")
                .expect("a spend windows finding")
        };
        let open = spend(&g);
        assert_eq!(open.level, Level::Ok, "{open:?}");

        let mut closed = g.clone();
        closed.spend_backoff_conversations = 2;
        closed.spend_exhausted_conversations = 1;
        closed.spend_paused_until = Some(1_700_000_600_000);
        let f = spend(&closed);
        assert_eq!(f.level, Level::Warn, "{f:?}");
        for part in [
            "2 conversation(s) in backoff",
            "1 conversation(s) used up their window",
            "summary_max_calls_per_window",
            "paused until 1700000600000",
            "or wait",
        ] {
            assert!(f.detail.contains(part), "{part:?} in {}", f.detail);
        }
        // A warning, not a failure: doctor still exits 0 on it alone.
        assert!(judge_status(&closed).iter().all(|f| f.level != Level::Fail));

        let window = |closed: bool| PartitionWindow {
            calls: 4,
            tokens: 0,
            cost_micros: 0,
            max_calls: Some(4),
            max_tokens: None,
            max_cost_micros: None,
            closed,
            reopens_at: Some(99),
            waiting_conversations: 1,
        };
        let partitions = vec![
            PartitionHealth {
                spend_window: Some(window(true)),
                ..PartitionHealth::new(7)
            },
            PartitionHealth {
                spend_window: Some(window(false)),
                ..PartitionHealth::new(8)
            },
        ];
        let f = spend(&with_partitions(g, partitions));
        assert_eq!(f.level, Level::Warn, "{f:?}");
        assert!(f.detail.contains("partition(s) 7 (until 99)"), "{f:?}");
        assert!(!f.detail.contains(" 8"), "{f:?}");
    }

    #[test]
    fn members_under_different_policies_fail_and_unknown_ones_warn() {
        use contextfold::nats::leases::MemberRecord;
        let member = |id: &str, fp: Option<&str>| LiveMember {
            member: id.into(),
            record: Some(MemberRecord {
                member: id.into(),
                held: 8,
                policy_fingerprint: fp.map(Into::into),
                ttl_ms: Some(1_500),
            }),
        };
        let same = [member("a-1", Some("fp-a")), member("b-2", Some("fp-a"))];
        let f = judge_policies(&same, "fp-a");
        assert_eq!(f.level, Level::Ok, "{f:?}");
        assert!(
            f.detail.contains("2 live member(s) fold under fp-a"),
            "{f:?}"
        );

        let split = [member("a-1", Some("fp-a")), member("b-2", Some("fp-b"))];
        let f = judge_policies(&split, "fp-a");
        assert_eq!(f.level, Level::Fail, "{f:?}");
        assert!(
            f.detail.contains("a-1 under fp-a") && f.detail.contains("b-2 under fp-b"),
            "{f:?}"
        );
        assert!(f.detail.contains("same [policy]"), "{f:?}");

        let f = judge_policies(&same, "fp-mine");
        assert_eq!(f.level, Level::Warn, "{f:?}");
        assert!(
            f.detail
                .contains("this config folds under fp-mine, the cluster under fp-a"),
            "{f:?}"
        );

        let older = [
            member("a-1", Some("fp-a")),
            member("old-3", None),
            LiveMember {
                member: "odd-4".into(),
                record: None,
            },
        ];
        let f = judge_policies(&older, "fp-a");
        assert_eq!(f.level, Level::Warn, "{f:?}");
        assert!(f.detail.contains("old-3, odd-4"), "{f:?}");
        assert!(f.detail.contains("older contextfold"), "{f:?}");

        assert_eq!(judge_policies(&[], "fp-a").level, Level::Ok);
    }

    #[test]
    fn stores_ahead_of_the_stream_fail_and_another_policy_warns() {
        use contextfold::store::redb_backend::RedbBackend;
        use contextfold::store::{KvBackend, Table, Write};
        let dir = tempfile::tempdir().unwrap();
        let stores = Stores {
            dir: dir.path().to_path_buf(),
            fingerprint: "this-policy".into(),
        };
        // Nothing stored yet: position 0, no policy.
        drop(RedbBackend::open(&dir.path().join("partition-0.redb")).unwrap());
        let f = check_stores(&stores, 2, Some(0));
        assert_eq!(f.level, Level::Ok, "{f:?}");
        assert!(
            f.detail.contains("1 read") && f.detail.contains("1 absent"),
            "{f:?}"
        );
        let missing = Stores {
            dir: dir.path().join("nowhere"),
            fingerprint: String::new(),
        };
        assert_eq!(check_stores(&missing, 2, Some(0)).level, Level::Warn);

        // Partition 1 at position 9 under another policy (the state store's
        // own meta keys, as `StateStore::commit` writes them).
        let mut b = RedbBackend::open(&dir.path().join("partition-1.redb")).unwrap();
        let put = |key: &[u8], value: &[u8]| Write::Put {
            table: Table::Meta,
            key: key.to_vec(),
            value: value.to_vec(),
        };
        b.commit(
            &[
                put(b"position", &9u64.to_be_bytes()),
                put(b"policy", b"other-policy"),
            ],
            true,
        )
        .unwrap();
        drop(b);
        let f = check_stores(&stores, 2, Some(9));
        assert_eq!(f.level, Level::Warn, "{f:?}");
        assert!(
            f.detail.contains("[1]") && f.detail.contains("another policy"),
            "{f:?}"
        );
        let f = check_stores(&stores, 2, Some(5));
        assert_eq!(f.level, Level::Fail, "{f:?}");
        assert!(f.detail.contains("1 (at 9)"), "{f:?}");
    }

    #[test]
    fn only_unowned_partitions_with_waiting_events_are_stalled() {
        let lags = [(0, 3), (1, 0), (2, 7)].into_iter().collect();
        assert_eq!(stalled(&lags, &[1]).level, Level::Ok);
        assert_eq!(stalled(&lags, &[]).level, Level::Ok);
        let f = stalled(&lags, &[1, 2]);
        assert_eq!(f.level, Level::Fail);
        assert!(f.detail.starts_with("2 (7 waiting):"), "{}", f.detail);
        assert!(!f.detail.contains("0 (3"), "{}", f.detail);
    }
}
