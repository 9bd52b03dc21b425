//! Summary acceptance: a recorded summary is checked against the state
//! (identity, the span it covers, a re-summary's predecessor) and placed
//! in the context, or rejected with the reason.

use super::*;

/// Where an accepted summary goes: the context range it takes the place
/// of, the raw turns under it, the tokens it was written over and the
/// tokens that leave the context.
pub(super) struct Placement {
    pub(super) start: usize,
    pub(super) end: usize,
    pub(super) first_turn: u64,
    pub(super) last_turn: u64,
    pub(super) source_tokens: u64,
    pub(super) removed_tokens: u64,
}

impl FoldContext<'_> {
    pub(super) fn summary_recorded(&mut self, s: &SummaryRecorded) -> FoldStatus {
        let checked = match &s.supersedes {
            None => self.validate_summary(s),
            Some(old) => self.validate_resummary(s, old),
        };
        match checked {
            Ok(Placement {
                start,
                end,
                first_turn,
                last_turn,
                source_tokens,
                removed_tokens,
            }) => {
                // What it costs in context is its rendered message, wrapper
                // included: assembly's budget is kept in real tokens.
                let tokens = assembly::summary_tokens(
                    self.conv.encoding,
                    &s.summary_id,
                    s.depth,
                    first_turn,
                    last_turn,
                    s.fallback,
                    &s.content,
                );
                let index = self.conv.summaries.len() as u32;
                self.conv.summaries.push(Summary {
                    id: s.summary_id.clone(),
                    kind: s.kind,
                    depth: s.depth,
                    covers: s.covers.clone(),
                    first_turn,
                    last_turn,
                    tokens,
                    source_tokens,
                    model: s.model.clone(),
                    provider: s.provider.clone(),
                    prompt_version: s.prompt_version.clone(),
                    fallback: s.fallback,
                    time: self.event.time,
                    job_id: s.job_id.clone(),
                    supersedes: s.supersedes.clone(),
                });
                self.conv
                    .summary_texts
                    .push(index, Arc::from(s.content.as_str()));
                let removed_bytes: u64 = self.conv.context[start..end]
                    .iter()
                    .map(|i| match i {
                        ContextItem::Turn(seq) => u64::from(self.conv.turns[*seq as usize].bytes),
                        ContextItem::Summary(_) => 0,
                    })
                    .sum();
                self.conv.context.replace(
                    start..end,
                    ContextItem::Summary(index),
                    tokens,
                    removed_tokens,
                    removed_bytes,
                );
                if let (Some(pending), Some(id)) = (&mut self.conv.pending_job, &s.job_id) {
                    if &pending.job.job_id == id {
                        pending.committed += 1;
                    }
                }
                self.history(
                    "summary_recorded",
                    format!(
                        "{} {:?} depth {} over turns {first_turn}..={last_turn}: {source_tokens} -> {tokens} tokens{}{}",
                        s.summary_id,
                        s.kind,
                        s.depth,
                        if s.fallback { " (deterministic fallback)" } else { "" },
                        s.supersedes.as_ref().map_or(String::new(), |old| format!(
                            ", replaces fallback {old} ({removed_tokens} tokens in context)"
                        ))
                    ),
                );
                FoldStatus::Applied
            }
            Err(rejection) => {
                self.conv.stale_summaries += 1;
                self.history("summary_rejected", format!("{}: {rejection}", s.summary_id));
                self.decide(EventBody::SummaryRejected(SummaryRejected {
                    summary_id: s.summary_id.clone(),
                    job_id: s.job_id.clone(),
                    reason: rejection.to_string(),
                }));
                FoldStatus::Rejected(rejection.into())
            }
        }
    }

    /// What every recorded summary must be: its own content address, not
    /// empty, not recorded before.
    pub(super) fn validate_identity(&self, s: &SummaryRecorded) -> Result<(), SummaryRejection> {
        let expected = summary_id(
            &self.conv.key,
            s.kind,
            s.depth,
            &s.covers,
            &s.content,
            &s.prompt_version,
        );
        if expected != s.summary_id {
            return Err(SummaryRejection::NotContentAddressed { expected });
        }
        if s.content.trim().is_empty() {
            return Err(SummaryRejection::Empty);
        }
        if self.conv.summary_index(&s.summary_id).is_some() {
            return Err(SummaryRejection::AlreadyRecorded);
        }
        Ok(())
    }

    /// Checks a re-summarization: a model summary that takes the place of
    /// fallback summary `old` in context, over exactly the same sources.
    /// The sources are no longer in context, so the placement is `old`'s
    /// own slot and the source tokens are the ones `old` was written over.
    pub(super) fn validate_resummary(
        &self,
        s: &SummaryRecorded,
        old: &str,
    ) -> Result<Placement, SummaryRejection> {
        self.validate_identity(s)?;
        if s.fallback {
            return Err(SummaryRejection::FallbackSupersedes { old: old.into() });
        }
        let Some(index) = self.conv.summary_index(old) else {
            return Err(SummaryRejection::SupersedesUnknown { old: old.into() });
        };
        let replaced = &self.conv.summaries[index as usize];
        if !replaced.fallback {
            return Err(SummaryRejection::SupersedesModelSummary { old: old.into() });
        }
        let Some(pos) = self
            .conv
            .context
            .iter()
            .position(|i| *i == ContextItem::Summary(index))
        else {
            return Err(SummaryRejection::SupersededGone { old: old.into() });
        };
        if s.kind != replaced.kind || s.depth != replaced.depth || s.covers != replaced.covers {
            return Err(SummaryRejection::NotTheSameSpan {
                old: old.into(),
                kind: s.kind,
                depth: s.depth,
                covers: s.covers.clone(),
                old_kind: replaced.kind,
                old_depth: replaced.depth,
                old_covers: replaced.covers.clone(),
            });
        }
        Ok(Placement {
            start: pos,
            end: pos + 1,
            first_turn: replaced.first_turn,
            last_turn: replaced.last_turn,
            source_tokens: replaced.source_tokens,
            removed_tokens: replaced.tokens,
        })
    }

    /// Checks that a summary matches the current state exactly; returns the
    /// context range it replaces, its turn span and source tokens.
    pub(super) fn validate_summary(
        &self,
        s: &SummaryRecorded,
    ) -> Result<Placement, SummaryRejection> {
        self.validate_identity(s)?;
        let ctx = &self.conv.context;
        match (&s.kind, &s.covers) {
            (SummaryKind::Leaf, Covers::Turns { first, last }) => {
                if s.depth != 0 {
                    return Err(SummaryRejection::LeafDepth);
                }
                if first > last || *last as usize >= self.conv.turns.len() {
                    return Err(SummaryRejection::UnknownTurns {
                        first: *first,
                        last: *last,
                    });
                }
                let Some(start) = ctx.iter().position(|i| *i == ContextItem::Turn(*first)) else {
                    return Err(SummaryRejection::TurnNotRaw { first: *first });
                };
                // Summaries stay a prefix of the context: a leaf that did not
                // start at the oldest raw turn would leave raw turns between
                // two summaries, which no later leaf could cover. A chunk
                // planned on an old snapshot (an expired or superseded job)
                // is refused here once another summary took its place.
                let oldest = policy::raw_start(&*self.conv);
                if start != oldest {
                    let oldest = match ctx.get(oldest) {
                        Some(ContextItem::Turn(seq)) => seq.to_string(),
                        _ => "none".into(),
                    };
                    return Err(SummaryRejection::NotOldestRaw {
                        first: *first,
                        oldest,
                    });
                }
                let mut end = start;
                let mut tokens = 0;
                for seq in *first..=*last {
                    let turn = &self.conv.turns[seq as usize];
                    if !turn.in_context {
                        continue;
                    }
                    if ctx.get(end) != Some(&ContextItem::Turn(seq)) {
                        return Err(SummaryRejection::TurnNotNext { seq });
                    }
                    tokens += turn.context_tokens;
                    end += 1;
                }
                let conv: &Conversation = self.conv;
                if !policy::is_boundary(conv, start) || !policy::is_boundary(conv, end) {
                    return Err(SummaryRejection::SplitsToolPair);
                }
                // The hard line: the newest fresh_tail_count turns are never summarized.
                let tail = policy::fresh_tail_start_with(conv, self.policy, false);
                if end > tail {
                    return Err(SummaryRejection::FreshTail);
                }
                Ok(Placement {
                    start,
                    end,
                    first_turn: *first,
                    last_turn: *last,
                    source_tokens: u64::from(tokens),
                    removed_tokens: u64::from(tokens),
                })
            }
            (SummaryKind::Condensed, Covers::Summaries { ids }) => {
                if ids.len() < 2 {
                    return Err(SummaryRejection::TooFewChildren);
                }
                let mut start = None;
                let mut tokens = 0;
                let (mut first_turn, mut last_turn) = (u64::MAX, 0);
                for (k, id) in ids.iter().enumerate() {
                    let Some(index) = self.conv.summary_index(id) else {
                        return Err(SummaryRejection::UnknownChild { id: id.clone() });
                    };
                    let child = &self.conv.summaries[index as usize];
                    if child.depth + 1 != s.depth {
                        return Err(match s.depth.checked_sub(1) {
                            Some(expected) => SummaryRejection::ChildDepth {
                                id: id.clone(),
                                depth: child.depth,
                                expected,
                            },
                            None => SummaryRejection::CondensedDepth,
                        });
                    }
                    let Some(pos) = ctx.iter().position(|i| *i == ContextItem::Summary(index))
                    else {
                        return Err(SummaryRejection::ChildCondensed { id: id.clone() });
                    };
                    match start {
                        None => start = Some(pos),
                        Some(s0) if pos != s0 + k => return Err(SummaryRejection::ChildrenApart),
                        _ => {}
                    }
                    tokens += child.tokens;
                    first_turn = first_turn.min(child.first_turn);
                    last_turn = last_turn.max(child.last_turn);
                }
                let start = start.unwrap_or(0);
                Ok(Placement {
                    start,
                    end: start + ids.len(),
                    first_turn,
                    last_turn,
                    source_tokens: tokens,
                    removed_tokens: tokens,
                })
            }
            _ => Err(SummaryRejection::KindCoversDisagree),
        }
    }
}
