//! The built-in demo session: a long, realistic coding-agent conversation
//! (requests, tool calls with files and commands, errors, decisions,
//! identifiers), generated deterministically so the demo needs no data
//! files and gives the same result everywhere.

use crate::core::event::{Envelope, EventBody, ModelDeclared, ProviderErrorObserved, TurnAppended};
use crate::core::message::{ChatMessage, FunctionCall, Role, ToolCall};

/// A small deterministic generator (no randomness: the demo is replayable).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[(self.next() as usize) % items.len()]
    }
}

const FILES: [&str; 10] = [
    "src/billing/invoice.rs",
    "src/billing/tax.rs",
    "src/api/routes.rs",
    "src/db/migrations/0042_add_ledger.sql",
    "src/auth/session.rs",
    "tests/billing_roundtrip.rs",
    "config/staging.toml",
    "src/queue/retry.rs",
    "deploy/helm/values.yaml",
    "src/api/handlers/refund.rs",
];

const TASKS: [&str; 8] = [
    "The refund endpoint returns 500 for partial refunds on invoices with tax lines. Can you find out why and fix it?",
    "Add an idempotency key to POST /v2/refunds so retried requests from the mobile client don't double-refund.",
    "The staging deploy at https://staging.billing.internal:8443 fails its health check after the ledger migration. Investigate.",
    "Tax rounding is off by one cent for EUR invoices with more than 20 lines. Write a failing test first, then fix it.",
    "Move the retry policy for the payment queue from hard-coded values into config/staging.toml and document it.",
    "Our session tokens expire after 15 minutes even though SESSION_TTL is set to 3600. Please check src/auth/session.rs.",
    "Review the ledger migration 0042 for locking problems before we run it on the production replica at 10.20.4.17.",
    "Summarize what we changed today and what is still open so I can hand over to the on-call engineer.",
];

const DECISIONS: [&str; 6] = [
    "Decision: we will use a Decimal type with banker's rounding instead of f64 for tax amounts, because f64 accumulates error over many lines.",
    "I chose to store idempotency keys in the ledger table with a unique index rather than in Redis, so they survive a cache flush.",
    "Decision: the migration will add the column as nullable first and backfill in batches of 5000 to avoid a long table lock.",
    "We'll keep the old /v1/refunds route for one release and log a deprecation warning instead of removing it now.",
    "I decided against retrying on HTTP 409: a conflict means the refund already exists, so we return the existing one.",
    "Decision: session TTL is read once at startup from SESSION_TTL; hot reload is out of scope for this change.",
];

const ERRORS: [&str; 6] = [
    "error[E0308]: mismatched types\n  --> src/billing/tax.rs:88:24\n   |\n88 |     let total: Decimal = line.amount * rate;\n   |                ^^^^^^^ expected `Decimal`, found `f64`",
    "thread 'billing_roundtrip::eur_many_lines' panicked at tests/billing_roundtrip.rs:41:5:\nassertion `left == right` failed\n  left: 10001\n right: 10000",
    "ERROR: deadlock detected\nDETAIL: Process 31337 waits for ShareLock on transaction 948812; blocked by process 31338.\nHINT: See server log for query details.",
    "Error: connect ECONNREFUSED 127.0.0.1:5432\n    at TCPConnectWrapper.afterConnect [as oncomplete] (node:net:1555:16)",
    "health check failed: GET https://staging.billing.internal:8443/healthz -> 503 Service Unavailable (request id 7f9c2a1e-4b3d-4e8f-9a6b-2c1d0e5f8a7b)",
    "test result: FAILED. 41 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out; finished in 3.17s",
];

fn code_block(rng: &mut Lcg, file: &str, lines: usize) -> String {
    let mut out = format!("// {file}\n");
    for i in 0..lines {
        let n = rng.next() % 1000;
        let line = match i % 6 {
            0 => format!("pub fn compute_{n}(line: &InvoiceLine, rate: Decimal) -> Result<Decimal, BillingError> {{"),
            1 => format!("    let amount = line.amount.checked_mul(rate).ok_or(BillingError::Overflow({n}))?;"),
            2 => format!("    tracing::debug!(invoice = %line.invoice_id, amount = %amount, \"computed line {n}\");"),
            3 => "    if amount.is_sign_negative() { return Err(BillingError::NegativeAmount); }".to_string(),
            4 => format!("    Ok(amount.round_dp_with_strategy(2, RoundingStrategy::MidpointNearestEven)) // {n}"),
            _ => "}".to_string(),
        };
        out.push_str(&line);
        out.push('\n');
    }
    out
}

/// The demo session's events, in order.
pub fn session() -> Vec<Envelope> {
    let conv = "demo:billing-agent";
    let mut rng = Lcg(42);
    let mut events = Vec::new();
    let mut time = 1_764_000_000_000u64;
    let mut n = 0u64;
    let mut push = |events: &mut Vec<Envelope>, time: &mut u64, body: EventBody| {
        n += 1;
        *time += 4_000 + (n % 7) * 1_000;
        events.push(Envelope::new(format!("demo-{n:05}"), conv, *time, body));
    };
    let turn = |message: ChatMessage| {
        EventBody::TurnAppended(TurnAppended {
            message,
            model: Some("gpt-4o".into()),
            sender: Some("billing-agent".into()),
            usage: None,
            metadata: None,
        })
    };
    push(
        &mut events,
        &mut time,
        EventBody::ModelDeclared(ModelDeclared {
            model: "gpt-4o".into(),
            context_window: Some(128_000),
        }),
    );
    push(
        &mut events,
        &mut time,
        turn(ChatMessage::text(Role::System, "You are a careful senior engineer working in the billing service repository. Use the tools to read, edit and test code.")),
    );
    let mut call = 0u32;
    for (t, task) in TASKS.iter().cycle().take(3 * TASKS.len()).enumerate() {
        push(
            &mut events,
            &mut time,
            turn(ChatMessage::text(Role::User, *task)),
        );
        let rounds = 6 + (rng.next() % 6) as usize;
        for r in 0..rounds {
            let file = rng.pick(&FILES);
            let (name, args, result) = match r % 4 {
                0 => {
                    let lines = 60 + (rng.next() % 80) as usize;
                    ("read_file", format!("{{\"path\":\"{file}\"}}"), code_block(&mut rng, file, lines))
                }
                1 => ("run_tests", "{\"command\":\"cargo test -p billing -- --nocapture\"}".to_string(), rng.pick(&ERRORS).to_string()),
                2 => (
                    "edit_file",
                    format!("{{\"path\":\"{file}\",\"old\":\"line.amount * rate\",\"new\":\"line.amount.checked_mul(rate)?\"}}"),
                    format!("Applied 1 edit to {file} (commit {:07x}).", rng.next() % 0xfffffff),
                ),
                _ => ("bash", "{\"command\":\"git log --oneline -5\"}".to_string(), {
                    let mut s = String::new();
                    for _ in 0..5 {
                        s.push_str(&format!("{:07x} billing: {}\n", rng.next() % 0xfffffff, rng.pick(&["fix tax rounding", "add idempotency key", "ledger migration", "retry config", "session ttl"])));
                    }
                    s
                }),
            };
            call += 1;
            let id = format!("call_{t}_{r}_{call:04}");
            let mut assistant = ChatMessage::text(
                Role::Assistant,
                format!(
                    "Let me {} `{file}`.",
                    if r % 2 == 0 { "look at" } else { "check" }
                ),
            );
            assistant.tool_calls = vec![ToolCall {
                id: id.clone(),
                kind: "function".into(),
                function: FunctionCall {
                    name: name.into(),
                    arguments: args,
                },
            }];
            push(&mut events, &mut time, turn(assistant));
            let mut tool = ChatMessage::text(Role::Tool, result);
            tool.tool_call_id = Some(id);
            push(&mut events, &mut time, turn(tool));
            if r % 3 == 2 {
                push(
                    &mut events,
                    &mut time,
                    turn(ChatMessage::text(Role::Assistant, rng.pick(&DECISIONS))),
                );
            }
        }
        if t == 13 {
            push(
                &mut events,
                &mut time,
                EventBody::ProviderErrorObserved(ProviderErrorObserved {
                    error: "This model's maximum context length is 128000 tokens. However, your messages resulted in 131072 tokens. Please reduce the length of the messages.".into(),
                    model: Some("gpt-4o".into()),
                }),
            );
        }
        push(
            &mut events,
            &mut time,
            turn(ChatMessage::text(Role::Assistant, format!("Done with this step. Open item: follow up on ticket BILL-{} before the next release.", 100 + t))),
        );
    }
    events
}
