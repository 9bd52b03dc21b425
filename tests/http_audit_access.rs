//! Who may read the audit page (issue 23, finding 6), over real HTTP
//! against the binary: `contextfold ui` on the embedded store and
//! `contextfold serve --http ADDR --audit-page` against a nats-server.
//!
//! - A request whose `Host` names another server (DNS rebinding: a web
//!   page pointing its own name at 127.0.0.1) or whose `Origin` is another
//!   site is refused, and shows nothing; the same request naming the
//!   server is answered.
//! - Beyond loopback the page does not start without a token, and says how
//!   to set one; with one, the page and its API need it (bearer or the
//!   cookie `/?token=` sets), while `/metrics`, `/healthz` and `/readyz`
//!   stay open. The token is never printed.
//!
//! Requests are written by hand on a TCP socket, so the headers are
//! exactly those an attacker's browser would send.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use contextfold::core::event::{Envelope, EventBody, TurnAppended};
use contextfold::core::message::{ChatMessage, Role};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};
use support::cli::command;
use support::nats_server::{free_port, NatsServer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const CONV: &str = "victim";
const SECRET: &str = "sk-victim-0123456789";
const TOKEN: &str = "9f2c4e6a8b0d1f3e5a7c9b1d3f5e7a90";

/// (status, head, body) of one HTTP/1.1 request with exactly `headers`.
async fn get(addr: &str, path: &str, headers: &[(&str, &str)]) -> (u16, String, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut request = format!("GET {path} HTTP/1.1\r\nConnection: close\r\n");
    for (k, v) in headers {
        request.push_str(&format!("{k}: {v}\r\n"));
    }
    request.push_str("\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut bytes = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut bytes))
        .await
        .expect("an answer within 30 s")
        .unwrap();
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, head.to_string(), body.to_string())
}

/// A data directory whose one conversation holds [`SECRET`]; returns the
/// id of its last event.
fn data_with_a_secret(data: &Path) -> String {
    let events: Vec<Envelope> = (0..6)
        .map(|i| {
            let role = if i % 2 == 0 {
                Role::User
            } else {
                Role::Assistant
            };
            Envelope::new(
                format!("{CONV}#{i}"),
                CONV,
                1_700_000_000_000 + i * 2_000,
                EventBody::TurnAppended(TurnAppended::from(ChatMessage::text(
                    role,
                    format!("turn {i}: the deploy key is {SECRET}"),
                ))),
            )
        })
        .collect();
    let file = data.with_extension("jsonl");
    let lines: Vec<String> = events.iter().map(Envelope::to_json).collect();
    std::fs::write(&file, lines.join("\n") + "\n").unwrap();
    let out = command(data, &["run", file.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    format!("{CONV}#5")
}

/// A process killed on drop.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits for `child` to exit within `limit`: its exit status and stderr,
/// or `None` (killed) when it kept running.
fn exits_within(mut child: Child, limit: Duration) -> Option<(bool, String)> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            if let Some(mut e) = child.stderr.take() {
                std::io::Read::read_to_string(&mut e, &mut err).unwrap();
            }
            return Some((status.success(), err));
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_on_loopback_answers_only_requests_that_name_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let at = data_with_a_secret(&data);
    let mut child = command(&data, &["ui", "--port", "0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let _ui = Running(child);
    let addr = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("http://"))
        .map(|a| a.trim_end_matches('/').to_string())
        .unwrap_or_else(|| panic!("no address in {line:?}"));
    let port = addr.rsplit(':').next().unwrap().to_string();
    let context = format!("/api/context?c={CONV}&at={}", at.replace('#', "%23"));

    // The page's own address, and localhost, are answered.
    for host in [addr.clone(), format!("localhost:{port}")] {
        let (status, _, body) = get(&addr, &context, &[("Host", &host)]).await;
        assert_eq!(status, 200, "Host {host}: {body}");
        assert!(body.contains(SECRET), "{body}");
    }
    // A rebinding page's requests carry its own name: refused, and nothing
    // of the conversation in the answer.
    let mut leaked = Vec::new();
    for path in [
        context.as_str(),
        "/api/conversations",
        "/",
        "/api/audit?c=victim",
    ] {
        for headers in [
            vec![("Host", format!("attacker.example:{port}"))],
            vec![("Host", "attacker.example".to_string())],
            vec![
                ("Host", addr.clone()),
                ("Origin", "http://attacker.example".to_string()),
            ],
            vec![("Host", addr.clone()), ("Origin", "null".to_string())],
        ] {
            let headers: Vec<(&str, &str)> =
                headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
            let (status, _, body) = get(&addr, path, &headers).await;
            if status != 403 || body.contains(SECRET) || body.contains(CONV) {
                leaked.push(format!(
                    "{path} {headers:?}: {status} {}",
                    &body[..body.len().min(80)]
                ));
            }
        }
    }
    assert!(
        leaked.is_empty(),
        "requests naming another server were answered:\n  {}",
        leaked.join("\n  ")
    );
}

#[test]
fn ui_beyond_loopback_refuses_to_start_without_a_token() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    data_with_a_secret(&data);
    let child = command(&data, &["ui", "--host", "0.0.0.0", "--port", "0"])
        .env_remove("CONTEXTFOLD_HTTP__TOKEN")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (ok, err) = exits_within(child, Duration::from_secs(10))
        .expect("ui on 0.0.0.0 without a token kept running, serving every conversation");
    assert!(!ok);
    assert!(err.contains("CONTEXTFOLD_HTTP__TOKEN"), "{err}");
}

/// `contextfold serve --http ADDR --audit-page` on `server`, its stderr in
/// `dir/serve.log`.
fn serve_with_page(server: &NatsServer, dir: &Path, http: &str, token: Option<&str>) -> Child {
    let log = std::fs::File::create(dir.join("serve.log")).unwrap();
    let mut cmd = command(
        &dir.join("serve"),
        &[
            "serve",
            "--nats",
            &server.url(),
            "--http",
            http,
            "--audit-page",
        ],
    );
    cmd.env_remove("CONTEXTFOLD_SUMMARIZER__BASE_URL")
        .env("CONTEXTFOLD_NATS__STORAGE", "memory")
        .env("CONTEXTFOLD_LOG", "info")
        .stdout(Stdio::null())
        .stderr(log);
    match token {
        Some(t) => cmd.env("CONTEXTFOLD_HTTP__TOKEN", t),
        None => cmd.env_remove("CONTEXTFOLD_HTTP__TOKEN"),
    };
    cmd.spawn().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_beyond_loopback_needs_a_token_for_the_page_and_leaves_the_probes_open() {
    let server = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();

    // Without a token: refused at start, saying how to set one.
    let port = free_port();
    let child = serve_with_page(&server, dir.path(), &format!("0.0.0.0:{port}"), None);
    let ended = exits_within(child, Duration::from_secs(10));
    let log = std::fs::read_to_string(dir.path().join("serve.log")).unwrap();
    let Some((ok, _)) = ended else {
        panic!("serve --http 0.0.0.0 --audit-page without a token kept running:\n{log}");
    };
    assert!(!ok);
    assert!(log.contains("CONTEXTFOLD_HTTP__TOKEN"), "{log}");

    // With one.
    let port = free_port();
    let _serve = Running(serve_with_page(
        &server,
        dir.path(),
        &format!("0.0.0.0:{port}"),
        Some(TOKEN),
    ));
    let addr = format!("127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(30);
    while tokio::net::TcpStream::connect(&addr).await.is_err() {
        assert!(
            Instant::now() < deadline,
            "serve's HTTP server did not come up"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let host = ("Host", addr.as_str());
    let bearer = format!("Bearer {TOKEN}");
    let cookie = format!("contextfold_audit_token={TOKEN}");
    // The probes stay open.
    for path in ["/healthz", "/metrics"] {
        let (status, _, body) = get(&addr, path, &[host]).await;
        assert_eq!(status, 200, "{path}: {body}");
    }
    let (status, _, body) = get(&addr, "/readyz", &[host]).await;
    assert!(matches!(status, 200 | 503), "{status} {body}");
    // The page and its API need the token.
    for path in ["/", "/app.js", "/api/conversations"] {
        let (status, _, body) = get(&addr, path, &[host]).await;
        assert_eq!(status, 401, "{path}: {body}");
        assert!(body.contains("token"), "{body}");
        assert!(!body.contains(TOKEN), "{body}");
        let (status, _, _) = get(
            &addr,
            path,
            &[host, ("Authorization", "Bearer wrong-token-0000000000")],
        )
        .await;
        assert_eq!(status, 401, "{path} with a wrong token");
    }
    let (status, _, body) = get(
        &addr,
        "/api/conversations",
        &[host, ("Authorization", &bearer)],
    )
    .await;
    assert_eq!(status, 200, "{body}");
    // `/?token=` keeps it in a cookie and takes it out of the address.
    let (status, head, _) = get(&addr, &format!("/?token={TOKEN}"), &[host]).await;
    assert_eq!(status, 303, "{head}");
    let head = head.to_ascii_lowercase();
    assert!(head.contains("location: /\r\n"), "{head}");
    assert!(
        head.contains("set-cookie: contextfold_audit_token="),
        "{head}"
    );
    assert!(
        head.contains("httponly") && head.contains("samesite=strict"),
        "{head}"
    );
    let (status, _, body) = get(&addr, "/", &[host, ("Cookie", &cookie)]).await;
    assert_eq!(status, 200);
    assert!(
        body.contains("<html") || body.contains("<!doctype"),
        "{body}"
    );
    // The token does not make another Host acceptable.
    let (status, _, _) = get(
        &addr,
        "/api/conversations",
        &[("Host", "attacker.example"), ("Authorization", &bearer)],
    )
    .await;
    assert_eq!(status, 403);
    let log = std::fs::read_to_string(dir.path().join("serve.log")).unwrap();
    assert!(!log.contains(TOKEN), "the token is in serve's log:\n{log}");
}
