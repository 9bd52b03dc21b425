//! NATS credentials against real nats-servers that demand them (a user and
//! password, or a token): the right credentials connect whether they come
//! from the options, the configuration (file or environment), a flag or
//! the URL's userinfo; none or wrong ones fail with an error that says what
//! to do and never contains the password. `serve`'s start line and
//! `contextfold config` show the credentials as `***`.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use contextfold::config::Config;
use contextfold::nats::connect::NatsOptions;
use contextfold::secret::Secret;
use std::process::Stdio;
use std::time::{Duration, Instant};
use support::cli::{command, split};
use support::nats_server::NatsServer;

const PASSWORD: &str = "s3cret-pw-9f";
const TOKEN: &str = "t0ken-7d2e";

fn user_server() -> NatsServer {
    NatsServer::start_with_config(&format!(
        "authorization {{ user: alice, password: \"{PASSWORD}\" }}\n"
    ))
}

fn token_server() -> NatsServer {
    NatsServer::start_with_config(&format!("authorization {{ token: \"{TOKEN}\" }}\n"))
}

/// `nats://<userinfo>@127.0.0.1:<port>`.
fn url_with(server: &NatsServer, userinfo: &str) -> String {
    format!("nats://{userinfo}@127.0.0.1:{}", server.port())
}

async fn connect(options: &NatsOptions) -> Result<(), String> {
    options
        .connect()
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

fn load(vars: &[(&str, &str)]) -> Config {
    let env = vars.iter().map(|(a, b)| (a.to_string(), b.to_string()));
    Config::load_with_env(None, env).expect("configuration loads")
}

#[tokio::test]
async fn user_and_password_connect_by_option_config_and_url() {
    let server = user_server();
    let by_option = NatsOptions {
        user: Some("alice".into()),
        password: Some(Secret::new(PASSWORD)),
        ..NatsOptions::with_servers([server.url()])
    };
    connect(&by_option)
        .await
        .expect("user and password options");

    let by_env = load(&[
        (
            "CONTEXTFOLD_NATS__CONNECTION__SERVERS",
            &format!("[\"{}\"]", server.url()),
        ),
        ("CONTEXTFOLD_NATS__CONNECTION__USER", "alice"),
        ("CONTEXTFOLD_NATS__CONNECTION__PASSWORD", PASSWORD),
    ]);
    connect(&by_env.nats.connection)
        .await
        .expect("configured by the environment");

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("c.toml");
    std::fs::write(
        &file,
        format!(
            "[nats.connection]\nservers = [\"{}\"]\nuser = \"alice\"\npassword = \"{PASSWORD}\"\n",
            server.url()
        ),
    )
    .unwrap();
    let by_file = Config::load_with_env(Some(&file), Vec::new()).unwrap();
    connect(&by_file.nats.connection)
        .await
        .expect("configured by the file");

    let by_url = NatsOptions::with_servers([url_with(&server, &format!("alice:{PASSWORD}"))]);
    connect(&by_url)
        .await
        .expect("user and password in the URL");
}

#[tokio::test]
async fn missing_or_wrong_credentials_fail_clearly_without_the_password() {
    let server = user_server();
    let err = connect(&NatsOptions::with_servers([server.url()]))
        .await
        .expect_err("no credentials");
    assert!(
        err.contains("requires credentials") && err.contains("--user"),
        "{err}"
    );

    let wrong = "wr0ng-pw-55";
    for options in [
        NatsOptions::with_servers([url_with(&server, &format!("alice:{wrong}"))]),
        NatsOptions {
            user: Some("alice".into()),
            password: Some(Secret::new(wrong)),
            ..NatsOptions::with_servers([server.url()])
        },
    ] {
        let err = connect(&options).await.expect_err("wrong password");
        assert!(err.contains("refused user \"alice\""), "{err}");
        assert!(!err.contains(wrong) && !err.contains(PASSWORD), "{err}");
    }
    let err = connect(&NatsOptions::with_servers([url_with(
        &server,
        &format!("alice:{wrong}"),
    )]))
    .await
    .unwrap_err();
    assert!(err.contains("alice:***@127.0.0.1"), "{err}");
}

#[tokio::test]
async fn a_token_connects_by_option_config_and_url() {
    let server = token_server();
    let by_option = NatsOptions {
        token: Some(Secret::new(TOKEN)),
        ..NatsOptions::with_servers([server.url()])
    };
    connect(&by_option).await.expect("token option");
    let by_env = load(&[
        (
            "CONTEXTFOLD_NATS__CONNECTION__SERVERS",
            &format!("[\"{}\"]", server.url()),
        ),
        ("CONTEXTFOLD_NATS__CONNECTION__TOKEN", TOKEN),
    ]);
    connect(&by_env.nats.connection)
        .await
        .expect("token from the environment");
    connect(&NatsOptions::with_servers([url_with(&server, TOKEN)]))
        .await
        .expect("token in the URL");

    let err = connect(&NatsOptions::with_servers([server.url()]))
        .await
        .expect_err("no token");
    assert!(
        err.contains("requires credentials") && err.contains("--token"),
        "{err}"
    );
    let err = connect(&NatsOptions::with_servers([url_with(
        &server,
        "not-the-token",
    )]))
    .await
    .expect_err("wrong token");
    assert!(err.contains("refused the token given"), "{err}");
    assert!(
        err.contains("nats://***@127.0.0.1") && !err.contains("not-the-token"),
        "{err}"
    );
}

#[test]
fn cli_flags_and_url_userinfo_reach_the_server() {
    let server = user_server();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let run = |args: &[&str]| split(command(&data, args).output().expect("contextfold runs"));
    // Connected: what answers is the absence of a service, not the server's refusal.
    let connected = "no contextfold API answers";
    let url = server.url();
    let (ok, _, err) = run(&[
        "status",
        "--nats",
        &url,
        "--user",
        "alice",
        "--password",
        PASSWORD,
    ]);
    assert!(!ok && err.contains(connected), "flags: {err}");
    let in_url = url_with(&server, &format!("alice:{PASSWORD}"));
    let (ok, _, err) = run(&["status", "--nats", &in_url]);
    assert!(!ok && err.contains(connected), "URL userinfo: {err}");
    assert!(!err.contains(PASSWORD), "{err}");
    let (ok, _, err) = split(
        command(&data, &["status", "--nats", &url, "--user", "alice"])
            .env("CONTEXTFOLD_NATS__CONNECTION__PASSWORD", PASSWORD)
            .output()
            .unwrap(),
    );
    assert!(
        !ok && err.contains(connected),
        "flag and environment: {err}"
    );

    let (ok, _, err) = run(&["status", "--nats", &url]);
    assert!(!ok && err.contains("requires credentials"), "{err}");
    let wrong = url_with(&server, "alice:wr0ng-pw-55");
    let (ok, _, err) = run(&["status", "--nats", &wrong]);
    assert!(!ok && err.contains("refused user"), "{err}");
    assert!(
        !err.contains("wr0ng-pw-55") && err.contains("alice:***@"),
        "{err}"
    );
    // Two ways at once are refused before connecting, naming both.
    let (ok, _, err) = run(&[
        "status",
        "--nats",
        &in_url,
        "--user",
        "bob",
        "--password",
        "x",
    ]);
    assert!(!ok && err.contains("give the credentials one way"), "{err}");
    assert!(!err.contains(PASSWORD), "{err}");
}

#[test]
fn serve_start_line_and_config_show_no_password() {
    let server = user_server();
    let dir = tempfile::tempdir().unwrap();
    let in_url = url_with(&server, &format!("alice:{PASSWORD}"));
    let log_path = dir.path().join("serve.log");
    let mut child = command(&dir.path().join("serve"), &["serve", "--nats", &in_url])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log_path).unwrap())
        .spawn()
        .expect("contextfold serve starts");
    let deadline = Instant::now() + Duration::from_secs(30);
    let log = loop {
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        let exited = child.try_wait().unwrap();
        if log.contains("contextfold serve: roles") || exited.is_some() {
            break log;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("serve printed no start line in 30 s:\n{log}");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        log.contains("contextfold serve: roles"),
        "serve did not start:\n{log}"
    );
    assert!(log.contains("at nats://alice:***@127.0.0.1"), "{log}");
    assert!(!log.contains(PASSWORD), "{log}");

    let (ok, out, err) = split(
        command(dir.path(), &["config"])
            .env(
                "CONTEXTFOLD_NATS__CONNECTION__SERVERS",
                format!("[\"{in_url}\"]"),
            )
            .env("CONTEXTFOLD_NATS__CONNECTION__TOKEN", TOKEN)
            .output()
            .unwrap(),
    );
    assert!(ok, "config: {err}");
    assert!(
        out.contains("alice:***@127.0.0.1") && out.contains("token = \"***\""),
        "{out}"
    );
    assert!(!out.contains(PASSWORD) && !out.contains(TOKEN), "{out}");
}
