//! The rolling session state written without a model: newest facts
//! first in each section, cut to the section and state limits.

use super::*;

pub(super) static COMPLETED: LazyLock<Regex> = LazyLock::new(|| {
    regex_or_bug(
        r"(?i)\b(?:done|completed?|fixed|added|implemented|created|updated|passed|passing|merged|booked|cancell?ed|resolved|wrote|written|finished|removed|renamed|refactored|installed|deployed|confirmed|succeeded|works now)\b",
    )
});
pub(super) static NEXT: LazyLock<Regex> = LazyLock::new(|| {
    regex_or_bug(
        r"(?i)\b(?:todo|next|then|still need|need to|needs to|will|going to|plan to|should|remaining|follow[- ]up)\b",
    )
});
pub(super) static BLOCKER: LazyLock<Regex> = LazyLock::new(|| {
    regex_or_bug(
        r"(?i)\b(?:blocked|blocker|error|exception|traceback|failing|fails|failed|failure|panicked|cannot|can't|could not|unable to|denied|not found|broken|doesn't work|does not work)\b",
    )
});

/// Refreshes the rolling session state from the turns since the last one.
///
/// Newest facts first in each section; the previous state's entries follow
/// (blockers and next steps are carried only when the new turns say nothing
/// of them). Sections are cut to [`ROLLING_SECTION_MAX_CHARS`] and the whole
/// to [`ROLLING_STATE_MAX_CHARS`], on character boundaries.
pub fn rolling_state(req: &RollingStateRequest) -> RollingState {
    let mut completed: Vec<String> = Vec::new();
    let mut decisions: Vec<String> = Vec::new();
    let mut blockers: Vec<String> = Vec::new();
    let mut next: Vec<String> = Vec::new();
    let mut last_ask: Option<String> = None;
    let mut last_action: Option<String> = None;

    for item in req.sources.iter().rev() {
        let text = prefix_bytes(&item.text, MINED_BYTES);
        match item.role {
            Some(Role::User) => {
                last_ask = last_ask.or_else(|| Some(condense(text, 120)).filter(|a| !a.is_empty()));
            }
            Some(Role::Assistant) => {
                if last_action.is_none() {
                    last_action = match &item.tool {
                        Some(tool) => Some(format!("`{tool}`")),
                        None => first_sentence(text),
                    };
                }
                if let Some(tool) = &item.tool {
                    completed.push(format!("ran `{tool}`"));
                }
            }
            Some(Role::Tool) => {
                if let Some(error) = first_error_line(text) {
                    let tool = item.tool.as_deref().unwrap_or("tool");
                    blockers.push(format!("`{tool}`: {}", condense(&error, 90)));
                }
                continue;
            }
            Some(Role::System) => continue,
            None => {}
        }
        for sentence in sentences(text) {
            if sentence.len() < 8 || looks_like_code(sentence) {
                continue;
            }
            let s = condense(sentence, 90);
            if DECISION.is_match(sentence) {
                decisions.push(s);
            } else if BLOCKER.is_match(sentence) {
                blockers.push(s);
            } else if NEXT.is_match(sentence) && item.role != Some(Role::User) {
                next.push(s);
            } else if COMPLETED.is_match(sentence) && item.role != Some(Role::User) {
                completed.push(s);
            }
        }
    }

    let previous = req.previous.clone().unwrap_or_default();
    let in_progress = match (last_ask, last_action) {
        (Some(ask), Some(action)) => format!("{ask} (last step: {action})"),
        (Some(ask), None) => ask,
        (None, Some(action)) => action,
        (None, None) => previous.in_progress.clone(),
    };
    let carry = |mut new: Vec<String>, old: &str, always: bool| -> String {
        dedup_keep_first(&mut new);
        let mut joined = new.join("; ");
        if (always || new.is_empty()) && !old.is_empty() {
            if !joined.is_empty() {
                joined.push_str("; ");
            }
            joined.push_str(old);
        }
        joined
    };
    let sections = [
        carry(completed, &previous.completed, true),
        in_progress,
        carry(decisions, &previous.decisions, true),
        carry(blockers, &previous.blockers, false),
        carry(next, &previous.next, false),
    ];
    let limits = fair_limits(&sections);
    let mut cut = sections
        .iter()
        .zip(limits)
        .map(|(s, limit)| truncate_chars(s, limit));
    RollingState {
        completed: cut.next().unwrap_or_default(),
        in_progress: cut.next().unwrap_or_default(),
        decisions: cut.next().unwrap_or_default(),
        blockers: cut.next().unwrap_or_default(),
        next: cut.next().unwrap_or_default(),
    }
}

pub(super) fn first_sentence(text: &str) -> Option<String> {
    sentences(text)
        .into_iter()
        .find(|s| s.len() >= 8 && !looks_like_code(s))
        .map(|s| condense(s, 90))
}

pub(super) fn dedup_keep_first(items: &mut Vec<String>) {
    let mut seen = HashSet::new();
    items.retain(|item| seen.insert(item.to_lowercase()));
}

/// Character limits per section: each at most the section maximum, the
/// sum at most the state maximum, short sections keeping all they have and
/// long ones sharing the rest equally.
pub(super) fn fair_limits(sections: &[String; 5]) -> [usize; 5] {
    let wanted: Vec<usize> = sections
        .iter()
        .map(|s| s.chars().count().min(ROLLING_SECTION_MAX_CHARS))
        .collect();
    let mut limits = [0usize; 5];
    let mut order: Vec<usize> = (0..5).collect();
    order.sort_by_key(|&i| (wanted[i], i));
    let mut left = ROLLING_STATE_MAX_CHARS;
    for (k, &i) in order.iter().enumerate() {
        let fair = left / (5 - k);
        limits[i] = wanted[i].min(fair);
        left -= limits[i];
    }
    limits
}

/// At most `max` characters; a cut text ends with `…` (counted).
pub(super) fn truncate_chars(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_string();
    }
    if max == 0 {
        return String::new();
    }
    let mut out: String = text.chars().take(max - 1).collect();
    if let Some(space) = out.rfind(' ') {
        if out[space..].chars().count() <= 16 && space > 0 {
            out.truncate(space);
            out = out.trim_end_matches([';', ',', ' ']).to_string();
        }
    }
    out.push('…');
    out
}
