//! Every id the service derives from another one, built in one place.
//!
//! These ids are stored in events, so they are in the golden files, the
//! state hash and (through `nats::msg_id`) the message ids a stream
//! deduplicates by: a derived id never changes shape. Each kind is one
//! arm of [`DerivedId`] and its text is written by its `Display`, and
//! nowhere else.

use std::fmt;

/// An id derived from another: format one with `to_string()`.
#[derive(Debug, Clone, Copy)]
pub enum DerivedId<'a> {
    /// A decision the fold derives from event `cause`:
    /// `d_<event type>_<hash of cause and type>`.
    Decision { cause: &'a str, event_type: &'a str },
    /// The `issued`-th job (from 0) of `conversation`:
    /// `job_<hash of conversation>_<issued>`.
    Job { conversation: &'a str, issued: u64 },
    /// The `summary_recorded` event of a summary: `sr_<summary id>`.
    SummaryRecorded { summary_id: &'a str },
    /// The `rolling_state_updated` event of a job: `rs_<job id>`.
    RollingState { job_id: &'a str },
    /// The `sweep_ended` event of a job: `se_<job id>`.
    SweepEnded { job_id: &'a str },
    /// The id a rejection gives a record with none of its own:
    /// `undecodable_<hash of its bytes>`.
    Undecodable { bytes: &'a [u8] },
    /// The dead letter of a job that cannot run: `dead_<job id>`.
    DeadJob { job_id: &'a str },
    /// The dead letter of a decision that cannot be published:
    /// `dead_<event id>`.
    DeadEvent { event_id: &'a str },
    /// The dead letter of a record a partition refused:
    /// `dead_p<partition>_<stream position>`.
    DeadRecord { partition: u32, position: u64 },
}

impl fmt::Display for DerivedId<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            DerivedId::Decision { cause, event_type } => {
                let h = blake3::hash(format!("{cause}\u{0}{event_type}").as_bytes());
                write!(f, "d_{}_{}", event_type, &h.to_hex()[..20])
            }
            DerivedId::Job {
                conversation,
                issued,
            } => write!(
                f,
                "job_{}_{}",
                &blake3::hash(conversation.as_bytes()).to_hex()[..12],
                issued
            ),
            DerivedId::SummaryRecorded { summary_id } => write!(f, "sr_{summary_id}"),
            DerivedId::RollingState { job_id } => write!(f, "rs_{job_id}"),
            DerivedId::SweepEnded { job_id } => write!(f, "se_{job_id}"),
            DerivedId::Undecodable { bytes } => {
                write!(f, "undecodable_{}", &blake3::hash(bytes).to_hex()[..20])
            }
            DerivedId::DeadJob { job_id } => write!(f, "dead_{job_id}"),
            DerivedId::DeadEvent { event_id } => write!(f, "dead_{event_id}"),
            DerivedId::DeadRecord {
                partition,
                position,
            } => write!(f, "dead_p{partition}_{position}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shapes as they were built by hand before this module: these ids
    /// are stored, so a change here is a change to the log.
    #[test]
    fn every_kind_keeps_its_shape() {
        let decision = DerivedId::Decision {
            cause: "t1",
            event_type: "job_issued",
        }
        .to_string();
        let h = blake3::hash("t1\u{0}job_issued".as_bytes());
        assert_eq!(decision, format!("d_job_issued_{}", &h.to_hex()[..20]));
        let job = DerivedId::Job {
            conversation: "c:1",
            issued: 3,
        }
        .to_string();
        assert_eq!(
            job,
            format!("job_{}_3", &blake3::hash(b"c:1").to_hex()[..12])
        );
        let undecodable = DerivedId::Undecodable { bytes: b"\xff" }.to_string();
        assert_eq!(
            undecodable,
            format!("undecodable_{}", &blake3::hash(b"\xff").to_hex()[..20])
        );
        let cases = [
            (
                DerivedId::SummaryRecorded {
                    summary_id: "sum_1",
                },
                "sr_sum_1",
            ),
            (DerivedId::RollingState { job_id: "job_a_0" }, "rs_job_a_0"),
            (DerivedId::SweepEnded { job_id: "job_a_0" }, "se_job_a_0"),
            (DerivedId::DeadJob { job_id: "job_a_0" }, "dead_job_a_0"),
            (DerivedId::DeadEvent { event_id: "d_x_1" }, "dead_d_x_1"),
            (
                DerivedId::DeadRecord {
                    partition: 2,
                    position: 17,
                },
                "dead_p2_17",
            ),
        ];
        for (id, want) in cases {
            assert_eq!(id.to_string(), want);
        }
    }
}
