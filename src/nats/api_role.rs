//! The API over NATS request/reply (subjects as in [`crate::nats::subjects`]):
//!
//! - `<prefix>.api.<op>.<conversation token>`: the public subjects, one per
//!   operation and conversation, so NATS permissions can scope what a
//!   client may read or compact (docs/subjects.md). The body must name the
//!   subject's conversation. `<prefix>.admin.status` answers for the whole
//!   service, for operators: the answering process asks the owner of each
//!   partition it does not hold for that partition's own status
//!   (`<prefix>.api.p.<partition>.status.~`), adds them up, and names the
//!   partitions nobody answered for (`missing_partitions`). Every API
//!   process joins one queue group on `<prefix>.api.*.*` and
//!   `<prefix>.admin.*`, so each request is answered once. A process that
//!   does not own the conversation forwards the request to
//!   `<prefix>.api.p.<partition>.<op>.<token>` when it knows the partition
//!   count ([`ServiceConfig::forward_partitions`]) and relays the owner's
//!   reply;
//!   otherwise, or when no owner answers, it replies `not_owner` with a
//!   retry hint.
//! - `<prefix>.api.p.<partition>.<op>.<token>`: answered by the partition's owner
//!   ([`start_partition`], started when a lease is won, stopped when it is
//!   lost). These never forward, so a request cannot loop.
//!
//! [`run`] is the API role of `contextfold serve`: the public subjects plus
//! one partition subscription per partition held, reconciled as leases
//! move, over an [`EngineView`] of the folder's engines.
//!
//! `recall` runs a model, so it is not answered from state alone: the
//! owner plans it from the conversation's state ([`crate::api::recall`]),
//! asks the model under the recall deadline ([`ServiceConfig::recall`]),
//! stores the `recall_answered` event carrying the spend in the events
//! stream (on the service subject, deduplicated by its id, so a retried
//! request with the same `request_id` is counted once) and only then
//! answers. A crash before the event is stored loses the answer and its
//! spend record together; the caller retries with the same `request_id`.
//!
//! The operation and conversation come from the subject; the operation is
//! parsed once into [`Op`] and dispatched exhaustively (`Handler::dispatch`),
//! with what it does besides answering: `compact` stores its event, `recall`
//! its spend, a global `status` gathers the other partitions'. The JSON body
//! goes to [`crate::api::answer_view`] on a blocking thread (a regex over a
//! long conversation must not stall the async workers). Error replies also carry
//! the NATS service headers `Nats-Service-Error-Code` and
//! `Nats-Service-Error`, so generic NATS tools see them as errors. A reply
//! too large for the server becomes an error reply: never silence.

use crate::api::{
    answer_view, recall, ApiError, CompactResponse, Held, Op, StatusResponse, Target,
};
pub use crate::api::{LocalState, StateView};
use crate::core::event::{Encoding, Envelope, Origin};
use crate::core::policy::PolicyConfig;
use crate::core::state::{Conversation, State};
use crate::nats::folder::{EngineMap, SharedEngine};
use crate::nats::publish::Outbound;
use crate::nats::replies::{ReplyFamily, ReplyPolicy};
use crate::nats::retry::Backoff;
use crate::nats::subjects::{partition_of, SubjectError, Subjects};
use crate::runtime::recall::{RecallSetupError, Recaller};
use crate::store::KvBackend;
use crate::telemetry::log_excerpt;
use async_nats::jetstream;
use async_nats::{Client, HeaderMap, PublishErrorKind, RequestErrorKind, Subject, Subscriber};
use bytes::Bytes;
use futures::stream::SelectAll;
use futures::StreamExt;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{oneshot, watch, Semaphore};
use tokio::task::{JoinHandle, JoinSet};

/// Default subject prefix.
pub const DEFAULT_PREFIX: &str = "cf";
/// Default queue group every API process joins.
pub const DEFAULT_QUEUE_GROUP: &str = "contextfold-api";

/// How the service subscribes and answers.
#[derive(Debug, Clone)]
pub struct ServiceConfig {
    /// Subjects are `<prefix>.api.<op>.<token>`, `<prefix>.admin.<op>` and
    /// `<prefix>.api.p.<partition>.<op>.<token>`.
    pub prefix: String,
    pub queue_group: String,
    /// `retry_after_ms` sent with `not_owner`.
    pub not_owner_retry_ms: u64,
    /// Requests answered at once; more wait in the subscription.
    pub max_in_flight: usize,
    /// The events stream's partition count: with it, a request for a
    /// conversation this process does not own is forwarded to its owner.
    pub forward_partitions: Option<u32>,
    /// How long a forwarded request may wait for the owner, retries
    /// included (a partition in handover has no owner for a moment).
    pub forward_timeout: Duration,
    /// `compact` stores its `compaction_requested` event in the events
    /// stream (`<prefix>.svc.<conversation>`, the service subject) before answering. Off only
    /// where no events stream exists (tests of the bare service).
    pub publish_compactions: bool,
    /// The model `recall` asks, or why there is none.
    pub recall: RecallService,
    /// The reply subjects answered ([`crate::nats::replies`]): a request
    /// replying anywhere else is refused unanswered and counted.
    pub replies: ReplyPolicy,
}

/// Whether this service answers `recall`.
#[derive(Debug, Clone)]
pub enum RecallService {
    /// Answered with this model.
    On(Arc<Recaller>),
    /// Refused, saying why (no model configured).
    Off(String),
}

impl Default for ServiceConfig {
    fn default() -> Self {
        ServiceConfig {
            prefix: DEFAULT_PREFIX.into(),
            queue_group: DEFAULT_QUEUE_GROUP.into(),
            not_owner_retry_ms: crate::api::DEFAULT_NOT_OWNER_RETRY_MS,
            max_in_flight: 64,
            forward_partitions: None,
            forward_timeout: Duration::from_secs(3),
            publish_compactions: true,
            recall: RecallService::Off(RecallSetupError::NoModel.to_string()),
            replies: ReplyPolicy::default_for(DEFAULT_PREFIX),
        }
    }
}

/// First pause before a forwarded request is asked again (lease handover).
const FORWARD_RETRY_FIRST: Duration = Duration::from_millis(25);
/// Longest pause between forwarding attempts.
const FORWARD_RETRY_MAX: Duration = Duration::from_millis(400);

#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error(transparent)]
    Subject(#[from] SubjectError),
    #[error("invalid queue group {0:?}: it must be non-empty without spaces")]
    QueueGroup(String),
    #[error("`forward_partitions` must be at least 1")]
    Partitions,
    #[error("cannot subscribe to {subject}: {source}")]
    Subscribe {
        subject: String,
        #[source]
        source: async_nats::SubscribeError,
    },
    #[error("cannot reach the NATS server to confirm the subscription: {0}")]
    Flush(#[source] crate::BoxError),
}

/// A running API subscription. Dropping it stops it too, without waiting.
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

/// Where requests come from, and so whether a miss is forwarded.
#[derive(Debug, Clone)]
enum Route {
    Public {
        forward: Option<u32>,
        prefix: String,
        timeout: Duration,
    },
    Partition,
}

/// Serves the public subjects `<prefix>.api.<op>.<token>` and
/// `<prefix>.admin.<op>`. When this returns, the
/// server has the subscription: requests sent from now on are served.
pub async fn start<V: StateView>(
    client: Client,
    view: Arc<V>,
    config: ServiceConfig,
) -> Result<ApiService, ServiceError> {
    let subjects = Subjects::new(&config.prefix)?;
    let filter = vec![subjects.api_wildcard(), subjects.admin_wildcard()];
    if config.forward_partitions == Some(0) {
        return Err(ServiceError::Partitions);
    }
    let route = Route::Public {
        forward: config.forward_partitions,
        prefix: config.prefix.clone(),
        timeout: config.forward_timeout,
    };
    serve(client, view, filter, route, &config).await
}

/// Serves one partition's subjects `<prefix>.api.p.<partition>.<op>`, for
/// the process holding its lease.
pub async fn start_partition<V: StateView>(
    client: Client,
    view: Arc<V>,
    config: ServiceConfig,
    partition: u32,
) -> Result<ApiService, ServiceError> {
    let filter = vec![Subjects::new(&config.prefix)?.api_partition_wildcard(partition)];
    serve(client, view, filter, Route::Partition, &config).await
}

async fn serve<V: StateView>(
    client: Client,
    view: Arc<V>,
    filters: Vec<String>,
    route: Route,
    config: &ServiceConfig,
) -> Result<ApiService, ServiceError> {
    if config.queue_group.is_empty() || config.queue_group.contains(char::is_whitespace) {
        return Err(ServiceError::QueueGroup(config.queue_group.clone()));
    }
    let filter = filters.join(" ");
    let subscriber = subscribe(&client, &filters, &config.queue_group).await?;
    round_trip(&client).await.map_err(ServiceError::Flush)?;
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let subjects = Subjects::new(&config.prefix)?;
    let handler = Arc::new(Handler {
        client,
        view,
        route,
        compactions: config.publish_compactions.then(|| subjects.clone()),
        subjects,
        recall: config.recall.clone(),
        replies: config.replies.clone(),
        retry_ms: config.not_owner_retry_ms,
    });
    tracing::info!(subject = %filter, group = %config.queue_group, "API service started");
    let limit = config.max_in_flight.max(1);
    let task = tokio::spawn(serve_requests(
        handler,
        subscriber,
        stop_rx,
        limit,
        filter.clone(),
    ));
    Ok(ApiService {
        stop: Some(stop_tx),
        task: Some(task),
        filter,
    })
}

/// One queue subscription per filter, merged. Partition subjects join the
/// group too: while a lease moves, old and new owner may both be
/// subscribed for a moment, and one answer is enough.
async fn subscribe(
    client: &Client,
    filters: &[String],
    queue_group: &str,
) -> Result<SelectAll<Subscriber>, ServiceError> {
    let mut subscribers = Vec::with_capacity(filters.len());
    for f in filters {
        subscribers.push(
            client
                .queue_subscribe(f.clone(), queue_group.to_string())
                .await
                .map_err(|source| ServiceError::Subscribe {
                    subject: f.clone(),
                    source,
                })?,
        );
    }
    Ok(futures::stream::select_all(subscribers))
}

/// Takes requests until `stop`, each answered in a task of its own (at
/// most `max_in_flight` at once); then drains the subscription, answers
/// what it already received and flushes the replies.
async fn serve_requests<V: StateView>(
    handler: Arc<Handler<V>>,
    mut subscriber: SelectAll<Subscriber>,
    mut stop: oneshot::Receiver<()>,
    max_in_flight: usize,
    filter: String,
) {
    let limit = Arc::new(Semaphore::new(max_in_flight));
    let mut in_flight = JoinSet::new();
    let mut draining = false;
    loop {
        let message = tokio::select! {
            _ = &mut stop, if !draining => {
                draining = true;
                if !drain(&mut subscriber).await {
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
        let handler = handler.clone();
        in_flight.spawn(async move {
            let _permit = permit;
            handler.handle(message).await;
        });
    }
    while in_flight.join_next().await.is_some() {}
    if let Err(e) = handler.client.flush().await {
        tracing::warn!(error = %e, "cannot flush the last API replies");
    }
    tracing::info!(subject = %filter, "API service stopped");
}

/// Drain: the server stops sending; what it already sent still arrives
/// and is answered. False when a subscription could not be drained.
async fn drain(subscriber: &mut SelectAll<Subscriber>) -> bool {
    let mut drained = true;
    for s in subscriber.iter_mut() {
        if let Err(e) = s.drain().await {
            tracing::warn!(error = %e, "cannot drain the API subscription");
            drained = false;
        }
    }
    drained
}

/// What answering a request of one subscription needs.
struct Handler<V> {
    client: Client,
    view: Arc<V>,
    route: Route,
    /// Where `compact` stores its event; `None`: not stored
    /// ([`ServiceConfig::publish_compactions`]).
    compactions: Option<Subjects>,
    subjects: Subjects,
    recall: RecallService,
    replies: ReplyPolicy,
    /// `retry_after_ms` sent with `not_owner`.
    retry_ms: u64,
}

impl<V: StateView> Handler<V> {
    /// Answers one request: refused unanswered when its reply subject is
    /// no inbox; a partition's own status; or an operation, parsed once
    /// from the subject and [dispatched](Handler::dispatch).
    async fn handle(&self, message: async_nats::Message) {
        let Some(reply) = message.reply else {
            tracing::warn!(subject = %log_excerpt(&message.subject, 200), "API request without a reply subject; nothing to answer to");
            return;
        };
        // Before anything is read or done: a reply subject that is no
        // inbox gets nothing (see crate::nats::replies).
        if let Err(family) = self.replies.admit(reply.as_str(), &self.subjects) {
            self.refuse(&message.subject, &reply, family);
            return;
        }
        if let Some(partition) = self
            .subjects
            .parse_partition_status(message.subject.as_str())
        {
            let result = self.partition_status(partition).await;
            send_reply(&self.client, reply, result).await;
            return;
        }
        let addressed = self
            .subjects
            .parse_api_subject(message.subject.as_str())
            .map_err(|e| ApiError::BadRequest(e.to_string()))
            .and_then(|a| Ok((crate::api::parse_op(&a.op)?, a.conversation)));
        let result = match addressed {
            Ok((op, conversation)) => {
                let result = self
                    .dispatch(op, conversation, message.payload.clone())
                    .await;
                self.forward_not_owned(op, result, message.payload).await
            }
            Err(e) => Err(e),
        };
        match result {
            Ok(Relayed::Owner(headers, payload)) => {
                publish(&self.client, reply, headers, payload, None).await
            }
            Ok(Relayed::Here(result)) => send_reply(&self.client, reply, result).await,
            Err(e) => send_reply(&self.client, reply, Err(e)).await,
        }
    }

    /// Counts a request refused for its reply subject.
    fn refuse(&self, subject: &Subject, reply: &Subject, family: ReplyFamily) {
        let addressed = self.subjects.parse_api_subject(subject.as_str()).ok();
        let op = addressed
            .as_ref()
            .and_then(|a| Op::parse(&a.op))
            .map_or("unknown", Op::as_str);
        let conversation = addressed
            .as_ref()
            .and_then(|a| a.conversation.as_deref())
            .map(|c| log_excerpt(c, 128))
            .unwrap_or_default();
        crate::telemetry::ReplyRefused {
            family: family.as_str(),
            op,
            conversation_id: &conversation,
            reply: &log_excerpt(reply.as_str(), 64),
        }
        .emit();
    }

    /// The answer to one operation, effects included: what the operation
    /// stores before its caller hears of it, and what it gathers from other
    /// processes. Exhaustive, so a new operation does not compile until it
    /// is placed here.
    async fn dispatch(
        &self,
        op: Op,
        conversation: Option<String>,
        body: Bytes,
    ) -> Result<Vec<u8>, ApiError> {
        match op {
            Op::Assemble | Op::Grep | Op::Describe | Op::Expand | Op::History => {
                self.answer_here(op, conversation, body).await
            }
            Op::Status => {
                let global = conversation.is_none();
                let local = self.answer_here(op, conversation, body).await?;
                // The whole service's status: what this process holds, and
                // every other partition from the process that holds it.
                match &self.route {
                    Route::Public {
                        forward: Some(partitions),
                        timeout,
                        ..
                    } if global => {
                        gather_status(&self.client, &self.subjects, local, *partitions, *timeout)
                            .await
                    }
                    Route::Public { .. } | Route::Partition => Ok(local),
                }
            }
            // Effect: the compaction request is stored before the answer.
            Op::Compact => {
                let answer = self.answer_here(op, conversation, body).await?;
                match &self.compactions {
                    Some(subjects) => publish_compaction(&self.client, subjects, &answer).await,
                    None => Ok(answer),
                }
            }
            // Effect: a model call, and its spend stored before the answer.
            Op::Recall => {
                answer_recall(
                    &self.client,
                    &self.subjects,
                    &self.recall,
                    self.view.clone(),
                    conversation,
                    &body,
                    self.retry_ms,
                )
                .await
            }
        }
    }

    /// Answers from the state this process holds, on a blocking thread (a
    /// regex over a long conversation must not stall the async workers).
    async fn answer_here(
        &self,
        op: Op,
        conversation: Option<String>,
        body: Bytes,
    ) -> Result<Vec<u8>, ApiError> {
        let view = self.view.clone();
        let retry_ms = self.retry_ms;
        tokio::task::spawn_blocking(move || {
            let target = match &conversation {
                Some(c) => Target::Conversation(c),
                None => Target::Global,
            };
            answer_view(op, target, &body, view.as_ref(), retry_ms)
        })
        .await
        .unwrap_or_else(|e| Err(ApiError::Internal(format!("the request task failed: {e}"))))
    }

    /// A partition's own status, when this process holds it.
    async fn partition_status(&self, partition: u32) -> Result<Vec<u8>, ApiError> {
        let view = self.view.clone();
        let retry_ms = self.retry_ms;
        tokio::task::spawn_blocking(move || match view.partition_status(partition) {
            Some(status) => status.and_then(|g| {
                serde_json::to_vec(&StatusResponse::Global(Box::new(g)))
                    .map_err(|e| ApiError::Internal(e.to_string()))
            }),
            None => Err(ApiError::NotOwner {
                conversation: String::new(),
                retry_after_ms: retry_ms,
            }),
        })
        .await
        .unwrap_or_else(|e| Err(ApiError::Internal(format!("the request task failed: {e}"))))
    }

    /// A `not_owner` answer on the public subjects, when the partition
    /// count is known, is asked of the owner instead; its reply is relayed
    /// as is.
    async fn forward_not_owned(
        &self,
        op: Op,
        result: Result<Vec<u8>, ApiError>,
        body: Bytes,
    ) -> Result<Relayed, ApiError> {
        match (result, &self.route) {
            (
                Err(ApiError::NotOwner { conversation, .. }),
                Route::Public {
                    forward: Some(partitions),
                    prefix,
                    timeout,
                },
            ) if !conversation.is_empty() => {
                let timeout = self.forward_timeout(op, *timeout);
                let (headers, payload) = forward(
                    &self.client,
                    prefix,
                    *partitions,
                    timeout,
                    op,
                    &conversation,
                    body,
                    self.retry_ms,
                )
                .await?;
                Ok(Relayed::Owner(headers, payload))
            }
            (result, _) => Ok(Relayed::Here(result)),
        }
    }

    /// How long a forwarded request may wait for its owner: a recall waits
    /// on its model, so the owner answers within the recall deadline, not
    /// a state read's.
    fn forward_timeout(&self, op: Op, timeout: Duration) -> Duration {
        match (op, &self.recall) {
            (Op::Recall, RecallService::On(r)) => {
                timeout.max(r.deadline() + Duration::from_secs(5))
            }
            (Op::Recall, RecallService::Off(_))
            | (
                Op::Assemble
                | Op::Status
                | Op::Grep
                | Op::Describe
                | Op::Expand
                | Op::Compact
                | Op::History,
                _,
            ) => timeout,
        }
    }
}

/// Where a request's answer comes from.
enum Relayed {
    /// This process: an answer or an error, to reply with.
    Here(Result<Vec<u8>, ApiError>),
    /// The partition's owner: its reply as is, headers included.
    Owner(HeaderMap, Bytes),
}

/// The global status of the whole service from this process's `local`
/// one: each partition this process does not hold is asked of its owner
/// (`<prefix>.api.p.<p>.status.~`), all at once, each within `timeout`;
/// one that does not answer is named in `missing_partitions`.
async fn gather_status(
    client: &Client,
    subjects: &Subjects,
    local: Vec<u8>,
    partitions: u32,
    timeout: Duration,
) -> Result<Vec<u8>, ApiError> {
    let StatusResponse::Global(local) = serde_json::from_slice(&local)
        .map_err(|e| ApiError::Internal(format!("cannot read this process's status: {e}")))?
    else {
        return Err(ApiError::Internal("a global status was expected".into()));
    };
    let held: Vec<u32> = local.partitions.iter().map(|p| p.partition).collect();
    let others: Vec<u32> = (0..partitions).filter(|p| !held.contains(p)).collect();
    let asks = others.iter().map(|&p| {
        let subject = subjects.partition_status(p);
        async move {
            // Retried through a handover as a forwarded request is.
            let not_owner = || ApiError::NotOwner {
                conversation: String::new(),
                retry_after_ms: 0,
            };
            let (_, payload) = ask_partition(
                client,
                subject,
                Bytes::from_static(b"{}"),
                timeout,
                not_owner,
            )
            .await
            .ok()?;
            match serde_json::from_slice::<StatusResponse>(&payload).ok()? {
                StatusResponse::Global(g) => Some(*g),
                StatusResponse::Conversation(_) => None,
            }
        }
    });
    let answers = futures::future::join_all(asks).await;
    let mut total = *local;
    total.partitions_total = Some(partitions);
    let mut missing = Vec::new();
    for (p, answer) in others.into_iter().zip(answers) {
        match answer {
            Some(g) => total = total.merge(g),
            None => missing.push(p),
        }
    }
    let total = total.missing(missing);
    serde_json::to_vec(&StatusResponse::Global(Box::new(total)))
        .map_err(|e| ApiError::Internal(e.to_string()))
}

/// Returns once the server has processed everything `client` sent before
/// (a subscription, say): a message to a fresh inbox comes back through
/// the connection. `Client::flush` only writes to the socket, and a
/// request from another connection can overtake what is still unread
/// there.
async fn round_trip(client: &Client) -> Result<(), crate::BoxError> {
    let inbox = client.new_inbox();
    let mut back = client.subscribe(inbox.clone()).await?;
    client.publish(inbox, Bytes::new()).await?;
    let limit = client.timeout().unwrap_or(Duration::from_secs(10));
    match tokio::time::timeout(limit, back.next()).await {
        Ok(Some(_)) => Ok(()),
        Ok(None) => Err("the connection closed".into()),
        Err(_) => Err(format!("no answer within {limit:?}").into()),
    }
}

/// Answers `recall` for `conversation` (see the module doc): plans it on
/// the owner's state, asks the model, stores the spend event, replies.
async fn answer_recall<V: StateView>(
    client: &Client,
    subjects: &Subjects,
    recall: &RecallService,
    view: Arc<V>,
    conversation: Option<String>,
    body: &[u8],
    retry_ms: u64,
) -> Result<Vec<u8>, ApiError> {
    let Some(key) = conversation else {
        return Err(ApiError::bad(
            "recall is about one conversation: send it on its conversation's subject",
        ));
    };
    let request: recall::RecallRequest = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad(format!("invalid recall request: {e}")))?;
    if request.conversation != key {
        return Err(ApiError::bad(format!(
            "the request names conversation {:?} but was sent on the subject of {key:?}: send it \
             on its own conversation's subject",
            request.conversation
        )));
    }
    if request.request_id.as_deref().is_none_or(str::is_empty) {
        return Err(ApiError::bad(
            "a recall over NATS needs `request_id` (an idempotency key: a retried request with \
             the same one is answered and counted once)",
        ));
    }
    let recaller = match recall {
        RecallService::On(r) => r.clone(),
        RecallService::Off(why) => {
            return Err(ApiError::bad(format!(
                "this service does not answer recall: {why}"
            )))
        }
    };
    let limits = recaller.limits();
    let prepared = tokio::task::spawn_blocking(move || {
        view.with_state(Some(&key), |held| match held {
            Some(held) => recall::prepare(held.state, held.bodies, held.policy, &request, &limits),
            None => Err(ApiError::NotOwner {
                conversation: key.clone(),
                retry_after_ms: retry_ms,
            }),
        })
    })
    .await
    .unwrap_or_else(|e| Err(ApiError::Internal(format!("the request task failed: {e}"))))?;
    let run = recaller.run(&prepared).await;
    let event = recall::answered_event(&prepared, &run);
    store_event(client, subjects, &event, "the recall's spend").await?;
    let response = recall::response(&prepared, &run, true)?;
    serde_json::to_vec(&response)
        .map_err(|e| ApiError::Internal(format!("cannot encode the recall answer: {e}")))
}

/// Stores an event the service writes for a caller (`what` it is, for the
/// error) in the events stream, on the conversation's service subject:
/// the caller's permission was on the request subject. JetStream
/// deduplicates it by its id, so a retried request is stored once.
async fn store_event(
    client: &Client,
    subjects: &Subjects,
    event: &Envelope,
    what: &str,
) -> Result<(), ApiError> {
    let message = Outbound::event(subjects, Origin::Service, None, event, Encoding::Json)
        .map_err(|e| ApiError::BadRequest(format!("cannot route the conversation: {e}")))?;
    let stored = async { message.send(&jetstream::new(client.clone())).await?.await };
    stored.await.map(drop).map_err(|e| {
        ApiError::Internal(format!(
            "cannot store {what} {} in the events stream: {e}",
            event.id
        ))
    })
}

/// Stores a `compact` answer's event in the events stream (deduplicated by
/// its id, so a retried request is stored once) and marks it published.
async fn publish_compaction(
    client: &Client,
    subjects: &Subjects,
    reply: &[u8],
) -> Result<Vec<u8>, ApiError> {
    let mut response: CompactResponse = serde_json::from_slice(reply)
        .map_err(|e| ApiError::Internal(format!("cannot read the compact answer: {e}")))?;
    store_event(client, subjects, &response.event, "the compaction request").await?;
    response.published = true;
    serde_json::to_vec(&response)
        .map_err(|e| ApiError::Internal(format!("cannot encode the compact answer: {e}")))
}

/// Asks the owner of `conversation`'s partition directly, on
/// `<prefix>.api.p.<partition>.<op>.<token>` (the subjects a public API
/// process forwards to, which the service user may publish), asking again
/// through a lease handover within `timeout`; returns the owner's reply
/// body (an answer, or an API error as JSON). For a client in the service's
/// own process, such as `serve`'s audit page, which needs no permission on
/// the public subjects that way.
pub async fn ask_owner(
    client: &Client,
    prefix: &str,
    partitions: u32,
    timeout: Duration,
    op: Op,
    conversation: &str,
    body: Bytes,
) -> Result<Bytes, ApiError> {
    let retry_ms = crate::api::DEFAULT_NOT_OWNER_RETRY_MS;
    forward(
        client,
        prefix,
        partitions,
        timeout,
        op,
        conversation,
        body,
        retry_ms,
    )
    .await
    .map(|(_, payload)| payload)
}

/// Asks the owner of the conversation's partition and returns its reply
/// as is (headers included); no owner answering is `not_owner`.
#[allow(clippy::too_many_arguments)]
async fn forward(
    client: &Client,
    prefix: &str,
    partitions: u32,
    timeout: Duration,
    op: Op,
    conversation: &str,
    body: Bytes,
    retry_ms: u64,
) -> Result<(HeaderMap, Bytes), ApiError> {
    let not_owner = || ApiError::NotOwner {
        conversation: conversation.to_string(),
        retry_after_ms: retry_ms,
    };
    let partition = partition_of(conversation, partitions)
        .map_err(|e| ApiError::BadRequest(format!("cannot route the conversation: {e}")))?;
    let subject = Subjects::new(prefix)
        .map_err(|e| ApiError::Internal(e.to_string()))?
        .api_for_partition(partition, op, conversation)
        .map_err(|e| ApiError::BadRequest(format!("cannot route the conversation: {e}")))?;
    ask_partition(client, subject, body, timeout, not_owner).await
}

/// Asks whoever holds a partition on its subject `subject` and returns the
/// reply as is (headers included); no owner answering in `timeout` is
/// `not_owner()`.
async fn ask_partition(
    client: &Client,
    subject: String,
    body: Bytes,
    timeout: Duration,
    not_owner: impl Fn() -> ApiError,
) -> Result<(HeaderMap, Bytes), ApiError> {
    // A lease in handover leaves a moment with no owner, or with the old
    // owner still subscribed but no longer holding it: ask again, backing
    // off, within the forward budget, so clients rarely see it.
    let deadline = tokio::time::Instant::now() + timeout;
    let mut backoff = Backoff::up_to(FORWARD_RETRY_FIRST, FORWARD_RETRY_MAX);
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            return Err(not_owner());
        }
        let request = async_nats::Request::new()
            .payload(body.clone())
            .timeout(Some(left));
        match client.send_request(subject.clone(), request).await {
            Ok(message) => {
                let moving = message
                    .headers
                    .as_ref()
                    .and_then(|h| h.get("Nats-Service-Error-Code"))
                    .is_some_and(|v| v.as_str() == "503");
                if !moving {
                    return Ok((message.headers.unwrap_or_default(), message.payload));
                }
                tracing::debug!(%subject, "the partition's subscriber no longer holds it");
            }
            Err(e) => match e.kind() {
                RequestErrorKind::NoResponders => {
                    tracing::debug!(%subject, "no owner answers this partition now");
                }
                RequestErrorKind::TimedOut => {
                    tracing::warn!(%subject, ?timeout, "the partition's owner did not answer in time");
                    return Err(not_owner());
                }
                RequestErrorKind::MaxPayloadExceeded => {
                    return Err(ApiError::BadRequest(format!(
                        "the request is larger than the NATS server's max_payload of {} bytes",
                        client.server_info().max_payload
                    )))
                }
                _ => {
                    tracing::warn!(%subject, error = %e, "forwarding an API request failed");
                    return Err(not_owner());
                }
            },
        }
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        tokio::time::sleep(backoff.next_delay().min(left)).await;
    }
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
    let headers = headers_for(error.as_ref());
    publish(client, reply, headers, body.into(), error.as_ref()).await;
}

async fn publish(
    client: &Client,
    reply: Subject,
    headers: HeaderMap,
    body: Bytes,
    error: Option<&ApiError>,
) {
    let size = body.len();
    let Err(e) = client
        .publish_with_headers(reply.clone(), headers, body)
        .await
    else {
        return;
    };
    // The caller must never be left waiting: a reply the server cannot
    // carry becomes an error reply that says what to ask instead.
    let fallback = if e.kind() == PublishErrorKind::MaxPayloadExceeded && error.is_none() {
        ApiError::BadRequest(format!(
            "the reply of {size} bytes exceeds the NATS server's max_payload of {} bytes; ask for less (a lower assemble `budget`, grep `limit`, expand `max_tokens` or history `limit`) or raise the server's `max_payload`",
            client.server_info().max_payload
        ))
    } else {
        ApiError::Internal(format!("cannot publish the reply: {e}"))
    };
    if let Err(e) = client
        .publish_with_headers(
            reply,
            headers_for(Some(&fallback)),
            fallback.to_json().into(),
        )
        .await
    {
        tracing::error!(error = %e, "cannot publish an API error reply");
    }
}

/// The engines of the partitions a process folds, as the API needs them.
pub trait HeldEngines: Send + Sync + 'static {
    type Backend: KvBackend + 'static;
    /// The engine of `partition` while its lease is held.
    fn engine(&self, partition: u32) -> Option<SharedEngine<Self::Backend>>;
    /// Partitions held now, ascending.
    fn held(&self) -> Vec<u32>;
    /// How a held partition is doing.
    fn health(&self, _partition: u32) -> Option<crate::api::status::PartitionHealth> {
        None
    }
}

impl<B: KvBackend + Sync + 'static> HeldEngines for EngineMap<B> {
    type Backend = B;
    fn engine(&self, partition: u32) -> Option<SharedEngine<B>> {
        self.get(partition)
    }
    fn held(&self) -> Vec<u32> {
        self.partitions()
    }
    fn health(&self, partition: u32) -> Option<crate::api::status::PartitionHealth> {
        EngineMap::health(self, partition)
    }
}

/// A [`StateView`] over the folder's engines: a conversation is owned when
/// its partition's lease is held here.
pub struct EngineView<H: HeldEngines> {
    engines: H,
    partitions: u32,
    /// For keys no partition can hold (empty, too long): answered from an
    /// empty state, so the caller hears what is wrong with the key.
    policy: PolicyConfig,
}

impl<H: HeldEngines> EngineView<H> {
    pub fn new(engines: H, partitions: u32, policy: PolicyConfig) -> Self {
        EngineView {
            engines,
            partitions: partitions.max(1),
            policy,
        }
    }

    pub fn held(&self) -> Vec<u32> {
        self.engines.held()
    }
}

impl<H: HeldEngines> StateView for EngineView<H> {
    fn partitions(&self) -> Vec<crate::api::status::PartitionHealth> {
        self.engines
            .held()
            .into_iter()
            .filter_map(|p| {
                let mut health = self.engines.health(p)?;
                // The partition-wide spend window is the partition's own:
                // the merged global view has none.
                if let Some(engine) = self.engines.engine(p) {
                    let engine = engine.lock().unwrap_or_else(|p| p.into_inner());
                    health.spend_window =
                        crate::api::status::partition_window(&engine.state, &engine.policy);
                }
                Some(health)
            })
            .collect()
    }

    #[allow(clippy::expect_used)] // only a bug reaches the expect (see its message)
    fn with_state<R>(
        &self,
        conversation: Option<&str>,
        f: impl FnOnce(Option<Held<'_>>) -> R,
    ) -> R {
        match conversation {
            Some(key) => {
                let Ok(partition) = partition_of(key, self.partitions) else {
                    return f(Some(Held::resident(&State::default(), &self.policy)));
                };
                match self.engines.engine(partition) {
                    Some(engine) => {
                        // The folder holds this lock for one batch at most;
                        // a conversation not resident is read for this
                        // request only (one head, its chunks).
                        let engine = engine.lock().unwrap_or_else(|p| p.into_inner());
                        let policy = &engine.policy;
                        let mut f = Some(f);
                        let answered = engine.with_conversation(key, |state, bodies| {
                            let f = f.take().expect("called once");
                            f(Some(Held {
                                state,
                                bodies,
                                policy,
                            }))
                        });
                        match answered {
                            Ok(r) => r,
                            Err(e) => {
                                // The store failed to read it: answer from an
                                // empty state, and say why in the log.
                                tracing::error!(conversation_id = key, error = %e, "cannot read a conversation for the API");
                                let f = f.take().expect("not called on error");
                                f(Some(Held::resident(&State::default(), &self.policy)))
                            }
                        }
                    }
                    None => f(None),
                }
            }
            None => {
                // The global view: every held partition's own counts in one
                // state; conversations come through `each_conversation`.
                let mut merged = State::default();
                let mut policy = self.policy.clone();
                for partition in self.engines.held() {
                    let Some(engine) = self.engines.engine(partition) else {
                        continue;
                    };
                    let engine = engine.lock().unwrap_or_else(|p| p.into_inner());
                    policy = engine.policy.clone();
                    merged.unattributed_rejections += engine.state.unattributed_rejections;
                }
                f(Some(Held::resident(&merged, &policy)))
            }
        }
    }

    fn partition_status(
        &self,
        partition: u32,
    ) -> Option<Result<crate::api::status::GlobalStatus, ApiError>> {
        let mut health = self.engines.health(partition)?;
        let engine = self.engines.engine(partition)?;
        let engine = engine.lock().unwrap_or_else(|p| p.into_inner());
        health.spend_window = crate::api::status::partition_window(&engine.state, &engine.policy);
        let status =
            crate::api::status::global_status_with(&engine.state, &engine.policy, |each| {
                engine.each_conversation(|state, conv| each(state, conv))
            });
        Some(status.map(|g| crate::api::status::with_partitions(g, vec![health])))
    }

    fn each_conversation(
        &self,
        f: &mut dyn FnMut(&State, &Conversation) -> Result<(), ApiError>,
    ) -> Result<(), ApiError> {
        // One partition lock at a time, so no folder waits on another's;
        // global status is rare.
        for partition in self.engines.held() {
            let Some(engine) = self.engines.engine(partition) else {
                continue;
            };
            let engine = engine.lock().unwrap_or_else(|p| p.into_inner());
            engine.each_conversation(|state, conv| f(state, conv))?;
        }
        Ok(())
    }
}

/// How often [`run`] looks at the held partitions.
pub const RECONCILE_EVERY: Duration = Duration::from_millis(250);

/// The API role: serves the public subjects (forwarding what this process
/// does not own when `config.forward_partitions` is set) and one partition
/// subscription per partition `held()` returns, started and stopped as
/// leases move, until `shutdown` turns true; then answers what it already
/// received and returns.
pub async fn run<V: StateView>(
    client: Client,
    view: Arc<V>,
    config: ServiceConfig,
    held: impl Fn() -> Vec<u32> + Send + 'static,
    mut shutdown: watch::Receiver<bool>,
) -> Result<(), ServiceError> {
    let public = start(client.clone(), view.clone(), config.clone()).await?;
    let mut owned: BTreeMap<u32, ApiService> = BTreeMap::new();
    let mut tick = tokio::time::interval(RECONCILE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        if *shutdown.borrow() {
            break;
        }
        tokio::select! {
            changed = shutdown.changed() => {
                if changed.is_err() {
                    break;
                }
                continue;
            }
            _ = tick.tick() => {}
        }
        let now: Vec<u32> = held();
        let gone: Vec<u32> = owned.keys().filter(|p| !now.contains(p)).copied().collect();
        for p in gone {
            if let Some(service) = owned.remove(&p) {
                service.stop().await;
                tracing::info!(
                    partition = p,
                    "API stopped answering for a partition no longer held"
                );
            }
        }
        for p in now {
            if owned.contains_key(&p) {
                continue;
            }
            match start_partition(client.clone(), view.clone(), config.clone(), p).await {
                Ok(service) => {
                    owned.insert(p, service);
                }
                // Retried at the next tick; meanwhile the public subjects
                // answer (or say not_owner).
                Err(e) => {
                    tracing::warn!(partition = p, error = %e, "cannot serve the partition's API subjects")
                }
            }
        }
    }
    public.stop().await;
    for (_, service) in std::mem::take(&mut owned) {
        service.stop().await;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Engines held by partition, as the folder would hold them.
    struct FakeHeld(BTreeMap<u32, SharedEngine<crate::store::memory_backend::MemoryBackend>>);

    impl HeldEngines for FakeHeld {
        type Backend = crate::store::memory_backend::MemoryBackend;
        fn engine(&self, partition: u32) -> Option<SharedEngine<Self::Backend>> {
            self.0.get(&partition).cloned()
        }
        fn held(&self) -> Vec<u32> {
            self.0.keys().copied().collect()
        }
    }

    fn engine_with(
        state: State,
        policy: &PolicyConfig,
    ) -> SharedEngine<crate::store::memory_backend::MemoryBackend> {
        let mut engine = crate::runtime::engine::Engine::open(
            crate::store::memory_backend::MemoryBackend::default(),
            policy.clone(),
        )
        .unwrap();
        engine.state = state;
        Arc::new(std::sync::Mutex::new(engine))
    }

    #[test]
    fn the_engine_view_owns_exactly_the_held_partitions() {
        use crate::api::testing::{self, CONV};
        let (state, policy) = testing::folded();
        let p = partition_of(CONV, 16).unwrap();
        let mut other = State::default();
        let mut c = testing::conv(state).clone();
        let other_key = (0..)
            .map(|i| format!("other-{i}"))
            .find(|k| partition_of(k, 16).unwrap() != p)
            .unwrap();
        c.key = other_key.clone();
        other.conversations.insert(other_key.clone(), c);
        other.unattributed_rejections = 1;
        let q = partition_of(&other_key, 16).unwrap();
        let view = EngineView::new(
            FakeHeld(BTreeMap::from([
                (p, engine_with(state.clone(), policy)),
                (q, engine_with(other, policy)),
            ])),
            16,
            policy.clone(),
        );
        assert_eq!(view.held().len(), 2);
        let owned = |key: &str| {
            view.with_state(Some(key), |s| {
                s.map(|h| h.state.conversations.contains_key(key))
            })
        };
        assert_eq!(owned(CONV), Some(true));
        assert_eq!(owned(&other_key), Some(true));
        // A key whose partition is not held here: not owned.
        let stranger = (0..)
            .map(|i| format!("stranger-{i}"))
            .find(|k| ![p, q].contains(&partition_of(k, 16).unwrap()))
            .unwrap();
        assert_eq!(owned(&stranger), None);
        // An empty key belongs to no partition: answered (as a bad request).
        let reply = crate::api::handle_view(
            "status",
            crate::api::Target::Conversation(""),
            br#"{"conversation":""}"#,
            &view,
            100,
        );
        assert!(String::from_utf8_lossy(&reply).contains("bad_request"));
        // The global view merges every held partition.
        let rejected = view.with_state(None, |s| s.unwrap().state.unattributed_rejections);
        let mut n = 0;
        view.each_conversation(&mut |_, _| {
            n += 1;
            Ok(())
        })
        .unwrap();
        assert_eq!((n, rejected), (2, 1));
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
