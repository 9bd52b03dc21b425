//! The compaction policy's knobs, with their documented defaults. Part of
//! the pure core: the fold's decisions are a function of the events and of
//! this struct, so replaying with the same policy gives the same state.
//!
//! A module of its own, below the events (a `policy_recorded` event carries
//! the whole configuration) and below [`crate::core::policy`], which reads
//! it with the conversation's state; `core::policy` re-exports it.

use crate::core::glob::SessionGlob;
use serde::{Deserialize, Serialize};

/// Every knob of the compaction policy (TOML section `[policy]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyConfig {
    /// Compact when context tokens exceed this share of the budget.
    pub context_threshold: f64,
    /// A sweep compacts down to this share of the budget (hysteresis: must be
    /// below `context_threshold` so the next turn does not re-trigger).
    pub context_target: f64,
    /// Budget when the conversation declared no context window.
    pub default_context_window: u64,
    /// Optional cap on the budget, whatever the window.
    pub max_assembly_token_budget: Option<u64>,
    /// Threshold overrides; the most specific matching rule wins, ties go to
    /// the earliest rule.
    pub threshold_overrides: Vec<ThresholdOverride>,

    /// Newest raw turns that are never compacted.
    pub fresh_tail_count: usize,
    /// Optional token cap on the fresh tail (it still reaches back to the
    /// newest user turn).
    pub fresh_tail_max_tokens: Option<u64>,
    /// Largest leaf chunk, in source tokens.
    pub leaf_chunk_tokens: u64,
    /// Size a leaf summary aims at.
    pub leaf_target_tokens: u64,
    /// Size a condensed summary aims at.
    pub condensed_target_tokens: u64,
    /// Summaries condensed at once at depth 0.
    pub leaf_fanout: usize,
    /// Summaries condensed at once above depth 0.
    pub condensed_fanout: usize,
    /// Fanout under pressure (overflow recovery, manual compaction).
    pub hard_min_fanout: usize,
    /// Deepest condensation a routine sweep performs.
    pub sweep_max_depth: u32,
    /// Condense deeper while the summarized prefix exceeds this share of the
    /// budget.
    pub summarized_prefix_target: f64,

    /// Rolling session state: refresh every this many turns.
    pub rolling_every_turns: u64,
    /// ...or after this many consecutive tool calls (tool-loop guard).
    pub rolling_tool_loop: u64,
    /// ...or above this share of the budget.
    pub rolling_threshold: f64,

    /// Compact when the active transcript exceeds this many bytes (off when unset).
    pub max_active_transcript_bytes: Option<u64>,
    /// Turns above this many tokens are stored as a payload and shown as a stub.
    pub large_payload_threshold_tokens: u64,
    /// At assembly, tool results outside the fresh tail above this many
    /// tokens are cut to a head/tail excerpt (off when unset).
    pub prune_tool_results_over_tokens: Option<u64>,

    /// A user turn of at least this many characters identical to one within
    /// `duplicate_window_ms` is recorded but kept out of context.
    pub duplicate_min_chars: usize,
    pub duplicate_window_ms: u64,
    /// Replay-flood guard: identical user turns allowed in one second.
    pub flood_max_user_per_second: u32,
    /// Replay-flood guard: identical tool/assistant turns allowed in one second.
    pub flood_max_other_per_second: u32,

    /// Intake quota of one conversation: agent events admitted per second
    /// (a token bucket on the partition's clock), and how many may come at
    /// once (a backfill of a long session). Over it, events are refused
    /// (counted; one record per episode). Unset: no quota.
    pub intake_events_per_second: Option<u32>,
    pub intake_burst_events: u32,
    /// The same in bytes of message text.
    pub intake_bytes_per_second: Option<u64>,
    pub intake_burst_bytes: u64,
    /// Intake quota of the whole partition, across its conversations: one
    /// tenant prefix's `serve` holds every partition of its stream, so
    /// the tenant is held to `partitions` times these rates, however many
    /// conversations it spreads a flood over. Taken only from events their
    /// conversation's quota admitted (a conversation refused on its own
    /// takes nothing from the others). Unset: none (the default; NATS's
    /// account and stream limits are the first line). The burst defaults
    /// to a minute of the rate.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub intake_partition_events_per_second: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub intake_partition_burst_events: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub intake_partition_bytes_per_second: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub intake_partition_burst_bytes: Option<u64>,

    /// Conversations matching these globs are not folded at all.
    pub ignore_sessions: Vec<SessionGlob>,
    /// Conversations matching these globs are folded but never compacted.
    pub stateless_sessions: Vec<SessionGlob>,
    /// Tags whose content is stripped from summarizer input.
    pub strip_injected_context_tags: Vec<String>,
    /// Extra instructions for every summary.
    pub custom_instructions: Option<String>,

    /// Passes a sweep may make.
    pub max_sweep_iterations: u32,
    /// Deadline of a routine sweep.
    pub sweep_deadline_ms: u64,
    /// Deadline of an overflow recovery.
    pub compact_until_under_deadline_ms: u64,
    /// Spend window: summarizer calls allowed per window.
    pub summary_max_calls_per_window: u32,
    /// Spend window: summarizer tokens allowed per window (unlimited when unset).
    pub summary_max_tokens_per_window: Option<u64>,
    /// Spend window: money allowed per window, micro-dollars (unlimited when unset).
    pub summary_max_cost_micros_per_window: Option<u64>,
    pub summary_call_window_ms: u64,
    /// Spend window: calls urgent jobs (agent-requested compaction,
    /// provider overflows) may make per window, apart from routine ones
    /// (unset: the same as `summary_max_calls_per_window`).
    pub summary_max_urgent_calls_per_window: Option<u32>,
    /// Backoff after a round that made no progress: the first one; each
    /// further round in a row without progress doubles it, up to
    /// `summary_spend_backoff_ms`.
    pub no_progress_backoff_ms: u64,
    /// The longest backoff after rounds that made no progress.
    pub summary_spend_backoff_ms: u64,
    /// Spend window across all conversations of a partition: calls allowed
    /// per window (unlimited when unset).
    pub summary_max_calls_per_window_global: Option<u32>,
    /// ...tokens allowed per window (unlimited when unset).
    pub summary_max_tokens_per_window_global: Option<u64>,
    /// ...money allowed per window, micro-dollars (unlimited when unset).
    pub summary_max_cost_micros_per_window_global: Option<u64>,
    /// Spend window of each tenant (`core::spend::tenant_of`: the key up to
    /// its first `/`, as the gateway's tenants are keyed) across its
    /// conversations of a partition: calls allowed per window (unlimited
    /// when unset).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub summary_max_calls_per_window_tenant: Option<u32>,
    /// ...tokens allowed per window (unlimited when unset).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub summary_max_tokens_per_window_tenant: Option<u64>,
    /// ...money allowed per window, micro-dollars (unlimited when unset).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub summary_max_cost_micros_per_window_tenant: Option<u64>,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            context_threshold: 0.75,
            context_target: 0.5,
            default_context_window: 128_000,
            max_assembly_token_budget: None,
            threshold_overrides: Vec::new(),
            fresh_tail_count: 64,
            fresh_tail_max_tokens: None,
            leaf_chunk_tokens: 20_000,
            leaf_target_tokens: 2_400,
            condensed_target_tokens: 2_000,
            leaf_fanout: 8,
            condensed_fanout: 4,
            hard_min_fanout: 2,
            sweep_max_depth: 1,
            summarized_prefix_target: 0.25,
            rolling_every_turns: 15,
            rolling_tool_loop: 10,
            rolling_threshold: 0.70,
            max_active_transcript_bytes: None,
            large_payload_threshold_tokens: 25_000,
            prune_tool_results_over_tokens: None,
            duplicate_min_chars: 24,
            duplicate_window_ms: 60_000,
            flood_max_user_per_second: 3,
            flood_max_other_per_second: 32,
            intake_events_per_second: Some(100),
            intake_burst_events: 20_000,
            intake_bytes_per_second: Some(1024 * 1024),
            intake_burst_bytes: 64 * 1024 * 1024,
            intake_partition_events_per_second: None,
            intake_partition_burst_events: None,
            intake_partition_bytes_per_second: None,
            intake_partition_burst_bytes: None,
            ignore_sessions: Vec::new(),
            stateless_sessions: Vec::new(),
            strip_injected_context_tags: vec![
                "active_memory_plugin".into(),
                "relevant-memories".into(),
                "relevant_memories".into(),
                "hindsight_memories".into(),
            ],
            custom_instructions: None,
            max_sweep_iterations: 12,
            sweep_deadline_ms: 120_000,
            compact_until_under_deadline_ms: 300_000,
            summary_max_calls_per_window: 24,
            summary_max_tokens_per_window: None,
            summary_max_cost_micros_per_window: None,
            summary_call_window_ms: 600_000,
            summary_max_urgent_calls_per_window: None,
            no_progress_backoff_ms: 60_000,
            summary_spend_backoff_ms: 1_800_000,
            summary_max_calls_per_window_global: None,
            summary_max_tokens_per_window_global: None,
            summary_max_cost_micros_per_window_global: None,
            summary_max_calls_per_window_tenant: None,
            summary_max_tokens_per_window_tenant: None,
            summary_max_cost_micros_per_window_tenant: None,
        }
    }
}

/// One threshold override. Every condition given must match.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct ThresholdOverride {
    /// Exact model name.
    pub model: Option<String>,
    /// Context-window range, inclusive.
    pub min_context_window: Option<u64>,
    pub max_context_window: Option<u64>,
    /// Session-key glob (`*` one colon-separated segment, `**` any number).
    pub session: Option<SessionGlob>,
    /// The threshold to use.
    pub context_threshold: Option<f64>,
    /// The target to use.
    pub context_target: Option<f64>,
}

/// A policy value that cannot work.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PolicyError {
    #[error("policy.{field} = {value}: {why}")]
    Invalid {
        field: String,
        value: String,
        why: String,
    },
}

fn invalid(field: &str, value: impl ToString, why: &str) -> PolicyError {
    PolicyError::Invalid {
        field: field.into(),
        value: value.to_string(),
        why: why.into(),
    }
}

impl PolicyConfig {
    /// The conversation's intake quota as `IntakeQuota::take` reads it.
    pub fn conversation_intake(&self) -> (Option<u32>, u32, Option<u64>, u64) {
        (
            self.intake_events_per_second,
            self.intake_burst_events,
            self.intake_bytes_per_second,
            self.intake_burst_bytes,
        )
    }

    /// The partition's intake quota as `IntakeQuota::take` reads it (a
    /// burst left unset is a minute of its rate).
    pub fn partition_intake(&self) -> (Option<u32>, u32, Option<u64>, u64) {
        let events = self.intake_partition_events_per_second;
        let bytes = self.intake_partition_bytes_per_second;
        (
            events,
            self.intake_partition_burst_events
                .unwrap_or_else(|| events.unwrap_or(0).saturating_mul(60)),
            bytes,
            self.intake_partition_burst_bytes
                .unwrap_or_else(|| bytes.unwrap_or(0).saturating_mul(60)),
        )
    }

    /// The limits of the spend windows this policy sets.
    pub fn spend_limits(&self) -> crate::core::spend::SpendLimits {
        crate::core::spend::SpendLimits {
            window_ms: self.summary_call_window_ms,
            calls: self.summary_max_calls_per_window,
            urgent_calls: self
                .summary_max_urgent_calls_per_window
                .unwrap_or(self.summary_max_calls_per_window),
            tokens: self.summary_max_tokens_per_window,
            cost_micros: self.summary_max_cost_micros_per_window,
            partition_calls: self.summary_max_calls_per_window_global,
            partition_tokens: self.summary_max_tokens_per_window_global,
            partition_cost_micros: self.summary_max_cost_micros_per_window_global,
            tenant_calls: self.summary_max_calls_per_window_tenant,
            tenant_tokens: self.summary_max_tokens_per_window_tenant,
            tenant_cost_micros: self.summary_max_cost_micros_per_window_tenant,
        }
    }

    /// The backoff after `rounds` rounds in a row without progress (1 for
    /// the first): `no_progress_backoff_ms`, doubled per further round,
    /// capped at `summary_spend_backoff_ms`.
    pub fn no_progress_backoff(&self, rounds: u32) -> u64 {
        let doublings = rounds.saturating_sub(1).min(32);
        self.no_progress_backoff_ms
            .saturating_mul(1u64 << doublings)
            .min(self.summary_spend_backoff_ms)
            .max(1)
    }

    /// Reports the first value that cannot work; never replaces it.
    pub fn validate(&self) -> Result<(), PolicyError> {
        let share = |field: &str, v: f64| {
            if v.is_finite() && v > 0.0 && v <= 1.0 {
                Ok(())
            } else {
                Err(invalid(field, v, "must be a share of the budget in (0, 1]"))
            }
        };
        share("context_threshold", self.context_threshold)?;
        share("context_target", self.context_target)?;
        share("rolling_threshold", self.rolling_threshold)?;
        share("summarized_prefix_target", self.summarized_prefix_target)?;
        if self.context_target >= self.context_threshold {
            return Err(invalid(
                "context_target",
                self.context_target,
                "must be below context_threshold, or every turn would re-trigger compaction",
            ));
        }
        for (i, o) in self.threshold_overrides.iter().enumerate() {
            if let Some(t) = o.context_threshold {
                share(&format!("threshold_overrides[{i}].context_threshold"), t)?;
            }
            if let Some(t) = o.context_target {
                share(&format!("threshold_overrides[{i}].context_target"), t)?;
            }
        }
        let positive = |field: &str, v: u64| {
            if v == 0 {
                Err(invalid(field, v, "must be positive"))
            } else {
                Ok(())
            }
        };
        positive("default_context_window", self.default_context_window)?;
        positive("leaf_chunk_tokens", self.leaf_chunk_tokens)?;
        positive("leaf_target_tokens", self.leaf_target_tokens)?;
        positive("condensed_target_tokens", self.condensed_target_tokens)?;
        positive("summary_call_window_ms", self.summary_call_window_ms)?;
        positive("sweep_deadline_ms", self.sweep_deadline_ms)?;
        // A quota's rates and bursts: 0 would refuse everything for ever
        // (leave a rate unset for none).
        let quota = [
            (
                "intake_events_per_second",
                self.intake_events_per_second.map(u64::from),
            ),
            (
                "intake_burst_events",
                Some(u64::from(self.intake_burst_events)),
            ),
            ("intake_bytes_per_second", self.intake_bytes_per_second),
            ("intake_burst_bytes", Some(self.intake_burst_bytes)),
            (
                "intake_partition_events_per_second",
                self.intake_partition_events_per_second.map(u64::from),
            ),
            (
                "intake_partition_burst_events",
                self.intake_partition_burst_events.map(u64::from),
            ),
            (
                "intake_partition_bytes_per_second",
                self.intake_partition_bytes_per_second,
            ),
            (
                "intake_partition_burst_bytes",
                self.intake_partition_burst_bytes,
            ),
        ];
        for (field, v) in quota {
            if let Some(v) = v {
                positive(field, v)?;
            }
        }
        positive("max_sweep_iterations", self.max_sweep_iterations as u64)?;
        positive("no_progress_backoff_ms", self.no_progress_backoff_ms)?;
        if self.no_progress_backoff_ms > self.summary_spend_backoff_ms {
            return Err(invalid(
                "no_progress_backoff_ms",
                self.no_progress_backoff_ms,
                "must not exceed summary_spend_backoff_ms (the longest backoff)",
            ));
        }
        if self.leaf_target_tokens >= self.leaf_chunk_tokens {
            return Err(invalid(
                "leaf_target_tokens",
                self.leaf_target_tokens,
                "must be below leaf_chunk_tokens",
            ));
        }
        if self.hard_min_fanout < 2 {
            return Err(invalid(
                "hard_min_fanout",
                self.hard_min_fanout,
                "must be at least 2",
            ));
        }
        if self.leaf_fanout < self.hard_min_fanout || self.condensed_fanout < self.hard_min_fanout {
            return Err(invalid(
                "leaf_fanout",
                self.leaf_fanout,
                "fanouts must be at least hard_min_fanout",
            ));
        }
        Ok(())
    }
}
