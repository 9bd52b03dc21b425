//! The one typed configuration: a TOML file plus `CONTEXTFOLD_*`
//! environment overrides. Invalid values are reported, never replaced.
//!
//! Environment overrides name a path with `__` between levels, for the
//! sections below only: `CONTEXTFOLD_DATA_DIR=/var/lib/cf`,
//! `CONTEXTFOLD_POLICY__CONTEXT_THRESHOLD=0.8`,
//! `CONTEXTFOLD_STORE__BACKEND=sled`, `CONTEXTFOLD_NATS__PARTITIONS=32`.
//! A value is read as TOML (numbers, booleans, `["a","b"]`) and otherwise
//! as a string; secrets (`password`, `token`, `nkey_seed`) are always
//! taken verbatim, since a password may look like a number.
//! `CONTEXTFOLD_SUMMARIZER__BASE_URL=http://127.0.0.1:8080/v1` turns the
//! model summarizer on.
//!
//! Every other `CONTEXTFOLD_*` variable is an error naming the nearest
//! known key, so a misspelled override is not silently ignored, except the
//! variables in [`NON_CONFIG_VARS`] and [`NON_CONFIG_PREFIXES`] (read by
//! the binary, the tests and the benchmarks, not by this loader) and the
//! variable `summarizer.api_key_env` names.
//!
//! Nothing here prints a secret: [`Config::to_toml`] shows secrets and URL
//! credentials as `***`, and a file that is not valid TOML is reported by
//! line and column, without quoting the line.

use crate::core::policy::{PolicyConfig, PolicyError};
pub use crate::http::HttpConfig;
use crate::nats::NatsConfig;
use crate::runtime::recall::RecallConfig;
use crate::secret::redact_url;
pub use crate::store::{StoreBackend, StoreConfig};
use crate::summarizer::SummarizerConfig;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Where state lives when neither `--data` nor `data_dir` says otherwise.
pub const DEFAULT_DATA_DIR: &str = ".contextfold";

/// Top-level sections an environment override may name.
const SECTIONS: [&str; 9] = [
    "data_dir",
    "store",
    "policy",
    "summarizer",
    "recall",
    "nats",
    "http",
    "log",
    "gateway",
];

/// `CONTEXTFOLD_*` variables that are not configuration keys, skipped by
/// the loader: the config file and log filter of the binary, where the
/// tests find nats-server and the mock LLM servers and whether they must,
/// golden-file blessing, shared test data, the store crash test's
/// directory, where the tests find Prometheus and whether they must,
/// whether the deploy/ checks must find their tools, whether the audit
/// page test must find Chromium and where it saves its screenshot, and the
/// convergence tests' fault point (`nats::folder::Fault`) and matrix.
pub const NON_CONFIG_VARS: [&str; 19] = [
    "CONTEXTFOLD_CONFIG",
    "CONTEXTFOLD_LOG",
    "CONTEXTFOLD_VENV",
    "CONTEXTFOLD_NATS_SERVER",
    "CONTEXTFOLD_REQUIRE_NATS",
    "CONTEXTFOLD_REQUIRE_LLM_SERVERS",
    "CONTEXTFOLD_BLESS",
    "CONTEXTFOLD_SHARED_DATA",
    "CONTEXTFOLD_STORE_CRASH_DIR",
    "CONTEXTFOLD_PROMETHEUS",
    "CONTEXTFOLD_REQUIRE_PROMETHEUS",
    "CONTEXTFOLD_REQUIRE_DEPLOY_TOOLS",
    "CONTEXTFOLD_REQUIRE_BROWSER",
    "CONTEXTFOLD_SCREENSHOT_DIR",
    "CONTEXTFOLD_TEST_FAULT",
    "CONTEXTFOLD_CONVERGENCE",
    // scripts/test.sh: the helm binary tests/deploy.rs runs.
    "CONTEXTFOLD_HELM",
    // scripts/real-model-eval.sh: its binary and its cache.
    "CONTEXTFOLD_BIN",
    "CONTEXTFOLD_REAL_MODEL_DIR",
];

/// Prefixes of benchmark knobs (`CONTEXTFOLD_BENCH_SCALE`, ...), skipped
/// by the loader too.
pub const NON_CONFIG_PREFIXES: [&str; 5] = [
    "CONTEXTFOLD_BENCH_",
    "CONTEXTFOLD_SOAK_",
    "CONTEXTFOLD_FLEET_",
    "CONTEXTFOLD_TAKEOVER_",
    "CONTEXTFOLD_FLOOD_",
];

/// Keys whose environment value is taken verbatim, never as TOML: the
/// secrets (a password `0123` must not become the number 123).
const VERBATIM_KEYS: [&str; 3] = ["password", "token", "nkey_seed"];

fn is_non_config_var(var: &str) -> bool {
    NON_CONFIG_VARS.contains(&var) || NON_CONFIG_PREFIXES.iter().any(|p| var.starts_with(p))
}

/// The variable that sets `path` (`["policy", "fresh_tail_count"]` ->
/// `CONTEXTFOLD_POLICY__FRESH_TAIL_COUNT`).
fn env_var_of(path: &[String]) -> String {
    format!("CONTEXTFOLD_{}", path.join("__").to_ascii_uppercase())
}

/// The candidate nearest to `word` by edit distance.
fn nearest<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    candidates
        .into_iter()
        .min_by_key(|c| strsim::levenshtein(word, c))
}

/// For a variable whose first segment is no section: the nearest
/// variable contextfold reads (a section with the same rest, or a
/// non-config variable). `CONTEXTFOLD_NATS_PARTITIONS` (one underscore)
/// gives `CONTEXTFOLD_NATS__PARTITIONS`.
fn nearest_for_unknown_section(var: &str, path: &[String]) -> String {
    let mut candidates: Vec<String> = NON_CONFIG_VARS.iter().map(|v| v.to_string()).collect();
    for section in SECTIONS {
        let mut guess: Vec<String> = match path[0].strip_prefix(&format!("{section}_")) {
            Some(rest) if section != "data_dir" => vec![section.to_string(), rest.to_string()],
            _ => vec![section.to_string()],
        };
        if section != "data_dir" {
            guess.extend(path[1..].iter().filter(|k| !k.is_empty()).cloned());
        }
        candidates.push(env_var_of(&guess));
    }
    nearest(var, candidates.iter().map(String::as_str))
        .unwrap_or("CONTEXTFOLD_DATA_DIR")
        .to_string()
}

/// Deserializes `Config` from this one override alone: if its key is
/// unknown, the unknown segment and the nearest known key (from the
/// deserializer's list of expected fields), as a variable.
fn probe_unknown_key(path: &[String], value: &toml::Value) -> Option<(String, String)> {
    let mut leaf = value.clone();
    for key in path.iter().rev() {
        let mut t = toml::Table::new();
        t.insert(key.clone(), leaf);
        leaf = toml::Value::Table(t);
    }
    let err = leaf.try_into::<Config>().err()?;
    let (field, expected) = unknown_field(err.message())?;
    let at = path.iter().position(|k| k == field)?;
    let mut suggestion = path.to_vec();
    if let Some(best) = nearest(field, expected) {
        suggestion[at] = best.to_string();
    }
    Some((path[..=at].join("."), env_var_of(&suggestion)))
}

/// The unknown field a deserializer's message names, and the fields it
/// expected there ("unknown field `x`, expected one of `a`, `b`").
fn unknown_field(message: &str) -> Option<(&str, Vec<&str>)> {
    let rest = message.split_once("unknown field `")?.1;
    let (field, rest) = rest.split_once('`')?;
    let expected = rest
        .split_once("expected")
        .map_or("", |(_, e)| e)
        .split('`')
        .skip(1)
        .step_by(2)
        .collect();
    Some((field, expected))
}

/// A key of the configuration file that is no key: the key, its section
/// (`[policy]`, or the top level), the nearest key there, and the file's
/// lines where the key is set (only their numbers: a line may hold a
/// password).
fn file_key_typo(message: &str, text: &str) -> Option<(String, String, String, Vec<usize>)> {
    let (field, expected) = unknown_field(message)?;
    let nearest = nearest(field, expected)?.to_string();
    let section = message
        .rsplit_once("in `")
        .and_then(|(_, rest)| rest.split_once('`'))
        .map_or_else(|| "the top level".to_string(), |(s, _)| format!("[{s}]"));
    let lines = text
        .lines()
        .enumerate()
        .filter(|(_, line)| {
            let line = line.trim_start();
            let line = line.trim_start_matches(['"', '\'']);
            line.strip_prefix(field).is_some_and(|rest| {
                rest.trim_start_matches(['"', '\''])
                    .trim_start()
                    .starts_with('=')
            })
        })
        .map(|(i, _)| i + 1)
        .collect();
    Some((field.to_string(), section, nearest, lines))
}

/// "line L, column C" of a byte offset in `text`.
fn line_and_column(text: &str, offset: usize) -> String {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
    format!("line {line}, column {column}")
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Where the embedded log and the state live (default `.contextfold`).
    pub data_dir: PathBuf,
    pub store: StoreConfig,
    pub policy: PolicyConfig,
    /// The model summarizer (`[summarizer]`, every field defaulted). Absent:
    /// the deterministic summarizer, which needs no model and spends
    /// nothing. Present (even as `CONTEXTFOLD_SUMMARIZER__BASE_URL` alone):
    /// summaries are written by the model at its `base_url`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summarizer: Option<SummarizerConfig>,
    /// The model that answers `recall` (`[recall]`): its own endpoint and
    /// model, or the summarizer's; the cap and deadline of a recall.
    pub recall: RecallConfig,
    /// How `serve` and `publish` reach NATS, and the JetStream layout.
    pub nats: NatsConfig,
    /// The operators' HTTP server of `serve` (`/metrics`, `/healthz`,
    /// `/readyz`); off unless `listen` is set.
    pub http: HttpConfig,
    /// How the binary logs.
    pub log: LogConfig,
    /// The LLM gateway (`contextfold gateway`, `serve --roles gateway`).
    pub gateway: GatewayConfig,
}

/// `[gateway]`: the LLM gateway in front of an upstream provider
/// (`contextfold gateway`, docs/gateway.md). Every field has a default;
/// only the upstream must be given (here or with `--upstream`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GatewayConfig {
    /// Address the gateway listens on (default `127.0.0.1:8787`;
    /// `--listen` overrides it).
    pub listen: std::net::SocketAddr,
    /// The upstream provider's base URL, without `/v1`
    /// (`https://provider.example`): every path is forwarded below it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upstream: Option<String>,
    /// Per-surface upstreams, overriding `upstream` for that surface:
    /// Chat Completions, Responses, Anthropic Messages.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upstream_chat: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upstream_responses: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upstream_messages: Option<String>,
    /// `active` (default): past the budget the model receives contextfold's
    /// assembled context. `shadow`: every request goes upstream unchanged;
    /// the gateway stores the turns and reports what it would have sent.
    pub mode: GatewayMode,
    /// Tokens past which a request is sent as `[client system and tools]
    /// [summary block] [fresh tail]` (default: the policy's budget,
    /// `policy.default_context_window` capped by
    /// `policy.max_assembly_token_budget`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub budget_tokens: Option<u64>,
    /// Largest request body accepted, in bytes after decompression
    /// (default 32 MiB); larger ones get a provider-shaped 413.
    pub max_body_bytes: usize,
    /// Largest response kept to store as a turn (default 16 MiB); a
    /// larger one is still passed through whole, and stored cut, marked.
    pub max_stored_response_bytes: usize,
    /// When the upstream answers with a context-overflow error: retry once
    /// with the assembled context (default false: the error goes back to
    /// the client unchanged; it is recorded either way).
    pub retry_overflow: bool,
    /// When NATS cannot take a turn: `fail_open` (default: forward
    /// unchanged, spool the turn, publish it when NATS is back) or
    /// `refuse` (a provider-shaped 503).
    pub on_store_unavailable: StoreUnavailable,
    /// Whole-request deadline for the upstream, ms (default 600,000).
    pub upstream_timeout_ms: u64,
    /// Connect deadline for the upstream, ms (default 10,000).
    pub upstream_connect_timeout_ms: u64,
    /// Requests in flight to the upstream per tenant (default 64): one
    /// tenant's slow upstream fills its own allowance, never another's.
    pub max_in_flight_per_tenant: usize,
    /// Turns the conversation index holds at most (default 1,000,000; under
    /// 100 MB by an estimate from its entry sizes): past it the conversations used least recently are
    /// forgotten, as a restart forgets them; their next request resolves
    /// to the same conversation by content (docs/gateway.md, "Keying").
    pub keying_max_turns: usize,
    /// Where turns wait when NATS cannot take them (default
    /// `<data_dir>/gateway-spool`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spool_dir: Option<PathBuf>,
    /// Tenants by gateway key (`x-contextfold-key` or the bearer token).
    /// None configured: one tenant, `default`, and no key asked for.
    pub tenants: Vec<GatewayTenant>,
}

/// Turns the gateway's conversation index holds at most by default
/// (`gateway.keying_max_turns`; under 100 MB by an estimate, not measured).
pub const DEFAULT_KEYING_MAX_TURNS: usize = 1_000_000;

/// What the gateway does past the budget.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GatewayMode {
    #[default]
    Active,
    Shadow,
}

/// What the gateway does when the store cannot take a turn.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StoreUnavailable {
    #[default]
    FailOpen,
    Refuse,
}

/// One tenant of the gateway.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayTenant {
    /// Its name: the prefix of its conversations (`<name>/...`), so NATS
    /// permissions on `cf.in.<name>/...` subjects isolate it. Letters,
    /// digits, `-` and `_`.
    pub name: String,
    /// The gateway key its clients present.
    pub key: crate::secret::Secret,
    /// The upstream credential used for it; absent: the client's own
    /// `Authorization` / `x-api-key` is passed through.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream_api_key: Option<crate::secret::Secret>,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            listen: std::net::SocketAddr::from(([127, 0, 0, 1], 8787)),
            upstream: None,
            upstream_chat: None,
            upstream_responses: None,
            upstream_messages: None,
            mode: GatewayMode::Active,
            budget_tokens: None,
            max_body_bytes: 32 * 1024 * 1024,
            max_stored_response_bytes: 16 * 1024 * 1024,
            retry_overflow: false,
            on_store_unavailable: StoreUnavailable::FailOpen,
            upstream_timeout_ms: 600_000,
            upstream_connect_timeout_ms: 10_000,
            max_in_flight_per_tenant: 64,
            keying_max_turns: DEFAULT_KEYING_MAX_TURNS,
            spool_dir: None,
            tenants: Vec::new(),
        }
    }
}

impl GatewayConfig {
    /// Refuses values the gateway cannot honour; the message says which.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_body_bytes < 1024 {
            return Err("max_body_bytes must be at least 1024".into());
        }
        if self.budget_tokens == Some(0) {
            return Err(
                "budget_tokens must be at least 1 (omit it for the policy's budget)".into(),
            );
        }
        if self.keying_max_turns == 0 {
            return Err("keying_max_turns must be at least 1".into());
        }
        if self.max_in_flight_per_tenant == 0 {
            return Err("max_in_flight_per_tenant must be at least 1".into());
        }
        for url in [
            &self.upstream,
            &self.upstream_chat,
            &self.upstream_responses,
            &self.upstream_messages,
        ]
        .into_iter()
        .flatten()
        {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(format!(
                    "upstream {} is not an http:// or https:// URL",
                    redact_url(url)
                ));
            }
        }
        let mut names = std::collections::BTreeSet::new();
        let mut keys = std::collections::BTreeSet::new();
        for t in &self.tenants {
            let ok = !t.name.is_empty()
                && t.name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
            if !ok {
                return Err(format!(
                    "tenant name {:?} must be letters, digits, `-` and `_`",
                    t.name
                ));
            }
            if !names.insert(t.name.clone()) {
                return Err(format!("tenant {:?} is listed twice", t.name));
            }
            if t.key.expose().len() < 8 {
                return Err(format!(
                    "tenant {:?}: its key must be at least 8 characters",
                    t.name
                ));
            }
            if !keys.insert(t.key.expose().to_string()) {
                return Err(format!("tenant {:?}: its key is another tenant's", t.name));
            }
        }
        Ok(())
    }

    /// The form that may be shown: URL credentials replaced by `***`
    /// (tenant keys are [`crate::secret::Secret`]s already).
    pub fn redacted(&self) -> GatewayConfig {
        let mut shown = self.clone();
        for url in [
            &mut shown.upstream,
            &mut shown.upstream_chat,
            &mut shown.upstream_responses,
            &mut shown.upstream_messages,
        ]
        .into_iter()
        .flatten()
        {
            *url = redact_url(url);
        }
        shown
    }
}

/// `[log]`: the binary's log output (the filter is `CONTEXTFOLD_LOG`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    /// `text` (default) or `json` (one object a line, for log pipelines);
    /// `--log-format` overrides it.
    pub format: LogFormat,
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines on stderr.
    #[default]
    Text,
    /// One JSON object a line on stderr, with the span fields.
    Json,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            data_dir: PathBuf::from(DEFAULT_DATA_DIR),
            store: StoreConfig::default(),
            policy: PolicyConfig::default(),
            summarizer: None,
            recall: RecallConfig::default(),
            nats: NatsConfig::default(),
            http: HttpConfig::default(),
            log: LogConfig::default(),
            gateway: GatewayConfig::default(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// Located by line and column, without the TOML error as its cause:
    /// that error quotes the line, which may hold a password.
    #[error("config file {path} is not valid TOML: {detail}")]
    Parse { path: String, detail: String },
    #[error("invalid configuration{origin}: {source}")]
    Invalid {
        origin: String,
        /// The TOML error, or the validation's sentence.
        #[source]
        source: crate::BoxError,
    },
    #[error("environment variable {var}: {detail}")]
    Env { var: String, detail: String },
    #[error(
        "environment variable {var} is not a configuration key ({reason}); the nearest \
         known one is {nearest}. Overrides are CONTEXTFOLD_<SECTION>__<KEY> with sections \
         data_dir, store, policy, summarizer, recall, nats, http, log and gateway; the variables that are not keys are \
         listed in the README"
    )]
    UnknownEnv {
        var: String,
        reason: String,
        nearest: String,
    },
    #[error(
        "config file {path}: unknown key `{key}` in {section}{at}; the nearest known key is \
         `{nearest}` (`contextfold config` prints every key with its value)"
    )]
    UnknownKey {
        path: String,
        key: String,
        section: String,
        nearest: String,
        /// ", line N" (or lines) where the file sets it; empty when not found.
        at: String,
    },
    #[error(transparent)]
    Policy(#[from] PolicyError),
}

impl ConfigError {
    /// `text`, read from `path`, is not TOML: where and why, without
    /// quoting it.
    fn parse(path: &Path, text: &str, e: &toml::de::Error) -> ConfigError {
        ConfigError::Parse {
            path: path.display().to_string(),
            detail: match e.span() {
                Some(span) => format!("{}: {}", line_and_column(text, span.start), e.message()),
                None => e.message().to_string(),
            },
        }
    }
}

impl Config {
    /// Reads the file (if any), applies `CONTEXTFOLD_*` overrides from the
    /// process environment, and validates.
    pub fn load(path: Option<&Path>) -> Result<Config, ConfigError> {
        Self::load_with_env(path, std::env::vars())
    }

    /// A policy file (`replay --policy`): the keys of a `[policy]` section,
    /// bare or under a `[policy]` header, parsed and checked as the
    /// configuration's section is (unknown keys rejected, then validated).
    pub fn load_policy_file(path: &Path) -> Result<PolicyConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let mut table = text
            .parse::<toml::Table>()
            .map_err(|e| ConfigError::parse(path, &text, &e))?;
        if table.len() == 1 {
            if let Some(toml::Value::Table(section)) = table.get("policy") {
                table = section.clone();
            }
        }
        let policy: PolicyConfig =
            toml::Value::Table(table)
                .try_into()
                .map_err(|e: toml::de::Error| ConfigError::Invalid {
                    origin: format!(" in {}", path.display()),
                    source: e.into(),
                })?;
        policy.validate()?;
        Ok(policy)
    }

    pub fn load_with_env(
        path: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigError> {
        let mut file_text = String::new();
        let mut table = match path {
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|source| ConfigError::Read {
                    path: p.display().to_string(),
                    source,
                })?;
                file_text.clone_from(&text);
                // Located by line and column, not quoted: the line may
                // hold a password.
                text.parse::<toml::Table>()
                    .map_err(|e| ConfigError::parse(p, &text, &e))?
            }
            None => toml::Table::new(),
        };
        let mut applied = Vec::new();
        let mut probes = Vec::new();
        let mut unknown = Vec::new();
        for (var, value) in env {
            let Some(rest) = var.strip_prefix("CONTEXTFOLD_") else {
                continue;
            };
            if is_non_config_var(&var) {
                continue;
            }
            let path: Vec<String> = rest.split("__").map(|s| s.to_ascii_lowercase()).collect();
            if !SECTIONS.contains(&path[0].as_str()) || path.iter().any(String::is_empty) {
                unknown.push((var, path));
                continue;
            }
            let verbatim = path
                .last()
                .is_some_and(|k| VERBATIM_KEYS.contains(&k.as_str()));
            let parsed = if verbatim {
                toml::Value::String(value.clone())
            } else {
                format!("v = {value}")
                    .parse::<toml::Table>()
                    .ok()
                    .and_then(|mut t| t.remove("v"))
                    .unwrap_or(toml::Value::String(value.clone()))
            };
            probes.push((var.clone(), path.clone(), parsed.clone()));
            let mut node = &mut table;
            for (i, key) in path.iter().enumerate() {
                if i + 1 == path.len() {
                    node.insert(key.clone(), parsed.clone());
                } else {
                    let entry = node
                        .entry(key.clone())
                        .or_insert_with(|| toml::Value::Table(toml::Table::new()));
                    node = entry.as_table_mut().ok_or_else(|| ConfigError::Env {
                        var: var.clone(),
                        detail: format!("{key} is not a section"),
                    })?;
                }
            }
            applied.push(var);
        }
        // The variable holding the model's API key may be any name, ours
        // included.
        let api_key_env = table
            .get("summarizer")
            .and_then(|s| s.get("api_key_env"))
            .and_then(toml::Value::as_str)
            .map_or_else(|| SummarizerConfig::default().api_key_env, str::to_string);
        // So may the recall model's.
        let recall_key_env = table
            .get("recall")
            .and_then(|s| s.get("api_key_env"))
            .and_then(toml::Value::as_str)
            .map(str::to_string);
        if let Some((var, path)) = unknown
            .into_iter()
            .find(|(var, _)| *var != api_key_env && Some(var) != recall_key_env.as_ref())
        {
            let reason = if path.iter().any(String::is_empty) {
                "an empty segment between `__`".to_string()
            } else {
                format!("no section `{}`", path[0])
            };
            return Err(ConfigError::UnknownEnv {
                nearest: nearest_for_unknown_section(&var, &path),
                var,
                reason,
            });
        }
        let origin = match (path, applied.is_empty()) {
            (Some(p), true) => format!(" in {}", p.display()),
            (Some(p), false) => format!(" in {} or {}", p.display(), applied.join(", ")),
            (None, false) => format!(" in {}", applied.join(", ")),
            (None, true) => String::new(),
        };
        let config: Config = match toml::Value::Table(table).try_into() {
            Ok(config) => config,
            Err(e) => {
                // A misspelled override: name it and the key it missed.
                for (var, path, value) in &probes {
                    if let Some((unknown, nearest)) = probe_unknown_key(path, value) {
                        return Err(ConfigError::UnknownEnv {
                            var: var.clone(),
                            reason: format!("no key `{unknown}`"),
                            nearest,
                        });
                    }
                }
                let e: toml::de::Error = e;
                // A misspelled key of the file: name it, where it is, and
                // the key it missed (not every key of its section).
                if let Some(p) = path {
                    if let Some((key, section, nearest, lines)) =
                        file_key_typo(&e.to_string(), &file_text)
                    {
                        let at = match lines.as_slice() {
                            [] => String::new(),
                            [one] => format!(", line {one}"),
                            many => format!(
                                ", lines {}",
                                many.iter()
                                    .map(ToString::to_string)
                                    .collect::<Vec<_>>()
                                    .join(", ")
                            ),
                        };
                        return Err(ConfigError::UnknownKey {
                            path: p.display().to_string(),
                            key,
                            section,
                            nearest,
                            at,
                        });
                    }
                }
                return Err(ConfigError::Invalid {
                    origin,
                    source: e.into(),
                });
            }
        };
        config.policy.validate()?;
        if let Some(summarizer) = &config.summarizer {
            summarizer
                .validate()
                .map_err(|detail| ConfigError::Invalid {
                    origin: String::new(),
                    source: detail.into(),
                })?;
        }
        config
            .recall
            .validate()
            .map_err(|detail| ConfigError::Invalid {
                origin: String::new(),
                source: detail.into(),
            })?;
        config.nats.validate().map_err(|e| ConfigError::Invalid {
            origin: String::new(),
            source: format!("[nats] {e}").into(),
        })?;
        config
            .store
            .validate()
            .map_err(|detail| ConfigError::Invalid {
                origin: String::new(),
                source: detail.into(),
            })?;
        config
            .gateway
            .validate()
            .map_err(|detail| ConfigError::Invalid {
                origin: String::new(),
                source: format!("[gateway] {detail}").into(),
            })?;
        Ok(config)
    }

    /// This configuration as it may be shown: secrets (already `***` when
    /// serialized) and the credentials in URLs replaced by `***`.
    pub fn redacted(&self) -> Config {
        let mut shown = self.clone();
        let servers = &mut shown.nats.connection.servers;
        *servers = servers.iter().map(|s| redact_url(s)).collect();
        if let Some(s) = &mut shown.summarizer {
            s.base_url = redact_url(&s.base_url);
        }
        if let Some(url) = &mut shown.recall.base_url {
            *url = redact_url(url);
        }
        shown.gateway = shown.gateway.redacted();
        shown
    }

    /// The configuration as TOML, for `contextfold config`: secrets and URL
    /// credentials appear as `***`.
    #[allow(clippy::expect_used)] // only a bug reaches the expect (see its message)
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(&self.redacted()).expect("config serializes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    }

    #[test]
    fn env_overrides_and_defaults() {
        let c = Config::load_with_env(
            None,
            env(&[
                ("CONTEXTFOLD_POLICY__CONTEXT_THRESHOLD", "0.8"),
                ("CONTEXTFOLD_DATA_DIR", "/tmp/x"),
                ("CONTEXTFOLD_POLICY__IGNORE_SESSIONS", r#"["cron:**"]"#),
                ("CONTEXTFOLD_BENCH_SCALE", "3"),
            ]),
        )
        .unwrap();
        assert_eq!(c.policy.context_threshold, 0.8);
        assert_eq!(c.data_dir, PathBuf::from("/tmp/x"));
        assert_eq!(c.policy.ignore_sessions, vec!["cron:**".parse().unwrap()]);
        assert_eq!(c.policy.fresh_tail_count, 64);
    }

    #[test]
    fn the_http_token_is_read_verbatim_and_never_shown() {
        let c = Config::load_with_env(
            None,
            env(&[
                ("CONTEXTFOLD_HTTP__TOKEN", "0123456789012345"),
                ("CONTEXTFOLD_HTTP__ALLOWED_HOSTS", r#"["audit.internal"]"#),
            ]),
        )
        .unwrap();
        assert_eq!(
            c.http.token.as_ref().map(crate::secret::Secret::expose),
            Some("0123456789012345")
        );
        assert_eq!(c.http.allowed_hosts, ["audit.internal"]);
        assert!(!c.to_toml().contains("0123456789012345"));
        assert!(!format!("{c:?}").contains("0123456789012345"));
    }

    #[test]
    fn http_is_off_by_default_and_log_format_is_text() {
        let c = Config::load_with_env(None, Vec::new()).unwrap();
        assert_eq!(c.http.listen, None);
        assert_eq!(c.log.format, LogFormat::Text);
        let c = Config::load_with_env(
            None,
            env(&[
                ("CONTEXTFOLD_HTTP__LISTEN", "127.0.0.1:9464"),
                ("CONTEXTFOLD_LOG__FORMAT", "json"),
                ("CONTEXTFOLD_LOG", "info"),
            ]),
        )
        .unwrap();
        assert_eq!(c.http.listen, Some("127.0.0.1:9464".parse().unwrap()));
        assert_eq!(c.log.format, LogFormat::Json);
        let err = Config::load_with_env(None, env(&[("CONTEXTFOLD_HTTP__LISTEN", "nowhere")]))
            .unwrap_err();
        assert!(err.to_string().contains("listen"), "{err}");
        let err =
            Config::load_with_env(None, env(&[("CONTEXTFOLD_HTTP__LISTENS", "x")])).unwrap_err();
        assert!(
            err.to_string().contains("CONTEXTFOLD_HTTP__LISTEN"),
            "{err}"
        );
        let err =
            Config::load_with_env(None, env(&[("CONTEXTFOLD_LOG__FORMAT", "xml")])).unwrap_err();
        assert!(err.to_string().contains("format"), "{err}");
    }

    #[test]
    fn invalid_values_are_reported_not_replaced() {
        let err = Config::load_with_env(
            None,
            env(&[("CONTEXTFOLD_POLICY__CONTEXT_THRESHOLD", "1.5")]),
        )
        .unwrap_err();
        assert!(err.to_string().contains("context_threshold"), "{err}");
        let err = Config::load_with_env(
            None,
            env(&[("CONTEXTFOLD_POLICY__FRESH_TAIL_COUNT", "many")]),
        )
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("CONTEXTFOLD_POLICY__FRESH_TAIL_COUNT"),
            "{err}"
        );
        let err = Config::load_with_env(None, env(&[("CONTEXTFOLD_POLICY__NO_SUCH_KNOB", "1")]))
            .unwrap_err();
        assert!(err.to_string().contains("no_such_knob"), "{err}");
    }

    #[test]
    fn a_bad_session_glob_is_reported_when_the_configuration_is_read() {
        for (var, value) in [
            ("CONTEXTFOLD_POLICY__IGNORE_SESSIONS", r#"["cron:a**"]"#),
            ("CONTEXTFOLD_POLICY__STATELESS_SESSIONS", r#"[""]"#),
            (
                "CONTEXTFOLD_POLICY__THRESHOLD_OVERRIDES",
                r#"[{session = "**x", context_threshold = 0.5}]"#,
            ),
        ] {
            let err = Config::load_with_env(None, env(&[(var, value)])).unwrap_err();
            let message = err.to_string();
            assert!(message.contains("session glob"), "{var}: {message}");
            assert!(message.contains(var), "{var}: {message}");
        }
    }

    #[test]
    fn a_summarizer_base_url_turns_the_model_on() {
        let c = Config::load_with_env(None, Vec::new()).unwrap();
        assert_eq!(c.summarizer, None, "no section: deterministic");
        let c = Config::load_with_env(
            None,
            env(&[
                ("CONTEXTFOLD_SUMMARIZER__BASE_URL", "http://127.0.0.1:9/v1"),
                ("CONTEXTFOLD_SUMMARIZER__MAX_RETRIES", "0"),
            ]),
        )
        .unwrap();
        let s = c.summarizer.expect("section from the environment");
        assert_eq!(s.base_url, "http://127.0.0.1:9/v1");
        assert_eq!(s.max_retries, 0);
        assert_eq!(s.model, SummarizerConfig::default().model);
        let err =
            Config::load_with_env(None, env(&[("CONTEXTFOLD_SUMMARIZER__NO_SUCH_KNOB", "1")]))
                .unwrap_err();
        assert!(err.to_string().contains("no_such_knob"), "{err}");
    }

    fn unknown_env(vars: &[(&str, &str)]) -> (String, String, String) {
        match Config::load_with_env(None, env(vars)) {
            Err(ConfigError::UnknownEnv {
                var,
                reason,
                nearest,
            }) => (var, reason, nearest),
            other => panic!("{vars:?}: expected an unknown variable, got {other:?}"),
        }
    }

    #[test]
    fn a_misspelled_override_names_itself_and_the_nearest_key() {
        let (var, reason, nearest) =
            unknown_env(&[("CONTEXTFOLD_POLICY__CONTEXT_THRESHOLDD", "0.8")]);
        assert_eq!(var, "CONTEXTFOLD_POLICY__CONTEXT_THRESHOLDD");
        assert!(reason.contains("policy.context_thresholdd"), "{reason}");
        assert_eq!(nearest, "CONTEXTFOLD_POLICY__CONTEXT_THRESHOLD");
        let cases = [
            (
                "CONTEXTFOLD_POLICYY__CONTEXT_THRESHOLD",
                "CONTEXTFOLD_POLICY__CONTEXT_THRESHOLD",
            ),
            (
                "CONTEXTFOLD_NATS_PARTITIONS",
                "CONTEXTFOLD_NATS__PARTITIONS",
            ),
            (
                "CONTEXTFOLD_NATS__CONECTION__SERVERS",
                "CONTEXTFOLD_NATS__CONNECTION__SERVERS",
            ),
            (
                "CONTEXTFOLD_NATS__CONNECTION__PASWORD",
                "CONTEXTFOLD_NATS__CONNECTION__PASSWORD",
            ),
            ("CONTEXTFOLD_DATADIR", "CONTEXTFOLD_DATA_DIR"),
            ("CONTEXTFOLD_LOGG", "CONTEXTFOLD_LOG"),
            ("CONTEXTFOLD_STORE__BACKEN", "CONTEXTFOLD_STORE__BACKEND"),
            ("CONTEXTFOLD_POLICY____X", "CONTEXTFOLD_POLICY__X"),
        ];
        for (var, want) in cases {
            let (named, _, nearest) = unknown_env(&[(var, "1")]);
            assert_eq!(named, var);
            assert_eq!(nearest, want, "{var}");
        }
        // The message says all of it.
        let err = Config::load_with_env(None, env(&[("CONTEXTFOLD_STORE__BACKEN", "redb")]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("CONTEXTFOLD_STORE__BACKEN ") && err.contains("BACKEND"),
            "{err}"
        );
    }

    #[test]
    fn variables_that_are_not_keys_are_left_alone() {
        let mut vars: Vec<(&str, &str)> = NON_CONFIG_VARS.iter().map(|v| (*v, "x")).collect();
        vars.extend([
            ("CONTEXTFOLD_BENCH_EVENTS", "5"),
            ("CONTEXTFOLD_SOAK_RUNS", "2"),
            ("OTHER_TOOL_SETTING", "1"),
        ]);
        assert_eq!(
            Config::load_with_env(None, env(&vars)).unwrap(),
            Config::default()
        );
        // The API key's variable may have our prefix.
        let c = Config::load_with_env(
            None,
            env(&[
                ("CONTEXTFOLD_SUMMARIZER__API_KEY_ENV", "CONTEXTFOLD_LLM_KEY"),
                ("CONTEXTFOLD_LLM_KEY", "sk-not-a-key"),
            ]),
        )
        .unwrap();
        assert_eq!(c.summarizer.unwrap().api_key_env, "CONTEXTFOLD_LLM_KEY");
        unknown_env(&[("CONTEXTFOLD_LLM_KEY", "sk-not-a-key")]);
    }

    #[test]
    fn secrets_from_the_environment_are_taken_verbatim() {
        let c = Config::load_with_env(
            None,
            env(&[
                ("CONTEXTFOLD_NATS__CONNECTION__USER", "alice"),
                ("CONTEXTFOLD_NATS__CONNECTION__PASSWORD", "0123"),
                ("CONTEXTFOLD_NATS__CONNECTION__TOKEN", "true"),
            ]),
        )
        .unwrap();
        let conn = &c.nats.connection;
        assert_eq!(conn.user.as_deref(), Some("alice"));
        assert_eq!(conn.password.as_ref().map(|p| p.expose()), Some("0123"));
        assert_eq!(conn.token.as_ref().map(|t| t.expose()), Some("true"));
    }

    #[test]
    fn a_misspelled_key_of_the_file_names_its_line_and_the_nearest_key_only() {
        let dir = tempfile::tempdir().unwrap();
        for (text, key, section, nearest, line) in [
            (
                "[policy]\nfresh_tail_count = 8\ncontext_thresholdd = 0.8\n",
                "context_thresholdd",
                "[policy]",
                "context_threshold",
                3,
            ),
            (
                "[nats]\npartitons = 8\n",
                "partitons",
                "[nats]",
                "partitions",
                2,
            ),
            (
                "data_dri = \"x\"\n",
                "data_dri",
                "the top level",
                "data_dir",
                1,
            ),
            (
                "[nats.connection]\n  serverz = [\"nats://h:4222\"]\n",
                "serverz",
                "[nats.connection]",
                "servers",
                2,
            ),
        ] {
            let path = dir.path().join("c.toml");
            std::fs::write(&path, text).unwrap();
            let err = Config::load_with_env(Some(&path), env(&[])).unwrap_err();
            let message = err.to_string();
            match &err {
                ConfigError::UnknownKey {
                    key: k,
                    section: s,
                    nearest: n,
                    at,
                    ..
                } => {
                    assert_eq!(
                        (k.as_str(), s.as_str(), n.as_str()),
                        (key, section, nearest)
                    );
                    assert_eq!(at, &format!(", line {line}"), "{message}");
                }
                other => panic!("{text:?}: {other:?}"),
            }
            // The nearest key, not the section's every key.
            assert!(message.matches('`').count() <= 6, "{message}");
        }
    }

    #[test]
    fn the_printed_configuration_shows_no_secret() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(
            &path,
            "[nats.connection]\nservers = [\"nats://alice:pw-in-url@h:4222\"]\n\
             token = \"tok-in-file\"\nnkey_seed = \"SU-seed-in-file\"\n",
        )
        .unwrap();
        let c = Config::load_with_env(
            Some(&path),
            env(&[("CONTEXTFOLD_NATS__CONNECTION__PASSWORD", "pw-in-env")]),
        )
        .unwrap();
        assert_eq!(
            c.nats.connection.token.as_ref().unwrap().expose(),
            "tok-in-file"
        );
        let mut c = c;
        c.summarizer = Some(SummarizerConfig {
            base_url: "https://u:pw-in-base-url@llm/v1".into(),
            ..SummarizerConfig::default()
        });
        let shown = format!("{}\n{:?}", c.to_toml(), c.redacted());
        for secret in [
            "pw-in-url",
            "tok-in-file",
            "SU-seed-in-file",
            "pw-in-env",
            "pw-in-base-url",
        ] {
            assert!(!shown.contains(secret), "{secret} shown:\n{shown}");
        }
        assert!(shown.contains("nats://alice:***@h:4222"), "{shown}");
        assert!(shown.contains("https://u:***@llm/v1"), "{shown}");
        assert!(shown.contains("token = \"***\""), "{shown}");
    }

    #[test]
    fn a_file_that_is_not_toml_is_located_not_quoted() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, "[nats.connection]\npassword = hunter#2\n").unwrap();
        let err = Config::load_with_env(Some(&path), Vec::new())
            .unwrap_err()
            .to_string();
        assert!(err.contains("line 2, column"), "{err}");
        assert!(!err.contains("hunter"), "{err}");
    }

    #[test]
    fn sled_is_refused_rather_than_replaced_by_redb() {
        let err = Config::load_with_env(None, env(&[("CONTEXTFOLD_STORE__BACKEND", "sled")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("store.backend"), "{err}");
        if cfg!(feature = "sled-store") {
            assert!(err.contains("redb stores only"), "{err}");
        } else {
            assert!(err.contains("--features sled-store"), "{err}");
        }
        let c = Config::load_with_env(None, env(&[("CONTEXTFOLD_STORE__BACKEND", "redb")]));
        assert_eq!(c.unwrap().store.backend, StoreBackend::Redb);
    }

    #[test]
    fn default_config_round_trips_through_toml() {
        let text = Config::default().to_toml();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, text).unwrap();
        assert_eq!(
            Config::load_with_env(Some(&path), Vec::new()).unwrap(),
            Config::default()
        );
    }
}
