//! `assemble` request latency over NATS request/reply for a conversation of
//! 26,500 turns (goal: p99 under 2 ms).
//!
//! The bench starts its own nats-server and serves the API
//! (`nats::api_role::start`, default settings) over a `LocalState`
//! holding one of the 26,500-turn shapes of `support/shapes.rs`
//! (`compacted`: summaries plus raw turns, about 125k tokens, assembled
//! whole with its summaries as they are; `compacted_opened`: the same with
//! the room given back, summaries opened into about 10,000 masked turns;
//! `raw_newest_155k`: uncompacted, a 155k-token budget;
//! `raw_all_155k`: 26,500 short turns all sent). A client in the same
//! process (same tokio runtime, another connection) sends
//! `{"conversation": …, "budget": …}` to `cf.api.assemble.<token>`, one request at
//! a time, and times each round trip from sending until the whole reply
//! is received: request routing, the handler on a blocking thread (the
//! state lock, assembly, JSON encoding), the reply's publish and its
//! delivery. The first requests warm up and are not counted.
//!
//! A reply over the server's `max_payload` (1 MB by default) is answered
//! with a `bad_request` and not timed: so far the two raw shapes (about
//! 1.95 MB each: 26,027 `left_out` entries, or 26,500 messages) and
//! `compacted_opened`, whose handler time alone is reported.
//!
//! For comparison, in the same run: the handler alone (`api::answer_view`,
//! what the service runs per request) timed in-process over the same
//! state, and the floor: round trips to a responder that answers with a
//! ready-made reply of the same size (what NATS and this machine cost for
//! moving it, whatever the service does).
//!
//! Each shape is also asked with `since` by an agent holding all but the
//! newest message (a reply of one message and the whole context's counts),
//! handler alone and over NATS.
//!
//! Before the shapes, the floor alone at reply sizes from 16 KiB to the
//! `compacted` reply's (`floor`): where NATS itself crosses the goal here.
//!
//! ```text
//! cargo bench --bench nats_assemble [-- SHAPE... | floor]
//! CONTEXTFOLD_BENCH_REQUESTS=2000  # timed requests per shape (default 2000)
//! ```
//!
//! The `compacted` and `raw_newest_155k` shapes need the transcripts of
//! `../shared/data` (see `support/transcripts.rs`) and are skipped without
//! them. nats-server is looked up as the integration tests do; without one
//! the bench says so and exits successfully.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "support/transcripts.rs"]
mod transcripts;

#[path = "support/shapes.rs"]
mod shapes;

// The integration tests' nats-server harness; not all of it is used here.
#[allow(dead_code)]
#[path = "../tests/support/nats_server.rs"]
mod nats_server;

use bytes::Bytes;
use contextfold::api::{answer_view, assemble as assemble_api, LocalState, Op, Target};
use contextfold::core::assembly;
use contextfold::core::state::{Resident, State};
use contextfold::nats::api_role::{self, ServiceConfig};
use futures::StreamExt;
use nats_server::NatsServer;
use serde_json::json;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

const WARMUP: usize = 200;
/// The handler alone is timed this many times.
const HANDLER_RUNS: usize = 500;
const GOAL_P99: Duration = Duration::from_millis(2);

type Error = Box<dyn std::error::Error + Send + Sync>;

struct Percentiles {
    p50: Duration,
    p90: Duration,
    p99: Duration,
    p999: Duration,
    max: Duration,
    mean: Duration,
}

fn percentiles(mut v: Vec<Duration>) -> Percentiles {
    v.sort_unstable();
    let at = |q: f64| v[((v.len() as f64 * q) as usize).min(v.len() - 1)];
    Percentiles {
        p50: at(0.50),
        p90: at(0.90),
        p99: at(0.99),
        p999: at(0.999),
        max: v[v.len() - 1],
        mean: v.iter().sum::<Duration>() / v.len() as u32,
    }
}

fn us(d: Duration) -> String {
    format!("{:.0} us", d.as_secs_f64() * 1e6)
}

/// Round trips to a responder that answers every request with the same
/// `bytes` bytes, built once: what NATS alone costs for a reply this size.
async fn echo(
    server: &NatsServer,
    client: &async_nats::Client,
    bytes: usize,
    requests: usize,
) -> Result<Vec<Duration>, Error> {
    let responder = async_nats::connect(server.url()).await?;
    let mut requests_in = responder.subscribe("bench.echo").await?;
    // Until the server has the subscription (a flush only writes to the
    // socket): a message to a fresh inbox, back through the connection.
    let inbox = responder.new_inbox();
    let mut back = responder.subscribe(inbox.clone()).await?;
    responder.publish(inbox, Bytes::new()).await?;
    back.next()
        .await
        .ok_or("the responder's connection closed")?;
    drop(back);
    let reply = Bytes::from(vec![b'x'; bytes]);
    let task = tokio::spawn(async move {
        while let Some(m) = requests_in.next().await {
            if let Some(to) = m.reply {
                if responder.publish(to, reply.clone()).await.is_err() {
                    break;
                }
            }
        }
    });
    let mut rtt = Vec::with_capacity(requests);
    for i in 0..WARMUP + requests {
        let t = Instant::now();
        let got = client
            .request("bench.echo", "{}".into())
            .await
            .map_err(|e| format!("echo request {i}: {e}"))?;
        if i >= WARMUP {
            rtt.push(t.elapsed());
        }
        if got.payload.len() != bytes {
            return Err(format!("echo of {} bytes, expected {bytes}", got.payload.len()).into());
        }
    }
    task.abort();
    Ok(rtt)
}

/// The handler alone, on this thread ([`HANDLER_RUNS`] times): its
/// percentiles and the size of its reply.
fn handler_alone(name: &str, view: &LocalState, body: &str) -> Result<(Percentiles, usize), Error> {
    let mut alone = Vec::with_capacity(HANDLER_RUNS);
    let mut reply_bytes = 0;
    for _ in 0..HANDLER_RUNS {
        let t = Instant::now();
        let reply = answer_view(
            Op::Assemble,
            Target::Conversation(shapes::KEY),
            body.as_bytes(),
            view,
            0,
        )
        .map_err(|e| format!("{name}: the handler failed: {e}"))?;
        alone.push(t.elapsed());
        reply_bytes = reply.len();
    }
    Ok((percentiles(alone), reply_bytes))
}

/// `requests` timed `assemble` round trips with `body` after the warm-up;
/// every reply must be free of errors and pass `check`.
async fn round_trips(
    client: &async_nats::Client,
    name: &str,
    body: &str,
    requests: usize,
    check: impl Fn(&async_nats::Message) -> Result<(), String>,
) -> Result<Vec<Duration>, Error> {
    let mut rtt = Vec::with_capacity(requests);
    for i in 0..WARMUP + requests {
        let t = Instant::now();
        let reply = client
            .request(
                format!(
                    "cf.api.assemble.{}",
                    contextfold::nats::subjects::encode_conversation(shapes::KEY)?
                ),
                body.to_string().into(),
            )
            .await
            .map_err(|e| format!("{name}: assemble request {i}: {e}"))?;
        let took = t.elapsed();
        if let Some(error) = reply
            .headers
            .as_ref()
            .and_then(|h| h.get("Nats-Service-Error"))
        {
            return Err(format!("{name}: error reply: {error}").into());
        }
        check(&reply).map_err(|e| format!("{name}: request {i}: {e}"))?;
        if i >= WARMUP {
            rtt.push(took);
        }
    }
    Ok(rtt)
}

async fn bench_shape(name: &str, server: &NatsServer, requests: usize) -> Result<(), Error> {
    let Some(shape) = shapes::build(name) else {
        println!("{name}: skipped: the shared transcripts are absent");
        return Ok(());
    };
    let turns = shape.conv.turns.len();
    let mut body = json!({"conversation": shapes::KEY});
    if let Some(budget) = shape.request.budget {
        body["budget"] = json!(budget);
    }
    if let Some(prompt) = &shape.request.prompt {
        body["prompt"] = json!(prompt);
    }
    if shape.request.summaries_as_they_are {
        body["summaries_as_they_are"] = json!(true);
    }
    let body = body.to_string();
    let mut state = State::default();
    state
        .conversations
        .insert(shapes::KEY.to_string(), shape.conv);
    // What the reply holds, for the fingerprint of its start.
    let request: assemble_api::AssembleRequest = serde_json::from_str(&body)?;
    let shape_messages = assemble_api::assemble(&state, &Resident, &shape.policy, &request)
        .map_err(|e| format!("{name}: assembling: {e}"))?
        .assembled
        .messages;
    let view = Arc::new(LocalState::new(state, shape.policy));

    let (alone, reply_bytes) = handler_alone(name, view.as_ref(), &body)?;

    let client = async_nats::connect(server.url()).await?;
    let max_payload = client.server_info().max_payload;
    if reply_bytes >= max_payload {
        // The service answers such a request with a bad_request saying
        // so: nothing to time.
        println!(
            "{name}: {turns} turns, reply {reply_bytes} bytes: over the server's max_payload of \
             {max_payload} bytes, so over NATS the answer is a bad_request; not timed\n  \
             handler alone ({HANDLER_RUNS}): p50 {}, p99 {}, max {}",
            us(alone.p50),
            us(alone.p99),
            us(alone.max),
        );
        return Ok(());
    }
    let floor = percentiles(echo(server, &client, reply_bytes, requests).await?);
    let service = api_role::start(
        async_nats::connect(server.url()).await?,
        view.clone(),
        ServiceConfig {
            // A bare state: there is no events stream here.
            publish_compactions: false,
            ..ServiceConfig::default()
        },
    )
    .await?;
    let rtt = round_trips(&client, name, &body, requests, |reply| {
        if reply.payload.len() == reply_bytes {
            Ok(())
        } else {
            Err(format!(
                "a reply of {} bytes, the handler's was {reply_bytes}",
                reply.payload.len()
            ))
        }
    })
    .await?;
    // The same conversation asked with `since` by an agent that holds all
    // but the newest message (as after one new turn): the reply carries one
    // message and the whole context's counts.
    let held = shape_messages.len().saturating_sub(1);
    let (prefix, _) = assembly::fingerprints(&shape_messages, held);
    let mut delta_body: serde_json::Value = serde_json::from_str(&body)?;
    delta_body["since"] = json!({"messages": held, "fingerprint": prefix});
    let delta_body = delta_body.to_string();
    let (delta_alone, delta_bytes) = handler_alone(name, view.as_ref(), &delta_body)?;
    let delta_rtt = round_trips(&client, name, &delta_body, requests, |reply| {
        let parsed: serde_json::Value =
            serde_json::from_slice(&reply.payload).map_err(|e| e.to_string())?;
        if parsed["delta"]["from"] == json!(held)
            && parsed["messages"].as_array().map(Vec::len) == Some(1)
        {
            Ok(())
        } else {
            Err(format!("not the newest message alone: {}", parsed["delta"]))
        }
    })
    .await?;
    service.stop().await;
    let delta = percentiles(delta_rtt);
    let over = percentiles(rtt);
    let met = over.p99 < GOAL_P99;
    println!(
        "{name}: {turns} turns, reply {reply_bytes} bytes (max_payload {max_payload})\n  \
         handler alone ({HANDLER_RUNS}): p50 {}, p99 {}, max {}\n  \
         floor, a reply of {reply_bytes} bytes from a responder doing nothing ({requests}): \
         p50 {}, p90 {}, p99 {}, max {}\n  \
         over NATS ({requests} requests): p50 {}, p90 {}, p99 {}, p99.9 {}, max {}, mean {}; \
         p99 < {GOAL_P99:?}: {}\n  \
         with `since` (all but the newest message held; reply {delta_bytes} bytes): handler \
         alone p50 {}, p99 {}; over NATS ({requests} requests) p50 {}, p90 {}, p99 {}, \
         p99.9 {}, max {}; p99 < {GOAL_P99:?}: {}",
        us(alone.p50),
        us(alone.p99),
        us(alone.max),
        us(floor.p50),
        us(floor.p90),
        us(floor.p99),
        us(floor.max),
        us(over.p50),
        us(over.p90),
        us(over.p99),
        us(over.p999),
        us(over.max),
        us(over.mean),
        if met { "met" } else { "NOT met" },
        us(delta_alone.p50),
        us(delta_alone.p99),
        us(delta.p50),
        us(delta.p90),
        us(delta.p99),
        us(delta.p999),
        us(delta.max),
        if delta.p99 < GOAL_P99 {
            "met"
        } else {
            "NOT met"
        },
    );
    Ok(())
}

/// Reply sizes of the floor by size: from a small context to the
/// `compacted` shape's reply.
const FLOOR_SIZES: [usize; 6] = [16 << 10, 64 << 10, 128 << 10, 192 << 10, 256 << 10, 451_425];

/// The floor alone at several reply sizes: the largest reply whose round
/// trip NATS itself completes within the goal on this machine.
async fn floor_by_size(server: &NatsServer, requests: usize) -> Result<(), Error> {
    let client = async_nats::connect(server.url()).await?;
    println!("floor by reply size (a responder doing nothing, {requests} requests each):");
    for bytes in FLOOR_SIZES {
        let p = percentiles(echo(server, &client, bytes, requests).await?);
        println!(
            "  {:>7} bytes: p50 {}, p90 {}, p99 {}, max {}; p99 < {GOAL_P99:?}: {}",
            bytes,
            us(p.p50),
            us(p.p90),
            us(p.p99),
            us(p.max),
            if p.p99 < GOAL_P99 { "yes" } else { "no" },
        );
    }
    Ok(())
}

async fn run(names: Vec<&'static str>, floor: bool) -> Result<(), Error> {
    let requests = std::env::var("CONTEXTFOLD_BENCH_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000usize)
        .max(1);
    let server = NatsServer::start();
    if floor {
        if let Err(e) = floor_by_size(&server, requests).await {
            return Err(format!("{e}; nats-server log:\n{}", server.log_tail(20)).into());
        }
    }
    for name in names {
        if let Err(e) = bench_shape(name, &server, requests).await {
            return Err(format!("{e}; nats-server log:\n{}", server.log_tail(20)).into());
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    if let Err(e) = nats_server::find_binary() {
        println!("nats_assemble skipped: {e}");
        return ExitCode::SUCCESS;
    }
    // `cargo bench` passes `--bench`; other arguments pick shapes.
    let wanted: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let names: Vec<&'static str> = shapes::NAMES
        .into_iter()
        .filter(|n| wanted.is_empty() || wanted.iter().any(|w| n.contains(w.as_str())))
        .collect();
    let floor = wanted.is_empty() || wanted.iter().any(|w| w == "floor");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    match rt.block_on(run(names, floor)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nats_assemble failed: {e}");
            ExitCode::FAILURE
        }
    }
}
