//! Partition ownership through JetStream KV leases.
//!
//! Each process is a *member*: it keeps a heartbeat key `members.<id>` and
//! owns partitions through keys `partitions.<p>` in the lease bucket, whose
//! `max_age` is the lease TTL (a key not rewritten within the TTL vanishes).
//!
//! - **Acquire**: KV `create` (succeeds only if the key is absent, deleted or
//!   expired). The revision it returns is the lease's *fencing token*: KV
//!   revisions only grow, so a later owner always has a larger token.
//! - **Renew**: KV `update` expecting the last revision we wrote; if anyone
//!   else wrote the key in between, the update fails and the lease is lost.
//! - **Expiry**: a process that dies stops renewing; its keys expire after
//!   the TTL and others create them.
//! - **Fencing in time**: a holder considers a lease valid only until
//!   `sent + ttl - margin`, where `sent` is when its last successful renewal
//!   was *sent*; the server cannot expire the key before `sent + ttl`. So a
//!   holder that cannot renew (partitioned, paused, slow) stops using the
//!   partition at least `margin` before anyone else can acquire it. Once a
//!   [`Lease`] stops being held it never becomes held again; a re-acquired
//!   partition gets a new `Lease` with a new token.
//! - **Balance**: every renewal round a member counts live members `M` and
//!   aims for `ceil(N / M)` partitions: it releases its excess (the ones it
//!   ranks lowest by rendezvous hashing) and claims free ones (those it
//!   ranks highest), so partitions spread over live members and move when
//!   one joins, leaves or dies.
//! - **Release** (rebalancing or shutdown): the lease is revoked first, then
//!   the key is deleted once the partition's worker has dropped its handle
//!   (or after a short wait), so the next owner starts after this one stops.

use crate::nats::config::NatsConfig;
use crate::nats::NatsError;
use crate::telemetry::{LeaseChange, LeaseChanged, PartitionsHeld};
use async_nats::jetstream::kv::{self, Operation, UpdateErrorKind};
use bytes::Bytes;
use futures::TryStreamExt;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// Timing and size of the lease scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseSettings {
    pub partitions: u32,
    /// The bucket's `max_age`.
    pub ttl: Duration,
    /// Interval between renewal rounds.
    pub renew: Duration,
    /// Safety margin before the earliest possible server-side expiry.
    pub margin: Duration,
}

impl LeaseSettings {
    pub fn from_config(cfg: &NatsConfig) -> Self {
        LeaseSettings {
            partitions: cfg.partitions,
            ttl: cfg.lease_ttl(),
            renew: cfg.lease_renew(),
            margin: cfg.lease_margin(),
        }
    }

    /// How long a lease stays usable after its renewal was sent.
    fn usable_for(&self) -> Duration {
        self.ttl.saturating_sub(self.margin)
    }

    /// How long a release waits for the partition's worker to let go.
    fn release_wait(&self) -> Duration {
        (self.margin / 2).min(self.renew)
    }
}

/// The value of a `partitions.<p>` key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRecord {
    /// Member id of the holder.
    pub owner: String,
}

/// The value of a `members.<id>` key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberRecord {
    pub member: String,
    /// Partitions held when the heartbeat was written.
    pub held: usize,
    /// The fingerprint of the policy this member folds under
    /// (`runtime::engine::policy_fingerprint`), so that `doctor` can tell
    /// members that fold under different `[policy]` apart. Absent in the
    /// records of older versions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_fingerprint: Option<String>,
}

#[derive(Debug, Clone, Copy)]
struct LeaseState {
    revision: u64,
    valid_until: Instant,
    revoked: bool,
}

#[derive(Debug)]
struct LeaseInner {
    partition: u32,
    fencing_token: u64,
    state: watch::Sender<LeaseState>,
}

/// A held partition. Clone it into the partition's worker; the worker
/// checks [`Lease::still_held`] before every commit and publish, and drops
/// its clone when it stops.
#[derive(Debug, Clone)]
pub struct Lease {
    inner: Arc<LeaseInner>,
}

impl Lease {
    fn new(partition: u32, revision: u64, valid_until: Instant) -> Lease {
        let (state, _) = watch::channel(LeaseState {
            revision,
            valid_until,
            revoked: false,
        });
        Lease {
            inner: Arc::new(LeaseInner {
                partition,
                fencing_token: revision,
                state,
            }),
        }
    }

    pub fn partition(&self) -> u32 {
        self.inner.partition
    }

    /// KV revision at acquisition; larger for every later owner.
    pub fn fencing_token(&self) -> u64 {
        self.inner.fencing_token
    }

    /// KV revision of the latest renewal (what the next renewal expects).
    pub fn revision(&self) -> u64 {
        self.inner.state.borrow().revision
    }

    /// Until when the holder may act on this lease, unless renewed.
    pub fn valid_until(&self) -> Instant {
        self.inner.state.borrow().valid_until
    }

    /// True while this process may fold the partition. Once false, stays
    /// false.
    pub fn still_held(&self) -> bool {
        let s = *self.inner.state.borrow();
        !s.revoked && Instant::now() < s.valid_until
    }

    /// Resolves when the lease stops being held (revoked or run out).
    pub async fn lost(&self) {
        let mut rx = self.inner.state.subscribe();
        loop {
            let s = *rx.borrow_and_update();
            if s.revoked || Instant::now() >= s.valid_until {
                return;
            }
            tokio::select! {
                changed = rx.changed() => {
                    if changed.is_err() {
                        return;
                    }
                }
                _ = tokio::time::sleep_until(s.valid_until) => {}
            }
        }
    }

    fn revoke(&self) {
        self.inner.state.send_modify(|s| s.revoked = true);
    }

    /// Records a successful renewal; refuses (and revokes) a lease that had
    /// already stopped being held, so "held" never comes back.
    fn renewed(&self, revision: u64, valid_until: Instant) -> bool {
        let mut kept = false;
        self.inner.state.send_modify(|s| {
            if !s.revoked && Instant::now() < s.valid_until {
                s.revision = revision;
                s.valid_until = valid_until;
                kept = true;
            } else {
                s.revoked = true;
            }
        });
        kept
    }

    /// Clones alive outside the lease table (workers still using it).
    fn users(&self) -> usize {
        Arc::strong_count(&self.inner) - 1
    }
}

/// A change of ownership, for whoever runs the partitions' workers.
#[derive(Debug, Clone)]
pub enum LeaseEvent {
    /// Start working on this partition.
    Acquired(Lease),
    /// Given up on purpose (rebalancing or shutdown).
    Released { partition: u32 },
    /// Taken away: renewal failed or came too late.
    Lost { partition: u32, reason: String },
}

fn partition_key(p: u32) -> String {
    format!("partitions.{p}")
}

fn member_key(id: &str) -> String {
    format!("members.{id}")
}

/// Checks a member id: 1 to 128 of `A-Z a-z 0-9 _ - =` (one KV key token).
pub fn validate_member_id(id: &str) -> Result<(), NatsError> {
    let ok = !id.is_empty()
        && id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'='));
    if ok {
        Ok(())
    } else {
        Err(NatsError::Config {
            field: "member_id",
            reason: format!("{id:?}: use 1 to 128 of A-Z a-z 0-9 _ - ="),
        })
    }
}

/// A member id unique to this process start: `<name>-<pid>-<random>`.
pub fn generate_member_id(name: &str) -> String {
    let clean: String = name
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
        .take(64)
        .collect();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let mut hasher = blake3::Hasher::new();
    hasher.update(&nanos.to_le_bytes());
    hasher.update(&std::process::id().to_le_bytes());
    hasher.update(clean.as_bytes());
    let random = &hasher.finalize().to_hex()[..8];
    let stem = if clean.is_empty() { "cf" } else { &clean };
    format!("{stem}-{}-{random}", std::process::id())
}

/// Rendezvous score: every member ranks every partition the same way, so
/// preferences are stable as members come and go.
fn rank(member: &str, partition: u32) -> u64 {
    let mut h = blake3::Hasher::new();
    h.update(member.as_bytes());
    h.update(&partition.to_le_bytes());
    let bytes = h.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&bytes.as_bytes()[..8]);
    u64::from_le_bytes(first)
}

/// `ceil(partitions / members)`, the most any member aims to hold.
pub fn fair_share(partitions: u32, members: usize) -> usize {
    (partitions as usize).div_ceil(members.max(1))
}

/// One process's membership and leases.
pub struct PartitionLeases {
    kv: kv::Store,
    member: String,
    settings: LeaseSettings,
    held: Arc<Mutex<BTreeMap<u32, Lease>>>,
    /// Set after the first round that listed the members and claimed this
    /// member's share: the process has joined (for `/readyz`).
    joined: Arc<AtomicBool>,
    failures: u64,
    /// Published in the heartbeat (see [`MemberRecord::policy_fingerprint`]).
    policy_fingerprint: Option<String>,
    /// Where events go the moment they happen when running as a task (a
    /// release waits for the worker, which must hear of it first).
    sink: Option<mpsc::UnboundedSender<LeaseEvent>>,
}

fn lock(map: &Mutex<BTreeMap<u32, Lease>>) -> MutexGuard<'_, BTreeMap<u32, Lease>> {
    // The map holds plain data; a panic elsewhere cannot leave it torn.
    map.lock().unwrap_or_else(|p| p.into_inner())
}

impl PartitionLeases {
    pub fn new(
        kv: kv::Store,
        member: impl Into<String>,
        settings: LeaseSettings,
    ) -> Result<Self, NatsError> {
        let member = member.into();
        validate_member_id(&member)?;
        let bucket_ttl = kv.stream.cached_info().config.max_age;
        if bucket_ttl != settings.ttl {
            return Err(NatsError::Incompatible {
                resource: format!("KV bucket {}", kv.name),
                detail: format!(
                    "its max_age is {bucket_ttl:?} but the lease TTL is {:?}",
                    settings.ttl
                ),
            });
        }
        if settings.margin >= settings.ttl || settings.renew >= settings.usable_for() {
            return Err(NatsError::Config {
                field: "lease_renew_ms",
                reason: "need renew < ttl - margin and margin < ttl".to_string(),
            });
        }
        Ok(PartitionLeases {
            kv,
            member,
            settings,
            held: Arc::new(Mutex::new(BTreeMap::new())),
            joined: Arc::new(AtomicBool::new(false)),
            failures: 0,
            policy_fingerprint: None,
            sink: None,
        })
    }

    /// Publishes `fingerprint` (the policy this member folds under) in
    /// every heartbeat.
    pub fn with_policy_fingerprint(mut self, fingerprint: impl Into<String>) -> Self {
        self.policy_fingerprint = Some(fingerprint.into());
        self
    }

    pub fn member_id(&self) -> &str {
        &self.member
    }

    pub fn settings(&self) -> LeaseSettings {
        self.settings
    }

    /// Renewal rounds that hit a NATS error so far.
    pub fn failures(&self) -> u64 {
        self.failures
    }

    /// A shared view of the held leases (for routing API requests).
    pub fn table(&self) -> LeaseTable {
        LeaseTable {
            held: self.held.clone(),
            joined: self.joined.clone(),
        }
    }

    fn note_failure(&mut self, what: &str, err: impl std::fmt::Display) {
        self.failures += 1;
        tracing::warn!(member = %self.member, "lease {what} failed: {err}");
    }

    /// Stops holding `lease` (its holder sees it revoked) and says why.
    fn lose(&self, events: &mut Vec<LeaseEvent>, lease: &Lease, reason: &str) {
        let partition = lease.partition();
        lock(&self.held).remove(&partition);
        lease.revoke();
        self.emit(
            events,
            LeaseEvent::Lost {
                partition,
                reason: reason.to_string(),
            },
        );
    }

    fn emit(&self, events: &mut Vec<LeaseEvent>, event: LeaseEvent) {
        let (partition, change, reason) = match &event {
            LeaseEvent::Acquired(lease) => (lease.partition(), LeaseChange::Acquired, ""),
            LeaseEvent::Released { partition } => {
                (*partition, LeaseChange::HandedOver, "rebalance or leave")
            }
            LeaseEvent::Lost { partition, reason } => {
                (*partition, LeaseChange::Lost, reason.as_str())
            }
        };
        LeaseChanged {
            partition,
            change,
            reason,
        }
        .emit();
        PartitionsHeld {
            count: lock(&self.held).len(),
        }
        .emit();
        match &self.sink {
            Some(sink) => {
                let _ = sink.send(event);
            }
            None => events.push(event),
        }
    }

    fn record(&self) -> Bytes {
        let record = LeaseRecord {
            owner: self.member.clone(),
        };
        Bytes::from(serde_json::to_vec(&record).unwrap_or_default())
    }

    /// One renewal round: heartbeat, renew, rebalance; returns the
    /// ownership changes. NATS errors are logged and counted; leases then
    /// run out by time, never silently.
    pub async fn tick(&mut self) -> Vec<LeaseEvent> {
        let mut events = Vec::new();
        self.drop_overdue(&mut events).await;

        let held_count = lock(&self.held).len();
        let heartbeat = MemberRecord {
            member: self.member.clone(),
            held: held_count,
            policy_fingerprint: self.policy_fingerprint.clone(),
        };
        let body = Bytes::from(serde_json::to_vec(&heartbeat).unwrap_or_default());
        if let Err(e) = self.kv.put(member_key(&self.member), body).await {
            self.note_failure("heartbeat", e);
        }

        self.renew_all(&mut events).await;

        let members = match self.live_members().await {
            Ok(m) => m,
            Err(e) => {
                // Without a member count, do not rebalance this round.
                self.note_failure("member listing", e);
                return events;
            }
        };
        let share = fair_share(self.settings.partitions, members.len().max(1));
        let held_now = lock(&self.held).len();
        if held_now > share {
            self.release_excess(held_now - share, &mut events).await;
        } else if held_now < share {
            self.claim(share - held_now, &mut events).await;
        }
        self.joined.store(true, Ordering::Release);
        events
    }

    /// Leases whose time ran out are revoked and their keys deleted (when
    /// still ours) so the partition is free at once.
    async fn drop_overdue(&mut self, events: &mut Vec<LeaseEvent>) {
        let overdue: Vec<Lease> = lock(&self.held)
            .values()
            .filter(|l| !l.still_held())
            .cloned()
            .collect();
        for lease in overdue {
            let p = lease.partition();
            self.lose(events, &lease, "not renewed in time");
            // Only removes our own value: the revision check fails if
            // anyone else has written the key since.
            let _ = self
                .kv
                .delete_expect_revision(partition_key(p), Some(lease.revision()))
                .await;
        }
    }

    /// Renews every held lease at once: one round takes one round trip
    /// whatever the number of partitions held. Renewed one after another,
    /// sixteen renewals on a loaded machine took longer than a lease's
    /// usable time, and the last ones in the queue were lost.
    async fn renew_all(&mut self, events: &mut Vec<LeaseEvent>) {
        // Collected so that the lock is released before the renewals wait.
        #[allow(clippy::needless_collect)]
        let leases: Vec<Lease> = lock(&self.held).values().cloned().collect();
        let record = self.record();
        let kv = &self.kv;
        let renewals = leases.into_iter().map(|lease| {
            let record = record.clone();
            async move {
                let sent = Instant::now();
                let result = kv
                    .update(partition_key(lease.partition()), record, lease.revision())
                    .await;
                (lease, sent, result)
            }
        });
        for (lease, sent, result) in futures::future::join_all(renewals).await {
            let p = lease.partition();
            match result {
                Ok(revision) => {
                    if !lease.renewed(revision, sent + self.settings.usable_for()) {
                        self.lose(events, &lease, "renewal came after the lease ran out");
                        let _ = self
                            .kv
                            .delete_expect_revision(partition_key(p), Some(revision))
                            .await;
                    }
                }
                Err(e) if e.kind() == UpdateErrorKind::WrongLastRevision => {
                    self.lose(events, &lease, "the lease key expired or changed hands");
                }
                // Timeouts and disconnects: try again next round; the lease
                // runs out by time if they persist.
                Err(e) => self.note_failure("renewal", e),
            }
        }
    }

    /// Ids of members whose heartbeat key is alive (this one included).
    pub async fn live_members(&self) -> Result<Vec<String>, NatsError> {
        let mut members: Vec<String> = member_entries(&self.kv)
            .await?
            .into_iter()
            .map(|(id, _)| id)
            .collect();
        if !members.iter().any(|m| m == &self.member) {
            members.push(self.member.clone());
        }
        members.sort();
        Ok(members)
    }

    async fn release_excess(&mut self, count: usize, events: &mut Vec<LeaseEvent>) {
        let mut ranked: Vec<u32> = lock(&self.held).keys().copied().collect();
        ranked.sort_by_key(|p| rank(&self.member, *p));
        for p in ranked.into_iter().take(count) {
            self.release(p, events).await;
        }
    }

    async fn release(&mut self, partition: u32, events: &mut Vec<LeaseEvent>) {
        let Some(lease) = lock(&self.held).remove(&partition) else {
            return;
        };
        lease.revoke();
        self.emit(events, LeaseEvent::Released { partition });
        let deadline = Instant::now() + self.settings.release_wait();
        while lease.users() > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if let Err(e) = self
            .kv
            .delete_expect_revision(partition_key(partition), Some(lease.revision()))
            .await
        {
            // The key then expires by TTL: slower hand-over, same safety.
            self.note_failure("release", e);
        }
    }

    async fn claim(&mut self, wanted: usize, events: &mut Vec<LeaseEvent>) {
        let held: Vec<u32> = lock(&self.held).keys().copied().collect();
        let mut candidates: Vec<u32> = (0..self.settings.partitions)
            .filter(|p| !held.contains(p))
            .collect();
        candidates.sort_by_key(|p| std::cmp::Reverse(rank(&self.member, *p)));
        let record = self.record();
        let mut got = 0;
        for p in candidates {
            if got == wanted {
                break;
            }
            let key = partition_key(p);
            match self.kv.entry(key.clone()).await {
                Ok(Some(entry)) if entry.operation == Operation::Put => continue,
                Ok(_) => {}
                Err(e) => {
                    self.note_failure("lookup", e);
                    continue;
                }
            }
            let sent = Instant::now();
            match self.kv.create(key, record.clone()).await {
                Ok(revision) => {
                    let lease = Lease::new(p, revision, sent + self.settings.usable_for());
                    lock(&self.held).insert(p, lease.clone());
                    self.emit(events, LeaseEvent::Acquired(lease));
                    got += 1;
                }
                // Someone else was quicker: fine.
                Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {}
                Err(e) => self.note_failure("acquire", e),
            }
        }
    }

    /// Graceful leave: releases every lease (after its worker lets go) and
    /// deletes the heartbeat so others rebalance at once.
    pub async fn release_all(&mut self) -> Vec<LeaseEvent> {
        let mut events = Vec::new();
        let partitions: Vec<u32> = lock(&self.held).keys().copied().collect();
        for p in partitions {
            self.release(p, &mut events).await;
        }
        if let Err(e) = self.kv.delete(member_key(&self.member)).await {
            self.note_failure("leave", e);
        }
        events
    }

    /// Runs renewal rounds every `renew` until `stop()`; ownership changes
    /// arrive on the returned handle's `events`.
    pub fn spawn(mut self) -> LeaseRunner {
        let (events_tx, events) = mpsc::unbounded_channel();
        self.sink = Some(events_tx);
        let (stop_tx, mut stop_rx) = watch::channel(false);
        let table = self.table();
        let member = self.member.clone();
        let task = tokio::spawn(async move {
            let mut interval = tokio::time::interval(self.settings.renew);
            interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = stop_rx.changed() => break,
                    _ = interval.tick() => {}
                }
                // Events went out through the sink as they happened.
                self.tick().await;
            }
            self.release_all().await;
        });
        LeaseRunner {
            member,
            table,
            events,
            stop: stop_tx,
            task,
        }
    }
}

/// Which partitions this process holds right now.
#[derive(Clone)]
pub struct LeaseTable {
    held: Arc<Mutex<BTreeMap<u32, Lease>>>,
    joined: Arc<AtomicBool>,
}

impl LeaseTable {
    /// The lease on `partition`, if held and still valid.
    pub fn lease(&self, partition: u32) -> Option<Lease> {
        lock(&self.held)
            .get(&partition)
            .filter(|l| l.still_held())
            .cloned()
    }

    /// Whether a renewal round has completed: the member is listed and has
    /// claimed what it could of its share.
    pub fn joined(&self) -> bool {
        self.joined.load(Ordering::Acquire)
    }

    /// Partitions held and still valid, ascending.
    pub fn partitions(&self) -> Vec<u32> {
        lock(&self.held)
            .values()
            .filter(|l| l.still_held())
            .map(Lease::partition)
            .collect()
    }
}

/// A running [`PartitionLeases`] loop.
pub struct LeaseRunner {
    member: String,
    table: LeaseTable,
    /// Ownership changes, in order.
    pub events: mpsc::UnboundedReceiver<LeaseEvent>,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl LeaseRunner {
    pub fn member_id(&self) -> &str {
        &self.member
    }

    pub fn table(&self) -> LeaseTable {
        self.table.clone()
    }

    /// Takes the event receiver (to hand to the folder role); `events` is
    /// then an empty, closed channel.
    pub fn take_events(&mut self) -> mpsc::UnboundedReceiver<LeaseEvent> {
        let (_, closed) = mpsc::unbounded_channel();
        std::mem::replace(&mut self.events, closed)
    }

    /// Graceful stop: releases all leases and leaves; returns the final
    /// events not yet received.
    pub async fn stop(mut self) -> Vec<LeaseEvent> {
        let _ = self.stop.send(true);
        let _ = (&mut self.task).await;
        let mut rest = Vec::new();
        while let Ok(e) = self.events.try_recv() {
            rest.push(e);
        }
        rest
    }

    /// Stops renewing at once without releasing, as a crash would: the
    /// keys expire after the TTL.
    pub fn abort(self) {
        self.task.abort();
    }
}

/// The live member keys of the lease bucket and their values, by member id
/// (a member that left leaves a delete marker, which is skipped).
async fn member_entries(kv: &kv::Store) -> Result<Vec<(String, Bytes)>, NatsError> {
    let filter = format!("{}members.>", kv.prefix);
    let mut info = kv
        .stream
        .info_with_subjects(&filter)
        .await
        .map_err(|e| NatsError::js("listing lease members", e))?;
    let mut keys = Vec::new();
    while let Some((subject, _count)) = info
        .try_next()
        .await
        .map_err(|e| NatsError::js("listing lease members", e))?
    {
        if let Some(key) = subject.strip_prefix(kv.prefix.as_str()) {
            keys.push(key.to_string());
        }
    }
    let mut members = Vec::new();
    for key in keys {
        let entry = kv
            .entry(key.clone())
            .await
            .map_err(|e| NatsError::js("reading a lease member", e))?;
        if let Some(entry) = entry {
            if entry.operation == Operation::Put {
                if let Some(id) = key.strip_prefix("members.") {
                    members.push((id.to_string(), entry.value));
                }
            }
        }
    }
    members.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(members)
}

/// A live member as its last heartbeat describes it; `record` is `None`
/// when the value does not decode (written by another version).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveMember {
    pub member: String,
    pub record: Option<MemberRecord>,
}

/// Every live member of the lease bucket with its heartbeat record, by id
/// (for `doctor`: who folds, and under which policy).
pub async fn live_member_records(kv: &kv::Store) -> Result<Vec<LiveMember>, NatsError> {
    Ok(member_entries(kv)
        .await?
        .into_iter()
        .map(|(member, value)| LiveMember {
            record: serde_json::from_slice::<MemberRecord>(&value).ok(),
            member,
        })
        .collect())
}

/// Who holds `partition`, if anyone (for routing a request to the owner).
pub async fn owner_of(kv: &kv::Store, partition: u32) -> Result<Option<String>, NatsError> {
    let entry = kv
        .entry(partition_key(partition))
        .await
        .map_err(|e| NatsError::js("reading a partition lease", e))?;
    Ok(match entry {
        Some(e) if e.operation == Operation::Put => serde_json::from_slice::<LeaseRecord>(&e.value)
            .ok()
            .map(|r| r.owner),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fair_share_rounds_up() {
        assert_eq!(fair_share(16, 1), 16);
        assert_eq!(fair_share(16, 2), 8);
        assert_eq!(fair_share(16, 3), 6);
        assert_eq!(fair_share(16, 17), 1);
        assert_eq!(fair_share(16, 0), 16);
    }

    #[test]
    fn member_records_of_older_versions_still_decode() {
        let old: MemberRecord = serde_json::from_str(r#"{"member":"a-1","held":3}"#).unwrap();
        assert_eq!(old.policy_fingerprint, None);
        assert_eq!(old.held, 3);
        let new = MemberRecord {
            member: "b-2".into(),
            held: 1,
            policy_fingerprint: Some("0123abcd".into()),
        };
        let json = serde_json::to_string(&new).unwrap();
        assert!(
            json.contains(r#""policy_fingerprint":"0123abcd""#),
            "{json}"
        );
        assert_eq!(serde_json::from_str::<MemberRecord>(&json).unwrap(), new);
    }

    #[test]
    fn member_ids_are_single_key_tokens() {
        assert!(validate_member_id("host-1_a=").is_ok());
        for bad in ["", "a.b", "a b", "a/b", &"x".repeat(129)] {
            assert!(validate_member_id(bad).is_err(), "{bad:?}");
        }
        let id = generate_member_id("my host.example");
        assert!(validate_member_id(&id).is_ok(), "{id}");
        assert_ne!(generate_member_id("a"), generate_member_id("a"));
    }

    #[test]
    fn ranking_spreads_preferences_across_members() {
        // Each of two members ranks a different half of the partitions
        // highest often enough that claims do not all collide.
        let top = |m: &str| {
            let mut ps: Vec<u32> = (0..16).collect();
            ps.sort_by_key(|p| std::cmp::Reverse(rank(m, *p)));
            ps[..8].to_vec()
        };
        let a = top("a");
        let b = top("b");
        assert_ne!(a, b);
    }

    #[tokio::test(start_paused = true)]
    async fn a_lease_runs_out_by_time_and_never_comes_back() {
        let settings = LeaseSettings {
            partitions: 1,
            ttl: Duration::from_secs(10),
            renew: Duration::from_secs(2),
            margin: Duration::from_secs(3),
        };
        let lease = Lease::new(0, 5, Instant::now() + settings.usable_for());
        assert!(lease.still_held());
        assert_eq!(lease.fencing_token(), 5);
        assert!(lease.renewed(9, Instant::now() + settings.usable_for()));
        assert_eq!(lease.revision(), 9);
        assert_eq!(lease.fencing_token(), 5);
        tokio::time::advance(Duration::from_secs(7)).await;
        assert!(!lease.still_held());
        // lost() resolves once the time is up.
        tokio::time::timeout(Duration::from_millis(1), lease.lost())
            .await
            .unwrap();
        // A late renewal does not resurrect it.
        assert!(!lease.renewed(10, Instant::now() + settings.usable_for()));
        assert!(!lease.still_held());
    }

    #[tokio::test]
    async fn revoking_wakes_lost() {
        let lease = Lease::new(3, 1, Instant::now() + Duration::from_secs(60));
        let waiter = {
            let l = lease.clone();
            tokio::spawn(async move { l.lost().await })
        };
        tokio::task::yield_now().await;
        assert!(lease.still_held());
        lease.revoke();
        tokio::time::timeout(Duration::from_secs(1), waiter)
            .await
            .unwrap()
            .unwrap();
        assert!(!lease.still_held());
    }
}
