//! The NATS infrastructure against real nats-server processes: setup,
//! partitioning by subject transform, dedup, the JetStream event log, KV
//! partition leases, and a 3-node cluster.
//!
//! Needs the pinned nats-server: run `scripts/install-nats.sh` first.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use async_nats::jetstream::{self, consumer::pull, stream::StorageType};
use contextfold::core::event::{Encoding, Envelope, EventBody, Origin, TurnAppended};
use contextfold::core::message::{ChatMessage, Role};
use contextfold::log::EventLog;
use contextfold::nats::event_log::{event_headers, NatsEventLog};
use contextfold::nats::leases::{LeaseEvent, LeaseRunner, LeaseSettings, PartitionLeases};
use contextfold::nats::setup::ensure;
use contextfold::nats::subjects::{encode_conversation, partition_of_token};
use contextfold::nats::version::MIN_SERVER_VERSION;
use contextfold::nats::{NatsConfig, NatsError, NatsOptions};
use futures::StreamExt;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};
use support::nats_server::{start_cluster, wait_for_jetstream, NatsServer};

fn config_for(urls: &[String]) -> NatsConfig {
    NatsConfig {
        connection: NatsOptions::with_servers(urls.iter().cloned()),
        ..NatsConfig::default()
    }
}

async fn connect(cfg: &NatsConfig) -> (async_nats::Client, jetstream::Context) {
    let (client, version) = cfg.connection.connect().await.expect("connect");
    assert!(version >= MIN_SERVER_VERSION);
    let js = jetstream::new(client.clone());
    (client, js)
}

fn turn(id: &str, conversation: &str, text: &str) -> Envelope {
    Envelope::new(
        id,
        conversation,
        1_700_000_000_000,
        EventBody::TurnAppended(TurnAppended {
            message: ChatMessage::text(Role::User, text),
            model: None,
            sender: Some("test-agent".into()),
            usage: None,
            metadata: None,
        }),
    )
}

#[tokio::test]
async fn setup_is_idempotent_and_refuses_breaking_changes() {
    let server = NatsServer::start();
    let cfg = config_for(&[server.url()]);
    let (_client, js) = connect(&cfg).await;

    let first = ensure(&js, &cfg).await.expect("first setup");
    let first_created = first.events.cached_info().created;
    let second = ensure(&js, &cfg).await.expect("second setup");
    assert_eq!(second.events.cached_info().created, first_created);
    assert_eq!(
        second.events.cached_info().config,
        first.events.cached_info().config
    );
    assert_eq!(second.leases.name, "cf_leases");
    js.get_object_store("cf_payloads")
        .await
        .expect("payload bucket");
    let summarizers = second
        .jobs
        .consumer_info("cf_summarizers")
        .await
        .expect("summarizer consumer");
    assert_eq!(summarizers.config.max_deliver, cfg.job_max_deliver);

    // A different partition count would move conversations: refused.
    let more = NatsConfig {
        partitions: 32,
        ..cfg.clone()
    };
    match ensure(&js, &more).await {
        Err(NatsError::Incompatible { resource, detail }) => {
            assert_eq!(resource, "stream CF_EVENTS");
            assert!(detail.contains("partition count"), "{detail}");
        }
        Err(e) => panic!("expected an incompatibility, got {e}"),
        Ok(_) => panic!("expected an incompatibility, setup succeeded"),
    }
    // Every lease says its own TTL, so processes may differ; but a lease
    // must not outlive its key (the bucket's max_age, 30 s): refused.
    let other_ttl = NatsConfig {
        lease_ttl_ms: 20_000,
        ..cfg.clone()
    };
    ensure(&js, &other_ttl).await.expect("a TTL within max_age");
    let too_long = NatsConfig {
        lease_ttl_ms: 40_000,
        ..cfg.clone()
    };
    match ensure(&js, &too_long).await {
        Err(NatsError::Incompatible { resource, detail }) => {
            assert_eq!(resource, "KV bucket cf_leases");
            assert!(detail.contains("max_age"), "{detail}");
        }
        Err(e) => panic!("expected an incompatibility, got {e}"),
        Ok(_) => panic!("a lease TTL beyond the bucket's max_age was accepted"),
    }
    // A wider dedup window is applied in place.
    let wider = NatsConfig {
        dedup_window_ms: 300_000,
        ..cfg.clone()
    };
    let updated = ensure(&js, &wider).await.expect("update in place");
    assert_eq!(
        updated.events.cached_info().config.duplicate_window,
        Duration::from_secs(300)
    );
    // Replicas beyond a single server: a clear configuration error.
    let replicated = NatsConfig {
        replicas: 3,
        prefix: "r3".into(),
        ..cfg.clone()
    };
    match ensure(&js, &replicated).await {
        Err(NatsError::Config { field, reason }) => {
            assert_eq!(field, "replicas", "{reason}");
        }
        Err(e) => panic!("expected a replicas error, got {e}"),
        Ok(_) => panic!("3 replicas accepted by a single server"),
    }
}

#[tokio::test]
async fn raw_publish_lands_in_the_partition_any_client_can_compute() {
    let server = NatsServer::start();
    let cfg = config_for(&[server.url()]);
    let (client, js) = connect(&cfg).await;
    let infra = ensure(&js, &cfg).await.expect("setup");

    let keys: Vec<String> = (0..40)
        .map(|i| match i % 4 {
            0 => format!("agent-{i}"),
            1 => format!("agent:{i}/main"),
            2 => format!("user {i}.session *"),
            _ => format!("会話-{i} >"),
        })
        .collect();
    // As an agent in any language would: plain core NATS publish with a
    // JSON body, no JetStream client.
    for (i, key) in keys.iter().enumerate() {
        let subject = format!("cf.in.{}", encode_conversation(key).unwrap());
        let body = turn(&format!("raw-{i}"), key, "hello").to_json();
        client
            .publish(subject, body.into())
            .await
            .expect("raw publish");
    }
    client.flush().await.expect("flush");

    let mut events = infra.events.clone();
    let deadline = Instant::now() + Duration::from_secs(10);
    while events.info().await.unwrap().state.messages < keys.len() as u64 {
        assert!(Instant::now() < deadline, "events not stored in time");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let mut used = BTreeSet::new();
    for (i, key) in keys.iter().enumerate() {
        let token = encode_conversation(key).unwrap();
        let p = partition_of_token(&token, cfg.partitions);
        used.insert(p);
        let stored = infra
            .events
            .direct_get_last_for_subject(format!("cf.ev.{p}.in.{token}"))
            .await
            .unwrap_or_else(|e| panic!("{key:?} not under partition {p}: {e}"));
        let env = Envelope::decode(&stored.payload, Encoding::Json).unwrap();
        assert_eq!(env.id, format!("raw-{i}"));
        assert_eq!(env.conversation, *key);
        let parsed = infra
            .subjects
            .parse_event_subject(stored.subject.as_str())
            .unwrap();
        assert_eq!(
            (
                parsed.partition,
                parsed.origin,
                parsed.conversation.as_str()
            ),
            (p, Origin::Agent, key.as_str())
        );
    }
    assert!(
        used.len() > 8,
        "40 keys over 16 partitions used only {used:?}"
    );

    // A folder's multi-filter consumer (server >= 2.10) sees exactly the
    // events of its partitions.
    let wanted: Vec<u32> = used.iter().copied().take(2).collect();
    let consumer = infra
        .events
        .create_consumer(pull::Config {
            filter_subjects: wanted
                .iter()
                .map(|p| infra.subjects.partition_filter(*p))
                .collect(),
            ..Default::default()
        })
        .await
        .expect("multi-filter consumer");
    let mut batch = consumer.fetch().max_messages(100).messages().await.unwrap();
    let mut seen = 0;
    while let Some(m) = batch.next().await {
        let m = m.unwrap();
        let stored = infra
            .subjects
            .parse_event_subject(m.subject.as_str())
            .unwrap();
        assert!(wanted.contains(&stored.partition));
        seen += 1;
    }
    let expected = keys
        .iter()
        .filter(|k| {
            wanted.contains(&partition_of_token(
                &encode_conversation(k).unwrap(),
                cfg.partitions,
            ))
        })
        .count();
    assert_eq!(seen, expected);
}

#[tokio::test]
async fn dedup_window_drops_a_republished_message_id() {
    let server = NatsServer::start();
    let cfg = config_for(&[server.url()]);
    let (_client, js) = connect(&cfg).await;
    let infra = ensure(&js, &cfg).await.expect("setup");

    let body = turn("evt-dup", "agent:dup", "once").to_json();
    let first = js
        .publish_with_headers(
            "cf.in.~YWdlbnQ6ZHVw",
            event_headers("evt-dup", Encoding::Json),
            body.clone().into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    let again = js
        .publish_with_headers(
            "cf.in.~YWdlbnQ6ZHVw",
            event_headers("evt-dup", Encoding::Json),
            body.into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(!first.duplicate);
    assert!(again.duplicate);
    assert_eq!(again.sequence, first.sequence);
    let mut events = infra.events.clone();
    assert_eq!(events.info().await.unwrap().state.messages, 1);
}

#[tokio::test]
async fn event_log_appends_reads_back_and_deduplicates() {
    let server = NatsServer::start();
    let cfg = config_for(&[server.url()]);
    let (_client, js) = connect(&cfg).await;
    let infra = ensure(&js, &cfg).await.expect("setup");
    let mut log = NatsEventLog::open(js.clone(), infra.subjects.clone())
        .await
        .unwrap();
    assert_eq!(log.last_position().await.unwrap(), 0);
    assert!(log.read_after(0, 10).await.unwrap().is_empty());

    let events: Vec<(Envelope, Encoding)> = (0..6)
        .map(|i| {
            let enc = if i % 2 == 0 {
                Encoding::Msgpack
            } else {
                Encoding::Json
            };
            (turn(&format!("e{i}"), &format!("conv:{}", i % 3), "x"), enc)
        })
        .collect();
    let mut positions = Vec::new();
    for (env, enc) in &events[..4] {
        let appended = log.append_event(Origin::Agent, env, *enc).await.unwrap();
        assert!(!appended.duplicate);
        positions.push(appended.position);
    }
    // Through the trait, bytes only: id and conversation come from them.
    let batch: Vec<(Origin, Encoding, Vec<u8>)> = events[4..]
        .iter()
        .map(|(e, enc)| (Origin::Agent, *enc, e.encode(*enc)))
        .collect();
    let last = log.append_batch(&batch).await.unwrap();
    assert_eq!(last, 6);
    assert_eq!(positions, vec![1, 2, 3, 4]);

    let again = log
        .append_event(Origin::Agent, &events[1].0, events[1].1)
        .await
        .unwrap();
    assert!(again.duplicate);
    assert_eq!(again.position, 2);
    assert_eq!(
        log.append(
            Origin::Agent,
            Encoding::Json,
            &events[2].0.encode(Encoding::Json)
        )
        .await
        .unwrap(),
        3
    );
    assert_eq!(log.last_position().await.unwrap(), 6);

    // Sequential reads reuse the cursor; a jump starts a new one.
    let head = log.read_after(0, 4).await.unwrap();
    let tail = log.read_after(4, 100).await.unwrap();
    let all: Vec<_> = head.into_iter().chain(tail).collect();
    assert_eq!(all.len(), 6);
    for (i, record) in all.iter().enumerate() {
        assert_eq!(record.position, i as u64 + 1);
        assert_eq!(record.encoding, events[i].1);
        let env = Envelope::decode(&record.bytes, record.encoding).unwrap();
        assert_eq!(env, events[i].0);
    }
    let middle = log.read_after(2, 1).await.unwrap();
    assert_eq!(middle.len(), 1);
    assert_eq!(middle[0].position, 3);

    // A partition's log sees only that partition, positions from the stream.
    let token = encode_conversation("conv:1").unwrap();
    let p = partition_of_token(&token, cfg.partitions);
    let mut part = NatsEventLog::open_partition(js.clone(), infra.subjects.clone(), p)
        .await
        .unwrap();
    let records = part.read_after(0, 100).await.unwrap();
    let got: BTreeSet<String> = records
        .iter()
        .map(|r| Envelope::decode(&r.bytes, r.encoding).unwrap().id)
        .collect();
    let expected: BTreeSet<String> = events
        .iter()
        .filter(|(e, _)| {
            partition_of_token(
                &encode_conversation(&e.conversation).unwrap(),
                cfg.partitions,
            ) == p
        })
        .map(|(e, _)| e.id.clone())
        .collect();
    assert_eq!(got, expected);
    assert!(got.contains("e1") && got.contains("e4"), "{got:?}");
    assert_eq!(
        part.last_position().await.unwrap(),
        records.last().unwrap().position
    );

    // Bytes without an id cannot be routed or deduplicated.
    assert!(log
        .append(Origin::Agent, Encoding::Json, b"{\"x\":1}")
        .await
        .is_err());
}

fn lease_config(url: &str) -> NatsConfig {
    NatsConfig {
        connection: NatsOptions::with_servers([url]),
        lease_ttl_ms: 2_000,
        lease_renew_ms: 250,
        lease_margin_ms: 700,
        storage: contextfold::nats::config::StorageKind::Memory,
        ..NatsConfig::default()
    }
}

async fn lease_member(cfg: &NatsConfig, id: &str) -> LeaseRunner {
    let (_client, js) = connect(cfg).await;
    let infra = ensure(&js, cfg).await.expect("setup");
    PartitionLeases::new(infra.leases, id, LeaseSettings::from_config(cfg))
        .expect("lease member")
        .spawn()
}

/// What a worker pool would do with lease events: keep the handles of
/// held partitions, drop them when released or lost.
fn absorb(runner: &mut LeaseRunner, held: &mut BTreeMap<u32, contextfold::nats::leases::Lease>) {
    while let Ok(event) = runner.events.try_recv() {
        match event {
            LeaseEvent::Acquired(lease) => {
                held.insert(lease.partition(), lease);
            }
            LeaseEvent::Released { partition } | LeaseEvent::Lost { partition, .. } => {
                held.remove(&partition);
            }
            // The handle kept says whether it is held right now.
            LeaseEvent::Lapsed { .. } | LeaseEvent::Resumed { .. } => {}
        }
    }
}

fn valid(held: &BTreeMap<u32, contextfold::nats::leases::Lease>) -> BTreeSet<u32> {
    held.values()
        .filter(|l| l.still_held())
        .map(|l| l.partition())
        .collect()
}

#[tokio::test]
async fn leases_split_evenly_never_overlap_and_move_when_a_member_dies() {
    let server = NatsServer::start();
    let cfg = lease_config(&server.url());
    let settings = LeaseSettings::from_config(&cfg);

    let mut a = lease_member(&cfg, "member-a").await;
    let mut held_a = BTreeMap::new();
    // Alone, A takes everything.
    let deadline = Instant::now() + Duration::from_secs(5);
    while valid(&held_a).len() < 16 {
        assert!(
            Instant::now() < deadline,
            "A alone holds {:?}",
            valid(&held_a)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
        absorb(&mut a, &mut held_a);
    }

    let mut b = lease_member(&cfg, "member-b").await;
    let mut held_b = BTreeMap::new();
    let deadline = Instant::now() + Duration::from_secs(8);
    let mut tokens: BTreeMap<u32, u64> = BTreeMap::new();
    loop {
        absorb(&mut a, &mut held_a);
        absorb(&mut b, &mut held_b);
        let (va, vb) = (valid(&held_a), valid(&held_b));
        assert!(va.is_disjoint(&vb), "overlap: A {va:?} B {vb:?}");
        // Fencing tokens only grow across owners of a partition.
        for lease in held_a
            .values()
            .chain(held_b.values())
            .filter(|l| l.still_held())
        {
            let prev = tokens.insert(lease.partition(), lease.fencing_token());
            if let Some(prev) = prev {
                assert!(lease.fencing_token() >= prev);
            }
        }
        if va.len() == 8 && vb.len() == 8 {
            break;
        }
        assert!(Instant::now() < deadline, "no 8/8 split: A {va:?} B {vb:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Stable: keeps splitting 8/8 over several renewal rounds.
    let until = Instant::now() + settings.renew * 6;
    while Instant::now() < until {
        absorb(&mut a, &mut held_a);
        absorb(&mut b, &mut held_b);
        let (va, vb) = (valid(&held_a), valid(&held_b));
        assert!(va.is_disjoint(&vb), "overlap: A {va:?} B {vb:?}");
        assert_eq!((va.len(), vb.len()), (8, 8));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // A dies without releasing: its leases expire, B takes all within
    // TTL + one renewal interval (plus scheduling slack).
    let a_had = valid(&held_a);
    a.abort();
    let died = Instant::now();
    let bound = settings.ttl + settings.renew + Duration::from_millis(1_500);
    loop {
        absorb(&mut b, &mut held_b);
        let (va, vb) = (valid(&held_a), valid(&held_b));
        assert!(
            va.is_disjoint(&vb),
            "overlap after crash: A {va:?} B {vb:?}"
        );
        if vb.len() == 16 {
            break;
        }
        assert!(
            died.elapsed() < bound,
            "B holds {vb:?} {:?} after A died (bound {bound:?})",
            died.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let takeover = died.elapsed();
    // A's own handles ran out before B could have acquired (fencing).
    assert!(valid(&held_a).is_empty());
    for p in &a_had {
        assert!(held_b[p].fencing_token() > tokens[p]);
    }
    eprintln!(
        "takeover after crash: {takeover:?} (ttl {:?})",
        settings.ttl
    );
    b.stop().await;
}

#[tokio::test]
async fn a_graceful_leave_hands_over_at_once() {
    let server = NatsServer::start();
    let cfg = lease_config(&server.url());
    let settings = LeaseSettings::from_config(&cfg);
    let mut a = lease_member(&cfg, "member-a").await;
    let mut b = lease_member(&cfg, "member-b").await;
    let (mut held_a, mut held_b) = (BTreeMap::new(), BTreeMap::new());
    let deadline = Instant::now() + Duration::from_secs(8);
    loop {
        absorb(&mut a, &mut held_a);
        absorb(&mut b, &mut held_b);
        if valid(&held_a).len() == 8 && valid(&held_b).len() == 8 {
            break;
        }
        assert!(Instant::now() < deadline, "no 8/8 split");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(held_a);
    let final_events = a.stop().await;
    assert!(final_events
        .iter()
        .all(|e| matches!(e, LeaseEvent::Released { .. })));
    let left = Instant::now();
    loop {
        absorb(&mut b, &mut held_b);
        if valid(&held_b).len() == 16 {
            break;
        }
        // Well before the TTL: released keys and the deleted heartbeat are
        // seen on B's next rounds.
        assert!(
            left.elapsed() < settings.renew * 4 + Duration::from_millis(500),
            "B holds {:?} after A left",
            valid(&held_b)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    b.stop().await;
}

#[tokio::test]
async fn three_node_cluster_replicates_and_survives_the_stream_leader() {
    let mut cluster = start_cluster(3);
    wait_for_jetstream(&cluster.nodes[0].url()).await;
    let cfg = NatsConfig {
        replicas: 3,
        ..config_for(&cluster.urls())
    };
    let (_client, js) = connect(&cfg).await;
    // The meta leader may still be settling: retry setup briefly.
    let mut infra = None;
    for _ in 0..50 {
        match ensure(&js, &cfg).await {
            Ok(i) => {
                infra = Some(i);
                break;
            }
            Err(e) => {
                eprintln!("setup not ready yet: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    let infra = infra.expect("setup on the cluster");
    let mut events = infra.events.clone();
    let info = events.info().await.unwrap().clone();
    assert_eq!(info.config.num_replicas, 3);
    assert_eq!(info.config.storage, StorageType::File);
    let cluster_info = info.cluster.clone().expect("cluster info");
    assert_eq!(cluster_info.replicas.len(), 2, "{cluster_info:?}");
    let mut kv_stream = infra.leases.stream.clone();
    assert_eq!(kv_stream.info().await.unwrap().config.num_replicas, 3);

    let mut log = NatsEventLog::open(js.clone(), infra.subjects.clone())
        .await
        .unwrap();
    log.append_event(
        Origin::Agent,
        &turn("c1", "conv:c", "before"),
        Encoding::Json,
    )
    .await
    .unwrap();

    // Kill the events stream's leader; the other two elect a new one and
    // the log keeps accepting and serving events.
    let leader = cluster_info.leader.expect("a stream leader");
    let index = cluster.index_of(&leader).expect("leader is one of ours");
    cluster.kill_node(index);
    let deadline = Instant::now() + Duration::from_secs(30);
    let appended = loop {
        match log
            .append_event(
                Origin::Agent,
                &turn("c2", "conv:c", "after"),
                Encoding::Json,
            )
            .await
        {
            Ok(a) => break a,
            Err(e) => {
                assert!(Instant::now() < deadline, "no new leader: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    assert_eq!(appended.position, 2);
    // Reading creates a consumer, which needs the JetStream meta leader: if
    // the killed node led that too, it may take another election.
    let records = loop {
        match log.read_after(0, 10).await {
            Ok(r) => break r,
            Err(e) => {
                assert!(
                    Instant::now() < deadline,
                    "cannot read after fail-over: {e}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    assert_eq!(records.len(), 2);
    let new_leader = events.info().await.unwrap().cluster.clone().unwrap().leader;
    assert_ne!(new_leader.as_deref(), Some(leader.as_str()));

    // The killed node comes back and catches up.
    cluster.restart_node(index);
    wait_for_jetstream(&cluster.nodes[index].url()).await;
}
