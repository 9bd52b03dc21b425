//! Plain-text and JSON reports of state and assembled contexts.

use contextfold::core::assembly::{Assembled, Source};
use contextfold::core::policy::PolicyConfig;
use contextfold::core::state::{ContextItem, Conversation, TurnBodies};
use contextfold::runtime::engine::Engine;
use contextfold::store::KvBackend;
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::Duration;

/// The numbers of one conversation.
#[derive(Debug, Serialize)]
pub struct ConversationReport {
    pub conversation: String,
    pub turns: usize,
    pub raw_tokens: u64,
    /// Tokens the agent would send without compaction (current epoch).
    pub context_before: u64,
    /// Tokens in context now.
    pub context_after: u64,
    pub summaries_by_depth: BTreeMap<u32, usize>,
    /// Raw tokens under the summaries in context / their tokens (each raw
    /// turn counted once, however deep the DAG above it).
    pub compression_ratio: f64,
    pub rejections: u64,
    pub state_hash: String,
}

pub fn conversation_report(
    conv: &Conversation,
    bodies: &dyn TurnBodies,
) -> anyhow::Result<ConversationReport> {
    let mut by_depth = BTreeMap::new();
    for s in &conv.summaries {
        *by_depth.entry(s.depth).or_insert(0) += 1;
    }
    let (mut covered, mut summary_tokens) = (0u64, 0u64);
    for item in &conv.context {
        if let ContextItem::Summary(i) = item {
            let s = &conv.summaries[*i as usize];
            covered += conv.turns[s.first_turn as usize..=s.last_turn as usize]
                .iter()
                .filter(|t| t.in_context)
                .map(|t| u64::from(t.context_tokens))
                .sum::<u64>();
            summary_tokens += s.tokens;
        }
    }
    let before = conv
        .turns
        .iter()
        .filter(|t| t.in_context && t.epoch == conv.epoch)
        .map(|t| u64::from(t.context_tokens))
        .sum();
    Ok(ConversationReport {
        conversation: conv.key.clone(),
        turns: conv.turns.len(),
        raw_tokens: conv.raw_tokens(),
        context_before: before,
        context_after: conv.context.tokens(),
        summaries_by_depth: by_depth,
        compression_ratio: if summary_tokens == 0 {
            1.0
        } else {
            covered as f64 / summary_tokens as f64
        },
        rejections: conv.rejections,
        state_hash: conv.hash_with(bodies)?,
    })
}

/// Reports every conversation of an engine (stored ones read one at a time
/// on each core) and the state hash.
pub fn print<B: KvBackend + Sync>(
    engine: &Engine<B>,
    _policy: &PolicyConfig,
    elapsed: Duration,
    json: bool,
) -> anyhow::Result<()> {
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    let reports =
        engine.map_conversations(cores, |conv, bodies| conversation_report(conv, bodies))?;
    // The state hash from the conversations' hashes just reported (in the
    // same key order): each conversation's bodies are read once.
    let state_hash = engine.state.hash_of(
        reports
            .iter()
            .map(|r| (r.conversation.as_str(), r.state_hash.as_str())),
    );
    if json {
        let total = serde_json::json!({
            "conversations": reports,
            "state_hash": state_hash,
            "seconds": elapsed.as_secs_f64(),
        });
        println!("{total}");
        return Ok(());
    }
    for r in &reports {
        let depths: Vec<String> = r
            .summaries_by_depth
            .iter()
            .map(|(d, n)| format!("d{d}:{n}"))
            .collect();
        println!(
            "{}: {} turns, {} raw tokens; context {} -> {} tokens; summaries [{}]; compression {:.1}x{}",
            r.conversation,
            r.turns,
            r.raw_tokens,
            r.context_before,
            r.context_after,
            depths.join(" "),
            r.compression_ratio,
            if r.rejections > 0 { format!("; {} rejected", r.rejections) } else { String::new() }
        );
    }
    let turns: usize = reports.iter().map(|r| r.turns).sum();
    let raw: u64 = reports.iter().map(|r| r.raw_tokens).sum();
    let before: u64 = reports.iter().map(|r| r.context_before).sum();
    let after: u64 = reports.iter().map(|r| r.context_after).sum();
    let summaries: usize = reports
        .iter()
        .map(|r| r.summaries_by_depth.values().sum::<usize>())
        .sum();
    println!(
        "total: {} conversations, {turns} turns, {raw} raw tokens, {summaries} summaries; context {before} -> {after} tokens; state {} ({:.2}s)",
        reports.len(),
        state_hash,
        elapsed.as_secs_f64()
    );
    Ok(())
}

fn label(s: &Source) -> String {
    match s {
        Source::Turn { seq } => format!("turn {seq}"),
        Source::MaskedTurn { seq } => format!("turn {seq} (masked)"),
        Source::Summary { id, depth } => format!("summary {id} (depth {depth})"),
        Source::RollingState => "rolling session state".into(),
        Source::MissingToolResult { call_id } => format!("stub result for {call_id}"),
    }
}

pub fn print_assembled(out: &Assembled) {
    print!("{}", format_assembled(out));
}

/// The messages as the model sees them, then the accounting line.
pub fn format_assembled(out: &Assembled) -> String {
    use std::fmt::Write as _;
    let mut text = String::new();
    for (m, s) in out.messages.iter().zip(&out.sources) {
        let _ = writeln!(text, "--- {} [{}] ---", m.role.as_str(), label(s));
        let content = m.text_content();
        if !content.is_empty() {
            let _ = writeln!(text, "{content}");
        }
        for c in &m.tool_calls {
            let _ = writeln!(
                text,
                "→ call {} {}({})",
                c.id, c.function.name, c.function.arguments
            );
        }
    }
    let _ = writeln!(text, "{}", accounting(out));
    text
}

fn accounting(out: &Assembled) -> String {
    let relevant = if out.chosen_by_relevance.is_empty() {
        String::new()
    } else {
        let items: Vec<String> = out
            .chosen_by_relevance
            .iter()
            .map(|s| match s {
                Source::Turn { seq } => format!("turn {seq}"),
                Source::MaskedTurn { seq } => format!("turn {seq} (masked)"),
                Source::Summary { id, .. } => id.clone(),
                Source::RollingState => "rolling state".to_string(),
                Source::MissingToolResult { call_id } => format!("stub for {call_id}"),
            })
            .collect();
        format!(
            "; {} kept for their relevance to the prompt: {}",
            items.len(),
            items.join(", ")
        )
    };
    format!(
        "== {} messages, {} tokens of budget {} (fresh tail {}); {} items left out{}{relevant}",
        out.messages.len(),
        out.tokens,
        out.budget,
        out.fresh_tail_tokens,
        out.left_out.len(),
        if out.over_budget {
            "; the fresh tail alone exceeds the budget"
        } else {
            ""
        }
    )
}
