//! Every event id the service derives from another one (or from a request
//! id, a log position, a transcript index), built in one place.
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
    /// The `clock_ticked` event a partition records at a log position:
    /// `tick:<partition key>:<position>`.
    ClockTick {
        partition_key: &'a str,
        position: u64,
    },
    /// The `policy_recorded` event a partition records at a log position
    /// under a policy: `policy:<partition key>:<fingerprint>:<position>`
    /// (every partition records its own; ids are deduplicated across the
    /// whole stream).
    PolicyRecorded {
        partition_key: &'a str,
        fingerprint: &'a str,
        position: u64,
    },
    /// The `recall_answered` event of a caller's recall request:
    /// `recall_<hash of conversation and request id>`.
    Recall {
        conversation: &'a str,
        request_id: &'a str,
    },
    /// The `compaction_requested` event of a caller's request id:
    /// `compact_<hash of conversation and request id>` (the conversation
    /// in it, so the stream's deduplication never merges two
    /// conversations' requests).
    CompactionRequest {
        conversation: &'a str,
        request_id: &'a str,
    },
    /// The `index`-th event imported from a transcript into
    /// `conversation`: `imp-<hash of conversation and index>`.
    Imported { conversation: &'a str, index: usize },
    /// The `n`-th turn the gateway records after the history whose chain
    /// value is `chain` (`gateway::keying`):
    /// `gw-<hash of conversation and chain>.<n>`.
    GatewayTurn {
        conversation: &'a str,
        chain: &'a [u8; 16],
        n: usize,
    },
    /// The `provider_error_observed` event the gateway records for a turn's
    /// overflowing request: `<turn id>.overflow`.
    GatewayOverflow { turn_id: &'a str },
    /// The `compaction_requested` event the gateway records when a client
    /// compacts at a turn: `<turn id>.compact`.
    GatewayCompaction { turn_id: &'a str },
}

/// The hash of `parts`, each after its length (so no two lists of parts
/// hash alike): the gateway's turn ids, and its chain values
/// (`gateway::keying`).
pub fn hash_of_parts(parts: &[&[u8]]) -> blake3::Hash {
    let mut h = blake3::Hasher::new();
    for part in parts {
        h.update(&(part.len() as u64).to_le_bytes());
        h.update(part);
    }
    h.finalize()
}

/// The hash of `conversation`, a NUL and `request_id`.
fn request_hash(conversation: &str, request_id: &str) -> blake3::Hash {
    let mut h = blake3::Hasher::new();
    h.update(conversation.as_bytes());
    h.update(&[0]);
    h.update(request_id.as_bytes());
    h.finalize()
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
            DerivedId::ClockTick {
                partition_key,
                position,
            } => write!(f, "tick:{partition_key}:{position}"),
            DerivedId::PolicyRecorded {
                partition_key,
                fingerprint,
                position,
            } => write!(f, "policy:{partition_key}:{fingerprint}:{position}"),
            DerivedId::Recall {
                conversation,
                request_id,
            } => write!(
                f,
                "recall_{}",
                &request_hash(conversation, request_id).to_hex()[..24]
            ),
            DerivedId::CompactionRequest {
                conversation,
                request_id,
            } => write!(
                f,
                "compact_{}",
                &request_hash(conversation, request_id).to_hex()[..24]
            ),
            DerivedId::Imported {
                conversation,
                index,
            } => {
                let mut h = blake3::Hasher::new();
                h.update(b"contextfold-import\0");
                h.update(conversation.as_bytes());
                h.update(b"\0");
                h.update(&(index as u64).to_le_bytes());
                write!(f, "imp-{}", &h.finalize().to_hex()[..16])
            }
            DerivedId::GatewayTurn {
                conversation,
                chain,
                n,
            } => {
                let h = hash_of_parts(&[conversation.as_bytes(), chain]);
                write!(f, "gw-{}.{n}", &h.to_hex()[..24])
            }
            DerivedId::GatewayOverflow { turn_id } => write!(f, "{turn_id}.overflow"),
            DerivedId::GatewayCompaction { turn_id } => write!(f, "{turn_id}.compact"),
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

    /// The ids built by hand before they moved here (the folder's ticks,
    /// the engine's policy records, the API's request ids, the importers'
    /// and the gateway's), each with the code that built it then.
    #[test]
    fn the_ids_that_moved_here_keep_their_shape() {
        let cases = [
            (
                DerivedId::ClockTick {
                    partition_key: "contextfold-partition-3",
                    position: 48213,
                },
                format!("tick:{}:{}", "contextfold-partition-3", 48213),
            ),
            (
                DerivedId::PolicyRecorded {
                    partition_key: "contextfold-partition-3",
                    fingerprint: "fp1",
                    position: 7,
                },
                format!("policy:{}:{}:{}", "contextfold-partition-3", "fp1", 7),
            ),
        ];
        for (id, want) in cases {
            assert_eq!(id.to_string(), want);
        }
        let by_request = |prefix: &str| {
            let mut h = blake3::Hasher::new();
            h.update(b"c:1");
            h.update(&[0]);
            h.update(b"req-9");
            format!("{prefix}_{}", &h.finalize().to_hex()[..24])
        };
        let (conversation, request_id) = ("c:1", "req-9");
        let recall = DerivedId::Recall {
            conversation,
            request_id,
        };
        assert_eq!(recall.to_string(), by_request("recall"));
        let compact = DerivedId::CompactionRequest {
            conversation,
            request_id,
        };
        assert_eq!(compact.to_string(), by_request("compact"));
        let mut h = blake3::Hasher::new();
        h.update(b"contextfold-import\0");
        h.update(b"c:1");
        h.update(b"\0");
        h.update(&5u64.to_le_bytes());
        let imported = DerivedId::Imported {
            conversation,
            index: 5,
        };
        assert_eq!(
            imported.to_string(),
            format!("imp-{}", &h.finalize().to_hex()[..16])
        );
        let chain = [7u8; 16];
        let mut h = blake3::Hasher::new();
        for part in [&b"c:1"[..], &chain[..]] {
            h.update(&(part.len() as u64).to_le_bytes());
            h.update(part);
        }
        let digest = h.finalize();
        let hex: String = digest.as_bytes()[..12]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let turn = DerivedId::GatewayTurn {
            conversation,
            chain: &chain,
            n: 2,
        }
        .to_string();
        assert_eq!(turn, format!("gw-{hex}.2"));
        let turn_id = turn.as_str();
        assert_eq!(
            DerivedId::GatewayOverflow { turn_id }.to_string(),
            format!("{turn}.overflow")
        );
        assert_eq!(
            DerivedId::GatewayCompaction { turn_id }.to_string(),
            format!("{turn}.compact")
        );
    }
}
