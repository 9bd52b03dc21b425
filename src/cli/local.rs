//! Subcommands over the embedded log and state in the data directory.
//!
//! Only `run` (and `compact`, which appends its request) may create a data
//! directory. The read-only commands (`status`, `assemble`, `grep`,
//! `describe`, `expand`, `history`, `replay`) and `rebuild` refuse a
//! directory without a log ([`require_data`]), and the read-only ones
//! never write a store ([`read_engine`]): they open `state.redb` read-only
//! (no catch-up, no commit, no job, no clearing: the file stays byte for
//! byte as it was) and answer from the position it reflects, saying on
//! stderr how far behind the log that is and that `contextfold run` folds
//! the rest; a store of another layout, or none, is not read: they fold
//! the log in memory instead (the log is the truth), saying so. They read
//! only the conversation they are asked about (global status reads them
//! one at a time), and answer under the policy in force at the store's
//! position (the log's `policy_recorded`), not today's configuration.

use super::report;
use anyhow::{bail, Context, Result};
use contextfold::api::{self, status, Held};
use contextfold::config::Config;
use contextfold::core::assembly::{self, AssemblyRequest};
use contextfold::core::event::{Encoding, MAX_EVENT_BYTES};
use contextfold::core::measure::TurnMeasure;
use contextfold::core::overflow;
use contextfold::core::policy::PolicyConfig;
use contextfold::core::tokens;
use contextfold::import::{self, Format};
use contextfold::log::segment::{SegmentLog, DEFAULT_MAX_RECORD_BYTES};
use contextfold::log::{EventLog, LogRecord};
use contextfold::runtime::embedded::{self, Measurer, Pipeline};
use contextfold::runtime::engine::Engine;
use contextfold::store::memory_backend::MemoryBackend;
use contextfold::store::redb_backend::{ReadOnlyRedb, RedbBackend};
use contextfold::store::state_store::{BodyCache, StateStore};
use contextfold::store::KvBackend;
use contextfold::summarizer::DeterministicSummarizer;
use std::io::{BufRead, Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

pub(super) fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}

fn log_dir(config: &Config) -> PathBuf {
    config.data_dir.join("log")
}

fn state_path(config: &Config) -> PathBuf {
    config.data_dir.join("state.redb")
}

type LocalPipeline = Pipeline<SegmentLog, RedbBackend, DeterministicSummarizer>;

/// Refuses a data directory that holds no embedded log, before anything
/// is created in it.
pub(super) fn require_data(config: &Config) -> Result<()> {
    if log_dir(config).is_dir() {
        return Ok(());
    }
    bail!(
        "no contextfold data in {}: run `contextfold run FILE` with this data directory \
         first, or point --data (or data_dir) at one `run` wrote (a `serve` process is asked \
         with --nats instead)",
        config.data_dir.display()
    )
}

/// The engine a read-only command answers from.
pub(super) enum LocalEngine {
    /// The store as it is (opened read-only; perhaps behind the log).
    Stored(Engine<ReadOnlyRedb>),
    /// No store yet: the log folded in memory.
    Memory(Engine<MemoryBackend>),
}

impl LocalEngine {
    /// Answers one API request (JSON bytes, or an error reply) reading only
    /// `conversation` (or, for global status, every conversation one at a
    /// time).
    /// Under the policy in force where the engine is (the log's).
    pub(super) fn answer(&self, op: api::Op, conversation: Option<&str>, body: &[u8]) -> Vec<u8> {
        match self {
            LocalEngine::Stored(e) => answer_from(e, op, conversation, body, &e.policy),
            LocalEngine::Memory(e) => answer_from(e, op, conversation, body, &e.policy),
        }
    }
}

/// [`LocalEngine::answer`] for one engine.
pub(super) fn answer_from<B: KvBackend>(
    engine: &Engine<B>,
    op: api::Op,
    conversation: Option<&str>,
    body: &[u8],
    policy: &PolicyConfig,
) -> Vec<u8> {
    let reply = match conversation {
        Some(key) => engine.with_conversation(key, |state, bodies| {
            api::handle_op(
                op,
                body,
                Held {
                    state,
                    bodies,
                    policy,
                },
            )
        }),
        None if op == api::Op::Status => Ok(
            match status::global_status_with(&engine.state, policy, |each| {
                engine.each_conversation(|state, conv| each(state, conv))
            }) {
                Ok(g) => serde_json::to_vec(&status::StatusResponse::Global(Box::new(g)))
                    .unwrap_or_else(|e| api::ApiError::Internal(e.to_string()).to_json()),
                Err(e) => e.to_json(),
            },
        ),
        None => Ok(api::handle_op(
            op,
            body,
            Held::resident(&engine.state, policy),
        )),
    };
    reply.unwrap_or_else(|e| api::ApiError::from(e).to_json())
}

/// How the store a read-only command reads stands against the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Freshness {
    /// The store reflects the whole log.
    Current,
    /// The store reflects the log up to `store`; the log holds `log`.
    Behind { store: u64, log: u64 },
    /// No store: the log was folded in memory.
    NoStore,
    /// A store of another layout: not read; the log was folded in memory.
    OtherLayout(String),
}

impl Freshness {
    /// The note a read-only command prints on stderr (`None`: current).
    pub(super) fn note(&self) -> Option<String> {
        match self {
            Freshness::Current | Freshness::NoStore => None,
            Freshness::Behind { store, log } => Some(format!(
                "note: the state store is {} record(s) behind the log (it reflects record {store} \
                 of {log}); this answer is as of record {store}. `contextfold run /dev/null` \
                 folds the rest into the store (and runs the jobs it issues); read-only \
                 commands never write it",
                log - store
            )),
            Freshness::OtherLayout(why) => Some(format!(
                "note: {why}; the log was folded in memory to answer (the store was not \
                 touched). `contextfold run /dev/null` refolds the log into it"
            )),
        }
    }
}

/// The engine for a read-only command, and how it stands against the log:
/// the store opened read-only as it is (behind the log, perhaps), or, when
/// there is no store or one of another layout, the log folded in memory.
/// Creates no data directory and no store, and writes none.
pub(super) async fn read_engine_with(config: &Config) -> Result<(LocalEngine, Freshness)> {
    require_data(config)?;
    let path = state_path(config);
    if !path.exists() {
        let engine = replay_log(config, None).await?.0;
        return Ok((LocalEngine::Memory(engine), Freshness::NoStore));
    }
    let backend = ReadOnlyRedb::open(&path)
        .with_context(|| format!("opening the state store {} read-only", path.display()))?;
    match Engine::open_read_only(store(backend, config), config.policy.clone()) {
        Ok(mut engine) => {
            engine.set_residency(config.store.residency());
            let log = open_log(config)?.last_position().await?;
            let freshness = if engine.position() < log {
                Freshness::Behind {
                    store: engine.position(),
                    log,
                }
            } else {
                Freshness::Current
            };
            Ok((LocalEngine::Stored(engine), freshness))
        }
        Err(e @ contextfold::store::StoreError::OtherLayout { .. }) => {
            let engine = replay_log(config, None).await?.0;
            Ok((
                LocalEngine::Memory(engine),
                Freshness::OtherLayout(e.to_string()),
            ))
        }
        Err(e) => Err(e.into()),
    }
}

/// [`read_engine_with`], its note printed on stderr.
pub(super) async fn read_engine(config: &Config) -> Result<LocalEngine> {
    let (engine, freshness) = read_engine_with(config).await?;
    if let Some(note) = freshness.note() {
        eprintln!("{note}");
    }
    Ok(engine)
}

/// The pipeline of a command that folds live (`run`, `compact`): it
/// records its configured policy in the log when the log's differs.
pub(super) async fn open_pipeline(config: &Config) -> Result<LocalPipeline> {
    open_pipeline_with(config, true).await
}

/// [`open_pipeline`]; `record`: whether it records its policy (`rebuild`
/// catches the store up without).
async fn open_pipeline_with(config: &Config, record: bool) -> Result<LocalPipeline> {
    std::fs::create_dir_all(&config.data_dir)
        .with_context(|| format!("creating data directory {}", config.data_dir.display()))?;
    let log = open_log(config)?;
    let backend = RedbBackend::open_with_cache(&state_path(config), redb_cache(config))
        .with_context(|| format!("opening the state store {}", state_path(config).display()))?;
    let mut engine = Engine::open_with(store(backend, config), config.policy.clone())?;
    engine.set_flush_every(config.store.flush_every);
    engine.set_residency(config.store.residency());
    if record {
        engine.record_policy_as(
            contextfold::core::event::EMBEDDED_PARTITION_KEY.into(),
            "embedded",
        );
    }
    Ok(Pipeline::open(log, engine, DeterministicSummarizer).await?)
}

fn redb_cache(config: &Config) -> usize {
    usize::try_from(config.store.redb_cache_bytes).unwrap_or(usize::MAX)
}

/// A state store with the configured body cache.
fn store<B: KvBackend>(backend: B, config: &Config) -> StateStore<B> {
    StateStore::with_cache(
        backend,
        std::sync::Arc::new(BodyCache::new(config.store.body_cache_bytes)),
    )
}

pub fn import(format: &str, file: &Path) -> Result<ExitCode> {
    let format: Format = format.parse().map_err(|e| anyhow::anyhow!("{e}"))?;
    let conversations = import::import_file(file, format)
        .with_context(|| format!("importing {}", file.display()))?;
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let mut n = 0;
    for conv in &conversations {
        for e in &conv.events {
            writeln!(out, "{}", e.to_json())?;
            n += 1;
        }
    }
    out.flush()?;
    eprintln!(
        "imported {n} events in {} conversation(s) from {}",
        conversations.len(),
        file.display()
    );
    Ok(ExitCode::SUCCESS)
}

pub fn classify_errors() -> Result<ExitCode> {
    let stdin = std::io::stdin();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    for line in stdin.lock().lines() {
        let line = line.context("reading stdin")?;
        let v = overflow::classify(&line);
        let verdict = match (v.overflow, v.size_limit) {
            (true, _) => "overflow",
            // A request or upload over a byte limit: no compaction.
            (false, true) => "size_limit",
            (false, false) => "other",
        };
        let counts: Vec<String> = v.token_counts.iter().map(u64::to_string).collect();
        if counts.is_empty() {
            writeln!(out, "{verdict}")?;
        } else {
            writeln!(out, "{verdict} {}", counts.join(" "))?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// One input record and where it came from, for messages.
pub(super) struct Input {
    pub at: Place,
    pub encoding: Encoding,
    pub bytes: Vec<u8>,
}

/// Where an input record came from: `line 12` of event JSONL, or `event 12`
/// of an imported transcript (written only when a message names it).
#[derive(Clone, Copy, Debug)]
pub(super) enum Place {
    Line(usize),
    Event(usize),
}

impl std::fmt::Display for Place {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Place::Line(n) => write!(f, "line {n}"),
            Place::Event(n) => write!(f, "event {n}"),
        }
    }
}

/// Reads input as event JSONL when it looks like it, else as a transcript.
/// Lines that are not valid events are kept as raw records so the engine
/// rejects them with a reason and folds everything else.
pub(super) fn read_input(file: Option<&Path>, format: &str) -> Result<Vec<Input>> {
    input_records(file, format)?.collect()
}

/// Input records, read as they are needed: event JSONL line by line (a
/// fleet's history need not fit in memory), a transcript imported whole
/// (transcript formats are one document).
pub(super) enum InputRecords {
    Lines {
        reader: Box<dyn BufRead + Send>,
        /// The first non-blank line, read to tell the format.
        first: Option<(usize, Vec<u8>)>,
        line: usize,
    },
    Imported(std::vec::IntoIter<Input>),
}

impl Iterator for InputRecords {
    type Item = Result<Input>;

    fn next(&mut self) -> Option<Result<Input>> {
        match self {
            InputRecords::Imported(records) => records.next().map(Ok),
            InputRecords::Lines {
                reader,
                first,
                line,
            } => {
                if let Some((at, bytes)) = first.take() {
                    return Some(Ok(event_line(at, bytes)));
                }
                loop {
                    let mut buf = Vec::new();
                    match reader.read_until(b'\n', &mut buf) {
                        Ok(0) => return None,
                        Ok(_) => {
                            *line += 1;
                            if buf.iter().all(u8::is_ascii_whitespace) {
                                continue;
                            }
                            trim_line_end(&mut buf);
                            return Some(Ok(event_line(*line, buf)));
                        }
                        Err(e) => return Some(Err(anyhow::Error::new(e).context("reading input"))),
                    }
                }
            }
        }
    }
}

fn trim_line_end(buf: &mut Vec<u8>) {
    while buf.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
        buf.pop();
    }
}

fn event_line(line: usize, bytes: Vec<u8>) -> Input {
    Input {
        at: Place::Line(line),
        encoding: Encoding::Json,
        bytes,
    }
}

/// Opens the input: event JSONL when `format` says so or (`auto`) its first
/// non-blank line is an event, else a transcript of `format`.
pub(super) fn input_records(file: Option<&Path>, format: &str) -> Result<InputRecords> {
    let mut reader: Box<dyn BufRead + Send> = match file {
        Some(p) if p != Path::new("-") => Box::new(std::io::BufReader::with_capacity(
            1 << 20,
            std::fs::File::open(p).with_context(|| format!("reading {}", p.display()))?,
        )),
        _ => Box::new(std::io::BufReader::new(std::io::stdin())),
    };
    let mut head = Vec::new();
    let mut line = 0;
    let first = loop {
        let mut buf = Vec::new();
        if reader
            .read_until(b'\n', &mut buf)
            .context("reading input")?
            == 0
        {
            break None;
        }
        line += 1;
        head.extend_from_slice(&buf);
        if !buf.iter().all(u8::is_ascii_whitespace) {
            trim_line_end(&mut buf);
            break Some(buf);
        }
    };
    let is_events = format == "events"
        || (format == "auto"
            && first.as_ref().is_some_and(|l| {
                serde_json::from_slice::<serde_json::Value>(l)
                    .ok()
                    .is_some_and(|v| v.get("conversation").is_some() && v.get("payload").is_some())
            }));
    // Empty input is no events (`run /dev/null` catches the store up).
    if is_events || first.is_none() {
        return Ok(InputRecords::Lines {
            reader,
            first: first.map(|f| (line, f)),
            line,
        });
    }
    let mut bytes = head;
    reader.read_to_end(&mut bytes).context("reading input")?;
    let format: Format = format.parse().map_err(|e| anyhow::anyhow!("{e}"))?;
    let name = file.map_or("stdin".to_string(), |p| {
        p.file_stem()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned()
    });
    let conversations = import::import_bytes(&bytes, format, &name)?;
    // Collected: the records borrow the imported conversations, dropped here.
    #[allow(clippy::needless_collect)]
    let records: Vec<Input> = conversations
        .iter()
        .flat_map(|c| c.events.iter())
        .enumerate()
        .map(|(i, e)| Input {
            at: Place::Event(i + 1),
            encoding: Encoding::Msgpack,
            bytes: e.to_msgpack(),
        })
        .collect();
    Ok(InputRecords::Imported(records.into_iter()))
}

/// Splits off the records the log cannot store (over
/// [`DEFAULT_MAX_RECORD_BYTES`]), each reported on stderr by its place and
/// size; the rest go on. Records up to that size are stored even when the
/// decoder refuses them (over `MAX_EVENT_BYTES`): the fold rejects those
/// with a reason an operator can read back.
fn drop_unstorable(input: Vec<Input>) -> (Vec<(Encoding, Vec<u8>)>, usize) {
    let mut skipped = 0;
    let records = input
        .into_iter()
        .filter_map(|r| {
            if r.bytes.len() > DEFAULT_MAX_RECORD_BYTES {
                skipped += 1;
                eprintln!(
                    "{} rejected: {} bytes, over the {} bytes a log record may hold (an event \
                     may have {}); the lines after it are read",
                    r.at,
                    r.bytes.len(),
                    DEFAULT_MAX_RECORD_BYTES,
                    MAX_EVENT_BYTES
                );
                None
            } else {
                Some((r.encoding, r.bytes))
            }
        })
        .collect();
    (records, skipped)
}

/// The records `run`'s measuring thread hands to the fold at a time: a
/// sixteenth of the batch. The fold starts as soon as the first piece is
/// measured, not the first batch, and at the input's end it is a piece
/// behind the measuring, not a batch (about 0.2 s for 4,096 turns of real
/// transcripts, with the other core idle). Commits stay one per batch.
fn piece_size(batch: usize) -> usize {
    (batch / 16).max(1)
}

/// How many of the turns' readings the measuring thread leaves to the
/// fold's thread ([`Measurer::shed_readings`]), steered by the pieces
/// waiting for the fold: with at most one waiting the fold is about to
/// wait on the measuring, which then sheds a larger share; with six or
/// more waiting the measuring is ahead and sheds less (between the two,
/// a commit's pause or a burst of drafts, it holds). The measuring
/// thread is the slower of the two on real transcripts (token counts and
/// readings; `docs/notes/issue-26.md`), so both cores stay busy. What is
/// shed is read by the drafts and rolling states that need it: the time
/// changes, never the state.
#[derive(Debug, Default)]
struct ShedReadings {
    share: f64,
}

impl ShedReadings {
    /// The change of the share per piece.
    const STEP: f64 = 1.0 / 32.0;

    /// The share to shed from the next piece, with `waiting` pieces
    /// measured and not yet taken by the fold.
    fn after(&mut self, waiting: usize) -> f64 {
        match waiting {
            0 | 1 => self.share = (self.share + Self::STEP).min(1.0),
            2..=5 => {}
            _ => self.share = (self.share - Self::STEP).max(0.0),
        }
        self.share
    }
}

/// A piece of input records, read and measured.
struct MeasuredPiece {
    records: Vec<(Encoding, Vec<u8>)>,
    measures: Vec<Option<TurnMeasure>>,
    /// Records of the piece too large to store (reported on stderr).
    dropped: usize,
}

/// `run`'s input, read and measured on its own thread ahead of the fold,
/// in pieces ([`piece_size`]): up to a batch of them wait measured, so a
/// stretch that is slow to fold (a burst of drafts) or slow to measure
/// does not idle the other thread. One thread for the whole run, not a
/// pool thread per piece: each thread that allocates gets its own malloc
/// arena, and a piece's records are freed on the fold's thread long after.
struct InputAhead {
    ready: tokio::sync::mpsc::Receiver<Result<Option<MeasuredPiece>>>,
}

impl InputAhead {
    fn start(mut input: InputRecords, mut measurer: Measurer, batch: usize) -> Result<InputAhead> {
        let size = piece_size(batch);
        // A batch of pieces waiting; the thread blocks with the next one
        // measured.
        let (send, ready) = tokio::sync::mpsc::channel(batch.max(1).div_ceil(size));
        let mut shed = ShedReadings::default();
        std::thread::Builder::new()
            .name("measure".into())
            .spawn(move || loop {
                let piece = input
                    .by_ref()
                    .take(size)
                    .collect::<Result<Vec<Input>>>()
                    .map(|records| {
                        (!records.is_empty()).then(|| {
                            let (records, dropped) = drop_unstorable(records);
                            let waiting = send.max_capacity() - send.capacity();
                            measurer.shed_readings(shed.after(waiting));
                            let measures = measurer.measure(&records);
                            MeasuredPiece {
                                records,
                                measures,
                                dropped,
                            }
                        })
                    });
                let last = !matches!(piece, Ok(Some(_)));
                // Ends at the input's end or error, or when the fold stops
                // taking pieces (it finished or failed).
                if send.blocking_send(piece).is_err() || last {
                    break;
                }
            })
            .context("starting the measuring thread")?;
        Ok(InputAhead { ready })
    }

    /// The next piece (`None` at the input's end); the ones after it are
    /// read while the caller folds this one.
    async fn next(&mut self) -> Result<Option<MeasuredPiece>> {
        self.ready
            .recv()
            .await
            .context("the measuring thread stopped")?
    }
}

pub fn run(
    config: &Config,
    file: Option<&Path>,
    format: &str,
    batch: usize,
    json: bool,
) -> Result<ExitCode> {
    let started = Instant::now();
    let input = input_records(file, format)?;
    // The pieces are read and their turns measured on the other core while
    // this one folds the piece before (`core::measure`). Measuring starts
    // before the store is open: the first turn it counts loads the
    // tokenizer, tens of milliseconds the store's opening then overlaps.
    let mut ahead = InputAhead::start(input, Measurer::for_policy(&config.policy), batch)?;
    let rt = runtime()?;
    // The fold is the runtime's one task, and it waits on each draft: the
    // drafts are written on its thread (`blocking::inline_within`).
    rt.block_on(contextfold::blocking::inline_within(async {
        let mut p = open_pipeline(config).await?;
        // Then, while the first piece is measured, this thread builds the
        // default encoding's pre-tokenizer patterns the measuring thread
        // would build after the BPE (`load_tokenizer` shares the work).
        tokens::load_tokenizer(tokens::Encoding::for_model(None));
        let mut done = 0;
        let mut skipped = 0;
        let mut last_report = Instant::now();
        let mut uncommitted = 0;
        while let Some(MeasuredPiece {
            records,
            measures,
            dropped,
        }) = ahead.next().await?
        {
            skipped += dropped;
            p.fold_measured(&records, measures).await?;
            done += records.len();
            uncommitted += records.len();
            if uncommitted >= batch {
                p.commit().await?;
                uncommitted = 0;
            }
            if last_report.elapsed().as_millis() >= 500 {
                eprintln!(
                    "  {done} events folded ({:.1}s)",
                    started.elapsed().as_secs_f64()
                );
                last_report = Instant::now();
            }
        }
        if uncommitted > 0 {
            p.commit().await?;
        }
        eprintln!(
            "  {done} events folded ({:.1}s)",
            started.elapsed().as_secs_f64()
        );
        p.engine.flush()?;
        report::print(&p.engine, &p.engine.policy, started.elapsed(), json)?;
        if skipped > 0 {
            eprintln!("{skipped} record(s) too large to store were rejected (see above)");
            return Ok(ExitCode::FAILURE);
        }
        Ok(ExitCode::SUCCESS)
    }))
}

pub(super) fn open_log(config: &Config) -> Result<SegmentLog> {
    SegmentLog::open(&log_dir(config))
        .with_context(|| format!("opening the event log in {}", log_dir(config).display()))
}

/// Folds the whole log into a fresh in-memory state, stopping after the
/// event `until` when given.
pub(super) async fn replay_log(
    config: &Config,
    until: Option<&str>,
) -> Result<(Engine<MemoryBackend>, bool)> {
    let mut engine = Engine::open_with(
        store(MemoryBackend::default(), config),
        config.policy.clone(),
    )?;
    engine.set_residency(config.store.residency());
    let found = embedded::replay(&mut open_log(config)?, &mut engine, until).await?;
    Ok((engine, found))
}

pub fn replay(config: &Config) -> Result<ExitCode> {
    require_data(config)?;
    let rt = runtime()?;
    rt.block_on(async {
        let started = Instant::now();
        let (engine, _) = replay_log(config, None).await?;
        let bodies = engine.bodies();
        engine.each_conversation(|_, conv| -> Result<()> {
            println!(
                "{}  {}  ({} turns, {} summaries)",
                conv.hash_with(&bodies)?,
                conv.key,
                conv.turns.len(),
                conv.summaries.len()
            );
            Ok(())
        })?;
        println!(
            "state {}  ({} records in {:.2}s)",
            engine.state_hash()?,
            engine.position(),
            started.elapsed().as_secs_f64()
        );
        Ok(ExitCode::SUCCESS)
    })
}

/// `replay --policy FILE [CONV...]` (see [`super::whatif`]).
pub fn what_if(
    config: &Config,
    file: &Path,
    conversations: &[String],
    json: bool,
) -> Result<ExitCode> {
    require_data(config)?;
    let other = Config::load_policy_file(file)?;
    let rt = runtime()?;
    rt.block_on(async {
        let mut log = open_log(config)?;
        let mut records = Vec::new();
        loop {
            let after = records.last().map_or(0, |r: &LogRecord| r.position);
            let batch = log.read_after(after, 4096).await?;
            if batch.is_empty() {
                break;
            }
            records.extend(batch);
        }
        let w = super::whatif::what_if(&records, &config.policy, &other, conversations).await?;
        if w.conversations.is_empty() {
            bail!(
                "no agent events in the log at {} for {}",
                log_dir(config).display(),
                if conversations.is_empty() {
                    "any conversation".to_string()
                } else {
                    conversations.join(", ")
                }
            );
        }
        if json {
            println!("{}", serde_json::to_string_pretty(&w)?);
        } else {
            print!("{}", super::whatif::render(&w, &file.display().to_string()));
        }
        Ok(ExitCode::SUCCESS)
    })
}

pub fn assemble(
    config: &Config,
    conversation: &str,
    at: Option<&str>,
    request: AssemblyRequest,
    json: bool,
) -> Result<ExitCode> {
    require_data(config)?;
    let rt = runtime()?;
    rt.block_on(async {
        let engine = if at.is_some() {
            let (engine, found) = replay_log(config, at).await?;
            if !found {
                bail!(
                    "event {:?} is not in the log at {}",
                    at.unwrap_or_default(),
                    log_dir(config).display()
                );
            }
            LocalEngine::Memory(engine)
        } else {
            read_engine(config).await?
        };
        let out = match &engine {
            LocalEngine::Stored(e) => assemble_one(e, conversation, &e.policy, &request)?,
            LocalEngine::Memory(e) => assemble_one(e, conversation, &e.policy, &request)?,
        };
        if json {
            println!("{}", serde_json::to_string_pretty(&out)?);
        } else {
            report::print_assembled(&out);
        }
        Ok(ExitCode::SUCCESS)
    })
}

/// Assembles one conversation of an engine, reading only its state.
pub(super) fn assemble_one<B: KvBackend>(
    engine: &Engine<B>,
    conversation: &str,
    policy: &PolicyConfig,
    request: &AssemblyRequest,
) -> Result<assembly::Assembled> {
    engine.with_conversation(conversation, |state, bodies| {
        let Some(conv) = state.conversations.get(conversation) else {
            bail!(
                "unknown conversation {conversation:?}; `contextfold replay` lists the known ones"
            );
        };
        Ok(assembly::assemble_from(conv, bodies, policy, request)?.into_owned())
    })?
}

pub fn rebuild(config: &Config) -> Result<ExitCode> {
    require_data(config)?;
    let rt = runtime()?;
    rt.block_on(async {
        let current = open_pipeline_with(config, false)
            .await?
            .engine
            .state_hash()?;
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let fresh_path = config.data_dir.join(format!("state.rebuild-{stamp}.redb"));
        let mut engine = Engine::open_with(
            store(
                RedbBackend::open_with_cache(&fresh_path, redb_cache(config))?,
                config,
            ),
            config.policy.clone(),
        )?;
        engine.set_residency(config.store.residency());
        embedded::replay(&mut open_log(config)?, &mut engine, None).await?;
        engine.flush()?;
        let rebuilt = engine.state_hash()?;
        println!("current state  {current}");
        println!("rebuilt state  {rebuilt}  -> {}", fresh_path.display());
        if rebuilt == current {
            println!("hashes agree");
            Ok(ExitCode::SUCCESS)
        } else {
            println!(
                "hashes DIFFER: the current store does not match the log; use the rebuilt store"
            );
            Ok(ExitCode::FAILURE)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::{piece_size, ShedReadings};

    #[test]
    fn the_share_shed_grows_while_the_fold_waits_and_shrinks_while_it_lags() {
        let mut shed = ShedReadings::default();
        assert_eq!(shed.after(1), ShedReadings::STEP);
        assert_eq!(shed.after(0), 2.0 * ShedReadings::STEP);
        assert_eq!(shed.after(2), 2.0 * ShedReadings::STEP);
        assert_eq!(shed.after(5), 2.0 * ShedReadings::STEP);
        assert_eq!(shed.after(6), ShedReadings::STEP);
        for _ in 0..100 {
            shed.after(0);
        }
        assert_eq!(shed.after(1), 1.0);
        for _ in 0..100 {
            shed.after(16);
        }
        assert_eq!(shed.after(9), 0.0);
    }

    #[test]
    fn pieces_are_a_sixteenth_of_the_batch_and_never_empty() {
        assert_eq!(piece_size(4096), 256);
        assert_eq!(piece_size(20), 1);
        assert_eq!(piece_size(1), 1);
        assert_eq!(piece_size(0), 1);
    }
}
