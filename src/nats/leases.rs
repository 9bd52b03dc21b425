//! Partition ownership through JetStream KV leases.
//!
//! Each process is a *member*: it keeps a heartbeat key `members.<id>` and
//! owns partitions through keys `partitions.<p>` in the lease bucket. Every
//! value names its writer and says how long the writer's claim lasts
//! without renewal (`ttl_ms`: the writer's `lease_ttl_ms`).
//!
//! # Protocol
//!
//! - **Watch**: each member watches the whole bucket (a KV watch: an
//!   ordered consumer delivering the last value of every key, then every
//!   change in stream order) and notes, per key, the revision it sees and
//!   *when it first saw it*, on its own monotonic clock.
//! - **Acquire**: a free key (absent, deleted, or removed by the bucket's
//!   `max_age`) with KV `create`; a *stale* key, one whose revision this
//!   member has seen unchanged for the writer's `ttl_ms`, with a KV
//!   `update` expecting that revision (a compare-and-set: it fails if
//!   anyone wrote the key since). The revision written is the lease's
//!   *fencing token*: revisions only grow, so a later owner always has a
//!   larger one. A key that disappears (a graceful release deletes it) is
//!   claimed the moment the watch shows it, not at the next round.
//! - **Renew**: every `lease_renew_ms`, a KV `update` per held key
//!   expecting the revision this member last wrote, and a heartbeat put.
//!   All of them are in flight at once, each bounded by a short timeout
//!   ([`LeaseSettings::request_timeout`]); none waits on another, on a
//!   claim, or on the watch.
//! - **Validity**: a holder acts on a lease only until
//!   `sent + ttl - margin`, where `sent` is when the request that wrote its
//!   latest revision (acquisition or renewal) was sent. [`Lease::still_held`]
//!   says so; the folder checks it before every publish and commit.
//! - **Lapse and resume**: a lease not renewed in time *lapses*: it stops
//!   being held and its worker pauses (it neither publishes nor commits).
//!   The member keeps the key and keeps renewing it. If an update
//!   expecting its revision then succeeds, nobody wrote the key in between,
//!   so nobody else acquired it (every acquisition is a write): the same
//!   [`Lease`] is held again and the worker goes on where it paused, its
//!   state still the partition's latest. If the update fails because the
//!   key changed, the member reads it: its own value (a renewal the stream
//!   applied but whose answer was lost) is adopted; anyone else's, or
//!   none, means the lease is lost for good (revoked: never held again).
//! - **Expiry**: the bucket's `max_age` (at least every member's TTL; 30 s
//!   when created, or `lease_ttl_ms` if longer; buckets of older versions
//!   keep theirs) removes what dead members leave; takeover does not wait
//!   for it.
//! - **Balance**: a member counts the live members `M` (heartbeats not
//!   stale, itself included) and aims for `ceil(N / M)` partitions: it
//!   releases its excess (the ones it ranks lowest by rendezvous hashing)
//!   and claims free or stale ones (those it ranks highest), so partitions
//!   spread over live members and move when one joins, leaves or dies.
//! - **Release** (rebalancing or shutdown): the lease is revoked first,
//!   then the key is deleted (expecting our revision) once the partition's
//!   worker has dropped its handle, or after `margin` at most.
//!
//! # Why two members never fold a partition at once
//!
//! Let H hold partition `p`, let `r` be the last revision H wrote to
//! `partitions.p` and `s` the time H sent that write. H's validity ends at
//! `s + ttl - margin` unless a later write of H succeeds. Another member O
//! can only start on `p` after its own write `w` to the key succeeds, and
//! `w` comes after `r` in the key's history (the stream orders writes):
//!
//! 1. `w` is an update expecting `r` (takeover of a stale key). O saw `r`
//!    only after the stream stored it, so after `s`, and waited `ttl` from
//!    then. Since `w` expected `r`, H wrote nothing after `r`: H's validity
//!    ended at `s + ttl - margin`, at least `margin` before O's write was
//!    even sent. H's renewals from then on expect `r` and fail.
//! 2. `w` is a create: the key was deleted or gone. Only a holder deletes
//!    its key, on release, after revoking its lease and letting its worker
//!    finish (or `margin` pass). A key is gone by `max_age` only after
//!    `max_age >= ttl` from its storing (checked at start by every member),
//!    so after `s + ttl`, as in 1.
//! 3. `w` is an update expecting a revision O wrote itself (a claim whose
//!    answer O never got): that write was an acquisition, covered by 1 or 2
//!    when it was sent, and O's validity counts from the later send.
//!
//! A resumed lease (above) is the same owner continuing: the successful
//! update proves no write, hence no other owner, since `r`; and while it
//! was lapsed its own worker did not act ([`Lease::still_held`] was
//! false), so nobody folded the partition in the gap at all.
//!
//! What this assumes, and what happens beyond it:
//!
//! - **Clocks**: only durations are compared, each on one member's
//!   monotonic clock; no wall clocks, no agreement between hosts. Rates
//!   may differ by a small fraction, which the margin covers (0.1% of a
//!   1.5 s TTL is 1.5 ms). The monotonic clock stops while a host is
//!   suspended: to the member, a suspension is a pause.
//! - **Pauses**: a check of [`Lease::still_held`] and the action it guards
//!   (a batch's commit, its publishes) take less than `margin` together.
//!   A worker paused longer between the two can finish that one action
//!   after the next owner started; it starts no other (the next check
//!   fails). What that one action does is harmless by construction, not by
//!   time: the fold is deterministic and every effect has a content-derived
//!   message id, so a late publish is dropped as a duplicate by the stream
//!   (or by the fold, by id), and the commit goes to the paused process's
//!   own state store, which nobody else reads.
//! - **Network partitions**: a member cut off from the bucket cannot renew
//!   and lapses after `ttl - margin`; it cannot write either, so it cannot
//!   take anything over. A member whose own requests fail (timeouts, no
//!   responders, a lost connection) or whose watch falls behind its own
//!   heartbeat restarts its staleness clocks: it cannot tell a dead holder
//!   from one that could not write either. So when a bucket without a
//!   leader (a NATS node failure) comes back, every holder has a full TTL to
//!   renew, and keeps its partitions.
//! - **A bucket leader election** (nats-server 2.15 raft: a follower calls
//!   an election 4 to 9 s after it last heard the leader): nobody can
//!   write, so nobody acquires; holders lapse after `ttl - margin` and
//!   resume with their first renewal once a leader is elected (a key
//!   outlives an election: every replica removes it only `max_age` after
//!   its last write).
//!
//! With the defaults (TTL 1.5 s, renewal every 250 ms, margin 500 ms) a
//! dead member's partitions are taken over 1.25 to 1.5 s after its death,
//! and a holder stops folding 1 s after its last successful renewal.

use crate::nats::config::NatsConfig;
use crate::nats::NatsError;
use crate::telemetry::{LeaseChange, LeaseChanged, PartitionsHeld};
use async_nats::jetstream::kv::{self, CreateErrorKind, Operation, UpdateErrorKind};
use bytes::Bytes;
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// The lease bucket's `max_age` when it is created, unless `lease_ttl_ms`
/// is longer: what a dead member leaves is removed after this. Takeover
/// does not wait for it. A key only has to outlive a leader election of
/// the bucket for its holder to keep it through one: a raft follower calls
/// an election 4 to 9 s after it last heard the leader, so 30 s leaves room
/// for a split vote and a second round.
pub const LEASE_KEY_MAX_AGE: Duration = Duration::from_secs(30);

/// Timing and size of the lease scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseSettings {
    pub partitions: u32,
    /// How long a lease lasts without renewal: others may take it over once
    /// they have seen it unrenewed this long.
    pub ttl: Duration,
    /// Interval between renewal rounds.
    pub renew: Duration,
    /// How much sooner than others may take it over the holder stops.
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
    pub fn usable_for(&self) -> Duration {
        self.ttl.saturating_sub(self.margin)
    }

    /// The longest one lease request (a renewal, a claim, a heartbeat, a
    /// read) is waited for: half of what is left of a lease's usable time
    /// after a renewal interval, so that one unanswered request still
    /// leaves time for the next renewal. 375 ms with the defaults.
    pub fn request_timeout(&self) -> Duration {
        (self.usable_for().saturating_sub(self.renew) / 2).max(Duration::from_millis(50))
    }

    /// How long a release waits for the partition's worker to let go.
    fn release_wait(&self) -> Duration {
        self.margin
    }
}

/// The value of a `partitions.<p>` key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRecord {
    /// Member id of the holder.
    pub owner: String,
    /// The holder's lease TTL in milliseconds: others may take the lease
    /// over once they have seen this value unrenewed this long. Absent in
    /// the records of older versions, whose TTL is the bucket's `max_age`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_ms: Option<u64>,
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
    /// The member's lease TTL in milliseconds: it counts as gone once its
    /// heartbeat has gone unrenewed this long. Absent in the records of
    /// older versions (the bucket's `max_age` then).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_ms: Option<u64>,
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

/// One tenure of a held partition. Clone it into the partition's worker;
/// the worker checks [`Lease::still_held`] before every commit and
/// publish, and drops its clone when it stops.
///
/// A lease not renewed in time *lapses*: it stops being held and its
/// worker must pause. It is held again only when a renewal expecting its
/// last revision succeeds, which proves that nobody wrote the key since,
/// so nobody else held the partition meanwhile and the holder's state is
/// still its latest: the worker may go on where it paused
/// ([`Lease::regained`]). A released or lost lease (revoked) is never
/// held again; a partition acquired anew comes as a new `Lease` with a
/// larger token.
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

    /// KV revision at the start of this tenure; larger for every later
    /// tenure, whoever holds it.
    pub fn fencing_token(&self) -> u64 {
        self.inner.fencing_token
    }

    /// KV revision of the latest renewal.
    pub fn revision(&self) -> u64 {
        self.inner.state.borrow().revision
    }

    /// Until when the holder may act on this lease, unless renewed.
    pub fn valid_until(&self) -> Instant {
        self.inner.state.borrow().valid_until
    }

    /// True while this process may fold the partition: not revoked and
    /// renewed in time. After a lapse it turns true again only through a
    /// renewal that proved nobody else wrote the key.
    pub fn still_held(&self) -> bool {
        let s = *self.inner.state.borrow();
        !s.revoked && Instant::now() < s.valid_until
    }

    /// Whether the lease was revoked: released or lost, never held again.
    pub fn is_gone(&self) -> bool {
        self.inner.state.borrow().revoked
    }

    /// Waits until the lease is held again after a lapse (`true`, at once
    /// if held now) or is gone for good (`false`).
    pub async fn regained(&self) -> bool {
        let mut rx = self.inner.state.subscribe();
        loop {
            let s = *rx.borrow_and_update();
            if s.revoked {
                return false;
            }
            if Instant::now() < s.valid_until {
                return true;
            }
            if rx.changed().await.is_err() {
                return false;
            }
        }
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

    /// Records a renewal the stream stored with `revision` (it expected the
    /// previous one); returns whether this resumed a lapsed lease. A
    /// revoked lease stays revoked.
    fn renewed(&self, revision: u64, valid_until: Instant) -> Renewal {
        let mut outcome = Renewal::Refused;
        self.inner.state.send_modify(|s| {
            if s.revoked {
                return;
            }
            let now = Instant::now();
            outcome = match (now < s.valid_until, now < valid_until) {
                (true, _) => Renewal::Extended,
                (false, true) => Renewal::Resumed,
                (false, false) => Renewal::TooLate,
            };
            s.revision = revision;
            s.valid_until = s.valid_until.max(valid_until);
        });
        outcome
    }

    /// Clones of this lease alive, this one included.
    fn clones(&self) -> usize {
        Arc::strong_count(&self.inner)
    }
}

/// What a renewal did to a lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Renewal {
    /// It was held and stays held longer.
    Extended,
    /// It had lapsed and is held again.
    Resumed,
    /// It had lapsed, and the answer came too late to hold it again.
    TooLate,
    /// It is revoked.
    Refused,
}

/// A change of ownership, for whoever runs the partitions' workers.
#[derive(Debug, Clone)]
pub enum LeaseEvent {
    /// Start working on this partition (a new tenure).
    Acquired(Lease),
    /// Given up on purpose (rebalancing or shutdown).
    Released { partition: u32 },
    /// Taken away for good (the key is someone else's, or gone).
    Lost { partition: u32, reason: String },
    /// Not renewed in time: the worker pauses ([`Lease::regained`]).
    Lapsed { partition: u32 },
    /// Held again after a lapse: the worker goes on.
    Resumed { partition: u32 },
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

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The maps hold plain data; a panic elsewhere cannot leave them torn.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What this member knows of one key: the revision it last saw and since
/// when.
#[derive(Debug, Clone)]
struct Seen {
    revision: u64,
    /// A value is there (a put), not a delete or purge marker.
    present: bool,
    /// Who wrote the value, when it decodes.
    owner: Option<String>,
    /// How long the writer's claim lasts without renewal.
    ttl: Duration,
    /// When this member first saw this revision (its own clock).
    since: Instant,
    /// The heartbeat's record (member keys).
    record: Option<MemberRecord>,
}

/// The keys of the bucket as this member has seen them.
#[derive(Debug, Default)]
struct View {
    partitions: BTreeMap<u32, Seen>,
    members: BTreeMap<String, Seen>,
}

/// How a partition can be claimed now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Claim {
    /// Absent or deleted: KV create.
    Create,
    /// Stale, or last written by this member: KV update expecting it.
    Takeover(u64),
}

/// Whether `seen` (a present key written by someone else) has gone
/// unrenewed for its TTL, counting only from `clean_since` (the end of
/// this member's last failure to reach the bucket).
fn is_stale(seen: &Seen, clean_since: Instant, now: Instant) -> bool {
    seen.present && now >= seen.since.max(clean_since) + seen.ttl
}

/// When `seen` becomes stale.
fn stale_at(seen: &Seen, clean_since: Instant) -> Instant {
    seen.since.max(clean_since) + seen.ttl
}

/// How a partition whose key looks like `seen` (`None`: never seen) can be
/// claimed by `member` at `now`: created when free, taken over (a
/// compare-and-set on the revision seen) when its last value is the
/// member's own or has gone unrenewed for its TTL since `clean_since`.
fn claim_for(
    seen: Option<&Seen>,
    member: &str,
    clean_since: Instant,
    now: Instant,
) -> Option<Claim> {
    match seen {
        None => Some(Claim::Create),
        Some(s) if !s.present => Some(Claim::Create),
        Some(s) if s.owner.as_deref() == Some(member) => Some(Claim::Takeover(s.revision)),
        Some(s) if is_stale(s, clean_since, now) => Some(Claim::Takeover(s.revision)),
        Some(_) => None,
    }
}

/// A held partition, lapsed or not.
struct Holding {
    lease: Lease,
    /// The revision the next renewal expects: the last one we wrote.
    expected: u64,
    /// The lease stopped being held and a `Lost` was reported for it.
    lapsed: bool,
    /// A renewal (or the check after a refused one) is in flight.
    busy: bool,
}

/// A lease request's failure.
#[derive(Debug)]
enum WriteFailure {
    /// The key was not as expected (someone else's, or changed).
    Conflict,
    /// No answer in time, no leader, no connection.
    Unanswered(String),
}

/// The answer to a request this member had in flight.
enum Outcome {
    Heartbeat(Result<u64, String>),
    /// A new watch (boxed: it is far larger than every other answer).
    Watch(Result<Box<kv::Watch>, String>),
    Renewed {
        partition: u32,
        sent: Instant,
        result: Result<u64, WriteFailure>,
    },
    /// The key read after a refused renewal.
    Checked {
        partition: u32,
        result: Result<Option<kv::Entry>, String>,
    },
    Claimed {
        partition: u32,
        sent: Instant,
        result: Result<u64, WriteFailure>,
    },
    /// The key read after a refused claim.
    Looked {
        partition: u32,
        at: Instant,
        result: Result<Option<kv::Entry>, String>,
    },
    Released {
        partition: u32,
        result: Result<(), String>,
    },
}

type Request = BoxFuture<'static, Outcome>;

/// Bounds `request` by `limit`: an unanswered request is a failure, never
/// a stall.
async fn bounded<T, E: std::fmt::Display>(
    limit: Duration,
    request: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, String> {
    match tokio::time::timeout(limit, request).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no answer within {} ms", limit.as_millis())),
    }
}

/// One process's membership and leases, before it runs.
pub struct PartitionLeases {
    kv: kv::Store,
    member: String,
    settings: LeaseSettings,
    /// The bucket's `max_age`: the TTL of values that do not say theirs.
    max_age: Duration,
    /// Published in the heartbeat (see [`MemberRecord::policy_fingerprint`]).
    policy_fingerprint: Option<String>,
}

impl PartitionLeases {
    pub fn new(
        kv: kv::Store,
        member: impl Into<String>,
        settings: LeaseSettings,
    ) -> Result<Self, NatsError> {
        let member = member.into();
        validate_member_id(&member)?;
        let max_age = kv.stream.cached_info().config.max_age;
        if max_age < settings.ttl {
            return Err(NatsError::Incompatible {
                resource: format!("KV bucket {}", kv.name),
                detail: format!(
                    "its max_age is {max_age:?}, shorter than the lease TTL {:?}: a lease could \
                     vanish before its holder stops using it",
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
            max_age,
            policy_fingerprint: None,
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

    /// Starts watching the bucket, renewing and balancing until `stop()`;
    /// ownership changes arrive on the returned handle's `events`.
    pub fn spawn(self) -> LeaseRunner {
        let (events_tx, events) = mpsc::unbounded_channel();
        let (stop_tx, stop_rx) = watch::channel(false);
        let table = LeaseTable {
            held: Arc::default(),
            joined: Arc::default(),
            members: Arc::default(),
        };
        let member = self.member.clone();
        let runner = Runner {
            kv: self.kv,
            member: self.member,
            settings: self.settings,
            max_age: self.max_age,
            policy_fingerprint: self.policy_fingerprint,
            table: table.clone(),
            sink: events_tx,
            holdings: BTreeMap::new(),
            claiming: BTreeSet::new(),
            releasing: BTreeSet::new(),
            view: View::default(),
            clean_since: Instant::now(),
            heartbeat: None,
            heartbeat_busy: false,
            watch_busy: false,
            watch_seen: 0,
            snapshot_done: false,
            balanced_once: false,
            failing: 0,
            started: Vec::new(),
            preference: Vec::new(),
        };
        let task = tokio::spawn(runner.run(stop_rx));
        LeaseRunner {
            member,
            table,
            events,
            stop: stop_tx,
            task,
        }
    }
}

/// The running state of one member (owned by its task).
struct Runner {
    kv: kv::Store,
    member: String,
    settings: LeaseSettings,
    max_age: Duration,
    policy_fingerprint: Option<String>,
    table: LeaseTable,
    sink: mpsc::UnboundedSender<LeaseEvent>,
    holdings: BTreeMap<u32, Holding>,
    claiming: BTreeSet<u32>,
    releasing: BTreeSet<u32>,
    view: View,
    /// Staleness is counted from here at the earliest: the end of this
    /// member's last failure to reach the bucket (or its start).
    clean_since: Instant,
    /// Our last heartbeat the stream acknowledged: (revision, when).
    heartbeat: Option<(u64, Instant)>,
    heartbeat_busy: bool,
    watch_busy: bool,
    /// The highest revision the watch delivered.
    watch_seen: u64,
    /// The watch delivered the bucket as it was when it started.
    snapshot_done: bool,
    balanced_once: bool,
    /// Requests failed since the last one that succeeded.
    failing: u64,
    /// Requests to put in flight.
    started: Vec<Request>,
    /// Every partition, the one this member ranks highest first.
    preference: Vec<u32>,
}

/// What woke the member's loop.
enum Wake {
    Stop,
    Done(Outcome),
    Watched(Option<Result<kv::Entry, kv::WatcherError>>),
    Round,
    Deadline,
}

impl Runner {
    async fn run(mut self, mut stop: watch::Receiver<bool>) {
        let mut preference: Vec<u32> = (0..self.settings.partitions).collect();
        preference.sort_by_cached_key(|p| std::cmp::Reverse(rank(&self.member, *p)));
        self.preference = preference;
        let mut requests: FuturesUnordered<Request> = FuturesUnordered::new();
        let mut watcher: Option<Box<kv::Watch>> = None;
        let mut rounds = tokio::time::interval(self.settings.renew);
        rounds.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let deadline = self.next_deadline();
            let wake = tokio::select! {
                biased;
                changed = stop.changed() => {
                    if changed.is_err() || *stop.borrow() { Wake::Stop } else { continue }
                }
                Some(done) = requests.next(), if !requests.is_empty() => Wake::Done(done),
                entry = next_entry(&mut watcher) => Wake::Watched(entry),
                _ = rounds.tick() => Wake::Round,
                _ = tokio::time::sleep_until(deadline) => Wake::Deadline,
            };
            match wake {
                Wake::Stop => break,
                Wake::Done(Outcome::Watch(Ok(w))) => {
                    self.watch_busy = false;
                    self.answered();
                    watcher = Some(w);
                }
                Wake::Done(done) => self.complete(done),
                Wake::Watched(None) => {
                    // The watch ended (the client closed it): start another.
                    watcher = None;
                    self.failed("watch", "the watch ended");
                }
                Wake::Watched(Some(Err(e))) => {
                    // It recovers by itself (recreated from the last revision
                    // it delivered); what it missed meanwhile is unknown.
                    self.failed("watch", e);
                }
                Wake::Watched(Some(Ok(entry))) => self.observe(entry),
                Wake::Round => self.round(watcher.is_none()),
                Wake::Deadline => {}
            }
            self.balance();
            requests.extend(self.started.drain(..));
        }
        self.leave(requests).await;
    }

    fn emit(&self, event: LeaseEvent, reason: &str) {
        let (partition, change) = match &event {
            LeaseEvent::Acquired(lease) => (lease.partition(), LeaseChange::Acquired),
            LeaseEvent::Released { partition } => (*partition, LeaseChange::HandedOver),
            LeaseEvent::Lost { partition, .. } | LeaseEvent::Lapsed { partition } => {
                (*partition, LeaseChange::Lost)
            }
            LeaseEvent::Resumed { partition } => (*partition, LeaseChange::Acquired),
        };
        LeaseChanged {
            partition,
            change,
            reason,
        }
        .emit();
        PartitionsHeld {
            count: self.table.partitions().len(),
        }
        .emit();
        let _ = self.sink.send(event);
    }

    fn record(&self) -> Bytes {
        let record = LeaseRecord {
            owner: self.member.clone(),
            ttl_ms: Some(self.settings.ttl.as_millis() as u64),
        };
        Bytes::from(serde_json::to_vec(&record).unwrap_or_default())
    }

    /// A request was not answered: counted, logged once per outage, and
    /// staleness clocks restart (this member cannot tell a dead holder
    /// from one that could not write either).
    fn failed(&mut self, what: &str, err: impl std::fmt::Display) {
        self.clean_since = Instant::now();
        self.failing += 1;
        if self.failing == 1 {
            tracing::warn!(member = %self.member, "lease {what} failed: {err} (retrying every {} ms)", self.settings.renew.as_millis());
        } else {
            tracing::debug!(member = %self.member, "lease {what} failed: {err}");
        }
    }

    /// A request was answered.
    fn answered(&mut self) {
        if self.failing > 0 {
            tracing::info!(member = %self.member, failed = self.failing, "lease requests are answered again");
            self.failing = 0;
        }
    }

    /// The earliest time a key seen becomes stale (or a round's worth
    /// ahead: rounds come anyway).
    fn next_deadline(&self) -> Instant {
        let now = Instant::now();
        let others = self
            .view
            .partitions
            .values()
            .chain(self.view.members.values())
            .filter(|s| s.present && s.owner.as_deref() != Some(self.member.as_str()))
            .map(|s| stale_at(s, self.clean_since))
            .filter(|t| *t > now);
        others.min().unwrap_or(now + self.settings.renew)
    }

    /// Every `renew`: report lapses, check the watch keeps up, heartbeat,
    /// renew every holding, (re)start the watch.
    fn round(&mut self, no_watch: bool) {
        let now = Instant::now();
        let lapsed: Vec<u32> = self
            .holdings
            .iter()
            .filter(|(_, h)| !h.lapsed && !h.lease.still_held())
            .map(|(p, _)| *p)
            .collect();
        for p in lapsed {
            if let Some(h) = self.holdings.get_mut(&p) {
                h.lapsed = true;
            }
            self.report_lapse(p);
        }
        // Our own heartbeat, acknowledged a while ago and not delivered by
        // the watch: the watch is behind, and so is what it says of others.
        if let Some((revision, at)) = self.heartbeat {
            if self.watch_seen < revision && now >= at + self.settings.request_timeout() {
                self.clean_since = now;
            }
        }
        self.publish_members(now);
        self.start_heartbeat();
        let due: Vec<u32> = self
            .holdings
            .iter()
            .filter(|(_, h)| !h.busy)
            .map(|(p, _)| *p)
            .collect();
        for p in due {
            self.start_renewal(p);
        }
        if no_watch && !self.watch_busy && self.heartbeat.is_some() {
            self.watch_busy = true;
            let kv = self.kv.clone();
            // Creating the watch creates a consumer: give it the TTL.
            let limit = self.settings.ttl.max(self.settings.request_timeout());
            self.started.push(
                async move {
                    Outcome::Watch(
                        bounded(limit, kv.watch_with_history(">"))
                            .await
                            .map(Box::new),
                    )
                }
                .boxed(),
            );
        }
    }

    /// The lease of `partition` ran out: its worker pauses; the member
    /// keeps renewing the key and the lease resumes if it is still its own.
    fn report_lapse(&mut self, partition: u32) {
        self.emit(
            LeaseEvent::Lapsed { partition },
            "lapsed: not renewed in time (resumes if the key is still ours)",
        );
    }

    fn start_heartbeat(&mut self) {
        if self.heartbeat_busy {
            return;
        }
        self.heartbeat_busy = true;
        let record = MemberRecord {
            member: self.member.clone(),
            held: self.table.partitions().len(),
            policy_fingerprint: self.policy_fingerprint.clone(),
            ttl_ms: Some(self.settings.ttl.as_millis() as u64),
        };
        let body = Bytes::from(serde_json::to_vec(&record).unwrap_or_default());
        let (kv, key, limit) = (
            self.kv.clone(),
            member_key(&self.member),
            self.settings.request_timeout(),
        );
        self.started.push(
            async move { Outcome::Heartbeat(bounded(limit, kv.put(key, body)).await) }.boxed(),
        );
    }

    fn start_renewal(&mut self, partition: u32) {
        let record = self.record();
        let limit = self.settings.request_timeout();
        let Some(h) = self.holdings.get_mut(&partition) else {
            return;
        };
        h.busy = true;
        let (kv, expected) = (self.kv.clone(), h.expected);
        self.started.push(
            async move {
                let sent = Instant::now();
                let result = match tokio::time::timeout(
                    limit,
                    kv.update(partition_key(partition), record, expected),
                )
                .await
                {
                    Ok(Ok(revision)) => Ok(revision),
                    Ok(Err(e)) if e.kind() == UpdateErrorKind::WrongLastRevision => {
                        Err(WriteFailure::Conflict)
                    }
                    Ok(Err(e)) => Err(WriteFailure::Unanswered(e.to_string())),
                    Err(_) => Err(WriteFailure::Unanswered(format!(
                        "no answer within {} ms",
                        limit.as_millis()
                    ))),
                };
                Outcome::Renewed {
                    partition,
                    sent,
                    result,
                }
            }
            .boxed(),
        );
    }

    fn start_claim(&mut self, partition: u32, claim: Claim) {
        self.claiming.insert(partition);
        let (kv, record, limit) = (
            self.kv.clone(),
            self.record(),
            self.settings.request_timeout(),
        );
        self.started.push(
            async move {
                let key = partition_key(partition);
                let sent = Instant::now();
                let answer = match claim {
                    Claim::Create => tokio::time::timeout(limit, kv.create(key, record))
                        .await
                        .map(|r| {
                            r.map_err(|e| match e.kind() {
                                CreateErrorKind::AlreadyExists => WriteFailure::Conflict,
                                _ => WriteFailure::Unanswered(e.to_string()),
                            })
                        }),
                    Claim::Takeover(expected) => {
                        tokio::time::timeout(limit, kv.update(key, record, expected))
                            .await
                            .map(|r| {
                                r.map_err(|e| match e.kind() {
                                    UpdateErrorKind::WrongLastRevision => WriteFailure::Conflict,
                                    _ => WriteFailure::Unanswered(e.to_string()),
                                })
                            })
                    }
                };
                let result = answer.unwrap_or_else(|_| {
                    Err(WriteFailure::Unanswered(format!(
                        "no answer within {} ms",
                        limit.as_millis()
                    )))
                });
                Outcome::Claimed {
                    partition,
                    sent,
                    result,
                }
            }
            .boxed(),
        );
    }

    /// Reads `partitions.<p>` (after a refused renewal: `checked`; after a
    /// refused claim: `!checked`).
    fn start_read(&mut self, partition: u32, checked: bool) {
        let (kv, limit) = (self.kv.clone(), self.settings.request_timeout());
        self.started.push(
            async move {
                let at = Instant::now();
                let result = bounded(limit, kv.entry(partition_key(partition))).await;
                if checked {
                    Outcome::Checked { partition, result }
                } else {
                    Outcome::Looked {
                        partition,
                        at,
                        result,
                    }
                }
            }
            .boxed(),
        );
    }

    /// Gives `partition` up on purpose: revoked now, the key deleted once
    /// the worker let go (or after the release wait).
    fn release(&mut self, partition: u32) {
        let Some(h) = self.holdings.remove(&partition) else {
            return;
        };
        lock(&self.table.held).remove(&partition);
        h.lease.revoke();
        self.emit(LeaseEvent::Released { partition }, "rebalance or leave");
        self.releasing.insert(partition);
        let (kv, limit, wait) = (
            self.kv.clone(),
            self.settings.request_timeout(),
            self.settings.release_wait(),
        );
        let (lease, expected) = (h.lease, h.expected);
        self.started.push(
            async move {
                let deadline = Instant::now() + wait;
                while lease.clones() > 1 && Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                drop(lease);
                // Only removes our own value. If it fails, the key goes
                // stale and is taken over: slower hand-over, same safety.
                let result = bounded(
                    limit,
                    kv.delete_expect_revision(partition_key(partition), Some(expected)),
                )
                .await;
                Outcome::Released { partition, result }
            }
            .boxed(),
        );
    }

    /// Stops holding `partition` for good (its key is someone else's).
    fn lose(&mut self, partition: u32, reason: &str) {
        let Some(h) = self.holdings.remove(&partition) else {
            return;
        };
        lock(&self.table.held).remove(&partition);
        h.lease.revoke();
        self.emit(
            LeaseEvent::Lost {
                partition,
                reason: reason.to_string(),
            },
            reason,
        );
    }

    /// Starts a tenure under `lease` (answered so late that it is already
    /// over, it starts lapsed: its worker waits for the next renewal).
    fn acquired(&mut self, lease: Lease, expected: u64) {
        let p = lease.partition();
        self.holdings.insert(
            p,
            Holding {
                lease: lease.clone(),
                expected,
                lapsed: !lease.still_held(),
                busy: false,
            },
        );
        lock(&self.table.held).insert(p, lease.clone());
        self.emit(LeaseEvent::Acquired(lease), "");
    }

    fn complete(&mut self, done: Outcome) {
        let now = Instant::now();
        let usable = self.settings.usable_for();
        match done {
            Outcome::Heartbeat(Ok(revision)) => {
                self.heartbeat_busy = false;
                self.answered();
                self.heartbeat = Some((revision, now));
            }
            Outcome::Heartbeat(Err(e)) => {
                self.heartbeat_busy = false;
                self.failed("heartbeat", e);
            }
            Outcome::Watch(Ok(_)) => {}
            Outcome::Watch(Err(e)) => {
                self.watch_busy = false;
                self.failed("watch", e);
            }
            Outcome::Renewed {
                partition,
                sent,
                result,
            } => match result {
                Ok(revision) => {
                    self.answered();
                    let Some(h) = self.holdings.get_mut(&partition) else {
                        return;
                    };
                    h.busy = false;
                    h.expected = revision;
                    match h.lease.renewed(revision, sent + usable) {
                        Renewal::Extended | Renewal::Refused => {}
                        Renewal::TooLate => {
                            if !std::mem::replace(&mut h.lapsed, true) {
                                self.report_lapse(partition);
                            }
                        }
                        // Lapsed, and nobody wrote the key since our last
                        // revision: nobody else held it meanwhile.
                        Renewal::Resumed => {
                            let reported = std::mem::replace(&mut h.lapsed, false);
                            if !reported {
                                self.report_lapse(partition);
                            }
                            self.emit(
                                LeaseEvent::Resumed { partition },
                                "resumed: the key was still ours",
                            );
                        }
                    }
                }
                Err(WriteFailure::Conflict) => self.start_read(partition, true),
                Err(WriteFailure::Unanswered(e)) => {
                    if let Some(h) = self.holdings.get_mut(&partition) {
                        h.busy = false;
                    }
                    self.failed("renewal", e);
                }
            },
            Outcome::Checked { partition, result } => match result {
                Ok(entry) => {
                    self.answered();
                    let ours = entry.as_ref().filter(|e| {
                        e.operation == Operation::Put
                            && lease_owner(&e.value).as_deref() == Some(self.member.as_str())
                    });
                    match ours {
                        // A renewal (or claim) of ours the stream applied
                        // but whose answer was lost: nobody else wrote since.
                        Some(entry) => {
                            if let Some(h) = self.holdings.get_mut(&partition) {
                                h.busy = false;
                                h.expected = entry.revision;
                            }
                        }
                        None => {
                            self.lose(partition, "the lease key expired or changed hands");
                        }
                    }
                }
                Err(e) => {
                    if let Some(h) = self.holdings.get_mut(&partition) {
                        h.busy = false;
                    }
                    self.failed("renewal check", e);
                }
            },
            Outcome::Claimed {
                partition,
                sent,
                result,
            } => {
                self.claiming.remove(&partition);
                match result {
                    Ok(revision) => {
                        self.answered();
                        self.acquired(Lease::new(partition, revision, sent + usable), revision);
                    }
                    // Someone else was quicker, or the key is not what the
                    // watch said (it may have expired unseen): read it.
                    Err(WriteFailure::Conflict) => {
                        self.answered();
                        self.start_read(partition, false);
                    }
                    Err(WriteFailure::Unanswered(e)) => self.failed("acquire", e),
                }
            }
            Outcome::Looked {
                partition,
                at,
                result,
            } => match result {
                Ok(entry) => {
                    self.answered();
                    match entry {
                        Some(e) => self.note_partition(partition, &e, at),
                        None => {
                            if let Some(s) = self.view.partitions.get_mut(&partition) {
                                s.present = false;
                            }
                        }
                    }
                }
                Err(e) => self.failed("lookup", e),
            },
            Outcome::Released { partition, result } => {
                self.releasing.remove(&partition);
                match result {
                    Ok(()) => self.answered(),
                    Err(e) => self.failed("release", e),
                }
            }
        }
    }

    /// Takes in one entry of the watch.
    fn observe(&mut self, entry: kv::Entry) {
        let now = Instant::now();
        self.watch_seen = self.watch_seen.max(entry.revision);
        if entry.seen_current {
            self.snapshot_done = true;
        }
        if let Some(p) = entry
            .key
            .strip_prefix("partitions.")
            .and_then(|p| p.parse::<u32>().ok())
        {
            if p < self.settings.partitions {
                self.note_partition(p, &entry, now);
            }
        } else if let Some(id) = entry.key.strip_prefix("members.") {
            let record = serde_json::from_slice::<MemberRecord>(&entry.value).ok();
            let ttl = self.ttl_of(record.as_ref().and_then(|r| r.ttl_ms));
            let seen = Seen {
                revision: entry.revision,
                present: entry.operation == Operation::Put,
                owner: Some(id.to_string()),
                ttl,
                since: now,
                record,
            };
            note(self.view.members.entry(id.to_string()), seen);
            self.publish_members(now);
        }
    }

    fn note_partition(&mut self, partition: u32, entry: &kv::Entry, at: Instant) {
        let record = serde_json::from_slice::<LeaseRecord>(&entry.value).ok();
        let ttl = self.ttl_of(record.as_ref().and_then(|r| r.ttl_ms));
        let seen = Seen {
            revision: entry.revision,
            present: entry.operation == Operation::Put,
            owner: record.map(|r| r.owner),
            ttl,
            since: at,
            record: None,
        };
        note(self.view.partitions.entry(partition), seen);
    }

    /// A value's TTL: what it says, else (older versions) the bucket's
    /// `max_age`; never more than `max_age`, past which the key is gone.
    fn ttl_of(&self, ttl_ms: Option<u64>) -> Duration {
        ttl_ms
            .map(Duration::from_millis)
            .unwrap_or(self.max_age)
            .min(self.max_age)
    }

    /// Live members (heartbeat present and not stale), this one included.
    fn live_members(&self, now: Instant) -> Vec<&str> {
        let mut live: Vec<&str> = self
            .view
            .members
            .iter()
            .filter(|(id, s)| {
                s.present && (id.as_str() == self.member || !is_stale(s, self.clean_since, now))
            })
            .map(|(id, _)| id.as_str())
            .collect();
        if !live.contains(&self.member.as_str()) {
            live.push(&self.member);
        }
        live
    }

    fn publish_members(&self, now: Instant) {
        let members = self
            .view
            .members
            .iter()
            .filter(|(id, s)| {
                s.present && (id.as_str() == self.member || !is_stale(s, self.clean_since, now))
            })
            .map(|(id, s)| LiveMember {
                member: id.clone(),
                record: s.record.clone(),
            })
            .collect();
        *lock(&self.table.members) = members;
    }

    /// How `partition` can be claimed now, if at all.
    fn claimable(&self, partition: u32, now: Instant) -> Option<Claim> {
        claim_for(
            self.view.partitions.get(&partition),
            &self.member,
            self.clean_since,
            now,
        )
    }

    /// Releases the excess over the fair share, or claims up to it.
    fn balance(&mut self) {
        if !self.snapshot_done || self.heartbeat.is_none() {
            return;
        }
        let now = Instant::now();
        let share = fair_share(self.settings.partitions, self.live_members(now).len());
        let held = self.holdings.len();
        if held > share {
            if self.claiming.is_empty() {
                let excess: Vec<u32> = self
                    .preference
                    .iter()
                    .rev()
                    .filter(|p| self.holdings.contains_key(p))
                    .take(held - share)
                    .copied()
                    .collect();
                for p in excess {
                    self.release(p);
                }
            }
        } else {
            let mut room = (share - held).saturating_sub(self.claiming.len());
            let mut claims = Vec::new();
            for p in &self.preference {
                if room == 0 {
                    break;
                }
                if self.holdings.contains_key(p)
                    || self.claiming.contains(p)
                    || self.releasing.contains(p)
                {
                    continue;
                }
                if let Some(claim) = self.claimable(*p, now) {
                    claims.push((*p, claim));
                    room -= 1;
                }
            }
            for (p, claim) in claims {
                self.start_claim(p, claim);
            }
        }
        if !self.balanced_once {
            self.balanced_once = true;
        } else if self.claiming.is_empty() {
            self.table.joined.store(true, Ordering::Release);
        }
    }

    /// Graceful leave: every lease released (after its worker lets go), the
    /// heartbeat deleted so the others rebalance at once.
    async fn leave(mut self, mut requests: FuturesUnordered<Request>) {
        let held: Vec<u32> = self.holdings.keys().copied().collect();
        for p in held {
            self.release(p);
        }
        requests.extend(self.started.drain(..));
        let limit = self.settings.release_wait() + self.settings.request_timeout() * 2;
        let _ = tokio::time::timeout(limit, async {
            while let Some(done) = requests.next().await {
                if let Outcome::Released {
                    partition,
                    result: Err(e),
                } = done
                {
                    tracing::debug!(partition, "lease release failed: {e}");
                }
            }
        })
        .await;
        if let Err(e) = bounded(
            self.settings.request_timeout(),
            self.kv.delete(member_key(&self.member)),
        )
        .await
        {
            self.failed("leave", e);
        }
    }
}

/// Keeps what is known of a key: a newer revision replaces it (seen now),
/// the same or an older one (a read racing the watch) changes nothing.
fn note<K: Ord>(slot: std::collections::btree_map::Entry<'_, K, Seen>, seen: Seen) {
    match slot {
        std::collections::btree_map::Entry::Vacant(v) => {
            v.insert(seen);
        }
        std::collections::btree_map::Entry::Occupied(mut o) => {
            if seen.revision > o.get().revision {
                o.insert(seen);
            }
        }
    }
}

fn lease_owner(value: &[u8]) -> Option<String> {
    serde_json::from_slice::<LeaseRecord>(value)
        .ok()
        .map(|r| r.owner)
}

/// The next entry of the watch, or never while there is none.
async fn next_entry(
    watcher: &mut Option<Box<kv::Watch>>,
) -> Option<Result<kv::Entry, kv::WatcherError>> {
    match watcher {
        Some(w) => w.next().await,
        None => std::future::pending().await,
    }
}

/// Which partitions this process holds right now.
#[derive(Clone)]
pub struct LeaseTable {
    held: Arc<Mutex<BTreeMap<u32, Lease>>>,
    joined: Arc<AtomicBool>,
    members: Arc<Mutex<Vec<LiveMember>>>,
}

impl LeaseTable {
    /// The lease on `partition`, if held and still valid.
    pub fn lease(&self, partition: u32) -> Option<Lease> {
        lock(&self.held)
            .get(&partition)
            .filter(|l| l.still_held())
            .cloned()
    }

    /// Whether the member has joined: its heartbeat is written, it has seen
    /// the bucket, and its first claims are answered.
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

    /// The live members as this member's watch shows them (heartbeat
    /// present and renewed within its TTL), with their records.
    pub fn members(&self) -> Vec<LiveMember> {
        lock(&self.members).clone()
    }
}

/// A running member.
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
    /// leases lapse by time and others take the keys over.
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

/// Who holds `partition`, if anyone (for `doctor`): the owner of a lease
/// written within its TTL. A holder that stopped without releasing (a
/// crash, or a shutdown whose release did not finish) holds nothing once
/// its TTL has passed, though its record stays until the bucket's
/// `max_age` removes it. The record's age is the server's write time
/// against this host's clock (a one-off reading has no other), so
/// [`CLOCK_ALLOWANCE_MS`] is added to the TTL.
pub async fn owner_of(kv: &kv::Store, partition: u32) -> Result<Option<String>, NatsError> {
    let entry = kv
        .entry(partition_key(partition))
        .await
        .map_err(|e| NatsError::js("reading a partition lease", e))?;
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    Ok(match entry {
        Some(e) if e.operation == Operation::Put => serde_json::from_slice::<LeaseRecord>(&e.value)
            .ok()
            .filter(|r| {
                let written_ms = e.created.unix_timestamp_nanos() / 1_000_000;
                !lapsed(written_ms, r.ttl_ms, now_ms as i128)
            })
            .map(|r| r.owner),
        _ => None,
    })
}

/// How far this host's clock may be from the server's before [`owner_of`]
/// takes a live lease for a lapsed one.
pub const CLOCK_ALLOWANCE_MS: u64 = 5_000;

/// Whether a lease written at `written_ms` with `ttl_ms` has lapsed at
/// `now_ms`, clocks up to [`CLOCK_ALLOWANCE_MS`] apart (a record without a
/// TTL lasts as long as the bucket keeps it).
fn lapsed(written_ms: i128, ttl_ms: Option<u64>, now_ms: i128) -> bool {
    ttl_ms.is_some_and(|ttl| now_ms - written_ms > i128::from(ttl + CLOCK_ALLOWANCE_MS))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_unrenewed_past_its_ttl_is_held_by_nobody() {
        let by = 10_000 + 2_000 + i128::from(CLOCK_ALLOWANCE_MS);
        assert!(!lapsed(10_000, Some(2_000), by));
        assert!(lapsed(10_000, Some(2_000), by + 1));
        // Written "after" now (clocks apart): still held.
        assert!(!lapsed(10_000, Some(2_000), 9_000));
        // Older versions' records: the bucket's max_age decides.
        assert!(!lapsed(10_000, None, 1_000_000));
    }

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
            ttl_ms: None,
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

    fn seen(revision: u64, owner: &str, ttl_ms: u64, since: Instant) -> Seen {
        Seen {
            revision,
            present: true,
            owner: Some(owner.to_string()),
            ttl: Duration::from_millis(ttl_ms),
            since,
            record: None,
        }
    }

    #[test]
    fn a_key_is_taken_over_only_after_its_writer_s_ttl_of_clean_observation() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        // Free keys are created; our own last value is ours to renew at once.
        assert_eq!(claim_for(None, "me", t0, t0), Some(Claim::Create));
        let mut deleted = seen(4, "other", 1_500, t0);
        deleted.present = false;
        assert_eq!(claim_for(Some(&deleted), "me", t0, t0), Some(Claim::Create));
        let mine = seen(5, "me", 1_500, t0);
        assert_eq!(
            claim_for(Some(&mine), "me", t0, t0),
            Some(Claim::Takeover(5))
        );
        // Someone else's: only once seen unchanged for its TTL.
        let theirs = seen(7, "other", 1_500, t0);
        assert_eq!(claim_for(Some(&theirs), "me", t0, t0 + ms(1_499)), None);
        assert_eq!(
            claim_for(Some(&theirs), "me", t0, t0 + ms(1_500)),
            Some(Claim::Takeover(7))
        );
        // A failure of our own (say at +1 s) restarts the clock.
        let clean = t0 + ms(1_000);
        assert_eq!(claim_for(Some(&theirs), "me", clean, t0 + ms(2_000)), None);
        assert_eq!(
            claim_for(Some(&theirs), "me", clean, t0 + ms(2_500)),
            Some(Claim::Takeover(7))
        );
        assert_eq!(stale_at(&theirs, clean), t0 + ms(2_500));
        // The writer's own TTL counts, not ours.
        let slow = seen(8, "old-version", 10_000, t0);
        assert_eq!(claim_for(Some(&slow), "me", t0, t0 + ms(9_999)), None);
    }

    #[test]
    fn a_newer_revision_restarts_the_clock_and_an_older_one_changes_nothing() {
        let t0 = Instant::now();
        let later = t0 + Duration::from_secs(1);
        let mut map: BTreeMap<u32, Seen> = BTreeMap::new();
        note(map.entry(3), seen(10, "a", 1_500, t0));
        // The same revision seen again (a read racing the watch): still t0.
        note(map.entry(3), seen(10, "a", 1_500, later));
        assert_eq!(map[&3].since, t0);
        // An older one (a late read): ignored.
        note(map.entry(3), seen(9, "b", 1_500, later));
        assert_eq!((map[&3].revision, map[&3].since), (10, t0));
        // A newer one: seen now.
        note(map.entry(3), seen(12, "b", 1_500, later));
        assert_eq!((map[&3].revision, map[&3].since), (12, later));
    }

    #[test]
    fn records_say_their_ttl_and_older_ones_still_decode() {
        let old: LeaseRecord = serde_json::from_str(r#"{"owner":"a-1"}"#).unwrap();
        assert_eq!(old.ttl_ms, None);
        let new = LeaseRecord {
            owner: "b-2".into(),
            ttl_ms: Some(1_500),
        };
        let json = serde_json::to_string(&new).unwrap();
        assert_eq!(json, r#"{"owner":"b-2","ttl_ms":1500}"#);
        assert_eq!(lease_owner(json.as_bytes()).as_deref(), Some("b-2"));
        let heartbeat: MemberRecord =
            serde_json::from_str(r#"{"member":"a-1","held":2,"ttl_ms":1500}"#).unwrap();
        assert_eq!(heartbeat.ttl_ms, Some(1_500));
    }

    #[test]
    fn default_timing_leaves_room_for_a_lost_request() {
        let s = LeaseSettings::from_config(&NatsConfig::default());
        assert_eq!(s.usable_for(), Duration::from_millis(1_000));
        assert_eq!(s.request_timeout(), Duration::from_millis(375));
        // A renewal round, one unanswered request and the next renewal fit
        // in the usable time.
        assert!(s.renew + s.request_timeout() + s.renew < s.usable_for());
    }

    #[tokio::test(start_paused = true)]
    async fn a_lapsed_lease_comes_back_only_by_a_renewal_and_a_revoked_one_never() {
        let settings = LeaseSettings {
            partitions: 1,
            ttl: Duration::from_millis(1_500),
            renew: Duration::from_millis(250),
            margin: Duration::from_millis(500),
        };
        let usable = settings.usable_for();
        let lease = Lease::new(0, 5, Instant::now() + usable);
        assert!(lease.still_held());
        assert_eq!(lease.fencing_token(), 5);
        assert_eq!(lease.renewed(9, Instant::now() + usable), Renewal::Extended);
        assert_eq!(lease.clones(), 1);
        assert_eq!((lease.revision(), lease.fencing_token()), (9, 5));
        tokio::time::advance(Duration::from_millis(1_001)).await;
        assert!(!lease.still_held() && !lease.is_gone());
        // lost() resolves once the time is up; regained() waits.
        tokio::time::timeout(Duration::from_millis(1), lease.lost())
            .await
            .unwrap();
        let waiter = {
            let l = lease.clone();
            tokio::spawn(async move { l.regained().await })
        };
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        // A renewal sent before the lapse but answered after its own
        // validity does not bring it back.
        let sent_long_ago = Instant::now() - usable;
        assert_eq!(lease.renewed(10, sent_long_ago + usable), Renewal::TooLate);
        assert!(!lease.still_held());
        // One that proved the key unchanged does: same tenure, same token.
        assert_eq!(lease.renewed(11, Instant::now() + usable), Renewal::Resumed);
        assert!(lease.still_held());
        assert_eq!((lease.revision(), lease.fencing_token()), (11, 5));
        assert!(waiter.await.unwrap());
        // Revoked (released or lost): never again, and regained() says so.
        lease.revoke();
        assert_eq!(lease.renewed(12, Instant::now() + usable), Renewal::Refused);
        assert!(!lease.still_held() && lease.is_gone());
        assert!(!lease.regained().await);
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
