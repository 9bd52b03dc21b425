//! The operators' HTTP server of the `serve` binary (`--http`), checked from
//! outside: `/healthz` and `/readyz` as docs/operations.md documents them,
//! and a real Prometheus scraping `/metrics` and answering a PromQL query
//! with the number of turns the service folded.
//!
//! A second test holds what the deploy/ files are written against: every
//! family `src/telemetry.rs` documents is in the first scrape, before any
//! event; after traffic (turns folded and compacted by a model, a spend
//! window closed, a dead letter, assembles), every Grafana dashboard query
//! and every alert expression, evaluated by a real Prometheus scraping the
//! service, returns series, and the dead-letter and spend alerts fire on
//! their first event.
//!
//! Prometheus is the Debian package (`scripts/test.sh` installs it); the
//! tests skip with a message when it is missing, unless
//! `CONTEXTFOLD_REQUIRE_PROMETHEUS` is set. `CONTEXTFOLD_PROMETHEUS` names
//! the binary when it is not `prometheus` on the `PATH`.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "support/llm_server.rs"]
mod llm_server;
mod support;

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};
use support::nats_server::{free_port, NatsServer};
use support::serve::{raw_publish, token};
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
        Prometheus::start_with_rules(binary, target, None)
    }

    /// Scraping `target` every second, evaluating the rules of `rules`
    /// (a copy of the file) every second.
    fn start_with_rules(
        binary: &PathBuf,
        target: &str,
        rules: Option<&std::path::Path>,
    ) -> Prometheus {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("prometheus.yml");
        let rule_files = match rules {
            Some(file) => {
                let copy = dir.path().join("rules.yml");
                std::fs::copy(file, &copy).unwrap();
                format!("rule_files:\n  - '{}'\n", copy.display())
            }
            None => String::new(),
        };
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n{rule_files}\
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

    /// Every series an instant query returns (labels, value), or the error
    /// Prometheus gave.
    async fn series(
        &self,
        http: &reqwest::Client,
        promql: &str,
    ) -> Result<Vec<(serde_json::Value, String)>, String> {
        let body: serde_json::Value = self.api(http, "query", &[("query", promql)]).await?;
        if body["status"] != "success" {
            return Err(body.to_string());
        }
        Ok(body["data"]["result"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|r| {
                (
                    r["metric"].clone(),
                    r["value"][1].as_str().unwrap_or_default().to_string(),
                )
            })
            .collect())
    }

    async fn api(
        &self,
        http: &reqwest::Client,
        path: &str,
        query: &[(&str, &str)],
    ) -> Result<serde_json::Value, String> {
        let resp = http
            .get(format!("http://127.0.0.1:{}/api/v1/{path}", self.port))
            .query(query)
            .send()
            .await
            .map_err(|e| e.to_string())?;
        resp.json().await.map_err(|e| e.to_string())
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

/// Every PromQL expression of the Grafana dashboard's panels, with its panel
/// title, Grafana's variables given the values a dashboard of one
/// Prometheus gives them.
fn dashboard_queries() -> Vec<(String, String)> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy/grafana/dashboards/contextfold.json");
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut out = Vec::new();
    let mut panels: Vec<&serde_json::Value> =
        dashboard["panels"].as_array().unwrap().iter().collect();
    while let Some(panel) = panels.pop() {
        if let Some(inner) = panel["panels"].as_array() {
            panels.extend(inner);
        }
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"]
                .as_str()
                .unwrap()
                .replace("$__rate_interval", "1m")
                .replace("$instance", ".*");
            out.push((
                format!("panel {}", panel["title"].as_str().unwrap_or_default()),
                expr,
            ));
        }
    }
    out.reverse();
    out
}

/// An alert expression turned into one that returns its series whatever
/// their value: each comparison with a number gets `bool` (`x > 0` is 1 or
/// 0 instead of filtering), so the check sees what the rule compares.
fn unfiltered(expr: &str) -> String {
    regex::Regex::new(r"(==|!=|>=|<=|>|<)(\s*-?[0-9])")
        .unwrap()
        .replace_all(expr, "$1 bool$2")
        .into_owned()
}

fn short(expr: &str, n: usize) -> String {
    let one_line: String = expr.split_whitespace().collect::<Vec<_>>().join(" ");
    if one_line.chars().count() <= n {
        one_line
    } else {
        format!("{}…", one_line.chars().take(n - 1).collect::<String>())
    }
}

/// The families of an exposition: `# TYPE` lines, and the number of
/// samples of each.
fn exposition_families(text: &str) -> std::collections::BTreeMap<String, (String, usize)> {
    let mut out = std::collections::BTreeMap::<String, (String, usize)>::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut it = rest.split_whitespace();
            if let (Some(name), Some(kind)) = (it.next(), it.next()) {
                out.insert(name.to_string(), (kind.to_string(), 0));
            }
        } else if !line.starts_with('#') && !line.is_empty() {
            let name = line.split(['{', ' ']).next().unwrap_or_default();
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s).filter(|f| out.contains_key(*f)))
                .unwrap_or(name);
            if let Some(entry) = out.get_mut(family) {
                entry.1 += 1;
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_family_is_exported_from_start_up_and_every_dashboard_and_alert_query_answers() {
    let Some(prometheus) = prometheus_binary() else {
        assert!(
            std::env::var_os("CONTEXTFOLD_REQUIRE_PROMETHEUS").is_none(),
            "CONTEXTFOLD_REQUIRE_PROMETHEUS is set but no prometheus binary was found \
             (apt-get install -y prometheus, or set CONTEXTFOLD_PROMETHEUS)"
        );
        eprintln!("skipping: no prometheus binary (apt-get install -y prometheus)");
        return;
    };
    // A model that answers every summary request differently, in the
    // handover shape and keeping the user's words (one fixed text would be
    // refused as a copy, an echo as below the deterministic summary).
    let llm = llm_server::ScriptedServer::start(llm_server::Scripted::handover).await;
    let server = NatsServer::start();
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
        .env("OPENAI_API_KEY", "test-key-not-secret")
        .env("CONTEXTFOLD_NATS__STORAGE", "memory")
        .env("CONTEXTFOLD_SUMMARIZER__BASE_URL", llm.base_url())
        .env("CONTEXTFOLD_SUMMARIZER__MODEL", "good")
        .env("CONTEXTFOLD_POLICY__DEFAULT_CONTEXT_WINDOW", "6000")
        .env("CONTEXTFOLD_POLICY__FRESH_TAIL_COUNT", "6")
        .env("CONTEXTFOLD_POLICY__LEAF_CHUNK_TOKENS", "1200")
        .env("CONTEXTFOLD_POLICY__LEAF_TARGET_TOKENS", "200")
        // Three model calls a window (a rolling state and two summaries):
        // a conversation with more to compact then waits, its spend window
        // closed.
        .env("CONTEXTFOLD_POLICY__SUMMARY_MAX_CALLS_PER_WINDOW", "3")
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

    // The first scrape, before any event: every documented family.
    let text = wait_for(
        "the first /metrics",
        Duration::from_secs(30),
        async || match get(&http, &format!("{base}/metrics")).await {
            Some((200, text)) => Some(text),
            _ => None,
        },
    )
    .await;
    let families = exposition_families(&text);
    eprintln!("/metrics at start-up (no event yet): family, type, samples");
    let mut missing = Vec::new();
    for &(name, kind, _) in contextfold::telemetry::FAMILIES {
        let kind = format!("{kind:?}").to_lowercase();
        match families.get(name) {
            Some((exported, samples)) => {
                eprintln!("  {name:<48} {exported:<9} {samples}");
                assert_eq!(exported, &kind, "{name}");
                assert!(*samples > 0, "{name} has no sample at start-up");
            }
            None => missing.push(name),
        }
    }
    assert!(
        missing.is_empty(),
        "families missing from the first scrape: {missing:?}\n{text}"
    );
    for sample in [
        "contextfold_jobs_dead_lettered_total{reason=\"undecodable\"} 0",
        "contextfold_spend_windows_closed_total{window=\"spend_window\"} 0",
        "contextfold_summarizer_calls_total{model=\"good\",outcome=\"ok\"} 0",
        "contextfold_clock_ticks_total{partition=\"15\"} 0",
    ] {
        assert!(text.contains(sample), "no `{sample}` at start-up:\n{text}");
    }

    let alerts =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/prometheus/alerts.yml");
    let prom = Prometheus::start_with_rules(&prometheus, &target, Some(&alerts));
    wait_for("/readyz 200", Duration::from_secs(60), async || {
        matches!(get(&http, &format!("{base}/readyz")).await, Some((200, _))).then_some(())
    })
    .await;
    // Scraped at 0 first, so the first events below are increases.
    wait_for(
        "Prometheus's first scrape",
        Duration::from_secs(30),
        async || {
            prom.query(
                &http,
                "contextfold_jobs_dead_lettered_total{reason=\"undecodable\"}",
            )
            .await
        },
    )
    .await;

    // Traffic: three conversations compacted by the model, republished
    // events (duplicates), an undecodable record (a refusal), assembles,
    // and an undecodable job (a dead letter).
    let client = async_nats::connect(server.url()).await.unwrap();
    let keys = ["ops:alpha", "ops:beta", "ops:gamma"];
    let published: Vec<_> = keys
        .iter()
        .flat_map(|k| support::turns::turns(k, 0..80, 60))
        .collect();
    raw_publish(&client, &published).await;
    raw_publish(&client, &published[..3]).await;
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", "not-an-event-1");
    client
        .publish_with_headers(
            format!("cf.in.{}", token(keys[0])),
            headers,
            "{not json".into(),
        )
        .await
        .unwrap();
    client
        .publish(format!("cf.job.{}", token(keys[1])), "not a job".into())
        .await
        .unwrap();
    client.flush().await.unwrap();

    let need = [
        (
            "sum(contextfold_events_folded_total)",
            published.len() as f64,
        ),
        ("sum(contextfold_events_duplicate_total)", 1.0),
        ("sum(contextfold_events_rejected_total)", 1.0),
        ("sum(contextfold_summaries_written_total)", 1.0),
        (
            "sum(contextfold_summarizer_calls_total{model=\"good\"})",
            1.0,
        ),
        ("sum(contextfold_jobs_dead_lettered_total)", 1.0),
        ("sum(contextfold_spend_windows_closed_total)", 1.0),
    ];
    for (promql, at_least) in need {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let got = prom.query(&http, promql).await.unwrap_or(0.0);
            if got >= at_least {
                break;
            }
            let exited = serve.try_wait().ok().flatten();
            if exited.is_some() || Instant::now() >= deadline {
                let log = serve_log();
                let tail: Vec<&str> = log.lines().rev().take(60).collect();
                panic!(
                    "{promql} is {got}, wanted {at_least} (serve exited: {exited:?}; model \
                     requests {}); serve log, newest first:\n{}",
                    llm.received().len(),
                    tail.join("\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
    for key in keys {
        let reply = client
            .request(
                format!("cf.api.assemble.{}", token(key)),
                serde_json::json!({ "conversation": key })
                    .to_string()
                    .into(),
            )
            .await
            .unwrap();
        let body: serde_json::Value = serde_json::from_slice(&reply.payload).unwrap();
        assert!(body["messages"].is_array(), "{body}");
    }
    wait_for("assembles scraped", Duration::from_secs(30), async || {
        prom.query(&http, "sum(contextfold_assemble_seconds_count)")
            .await
            .filter(|n| *n >= keys.len() as f64)
    })
    .await;

    // The dead-letter and spend alerts fire on their first event.
    let firing = wait_for("the alerts to fire", Duration::from_secs(60), async || {
        let body = prom.api(&http, "alerts", &[]).await.ok()?;
        let firing: std::collections::BTreeMap<String, serde_json::Value> = body["data"]["alerts"]
            .as_array()?
            .iter()
            .filter(|a| a["state"] == "firing")
            .map(|a| {
                (
                    a["labels"]["alertname"].as_str().unwrap_or("").to_string(),
                    a.clone(),
                )
            })
            .collect();
        (firing.contains_key("ContextfoldDeadLetters")
            && firing.contains_key("ContextfoldSpendWindowClosed"))
        .then_some(firing)
    })
    .await;
    eprintln!("\nalerts firing after the first dead letter and the first closed spend window:");
    for (name, alert) in &firing {
        eprintln!(
            "  {name}: labels {}, value {}, summary {:?}",
            alert["labels"],
            alert["value"],
            alert["annotations"]["summary"].as_str().unwrap_or_default()
        );
    }
    assert_eq!(
        firing["ContextfoldDeadLetters"]["labels"]["reason"], "undecodable",
        "{firing:?}"
    );
    assert_eq!(
        firing["ContextfoldSpendWindowClosed"]["labels"]["window"], "spend_window",
        "{firing:?}"
    );

    // Every rule Prometheus loaded is healthy, and every alert expression
    // and dashboard query returns series from what serve exports.
    let rules = prom.api(&http, "rules", &[]).await.unwrap();
    let mut queries = Vec::new();
    for group in rules["data"]["groups"].as_array().unwrap() {
        for rule in group["rules"].as_array().unwrap() {
            assert_eq!(rule["health"], "ok", "{rule}");
            queries.push((
                format!("alert {}", rule["name"].as_str().unwrap()),
                unfiltered(rule["query"].as_str().unwrap()),
            ));
        }
    }
    assert_eq!(queries.len(), 7, "{rules}");
    queries.extend(dashboard_queries());
    assert!(queries.len() >= 45, "{}", queries.len());
    eprintln!(
        "\nevery alert expression (comparisons as `bool`) and dashboard query after traffic:"
    );
    eprintln!("  {:<58} {:<86} {:>6}  values", "where", "query", "series");
    let mut empty = Vec::new();
    for (origin, promql) in &queries {
        let series = prom
            .series(&http, promql)
            .await
            .unwrap_or_else(|e| panic!("{origin}: {promql}: {e}"));
        let values: Vec<&str> = series.iter().take(3).map(|(_, v)| v.as_str()).collect();
        eprintln!(
            "  {:<58} {:<86} {:>6}  {}",
            short(origin, 58),
            short(promql, 86),
            series.len(),
            values.join(" ")
        );
        if series.is_empty() {
            empty.push(format!("{origin}: {promql}"));
        }
    }
    assert!(
        empty.is_empty(),
        "queries that return nothing from a running serve:\n  {}\nserve log:\n{}",
        empty.join("\n  "),
        serve_log()
    );
    let _ = serve.start_kill();
    let _ = serve.wait().await;
    drop(prom);
}
