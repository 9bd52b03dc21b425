//! Every metric name contextfold emits, in one place.

pub const EVENTS_FOLDED: &str = "contextfold_events_folded_total";
pub const EVENTS_DUPLICATE: &str = "contextfold_events_duplicate_total";
pub const EVENTS_REJECTED: &str = "contextfold_events_rejected_total";
pub const EVENTS_IGNORED: &str = "contextfold_events_ignored_total";
pub const STATE_COMMITS: &str = "contextfold_state_commits_total";
pub const JOBS_ISSUED: &str = "contextfold_jobs_issued_total";
pub const SWEEPS_ENDED: &str = "contextfold_sweeps_ended_total";
pub const SUMMARIES_WRITTEN: &str = "contextfold_summaries_written_total";
pub const SUMMARIZER_CALLS: &str = "contextfold_summarizer_calls_total";
pub const SWEEP_SECONDS: &str = "contextfold_sweep_seconds";
pub const ASSEMBLE_SECONDS: &str = "contextfold_assemble_seconds";
