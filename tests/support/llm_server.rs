//! Real HTTP servers on loopback for the summarizer's tests, each started on
//! a free port and stopped when dropped:
//! - [`Llmock`]: the `llmock` package (faults, Retry-After, request journal);
//! - [`FakeLlm`]: the `fakellm` package (answers scripted by rules);
//! - [`ScriptedServer`]: a tiny HTTP/1.1 server of our own, for what the
//!   packages cannot show: a client closing the connection mid-call,
//!   non-OpenAI lenient bodies, HTTP-date Retry-After.
//!
//! The Python servers come from `scripts/install-test-llm.sh`. Without them
//! a test prints why it skips, unless `CONTEXTFOLD_REQUIRE_LLM_SERVERS` is
//! set (as in CI), where their absence fails the test.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// The virtualenv holding llmock and fakellm.
pub fn venv_dir() -> PathBuf {
    match std::env::var_os("CONTEXTFOLD_VENV") {
        Some(v) => PathBuf::from(v),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv-llm"),
    }
}

/// Path of a venv executable, or `None` (after printing why the test
/// skips) when it is missing. Panics instead when the servers are required.
pub fn venv_bin(name: &str) -> Option<PathBuf> {
    let bin = venv_dir().join("bin").join(name);
    if bin.is_file() {
        return Some(bin);
    }
    let msg = format!(
        "{} not found: run scripts/install-test-llm.sh (or set CONTEXTFOLD_VENV)",
        bin.display()
    );
    if std::env::var_os("CONTEXTFOLD_REQUIRE_LLM_SERVERS").is_some() {
        panic!("CONTEXTFOLD_REQUIRE_LLM_SERVERS is set but {msg}");
    }
    // Straight to stderr: libtest captures eprintln! of passing tests, and
    // a skip must be visible.
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED: {msg}");
    None
}

include!("free_port.rs");

fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .expect("test http client")
}

/// A Python mock server process, killed when dropped.
struct Process {
    child: Child,
    log: PathBuf,
}

impl Process {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `program args` (with `{port}` substituted) in `dir` and waits
/// until `ready_path` answers 200. Retries on another port if the process
/// dies early (another process took the port meanwhile).
async fn spawn(program: &Path, args: &[&str], ready_path: &str, dir: &Path) -> (Process, u16) {
    for _attempt in 0..3 {
        let port = free_port();
        let log = dir.join(format!("server-{port}.log"));
        let log_file = std::fs::File::create(&log).expect("server log");
        let args: Vec<String> = args
            .iter()
            .map(|a| a.replace("{port}", &port.to_string()))
            .collect();
        let child = Command::new(program)
            .args(&args)
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().expect("log fd"))
            .stderr(log_file)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", program.display()));
        let mut process = Process { child, log };
        let client = http();
        let url = format!("http://127.0.0.1:{port}{ready_path}");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(Some(status)) = process.child.try_wait() {
                eprintln!(
                    "{} exited with {status} on port {port}; retrying. Log:\n{}",
                    program.display(),
                    process.log()
                );
                break;
            }
            if let Ok(r) = client.get(&url).send().await {
                if r.status().is_success() {
                    return (process, port);
                }
            }
            assert!(
                Instant::now() < deadline,
                "{} did not become ready on port {port} within 30 s. Log:\n{}",
                program.display(),
                process.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    panic!("{} failed to start three times", program.display());
}

/// The `llmock` server.
pub struct Llmock {
    process: Process,
    _dir: tempfile::TempDir,
    port: u16,
    http: reqwest::Client,
}

impl Llmock {
    /// `None` (test skips) when llmock is not installed.
    pub async fn start() -> Option<Llmock> {
        let bin = venv_bin("llmock")?;
        let dir = tempfile::tempdir().expect("tempdir");
        let (process, port) = spawn(
            &bin,
            &[
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                "{port}",
                "--log-level",
                "warning",
                "--tool-mode",
                "off",
            ],
            "/health",
            dir.path(),
        )
        .await;
        Some(Llmock {
            process,
            _dir: dir,
            port,
            http: http(),
        })
    }

    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}/v1", self.port)
    }

    /// Queues behaviours (`{"type": "fail", "status": 429, ...}`).
    pub async fn script(&self, behaviors: serde_json::Value) {
        let r = self
            .http
            .post(format!("http://127.0.0.1:{}/_llmock/scenario", self.port))
            .json(&serde_json::json!({ "behaviors": behaviors }))
            .send()
            .await
            .expect("llmock scenario");
        assert!(
            r.status().is_success(),
            "llmock refused the scenario: {}",
            r.text().await.unwrap_or_default()
        );
    }

    /// Forgets the journal and every queued behaviour.
    pub async fn reset(&self) {
        self.http
            .post(format!("http://127.0.0.1:{}/_llmock/reset", self.port))
            .send()
            .await
            .expect("llmock reset");
    }

    /// Every chat request served, oldest first (waits for ones in flight).
    pub async fn requests(&self) -> Vec<serde_json::Value> {
        let v: serde_json::Value = self
            .http
            .get(format!("http://127.0.0.1:{}/_llmock/requests", self.port))
            .send()
            .await
            .expect("llmock requests")
            .json()
            .await
            .expect("llmock requests json");
        let mut out: Vec<serde_json::Value> = v["requests"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .filter(|r| r["path"].as_str() == Some("/v1/chat/completions"))
            .collect();
        out.sort_by_key(|r| r["seq"].as_u64());
        out
    }

    /// Models of the chat requests, in order.
    pub async fn models(&self) -> Vec<String> {
        self.requests()
            .await
            .iter()
            .map(|r| r["model"].as_str().unwrap_or_default().to_string())
            .collect()
    }

    pub fn log(&self) -> String {
        self.process.log()
    }
}

/// The `fakellm` server, with a YAML rule file.
pub struct FakeLlm {
    process: Process,
    _dir: tempfile::TempDir,
    port: u16,
    http: reqwest::Client,
}

impl FakeLlm {
    /// `None` (test skips) when fakellm is not installed.
    pub async fn start(rules_yaml: &str) -> Option<FakeLlm> {
        let bin = venv_bin("fakellm")?;
        let dir = tempfile::tempdir().expect("tempdir");
        let config = dir.path().join("fakellm.yaml");
        std::fs::write(&config, rules_yaml).expect("write fakellm.yaml");
        let config = config.to_string_lossy().into_owned();
        let (process, port) = spawn(
            &bin,
            &[
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                "{port}",
                "--config",
                &config,
            ],
            "/_fakellm/stats",
            dir.path(),
        )
        .await;
        Some(FakeLlm {
            process,
            _dir: dir,
            port,
            http: http(),
        })
    }

    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}/v1", self.port)
    }

    /// Requests served per rule name.
    pub async fn by_rule(&self) -> std::collections::BTreeMap<String, u64> {
        let v: serde_json::Value = self
            .http
            .get(format!("http://127.0.0.1:{}/_fakellm/stats", self.port))
            .send()
            .await
            .expect("fakellm stats")
            .json()
            .await
            .expect("fakellm stats json");
        v["by_rule"]
            .as_object()
            .map(|m| {
                m.iter()
                    .map(|(k, v)| (k.clone(), v.as_u64().unwrap_or(0)))
                    .collect()
            })
            .unwrap_or_default()
    }

    pub async fn total(&self) -> u64 {
        self.by_rule().await.values().sum()
    }
}

/// One request the scripted server received.
#[derive(Debug, Clone)]
pub struct Received {
    pub at: Instant,
    pub body: serde_json::Value,
    pub headers: Vec<(String, String)>,
}

impl Received {
    pub fn model(&self) -> String {
        self.body["model"].as_str().unwrap_or_default().to_string()
    }
}

/// What the scripted server answers.
#[derive(Debug, Clone)]
pub struct Scripted {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
    /// Held before answering; a client closing the connection meanwhile is
    /// recorded in [`ScriptedServer::disconnects`].
    pub delay: Duration,
}

impl Scripted {
    pub fn json(status: u16, body: serde_json::Value) -> Scripted {
        Scripted {
            status,
            headers: Vec::new(),
            body: body.to_string(),
            delay: Duration::ZERO,
        }
    }

    pub fn header(mut self, name: &str, value: &str) -> Scripted {
        self.headers.push((name.to_string(), value.to_string()));
        self
    }

    /// A 200 whose completion is [`handover_answer`] to `req`: what the
    /// tests' diligent model says.
    pub fn handover(req: &Received) -> Scripted {
        Scripted::json(200, completion(&req.model(), &handover_answer(&req.body)))
    }

    pub fn delayed(mut self, delay: Duration) -> Scripted {
        self.delay = delay;
        self
    }
}

type Responder = dyn Fn(&Received) -> Scripted + Send + Sync;

/// A minimal HTTP/1.1 server (one request a connection) answering from a
/// closure and recording requests and early client disconnects.
pub struct ScriptedServer {
    port: u16,
    received: Arc<Mutex<Vec<Received>>>,
    disconnects: Arc<Mutex<Vec<Instant>>>,
    task: tokio::task::JoinHandle<()>,
}

impl ScriptedServer {
    pub async fn start(
        responder: impl Fn(&Received) -> Scripted + Send + Sync + 'static,
    ) -> ScriptedServer {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let received = Arc::new(Mutex::new(Vec::new()));
        let disconnects = Arc::new(Mutex::new(Vec::new()));
        let responder: Arc<Responder> = Arc::new(responder);
        let (r, d) = (received.clone(), disconnects.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let (r, d, responder) = (r.clone(), d.clone(), responder.clone());
                tokio::spawn(async move {
                    let _ = serve_one(stream, r, d, responder).await;
                });
            }
        });
        ScriptedServer {
            port,
            received,
            disconnects,
            task,
        }
    }

    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}/v1", self.port)
    }

    pub fn received(&self) -> Vec<Received> {
        self.received.lock().unwrap().clone()
    }

    /// When clients closed their connection before the answer was sent.
    pub fn disconnects(&self) -> Vec<Instant> {
        self.disconnects.lock().unwrap().clone()
    }
}

impl Drop for ScriptedServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve_one(
    mut stream: tokio::net::TcpStream,
    received: Arc<Mutex<Vec<Received>>>,
    disconnects: Arc<Mutex<Vec<Instant>>>,
    responder: Arc<Responder>,
) -> std::io::Result<()> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(pos) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break pos + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut headers = Vec::new();
    for line in head.lines().skip(1) {
        if let Some((k, v)) = line.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    let length: usize = headers
        .iter()
        .find(|(k, _)| k == "content-length")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    while buf.len() < head_end + length {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let body = serde_json::from_slice(&buf[head_end..head_end + length])
        .unwrap_or(serde_json::Value::Null);
    let request = Received {
        at: Instant::now(),
        body,
        headers,
    };
    received.lock().unwrap().push(request.clone());
    let answer = responder(&request);
    if !answer.delay.is_zero() {
        // Hold the answer, but watch the socket: a read of 0 bytes means the
        // client closed the connection (its call was cancelled).
        let mut probe = [0u8; 1];
        tokio::select! {
            _ = tokio::time::sleep(answer.delay) => {}
            r = stream.read(&mut probe) => {
                if matches!(r, Ok(0) | Err(_)) {
                    disconnects.lock().unwrap().push(Instant::now());
                    return Ok(());
                }
            }
        }
    }
    let reason = match answer.status {
        200 => "OK",
        401 => "Unauthorized",
        403 => "Forbidden",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Status",
    };
    let mut out = format!(
        "HTTP/1.1 {} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n",
        answer.status,
        answer.body.len()
    );
    for (k, v) in &answer.headers {
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    out.push_str("\r\n");
    out.push_str(&answer.body);
    stream.write_all(out.as_bytes()).await?;
    stream.shutdown().await
}

/// An OpenAI-shaped completion body with `content`.
pub fn completion(model: &str, content: &str) -> serde_json::Value {
    serde_json::json!({
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": 1,
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120}
    })
}

/// What a diligent small model answers to a summarizer request (the
/// OpenAI chat body): the handover shape the prompts ask for, keeping a
/// few content words of every user turn and child summary in the data
/// block, so validation's floor (the user's requests, as the deterministic
/// summary keeps them) holds, and different for every span. A rolling
/// state request is answered in its five sections.
pub fn handover_answer(body: &serde_json::Value) -> String {
    const GLUE: &[&str] = &[
        "that", "this", "with", "from", "have", "what", "when", "then", "there", "they", "them",
        "their", "would", "could", "should", "about", "into", "also", "just", "like", "want",
        "need", "please", "make", "sure", "some", "more", "very", "only", "which", "will", "does",
        "doing", "been", "were", "your", "here", "than", "each", "other",
    ];
    let prompt = body["messages"]
        .as_array()
        .and_then(|m| m.iter().rev().find(|m| m["role"] == "user"))
        .and_then(|m| m["content"].as_str())
        .unwrap_or_default();
    let data = prompt
        .find("<data-")
        .and_then(|start| {
            let rest = &prompt[start..];
            rest.find("</data-").map(|end| &rest[..end])
        })
        .unwrap_or(prompt);
    let mut asked: Vec<String> = Vec::new();
    let mut block: Option<Vec<String>> = None;
    let mut flush = |block: &mut Option<Vec<String>>| {
        if let Some(words) = block.take().filter(|w| !w.is_empty()) {
            asked.push(words.join(" "));
        }
    };
    for line in data.lines().skip(1) {
        let header = line.starts_with('[') && line.trim_end().ends_with(':');
        if header {
            flush(&mut block);
            // A user's turn or a child summary: what the floor counts.
            let user = line.contains("] user");
            let child = line.starts_with("[summary ") && line.contains("]:");
            block = (user || child).then(Vec::new);
            continue;
        }
        if let Some(words) = block.as_mut() {
            // Words and identifiers (`gamma-w0-0`, `src/lib.rs`) whole.
            for w in line.split_whitespace() {
                let w = w
                    .trim_matches(|c: char| !c.is_alphanumeric())
                    .to_lowercase();
                if words.len() < 12
                    && w.len() >= 4
                    && !GLUE.contains(&w.as_str())
                    && !words.contains(&w)
                {
                    words.push(w);
                }
            }
        }
    }
    flush(&mut block);
    let system = body["messages"][0]["content"].as_str().unwrap_or_default();
    if system.contains("rolling session state") {
        // Five lines of at most 200 characters: the newest request in
        // progress, the ones before it as far as they fit.
        let newest = asked.pop().unwrap_or_else(|| "none".into());
        let mut completed = String::from("the user raised");
        for a in asked.iter().rev() {
            if completed.len() + a.len() + 2 > 190 {
                break;
            }
            completed.push_str(if completed.ends_with("raised") {
                " "
            } else {
                "; "
            });
            completed.push_str(a);
        }
        let newest: String = newest.chars().take(190).collect();
        return format!(
            "Completed: {completed}\nIn progress: {newest}\nDecisions: none\nBlockers: none\n\
             Next: carry on where the user left off"
        );
    }
    let asked = if asked.is_empty() {
        "nothing new".to_string()
    } else {
        asked.join("; ")
    };
    // The files the span's calls name (`"file_path": "…"`, `"path": "…"`)
    // or its child summaries list, one a line, as a model lists them.
    let mut files: Vec<&str> = Vec::new();
    for key in [
        "\"file_path\":\"",
        "\"file_path\": \"",
        "\"path\":\"",
        "\"path\": \"",
    ] {
        for (at, _) in data.match_indices(key) {
            let rest = &data[at + key.len()..];
            if let Some(path) = rest.split('"').next().filter(|p| !p.is_empty()) {
                if files.len() < 24 && !files.contains(&path) {
                    files.push(path);
                }
            }
        }
    }
    let mut in_files = false;
    for line in data.lines() {
        let line = line.trim();
        if let Some(heading) = line.strip_prefix("## ") {
            in_files = heading.eq_ignore_ascii_case("files changed");
        } else if in_files {
            let entry = line.trim_start_matches("- ");
            let path = entry.split(" (").next().unwrap_or(entry).trim();
            if !path.is_empty() && files.len() < 24 && !files.contains(&path) {
                files.push(path);
            }
        }
    }
    let files: String = files.iter().map(|f| format!("\n- {f}")).collect();
    let files = if files.is_empty() {
        String::new()
    } else {
        format!("\n## Files changed{files}")
    };
    // The errors the span shows (output lines that say one, or a child
    // summary's), quoted as a model quotes them.
    let mut errors: Vec<String> = Vec::new();
    for line in data.lines() {
        let line = line.trim().trim_start_matches("- ");
        let lower = line.to_lowercase();
        let says_error = [
            "error",
            "failed",
            "exception",
            "fatal",
            "no such file",
            "not found",
        ]
        .iter()
        .any(|w| lower.contains(w));
        if says_error && line.len() < 400 && errors.len() < 12 {
            let quoted: String = line.chars().take(200).collect();
            if !errors.contains(&quoted) {
                errors.push(quoted);
            }
        }
    }
    let errors: String = errors.iter().map(|e| format!("\n- {e}")).collect();
    let errors = if errors.is_empty() {
        String::new()
    } else {
        format!("\n## Errors{errors}")
    };
    format!(
        "## Task\nThe user raised, in order: {asked}.{files}{errors}\n## Next\nCarry on where the user left off."
    )
}

/// A plain nats-server (no JetStream) for the external summarizer's
/// request/reply test. The binary is the one `scripts/install-nats.sh`
/// installs: `$CONTEXTFOLD_NATS_SERVER`, else `nats-server` in
/// `$CONTEXTFOLD_VENV/bin`, `.venv/bin` or `.venv-llm/bin`.
pub struct NatsForTests {
    process: Process,
    port: u16,
    _dir: tempfile::TempDir,
}

impl NatsForTests {
    /// `None` (test skips) when no nats-server is installed.
    pub async fn start() -> Option<NatsForTests> {
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut candidates: Vec<PathBuf> = Vec::new();
        if let Some(p) = std::env::var_os("CONTEXTFOLD_NATS_SERVER") {
            candidates.push(PathBuf::from(p));
        }
        if let Some(v) = std::env::var_os("CONTEXTFOLD_VENV") {
            candidates.push(PathBuf::from(v).join("bin/nats-server"));
        }
        candidates.push(manifest.join(".venv/bin/nats-server"));
        candidates.push(manifest.join(".venv-llm/bin/nats-server"));
        let Some(bin) = candidates.into_iter().find(|p| p.is_file()) else {
            let msg = "no nats-server found: run scripts/install-nats.sh (or set CONTEXTFOLD_NATS_SERVER)";
            if std::env::var_os("CONTEXTFOLD_REQUIRE_LLM_SERVERS").is_some() {
                panic!("CONTEXTFOLD_REQUIRE_LLM_SERVERS is set but {msg}");
            }
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "SKIPPED: {msg}");
            return None;
        };
        let dir = tempfile::tempdir().expect("tempdir");
        for _attempt in 0..3 {
            let port = free_port();
            let log = dir.path().join(format!("nats-{port}.log"));
            let log_file = std::fs::File::create(&log).expect("nats log");
            let child = Command::new(&bin)
                .args(["-a", "127.0.0.1", "-p", &port.to_string()])
                .stdin(Stdio::null())
                .stdout(log_file.try_clone().expect("log fd"))
                .stderr(log_file)
                .spawn()
                .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
            let mut process = Process { child, log };
            let deadline = Instant::now() + Duration::from_secs(15);
            loop {
                if let Ok(Some(_)) = process.child.try_wait() {
                    break;
                }
                if async_nats::connect(format!("nats://127.0.0.1:{port}"))
                    .await
                    .is_ok()
                {
                    return Some(NatsForTests {
                        process,
                        port,
                        _dir: dir,
                    });
                }
                assert!(
                    Instant::now() < deadline,
                    "nats-server not ready on {port}: {}",
                    process.log()
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        panic!("nats-server failed to start three times");
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}
