//! The operators' HTTP server of the `serve` binary (`--http`), checked from
//! outside: `/healthz` and `/readyz` as docs/operations.md documents them,
//! and a real Prometheus scraping `/metrics` and answering a PromQL query
//! with the number of turns the service folded.
//!
//! Prometheus is the Debian package (`scripts/test.sh` installs it); the
//! test skips with a message when it is missing, unless
//! `CONTEXTFOLD_REQUIRE_PROMETHEUS` is set. `CONTEXTFOLD_PROMETHEUS` names
//! the binary when it is not `prometheus` on the `PATH`.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};
use support::nats_server::{free_port, NatsServer};
use support::serve::raw_publish;
use support::turns::turns;

fn prometheus_binary() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("CONTEXTFOLD_PROMETHEUS") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/sbin")])
        .map(|d| d.join("prometheus"))
        .find(|p| p.is_file())
}

async fn get(http: &reqwest::Client, url: &str) -> Option<(u16, String)> {
    let resp = http.get(url).send().await.ok()?;
    let status = resp.status().as_u16();
    Some((status, resp.text().await.ok()?))
}

async fn wait_for<T>(what: &str, limit: Duration, mut probe: impl AsyncFnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = probe().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A Prometheus instance scraping one target every second, killed on drop.
struct Prometheus {
    // Held for kill_on_drop.
    _child: tokio::process::Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    fn start(binary: &PathBuf, target: &str) -> Prometheus {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
                 scrape_configs:\n  - job_name: contextfold\n    scrape_interval: 1s\n    \
                 static_configs:\n      - targets: ['{target}']\n"
            ),
        )
        .unwrap();
        let port = free_port();
        let log = std::fs::File::create(dir.path().join("prometheus.log")).unwrap();
        let child = tokio::process::Command::new(binary)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .expect("prometheus starts");
        Prometheus {
            _child: child,
            port,
            _dir: dir,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self._dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// The value of an instant query's single sample, if there is one.
    async fn query(&self, http: &reqwest::Client, promql: &str) -> Option<f64> {
        let resp = http
            .get(format!("http://127.0.0.1:{}/api/v1/query", self.port))
            .query(&[("query", promql)])
            .send()
            .await
            .ok()?;
        let body: serde_json::Value = resp.json().await.ok()?;
        let value = body["data"]["result"].get(0)?["value"].get(1)?.as_str()?;
        value.parse().ok()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_serve_and_readiness_follows_nats() {
    let Some(prometheus) = prometheus_binary() else {
        assert!(
            std::env::var_os("CONTEXTFOLD_REQUIRE_PROMETHEUS").is_none(),
            "CONTEXTFOLD_REQUIRE_PROMETHEUS is set but no prometheus binary was found \
             (apt-get install -y prometheus, or set CONTEXTFOLD_PROMETHEUS)"
        );
        eprintln!(
            "skipping: no prometheus binary (apt-get install -y prometheus, or set \
             CONTEXTFOLD_PROMETHEUS); set CONTEXTFOLD_REQUIRE_PROMETHEUS=1 to fail instead"
        );
        return;
    };
    // The server is down while serve starts: serve keeps trying to connect.
    let mut server = NatsServer::start();
    server.kill();

    let dir = tempfile::tempdir().unwrap();
    let http_port = free_port();
    let target = format!("127.0.0.1:{http_port}");
    let stderr = std::fs::File::create(dir.path().join("serve.log")).unwrap();
    let mut serve = tokio::process::Command::new(env!("CARGO_BIN_EXE_contextfold"))
        .arg("--data")
        .arg(dir.path().join("serve"))
        .args(["--log-format", "json"])
        .args(["serve", "--nats", &server.url(), "--http", &target])
        .env_remove("CONTEXTFOLD_CONFIG")
        .env(
            "CONTEXTFOLD_NATS__CONNECTION__RETRY_ON_INITIAL_CONNECT",
            "true",
        )
        .env("CONTEXTFOLD_NATS__STORAGE", "memory")
        .env("CONTEXTFOLD_LOG", "contextfold=info")
        .stderr(stderr)
        .kill_on_drop(true)
        .spawn()
        .expect("contextfold serve starts");
    let serve_log = || std::fs::read_to_string(dir.path().join("serve.log")).unwrap_or_default();

    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let base = format!("http://{target}");

    // Alive at once; not ready while NATS is unreachable.
    let (status, body) = wait_for("/healthz", Duration::from_secs(30), async || {
        get(&http, &format!("{base}/healthz")).await
    })
    .await;
    assert_eq!((status, body.as_str()), (200, "ok\n"), "{}", serve_log());
    let (status, body) = get(&http, &format!("{base}/readyz")).await.unwrap();
    assert_eq!(status, 503, "{body}");
    let report: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(report["ready"], false, "{body}");
    assert_eq!(report["checks"][0]["name"], "streams", "{body}");
    assert_eq!(report["checks"][0]["ok"], false, "{body}");

    // NATS comes up: streams validated, leases joined, ready.
    server.restart();
    let body = wait_for("/readyz 200", Duration::from_secs(60), async || match get(
        &http,
        &format!("{base}/readyz"),
    )
    .await
    {
        Some((200, body)) => Some(body),
        _ => None,
    })
    .await;
    let report: serde_json::Value = serde_json::from_str(&body).unwrap();
    let names: Vec<&str> = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(names, ["streams", "connected", "leases", "partitions"]);

    // The exposition names the families operators query.
    let (status, text) = get(&http, &format!("{base}/metrics")).await.unwrap();
    assert_eq!(status, 200);
    assert!(text.contains("contextfold_ready 1"), "{text}");
    assert!(text.contains("contextfold_partitions_held"), "{text}");

    let prom = Prometheus::start(&prometheus, &target);
    let client = async_nats::connect(server.url()).await.unwrap();
    let published = turns("ops:one", 0..5, 8)
        .into_iter()
        .chain(turns("ops:two", 0..4, 8))
        .collect::<Vec<_>>();
    raw_publish(&client, &published).await;

    let want = published.len() as f64;
    let got = wait_for(
        "Prometheus to see every folded turn",
        Duration::from_secs(90),
        async || {
            prom.query(
                &http,
                "sum(contextfold_events_folded_total{job=\"contextfold\"})",
            )
            .await
            .filter(|v| *v >= want)
        },
    )
    .await;
    assert_eq!(
        got,
        want,
        "serve log:\n{}\nprometheus log:\n{}",
        serve_log(),
        prom.log()
    );
    let up = prom.query(&http, "up{job=\"contextfold\"}").await;
    assert_eq!(up, Some(1.0));

    // Histograms are histograms (buckets a dashboard can take quantiles
    // of), with the buckets src/telemetry.rs sets.
    let (_, text) = get(&http, &format!("{base}/metrics")).await.unwrap();
    for series in [
        "contextfold_folder_batch_records_bucket{le=\"512\"}",
        "contextfold_state_commit_seconds_bucket{le=\"0.0005\"}",
        "contextfold_state_commits_total",
    ] {
        assert!(text.contains(series), "{series} missing:\n{text}");
    }

    let _ = serve.start_kill();
    let _ = serve.wait().await;

    // --log-format json: every log line is one JSON object; the banner
    // lines of the command stay plain text.
    let log = serve_log();
    let events: Vec<serde_json::Value> = log
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert!(
        events
            .iter()
            .any(|e| e["fields"]["message"] == "folder role started" && e["level"] == "INFO"),
        "{log}"
    );
    drop(prom);
}
