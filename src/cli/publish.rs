//! `contextfold publish`: sends inbound events to NATS as an agent would,
//! one JetStream publish per event on the conversation's inbound subject
//! with `Nats-Msg-Id` = the event's message id (`nats::msg_id`: scoped to
//! its conversation and keyed by the credentials given), so a re-run with
//! the same credentials stores nothing twice and no other agent can take
//! an event's id first.

use super::serve::{runtime, NatsArgs};
use anyhow::{bail, Context, Result};
use async_nats::jetstream::{self, context::PublishAckFuture};
use contextfold::config::Config;
use contextfold::core::event::Envelope;
use contextfold::core::event::Origin;
use contextfold::nats::event_log::event_headers;
use contextfold::nats::msg_id::{self, AgentKey};
use std::collections::{BTreeSet, VecDeque};
use std::io::Write;
use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// Publishes awaiting the stream's acknowledgement at once.
const IN_FLIGHT: usize = 512;

#[derive(Debug, Default)]
struct Tally {
    published: u64,
    duplicates: u64,
    invalid: u64,
}

pub fn publish(
    config: &Config,
    nats: &NatsArgs,
    file: Option<&Path>,
    format: &str,
) -> Result<ExitCode> {
    let cfg = nats.apply(&config.nats);
    let subjects = cfg.subjects()?;
    let input = super::local::read_input(file, format)?;
    let servers = cfg.connection.display_servers();
    runtime()?.block_on(async {
        let (client, _version) = cfg
            .connection
            .connect()
            .await
            .with_context(|| format!("connecting to {servers}"))?;
        let js = jetstream::new(client.clone());
        let (_, auth) = cfg.connection.resolve()?;
        let key = AgentKey::from_secret(&auth.identity_secret()?);
        if key.is_none() {
            eprintln!(
                "note: no credentials: message ids are scoped to each conversation but not keyed, \
                 so anyone who may publish on this server could take them first (docs/subjects.md)"
            );
        }
        let started = Instant::now();
        let total = input.len();
        let mut tally = Tally::default();
        let mut conversations = BTreeSet::new();
        let mut pending: VecDeque<PublishAckFuture> = VecDeque::with_capacity(IN_FLIGHT);
        let mut last_progress = Instant::now();
        for super::local::Input {
            at,
            encoding,
            bytes,
        } in input
        {
            let event = match Envelope::decode(&bytes, encoding) {
                Ok(e) => e,
                Err(e) => {
                    tally.invalid += 1;
                    eprintln!("\n{at} skipped: {e}");
                    continue;
                }
            };
            let subject = subjects
                .inbound(&event.conversation)
                .with_context(|| format!("{at} ({})", event.id))?;
            conversations.insert(event.conversation.clone());
            if pending.len() >= IN_FLIGHT {
                if let Some(ack) = pending.pop_front() {
                    settle(ack, &mut tally).await?;
                }
            }
            // JSONL lines go out as the bytes given (as an agent would send
            // them); imported transcripts as MessagePack.
            let ack = js
                .publish_with_headers(
                    subject,
                    event_headers(
                        &msg_id::of(Origin::Agent, key.as_ref(), &event.conversation, &event.id),
                        encoding,
                    ),
                    bytes.into(),
                )
                .await
                .with_context(|| format!("publishing event {}", event.id))?;
            pending.push_back(ack);
            if last_progress.elapsed() >= Duration::from_millis(500) {
                last_progress = Instant::now();
                eprint!(
                    "\rpublished {}/{total} ({} duplicates)",
                    tally.published + tally.duplicates,
                    tally.duplicates
                );
                let _ = std::io::stderr().flush();
            }
        }
        while let Some(ack) = pending.pop_front() {
            settle(ack, &mut tally).await?;
        }
        let secs = started.elapsed().as_secs_f64();
        eprintln!(
            "\rpublished {} events in {} conversation(s) to {servers} ({} new, {} duplicates, {} \
             invalid) in {secs:.2} s ({:.0}/s)",
            tally.published + tally.duplicates,
            conversations.len(),
            tally.published,
            tally.duplicates,
            tally.invalid,
            (tally.published + tally.duplicates) as f64 / secs.max(1e-9),
        );
        if tally.invalid > 0 && tally.published + tally.duplicates == 0 {
            bail!("no valid event in the input");
        }
        Ok(if tally.invalid > 0 {
            ExitCode::FAILURE
        } else {
            ExitCode::SUCCESS
        })
    })
}

async fn settle(ack: PublishAckFuture, tally: &mut Tally) -> Result<()> {
    let ack = ack
        .await
        .context("the events stream did not store an event (is `contextfold serve` set up?)")?;
    if ack.duplicate {
        tally.duplicates += 1;
    } else {
        tally.published += 1;
    }
    Ok(())
}
