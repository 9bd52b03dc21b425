//! Sweep planning: a job's snapshot of a conversation and the pure steps of
//! a sweep over it (which pass next, what to ask the summarizer, the event
//! that records the answer). The summarizer side runs these steps under its
//! deadline; the fold later accepts each summary only if it still matches.

use crate::core::assembly;
use crate::core::derived_id::DerivedId;
use crate::core::event::{
    Covers, DebtReason, Envelope, EventBody, JobIssued, RollingState, SummaryKind, SummaryRecorded,
};
use crate::core::message::{ChatMessage, Role};
use crate::core::policy::{self, PlanItem, PlanView, PolicyConfig, Run};
use crate::core::state::{summary_id, BodyError, ContextItem, Conversation, Resident, TurnBodies};
use crate::core::summary::{
    IdentifierPolicy, ReadAhead, RollingStateRequest, SourceItem, SummaryDraft, SummaryRequest,
};
use crate::core::tokens;
use serde::{Deserialize, Serialize};

/// One context item in a snapshot. Items of the fresh tail carry no text.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotItem {
    pub plan: PlanItemWire,
    /// `Some(id)` for a summary.
    pub summary_id: Option<String>,
    pub first_turn: u64,
    pub last_turn: u64,
    pub source: Option<SourceItem>,
    /// A deterministic fallback summary.
    #[serde(default)]
    pub fallback: bool,
    /// In a re-summarization job, what this fallback summary was written
    /// over (its sources are no longer in context, so they travel here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resummarize: Option<Resummary>,
}

/// The sources of a fallback summary, for writing it again with a model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Resummary {
    pub kind: SummaryKind,
    pub depth: u32,
    pub covers: Covers,
    /// Tokens of the sources, as the fallback summary counted them.
    pub source_tokens: u64,
    /// Raw turns (leaf) or child summaries (condensed), oldest first.
    pub sources: Vec<SourceItem>,
}

/// [`PlanItem`] in a serializable form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanItemWire {
    pub seq: Option<u64>,
    pub role: Option<Role>,
    pub depth: u32,
    pub tokens: u64,
}

impl From<PlanItemWire> for PlanItem {
    fn from(w: PlanItemWire) -> PlanItem {
        match (w.seq, w.role) {
            (Some(seq), Some(role)) => PlanItem::Turn {
                seq,
                role,
                tokens: w.tokens,
            },
            _ => PlanItem::Summary {
                depth: w.depth,
                tokens: w.tokens,
            },
        }
    }
}

/// Everything a stateless summarizer needs to run one job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SweepSnapshot {
    pub conversation: String,
    pub job: JobIssued,
    pub encoding: tokens::Encoding,
    pub budget: u64,
    pub context_tokens: u64,
    pub prefix_target_tokens: u64,
    /// The context's items, each with what a compaction pass reads of it;
    /// empty for a job that does not compact (it makes no pass, and reads
    /// only `rolling_sources`).
    pub items: Vec<SnapshotItem>,
    pub policy: PolicyConfig,
    pub rolling: Option<RollingState>,
    pub rolling_sources: Vec<SourceItem>,
    pub through_turn: u64,
    /// The conversation's fresh-tail cap when the snapshot was taken.
    #[serde(default)]
    pub fresh_tail_cap: Option<u64>,
}

impl PlanView for SweepSnapshot {
    fn len(&self) -> usize {
        self.items.len()
    }
    fn fresh_tail_cap(&self, cfg: &PolicyConfig) -> Option<u64> {
        self.fresh_tail_cap.or(cfg.fresh_tail_max_tokens)
    }
    fn item(&self, i: usize) -> PlanItem {
        self.items[i].plan.into()
    }
}

/// Removes `<tag ...>...</tag>` blocks of injected context (memory plugins)
/// from text given to a summarizer; the stored turn is untouched.
pub fn strip_injected(text: String, tags: &[String]) -> String {
    // Most turns open no tag at all: one pass over the `<`s (code and
    // markup hold many) instead of a substring search per tag, and the
    // text handed back as it came.
    if !opens_a_tag(&text, tags) {
        return text;
    }
    strip_by_tag(text, tags)
}

/// [`strip_injected`] without its screen: a substring search per tag.
fn strip_by_tag(mut out: String, tags: &[String]) -> String {
    for tag in tags {
        let open = format!("<{tag}");
        let close = format!("</{tag}>");
        while let Some(start) = out.find(&open) {
            let after = &out[start + open.len()..];
            if !(after.starts_with('>') || after.starts_with(' ')) {
                break;
            }
            match out[start..].find(&close) {
                Some(rel) => out.replace_range(start..start + rel + close.len(), ""),
                None => break,
            }
        }
    }
    out
}

/// Whether `<tag` occurs in `text` for one of `tags`: where none does,
/// [`strip_injected`] finds nothing to strip.
fn opens_a_tag(text: &str, tags: &[String]) -> bool {
    memchr::memchr_iter(b'<', text.as_bytes()).any(|at| {
        let after = &text.as_bytes()[at + 1..];
        tags.iter().any(|tag| after.starts_with(tag.as_bytes()))
    })
}

/// The tool a turn's source names: its first call's, or the tool whose
/// result it is.
pub fn source_tool(msg: &ChatMessage) -> Option<String> {
    msg.tool_calls
        .first()
        .map(|c| c.function.name.clone())
        .or_else(|| msg.name.clone())
}

/// The text a summarizer is given for a turn, `None` for a demonstration
/// (another task's example: a note of what it is goes instead). What a
/// runtime reads ahead for the turn's drafts is read from this text.
pub fn turn_text(msg: &ChatMessage, tags: &[String]) -> Option<String> {
    (!msg.is_demonstration()).then(|| strip_injected(msg.searchable_text(), tags))
}

fn turn_source(
    conv: &Conversation,
    bodies: &dyn TurnBodies,
    seq: u64,
    tags: &[String],
) -> Result<SourceItem, BodyError> {
    let turn = &conv.turns[seq as usize];
    let body = bodies.turn_body(conv, seq)?;
    let msg = &body.message;
    let tool = source_tool(msg);
    let own_text = turn_text(msg, tags);
    let demonstration = own_text.is_none();
    let text = own_text.unwrap_or_else(|| {
        // Another task's example: sent whole, a small model summarizes it as
        // the task (a pydicom run's first leaf described marshmallow's
        // demonstrated fix). What it is goes instead; `expand` shows it.
        format!(
            "(A demonstration of another task, shown to the agent as an example of the \
             interface: {} tokens, not this conversation's work, left out here.)",
            turn.context_tokens
        )
    });
    // What is sent, not only what the turn costs in context: a large
    // payload costs its stub there but is sent whole (until `fit_sources`),
    // so it is counted again. Any other turn is sent as it was counted at
    // the fold (less what `strip_injected` removes, or a demonstration's
    // note): its context cost, with its message overhead about the source
    // header sent with it. Counting every turn of every snapshot again was
    // a tenth of `run`'s CPU.
    let context_tokens = u64::from(turn.context_tokens);
    let tokens = if turn.large_payload {
        context_tokens.max(tokens::count_text(conv.encoding, &text))
    } else {
        context_tokens
    };
    // A demonstration's note is not its message's text: nothing read
    // ahead is for it.
    let read_ahead = (!demonstration)
        .then(|| bodies.read_ahead(&body.event_id))
        .flatten();
    Ok(SourceItem {
        label: format!("turn {seq}"),
        role: Some(turn.role),
        tool,
        text,
        tokens,
        time: turn.time,
        read_ahead: ReadAhead(read_ahead),
    })
}

/// The most tokens the sources of one prompt may send: a run's own count
/// when larger (its items are what the fold replaces), else the leaf chunk.
fn prompt_cap(policy: &PolicyConfig, run_tokens: u64) -> u64 {
    policy.leaf_chunk_tokens.max(run_tokens).max(1)
}

/// The first part of `text` that, with a note of what was left out, counts
/// at most `max` tokens (the note alone when nothing fits).
fn excerpt(encoding: tokens::Encoding, text: &str, tokens_of_text: u64, max: u64) -> String {
    let with_note = |end: usize| {
        let head = &text[..end];
        let omitted = tokens_of_text.saturating_sub(tokens::count_text(encoding, head));
        format!("{head}\n[... {omitted} more tokens of this item not sent ...]")
    };
    // Largest prefix whose excerpt fits.
    let end = tokens::longest_prefix(text, |end| {
        tokens::count_text(encoding, &with_note(end)) <= max
    });
    with_note(end)
}

/// Holds a prompt's sources to `cap` tokens sent: when they send more, the
/// largest are cut to excerpts at one common level (the smaller are sent
/// whole), each item's `tokens` recounted from what it now sends.
pub fn fit_sources(
    encoding: tokens::Encoding,
    mut sources: Vec<SourceItem>,
    cap: u64,
) -> Vec<SourceItem> {
    let total: u64 = sources.iter().map(|s| s.tokens).sum();
    if total <= cap {
        return sources;
    }
    // The highest level L with sum(min(tokens, L)) <= cap.
    let (mut lo, mut hi) = (0u64, sources.iter().map(|s| s.tokens).max().unwrap_or(0));
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        let sum: u64 = sources.iter().map(|s| s.tokens.min(mid)).sum();
        if sum <= cap {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    for s in &mut sources {
        if s.tokens > lo {
            s.text = excerpt(encoding, &s.text, s.tokens, lo);
            s.tokens = tokens::count_text(encoding, &s.text);
        }
    }
    sources
}

/// The rolling state's sources: the newest in-context turns since the
/// last refresh (at most 60) that fit `cap` tokens sent, oldest first.
fn fit_rolling_sources(
    encoding: tokens::Encoding,
    newest: Vec<SourceItem>,
    cap: u64,
) -> Vec<SourceItem> {
    let mut total = 0u64;
    let mut kept: Vec<SourceItem> = Vec::new();
    for s in newest.into_iter().rev().take(60) {
        if !kept.is_empty() && total + s.tokens > cap {
            break;
        }
        total += s.tokens;
        kept.push(s);
    }
    kept.reverse();
    fit_sources(encoding, kept, cap)
}

fn summary_source(
    conv: &Conversation,
    bodies: &dyn TurnBodies,
    index: u32,
) -> Result<SourceItem, BodyError> {
    let s = &conv.summaries[index as usize];
    Ok(SourceItem {
        label: format!("summary {}", s.id),
        role: None,
        tool: None,
        text: bodies.summary_text(conv, index)?.to_string(),
        tokens: s.tokens,
        time: s.time,
        ..SourceItem::default()
    })
}

/// What fallback summary `s` was written over, exactly as the fold will
/// check it: the in-context turns of its span, or its child summaries.
fn resummary(
    conv: &Conversation,
    bodies: &dyn TurnBodies,
    s: &crate::core::state::Summary,
    tags: &[String],
) -> Result<Resummary, BodyError> {
    let sources = match &s.covers {
        Covers::Turns { first, last } => (*first..=*last)
            .filter(|seq| conv.turns.get(*seq as usize).is_some_and(|t| t.in_context))
            .map(|seq| turn_source(conv, bodies, seq, tags))
            .collect::<Result<_, _>>()?,
        Covers::Summaries { ids } => ids
            .iter()
            .filter_map(|id| conv.summary_index(id))
            .map(|k| summary_source(conv, bodies, k))
            .collect::<Result<_, _>>()?,
    };
    Ok(Resummary {
        kind: s.kind,
        depth: s.depth,
        covers: s.covers.clone(),
        source_tokens: s.source_tokens,
        sources,
    })
}

/// Takes the snapshot a job works on, the turns it sends read from
/// `bodies`.
pub fn snapshot_from(
    conv: &Conversation,
    bodies: &dyn TurnBodies,
    job: &JobIssued,
    cfg: &PolicyConfig,
) -> Result<SweepSnapshot, BodyError> {
    let levels = policy::levels(conv, cfg);
    let tags = &cfg.strip_injected_context_tags;
    // A job that only refreshes the rolling state makes no pass over the
    // plan (`SweepSnapshot::next_pass`), so its snapshot carries none: a
    // long conversation's context is not walked for each of its rolling
    // states.
    let items = if job.compact {
        plan_items(conv, bodies, job, cfg)?
    } else {
        Vec::new()
    };
    let from = conv.rolling_through.map_or(0, |t| t.saturating_add(1));
    let rolling_sources = if job.refresh_rolling_state {
        let seqs: Vec<u64> = conv
            .context
            .iter()
            .filter_map(|item| match item {
                ContextItem::Turn(seq) if *seq >= from => Some(*seq),
                _ => None,
            })
            .collect();
        let newest = seqs[seqs.len().saturating_sub(60)..]
            .iter()
            .map(|&seq| turn_source(conv, bodies, seq, tags))
            .collect::<Result<Vec<_>, _>>()?;
        fit_rolling_sources(conv.encoding, newest, cfg.leaf_chunk_tokens)
    } else {
        Vec::new()
    };
    Ok(SweepSnapshot {
        conversation: conv.key.clone(),
        job: job.clone(),
        encoding: conv.encoding,
        budget: levels.budget,
        context_tokens: conv.context.tokens(),
        prefix_target_tokens: levels.prefix_target_tokens,
        items,
        policy: cfg.clone(),
        rolling: conv.rolling.clone(),
        rolling_sources,
        through_turn: conv.turns.len().saturating_sub(1) as u64,
        fresh_tail_cap: Some(policy::fresh_tail_cap(conv, cfg)),
    })
}

/// A compacting job's plan: every item of the context, with what its
/// passes read (the turns outside the fresh tail, the summaries, and for a
/// re-summarization the fallback summaries' sources).
fn plan_items(
    conv: &Conversation,
    bodies: &dyn TurnBodies,
    job: &JobIssued,
    cfg: &PolicyConfig,
) -> Result<Vec<SnapshotItem>, BodyError> {
    let tail = policy::fresh_tail_start_with(conv, cfg, false);
    let tags = &cfg.strip_injected_context_tags;
    let resummarizing = job.reason == DebtReason::Resummarize;
    conv.context
        .iter()
        .enumerate()
        .map(|(i, &item)| {
            let plan = conv.item(i);
            let wire = match plan {
                PlanItem::Turn { seq, role, tokens } => PlanItemWire {
                    seq: Some(seq),
                    role: Some(role),
                    depth: 0,
                    tokens,
                },
                PlanItem::Summary { depth, tokens } => PlanItemWire {
                    seq: None,
                    role: None,
                    depth,
                    tokens,
                },
            };
            Ok(match item {
                ContextItem::Turn(seq) => SnapshotItem {
                    plan: wire,
                    summary_id: None,
                    first_turn: seq,
                    last_turn: seq,
                    // A re-summarization never reads raw turns in context:
                    // they are left out of its (queued, maybe stored) snapshot.
                    source: (!resummarizing && i < tail)
                        .then(|| turn_source(conv, bodies, seq, tags))
                        .transpose()?,
                    fallback: false,
                    resummarize: None,
                },
                ContextItem::Summary(k) => {
                    let s = &conv.summaries[k as usize];
                    SnapshotItem {
                        plan: wire,
                        summary_id: Some(s.id.clone()),
                        first_turn: s.first_turn,
                        last_turn: s.last_turn,
                        source: Some(summary_source(conv, bodies, k)?),
                        fallback: s.fallback,
                        resummarize: (resummarizing && s.fallback)
                            .then(|| resummary(conv, bodies, s, tags))
                            .transpose()?,
                    }
                }
            })
        })
        .collect::<Result<_, BodyError>>()
}

/// [`snapshot_from`] a conversation folded in memory (every body resident).
pub fn snapshot(
    conv: &Conversation,
    job: &JobIssued,
    cfg: &PolicyConfig,
) -> Result<SweepSnapshot, BodyError> {
    snapshot_from(conv, &Resident, job, cfg)
}

/// One step of a sweep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    Leaf(Run),
    Condense(Run, u32),
    /// Write the fallback summary at this item again, with a model.
    Resummarize(usize),
}

impl SweepSnapshot {
    /// The next pass: leaf passes while an eligible chunk is left outside
    /// the fresh tail, then condensation.
    pub fn next_pass(&self) -> Option<Pass> {
        if !self.job.compact {
            return None;
        }
        // A re-summarization job only replaces fallback summaries, oldest
        // first; compaction is the job of the other reasons.
        if self.job.reason == DebtReason::Resummarize {
            return self
                .items
                .iter()
                .position(|i| i.fallback && i.resummarize.is_some())
                .map(Pass::Resummarize);
        }
        let standing = policy::Standing {
            context_tokens: self.context_tokens,
            target_tokens: self.job.target_tokens,
            budget: self.budget,
            prefix_target_tokens: self.prefix_target_tokens,
            urgent: self.job.urgent,
        };
        policy::next_compaction(self, &self.policy, standing).map(|c| match c {
            policy::Compaction::Leaf(run) => Pass::Leaf(run),
            policy::Compaction::Condense(run, depth) => Pass::Condense(run, depth),
        })
    }

    /// What to ask the summarizer for this pass.
    pub fn request(&self, pass: Pass, aggressive: bool) -> SummaryRequest {
        let run_sources = |run: Run| -> Vec<SourceItem> {
            self.items[run.start..run.end]
                .iter()
                .filter_map(|i| i.source.clone())
                .collect()
        };
        let (kind, depth, sources, source_tokens, at) = match pass {
            Pass::Leaf(run) => (
                SummaryKind::Leaf,
                0,
                run_sources(run),
                run.tokens,
                run.start,
            ),
            Pass::Condense(run, depth) => (
                SummaryKind::Condensed,
                depth,
                run_sources(run),
                run.tokens,
                run.start,
            ),
            // The same kind and depth over exactly the fallback's sources.
            Pass::Resummarize(i) => {
                let r = self.items.get(i).and_then(|item| item.resummarize.as_ref());
                let (kind, depth, sources, source_tokens) = r
                    .map_or((SummaryKind::Leaf, 0, Vec::new(), 0), |r| {
                        (r.kind, r.depth, r.sources.clone(), r.source_tokens)
                    });
                (kind, depth, sources, source_tokens, i)
            }
        };
        // Every prompt is bounded by what it sends (a large payload counts
        // its stub in `source_tokens`, but its text is in `sources`).
        let sources = fit_sources(
            self.encoding,
            sources,
            prompt_cap(&self.policy, source_tokens),
        );
        SummaryRequest {
            conversation: self.conversation.clone(),
            kind,
            depth,
            target_tokens: policy::summary_target(&self.policy, depth, source_tokens, aggressive),
            sources,
            // Continuity: the summary in context before the pass's items.
            previous_summary: if kind == SummaryKind::Leaf {
                self.previous_summary(at)
            } else {
                None
            },
            instructions: self.job.instructions.clone(),
            custom_instructions: self.policy.custom_instructions.clone(),
            identifier_policy: IdentifierPolicy::Strict,
            aggressive,
        }
    }

    /// The summary in context before item `at`, given as continuity.
    fn previous_summary(&self, at: usize) -> Option<String> {
        self.items[..at].iter().rev().find_map(|i| {
            i.summary_id
                .as_ref()
                .and(i.source.as_ref())
                .map(|s| s.text.clone())
        })
    }

    /// The `summary_recorded` payload for a draft, content-addressed.
    pub fn record(&self, pass: Pass, draft: &SummaryDraft) -> SummaryRecorded {
        let (run, kind, depth) = match pass {
            Pass::Leaf(run) => (run, SummaryKind::Leaf, 0),
            Pass::Condense(run, depth) => (run, SummaryKind::Condensed, depth),
            Pass::Resummarize(i) => return self.resummarize_record(i, draft),
        };
        let slice = &self.items[run.start..run.end];
        let covers = match kind {
            SummaryKind::Leaf => Covers::Turns {
                first: slice.first().map_or(0, |i| i.first_turn),
                last: slice.last().map_or(0, |i| i.last_turn),
            },
            SummaryKind::Condensed => Covers::Summaries {
                ids: slice.iter().filter_map(|i| i.summary_id.clone()).collect(),
            },
        };
        self.recorded(kind, depth, covers, run.tokens, draft, None)
    }

    /// The record of a re-summarization: the replaced summary's kind,
    /// depth and covers, naming it in `supersedes`.
    fn resummarize_record(&self, i: usize, draft: &SummaryDraft) -> SummaryRecorded {
        let item = self.items.get(i);
        let r = item.and_then(|item| item.resummarize.as_ref());
        let (kind, depth, covers, source_tokens) = r.map_or(
            (SummaryKind::Leaf, 0, Covers::Turns { first: 0, last: 0 }, 0),
            |r| (r.kind, r.depth, r.covers.clone(), r.source_tokens),
        );
        let supersedes = item.and_then(|item| item.summary_id.clone());
        self.recorded(kind, depth, covers, source_tokens, draft, supersedes)
    }

    /// A draft as a content-addressed record of this job.
    fn recorded(
        &self,
        kind: SummaryKind,
        depth: u32,
        covers: Covers,
        source_tokens: u64,
        draft: &SummaryDraft,
        supersedes: Option<String>,
    ) -> SummaryRecorded {
        SummaryRecorded {
            summary_id: summary_id(
                &self.conversation,
                kind,
                depth,
                &covers,
                &draft.content,
                &draft.prompt_version,
            ),
            job_id: Some(self.job.job_id.clone()),
            kind,
            depth,
            covers,
            content: draft.content.clone(),
            source_tokens,
            // A deterministic draft counted it last as it fitted it.
            tokens: tokens::count_text_kept(self.encoding, &draft.content),
            model: draft.model.clone(),
            provider: draft.provider.clone(),
            prompt_version: draft.prompt_version.clone(),
            fallback: draft.fallback,
            supersedes,
        }
    }

    /// Applies a recorded summary to the snapshot so the next pass sees it.
    pub fn apply(&mut self, pass: Pass, rec: &SummaryRecorded) {
        let run = match pass {
            Pass::Leaf(run) | Pass::Condense(run, _) => run,
            // One summary in the place of another: the span is the same.
            Pass::Resummarize(i) => Run {
                start: i,
                end: i + 1,
                tokens: self.items.get(i).map_or(0, |item| item.plan.tokens),
            },
        };
        let first_turn = self.items[run.start].first_turn;
        let last_turn = self.items[run.end - 1].last_turn;
        // In context it costs its rendered message, as the fold counts it.
        let cost = assembly::summary_tokens(
            self.encoding,
            &rec.summary_id,
            rec.depth,
            first_turn,
            last_turn,
            rec.fallback,
            &rec.content,
        );
        let item = SnapshotItem {
            plan: PlanItemWire {
                seq: None,
                role: None,
                depth: rec.depth,
                tokens: cost,
            },
            summary_id: Some(rec.summary_id.clone()),
            first_turn,
            last_turn,
            source: Some(SourceItem {
                label: format!("summary {}", rec.summary_id),
                role: None,
                tool: None,
                text: rec.content.clone(),
                tokens: cost,
                time: 0,
                ..SourceItem::default()
            }),
            fallback: rec.fallback,
            resummarize: None,
        };
        self.items.splice(run.start..run.end, [item]);
        self.context_tokens = self.context_tokens - run.tokens + cost;
    }

    pub fn rolling_request(&self) -> Option<RollingStateRequest> {
        self.job.refresh_rolling_state.then(|| RollingStateRequest {
            conversation: self.conversation.clone(),
            previous: self.rolling.clone(),
            sources: self.rolling_sources.clone(),
        })
    }
}

/// The event a summarizer publishes for a recorded summary. Its id is
/// derived from the summary's content address, so a redelivered job that
/// writes the same summary is deduplicated.
pub fn summary_event(conversation: &str, time: u64, rec: SummaryRecorded) -> Envelope {
    Envelope::new(
        DerivedId::SummaryRecorded {
            summary_id: &rec.summary_id,
        }
        .to_string(),
        conversation,
        time,
        EventBody::SummaryRecorded(rec),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::event::{RollingStateUpdated, TurnAppended};
    use crate::core::fold::fold;
    use crate::core::message::ChatMessage;
    use crate::core::state::State;

    fn job(rolling: bool) -> JobIssued {
        JobIssued {
            job_id: "j".into(),
            reason: DebtReason::Manual,
            urgent: true,
            context_tokens: 0,
            target_tokens: 0,
            deadline_ms: 1000,
            issued_at: 2,
            instructions: None,
            compact: true,
            refresh_rolling_state: rolling,
            max_calls: None,
            max_tokens: None,
        }
    }

    /// A conversation with a large tool payload among short turns.
    fn with_large_payload(policy: &PolicyConfig, payload_tokens: usize) -> State {
        let payload =
            "dicom tag (0002,0010) value 1.2.840.10008.1.2.1 ok\n".repeat(payload_tokens / 20);
        let turns = [
            ChatMessage::text(
                Role::User,
                "read the file with the explicit VR transfer syntax and report its tags; "
                    .repeat(30),
            ),
            ChatMessage::text(Role::Assistant, &payload),
            ChatMessage::text(Role::User, "now fix the reader"),
            ChatMessage::text(
                Role::Assistant,
                "the reader compares the syntax UID as a string",
            ),
            ChatMessage::text(Role::User, "and add a test"),
        ];
        folded(policy, turns)
    }

    /// Conversation `c` with `turns`, one a millisecond.
    fn folded(policy: &PolicyConfig, turns: impl IntoIterator<Item = ChatMessage>) -> State {
        let mut state = State::default();
        for (i, t) in turns.into_iter().enumerate() {
            let e = Envelope::new(
                format!("t{i}"),
                "c",
                i as u64 + 1,
                EventBody::TurnAppended(TurnAppended::from(t)),
            );
            fold(&mut state, policy, &e);
        }
        state
    }

    #[test]
    fn a_rolling_state_job_carries_its_sources_and_no_plan() {
        let policy = PolicyConfig::default();
        let state = folded(
            &policy,
            (0..8).map(|i| ChatMessage::text(Role::User, format!("step {i}: run the tests"))),
        );
        let conv = &state.conversations["c"];
        let rolling_only = JobIssued {
            compact: false,
            ..job(true)
        };
        let snap = snapshot(conv, &rolling_only, &policy).unwrap();
        assert!(snap.items.is_empty());
        assert_eq!(snap.rolling_sources.len(), 8);
        assert_eq!(snap.next_pass(), None);
        assert!(snap.rolling_request().is_some());
        // A compacting job plans over every item of the context.
        let snap = snapshot(conv, &job(true), &policy).unwrap();
        assert_eq!(snap.items.len(), conv.context.len());
        assert_eq!(snap.rolling_sources.len(), 8);
    }

    #[test]
    fn a_large_payload_is_counted_as_sent_and_the_prompt_is_bounded() {
        // Issue 14: a leaf accounted as 2,519 tokens was an 8,249-token
        // prompt, because the payload was sent whole but counted as its stub.
        let policy = PolicyConfig {
            large_payload_threshold_tokens: 500,
            leaf_chunk_tokens: 1000,
            fresh_tail_count: 1,
            ..PolicyConfig::default()
        };
        let state = with_large_payload(&policy, 6000);
        let conv = &state.conversations["c"];
        assert!(
            conv.turns[1].large_payload,
            "the payload is stubbed in context"
        );
        let snap = snapshot(conv, &job(true), &policy).unwrap();
        for item in snap.items.iter().filter_map(|i| i.source.as_ref()) {
            assert!(item.tokens >= tokens::count_text(conv.encoding, &item.text));
        }
        let payload = snap.items[1]
            .source
            .as_ref()
            .expect("the payload is a source");
        assert!(payload.tokens > 5000, "counted as sent: {}", payload.tokens);
        let pass = snap.next_pass().unwrap_or_else(|| {
            panic!(
                "no leaf pass: {:?}",
                snap.items.iter().map(|i| i.plan.tokens).collect::<Vec<_>>()
            )
        });
        let req = snap.request(pass, false);
        let sent: u64 = req
            .sources
            .iter()
            .map(|s| tokens::count_text(conv.encoding, &s.text))
            .sum();
        assert!(
            sent <= req.source_tokens(),
            "the request counts what it sends"
        );
        assert!(
            req.source_tokens() <= policy.leaf_chunk_tokens,
            "{} tokens sent",
            req.source_tokens()
        );
        assert!(req.sources.iter().any(|s| s.text.contains("not sent")));
        // The rolling state's sources are capped the same way.
        let rolling: u64 = snap.rolling_sources.iter().map(|s| s.tokens).sum();
        assert!(
            rolling <= policy.leaf_chunk_tokens,
            "{rolling} rolling tokens"
        );
        assert!(!snap.rolling_sources.is_empty());
    }

    #[test]
    fn a_demonstration_of_another_task_is_named_not_sent() {
        // Issue 14: a pydicom run's first leaf, written by a real small
        // model, described the marshmallow fix SWE-agent demonstrates.
        let policy = PolicyConfig {
            fresh_tail_count: 1,
            ..PolicyConfig::default()
        };
        let mut demo = ChatMessage::text(
            Role::User,
            "Here is a demonstration: fix marshmallow/fields.py TimeDelta rounding",
        );
        demo.name = Some(crate::core::message::DEMONSTRATION_NAME.into());
        let state = folded(
            &policy,
            [
                demo,
                ChatMessage::text(Role::User, "fix pydicom's float pixel data read"),
                ChatMessage::text(Role::Assistant, "reproduced it"),
            ],
        );
        let conv = &state.conversations["c"];
        let snap = snapshot(conv, &job(false), &policy).unwrap();
        let sources: Vec<&SourceItem> = snap
            .items
            .iter()
            .filter_map(|i| i.source.as_ref())
            .collect();
        let demo = sources[0];
        assert_eq!(demo.tool.as_deref(), Some("demonstration"));
        assert!(
            demo.text.contains("demonstration of another task"),
            "{}",
            demo.text
        );
        assert!(!demo.text.contains("marshmallow"), "{}", demo.text);
        assert!(demo.tokens >= u64::from(conv.turns[0].context_tokens));
        assert!(sources[1].text.contains("pydicom"), "other turns are sent");
    }

    #[test]
    fn fit_sources_cuts_only_the_largest_to_a_common_level() {
        let enc = tokens::Encoding::O200kBase;
        let item = |label: &str, text: String| SourceItem {
            label: label.into(),
            role: Some(Role::Tool),
            tool: None,
            tokens: tokens::count_text(enc, &text),
            text,
            time: 0,
            ..SourceItem::default()
        };
        let small = item("turn 1", "the user asked for a fix".into());
        let big = item("turn 2", "word ".repeat(3000));
        let fitted = fit_sources(enc, vec![small.clone(), big.clone()], 500);
        assert_eq!(fitted[0], small, "a small source is sent whole");
        let total: u64 = fitted.iter().map(|s| s.tokens).sum();
        assert!(total <= 500 && total > 400, "{total}");
        assert!(fitted[1].text.starts_with("word word"));
        assert_eq!(fitted[1].tokens, tokens::count_text(enc, &fitted[1].text));
        // Under the cap nothing changes.
        let same = fit_sources(enc, vec![small.clone(), big.clone()], 10_000);
        assert_eq!(same, vec![small, big]);
    }

    #[test]
    fn a_rolling_state_through_the_last_possible_turn_leaves_nothing_to_read() {
        // `through_turn` is what a summarizer wrote: any number.
        let policy = PolicyConfig::default();
        let mut state = State::default();
        let turn = ChatMessage::text(Role::User, "rotate the key");
        let events = [
            Envelope::new(
                "t1",
                "c",
                1,
                EventBody::TurnAppended(TurnAppended::from(turn)),
            ),
            Envelope::new(
                "r1",
                "c",
                2,
                EventBody::RollingStateUpdated(RollingStateUpdated {
                    state: RollingState::default(),
                    through_turn: u64::MAX,
                    job_id: None,
                }),
            ),
        ];
        for e in &events {
            fold(&mut state, &policy, e);
        }
        let snap = snapshot(&state.conversations["c"], &job(true), &policy).unwrap();
        assert!(
            snap.rolling_sources.is_empty(),
            "{:?}",
            snap.rolling_sources
        );
    }

    fn tags() -> Vec<String> {
        PolicyConfig::default().strip_injected_context_tags
    }

    #[test]
    fn injected_blocks_are_stripped_and_the_rest_kept() {
        let text = "before <relevant-memories>\nold notes\n</relevant-memories> after <b>bold</b>";
        assert_eq!(
            strip_injected(text.into(), &tags()),
            "before  after <b>bold</b>"
        );
        // A tag name that only starts like one, or a block never closed,
        // stays (and ends the search for that tag).
        for kept in [
            "<relevant-memoriesx> x </relevant-memories>",
            "<relevant_memories> open",
        ] {
            assert_eq!(strip_injected(kept.into(), &tags()), kept);
        }
        assert_eq!(
            strip_injected("a < b && c<d".into(), &tags()),
            "a < b && c<d"
        );
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]
        #[test]
        fn stripping_is_the_search_by_tag(
            pieces in proptest::collection::vec(proptest::sample::select(&[
                "<relevant-memories>", "</relevant-memories>", "<relevant_memories ", "</relevant_memories>",
                "<active_memory_plugin>", "</active_memory_plugin>", "<hindsight_memories>",
                "</hindsight_memories>", "<relevant-memoriesx>", "<", ">", "</", "<b>", "x", " ", "\n",
                "é", "a < b",
            ][..]), 0..14)
        ) {
            let text = pieces.concat();
            // The screen only skips texts where the search finds nothing.
            proptest::prop_assert_eq!(strip_injected(text.clone(), &tags()), strip_by_tag(text, &tags()));
        }
    }
}
