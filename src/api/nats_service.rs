//! The API over NATS request/reply: one queue-group subscription on
//! `<prefix>.api.*` (so any number of processes share the requests and each
//! is answered once), the operation taken from the last subject token, the
//! JSON body handed to [`crate::api::answer_view`] on a blocking thread,
//! and the reply published to the request's reply subject. Error replies
//! also carry the NATS service headers `Nats-Service-Error-Code` and
//! `Nats-Service-Error`, so generic NATS tools see them as errors.
//!
//! A request for a conversation this process does not own gets `not_owner`
//! with a retry hint; routing requests to the owner is the runtime's job
//! (partition-specific subjects or forwarding), not this module's.

use crate::api::{answer_view, ApiError};
pub use crate::api::{LocalState, Op, StateView};
use async_nats::{Client, HeaderMap, PublishErrorKind, Subject};
use futures::StreamExt;
use std::sync::Arc;
use tokio::sync::{oneshot, Semaphore};
use tokio::task::{JoinHandle, JoinSet};

/// Default subject prefix.
pub const DEFAULT_PREFIX: &str = "cf";
/// Default queue group every API process joins.
pub const DEFAULT_QUEUE_GROUP: &str = "contextfold-api";

/// How the service subscribes and answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceConfig {
    /// Subjects are `<prefix>.api.<op>`.
    pub prefix: String,
    pub queue_group: String,
    /// `retry_after_ms` sent with `not_owner`.
    pub not_owner_retry_ms: u64,
    /// Requests answered at once; more wait in the subscription.
    pub max_in_flight: usize,
}

impl Default for ServiceConfig {
    fn default() -> Self {
        ServiceConfig {
            prefix: DEFAULT_PREFIX.into(),
            queue_group: DEFAULT_QUEUE_GROUP.into(),
            not_owner_retry_ms: crate::api::DEFAULT_NOT_OWNER_RETRY_MS,
            max_in_flight: 64,
        }
    }
}

/// The subject an operation is served on.
pub fn subject(prefix: &str, op: Op) -> String {
    format!("{prefix}.api.{}", op.as_str())
}

/// The subscription filter covering every operation.
pub fn subject_filter(prefix: &str) -> String {
    format!("{prefix}.api.*")
}

#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error("invalid API subject prefix {prefix:?}: {why}")]
    Prefix { prefix: String, why: &'static str },
    #[error("invalid queue group {0:?}: it must be non-empty without spaces")]
    QueueGroup(String),
    #[error("cannot subscribe to {subject}: {detail}")]
    Subscribe { subject: String, detail: String },
    #[error("cannot reach the NATS server to confirm the subscription: {0}")]
    Flush(String),
}

/// Checks a subject prefix: dot-separated non-empty tokens, no wildcards,
/// no whitespace.
pub fn validate_prefix(prefix: &str) -> Result<(), ServiceError> {
    let why = if prefix.is_empty() {
        Some("it is empty")
    } else if prefix.split('.').any(str::is_empty) {
        Some("it has an empty token (leading, trailing or double dot)")
    } else if prefix.contains(['*', '>']) {
        Some("it contains a wildcard")
    } else if prefix.chars().any(|c| c.is_whitespace() || c.is_control()) {
        Some("it contains whitespace")
    } else {
        None
    };
    match why {
        Some(why) => Err(ServiceError::Prefix {
            prefix: prefix.to_string(),
            why,
        }),
        None => Ok(()),
    }
}

/// A running API service. Dropping it stops it too, without waiting.
pub struct ApiService {
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
    filter: String,
}

impl ApiService {
    /// The subscription filter it serves.
    pub fn subject_filter(&self) -> &str {
        &self.filter
    }

    /// Stops taking requests, answers the ones already received, and
    /// returns when every reply is published.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            if let Err(e) = task.await {
                tracing::error!(error = %e, "API service task failed");
            }
        }
    }
}

impl Drop for ApiService {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Subscribes and starts answering. When this returns, the server has the
/// subscription: requests sent from now on are served.
pub async fn start<V: StateView>(
    client: Client,
    view: Arc<V>,
    config: ServiceConfig,
) -> Result<ApiService, ServiceError> {
    validate_prefix(&config.prefix)?;
    if config.queue_group.is_empty() || config.queue_group.contains(char::is_whitespace) {
        return Err(ServiceError::QueueGroup(config.queue_group));
    }
    let filter = subject_filter(&config.prefix);
    let mut subscriber = client
        .queue_subscribe(filter.clone(), config.queue_group.clone())
        .await
        .map_err(|e| ServiceError::Subscribe {
            subject: filter.clone(),
            detail: e.to_string(),
        })?;
    client
        .flush()
        .await
        .map_err(|e| ServiceError::Flush(e.to_string()))?;
    let (stop_tx, mut stop_rx) = oneshot::channel::<()>();
    let op_prefix = format!("{}.api.", config.prefix);
    let limit = Arc::new(Semaphore::new(config.max_in_flight.max(1)));
    let retry_ms = config.not_owner_retry_ms;
    tracing::info!(subject = %filter, group = %config.queue_group, "API service started");
    let task = tokio::spawn(async move {
        let mut in_flight = JoinSet::new();
        let mut draining = false;
        loop {
            let message = tokio::select! {
                _ = &mut stop_rx, if !draining => {
                    draining = true;
                    // Drain: the server stops sending; what it already
                    // sent still arrives and is answered.
                    if let Err(e) = subscriber.drain().await {
                        tracing::warn!(error = %e, "cannot drain the API subscription");
                        break;
                    }
                    continue;
                }
                message = subscriber.next() => message,
            };
            let Some(message) = message else { break };
            while in_flight.try_join_next().is_some() {}
            let Ok(permit) = limit.clone().acquire_owned().await else {
                break;
            };
            let client = client.clone();
            let view = view.clone();
            let op = message
                .subject
                .as_str()
                .strip_prefix(&op_prefix)
                .unwrap_or_default()
                .to_string();
            in_flight.spawn(async move {
                let _permit = permit;
                let Some(reply) = message.reply else {
                    tracing::warn!(subject = %message.subject, "API request without a reply subject; nothing to answer to");
                    return;
                };
                let body = message.payload;
                let result = tokio::task::spawn_blocking(move || {
                    answer_view(&op, &body, view.as_ref(), retry_ms)
                })
                .await
                .unwrap_or_else(|e| {
                    Err(ApiError::Internal(format!("the request task failed: {e}")))
                });
                send_reply(&client, reply, result).await;
            });
        }
        while in_flight.join_next().await.is_some() {}
        if let Err(e) = client.flush().await {
            tracing::warn!(error = %e, "cannot flush the last API replies");
        }
        tracing::info!("API service stopped");
    });
    Ok(ApiService {
        stop: Some(stop_tx),
        task: Some(task),
        filter,
    })
}

fn headers_for(error: Option<&ApiError>) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert("Content-Type", "application/json");
    if let Some(e) = error {
        headers.insert(
            "Nats-Service-Error-Code",
            e.code().status().to_string().as_str(),
        );
        // Header values are one line of printable text.
        let message: String = e
            .to_string()
            .chars()
            .map(|c| if c.is_control() { ' ' } else { c })
            .collect();
        headers.insert("Nats-Service-Error", message.as_str());
    }
    headers
}

async fn send_reply(client: &Client, reply: Subject, result: Result<Vec<u8>, ApiError>) {
    let (body, error) = match result {
        Ok(body) => (body, None),
        Err(e) => (e.to_json(), Some(e)),
    };
    let size = body.len();
    let first = client
        .publish_with_headers(reply.clone(), headers_for(error.as_ref()), body.into())
        .await;
    let Err(e) = first else { return };
    // The caller must never be left waiting: a reply the server cannot
    // carry becomes an error reply that says what to ask instead.
    let error = if e.kind() == PublishErrorKind::MaxPayloadExceeded {
        ApiError::BadRequest(format!(
            "the reply of {size} bytes exceeds the NATS server's max_payload of {} bytes; ask for less (a lower grep `limit`, expand `max_tokens`, history `limit`)",
            client.server_info().max_payload
        ))
    } else {
        ApiError::Internal(format!("cannot publish the reply: {e}"))
    };
    if let Err(e) = client
        .publish_with_headers(reply, headers_for(Some(&error)), error.to_json().into())
        .await
    {
        tracing::error!(error = %e, "cannot publish an API error reply");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_and_prefixes() {
        assert_eq!(subject("cf", Op::Grep), "cf.api.grep");
        assert_eq!(subject_filter("team.cf"), "team.cf.api.*");
        assert!(validate_prefix("cf").is_ok());
        assert!(validate_prefix("team.cf").is_ok());
        for bad in ["", "cf.", ".cf", "a..b", "cf.*", "c>", "c f"] {
            assert!(validate_prefix(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn error_headers_are_one_line() {
        let e = ApiError::BadRequest("line one\nline two".into());
        let h = headers_for(Some(&e));
        assert_eq!(
            h.get("Nats-Service-Error-Code").map(|v| v.as_str()),
            Some("400")
        );
        assert_eq!(
            h.get("Nats-Service-Error").map(|v| v.as_str()),
            Some("line one line two")
        );
        assert!(headers_for(None).get("Nats-Service-Error").is_none());
    }
}
