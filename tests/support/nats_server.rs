//! Real nats-server processes for integration tests.
//!
//! Each [`NatsServer`] runs its own nats-server with JetStream on a free
//! loopback port and a temporary store directory, and is killed (and reaped)
//! on drop, so a test never touches another server's data. [`start_cluster`]
//! starts an N-node JetStream cluster on loopback whose nodes can be killed
//! and restarted (same ports, same store) to test fail-over.
//!
//! The binary comes from `CONTEXTFOLD_NATS_SERVER`, else
//! `$CONTEXTFOLD_VENV/bin/nats-server`, else `<crate>/.venv/bin/nats-server`
//! (where `scripts/install-nats.sh` puts it). Debian's nats-server is too
//! old (2.9) and is refused.

use std::fs;
use std::io::{BufRead, BufReader};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Oldest server the tests accept (subject transforms, multi-filter consumers).
const MIN_VERSION: (u64, u64, u64) = (2, 10, 0);

/// How long a starting server may take to accept connections.
const START_TIMEOUT: Duration = Duration::from_secs(15);

/// The nats-server binary, checked once per test binary.
pub fn nats_server_binary() -> PathBuf {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY
        .get_or_init(|| find_binary().unwrap_or_else(|e| panic!("{e}")))
        .clone()
}

/// The nats-server binary, or why there is none usable (for a caller that
/// skips instead of failing, as the benchmarks do).
pub fn find_binary() -> Result<PathBuf, String> {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut candidates = Vec::new();
    if let Some(path) = std::env::var_os("CONTEXTFOLD_NATS_SERVER") {
        candidates.push(PathBuf::from(path));
    }
    if let Some(venv) = std::env::var_os("CONTEXTFOLD_VENV") {
        candidates.push(PathBuf::from(venv).join("bin/nats-server"));
    }
    candidates.push(manifest.join(".venv/bin/nats-server"));
    let Some(binary) = candidates.iter().find(|p| p.is_file()) else {
        return Err(format!(
            "no nats-server binary found (looked at {candidates:?}); run scripts/install-nats.sh \
             (CI installs it), or set CONTEXTFOLD_NATS_SERVER to a nats-server >= 2.10"
        ));
    };
    let output = Command::new(binary)
        .arg("--version")
        .output()
        .map_err(|e| format!("cannot run {}: {e}", binary.display()))?;
    let text = String::from_utf8_lossy(&output.stdout);
    let version = text
        .trim()
        .strip_prefix("nats-server: v")
        .and_then(parse_version)
        .ok_or_else(|| format!("unexpected `{} --version` output: {text}", binary.display()))?;
    if version < MIN_VERSION {
        return Err(format!(
            "{} is nats-server {version:?}, older than {MIN_VERSION:?}; run scripts/install-nats.sh",
            binary.display()
        ));
    }
    Ok(binary.clone())
}

fn parse_version(s: &str) -> Option<(u64, u64, u64)> {
    let core = s.split(['-', '+']).next()?;
    let mut parts = core.split('.').map(|p| p.parse::<u64>().ok());
    Some((
        parts.next()??,
        parts.next()??,
        parts.next().flatten().unwrap_or(0),
    ))
}

include!("free_port.rs");

/// Waits until a server on `port` greets with its INFO line, or the child dies.
fn wait_accepting(child: &mut Child, port: u16, log: &Path) -> Result<(), String> {
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!(
                "nats-server exited with {status}: {}",
                tail(log, 20)
            ));
        }
        if let Ok(stream) = TcpStream::connect(("127.0.0.1", port)) {
            let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
            let mut line = String::new();
            if BufReader::new(stream).read_line(&mut line).is_ok() && line.starts_with("INFO") {
                return Ok(());
            }
        }
        if Instant::now() > deadline {
            return Err(format!(
                "nats-server on port {port} not accepting after {START_TIMEOUT:?}: {}",
                tail(log, 20)
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn tail(path: &Path, lines: usize) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// One nats-server process with JetStream, killed on drop.
pub struct NatsServer {
    child: Option<Child>,
    port: u16,
    args: Vec<String>,
    log: PathBuf,
    // Held for its Drop: removes the store when the server goes.
    _dir: tempfile::TempDir,
}

impl NatsServer {
    /// Starts a standalone JetStream server on a free loopback port.
    pub fn start() -> NatsServer {
        let mut last_error = String::new();
        // A port picked free can be taken before the server binds it: retry.
        for _ in 0..3 {
            let dir = tempfile::tempdir().expect("temp dir for the nats store");
            let port = free_port();
            match NatsServer::spawn(dir, port, &[]) {
                Ok(server) => return server,
                Err(e) => last_error = e,
            }
        }
        panic!("could not start nats-server: {last_error}");
    }

    /// Starts a standalone JetStream server that also reads `conf_text` as
    /// its configuration file (e.g. an `authorization { ... }` block); the
    /// port, store and log flags still come from here.
    pub fn start_with_config(conf_text: &str) -> NatsServer {
        let mut last_error = String::new();
        for _ in 0..3 {
            let dir = tempfile::tempdir().expect("temp dir for the nats store");
            let conf = dir.path().join("nats-server.conf");
            fs::write(&conf, conf_text).expect("write the nats-server config file");
            let extra = ["-c".to_string(), conf.display().to_string()];
            match NatsServer::spawn(dir, free_port(), &extra) {
                Ok(server) => return server,
                Err(e) => last_error = e,
            }
        }
        panic!("could not start nats-server with config {conf_text:?}: {last_error}");
    }

    fn spawn(dir: tempfile::TempDir, port: u16, extra: &[String]) -> Result<NatsServer, String> {
        let store = dir.path().join("store");
        let log = dir.path().join("nats-server.log");
        let mut args: Vec<String> = vec![
            "-js".into(),
            "-a".into(),
            "127.0.0.1".into(),
            "-p".into(),
            port.to_string(),
            "-sd".into(),
            store.display().to_string(),
            "-l".into(),
            log.display().to_string(),
        ];
        args.extend_from_slice(extra);
        let mut server = NatsServer {
            child: None,
            port,
            args,
            log,
            _dir: dir,
        };
        server.launch()?;
        Ok(server)
    }

    fn launch(&mut self) -> Result<(), String> {
        let mut child = Command::new(nats_server_binary())
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("spawning nats-server: {e}"))?;
        if let Err(e) = wait_accepting(&mut child, self.port, &self.log) {
            let _ = child.kill();
            let _ = child.wait();
            return Err(e);
        }
        self.child = Some(child);
        Ok(())
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The server's process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Kills the process (SIGKILL, as a crash would) and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the process again on the same port with the same store.
    pub fn restart(&mut self) {
        self.kill();
        if let Err(e) = self.launch() {
            panic!("restarting nats-server on port {}: {e}", self.port);
        }
    }

    /// The last lines of the server's log, for failure messages.
    pub fn log_tail(&self, lines: usize) -> String {
        tail(&self.log, lines)
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A JetStream cluster of nats-server processes on loopback.
pub struct NatsCluster {
    pub nodes: Vec<NatsServer>,
}

/// Starts an `n`-node JetStream cluster (routes on loopback, one store
/// directory per node). Call [`wait_for_jetstream`] before using it: the
/// JetStream meta leader is elected after the nodes accept connections.
pub fn start_cluster(n: usize) -> NatsCluster {
    assert!(n >= 1, "a cluster needs at least one node");
    let mut last_error = String::new();
    // A port picked free can still be taken before a node binds it: retry
    // the whole cluster on fresh ports (the nodes started so far are dropped).
    for _ in 0..3 {
        match try_start_cluster(n) {
            Ok(cluster) => return cluster,
            Err(e) => last_error = e,
        }
    }
    panic!("could not start a {n}-node cluster: {last_error}");
}

fn try_start_cluster(n: usize) -> Result<NatsCluster, String> {
    let cluster_ports: Vec<u16> = (0..n).map(|_| free_port()).collect();
    let client_ports: Vec<u16> = (0..n).map(|_| free_port()).collect();
    let mut nodes = Vec::with_capacity(n);
    // Spawn every node before waiting on any: a node alone cannot elect.
    for i in 0..n {
        let routes: Vec<String> = cluster_ports
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .map(|(_, p)| format!("nats://127.0.0.1:{p}"))
            .collect();
        let extra = vec![
            "-n".to_string(),
            format!("cf-node-{i}"),
            "--cluster_name".to_string(),
            "cf-test".to_string(),
            "--cluster".to_string(),
            format!("nats://127.0.0.1:{}", cluster_ports[i]),
            "--routes".to_string(),
            routes.join(","),
        ];
        let dir = tempfile::tempdir().expect("temp dir for a cluster node");
        let node = NatsServer::spawn(dir, client_ports[i], &extra)
            .map_err(|e| format!("starting cluster node {i}: {e}"))?;
        nodes.push(node);
    }
    // A node greets on its client port before it binds its route port, so a
    // route port taken by someone else shows only as the node dying just after.
    std::thread::sleep(Duration::from_millis(200));
    for (i, node) in nodes.iter_mut().enumerate() {
        let exited = node
            .child
            .as_mut()
            .map(|c| matches!(c.try_wait(), Ok(Some(_))));
        if exited != Some(false) {
            return Err(format!("cluster node {i} exited: {}", node.log_tail(5)));
        }
    }
    Ok(NatsCluster { nodes })
}

impl NatsCluster {
    /// Every node's client URL.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(NatsServer::url).collect()
    }

    /// Comma-separated client URLs, as `async_nats::connect` accepts.
    pub fn url_list(&self) -> String {
        self.urls().join(",")
    }

    /// Kills node `i` (SIGKILL).
    pub fn kill_node(&mut self, i: usize) {
        self.nodes[i].kill();
    }

    /// Restarts node `i` with its ports and store.
    pub fn restart_node(&mut self, i: usize) {
        self.nodes[i].restart();
    }

    /// The node whose `server_name` is `name` (`cf-node-<i>`).
    pub fn index_of(&self, name: &str) -> Option<usize> {
        name.strip_prefix("cf-node-")?.parse().ok()
    }
}

/// Waits until JetStream answers account queries through `url` (a cluster
/// needs a meta leader first).
pub async fn wait_for_jetstream(url: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut last = String::new();
    while Instant::now() < deadline {
        match async_nats::connect(url).await {
            Ok(client) => {
                let js = async_nats::jetstream::new(client);
                match js.query_account().await {
                    Ok(_) => return,
                    Err(e) => last = e.to_string(),
                }
            }
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("JetStream not ready at {url} after 30 s: {last}");
}
