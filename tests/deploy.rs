//! What holds deploy/ true on a machine without Docker or Kubernetes:
//!
//! - `promtool check config` and `promtool check rules` accept the
//!   Prometheus config and the alert rules;
//! - `docker-compose config` accepts compose.yaml;
//! - every `contextfold` command line in deploy/ (compose services, the
//!   Dockerfile's CMD, the systemd unit's ExecStart, the helm chart's args)
//!   parses (`contextfold ARGS --help` exits 0 only when every flag and
//!   value is accepted), and every configuration it reads, with the
//!   environment it sets, loads (`contextfold config`);
//! - the helm chart's Chart.yaml and values.yaml parse and name the
//!   probes on `/healthz` and `/readyz`; its templates exist;
//! - every metric the Grafana dashboard and the alert rules query is one
//!   the service exports, read from the names in `src/telemetry.rs` (or
//!   `src/telemetry/`) and `src/metrics.rs`.
//!
//! The tools come from Debian packages (`prometheus` ships promtool;
//! `docker-compose`; `python3-yaml` for reading YAML). A missing tool
//! skips its test with a message, unless CONTEXTFOLD_REQUIRE_DEPLOY_TOOLS
//! is set (scripts/test.sh installs them and sets it): then it fails.
//!
//! deploy/ targets the operator HTTP (`serve --http`, /metrics). In a
//! tree without the telemetry module (no exporter, so no metric is
//! exported and there is no `--http`), the metric check is skipped and
//! `--http ADDR` is left out of the command lines checked, each with a
//! message saying so.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use regex::Regex;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn deploy(rel: &str) -> PathBuf {
    repo().join("deploy").join(rel)
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

fn require_tools() -> bool {
    std::env::var_os("CONTEXTFOLD_REQUIRE_DEPLOY_TOOLS").is_some_and(|v| !v.is_empty())
}

/// `name` on PATH, or None after saying why the caller skips (a panic
/// when the tools are required).
fn tool(name: &str, package: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(name))
            .find(|p| p.is_file())
    });
    if found.is_none() {
        let message = format!(
            "{name} not found on PATH: install the Debian package `{package}` \
             (scripts/test.sh does)"
        );
        assert!(
            !require_tools(),
            "{message}; CONTEXTFOLD_REQUIRE_DEPLOY_TOOLS is set"
        );
        eprintln!("SKIPPED: {message}");
    }
    found
}

fn run(cmd: &mut Command) -> Output {
    cmd.output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"))
}

fn show(out: &Output) -> String {
    format!(
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A Python with PyYAML, to read YAML without a Rust YAML crate.
fn yaml_reader() -> Option<PathBuf> {
    for python in ["python3", "/usr/bin/python3"] {
        let ok = Command::new(python)
            .args(["-c", "import yaml"])
            .output()
            .is_ok_and(|o| o.status.success());
        if ok {
            return Some(PathBuf::from(python));
        }
    }
    let message = "no python3 with PyYAML (Debian package `python3-yaml`; scripts/test.sh \
                   installs it) to read deploy/'s YAML";
    assert!(
        !require_tools(),
        "{message}; CONTEXTFOLD_REQUIRE_DEPLOY_TOOLS is set"
    );
    eprintln!("SKIPPED: {message}");
    None
}

/// YAML text as JSON (every document of a file must be one mapping here).
fn yaml(python: &Path, text: &str, what: &str) -> Value {
    use std::io::Write;
    let mut child = Command::new(python)
        .args([
            "-c",
            "import sys, json, yaml; json.dump(yaml.safe_load(sys.stdin), sys.stdout)",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("starting python3");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("writing YAML to python3");
    let out = child.wait_with_output().expect("python3 output");
    assert!(out.status.success(), "{what} is not YAML:\n{}", show(&out));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{what}: {e}"))
}

/// Whether this tree has the telemetry module, and so the exporter and
/// `serve --http`.
fn has_operator_http() -> bool {
    repo().join("src/telemetry.rs").is_file() || repo().join("src/telemetry").is_dir()
}

/// `args` without `--http ADDR` when this tree has no operator HTTP.
fn as_this_tree_parses(args: &[String], origin: &str) -> Vec<String> {
    if has_operator_http() {
        return args.to_vec();
    }
    let mut kept = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--http" {
            eprintln!(
                "NOTE: {origin}: `--http` left out of the check: this tree has no \
                 src/telemetry.rs (the operator HTTP)"
            );
            it.next();
        } else if !a.starts_with("--http=") {
            kept.push(a.clone());
        }
    }
    kept
}

fn contextfold(env: &BTreeMap<String, String>) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_contextfold"));
    // Only the environment the deployment sets: nothing of ours leaks in.
    cmd.env_clear();
    cmd.envs(env);
    cmd
}

/// `contextfold ARGS --help`: clap checks every flag and value before it
/// prints the help, and loads no configuration.
fn assert_args_parse(args: &[String], env: &BTreeMap<String, String>, origin: &str) {
    assert!(
        args.first()
            .is_some_and(|a| !a.starts_with('-') || a == "--config"),
        "{origin}: no subcommand in {args:?}"
    );
    let args = as_this_tree_parses(args, origin);
    let out = run(contextfold(env).args(&args).arg("--help"));
    assert!(
        out.status.success(),
        "{origin}: `contextfold {}` is refused:\n{}",
        args.join(" "),
        show(&out)
    );
}

/// `contextfold config` with this environment (and file): the loader
/// refuses unknown keys, unknown CONTEXTFOLD_* variables and bad values.
fn assert_config_loads(config: Option<&Path>, env: &BTreeMap<String, String>, origin: &str) {
    let mut cmd = contextfold(env);
    if let Some(path) = config {
        assert!(path.is_file(), "{origin}: {} is missing", path.display());
        cmd.arg("--config").arg(path);
    }
    let out = run(cmd.arg("config"));
    assert!(
        out.status.success(),
        "{origin}: the configuration is refused (config {config:?}, environment {:?}):\n{}",
        env.keys().collect::<Vec<_>>(),
        show(&out)
    );
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .map(|s| {
                    s.as_str()
                        .map(str::to_string)
                        .unwrap_or_else(|| s.to_string())
                })
                .collect()
        })
        .unwrap_or_default()
}

// ---------------------------------------------------------------- Prometheus

#[test]
fn promtool_accepts_the_prometheus_config_and_the_alert_rules() {
    let Some(promtool) = tool("promtool", "prometheus") else {
        return;
    };
    let config = run(Command::new(&promtool)
        .args(["check", "config"])
        .arg(deploy("prometheus/prometheus.yml")));
    assert!(
        config.status.success(),
        "promtool check config:\n{}",
        show(&config)
    );
    let rules = run(Command::new(&promtool)
        .args(["check", "rules"])
        .arg(deploy("prometheus/alerts.yml")));
    assert!(
        rules.status.success(),
        "promtool check rules:\n{}",
        show(&rules)
    );
    let text = String::from_utf8_lossy(&rules.stdout);
    assert!(text.contains("SUCCESS: 7 rules found"), "{text}");

    // The dashboard's queries are PromQL too: promtool checks them as
    // recording rules, Grafana's variables given a value.
    let dir = tempfile::tempdir().unwrap();
    let rules: Vec<Value> = dashboard_queries()
        .iter()
        .enumerate()
        .map(|(i, (_, expr))| {
            let expr = expr
                .replace("$__rate_interval", "5m")
                .replace("$instance", ".*");
            serde_json::json!({ "record": format!("dashboard:query_{i}"), "expr": expr })
        })
        .collect();
    assert!(rules.len() > 10, "{rules:?}");
    let file = dir.path().join("dashboard.rules.yml");
    let groups = serde_json::json!({ "groups": [{ "name": "dashboard", "rules": rules }] });
    std::fs::write(&file, groups.to_string()).unwrap();
    let out = run(Command::new(&promtool).args(["check", "rules"]).arg(&file));
    assert!(
        out.status.success(),
        "the dashboard's queries are not PromQL:\n{}",
        show(&out)
    );

    // The check can fail: a rule with a broken expression is refused.
    let broken = dir.path().join("alerts.yml");
    std::fs::write(
        &broken,
        read(&deploy("prometheus/alerts.yml")).replacen("expr: ", "expr: sum(( ", 1),
    )
    .unwrap();
    let out = run(Command::new(&promtool)
        .args(["check", "rules"])
        .arg(&broken));
    assert!(
        !out.status.success(),
        "a broken rule passed:\n{}",
        show(&out)
    );
}

/// `promtool test rules`: the unit tests of the alert rules pass, and they
/// show the dead-letter and spend alerts firing on the first event of a
/// counter exported at 0 (and silent for one that appears at 1).
#[test]
fn promtool_unit_tests_fire_the_dead_letter_and_spend_alerts_on_the_first_event() {
    let Some(promtool) = tool("promtool", "prometheus") else {
        return;
    };
    let tests = deploy("prometheus/alerts.test.yml");
    let out = run(Command::new(&promtool)
        .args(["test", "rules"])
        .arg(&tests)
        .current_dir(deploy("prometheus")));
    assert!(out.status.success(), "promtool test rules:\n{}", show(&out));
    let text = read(&tests);
    for alert in ["ContextfoldDeadLetters", "ContextfoldSpendWindowClosed"] {
        assert!(
            text.contains(&format!("alertname: {alert}")),
            "alerts.test.yml does not test {alert}"
        );
    }

    // The tests can fail: the same tests against rules whose dead-letter
    // alert needs two events are refused.
    let dir = tempfile::tempdir().unwrap();
    let rules = read(&deploy("prometheus/alerts.yml"));
    let needle = "increase(contextfold_jobs_dead_lettered_total[15m])) > 0";
    assert!(rules.contains(needle), "{needle} not in alerts.yml");
    std::fs::write(
        dir.path().join("alerts.yml"),
        rules.replace(
            needle,
            "increase(contextfold_jobs_dead_lettered_total[15m])) > 1",
        ),
    )
    .unwrap();
    std::fs::copy(&tests, dir.path().join("alerts.test.yml")).unwrap();
    let out = run(Command::new(&promtool)
        .args(["test", "rules", "alerts.test.yml"])
        .current_dir(dir.path()));
    assert!(
        !out.status.success(),
        "alerts.test.yml passed against a dead-letter alert that misses the first one:\n{}",
        show(&out)
    );
}

// ------------------------------------------------------------------- compose

/// compose.yaml as docker-compose resolves it (anchors merged, paths made
/// absolute), as JSON.
fn compose_config(docker_compose: &Path, python: &Path) -> Value {
    let out = run(Command::new(docker_compose)
        .arg("--file")
        .arg(deploy("compose.yaml"))
        .arg("config"));
    assert!(
        out.status.success(),
        "docker-compose config:\n{}",
        show(&out)
    );
    yaml(
        python,
        &String::from_utf8_lossy(&out.stdout),
        "docker-compose config's output",
    )
}

#[test]
fn docker_compose_accepts_compose_yaml() {
    let Some(docker_compose) = tool("docker-compose", "docker-compose") else {
        return;
    };
    let out = run(Command::new(&docker_compose)
        .arg("--file")
        .arg(deploy("compose.yaml"))
        .args(["config", "--quiet"]));
    assert!(
        out.status.success(),
        "docker-compose config:\n{}",
        show(&out)
    );

    // The check can fail: an unknown service key is refused.
    let dir = tempfile::tempdir().unwrap();
    let broken = dir.path().join("compose.yaml");
    std::fs::write(
        &broken,
        "services:\n  a:\n    image: x\n    restart_polcy: always\n",
    )
    .unwrap();
    let out = run(Command::new(&docker_compose)
        .arg("--file")
        .arg(&broken)
        .args(["config", "--quiet"]));
    assert!(
        !out.status.success(),
        "a bad compose file passed:\n{}",
        show(&out)
    );
}

/// The NATS version compose runs is the one the tests run
/// (scripts/install-nats.sh's pin).
#[test]
fn compose_runs_the_nats_version_the_tests_use() {
    let script = read(&repo().join("scripts/install-nats.sh"));
    let pinned = Regex::new(r#"(?m)^NATS_SERVER_VERSION="([0-9.]+)""#)
        .unwrap()
        .captures(&script)
        .map(|c| c[1].to_string())
        .expect("NATS_SERVER_VERSION in scripts/install-nats.sh");
    let compose = read(&deploy("compose.yaml"));
    let images: Vec<String> = Regex::new(r"(?m)^\s*image:\s*(nats:\S+)")
        .unwrap()
        .captures_iter(&compose)
        .map(|c| c[1].to_string())
        .collect();
    assert!(!images.is_empty(), "no nats image in compose.yaml");
    for image in images {
        let version = image
            .trim_start_matches("nats:")
            .trim_end_matches("-alpine");
        assert_eq!(
            version, pinned,
            "compose.yaml runs {image}; the tests run nats-server {pinned}"
        );
    }
}

#[test]
fn compose_runs_the_cluster_and_every_contextfold_command_is_accepted() {
    let Some(docker_compose) = tool("docker-compose", "docker-compose") else {
        return;
    };
    let Some(python) = yaml_reader() else {
        return;
    };
    let config = compose_config(&docker_compose, &python);
    let services = config["services"].as_object().expect("services");
    let names: BTreeSet<&str> = services.keys().map(String::as_str).collect();
    for want in [
        "nats1",
        "nats2",
        "nats3",
        "folder",
        "summarizer",
        "prometheus",
        "grafana",
    ] {
        assert!(names.contains(want), "no service {want} in {names:?}");
    }
    // Three NATS nodes with JetStream, routed to each other.
    for node in ["nats1", "nats2", "nats3"] {
        let command = strings(&services[node]["command"]);
        assert!(
            command.iter().any(|a| a == "--jetstream"),
            "{node}: {command:?}"
        );
        let routes = command
            .iter()
            .skip_while(|a| *a != "--routes")
            .nth(1)
            .unwrap_or_else(|| panic!("{node} has no --routes"));
        for other in ["nats1", "nats2", "nats3"].iter().filter(|o| *o != &node) {
            assert!(
                routes.contains(&format!("{other}:6222")),
                "{node}: {routes}"
            );
        }
    }

    let mut roles = BTreeSet::new();
    for (name, service) in services {
        if !service
            .get("build")
            .is_some_and(|b| b["dockerfile"] == "deploy/Dockerfile")
        {
            continue;
        }
        let origin = format!("compose service {name}");
        let env: BTreeMap<String, String> = service["environment"]
            .as_object()
            .map(|m| {
                m.iter()
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
                    .collect()
            })
            .unwrap_or_default();
        // The config the container reads, on the host side of its mount.
        let in_container = env
            .get("CONTEXTFOLD_CONFIG")
            .unwrap_or_else(|| panic!("{origin}: no CONTEXTFOLD_CONFIG"));
        let host = strings(&service["volumes"])
            .iter()
            .find_map(|v| {
                let mut parts = v.split(':');
                let (source, target) = (parts.next()?, parts.next()?);
                (target == in_container).then(|| PathBuf::from(source))
            })
            .unwrap_or_else(|| panic!("{origin}: nothing is mounted at {in_container}"));
        let mut host_env = env.clone();
        host_env.insert(
            "CONTEXTFOLD_CONFIG".into(),
            host.to_string_lossy().into_owned(),
        );
        assert_config_loads(None, &host_env, &origin);
        let command = strings(&service["command"]);
        assert_args_parse(&command, &host_env, &origin);
        let role = command
            .iter()
            .skip_while(|a| *a != "--roles")
            .nth(1)
            .unwrap_or_else(|| panic!("{origin}: no --roles"));
        roles.extend(role.split(',').map(str::to_string));
        assert!(
            command.iter().any(|a| a == "--http"),
            "{origin}: no --http, so Prometheus has nothing to scrape"
        );
    }
    assert_eq!(
        roles,
        ["api", "folder", "summarizer"].map(String::from).into(),
        "every role runs somewhere"
    );
}

#[test]
fn the_dockerfile_runs_contextfold_as_a_user_with_an_accepted_command() {
    let text = read(&deploy("Dockerfile"));
    let stages = text.lines().filter(|l| l.starts_with("FROM ")).count();
    assert!(stages >= 2, "not a multi-stage build:\n{text}");
    let user = text
        .lines()
        .filter_map(|l| l.strip_prefix("USER "))
        .next_back()
        .expect("a USER line");
    assert!(
        !matches!(user.trim(), "root" | "0" | "0:0"),
        "runs as {user}"
    );
    let mut env = BTreeMap::new();
    for line in text.lines().filter_map(|l| l.strip_prefix("ENV ")) {
        let (k, v) = line.split_once('=').expect("ENV KEY=VALUE");
        env.insert(k.trim().to_string(), v.trim().to_string());
    }
    assert_config_loads(None, &env, "Dockerfile ENV");
    let cmd = text
        .lines()
        .filter_map(|l| l.strip_prefix("CMD "))
        .next_back()
        .expect("a CMD line");
    let args: Vec<String> = serde_json::from_str(cmd).expect("CMD in exec (JSON) form");
    assert_args_parse(&args, &env, "Dockerfile CMD");
}

// ------------------------------------------------------------------- systemd

/// `KEY=VALUE` lines (comments and blanks skipped).
fn env_file(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (k, v) = l
                .split_once('=')
                .unwrap_or_else(|| panic!("not KEY=VALUE: {l}"));
            (k.to_string(), v.to_string())
        })
        .collect()
}

/// Where the unit's absolute paths are in deploy/.
fn installed(path: &str) -> PathBuf {
    match path {
        "/etc/contextfold/contextfold.toml" => deploy("config/contextfold.toml"),
        "-/etc/contextfold/contextfold.env" | "/etc/contextfold/contextfold.env" => {
            deploy("systemd/contextfold.env.example")
        }
        other => panic!("the unit names {other}, which deploy/ does not ship"),
    }
}

#[test]
fn the_systemd_unit_runs_serve_sandboxed_with_an_accepted_command_and_environment() {
    let unit = read(&deploy("systemd/contextfold.service"));
    let settings: Vec<(&str, &str)> = unit
        .lines()
        .filter(|l| !l.starts_with('#') && !l.starts_with('['))
        .filter_map(|l| l.split_once('='))
        .collect();
    let get = |key: &str| -> Vec<&str> {
        settings
            .iter()
            .filter(|(k, _)| *k == key)
            .map(|(_, v)| *v)
            .collect()
    };
    assert_eq!(get("StateDirectory"), ["contextfold"]);
    assert_eq!(get("Restart"), ["on-failure"]);
    for (key, want) in [
        ("NoNewPrivileges", "yes"),
        ("ProtectSystem", "strict"),
        ("ProtectHome", "yes"),
        ("PrivateTmp", "yes"),
        ("DynamicUser", "yes"),
        ("CapabilityBoundingSet", ""),
    ] {
        assert_eq!(get(key), [want], "{key}");
    }

    // The environment the service gets: Environment= lines, then the file.
    let mut env = BTreeMap::new();
    for assignment in get("Environment") {
        let (k, v) = assignment.split_once('=').expect("Environment=KEY=VALUE");
        env.insert(k.to_string(), v.to_string());
    }
    for file in get("EnvironmentFile") {
        env.extend(env_file(&read(&installed(file))));
    }
    let exec = get("ExecStart");
    assert_eq!(exec.len(), 1, "one ExecStart");
    let mut words = exec[0].split_whitespace().map(|w| {
        // ${VAR} as systemd substitutes it from the environment.
        match w.strip_prefix("${").and_then(|w| w.strip_suffix('}')) {
            Some(var) => env
                .get(var)
                .unwrap_or_else(|| panic!("ExecStart uses ${{{var}}}, which is never set"))
                .clone(),
            None => w.to_string(),
        }
    });
    let binary = words.next().expect("ExecStart names the binary");
    assert!(binary.ends_with("/contextfold"), "{binary}");
    let mut args: Vec<String> = words.collect();
    let at = args.iter().position(|a| a == "--config").expect("--config");
    let config = installed(&args[at + 1]);
    args[at + 1] = config.to_string_lossy().into_owned();
    assert_eq!(args.get(at + 2).map(String::as_str), Some("serve"));
    assert_config_loads(Some(&config), &env, "contextfold.service");
    assert_args_parse(&args, &env, "contextfold.service ExecStart");

    // systemd's own check of the unit, on a copy that starts the binary
    // under test (optional: systemd-analyze is not a deploy tool).
    if let Some(analyze) = tool_optional("systemd-analyze") {
        let dir = tempfile::tempdir().unwrap();
        let copy = dir.path().join("contextfold.service");
        std::fs::write(
            &copy,
            unit.replace(&binary, env!("CARGO_BIN_EXE_contextfold")),
        )
        .unwrap();
        let out = run(Command::new(analyze).arg("verify").arg(&copy));
        assert!(
            out.status.success(),
            "systemd-analyze verify:\n{}",
            show(&out)
        );
        assert!(
            out.stderr.is_empty(),
            "systemd-analyze warns:\n{}",
            show(&out)
        );
    }
}

fn tool_optional(name: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(name))
            .find(|p| p.is_file())
    });
    if found.is_none() {
        eprintln!("NOTE: {name} not found: its check is left out");
    }
    found
}

// ---------------------------------------------------------------------- helm

#[test]
fn the_helm_chart_parses_names_its_probes_and_runs_accepted_commands() {
    let chart = deploy("helm/contextfold");
    let templates = [
        "_helpers.tpl",
        "configmap.yaml",
        "secret.yaml",
        "services.yaml",
        "statefulset-folder.yaml",
        "deployment-summarizer.yaml",
        "servicemonitor.yaml",
        "dashboard.yaml",
    ];
    let mut all = String::new();
    for t in templates {
        let text = read(&chart.join("templates").join(t));
        assert_eq!(
            text.matches("{{").count(),
            text.matches("}}").count(),
            "{t}: unbalanced template actions"
        );
        all.push_str(&text);
    }
    for kind in [
        "kind: StatefulSet",
        "volumeClaimTemplates:",
        "kind: Deployment",
        "kind: ConfigMap",
        "kind: Secret",
        "kind: ServiceMonitor",
        "secretKeyRef:",
        "livenessProbe:",
        "readinessProbe:",
        "resources:",
    ] {
        assert!(all.contains(kind), "no `{kind}` in the chart's templates");
    }
    // The dashboard the chart ships is the one compose provisions.
    assert_eq!(
        read(&chart.join("dashboards/contextfold.json")),
        read(&deploy("grafana/dashboards/contextfold.json")),
        "deploy/helm/contextfold/dashboards/contextfold.json differs from \
         deploy/grafana/dashboards/contextfold.json: copy it over"
    );
    assert!(chart.join("README.md").is_file());

    let Some(python) = yaml_reader() else {
        return;
    };
    let meta = yaml(&python, &read(&chart.join("Chart.yaml")), "Chart.yaml");
    assert_eq!(meta["apiVersion"], "v2");
    assert_eq!(meta["name"], "contextfold");
    let values = yaml(&python, &read(&chart.join("values.yaml")), "values.yaml");
    assert_eq!(values["probes"]["liveness"]["path"], "/healthz");
    assert_eq!(values["probes"]["readiness"]["path"], "/readyz");
    assert!(values["folder"]["persistence"]["size"].is_string());
    for role in ["folder", "summarizer"] {
        for key in ["requests", "limits"] {
            assert!(
                values[role]["resources"][key]["memory"].is_string(),
                "{role}.resources.{key}.memory"
            );
        }
    }

    // The configuration, with every variable the templates set (each
    // secret alone, since NATS takes one way to authenticate).
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("contextfold.toml");
    std::fs::write(&config, values["config"].as_str().expect("config is text")).unwrap();
    let helpers = read(&chart.join("templates/_helpers.tpl"));
    let vars: BTreeSet<String> = Regex::new(r#"(?:name: |")(CONTEXTFOLD_[A-Z_]+|OPENAI_API_KEY)"#)
        .unwrap()
        .captures_iter(&helpers)
        .map(|c| c[1].to_string())
        .filter(|v| v != "CONTEXTFOLD_CONFIG")
        .collect();
    assert!(
        vars.contains("CONTEXTFOLD_NATS__CONNECTION__PASSWORD"),
        "{vars:?}"
    );
    let base: BTreeMap<String, String> = [
        ("CONTEXTFOLD_LOG", "info"),
        ("CONTEXTFOLD_NATS__CONNECTION__NAME", "contextfold-folder-0"),
    ]
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .into();
    assert_config_loads(Some(&config), &base, "values.yaml config");
    for var in &vars {
        let mut env = base.clone();
        env.insert(var.clone(), "/etc/contextfold/nats/nats.creds".into());
        if var.ends_with("__PASSWORD") {
            env.insert(
                "CONTEXTFOLD_NATS__CONNECTION__USER".into(),
                "contextfold".into(),
            );
        }
        assert_config_loads(
            Some(&config),
            &env,
            &format!("values.yaml config with {var}"),
        );
    }
    for role in ["folder", "summarizer"] {
        let args = strings(&values[role]["args"]);
        assert_args_parse(&args, &base, &format!("values.yaml {role}.args"));
        assert!(args.iter().any(|a| a == "0.0.0.0:9464"), "{role}: {args:?}");
    }
}

/// The real helm: `CONTEXTFOLD_HELM`, else `helm` on PATH
/// (scripts/install-helm.sh installs it); `CONTEXTFOLD_HELM=unavailable`
/// (scripts/test.sh, when the install failed) skips with that reason.
fn helm() -> Option<PathBuf> {
    match std::env::var("CONTEXTFOLD_HELM") {
        Ok(v) if v == "unavailable" => {
            eprintln!(
                "SKIPPED: scripts/install-helm.sh could not install helm on this machine \
                 (see its message)"
            );
            None
        }
        Ok(v) if !v.is_empty() => Some(PathBuf::from(v)),
        _ => {
            let found = std::env::var_os("PATH").and_then(|paths| {
                std::env::split_paths(&paths)
                    .map(|dir| dir.join("helm"))
                    .find(|p| p.is_file())
            });
            if found.is_none() {
                let message = "helm not found (CONTEXTFOLD_HELM or PATH): \
                               scripts/install-helm.sh installs it";
                assert!(
                    !require_tools(),
                    "{message}; CONTEXTFOLD_REQUIRE_DEPLOY_TOOLS is set"
                );
                eprintln!("SKIPPED: {message}");
            }
            found
        }
    }
}

/// `helm lint --strict` accepts the chart, and `helm template` renders it
/// into the objects the chart promises, with the probes on `/healthz` and
/// `/readyz`, the dashboard's JSON and every `contextfold` command line
/// accepted by the binary.
#[test]
fn helm_lints_and_renders_the_chart() {
    let Some(helm) = helm() else {
        return;
    };
    let chart = deploy("helm/contextfold");
    let home = tempfile::tempdir().unwrap();
    let helm_cmd = || {
        let mut c = Command::new(&helm);
        // No user configuration or cache of this machine's helm.
        c.env("HELM_CONFIG_HOME", home.path().join("config"))
            .env("HELM_CACHE_HOME", home.path().join("cache"))
            .env("HELM_DATA_HOME", home.path().join("data"));
        c
    };
    let lint = run(helm_cmd().args(["lint", "--strict"]).arg(&chart));
    assert!(
        lint.status.success(),
        "helm lint --strict:\n{}",
        show(&lint)
    );
    let text = String::from_utf8_lossy(&lint.stdout);
    assert!(text.contains("0 chart(s) failed"), "{text}");

    let rendered = run(helm_cmd()
        .args(["template", "cf", "--namespace", "agents"])
        .arg(&chart)
        .args([
            "--set",
            "serviceMonitor.enabled=true,dashboard.enabled=true",
        ]));
    assert!(
        rendered.status.success(),
        "helm template:\n{}",
        show(&rendered)
    );
    let Some(python) = yaml_reader() else {
        return;
    };
    let manifest = String::from_utf8_lossy(&rendered.stdout).into_owned();
    let docs = yaml_documents(&python, &manifest);
    let kinds: BTreeSet<String> = docs
        .iter()
        .filter_map(|d| d["kind"].as_str().map(str::to_string))
        .collect();
    for kind in [
        "StatefulSet",
        "Deployment",
        "ConfigMap",
        "Secret",
        "Service",
        "ServiceMonitor",
    ] {
        assert!(
            kinds.contains(kind),
            "helm template made no {kind}: {kinds:?}"
        );
    }
    let mut commands = 0;
    for doc in &docs {
        let containers = &doc["spec"]["template"]["spec"]["containers"];
        for c in containers.as_array().into_iter().flatten() {
            let origin = format!("helm template {} {}", doc["kind"], doc["metadata"]["name"]);
            assert_eq!(
                c["livenessProbe"]["httpGet"]["path"], "/healthz",
                "{origin}"
            );
            assert_eq!(
                c["readinessProbe"]["httpGet"]["path"], "/readyz",
                "{origin}"
            );
            // The image's entrypoint is contextfold: its arguments, or what
            // follows the binary in a command that names it.
            let command = strings(&c["command"]);
            let mut args: Vec<String> = command
                .iter()
                .skip_while(|a| !a.ends_with("contextfold"))
                .skip(1)
                .cloned()
                .collect();
            args.extend(strings(&c["args"]));
            assert_args_parse(&args, &BTreeMap::new(), &origin);
            commands += 1;
        }
        if doc["kind"] == "ConfigMap" {
            for (name, value) in doc["data"].as_object().into_iter().flatten() {
                if name.ends_with(".json") {
                    let text = value.as_str().unwrap_or_default();
                    serde_json::from_str::<Value>(text)
                        .unwrap_or_else(|e| panic!("{name} in the ConfigMap is not JSON: {e}"));
                }
            }
        }
    }
    assert!(commands >= 2, "no contextfold container in:\n{manifest}");

    // The check can fail: a chart with a broken template is refused.
    let broken = home.path().join("chart");
    copy_dir(&chart, &broken);
    let services = broken.join("templates/services.yaml");
    std::fs::write(
        &services,
        read(&services) + "\n{{ .Values.nope.missing }}\n",
    )
    .unwrap();
    let out = run(helm_cmd().args(["lint", "--strict"]).arg(&broken));
    assert!(
        !out.status.success(),
        "a broken chart passed helm lint:\n{}",
        show(&out)
    );
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

/// Every document of a multi-document YAML text, as JSON (empty ones left
/// out).
fn yaml_documents(python: &Path, text: &str) -> Vec<Value> {
    use std::io::Write;
    let mut child = Command::new(python)
        .args([
            "-c",
            "import sys, json, yaml; json.dump([d for d in yaml.safe_load_all(sys.stdin) if d], sys.stdout)",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "not YAML:\n{}", show(&out));
    match serde_json::from_slice(&out.stdout).unwrap() {
        Value::Array(docs) => docs,
        other => panic!("not a list of documents: {other}"),
    }
}

// ------------------------------------------------------------------- metrics

/// Every metric name the service exports: the `"contextfold_..."` string
/// constants of the telemetry module and of src/metrics.rs.
fn exported_metrics() -> BTreeSet<String> {
    let mut files = vec![
        repo().join("src/telemetry.rs"),
        repo().join("src/metrics.rs"),
    ];
    if let Ok(dir) = std::fs::read_dir(repo().join("src/telemetry")) {
        files.extend(dir.filter_map(Result::ok).map(|e| e.path()));
    }
    let name = Regex::new(r#""(contextfold_[a-z0-9_]+)""#).unwrap();
    files
        .iter()
        .filter(|f| f.is_file())
        .flat_map(|f| {
            name.captures_iter(&read(f))
                .map(|c| c[1].to_string())
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Every PromQL expression of the alert rules and the dashboard, with
/// where it is.
fn queries(python: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let rules = yaml(
        python,
        &read(&deploy("prometheus/alerts.yml")),
        "alerts.yml",
    );
    for group in rules["groups"].as_array().expect("groups") {
        for rule in group["rules"].as_array().expect("rules") {
            out.push((
                format!("alert {}", rule["alert"]),
                rule["expr"].as_str().expect("expr").to_string(),
            ));
        }
    }
    out.extend(dashboard_queries());
    // Query variables (`label_values(...)`, Grafana's, not PromQL).
    let dashboard = dashboard();
    for var in dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if let Some(q) = var["query"]["query"].as_str() {
            out.push((format!("variable {}", var["name"]), q.to_string()));
        }
    }
    out
}

fn dashboard() -> Value {
    let text = read(&deploy("grafana/dashboards/contextfold.json"));
    serde_json::from_str(&text).expect("the dashboard is JSON")
}

/// Every PromQL expression of the dashboard's panels, with where it is.
fn dashboard_queries() -> Vec<(String, String)> {
    let mut out = Vec::new();
    let dashboard = dashboard();
    let mut panels: Vec<&Value> = dashboard["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .collect();
    while let Some(panel) = panels.pop() {
        if let Some(inner) = panel["panels"].as_array() {
            panels.extend(inner);
        }
        for target in panel["targets"].as_array().into_iter().flatten() {
            out.push((
                format!("panel {}", panel["title"]),
                target["expr"].as_str().expect("expr").to_string(),
            ));
        }
    }
    out
}

#[test]
fn the_dashboard_and_the_alerts_query_only_metrics_the_service_exports() {
    let Some(python) = yaml_reader() else {
        return;
    };
    let queries = queries(&python);
    assert!(queries.len() > 10, "{queries:?}");
    let used = Regex::new(r"\b(contextfold_[a-z0-9_]+)").unwrap();
    let mut names = BTreeMap::<String, Vec<String>>::new();
    for (origin, expr) in &queries {
        let found: Vec<String> = used.captures_iter(expr).map(|c| c[1].to_string()).collect();
        assert!(
            !found.is_empty() || expr.contains("up{"),
            "{origin} queries no contextfold metric: {expr}"
        );
        for n in found {
            names.entry(n).or_default().push(origin.clone());
        }
    }
    if !has_operator_http() {
        eprintln!(
            "SKIPPED: this tree has no src/telemetry.rs, so no exporter: the {} metric \
             names deploy/ queries are checked where the telemetry module exists",
            names.len()
        );
        return;
    }
    let exported = exported_metrics();
    // Histograms are exported as NAME_bucket, NAME_sum and NAME_count.
    let is_exported = |n: &str| {
        exported.contains(n)
            || ["_bucket", "_sum", "_count"].iter().any(|s| {
                n.strip_suffix(s)
                    .is_some_and(|base| exported.contains(base))
            })
    };
    let unknown: Vec<String> = names
        .iter()
        .filter(|(n, _)| !is_exported(n))
        .map(|(n, origins)| format!("{n} (in {})", origins.join(", ")))
        .collect();
    assert!(
        unknown.is_empty(),
        "deploy/ queries metrics the service does not export:\n  {}\nexported: {exported:?}",
        unknown.join("\n  ")
    );
}

#[test]
fn grafana_is_provisioned_with_the_prometheus_and_the_dashboard_compose_mounts() {
    let Some(python) = yaml_reader() else {
        return;
    };
    let sources = yaml(
        &python,
        &read(&deploy("grafana/provisioning/datasources/prometheus.yml")),
        "datasources",
    );
    assert_eq!(sources["datasources"][0]["url"], "http://prometheus:9090");
    let providers = yaml(
        &python,
        &read(&deploy("grafana/provisioning/dashboards/contextfold.yml")),
        "dashboard providers",
    );
    let path = providers["providers"][0]["options"]["path"]
        .as_str()
        .expect("provider path");
    let compose = yaml(&python, &read(&deploy("compose.yaml")), "compose.yaml");
    let mounts = strings(&compose["services"]["grafana"]["volumes"]);
    assert!(
        mounts
            .iter()
            .any(|m| m.starts_with("./grafana/dashboards:") && m.contains(&format!(":{path}"))),
        "grafana loads dashboards from {path}, compose mounts {mounts:?}"
    );
    assert_eq!(dashboard()["uid"], "contextfold");
    for readme in ["README.md", "helm/contextfold/README.md"] {
        assert!(deploy(readme).is_file(), "deploy/{readme} is missing");
    }
}
