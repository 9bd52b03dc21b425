//! `replay --policy FILE [CONV...]`: what another policy would have done
//! with the same traffic, beside what really happened.
//!
//! The agent events of the log (records an agent wrote, or a legacy
//! embedded log's agent event types) are folded again, in memory, under
//! the other policy, with the embedded pipeline: its jobs run as they are
//! issued. A summary the new cut points ask for is taken from the log when
//! the log holds one over exactly the same sources (same conversation,
//! kind, depth and sources); otherwise the deterministic summarizer writes
//! it, and it counts as a model call the other policy would have needed.
//! What really happened is the whole log folded as it was (each recorded
//! policy from where it was recorded). Both are measured once the service
//! answered each agent event of a conversation (what happened: just before
//! the log's next agent event; the other policy: once the jobs the event
//! issued have run): the tokens in its context (peak and mean) and whether
//! they exceeded its budget (an overflow). Compactions are the
//! jobs issued; summaries are counted by depth at the end. Nothing is
//! written: not the log, not the store.

use anyhow::{Context, Result};
use contextfold::core::event::{Envelope, EventBody, Origin};
use contextfold::core::policy::{self, PolicyConfig};
use contextfold::core::summary::{RollingStateRequest, SummaryDraft, SummaryRequest};
use contextfold::log::memory::MemoryLog;
use contextfold::log::{EventLog, LogRecord};
use contextfold::runtime::embedded::Pipeline;
use contextfold::runtime::engine::{policy_fingerprint, Effects, Engine};
use contextfold::store::memory_backend::MemoryBackend;
use contextfold::store::KvBackend;
use contextfold::summarizer::{
    Budget, DeterministicSummarizer, RollingOutcome, SummarizeError, Summarizer, SummaryOutcome,
};
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

impl Outcome {
    fn count_job(&mut self, job: &contextfold::core::event::JobIssued) {
        if job.compact {
            self.compactions += 1;
        } else {
            self.rolling_only_jobs += 1;
        }
    }
}

/// What one run of a conversation's traffic did.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Outcome {
    /// Compaction jobs issued (jobs that summarize; as `audit` counts them).
    pub compactions: u64,
    /// Jobs issued for the rolling session state only.
    pub rolling_only_jobs: u64,
    /// Summaries in the final state, by depth (0 = leaves).
    pub summaries_by_depth: BTreeMap<u32, u64>,
    /// Tokens in context after each agent event: the largest, and the mean.
    pub peak_context_tokens: u64,
    pub mean_context_tokens: u64,
    /// Agent events after which the context was over the budget.
    pub budget_overflows: u64,
    /// Model calls: spent (what happened: the sweeps' reported calls), or
    /// needed (the other policy: summaries the log had no copy of).
    pub model_calls: u64,
    /// Agent events measured.
    pub agent_events: u64,
}

/// One conversation under both.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ConversationWhatIf {
    pub conversation: String,
    pub actual: Outcome,
    pub what_if: Outcome,
    /// Of the other policy's summaries: taken from the log, and written by
    /// the deterministic summarizer because the log had none over the
    /// same sources.
    pub summaries_from_log: u64,
    pub summaries_deterministic: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WhatIf {
    pub policy_fingerprint: String,
    pub conversations: Vec<ConversationWhatIf>,
}

/// Tallies while folding, per conversation.
#[derive(Default)]
struct Meter {
    sum: u128,
    outcome: Outcome,
}

impl Meter {
    fn measure(&mut self, context_tokens: u64, budget: u64) {
        let o = &mut self.outcome;
        o.agent_events += 1;
        o.peak_context_tokens = o.peak_context_tokens.max(context_tokens);
        if context_tokens > budget {
            o.budget_overflows += 1;
        }
        self.sum += u128::from(context_tokens);
    }

    fn finish(mut self) -> Outcome {
        if self.outcome.agent_events > 0 {
            self.outcome.mean_context_tokens =
                u64::try_from(self.sum / u128::from(self.outcome.agent_events)).unwrap_or(u64::MAX);
        }
        self.outcome
    }
}

/// An agent event of the log: written by an agent, or (legacy embedded
/// logs) of an agent event type.
fn agent_event(r: &LogRecord) -> Option<Envelope> {
    let e = Envelope::decode(&r.bytes, r.encoding).ok()?;
    let agent = match r.origin {
        Origin::Agent => true,
        Origin::Legacy => e.body.is_agent_event(),
        Origin::Service => false,
    };
    agent.then_some(e)
}

fn key(conversation: &str, req_kind: &str, depth: u32, labels: &[String]) -> String {
    format!(
        "{conversation}\u{0}{req_kind}\u{0}{depth}\u{0}{}",
        labels.join("\u{1}")
    )
}

fn kind_name<T: Serialize>(kind: &T) -> String {
    serde_json::to_string(kind).unwrap_or_default()
}

/// The summaries of the log, by what they cover; the deterministic
/// summarizer for the others. Counts both, per conversation.
struct FromLog {
    drafts: HashMap<String, SummaryDraft>,
    reused: std::sync::Mutex<HashMap<String, (u64, u64)>>,
    calls: AtomicU64,
}

impl FromLog {
    fn new(records: &[LogRecord]) -> FromLog {
        let mut drafts = HashMap::new();
        for r in records {
            let Ok(e) = Envelope::decode(&r.bytes, r.encoding) else {
                continue;
            };
            let EventBody::SummaryRecorded(s) = &e.body else {
                continue;
            };
            let labels: Vec<String> = match &s.covers {
                contextfold::core::event::Covers::Turns { first, last } => {
                    (*first..=*last).map(|t| format!("turn {t}")).collect()
                }
                contextfold::core::event::Covers::Summaries { ids } => {
                    ids.iter().map(|id| format!("summary {id}")).collect()
                }
            };
            drafts.insert(
                key(&e.conversation, &kind_name(&s.kind), s.depth, &labels),
                SummaryDraft {
                    content: s.content.clone(),
                    model: s.model.clone(),
                    provider: s.provider.clone(),
                    prompt_version: s.prompt_version.clone(),
                    fallback: s.fallback,
                },
            );
        }
        FromLog {
            drafts,
            reused: Default::default(),
            calls: AtomicU64::new(0),
        }
    }

    fn count(&self, conversation: &str, from_log: bool) {
        let mut reused = self.reused.lock().unwrap_or_else(|e| e.into_inner());
        let entry = reused.entry(conversation.to_string()).or_default();
        if from_log {
            entry.0 += 1;
        } else {
            entry.1 += 1;
        }
    }
}

/// The summarizer the what-if pipeline owns; its counts are read after.
struct Shared(Arc<FromLog>);

impl Summarizer for Shared {
    async fn summarize(
        &self,
        req: &SummaryRequest,
        budget: &Budget,
    ) -> Result<SummaryOutcome, SummarizeError> {
        let this = &self.0;
        let labels: Vec<String> = req.sources.iter().map(|s| s.label.clone()).collect();
        let k = key(&req.conversation, &kind_name(&req.kind), req.depth, &labels);
        if let Some(draft) = this.drafts.get(&k) {
            this.count(&req.conversation, true);
            return Ok(SummaryOutcome::without_calls(draft.clone()));
        }
        this.count(&req.conversation, false);
        this.calls.fetch_add(1, Ordering::Relaxed);
        DeterministicSummarizer.summarize(req, budget).await
    }

    async fn rolling_state(
        &self,
        req: &RollingStateRequest,
        budget: &Budget,
    ) -> Result<RollingOutcome, SummarizeError> {
        DeterministicSummarizer.rolling_state(req, budget).await
    }

    fn name(&self) -> &str {
        "what-if"
    }
}

fn measure<B: KvBackend>(engine: &Engine<B>, key: &str, meter: &mut Meter) -> Result<()> {
    let policy = &engine.policy;
    engine.with_conversation(key, |state, _| {
        if let Some(conv) = state.conversations.get(key) {
            meter.measure(conv.context.tokens(), policy::budget(conv, policy));
        }
    })?;
    Ok(())
}

fn summaries_by_depth<B: KvBackend>(engine: &Engine<B>, key: &str) -> Result<BTreeMap<u32, u64>> {
    Ok(engine.with_conversation(key, |state, _| {
        let mut by = BTreeMap::new();
        if let Some(conv) = state.conversations.get(key) {
            for s in &conv.summaries {
                *by.entry(s.depth).or_insert(0) += 1;
            }
        }
        by
    })?)
}

/// Folds the log's records as they were (`base`: the policy before the
/// first recorded one) and its agent events under `other`, for the
/// conversations `only` names (every one when empty).
pub async fn what_if(
    records: &[LogRecord],
    base: &PolicyConfig,
    other: &PolicyConfig,
    only: &[String],
) -> Result<WhatIf> {
    let wanted = |c: &str| only.is_empty() || only.iter().any(|o| o == c);
    // What happened.
    let mut actual: BTreeMap<String, Meter> = BTreeMap::new();
    let mut engine = Engine::open(MemoryBackend::default(), base.clone())?;
    // Measured when the service has answered an agent event: just before
    // the next one (and at the end), as the other policy's pipeline is
    // measured once the jobs an event issued have run.
    let mut answered: Option<String> = None;
    for r in records {
        let e = Envelope::decode(&r.bytes, r.encoding).ok();
        let agent = agent_event(r).is_some();
        if agent {
            if let Some(key) = answered.take() {
                measure(&engine, &key, actual.entry(key.clone()).or_default())?;
            }
        }
        engine.apply_record(r, &mut Effects::default())?;
        let Some(e) = e else {
            continue;
        };
        if !wanted(&e.conversation) {
            continue;
        }
        match &e.body {
            EventBody::JobIssued(j) if r.origin != Origin::Agent => {
                actual
                    .entry(e.conversation.clone())
                    .or_default()
                    .outcome
                    .count_job(j);
            }
            EventBody::SweepEnded(s) if r.origin != Origin::Agent => {
                actual
                    .entry(e.conversation.clone())
                    .or_default()
                    .outcome
                    .model_calls += u64::from(s.calls);
            }
            _ => {}
        }
        if agent {
            answered = Some(e.conversation.clone());
        }
    }
    if let Some(key) = answered.take() {
        measure(&engine, &key, actual.entry(key.clone()).or_default())?;
    }
    // The other policy, on the same agent events.
    let summarizer = Arc::new(FromLog::new(records));
    let mut sim = Pipeline::open(
        MemoryLog::new(),
        Engine::open(MemoryBackend::default(), other.clone())?,
        Shared(Arc::clone(&summarizer)),
    )
    .await?;
    let mut simulated: BTreeMap<String, Meter> = BTreeMap::new();
    for r in records {
        let Some(e) = agent_event(r) else {
            continue;
        };
        if !wanted(&e.conversation) {
            continue;
        }
        sim.ingest_raw(&[(r.encoding, r.bytes.to_vec())]).await?;
        let meter = simulated.entry(e.conversation.clone()).or_default();
        measure(&sim.engine, &e.conversation, meter)?;
    }
    let written = sim
        .log
        .read_after(0, usize::MAX)
        .await
        .context("reading the simulated log")?;
    for r in &written {
        if r.origin != Origin::Service {
            continue;
        }
        if let Ok(e) = Envelope::decode(&r.bytes, r.encoding) {
            if let EventBody::JobIssued(j) = &e.body {
                if let Some(m) = simulated.get_mut(&e.conversation) {
                    m.outcome.count_job(j);
                }
            }
        }
    }
    let reused = summarizer
        .reused
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let keys: BTreeSet<String> = actual
        .keys()
        .chain(simulated.keys())
        .filter(|k| !contextfold::core::event::is_partition_key(k))
        .cloned()
        .collect();
    let mut conversations = Vec::new();
    for k in keys {
        let mut a = actual.remove(&k).unwrap_or_default().finish();
        a.summaries_by_depth = summaries_by_depth(&engine, &k)?;
        let mut w = simulated.remove(&k).unwrap_or_default().finish();
        w.summaries_by_depth = summaries_by_depth(&sim.engine, &k)?;
        let (from_log, deterministic) = reused.get(&k).copied().unwrap_or_default();
        w.model_calls = deterministic;
        if a.agent_events == 0 {
            continue;
        }
        conversations.push(ConversationWhatIf {
            conversation: k,
            actual: a,
            what_if: w,
            summaries_from_log: from_log,
            summaries_deterministic: deterministic,
        });
    }
    Ok(WhatIf {
        policy_fingerprint: policy_fingerprint(other),
        conversations,
    })
}

fn depths(by: &BTreeMap<u32, u64>) -> String {
    if by.is_empty() {
        return "-".into();
    }
    by.iter()
        .map(|(d, n)| format!("d{d}:{n}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The table `replay --policy` prints.
pub fn render(w: &WhatIf, file: &str) -> String {
    let mut out = format!(
        "what-if: the log's agent events folded under {file} (policy {}) beside what happened\n",
        w.policy_fingerprint
    );
    let from_log: u64 = w.conversations.iter().map(|c| c.summaries_from_log).sum();
    let det: u64 = w
        .conversations
        .iter()
        .map(|c| c.summaries_deterministic)
        .sum();
    out.push_str(&format!(
        "summaries at the new cut points: {from_log} taken from the log, {det} written by the \
         deterministic summarizer (the log has none over the same sources: each would need a \
         model call)\n\n"
    ));
    out.push_str(&format!(
        "{:<28} {:<8} {:>11} {:>12} {:<18} {:>9} {:>9} {:>9} {:>11}\n",
        "conversation",
        "run",
        "compactions",
        "rolling only",
        "summaries",
        "peak ctx",
        "mean ctx",
        "overflows",
        "model calls"
    ));
    for c in &w.conversations {
        for (name, o) in [("actual", &c.actual), ("what-if", &c.what_if)] {
            out.push_str(&format!(
                "{:<28} {:<8} {:>11} {:>12} {:<18} {:>9} {:>9} {:>9} {:>11}\n",
                if name == "actual" {
                    c.conversation.as_str()
                } else {
                    ""
                },
                name,
                o.compactions,
                o.rolling_only_jobs,
                depths(&o.summaries_by_depth),
                o.peak_context_tokens,
                o.mean_context_tokens,
                o.budget_overflows,
                o.model_calls
            ));
        }
    }
    out
}
