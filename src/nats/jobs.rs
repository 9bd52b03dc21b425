//! The compaction job as it travels on the work queue (`cf.job.<conv>`).
//!
//! The folder publishes one [`JobMessage`] per issued job, MessagePack with
//! `Nats-Msg-Id` = the job id (a republished job is dropped by the server),
//! carrying the [`SweepSnapshot`] a stateless summarizer needs. When that
//! message would be larger than `max_inline_payload_bytes`, the snapshot
//! goes to the object store under `jobs/<job id>` and the message carries
//! its name instead; the summarizer deletes it when the job ends
//! ([`JobMessage::discard_snapshot`]), and the bucket's `max_age`
//! (`payload_max_age_ms`) removes what a crash left.

use crate::core::sweep::SweepSnapshot;
use crate::nats::publish::Outbound;
use crate::nats::subjects::Subjects;
use crate::nats::NatsError;
use async_nats::jetstream::context::PublishAckFuture;
use async_nats::jetstream::object_store::ObjectStore;
use async_nats::jetstream::Context;
use serde::{Deserialize, Serialize};
use tokio::io::AsyncReadExt;

/// One compaction job on the work queue.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobMessage {
    pub job_id: String,
    pub conversation: String,
    /// The snapshot itself, when small enough to travel inline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<SweepSnapshot>,
    /// Otherwise the object-store name holding the MessagePack snapshot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_object: Option<String>,
}

/// Object-store name of a job's snapshot.
pub fn snapshot_object_name(job_id: &str) -> String {
    format!("jobs/{job_id}")
}

#[allow(clippy::expect_used)] // only a bug reaches the expect (see its message)
fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    // Owned, well-formed data serializes into a Vec without failing.
    rmp_serde::to_vec_named(value).expect("job messages serialize")
}

impl JobMessage {
    pub fn decode(bytes: &[u8]) -> Result<JobMessage, NatsError> {
        rmp_serde::from_slice(bytes).map_err(|e| NatsError::js("decoding a job", e))
    }

    /// The snapshot, fetched from the object store when not inline.
    pub async fn snapshot(&self, payloads: &ObjectStore) -> Result<SweepSnapshot, NatsError> {
        if let Some(s) = &self.snapshot {
            return Ok(s.clone());
        }
        let Some(name) = &self.snapshot_object else {
            return Err(NatsError::js(
                "reading a job",
                format!("job {} carries no snapshot", self.job_id),
            ));
        };
        let mut object = payloads
            .get(name)
            .await
            .map_err(|e| NatsError::js(format!("fetching job snapshot {name}"), e))?;
        let mut bytes = Vec::new();
        object
            .read_to_end(&mut bytes)
            .await
            .map_err(|e| NatsError::js(format!("reading job snapshot {name}"), e))?;
        rmp_serde::from_slice(&bytes)
            .map_err(|e| NatsError::js(format!("decoding job snapshot {name}"), e))
    }
}

impl JobMessage {
    /// Deletes the job's snapshot from the object store, once the job has
    /// ended (acknowledged or dead-lettered): whether there was one to
    /// delete. Nothing for an inline snapshot, or one already gone.
    pub async fn discard_snapshot(&self, payloads: &ObjectStore) -> Result<bool, NatsError> {
        use async_nats::jetstream::object_store::DeleteErrorKind;
        let Some(name) = &self.snapshot_object else {
            return Ok(false);
        };
        match payloads.delete(name).await {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == DeleteErrorKind::NotFound => Ok(false),
            Err(e) => Err(NatsError::js(format!("deleting job snapshot {name}"), e)),
        }
    }
}

/// A [`JobMessage`] carrying its snapshot, borrowed: it writes the same
/// bytes (`an_inline_job_is_the_message_serde_writes`) without cloning the
/// snapshot into an owned message first.
#[derive(Serialize)]
struct InlineJob<'a> {
    job_id: &'a str,
    conversation: &'a str,
    snapshot: &'a SweepSnapshot,
}

/// Publishes a job (storing a large snapshot first); returns the pending
/// acknowledgement so several publishes can be in flight. The job travels
/// with its snapshot when that message is at most `max_inline_bytes`.
pub async fn publish_job(
    js: &Context,
    payloads: &ObjectStore,
    subjects: &Subjects,
    snapshot: &SweepSnapshot,
    max_inline_bytes: usize,
) -> Result<PublishAckFuture, NatsError> {
    let job_id = &snapshot.job.job_id;
    let conversation = &snapshot.conversation;
    let subject = subjects.job(conversation)?;
    let inline = encode(&InlineJob {
        job_id,
        conversation,
        snapshot,
    });
    let message = if inline.len() <= max_inline_bytes {
        inline
    } else {
        let name = snapshot_object_name(job_id);
        // Same name, same content on a republish: overwriting is harmless.
        payloads
            .put(name.as_str(), &mut encode(snapshot).as_slice())
            .await
            .map_err(|e| NatsError::js(format!("storing job snapshot {name}"), e))?;
        encode(&JobMessage {
            job_id: job_id.clone(),
            conversation: conversation.clone(),
            snapshot: None,
            snapshot_object: Some(name),
        })
    };
    Outbound::job(subject, job_id, message)
        .send(js)
        .await
        .map_err(|e| NatsError::js(format!("publishing job {job_id}"), e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::policy::PolicyConfig;
    use crate::testing::fold_test::FoldTest;

    fn a_snapshot() -> SweepSnapshot {
        let policy = PolicyConfig {
            default_context_window: 2_000,
            ..PolicyConfig::default()
        };
        let mut t = FoldTest::new(policy.clone());
        let (job, _) = t.until_job("a-conversation", 0, 1_700_000_000_000);
        let Ok(snapshot) =
            crate::core::sweep::snapshot(t.conversation("a-conversation"), &job, &policy)
        else {
            panic!("no snapshot of the job");
        };
        snapshot
    }

    #[test]
    fn an_inline_job_is_the_message_serde_writes() {
        let snapshot = a_snapshot();
        assert!(!snapshot.items.is_empty());
        let written = encode(&InlineJob {
            job_id: &snapshot.job.job_id,
            conversation: &snapshot.conversation,
            snapshot: &snapshot,
        });
        let derived = encode(&JobMessage {
            job_id: snapshot.job.job_id.clone(),
            conversation: snapshot.conversation.clone(),
            snapshot: Some(snapshot.clone()),
            snapshot_object: None,
        });
        assert_eq!(written, derived);
        let decoded = JobMessage::decode(&written).unwrap();
        assert_eq!(decoded.snapshot.as_ref(), Some(&snapshot));
        assert_eq!(decoded.snapshot_object, None);
    }
}
