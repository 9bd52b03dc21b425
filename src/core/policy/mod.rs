//! The compaction policy: pure functions of a conversation's state that say
//! what the budget and thresholds are, where the fresh tail starts, which
//! raw run is the next leaf chunk and which summaries condense next.
//!
//! They work over [`PlanItem`]s so the fold (on full state) and a sweep (on
//! a job's snapshot) take the very same decisions.

pub mod schedule;

pub use crate::core::policy_config::{PolicyConfig, PolicyError, ThresholdOverride};
pub use schedule::{schedule, Blocked, Grant, Schedule, Wait};

use crate::core::glob::SessionGlob;
use crate::core::message::Role;
use crate::core::state::{ContextItem, Conversation};

/// Smallest raw run worth a leaf summary.
pub const MIN_LEAF_CHUNK_TOKENS: u64 = 256;

/// The resolved budget and trigger levels of one conversation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Levels {
    pub budget: u64,
    pub threshold_tokens: u64,
    pub target_tokens: u64,
    pub rolling_tokens: u64,
    pub prefix_target_tokens: u64,
    pub threshold_share_millis: u64,
}

/// The budget: the declared window, capped by `max_assembly_token_budget`.
pub fn budget(conv: &Conversation, cfg: &PolicyConfig) -> u64 {
    budget_of(conv.context_window, cfg)
}

/// [`budget`] under the context window a conversation declared.
fn budget_of(context_window: Option<u64>, cfg: &PolicyConfig) -> u64 {
    let window = context_window.unwrap_or(cfg.default_context_window);
    match cfg.max_assembly_token_budget {
        Some(cap) => window.min(cap),
        None => window,
    }
}

/// Resolves threshold and target, applying the most specific override.
pub fn levels(conv: &Conversation, cfg: &PolicyConfig) -> Levels {
    levels_of(&conv.key, conv.model.as_deref(), conv.context_window, cfg)
}

/// [`levels`] of a conversation known by its key, the model and the
/// context window it declared: for a reader ahead of the fold, which has
/// no [`Conversation`].
pub fn levels_of(
    key: &str,
    model: Option<&str>,
    context_window: Option<u64>,
    cfg: &PolicyConfig,
) -> Levels {
    let window = context_window.unwrap_or(cfg.default_context_window);
    let budget = budget_of(context_window, cfg);
    let mut best: Option<(u32, &ThresholdOverride)> = None;
    for rule in &cfg.threshold_overrides {
        let mut score = 0u32;
        if let Some(m) = &rule.model {
            if model != Some(m.as_str()) {
                continue;
            }
            score += 1000;
        }
        if let Some(min) = rule.min_context_window {
            if window < min {
                continue;
            }
            score += 10;
        }
        if let Some(max) = rule.max_context_window {
            if window > max {
                continue;
            }
            score += 10;
        }
        if let Some(glob) = &rule.session {
            if !glob.matches(key) {
                continue;
            }
            score += 100 + glob.specificity().0.min(99);
        }
        // Strictly greater: ties go to the earliest rule.
        if best.is_none_or(|(s, _)| score > s) {
            best = Some((score, rule));
        }
    }
    let threshold = best
        .and_then(|(_, r)| r.context_threshold)
        .unwrap_or(cfg.context_threshold);
    let mut target = best
        .and_then(|(_, r)| r.context_target)
        .unwrap_or(cfg.context_target);
    if target >= threshold {
        target = threshold * 0.66;
    }
    // `as u64` truncates, which is the floor of a product that is not
    // negative, and saturates a negative one to 0 as the floor's would be:
    // no `floor` call (a libm call on baseline x86-64, every turn).
    let share = |s: f64| (budget as f64 * s) as u64;
    Levels {
        budget,
        threshold_tokens: share(threshold),
        target_tokens: share(target),
        rolling_tokens: share(cfg.rolling_threshold),
        prefix_target_tokens: share(cfg.summarized_prefix_target),
        threshold_share_millis: (threshold * 1000.0).round() as u64,
    }
}

pub fn session_matches(globs: &[SessionGlob], key: &str) -> bool {
    globs.iter().any(|glob| glob.matches(key))
}

/// What the policy needs to know of one context item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanItem {
    Turn { seq: u64, role: Role, tokens: u64 },
    Summary { depth: u32, tokens: u64 },
}

impl PlanItem {
    pub fn tokens(&self) -> u64 {
        match self {
            PlanItem::Turn { tokens, .. } | PlanItem::Summary { tokens, .. } => *tokens,
        }
    }
    pub fn is_turn(&self) -> bool {
        matches!(self, PlanItem::Turn { .. })
    }
}

/// A read-only view of context items, so the policy runs over full state
/// and over a job's snapshot alike without copying.
pub trait PlanView {
    fn len(&self) -> usize;
    fn item(&self, i: usize) -> PlanItem;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Most tokens the fresh tail may hold (see [`fresh_tail_start`]).
    fn fresh_tail_cap(&self, cfg: &PolicyConfig) -> Option<u64> {
        cfg.fresh_tail_max_tokens
    }
}

/// Most tokens a conversation's fresh tail may hold: `fresh_tail_max_tokens`
/// when set, else the compaction target, and never more than the budget.
/// A tail larger than the target could never be compacted under it, and one
/// larger than the budget would overflow every assembled context.
pub fn fresh_tail_cap(conv: &Conversation, cfg: &PolicyConfig) -> u64 {
    let levels = levels(conv, cfg);
    cfg.fresh_tail_max_tokens
        .unwrap_or(levels.target_tokens)
        .min(levels.budget)
}

impl PlanView for [PlanItem] {
    fn len(&self) -> usize {
        <[PlanItem]>::len(self)
    }
    fn item(&self, i: usize) -> PlanItem {
        self[i]
    }
}

impl PlanView for Vec<PlanItem> {
    fn len(&self) -> usize {
        <[PlanItem]>::len(self)
    }
    fn item(&self, i: usize) -> PlanItem {
        self[i]
    }
}

impl PlanView for Conversation {
    fn len(&self) -> usize {
        self.context.len()
    }
    fn fresh_tail_cap(&self, cfg: &PolicyConfig) -> Option<u64> {
        Some(fresh_tail_cap(self, cfg))
    }
    fn item(&self, i: usize) -> PlanItem {
        match self.context[i] {
            ContextItem::Turn(seq) => {
                let t = &self.turns[seq as usize];
                PlanItem::Turn {
                    seq,
                    role: t.role,
                    tokens: u64::from(t.context_tokens),
                }
            }
            ContextItem::Summary(k) => {
                let s = &self.summaries[k as usize];
                PlanItem::Summary {
                    depth: s.depth,
                    tokens: s.tokens,
                }
            }
        }
    }
}

/// The plan view of a conversation's context, materialized.
pub fn plan_items(conv: &Conversation) -> Vec<PlanItem> {
    (0..conv.context.len()).map(|i| conv.item(i)).collect()
}

/// True when a cut just before item `i` separates no tool call from its
/// result. The fold keeps a tool result in context only right after the
/// group of the assistant turn that made the call (late results stay out),
/// so a cut is safe exactly before any item that is not a tool result;
/// aborted or errored calls therefore never hold a group open.
pub fn is_boundary<V: PlanView + ?Sized>(items: &V, i: usize) -> bool {
    i >= items.len()
        || !matches!(
            items.item(i),
            PlanItem::Turn {
                role: Role::Tool,
                ..
            }
        )
}

/// Index of the first raw turn in context (summaries come before it).
pub fn raw_start<V: PlanView + ?Sized>(items: &V) -> usize {
    (0..items.len())
        .find(|&i| items.item(i).is_turn())
        .unwrap_or(items.len())
}

/// Where the fresh tail starts: the newest `fresh_tail_count` raw turns,
/// back to the newest user turn, within the view's token cap (at least one
/// turn), and never inside a tool group.
pub fn fresh_tail_start<V: PlanView + ?Sized>(items: &V, cfg: &PolicyConfig) -> usize {
    fresh_tail_start_with(items, cfg, true)
}

/// [`fresh_tail_start`], optionally without reaching back to the newest
/// user turn: under pressure (overflow recovery, manual compaction, a
/// context over the whole budget) a long autonomous run after one user turn
/// must still be compactable; the newest `fresh_tail_count` turns stay.
pub fn fresh_tail_start_with<V: PlanView + ?Sized>(
    items: &V,
    cfg: &PolicyConfig,
    reach_back: bool,
) -> usize {
    let len = items.len();
    let cap = items.fresh_tail_cap(cfg);
    let over_cap =
        |count: usize, tokens: u64, t: u64| count > 0 && cap.is_some_and(|c| tokens + t > c);
    let mut start = len;
    let mut count = 0usize;
    let mut tokens = 0u64;
    let mut newest_user = None;
    while start > 0 && count < cfg.fresh_tail_count {
        let item = items.item(start - 1);
        let PlanItem::Turn {
            role, tokens: t, ..
        } = item
        else {
            break;
        };
        if over_cap(count, tokens, t) {
            break;
        }
        if role == Role::User && newest_user.is_none() {
            newest_user = Some(start - 1);
        }
        start -= 1;
        count += 1;
        tokens += t;
    }
    if newest_user.is_none() && reach_back {
        // Reach further back to the newest user turn, if there is one and
        // the cap allows: an agent's long tool loop after one request must
        // not make the whole loop fresh.
        let mut i = start;
        let mut reach = tokens;
        while i > 0 {
            match items.item(i - 1) {
                PlanItem::Turn { tokens: t, .. } if over_cap(count, reach, t) => break,
                PlanItem::Turn {
                    role: Role::User, ..
                } => {
                    start = i - 1;
                    break;
                }
                PlanItem::Turn { tokens: t, .. } => {
                    reach += t;
                    i -= 1;
                }
                PlanItem::Summary { .. } => break,
            }
        }
    }
    while start > 0 && !is_boundary(items, start) {
        start -= 1;
    }
    start
}

/// A run of context items `[start, end)` a pass replaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub start: usize,
    pub end: usize,
    pub tokens: u64,
}

/// The oldest raw run outside the fresh tail, up to `leaf_chunk_tokens`,
/// ending on a tool-group boundary. `pressure` makes a partial chunk
/// eligible; otherwise only a full chunk is worth a summary.
pub fn next_leaf_chunk<V: PlanView + ?Sized>(
    items: &V,
    cfg: &PolicyConfig,
    pressure: bool,
) -> Option<Run> {
    next_leaf_chunk_with(items, cfg, pressure, true)
}

/// [`next_leaf_chunk`] with the fresh tail's reach-back chosen (see
/// [`fresh_tail_start_with`]).
pub fn next_leaf_chunk_with<V: PlanView + ?Sized>(
    items: &V,
    cfg: &PolicyConfig,
    pressure: bool,
    reach_back: bool,
) -> Option<Run> {
    let tail = fresh_tail_start_with(items, cfg, reach_back);
    let start = raw_start(items);
    if start >= tail {
        return None;
    }
    let mut end = start;
    let mut tokens = 0u64;
    let mut last_ok: Option<(usize, u64)> = None;
    while end < tail {
        let item = items.item(end);
        // A leaf covers raw turns only: a summary after them (a state an
        // older fold let in) ends the run, so the chunk is one the fold
        // can accept.
        if !item.is_turn() {
            break;
        }
        let t = item.tokens();
        // A chunk too small to be worth a summary takes the next group
        // whole, even when that group alone is over the chunk size.
        if tokens + t > cfg.leaf_chunk_tokens
            && last_ok.is_some_and(|(_, tk)| tk >= MIN_LEAF_CHUNK_TOKENS)
        {
            break;
        }
        tokens += t;
        end += 1;
        if is_boundary(items, end) {
            last_ok = Some((end, tokens));
        }
    }
    let (end, tokens) = last_ok?;
    let full = end < tail || tokens >= cfg.leaf_chunk_tokens;
    if tokens < MIN_LEAF_CHUNK_TOKENS || !(full || pressure) {
        return None;
    }
    Some(Run { start, end, tokens })
}

/// The oldest run of same-depth summaries to condense next, with the depth
/// of the condensed summary. Routine sweeps condense up to `sweep_max_depth`
/// at the normal fanouts; deeper, or at the hard minimum fanout, only when
/// the summarized prefix is over its target (`prefix_over`) or under
/// `pressure`.
pub fn next_condensation<V: PlanView + ?Sized>(
    items: &V,
    cfg: &PolicyConfig,
    prefix_over: bool,
    pressure: bool,
) -> Option<(Run, u32)> {
    let raw = raw_start(items);
    let mut i = 0;
    while i < raw {
        let PlanItem::Summary { depth, .. } = items.item(i) else {
            break;
        };
        let mut j = i;
        while j < raw && matches!(items.item(j), PlanItem::Summary { depth: d, .. } if d == depth) {
            j += 1;
        }
        let normal = if depth == 0 {
            cfg.leaf_fanout
        } else {
            cfg.condensed_fanout
        };
        let fanout = if pressure || prefix_over {
            cfg.hard_min_fanout
        } else {
            normal
        };
        let deep_ok = depth < cfg.sweep_max_depth || prefix_over || pressure;
        if j - i >= fanout && deep_ok {
            let take = if j - i >= normal { normal } else { j - i };
            let tokens = (i..i + take).map(|k| items.item(k).tokens()).sum();
            return Some((
                Run {
                    start: i,
                    end: i + take,
                    tokens,
                },
                depth + 1,
            ));
        }
        i = j;
    }
    None
}

/// Share of its source (percent) a leaf summary aims at: raw turns hold
/// tool output and narration that a handover does without.
pub const LEAF_TARGET_PERCENT: u64 = 12;

/// Share of its children (percent) a condensed summary aims at: they are
/// handovers already, compressed last; at 12% a depth-3 summary of
/// hundreds of turns was four identifiers.
pub const CONDENSED_TARGET_PERCENT: u64 = 33;

/// One compaction pass: a leaf over a raw run, or a condensation of a run
/// of summaries into one of the given depth.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compaction {
    Leaf(Run),
    Condense(Run, u32),
}

/// Where a conversation's context stands, for [`next_compaction`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Standing {
    pub context_tokens: u64,
    /// Where the debt (or the trigger) wants the context.
    pub target_tokens: u64,
    pub budget: u64,
    /// Condense further while the summaries in context cost more.
    pub prefix_target_tokens: u64,
    /// Overflow recovery or a request: hard fanouts, no reach back.
    pub urgent: bool,
}

/// The next compaction pass, if any. The one test the fold (is there work
/// the debt can be paid with?) and a sweep (what does it do next?) share,
/// so the fold never owes what no sweep can do, nor clears a debt a sweep
/// could still pay: leaf chunks outside the fresh tail first (partial ones
/// once over the target; the tail stops reaching back to the newest user
/// turn under pressure or over the budget), then condensation (at the hard
/// fanout while the summaries in context cost more than their target, or
/// under pressure).
pub fn next_compaction<V: PlanView + ?Sized>(
    items: &V,
    cfg: &PolicyConfig,
    at: Standing,
) -> Option<Compaction> {
    let over = at.context_tokens > at.target_tokens;
    let reach_back = !(at.urgent || at.context_tokens > at.budget);
    if let Some(run) = next_leaf_chunk_with(items, cfg, over || at.urgent, reach_back) {
        return Some(Compaction::Leaf(run));
    }
    let prefix: u64 = (0..items.len())
        .map(|i| items.item(i))
        .filter(|i| !i.is_turn())
        .map(|i| i.tokens())
        .sum();
    let prefix_over = over && prefix > at.prefix_target_tokens;
    next_condensation(items, cfg, prefix_over, at.urgent && over)
        .map(|(run, depth)| Compaction::Condense(run, depth))
}

/// The size a summary of `source_tokens` should aim at.
pub fn summary_target(cfg: &PolicyConfig, depth: u32, source_tokens: u64, aggressive: bool) -> u64 {
    let (cap, percent) = if depth == 0 {
        (cfg.leaf_target_tokens, LEAF_TARGET_PERCENT)
    } else {
        (cfg.condensed_target_tokens, CONDENSED_TARGET_PERCENT)
    };
    let mut t = (source_tokens * percent / 100)
        .clamp(64, cap)
        .min(source_tokens.saturating_sub(1).max(1));
    if aggressive {
        t = (t / 2).max(32);
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turn(seq: u64, role: Role, tokens: u64) -> PlanItem {
        PlanItem::Turn { seq, role, tokens }
    }

    #[test]
    fn boundaries_keep_tool_groups_whole() {
        let items = vec![
            turn(0, Role::User, 10),
            turn(1, Role::Assistant, 10),
            turn(2, Role::Tool, 10),
            turn(3, Role::Tool, 10),
            turn(4, Role::Assistant, 10), // aborted call: no result
            turn(5, Role::User, 10),
        ];
        let b: Vec<bool> = (0..=items.len()).map(|i| is_boundary(&items, i)).collect();
        assert_eq!(b, vec![true, true, false, false, true, true, true]);
    }

    #[test]
    fn leaf_chunk_never_splits_a_group() {
        let cfg = PolicyConfig {
            fresh_tail_count: 2,
            leaf_chunk_tokens: 1000,
            ..PolicyConfig::default()
        };
        let items = vec![
            turn(0, Role::User, 300),
            turn(1, Role::Assistant, 300),
            turn(2, Role::Tool, 600), // would overflow the chunk: the group goes whole to the next chunk
            turn(3, Role::User, 300),
            turn(4, Role::Assistant, 300),
            turn(5, Role::User, 10),
            turn(6, Role::Assistant, 10),
        ];
        let run = next_leaf_chunk(&items, &cfg, true).unwrap();
        assert_eq!((run.start, run.end, run.tokens), (0, 1, 300));
    }

    #[test]
    fn a_leaf_chunk_stops_at_a_summary() {
        // A context an older fold left with raw turns between summaries:
        // the chunk covers the raw run only, never across the summary.
        let cfg = PolicyConfig {
            fresh_tail_count: 1,
            leaf_chunk_tokens: 1000,
            ..PolicyConfig::default()
        };
        let items = vec![
            PlanItem::Summary {
                depth: 0,
                tokens: 100,
            },
            turn(3, Role::User, 150),
            turn(4, Role::Assistant, 150),
            PlanItem::Summary {
                depth: 0,
                tokens: 100,
            },
            turn(9, Role::User, 300),
            turn(10, Role::User, 10),
        ];
        let run = next_leaf_chunk(&items, &cfg, true).unwrap();
        assert_eq!((run.start, run.end, run.tokens), (1, 3, 300));
    }

    #[test]
    fn oversized_group_goes_whole() {
        let cfg = PolicyConfig {
            fresh_tail_count: 1,
            leaf_chunk_tokens: 1000,
            ..PolicyConfig::default()
        };
        let items = vec![
            turn(0, Role::Assistant, 800),
            turn(1, Role::Tool, 800),
            turn(2, Role::User, 10),
        ];
        let run = next_leaf_chunk(&items, &cfg, true).unwrap();
        assert_eq!((run.start, run.end, run.tokens), (0, 2, 1600));
    }

    #[test]
    fn short_run_before_an_oversized_group_is_not_stuck() {
        // The pi session's opening: a short user turn, then a tool group far
        // above the chunk size. The chunk takes both rather than nothing.
        let cfg = PolicyConfig {
            fresh_tail_count: 2,
            leaf_chunk_tokens: 20_000,
            ..PolicyConfig::default()
        };
        let items = vec![
            turn(0, Role::User, 159),
            turn(1, Role::Assistant, 59),
            turn(2, Role::Tool, 12_652),
            turn(3, Role::Tool, 12_403),
            turn(4, Role::Assistant, 51),
            turn(5, Role::Tool, 5_980),
            turn(6, Role::User, 10),
            turn(7, Role::Assistant, 10),
        ];
        let run = next_leaf_chunk(&items, &cfg, false).unwrap();
        assert_eq!((run.start, run.end, run.tokens), (0, 4, 25_273));
    }

    #[test]
    fn fresh_tail_reaches_back_to_newest_user_turn() {
        let cfg = PolicyConfig {
            fresh_tail_count: 2,
            ..PolicyConfig::default()
        };
        let items = vec![
            turn(0, Role::User, 10),
            turn(1, Role::User, 10),
            turn(2, Role::Assistant, 10),
            turn(3, Role::Tool, 10),
            turn(4, Role::Assistant, 10),
            turn(5, Role::Assistant, 10),
        ];
        assert_eq!(fresh_tail_start(&items, &cfg), 1);
    }

    #[test]
    fn fresh_tail_never_starts_inside_a_group() {
        let cfg = PolicyConfig {
            fresh_tail_count: 2,
            ..PolicyConfig::default()
        };
        let items = vec![
            turn(0, Role::User, 10),
            turn(1, Role::Assistant, 10),
            turn(2, Role::Tool, 10),
            turn(3, Role::Tool, 10),
            turn(4, Role::User, 10),
        ];
        assert_eq!(fresh_tail_start(&items, &cfg), 1);
    }

    #[test]
    fn condensation_uses_fanout_and_depth_cap() {
        let cfg = PolicyConfig::default();
        let mut items: Vec<PlanItem> = (0..8)
            .map(|_| PlanItem::Summary {
                depth: 0,
                tokens: 100,
            })
            .collect();
        items.push(turn(0, Role::User, 10));
        let (run, depth) = next_condensation(&items, &cfg, false, false).unwrap();
        assert_eq!((run.start, run.end, depth), (0, 8, 1));
        let items: Vec<PlanItem> = (0..4)
            .map(|_| PlanItem::Summary {
                depth: 1,
                tokens: 100,
            })
            .collect();
        assert!(
            next_condensation(&items, &cfg, false, false).is_none(),
            "depth 2 is not routine"
        );
        assert!(next_condensation(&items, &cfg, true, false).is_some());
    }
}
