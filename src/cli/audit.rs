//! `audit`, `plot` and `ui`: the compaction history of the embedded log,
//! as text or JSON, as SVG, and as a page in a browser.
//!
//! All three fold the log in memory ([`contextfold::runtime::audit`]):
//! they never open or rewrite the state store. `audit` and `plot` with
//! `--nats` read the conversation's partition of a deployment's events
//! stream instead of the embedded log.

use super::local;
use super::nats_args::NatsArgs;
use anyhow::{Context, Result};
use contextfold::api::describe::NodeRef;
use contextfold::api::Op;
use contextfold::api::{DescribeRequest, ExpandRequest, StatusRequest};
use contextfold::config::Config;
use contextfold::core::assembly::AssemblyRequest;
use contextfold::http::access::PageAccess;
use contextfold::http::audit_page::list::Row;
use contextfold::http::audit_page::{self, AuditSource, PageError};
use contextfold::log::EventLog;
use contextfold::nats::api_role::ask_owner;
use contextfold::nats::event_log::NatsEventLog;
use contextfold::nats::subjects::{partition_of, Subjects};
use contextfold::nats::NatsConfig;
use contextfold::runtime::audit::{self as gather, Audited};
use contextfold::runtime::embedded;
use contextfold::runtime::engine::Engine;
use contextfold::store::memory_backend::MemoryBackend;
use futures::TryStreamExt;
use std::io::Write;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

/// The audit of `conversation` in the embedded log.
pub(super) async fn audited(config: &Config, conversation: &str) -> Result<Audited> {
    local::require_data(config)?;
    let mut log = local::open_log(config)?;
    Ok(gather::audit(
        &mut log,
        &config.policy,
        config.store.residency(),
        conversation,
    )
    .await?)
}

/// The audit of `conversation` from a NATS deployment: its partition of
/// the events stream, read with an ephemeral consumer and folded here under
/// this process's policy, exactly as the partition's folder folds it (the
/// whole partition: spend limits may be shared by its conversations).
/// Needs read access to the events stream, as an operator has.
async fn audited_over_nats(
    config: &Config,
    nats: &NatsArgs,
    conversation: &str,
) -> Result<Audited> {
    let cfg = nats.apply(&config.nats);
    let servers = cfg.connection.display_servers();
    let subjects = cfg.subjects()?;
    let partition = partition_of(conversation, cfg.partitions)
        .with_context(|| format!("conversation {conversation:?}"))?;
    let (client, _version) = cfg
        .connection
        .connect()
        .await
        .with_context(|| format!("connecting to {servers}"))?;
    let js = async_nats::jetstream::new(client);
    let mut log = NatsEventLog::open_partition(js, subjects, partition)
        .await
        .with_context(|| format!("opening the events stream at {servers}"))?;
    Ok(gather::audit(
        &mut log,
        &config.policy,
        config.store.residency(),
        conversation,
    )
    .await?)
}

/// The audit from the embedded log, or over NATS when servers are given.
async fn audited_from(config: &Config, nats: &NatsArgs, conversation: &str) -> Result<Audited> {
    if nats.servers.is_empty() {
        audited(config, conversation).await
    } else {
        audited_over_nats(config, nats, conversation).await
    }
}

pub fn audit(config: &Config, nats: &NatsArgs, conversation: &str, json: bool) -> Result<ExitCode> {
    let rt = local::runtime()?;
    let a = rt.block_on(audited_from(config, nats, conversation))?;
    if json {
        println!("{}", serde_json::to_string_pretty(&a.audit)?);
    } else {
        print!("{}", contextfold::audit_text::render(&a.audit));
    }
    Ok(ExitCode::SUCCESS)
}

pub fn plot(config: &Config, nats: &NatsArgs, conversation: &str, out: &Path) -> Result<ExitCode> {
    let rt = local::runtime()?;
    let a = rt.block_on(audited_from(config, nats, conversation))?;
    let svg = contextfold::plot::svg(&a.audit, &a.dag)?;
    std::fs::write(out, svg).with_context(|| format!("writing {}", out.display()))?;
    eprintln!(
        "wrote {}: {} events, {} compactions, {} summaries in the DAG",
        out.display(),
        a.audit.totals.events,
        a.audit.totals.compactions,
        a.dag.nodes.len()
    );
    Ok(ExitCode::SUCCESS)
}

/// The audit page over the embedded log, or (with `--nats`) over a
/// deployment; serves until Ctrl-C.
pub fn ui(config: &Config, nats: &NatsArgs, addr: std::net::SocketAddr) -> Result<ExitCode> {
    if nats.servers.is_empty() {
        local::require_data(config)?;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    // Beyond loopback the page needs a token: refused before listening.
    let access = PageAccess::new(addr, &config.http).context("contextfold ui cannot listen so")?;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| {
            format!("cannot listen on {addr} (is the port in use? choose another with --port)")
        })?;
        let local = listener.local_addr()?;
        let source: Arc<dyn AuditSource> = if nats.servers.is_empty() {
            Arc::new(Embedded {
                config: config.clone(),
                turn: std::sync::Mutex::new(()),
                folded: std::sync::Mutex::new(None),
            })
        } else {
            Arc::new(
                NatsSource::connect(config, &nats.apply(&config.nats), AskRoute::Public).await?,
            )
        };
        if access.needs_token() {
            println!(
                "contextfold ui: http://{local}/ (open http://{local}/?token=<[http] token> once; \
                 Ctrl-C to stop)"
            );
        } else {
            println!("contextfold ui: http://{local}/ (Ctrl-C to stop)");
        }
        std::io::stdout().flush()?;
        axum::serve(listener, audit_page::router(source, access))
            .with_graceful_shutdown(async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await
            .context("the audit page server stopped")?;
        Ok(ExitCode::SUCCESS)
    })
}

/// The page's source over the embedded log, folded in memory (nothing is
/// written; what a `run` appended between two requests is seen at the
/// next: the list's fold is kept while the log has not grown). The log's
/// directory lock admits one open handle, so the requests take turns
/// (`turn`), and a `run` writing at that moment makes the request fail
/// with the log's own message.
struct Embedded {
    config: Config,
    turn: std::sync::Mutex<()>,
    /// The whole log folded, and the log position it reflects.
    folded: std::sync::Mutex<Option<(u64, Engine<MemoryBackend>)>>,
}

/// What the model saw after the event `engine` was folded up to, as the
/// page shows it: assembled under the policy the log had recorded there.
fn context_json<B: contextfold::store::KvBackend>(
    engine: &Engine<B>,
    conversation: &str,
) -> Result<serde_json::Value, PageError> {
    let out = local::assemble_one(
        engine,
        conversation,
        &engine.policy,
        &AssemblyRequest::default(),
    )
    .map_err(|e| PageError::NotFound(format!("{e:#}")))?;
    serde_json::to_value(out).map_err(failed)
}

fn failed(e: impl std::fmt::Display) -> PageError {
    PageError::Failed(format!("{e:#}"))
}

/// An API answer (JSON bytes) as a value; an API error as a page error.
fn api_answer(bytes: &[u8]) -> Result<serde_json::Value, PageError> {
    let value: serde_json::Value = serde_json::from_slice(bytes).map_err(failed)?;
    match value.get("error") {
        Some(e) => Err(PageError::NotFound(
            e.get("message")
                .and_then(|m| m.as_str())
                .map_or_else(|| e.to_string(), str::to_string),
        )),
        None => Ok(value),
    }
}

impl Embedded {
    fn block<T>(&self, f: impl std::future::Future<Output = Result<T>>) -> Result<T, PageError> {
        // A panicked request poisons nothing the next one reads.
        let _turn = self.turn.lock().unwrap_or_else(|p| p.into_inner());
        tokio::runtime::Handle::current()
            .block_on(f)
            .map_err(failed)
    }

    fn engine(&self, until: Option<&str>) -> Result<(Engine<MemoryBackend>, bool), PageError> {
        self.block(local::replay_log(&self.config, until))
    }

    /// `f` over the whole log folded: the kept fold while the log has not
    /// grown, else a new one.
    fn with_folded<T>(
        &self,
        f: impl FnOnce(&Engine<MemoryBackend>) -> Result<T, PageError>,
    ) -> Result<T, PageError> {
        let mut folded = self.folded.lock().unwrap_or_else(|p| p.into_inner());
        let position =
            self.block(async { Ok(local::open_log(&self.config)?.last_position().await?) })?;
        let engine = match folded.take() {
            Some((at, engine)) if at == position => engine,
            _ => self.engine(None)?.0,
        };
        let out = f(&engine);
        *folded = Some((position, engine));
        out
    }

    fn ask(
        &self,
        op: Op,
        conversation: &str,
        body: serde_json::Value,
    ) -> Result<serde_json::Value, PageError> {
        let (engine, _) = self.engine(None)?;
        let body = serde_json::to_vec(&body).map_err(failed)?;
        api_answer(&local::answer_from(
            &engine,
            op,
            Some(conversation),
            &body,
            &self.config.policy,
        ))
    }
}

impl AuditSource for Embedded {
    fn conversation_keys(&self) -> Result<Vec<String>, PageError> {
        self.with_folded(|engine| {
            let mut keys = Vec::new();
            engine
                .each_conversation(|_, conv| -> Result<(), contextfold::store::StoreError> {
                    keys.push(conv.key.clone());
                    Ok(())
                })
                .map_err(failed)?;
            Ok(keys)
        })
    }

    fn rows(&self, keys: &[String]) -> Result<Vec<Row>, PageError> {
        self.with_folded(|engine| {
            keys.iter()
                .map(|key| {
                    let body = serde_json::to_vec(&StatusRequest {
                        conversation: Some(key.clone()),
                    })
                    .map_err(failed)?;
                    Ok(
                        match api_answer(&local::answer_from(
                            engine,
                            Op::Status,
                            Some(key),
                            &body,
                            &self.config.policy,
                        )) {
                            Ok(status) => Row::from_status(key, &status),
                            Err(e) => Row::unknown(key, e.to_string()),
                        },
                    )
                })
                .collect()
        })
    }

    fn audit(&self, conversation: &str) -> Result<Audited, PageError> {
        self.block(audited(&self.config, conversation))
    }

    fn context_at(&self, conversation: &str, at: &str) -> Result<serde_json::Value, PageError> {
        let (engine, found) = self.engine(Some(at))?;
        if !found {
            return Err(PageError::NotFound(format!(
                "event {at:?} is not in the log"
            )));
        }
        context_json(&engine, conversation)
    }

    fn describe(&self, conversation: &str, id: &str) -> Result<serde_json::Value, PageError> {
        let request = DescribeRequest {
            conversation: conversation.to_string(),
            id: NodeRef::Id(id.to_string()),
        };
        self.ask(
            Op::Describe,
            conversation,
            serde_json::to_value(request).map_err(failed)?,
        )
    }

    fn expand(
        &self,
        conversation: &str,
        id: &str,
        skip: usize,
    ) -> Result<serde_json::Value, PageError> {
        let request = ExpandRequest {
            conversation: conversation.to_string(),
            summary_id: id.to_string(),
            max_tokens: None,
            skip,
        };
        self.ask(
            Op::Expand,
            conversation,
            serde_json::to_value(request).map_err(failed)?,
        )
    }
}

/// How the page asks the API role.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum AskRoute {
    /// On the public subjects `<prefix>.api.<op>.<token>`, as any client
    /// (`ui --nats`, with an operator's permissions).
    Public,
    /// The partition owner directly, on `<prefix>.api.p.<p>.<op>.<token>`,
    /// as the API role forwards (`serve --audit-page`, with the service
    /// user's permissions, which do not include the public subjects).
    Owner,
}

/// The page's source over a NATS deployment: the conversations the events
/// stream names, their status, describe and expand from the API role
/// (request/reply, on the [`AskRoute`]), the audit and what the model saw
/// at an event from the conversation's partition of the stream, folded in
/// this process. Publishes nothing but its requests.
pub(super) struct NatsSource {
    config: Config,
    partitions: u32,
    subjects: Subjects,
    route: AskRoute,
    client: async_nats::Client,
    js: async_nats::jetstream::Context,
}

impl NatsSource {
    pub(super) async fn connect(
        config: &Config,
        nats: &NatsConfig,
        route: AskRoute,
    ) -> Result<NatsSource> {
        let servers = nats.connection.display_servers();
        let (client, _version) = nats
            .connection
            .connect()
            .await
            .with_context(|| format!("connecting to {servers} for the audit page"))?;
        Ok(NatsSource {
            config: config.clone(),
            partitions: nats.partitions,
            subjects: nats.subjects()?,
            route,
            js: async_nats::jetstream::new(client.clone()),
            client,
        })
    }

    fn block<T>(&self, f: impl std::future::Future<Output = Result<T>>) -> Result<T, PageError> {
        tokio::runtime::Handle::current()
            .block_on(f)
            .map_err(failed)
    }

    async fn log(&self, conversation: &str) -> Result<NatsEventLog> {
        let partition = partition_of(conversation, self.partitions)
            .with_context(|| format!("conversation {conversation:?}"))?;
        Ok(NatsEventLog::open_partition(self.js.clone(), self.subjects.clone(), partition).await?)
    }

    /// One API request for `conversation`, as `contextfold status --nats` asks.
    fn ask(
        &self,
        op: Op,
        conversation: &str,
        body: &impl serde::Serialize,
    ) -> Result<serde_json::Value, PageError> {
        let body = serde_json::to_vec(body).map_err(failed)?;
        let reply = self.block(self.ask_bytes(op, conversation, body))?;
        api_answer(&reply)
    }

    /// [`NatsSource::ask`] without waiting: the reply's bytes.
    async fn ask_bytes(&self, op: Op, conversation: &str, body: Vec<u8>) -> Result<Vec<u8>> {
        let timeout = std::time::Duration::from_secs(30);
        if self.route == AskRoute::Owner {
            let reply = ask_owner(
                &self.client,
                self.subjects.prefix(),
                self.partitions,
                timeout,
                op,
                conversation,
                body.into(),
            )
            .await
            .map_err(|e| anyhow::anyhow!("asking the owner of {conversation:?}: {e}"))?;
            return Ok(reply.to_vec());
        }
        let subject = self.subjects.api(op, conversation)?;
        let request = async_nats::Request::new()
            .payload(body.into())
            .timeout(Some(timeout));
        let reply = self
            .client
            .send_request(subject.clone(), request)
            .await
            .with_context(|| format!("asking {subject} (is the api role running?)"))?;
        Ok(reply.payload.to_vec())
    }
}

/// Status requests a list page has in flight at once over NATS.
const STATUS_CONCURRENCY: usize = 32;

impl AuditSource for NatsSource {
    fn conversation_keys(&self) -> Result<Vec<String>, PageError> {
        self.block(async {
            let stream = self
                .js
                .get_stream(self.subjects.events_stream())
                .await
                .context("opening the events stream")?;
            let mut subjects = stream
                .info_with_subjects(self.subjects.events_wildcard())
                .await
                .context("listing the events stream's subjects")?;
            let mut keys = std::collections::BTreeSet::new();
            while let Some((subject, _count)) = subjects
                .try_next()
                .await
                .context("listing the events stream's subjects")?
            {
                if let Ok(stored) = self.subjects.parse_event_subject(&subject) {
                    // A partition's own events (its policy, its clock) are
                    // stored under a reserved key: no conversation.
                    if !contextfold::core::event::is_partition_key(&stored.conversation) {
                        keys.insert(stored.conversation);
                    }
                }
            }
            Ok(keys.into_iter().collect())
        })
    }

    fn rows(&self, keys: &[String]) -> Result<Vec<Row>, PageError> {
        use futures::StreamExt;
        self.block(async {
            let rows = futures::stream::iter(keys)
                .map(|key| async move {
                    let request = StatusRequest {
                        conversation: Some(key.clone()),
                    };
                    let answer = match serde_json::to_vec(&request) {
                        Ok(body) => self
                            .ask_bytes(Op::Status, key, body)
                            .await
                            .map_err(|e| format!("{e:#}"))
                            .and_then(|bytes| api_answer(&bytes).map_err(|e| e.to_string())),
                        Err(e) => Err(e.to_string()),
                    };
                    match answer {
                        Ok(status) => Row::from_status(key, &status),
                        Err(why) => Row::unknown(key, why),
                    }
                })
                .buffer_unordered(STATUS_CONCURRENCY)
                .collect::<Vec<Row>>()
                .await;
            Ok(rows)
        })
    }

    fn audit(&self, conversation: &str) -> Result<Audited, PageError> {
        self.block(async {
            let mut log = self.log(conversation).await?;
            Ok(gather::audit(
                &mut log,
                &self.config.policy,
                self.config.store.residency(),
                conversation,
            )
            .await?)
        })
    }

    fn context_at(&self, conversation: &str, at: &str) -> Result<serde_json::Value, PageError> {
        let (engine, found) = self.block(async {
            let mut log = self.log(conversation).await?;
            let mut engine = Engine::open(MemoryBackend::default(), self.config.policy.clone())?;
            engine.set_residency(self.config.store.residency());
            let found = embedded::replay(&mut log, &mut engine, Some(at)).await?;
            Ok((engine, found))
        })?;
        if !found {
            return Err(PageError::NotFound(format!(
                "event {at:?} is not in the conversation's partition"
            )));
        }
        context_json(&engine, conversation)
    }

    fn describe(&self, conversation: &str, id: &str) -> Result<serde_json::Value, PageError> {
        let request = DescribeRequest {
            conversation: conversation.to_string(),
            id: NodeRef::Id(id.to_string()),
        };
        self.ask(Op::Describe, conversation, &request)
    }

    fn expand(
        &self,
        conversation: &str,
        id: &str,
        skip: usize,
    ) -> Result<serde_json::Value, PageError> {
        let request = ExpandRequest {
            conversation: conversation.to_string(),
            summary_id: id.to_string(),
            max_tokens: None,
            skip,
        };
        self.ask(Op::Expand, conversation, &request)
    }
}
