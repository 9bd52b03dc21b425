//! Where the gateway's turns go and where its summary blocks come from.
//!
//! Two backends. **Embedded** (the default): one thread owns the embedded
//! pipeline (`runtime::embedded::Pipeline`, segment log + redb state under
//! the data directory); turns arrive on a channel, are ingested in batches
//! (one fsync and one state commit a batch), and the summary block of
//! every conversation a batch touched is rebuilt. Jobs the fold issues run
//! right there with the deterministic summarizer, or, with `[summarizer]`
//! configured, beside the fold with the model (`sweeper.rs`), their
//! results folded as they finish. **NATS**: turns are
//! published to `cf.in.<conversation>` with `Nats-Msg-Id` = the event id
//! (`nats::publish`); a failed publish is spooled (`spool.rs`); the block
//! is rebuilt from the deployment's `assemble` answer after each publish.
//!
//! The request path never waits on either: it reads the last block built
//! (`Blocks`), which changes only when the summaries in context change.
//! A crash loses what is in the channel (the client's retry republishes
//! it under the same ids) and nothing the log holds.

use crate::api::{self, AssembleRequest, AssembleResponse};
use crate::config::Config;
use crate::core::assembly::{summary_message, Source};
use crate::core::event::{Envelope, Origin, EMBEDDED_PARTITION_KEY};
use crate::core::message::{ChatMessage, Role};
use crate::core::state::{ContextItem, TurnBodies};
use crate::core::tokens;
use crate::gateway::spool::Spool;
use crate::gateway::surface::{message_digest, Surface, SUMMARY_MARKER};
use crate::gateway::sweeper::{SweepDone, Sweeper};
use crate::log::EventLog;
use crate::nats::publish::{self, Publisher};
use crate::runtime::embedded::Pipeline;
use crate::runtime::engine::Engine;
use crate::store::state_store::{BodyCache, StateStore};
use crate::store::KvBackend;
use crate::summarizer::{DeterministicSummarizer, Summarizer};
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// The summaries in a conversation's context, rendered once, the same on
/// every replica: what replaces the history they cover.
#[derive(Debug)]
pub struct SummaryBlock {
    pub conversation: String,
    /// The summaries' ids, in context order.
    pub summary_ids: Vec<String>,
    /// The block's text (module doc of `assembly.rs`).
    pub text: String,
    pub tokens: u64,
    /// Identity digests of the first turns in context after the summaries:
    /// where the client's history is taken up verbatim.
    pub tail_digests: Vec<[u8; 16]>,
    /// The item inserted, per surface (JSON), serialized once.
    pub chat_item: String,
    pub messages_item: String,
    pub responses_item: String,
}

impl SummaryBlock {
    /// Builds the block from the summary messages (as `assemble` renders
    /// them) and the first turns after them.
    pub fn new(
        conversation: &str,
        ids: Vec<String>,
        summaries: &[String],
        tail: &[ChatMessage],
    ) -> SummaryBlock {
        let mut text = format!(
            "{SUMMARY_MARKER}{conversation}\">\nThe earlier part of this conversation is summarized below (contextfold keeps every turn; the turns after this block follow verbatim).\n"
        );
        for s in summaries {
            text.push('\n');
            text.push_str(s);
            text.push('\n');
        }
        text.push_str("</contextfold_summary>");
        let tokens = tokens::count_text(tokens::Encoding::O200kBase, &text)
            + tokens::MESSAGE_OVERHEAD_TOKENS;
        let chat_item = serde_json::json!({"role": "user", "content": text}).to_string();
        let messages_item =
            serde_json::json!({"role": "user", "content": [{"type": "text", "text": text}]})
                .to_string();
        let responses_item = serde_json::json!({
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": text}],
        })
        .to_string();
        SummaryBlock {
            conversation: conversation.to_string(),
            summary_ids: ids,
            text,
            tokens,
            tail_digests: tail.iter().map(message_digest).collect(),
            chat_item,
            messages_item,
            responses_item,
        }
    }

    pub fn item(&self, surface: Surface) -> &str {
        match surface {
            Surface::Chat => &self.chat_item,
            Surface::Messages => &self.messages_item,
            Surface::Responses => &self.responses_item,
        }
    }
}

/// The last block of each conversation.
#[derive(Default)]
pub struct Blocks(RwLock<HashMap<String, Arc<SummaryBlock>>>);

impl Blocks {
    pub fn get(&self, conversation: &str) -> Option<Arc<SummaryBlock>> {
        self.0
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(conversation)
            .cloned()
    }
    /// Sets the block; returns whether it changed (different summaries).
    fn set(&self, block: Option<SummaryBlock>, conversation: &str) -> bool {
        let mut map = self.0.write().unwrap_or_else(|p| p.into_inner());
        match block {
            None => map.remove(conversation).is_some(),
            Some(b) => {
                let changed = map.get(conversation).is_none_or(|old| {
                    old.summary_ids != b.summary_ids || old.tail_digests != b.tail_digests
                });
                if changed {
                    map.insert(conversation.to_string(), Arc::new(b));
                }
                changed
            }
        }
    }
}

/// Turns of the first context items after the summaries kept in a block.
const TAIL_DIGESTS: usize = 3;

/// The block of a conversation as the state holds it.
fn block_from_state(
    conv: &crate::core::state::Conversation,
    bodies: &dyn TurnBodies,
) -> Option<SummaryBlock> {
    let mut ids = Vec::new();
    let mut texts = Vec::new();
    let mut tail = Vec::new();
    for item in conv.context.iter() {
        match *item {
            ContextItem::Summary(i) => {
                if !tail.is_empty() {
                    break;
                }
                let s = conv.summaries.get(i as usize)?;
                let text = bodies.summary_text(conv, i).ok()?;
                let m =
                    summary_message(&s.id, s.depth, s.first_turn, s.last_turn, s.fallback, &text);
                ids.push(s.id.clone());
                texts.push(m.text_content());
            }
            ContextItem::Turn(seq) => {
                if ids.is_empty() {
                    return None;
                }
                let Some(turn) = conv.turns.get(seq as usize) else {
                    continue;
                };
                if !turn.in_context {
                    continue;
                }
                tail.push(bodies.turn_body(conv, seq).ok()?.message.clone());
                if tail.len() >= TAIL_DIGESTS {
                    break;
                }
            }
        }
    }
    if ids.is_empty() {
        return None;
    }
    Some(SummaryBlock::new(&conv.key, ids, &texts, &tail))
}

/// The block of a conversation from an `assemble` answer (NATS mode):
/// the same summary messages, the same turns after them.
pub fn block_from_assembled(reply: &AssembleResponse) -> Option<SummaryBlock> {
    let mut ids = Vec::new();
    let mut texts = Vec::new();
    let mut tail = Vec::new();
    for (m, s) in reply
        .assembled
        .messages
        .iter()
        .zip(&reply.assembled.sources)
    {
        match s {
            Source::Summary { id, .. } if tail.is_empty() => {
                ids.push(id.clone());
                texts.push(m.text_content());
            }
            Source::Turn { .. } if !ids.is_empty() => {
                tail.push(m.clone());
                if tail.len() >= TAIL_DIGESTS {
                    break;
                }
            }
            _ => {}
        }
    }
    if ids.is_empty() {
        return None;
    }
    Some(SummaryBlock::new(&reply.conversation, ids, &texts, &tail))
}

/// Where the embedded store runs the jobs its fold issues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sweeps {
    /// Each before the batch that issued it is answered: the deterministic
    /// summarizer, which takes milliseconds.
    Inline,
    /// Beside the fold, a few at a time (`sweeper.rs`): a model, which
    /// takes seconds to minutes.
    Beside,
}

/// A batch of turns for the store.
enum Command {
    Publish(Vec<Envelope>),
    /// Answered when everything sent before it is stored.
    Flush(oneshot::Sender<()>),
    /// Stores what was sent before, closes the store, then answers.
    Close(oneshot::Sender<()>),
}

/// Counts of the store, for `/readyz`, doctor and tests.
#[derive(Debug, Default)]
pub struct StoreHealth {
    /// Turns handed to the store.
    pub handed: std::sync::atomic::AtomicU64,
    /// Turns stored.
    pub published: std::sync::atomic::AtomicU64,
    pub failed: std::sync::atomic::AtomicU64,
    pub reachable: std::sync::atomic::AtomicBool,
}

/// The gateway's store handle.
pub struct Store {
    tx: mpsc::UnboundedSender<Command>,
    pub blocks: Arc<Blocks>,
    pub health: Arc<StoreHealth>,
    pub kind: &'static str,
    pub spool: Option<Arc<Spool>>,
    /// The NATS connection, whose state says at once when NATS is away.
    client: Option<async_nats::Client>,
}

impl Store {
    /// Hands turns to the store; never waits.
    pub fn publish(&self, events: Vec<Envelope>) {
        if events.is_empty() {
            return;
        }
        let n = events.len();
        self.health
            .handed
            .fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
        if self.tx.send(Command::Publish(events)).is_err() {
            self.health
                .failed
                .fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Waits until everything handed over so far is stored (tests, shutdown).
    pub async fn flush(&self) {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Command::Flush(tx)).is_ok() {
            let _ = rx.await;
        }
    }

    /// Stores everything handed over, then closes the store (the embedded
    /// state store is closed cleanly); later turns are refused.
    pub async fn close(&self) {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Command::Close(tx)).is_ok() {
            let _ = rx.await;
        }
    }

    /// Turns handed over and neither stored, spooled nor refused yet.
    pub fn pending(&self) -> u64 {
        use std::sync::atomic::Ordering::Relaxed;
        let done = self.health.published.load(Relaxed) + self.health.failed.load(Relaxed);
        self.health.handed.load(Relaxed).saturating_sub(done)
    }

    pub fn reachable(&self) -> bool {
        let connected = self
            .client
            .as_ref()
            .is_none_or(|c| c.connection_state() == async_nats::connection::State::Connected);
        connected
            && self
                .health
                .reachable
                .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The embedded store under `config.data_dir` (segment log + redb),
    /// summarizing with the model `[summarizer]` names, else with the
    /// deterministic summarizer.
    pub fn embedded(config: &Config) -> Result<Store, std::io::Error> {
        match &config.summarizer {
            None => Self::embedded_with(config, Arc::new(DeterministicSummarizer), Sweeps::Inline),
            Some(cfg) if cfg.external.is_some() => Err(std::io::Error::other(
                "summarizer.external asks a team's summarizer over NATS: run the gateway with --nats (a deployment), or remove [summarizer.external]",
            )),
            Some(cfg) => {
                let stack = crate::summarizer::stack::model(cfg)
                    .map_err(|e| std::io::Error::other(format!("the model summarizer: {e}")))?;
                Self::embedded_with(config, Arc::new(stack), Sweeps::Beside)
            }
        }
    }

    /// The embedded store with `summarizer`, its jobs run as `sweeps` says.
    pub fn embedded_with<S: Summarizer + 'static>(
        config: &Config,
        summarizer: Arc<S>,
        sweeps: Sweeps,
    ) -> Result<Store, std::io::Error> {
        let config = config.clone();
        std::fs::create_dir_all(&config.data_dir)?;
        let open = move || -> Result<_, String> {
            let log = crate::log::segment::SegmentLog::open(&config.data_dir.join("log"))
                .map_err(|e| format!("opening the event log: {e}"))?;
            let backend = crate::store::redb_backend::RedbBackend::open_with_cache(
                &config.data_dir.join("state.redb"),
                usize::try_from(config.store.redb_cache_bytes).unwrap_or(usize::MAX),
            )
            .map_err(|e| format!("opening the state store: {e}"))?;
            let store = StateStore::with_cache(
                backend,
                Arc::new(BodyCache::new(config.store.body_cache_bytes)),
            );
            let mut engine = Engine::open_with(store, config.policy.clone())
                .map_err(|e| format!("opening the engine: {e}"))?;
            engine.set_flush_every(config.store.flush_every);
            engine.set_residency(config.store.residency());
            engine.record_policy_as(EMBEDDED_PARTITION_KEY.into(), "embedded");
            Ok((log, engine))
        };
        Self::spawn_embedded(open, summarizer, sweeps)
    }

    /// The embedded pipeline in memory (tests and benchmarks).
    pub fn in_memory(policy: crate::core::policy::PolicyConfig) -> Result<Store, std::io::Error> {
        let open = move || -> Result<_, String> {
            let engine = Engine::open(
                crate::store::memory_backend::MemoryBackend::default(),
                policy,
            )
            .map_err(|e| e.to_string())?;
            Ok((crate::log::memory::MemoryLog::new(), engine))
        };
        Self::spawn_embedded(open, Arc::new(DeterministicSummarizer), Sweeps::Inline)
    }

    fn spawn_embedded<L, B, S, F>(
        open: F,
        summarizer: Arc<S>,
        sweeps: Sweeps,
    ) -> Result<Store, std::io::Error>
    where
        L: EventLog + 'static,
        B: KvBackend + 'static,
        S: Summarizer + 'static,
        F: FnOnce() -> Result<(L, Engine<B>), String> + Send + 'static,
    {
        let (tx, rx) = mpsc::unbounded_channel();
        let blocks = Arc::new(Blocks::default());
        let health = Arc::new(StoreHealth::default());
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (b, h) = (blocks.clone(), health.clone());
        std::thread::Builder::new()
            .name("gateway-store".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.to_string()));
                        return;
                    }
                };
                rt.block_on(async move {
                    let (log, engine) = match open() {
                        Ok(x) => x,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                    let opened = match sweeps {
                        Sweeps::Beside => {
                            Pipeline::open_leaving_jobs(log, engine, summarizer.clone())
                                .await
                                .map(|(p, pending)| {
                                    let mut sweeper = Sweeper::new(summarizer);
                                    sweeper.add(pending);
                                    (p, Some(sweeper))
                                })
                        }
                        Sweeps::Inline => Pipeline::open(log, engine, summarizer)
                            .await
                            .map(|p| (p, None)),
                    };
                    let (pipeline, sweeper) = match opened {
                        Ok(x) => x,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e.to_string()));
                            return;
                        }
                    };
                    h.reachable
                        .store(true, std::sync::atomic::Ordering::Relaxed);
                    let _ = ready_tx.send(Ok(()));
                    run_embedded(pipeline, sweeper, rx, b, h).await;
                });
            })?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(Store {
                tx,
                blocks,
                health,
                kind: "embedded",
                spool: None,
                client: None,
            }),
            Ok(Err(e)) => Err(std::io::Error::other(e)),
            Err(_) => Err(std::io::Error::other("the store thread stopped")),
        }
    }

    /// The NATS store: publishes to a deployment; spools what it cannot.
    pub async fn nats(config: &Config, spool: Arc<Spool>) -> Result<Store, String> {
        let cfg = &config.nats;
        let subjects = cfg.subjects().map_err(|e| e.to_string())?;
        let (client, _) = cfg.connection.connect().await.map_err(|e| e.to_string())?;
        let max = (client.server_info().max_payload).min(cfg.max_message_bytes as usize);
        let publisher = Publisher {
            js: async_nats::jetstream::new(client.clone()),
            subjects: subjects.clone(),
            max_message_bytes: max,
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let blocks = Arc::new(Blocks::default());
        let health = Arc::new(StoreHealth::default());
        health
            .reachable
            .store(true, std::sync::atomic::Ordering::Relaxed);
        tokio::spawn(run_nats(
            publisher,
            client.clone(),
            subjects,
            rx,
            blocks.clone(),
            health.clone(),
            spool.clone(),
        ));
        Ok(Store {
            tx,
            blocks,
            health,
            kind: "nats",
            spool: Some(spool),
            client: Some(client),
        })
    }
}

/// The embedded store's loop: batches of turns are stored and folded as
/// they come; with a `sweeper`, jobs run beside and their results are
/// folded as each finishes.
async fn run_embedded<L: EventLog, B: KvBackend, S: Summarizer + 'static>(
    mut pipeline: Pipeline<L, B, Arc<S>>,
    mut sweeper: Option<Sweeper<S>>,
    mut rx: mpsc::UnboundedReceiver<Command>,
    blocks: Arc<Blocks>,
    health: Arc<StoreHealth>,
) {
    let mut closing = None;
    loop {
        let first = tokio::select! {
            cmd = rx.recv() => match cmd {
                Some(cmd) => cmd,
                None => break,
            },
            done = finished(&mut sweeper) => {
                match pipeline.append_leaving_jobs(Origin::Service, &done.events).await {
                    Ok(jobs) => {
                        if let Some(s) = sweeper.as_mut() {
                            s.add(jobs);
                        }
                    }
                    Err(e) => store_failed(&e),
                }
                rebuild_blocks(&mut pipeline, [done.conversation].iter(), &blocks);
                continue;
            }
        };
        let mut events = Vec::new();
        let mut flushes = Vec::new();
        let mut next = Some(first);
        while let Some(cmd) = next.take() {
            match cmd {
                Command::Publish(e) => events.extend(e),
                Command::Flush(tx) => flushes.push(tx),
                Command::Close(tx) => {
                    closing = Some(tx);
                    break;
                }
            }
            if events.len() < 4096 {
                next = rx.try_recv().ok();
            }
        }
        if !events.is_empty() {
            let touched: BTreeSet<String> = events.iter().map(|e| e.conversation.clone()).collect();
            let n = events.len() as u64;
            let stored = match sweeper.as_mut() {
                Some(s) => pipeline
                    .append_leaving_jobs(Origin::Agent, &events)
                    .await
                    .map(|jobs| s.add(jobs)),
                None => pipeline.ingest(&events).await,
            };
            match stored {
                Ok(()) => {
                    health
                        .published
                        .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
                }
                Err(e) => {
                    health
                        .failed
                        .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
                    store_failed(&e);
                }
            }
            rebuild_blocks(&mut pipeline, touched.iter(), &blocks);
        }
        for f in flushes {
            let _ = f.send(());
        }
        if closing.is_some() {
            break;
        }
    }
    if let Err(e) = pipeline.engine.flush() {
        store_failed(&e);
    }
    drop(pipeline);
    if let Some(tx) = closing {
        let _ = tx.send(());
    }
}

/// The next sweep to finish, when jobs run beside the fold; never resolves
/// otherwise.
async fn finished<S: Summarizer + 'static>(sweeper: &mut Option<Sweeper<S>>) -> SweepDone {
    match sweeper {
        Some(s) => s.finished().await,
        None => std::future::pending().await,
    }
}

fn store_failed(e: &dyn std::fmt::Display) {
    crate::telemetry::GatewayStoreFailed {
        error: &e.to_string(),
    }
    .emit();
}

/// Rebuilds the summary block of each conversation in `touched` from the
/// state.
fn rebuild_blocks<'a, L: EventLog, B: KvBackend, S: Summarizer>(
    pipeline: &mut Pipeline<L, B, S>,
    touched: impl Iterator<Item = &'a String>,
    blocks: &Blocks,
) {
    for conv in touched {
        let block = pipeline
            .engine
            .with_conversation(conv, |state, bodies| {
                state
                    .conversations
                    .get(conv)
                    .and_then(|c| block_from_state(c, bodies))
            })
            .ok()
            .flatten();
        if blocks.set(block, conv) {
            crate::telemetry::GatewayBlockChanged.emit();
        }
    }
}

const ASSEMBLE_TIMEOUT: Duration = Duration::from_secs(5);

async fn run_nats(
    publisher: Publisher,
    client: async_nats::Client,
    subjects: crate::nats::subjects::Subjects,
    mut rx: mpsc::UnboundedReceiver<Command>,
    blocks: Arc<Blocks>,
    health: Arc<StoreHealth>,
    spool: Arc<Spool>,
) {
    let mut retry = tokio::time::interval(Duration::from_secs(2));
    retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let cmd = tokio::select! {
            // Commands first: a retry of the spool may take a publish
            // timeout (5 s) while NATS is away, and an unbiased select let a
            // turn handed over meanwhile wait behind several retries in a
            // row. Taking a command while the spool holds turns only
            // appends to it, so the retries are not starved.
            biased;
            cmd = rx.recv() => cmd,
            _ = retry.tick() => {
                // Spooled turns go out when NATS takes them again.
                if !spool.is_empty() {
                    let pending = spool.snapshot();
                    let (stored, left) = publish_all(&publisher, pending).await;
                    health.published.fetch_add(stored as u64, std::sync::atomic::Ordering::Relaxed);
                    health.reachable.store(left.is_empty(), std::sync::atomic::Ordering::Relaxed);
                    spool.drop_front(stored);
                }
                continue;
            }
        };
        let Some(cmd) = cmd else { return };
        match cmd {
            Command::Flush(tx) => {
                let _ = tx.send(());
            }
            Command::Close(tx) => {
                let _ = tx.send(());
                return;
            }
            Command::Publish(events) => {
                if !spool.is_empty() {
                    // Older turns wait: these go after them, in order.
                    health
                        .failed
                        .fetch_add(events.len() as u64, std::sync::atomic::Ordering::Relaxed);
                    spool.append(events);
                    continue;
                }
                let touched: BTreeSet<String> =
                    events.iter().map(|e| e.conversation.clone()).collect();
                let (stored, left) = publish_all(&publisher, events).await;
                health
                    .published
                    .fetch_add(stored as u64, std::sync::atomic::Ordering::Relaxed);
                let ok = left.is_empty();
                health
                    .reachable
                    .store(ok, std::sync::atomic::Ordering::Relaxed);
                if !ok {
                    health
                        .failed
                        .fetch_add(left.len() as u64, std::sync::atomic::Ordering::Relaxed);
                    spool.put_back(left);
                    continue;
                }
                for conv in touched {
                    if let Some(reply) = assemble_over_nats(&client, &subjects, &conv).await {
                        if blocks.set(block_from_assembled(&reply), &conv) {
                            crate::telemetry::GatewayBlockChanged.emit();
                        }
                    }
                }
            }
        }
    }
}

/// Publishes events in order; returns how many were stored and the rest
/// (from the first failure on).
async fn publish_all(publisher: &Publisher, events: Vec<Envelope>) -> (usize, Vec<Envelope>) {
    let mut stored = 0;
    let mut iter = events.into_iter();
    while let Some(e) = iter.next() {
        let ok = match publisher.event(Origin::Agent, &e).await {
            Ok(ack) => {
                match tokio::time::timeout(Duration::from_secs(5), publish::stored("turn", ack))
                    .await
                {
                    Ok(Ok(())) => true,
                    Ok(Err(f)) if f.is_permanent() => {
                        crate::telemetry::GatewayStoreFailed {
                            error: &f.to_string(),
                        }
                        .emit();
                        true
                    }
                    _ => false,
                }
            }
            Err(f) if f.is_permanent() => {
                crate::telemetry::GatewayStoreFailed {
                    error: &f.to_string(),
                }
                .emit();
                true
            }
            Err(_) => false,
        };
        if !ok {
            let mut left = vec![e];
            left.extend(iter);
            return (stored, left);
        }
        stored += 1;
    }
    (stored, Vec::new())
}

async fn assemble_over_nats(
    client: &async_nats::Client,
    subjects: &crate::nats::subjects::Subjects,
    conversation: &str,
) -> Option<AssembleResponse> {
    let subject = subjects.api(api::Op::Assemble, conversation).ok()?;
    let body = serde_json::to_vec(&AssembleRequest {
        conversation: conversation.to_string(),
        budget: Some(u64::MAX / 4),
        prompt: None,
        prompt_aware_eviction: false,
        // The block changes only when the summaries do.
        summaries_as_they_are: true,
        since: None,
    })
    .ok()?;
    let request = async_nats::Request::new()
        .payload(body.into())
        .timeout(Some(ASSEMBLE_TIMEOUT));
    let reply = client.send_request(subject, request).await.ok()?;
    api::decode_reply::<AssembleResponse>(&reply.payload).ok()
}

/// A user turn holding the block (what a compaction answer is built from).
pub fn block_turn(block: &SummaryBlock) -> ChatMessage {
    ChatMessage::text(Role::User, block.text.clone())
}
