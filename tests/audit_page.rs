//! The audit page of `contextfold ui`, in a real headless Chromium (Debian
//! `chromium`): over a data directory folded from a shared transcript, the
//! page is opened with `#c=CONV&event=ID`, which makes it click the chart
//! point of event ID through its own click handler; the context it then
//! shows must be `assemble --at ID` of that event, message by message and
//! source by source. Screenshots of the same page (its deepest summary
//! drilled into too) and of `plot` are saved as `audit-page.png` and
//! `plot.png` in `CONTEXTFOLD_SCREENSHOT_DIR` (default the test's
//! temporary directory): the README's pictures come from
//! `CONTEXTFOLD_SCREENSHOT_DIR=docs/images cargo test --test audit_page`.
//!
//! A second test lists 2,001 conversations (2,000 generated beside the same
//! session): the page's search, sorts and paging, driven through the URL
//! fragment as a user's typing and clicks would be, reach every one of
//! them in natural order; the timeline reads as the CLI's sentences; the
//! DAG's bars carry their turn ranges on a turn axis; the chart is scaled
//! to the budget. Its screenshots are `audit-page-search.png`,
//! `audit-page-paging.png` and `audit-page-summary.png`.
//!
//! Without chromium the tests skip, unless `CONTEXTFOLD_REQUIRE_BROWSER`
//! is set (scripts/test.sh sets it), which makes them fail.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use contextfold::core::event::EventKind;
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use support::cli::{command, json_of, split};

const TRANSCRIPT: &str =
    "transcripts/claude-code_marot-spotter/fa812bfe-b295-4cca-9c2f-fdf01028cb46.jsonl";

/// Where the shared transcript is: `CONTEXTFOLD_SHARED_DATA` or
/// `../shared/data` beside the crate (as tests/corpus/mod.rs finds it).
fn shared_path(relative: &str) -> PathBuf {
    std::env::var_os("CONTEXTFOLD_SHARED_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/data"))
        .join(relative)
}

fn with_policy(cmd: &mut Command) -> &mut Command {
    // The window of the issue's scenario: this 358-turn session compacts
    // 15 times under it.
    cmd.env("CONTEXTFOLD_POLICY__DEFAULT_CONTEXT_WINDOW", "32000")
}

fn cli(data: &Path, args: &[&str]) -> (bool, String, String) {
    split(
        with_policy(&mut command(data, args))
            .output()
            .expect("the contextfold binary runs"),
    )
}

fn chromium() -> Option<PathBuf> {
    for name in ["chromium", "chromium-browser"] {
        for dir in std::env::var("PATH").unwrap_or_default().split(':') {
            let p = Path::new(dir).join(name);
            if p.is_file() {
                return Some(p);
            }
        }
    }
    if std::env::var_os("CONTEXTFOLD_REQUIRE_BROWSER").is_some_and(|v| v == "1") {
        panic!(
            "CONTEXTFOLD_REQUIRE_BROWSER=1 but no chromium on PATH: \
             `apt-get install -y --no-install-recommends chromium`"
        );
    }
    eprintln!("SKIPPED: no chromium on PATH (set CONTEXTFOLD_REQUIRE_BROWSER=1 to fail instead)");
    None
}

/// `contextfold ui` on a free loopback port; killed on drop.
struct Ui {
    child: Child,
    url: String,
}

impl Ui {
    fn start(data: &Path) -> Ui {
        let mut child = with_policy(&mut command(data, &["ui", "--port", "0"]))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("contextfold ui starts");
        let stdout = child.stdout.take().unwrap();
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).unwrap();
        let url = line
            .split_whitespace()
            .find(|w| w.starts_with("http://127.0.0.1:"))
            .unwrap_or_else(|| panic!("no loopback URL in {line:?}"))
            .to_string();
        Ui { child, url }
    }
}

impl Drop for Ui {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn browser(chromium: &Path, profile: &Path, extra: &[String], url: &str) -> std::process::Output {
    Command::new(chromium)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--hide-scrollbars",
            "--virtual-time-budget=30000",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(extra)
        .arg(url)
        .output()
        .expect("chromium runs")
}

fn unescape(s: &str) -> String {
    s.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&nbsp;", "\u{a0}")
        .replace("&amp;", "&")
}

/// The source label the page writes in `data-source`.
fn source_label(s: &Value) -> String {
    match s["kind"].as_str().unwrap_or_default() {
        "turn" => format!("turn:{}", s["seq"]),
        "summary" => format!("summary:{}", s["id"].as_str().unwrap_or_default()),
        "missing_tool_result" => format!(
            "missing_tool_result:{}",
            s["call_id"].as_str().unwrap_or_default()
        ),
        other => other.to_string(),
    }
}

fn content_text(m: &Value) -> String {
    match &m["content"] {
        Value::Null => String::new(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

#[test]
fn clicking_an_event_shows_what_assemble_at_that_event_gives() {
    let Some(chromium) = chromium() else { return };
    let path = shared_path(TRANSCRIPT);
    if !path.exists() {
        if std::env::var_os("CONTEXTFOLD_REQUIRE_BROWSER").is_some() {
            panic!("the shared transcript {} is missing", path.display());
        }
        eprintln!("SKIPPED: no {}", path.display());
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let (ok, out, err) = cli(&data, &["run", path.to_str().unwrap()]);
    assert!(ok, "run failed: {out}\n{err}");
    let (ok, out, err) = cli(&data, &["replay"]);
    assert!(ok, "{err}");
    let conv = out
        .lines()
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap_or_else(|| panic!("no conversation in {out}"))
        .to_string();
    let (ok, out, err) = cli(&data, &["audit", &conv, "--json"]);
    assert!(ok, "{err}");
    let audit = json_of(&out);
    assert!(
        audit["totals"]["compactions"].as_u64().unwrap() > 0,
        "no compaction"
    );
    // The event: the first one after an accepted summary whose context
    // holds a summary and raw turns (assembly opens summaries back into
    // their turns while the budget has room, so right after the first
    // compaction the summary is often sent as what it covers).
    let points = audit["points"].as_array().unwrap();
    let (event, want) = audit["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "summary" && e["accepted"] == true)
        .find_map(|summary| {
            let index = summary["index"].as_u64().unwrap() as usize + 1;
            let event = points[index.min(points.len() - 1)]["event_id"]
                .as_str()
                .unwrap()
                .to_string();
            let (ok, out, err) = cli(&data, &["assemble", &conv, "--at", &event, "--json"]);
            assert!(ok, "{err}");
            let want = json_of(&out);
            let holds_summary = want["sources"]
                .as_array()
                .unwrap()
                .iter()
                .any(|s| s["kind"] == "summary");
            holds_summary.then_some((event, want))
        })
        .expect("an event whose context holds a summary");

    let ui = Ui::start(&data);
    let fragment = |s: &str| {
        s.bytes()
            .map(|b| match b {
                b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' => {
                    (b as char).to_string()
                }
                _ => format!("%{b:02X}"),
            })
            .collect::<String>()
    };
    let url = format!(
        "{}#c={}&event={}",
        ui.url,
        fragment(&conv),
        fragment(&event)
    );
    let profile = dir.path().join("profile");
    let out = browser(
        &chromium,
        &profile,
        &[
            "--dump-dom".to_string(),
            "--window-size=1500,1150".to_string(),
        ],
        &url,
    );
    let dom = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        dom.contains(&format!("data-shown=\"{}\"", event.replace('"', "&quot;"))),
        "the page did not show event {event} (stderr: {})\n{}",
        String::from_utf8_lossy(&out.stderr),
        &dom[..dom.len().min(4000)]
    );

    // The context shown, message by message.
    let msg = regex::Regex::new(
        r#"(?s)<div class="msg" data-index="(\d+)" data-source="([^"]*)" data-role="([^"]*)">.*?<pre class="content">(.*?)</pre>"#,
    )
    .unwrap();
    let shown: Vec<(String, String, String)> = msg
        .captures_iter(&dom)
        .map(|c| (unescape(&c[2]), c[3].to_string(), unescape(&c[4])))
        .collect();
    let messages = want["messages"].as_array().unwrap();
    let sources = want["sources"].as_array().unwrap();
    assert_eq!(
        shown.len(),
        messages.len(),
        "messages shown vs assemble --at"
    );
    for (i, ((source, role, content), (m, s))) in
        shown.iter().zip(messages.iter().zip(sources)).enumerate()
    {
        assert_eq!(source, &source_label(s), "source of message {i}");
        assert_eq!(role, m["role"].as_str().unwrap(), "role of message {i}");
        assert_eq!(content, &content_text(m), "content of message {i}");
    }
    // The event's label in the context's title is the server's, from the
    // one table of event types (the page keeps none of its own).
    let page_audit = get_json(&format!("{}api/audit?c={}", ui.url, fragment(&conv)));
    let point = page_audit["audit"]["points"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["event_id"] == event.as_str())
        .expect("the event's point");
    let kind: EventKind = point["type"].as_str().unwrap().parse().unwrap();
    assert_eq!(point["label"], kind.label());
    let title = regex::Regex::new(r#"id="context-title"[^>]*>([^<]*)<"#).unwrap();
    let title = title
        .captures(&dom)
        .map(|c| unescape(&c[1]))
        .unwrap_or_default();
    assert!(
        title.starts_with(&format!(
            "What the model saw after #{} {} ",
            point["index"],
            kind.label()
        )),
        "{title}"
    );
    let tokens = regex::Regex::new(r#"id="context"[^>]*data-tokens="(\d+)""#).unwrap();
    let shown_tokens = tokens
        .captures(&dom)
        .map(|c| c[1].to_string())
        .unwrap_or_default();
    assert_eq!(shown_tokens, want["tokens"].to_string());

    // The pictures: the page with the event clicked and the deepest
    // summary drilled into, and `plot` of the same conversation.
    let shots = std::env::var_os("CONTEXTFOLD_SCREENSHOT_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| dir.path().to_path_buf());
    std::fs::create_dir_all(&shots).unwrap();
    let deepest = audit["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "summary" && e["accepted"] == true)
        .max_by_key(|e| e["depth"].as_u64())
        .and_then(|e| e["summary_id"].as_str())
        .unwrap()
        .to_string();
    let page = format!("{url}&summary={}", fragment(&deepest));
    screenshot(
        &chromium,
        &profile,
        &page,
        &shots.join("audit-page.png"),
        (1500, 1400),
    );
    let svg = dir.path().join("plot.svg");
    let (ok, _, err) = cli(&data, &["plot", &conv, "--out", svg.to_str().unwrap()]);
    assert!(ok, "{err}");
    let file_url = format!("file://{}", svg.display());
    screenshot(
        &chromium,
        &profile,
        &file_url,
        &shots.join("plot.png"),
        (1400, 1000),
    );
}

/// Saves a PNG of `url` at `png`, checking it is one.
fn screenshot(chromium: &Path, profile: &Path, url: &str, png: &Path, (w, h): (u32, u32)) {
    let _ = std::fs::remove_file(png);
    let out = browser(
        chromium,
        profile,
        &[
            format!("--screenshot={}", png.display()),
            format!("--window-size={w},{h}"),
        ],
        url,
    );
    let bytes = std::fs::read(png).unwrap_or_else(|e| {
        panic!(
            "no screenshot at {} ({e}); chromium said: {}",
            png.display(),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    assert!(bytes.starts_with(b"\x89PNG"), "not a PNG");
    assert!(bytes.len() > 10_000, "screenshot of {} bytes", bytes.len());
}

/// 2,000 small conversations `fleet-0` .. `fleet-1999` as inbound events
/// (JSONL), a minute apart; every 250th from `fleet-7` on has a tool turn
/// without its call, which the fold rejects: those are degraded.
fn fleet_events(path: &Path) {
    use std::io::Write;
    let mut out = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    for i in 0..2_000u64 {
        let conv = format!("fleet-{i}");
        let base = 1_767_225_600_000 + i * 60_000;
        let messages = (0..3 + i % 4)
            .map(|t| {
                serde_json::json!({
                    "role": if t % 2 == 0 { "user" } else { "assistant" },
                    "content": format!("turn {t} of {conv}: please check build {} and report back.", i * 7 + t),
                })
            })
            .chain((i % 250 == 7).then(|| serde_json::json!({"role": "tool", "content": "exit 0"})));
        for (t, message) in messages.enumerate() {
            let event = serde_json::json!({
                "id": format!("{conv}#{t}"),
                "conversation": conv,
                "version": 1,
                "time": base + t as u64 * 2_000,
                "type": "turn_appended",
                "payload": { "message": message },
            });
            writeln!(out, "{event}").unwrap();
        }
    }
}

/// GET `url` (JSON).
fn get_json(url: &str) -> Value {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let resp = reqwest::get(url).await.unwrap();
        assert!(resp.status().is_success(), "{url}: {}", resp.status());
        resp.json().await.unwrap()
    })
}

/// The rows of the list in a dumped page, in order.
fn listed(dom: &str) -> Vec<(String, String)> {
    regex::Regex::new(r#"<div class="conv[^"]*" data-conversation="([^"]*)" data-health="([^"]*)""#)
        .unwrap()
        .captures_iter(dom)
        .map(|c| (unescape(&c[1]), c[2].to_string()))
        .collect()
}

fn list_info(dom: &str, field: &str) -> usize {
    regex::Regex::new(&format!(r#"id="list-info"[^>]*data-{field}="(\d+)""#))
        .unwrap()
        .captures(dom)
        .map(|c| c[1].parse().unwrap())
        .unwrap_or_else(|| {
            panic!(
                "no data-{field} on #list-info in:\n{}",
                &dom[..dom.len().min(3000)]
            )
        })
}

fn dump(chromium: &Path, profile: &Path, url: &str) -> String {
    let out = browser(
        chromium,
        profile,
        &[
            "--dump-dom".to_string(),
            "--window-size=1600,1300".to_string(),
        ],
        url,
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn search_sorts_and_paging_reach_every_one_of_2000_conversations() {
    let Some(chromium) = chromium() else { return };
    let path = shared_path(TRANSCRIPT);
    if !path.exists() {
        if std::env::var_os("CONTEXTFOLD_REQUIRE_BROWSER").is_some() {
            panic!("the shared transcript {} is missing", path.display());
        }
        eprintln!("SKIPPED: no {}", path.display());
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let fleet = dir.path().join("fleet.jsonl");
    fleet_events(&fleet);
    let (ok, out, err) = cli(&data, &["run", fleet.to_str().unwrap()]);
    assert!(ok, "run failed: {out}\n{err}");
    let (ok, out, err) = cli(&data, &["run", path.to_str().unwrap()]);
    assert!(ok, "run failed: {out}\n{err}");
    let session = "fa812bfe-b295-4cca-9c2f-fdf01028cb46";
    let ui = Ui::start(&data);

    // The API: every conversation, page by page, in natural order.
    let mut all = Vec::new();
    let mut offset = 0;
    loop {
        let page = get_json(&format!(
            "{}api/conversations?limit=500&offset={offset}",
            ui.url
        ));
        assert_eq!(page["total"], 2_001, "{page}");
        let rows = page["conversations"].as_array().unwrap();
        if rows.is_empty() {
            break;
        }
        offset += rows.len();
        all.extend(
            rows.iter()
                .map(|r| r["conversation"].as_str().unwrap().to_string()),
        );
    }
    assert_eq!(all.len(), 2_001, "not every conversation is listed");
    let at = |k: &str| all.iter().position(|c| c == k).unwrap();
    assert_eq!(all[0], session);
    assert_eq!(&all[1..4], ["fleet-0", "fleet-1", "fleet-2"]);
    assert!(at("fleet-9") < at("fleet-10") && at("fleet-99") < at("fleet-100"));
    assert_eq!(all[2_000], "fleet-1999");

    let profile = dir.path().join("profile");
    let shots = std::env::var_os("CONTEXTFOLD_SCREENSHOT_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| dir.path().to_path_buf());
    std::fs::create_dir_all(&shots).unwrap();

    // Search, typed into the box: a part of a key, counted.
    let dom = dump(&chromium, &profile, &format!("{}#q=fleet-19", ui.url));
    let rows = listed(&dom);
    assert_eq!(list_info(&dom, "total"), 2_001);
    assert_eq!(
        list_info(&dom, "matched"),
        111,
        "fleet-19, -190..199, -1900..1999"
    );
    assert_eq!(rows.len(), 100);
    let keys: Vec<&str> = rows.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        keys[..4],
        ["fleet-19", "fleet-190", "fleet-191", "fleet-192"]
    );
    assert!(
        dom.contains("of 111 matching"),
        "the count of matches is not shown"
    );

    // Degraded first, within a search.
    let url = format!("{}#q=fleet-1&sort=health", ui.url);
    let dom = dump(&chromium, &profile, &url);
    let rows = listed(&dom);
    let first: Vec<(&str, &str)> = rows[..5]
        .iter()
        .map(|(k, h)| (k.as_str(), h.as_str()))
        .collect();
    assert_eq!(
        first,
        [
            ("fleet-1007", "degraded"),
            ("fleet-1257", "degraded"),
            ("fleet-1507", "degraded"),
            ("fleet-1757", "degraded"),
            ("fleet-1", "ok"),
        ]
    );
    screenshot(
        &chromium,
        &profile,
        &url,
        &shots.join("audit-page-search.png"),
        (1600, 1000),
    );

    // Recent activity first: the session (2026-02) before the fleet.
    let dom = dump(&chromium, &profile, &format!("{}#sort=recent", ui.url));
    let keys: Vec<String> = listed(&dom).into_iter().map(|(k, _)| k).collect();
    assert_eq!(keys[..3], [session, "fleet-1999", "fleet-1998"]);

    // Paging with the "next" button: page 7 holds 601-700; the last page
    // the last conversation.
    let url = format!("{}#page=7", ui.url);
    let dom = dump(&chromium, &profile, &url);
    assert_eq!(list_info(&dom, "offset"), 600);
    assert_eq!(listed(&dom)[0].0, all[600]);
    screenshot(
        &chromium,
        &profile,
        &url,
        &shots.join("audit-page-paging.png"),
        (1600, 1000),
    );
    let dom = dump(&chromium, &profile, &format!("{}#page=21", ui.url));
    assert_eq!(list_info(&dom, "offset"), 2_000);
    assert_eq!(listed(&dom), [("fleet-1999".to_string(), "ok".to_string())]);

    // One conversation: the timeline as the CLI's sentences, the DAG's
    // labelled bars on a turn axis, the chart scaled to the budget.
    let audit = get_json(&format!("{}api/audit?c={session}", ui.url));
    let deepest = audit["dag"]["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .max_by_key(|n| n["depth"].as_u64())
        .and_then(|n| n["id"].as_str())
        .unwrap()
        .to_string();
    let url = format!("{}#c={session}&summary={deepest}", ui.url);
    let dom = dump(&chromium, &profile, &url);
    let (ok, text, err) = cli(&data, &["audit", session]);
    assert!(ok, "{err}");
    let want: Vec<String> = text
        .lines()
        .filter(|l| l.starts_with('#'))
        .map(|l| {
            // `#index  before -> after  sentence`
            let rest = l.split_once(" -> ").unwrap().1.trim_start();
            rest.split_once(' ')
                .map_or("", |(_, s)| s.trim_start())
                .to_string()
        })
        .collect();
    let shown: Vec<String> = regex::Regex::new(r#"<span class="sentence">(.*?)</span>"#)
        .unwrap()
        .captures_iter(&dom)
        .map(|c| unescape(&c[1]))
        .collect();
    assert_eq!(
        shown.len(),
        want.len(),
        "timeline entries vs `contextfold audit` lines"
    );
    for (i, (s, w)) in shown.iter().zip(&want).enumerate() {
        assert_eq!(s, w, "timeline entry {i}");
        assert!(!s.starts_with('{'), "entry {i} is raw JSON: {s}");
    }
    assert!(
        shown.iter().any(|s| s.starts_with("policy ")),
        "no policy sentence"
    );
    let bars = regex::Regex::new(r#"<rect [^>]*data-first="(\d+)" data-last="(\d+)""#).unwrap();
    let ranges: Vec<String> = bars
        .captures_iter(&dom)
        .map(|c| format!("{}–{}", &c[1], &c[2]))
        .collect();
    assert_eq!(
        ranges.len(),
        audit["dag"]["nodes"].as_array().unwrap().len()
    );
    let labels: Vec<String> = regex::Regex::new(r#"<text [^>]*class="range" data-range="([^"]*)""#)
        .unwrap()
        .captures_iter(&dom)
        .map(|c| c[1].to_string())
        .collect();
    let unlabelled: Vec<&String> = ranges.iter().filter(|r| !labels.contains(r)).collect();
    assert!(
        unlabelled.is_empty(),
        "bars without their turn range: {unlabelled:?} (labels {labels:?})"
    );
    let ticks = regex::Regex::new(r#"class="turn-tick"[^>]*>([0-9,]+)<"#).unwrap();
    assert!(ticks.captures_iter(&dom).count() >= 4, "no turn axis");
    let ytop = regex::Regex::new(r#"class="ytick"[^>]*>([0-9,]+)<"#)
        .unwrap()
        .captures_iter(&dom)
        .map(|c| c[1].replace(',', "").parse::<u64>().unwrap())
        .max()
        .unwrap();
    assert!(
        (30_000..=40_000).contains(&ytop),
        "the chart's top tick is {ytop} for a 32,000-token budget"
    );
    // The summary, drilled into: its text, its metadata beside it.
    assert!(
        dom.contains(&format!("data-described=\"{deepest}\"")),
        "not drilled into"
    );
    assert!(
        dom.contains(r#"<pre class="text">Condensed summary"#),
        "the summary's text is not shown as text"
    );
    assert!(
        dom.contains("<dt>turns</dt>"),
        "no metadata beside the summary"
    );
    screenshot(
        &chromium,
        &profile,
        &url,
        &shots.join("audit-page-summary.png"),
        (1600, 1500),
    );
}
