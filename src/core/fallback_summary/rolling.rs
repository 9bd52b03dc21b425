//! The rolling session state written without a model: the handover of
//! [`Notes`] in five short lines, updated rather than rewritten.
//!
//! - **Completed**: milestones of the new turns (tests passing, commits,
//!   pushes, tasks closed, actions), then files changed, then what the
//!   previous state had;
//! - **In progress**: the user's newest request in their words (the
//!   previous one stays while the new turns bring none);
//! - **Decisions**: the new ones, then the previous ones;
//! - **Blockers**: errors of the new turns the agent has not yet answered;
//!   the previous blockers only while the new turns show no progress;
//! - **Next**: the newest next step of the new turns, or the question the
//!   agent asked; never an older one once the conversation moved on.
//!
//! Items are whole: a section is cut between items (`; `), and only an
//! item longer than the whole section is cut, at a word, with `…`.

use super::*;

/// Refreshes the rolling session state from the turns since the last one.
pub fn rolling_state(req: &RollingStateRequest) -> RollingState {
    let notes = Notes::from_turns(&req.sources);
    let previous = req.previous.clone().unwrap_or_default();
    let unlabel = |l: &Line| strip_label(&l.text).to_string();

    let mut completed: Vec<String> = notes.done.iter().rev().map(unlabel).collect();
    let mut files: Vec<&FileEntry> = notes.files.iter().collect();
    files.sort_by_key(|f| std::cmp::Reverse(f.at));
    if !files.is_empty() {
        let names: Vec<String> = files
            .iter()
            .take(6)
            .map(|f| format!("{} {}", f.verbs.join("/"), short_path(&f.path)))
            .collect();
        completed.push(names.join(", "));
    }
    completed.extend(items_of(&previous.completed));

    let ask = notes
        .task
        .last()
        .map(|l| strip_label(l.short.as_deref().unwrap_or(&l.text)).to_string());
    let in_progress = match ask {
        Some(ask) if ask.chars().count() < 60 => {
            // The request it continues, in its first sentence: the task
            // must not fall off when the newest words are "go on".
            let earlier = items_of(&previous.in_progress)
                .into_iter()
                .map(|i| i.trim_start_matches("earlier: ").to_string())
                .find(|i| *i != ask)
                .map(|i| signals::sentences_up_to(&i, 100));
            let mut v = vec![ask];
            v.extend(earlier.map(|e| format!("earlier: {e}")));
            v
        }
        Some(ask) => vec![ask],
        None => items_of(&previous.in_progress),
    };

    let mut decisions: Vec<String> = notes.decisions.iter().rev().map(unlabel).collect();
    decisions.extend(items_of(&previous.decisions));

    // Errors newer than the newest milestone block the work until
    // something shows progress past them.
    let progress_at = notes.done.iter().map(|d| d.at).max();
    let open_errors: Vec<String> = notes
        .errors
        .iter()
        .rev()
        .filter(|e| progress_at.is_none_or(|p| e.at > p))
        .map(|e| strip_label(e.short.as_deref().unwrap_or(&e.text)).to_string())
        .collect();
    let progress = !notes.done.is_empty() || !notes.files.is_empty();
    let blockers = if !open_errors.is_empty() {
        open_errors
    } else if progress || !notes.errors.is_empty() {
        Vec::new()
    } else {
        items_of(&previous.blockers)
    };

    let spoke = !req.sources.is_empty();
    let next = match (&notes.next, notes.open.last()) {
        (Some(n), _) => vec![unlabel(n)],
        (None, Some(q)) => vec![unlabel(q)],
        (None, None) if !spoke => items_of(&previous.next),
        (None, None) => Vec::new(),
    };

    let sections = [completed, in_progress, decisions, blockers, next].map(|mut items| {
        dedup_keep_first(&mut items);
        items
    });
    let wanted: Vec<usize> = sections
        .iter()
        .map(|items| items.join("; ").chars().count())
        .collect();
    let limits = fair_limits(&wanted);
    let mut cut = sections
        .iter()
        .zip(limits)
        .map(|(items, limit)| join_items(items, limit));
    RollingState {
        completed: cut.next().unwrap_or_default(),
        in_progress: cut.next().unwrap_or_default(),
        decisions: cut.next().unwrap_or_default(),
        blockers: cut.next().unwrap_or_default(),
        next: cut.next().unwrap_or_default(),
    }
}

impl HandoverFacts {
    /// The facts a rolling state carries into its update: the requests in
    /// progress and the decisions in force, by their content words. The
    /// deterministic update keeps them while they fit, so a model's update
    /// is held to them too ([`crate::summarizer::floor`]): a decision
    /// stated fifty turns ago is not in the new turns, and a model that
    /// drops it from the state loses it for good.
    pub fn carried_by(state: &RollingState) -> HandoverFacts {
        let terms = |section: &str| -> Vec<Vec<String>> {
            items_of(section)
                .iter()
                .map(|i| content_terms(i.trim_start_matches("earlier: ")))
                .filter(|t| !t.is_empty())
                .collect()
        };
        HandoverFacts {
            requests: terms(&state.in_progress),
            files: Vec::new(),
            errors: Vec::new(),
            decisions: terms(&state.decisions),
        }
    }

    /// These facts and `other`'s, each once.
    pub fn extend(&mut self, other: HandoverFacts) {
        fn add<T: PartialEq>(to: &mut Vec<T>, more: Vec<T>) {
            for m in more {
                if !to.contains(&m) {
                    to.push(m);
                }
            }
        }
        add(&mut self.requests, other.requests);
        add(&mut self.files, other.files);
        add(&mut self.errors, other.errors);
        add(&mut self.decisions, other.decisions);
    }
}

/// A section's items as the state wrote them.
fn items_of(section: &str) -> Vec<String> {
    section
        .split("; ")
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

/// The last two components of a path: enough to tell files apart in a
/// few characters.
fn short_path(path: &str) -> &str {
    let mut cut = path.len();
    for _ in 0..2 {
        match path[..cut].rfind('/') {
            Some(i) => cut = i,
            None => return path,
        }
    }
    &path[cut + 1..]
}

pub(super) fn dedup_keep_first(items: &mut Vec<String>) {
    let mut seen = HashSet::new();
    items.retain(|item| seen.insert(item.to_lowercase()));
}

/// Whole items joined by `; ` within `max` characters; the first item is
/// cut at a word with `…` only when it alone is longer than `max`.
fn join_items(items: &[String], max: usize) -> String {
    let mut out = String::new();
    for item in items {
        let sep = if out.is_empty() { 0 } else { 2 };
        let n = item.chars().count();
        if out.chars().count() + sep + n <= max {
            if sep > 0 {
                out.push_str("; ");
            }
            out.push_str(item);
        } else if out.is_empty() {
            return truncate_chars(item, max);
        }
    }
    out
}

/// Character limits per section: each at most the section maximum, the
/// sum at most the state maximum, short sections keeping all they have and
/// long ones sharing the rest equally.
pub(super) fn fair_limits(wanted: &[usize]) -> [usize; 5] {
    let wanted: Vec<usize> = wanted
        .iter()
        .map(|&w| w.min(ROLLING_SECTION_MAX_CHARS))
        .collect();
    let mut limits = [0usize; 5];
    let mut order: Vec<usize> = (0..5).collect();
    order.sort_by_key(|&i| (wanted.get(i).copied().unwrap_or(0), i));
    let mut left = ROLLING_STATE_MAX_CHARS;
    for (k, &i) in order.iter().enumerate() {
        let fair = left / (5 - k);
        limits[i] = wanted.get(i).copied().unwrap_or(0).min(fair);
        left -= limits[i];
    }
    limits
}

/// At most `max` characters; a cut text ends with `…` (counted), at a word
/// boundary when one is near.
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
