//! Subject names, and the encoding of conversation keys into one subject
//! token. `docs/subjects.md` is the reference for client authors.
//!
//! # Conversation keys in subjects
//!
//! A conversation key may contain `:`, `/`, `.`, spaces, `*`, `>` or any
//! unicode, but a NATS subject token may contain none of `.`, whitespace or a
//! lone `*`/`>`, and non-ASCII is discouraged. A key becomes exactly one
//! token, computable in any language:
//!
//! - a key of 1 to [`MAX_CONVERSATION_KEY_BYTES`] bytes made only of
//!   `A-Z a-z 0-9 _ -` is its own token (`agent-7_main` -> `agent-7_main`);
//! - any other key is `~` followed by the unpadded base64url (RFC 4648 §5,
//!   alphabet `A-Z a-z 0-9 - _`) of its UTF-8 bytes
//!   (`agent:alpha` -> `~YWdlbnQ6YWxwaGE`).
//!
//! `~` cannot occur in a plain token, so the two forms never collide, and
//! each key has exactly one token: [`decode_conversation`] refuses a `~`
//! token whose key would have been sent plain, and non-canonical base64.
//! That matters because the partition is computed from the token: two tokens
//! for one conversation would split it over two partitions.
//!
//! # Subjects (prefix `cf` by default)
//!
//! | subject | what |
//! |---|---|
//! | `cf.in.<conv>` | where agents publish a conversation's events |
//! | `cf.svc.<conv>` | where the service publishes them (agents must not) |
//! | `cf.ev.<partition>.<in\|svc>.<conv>` | the events stream's stored subject (a stream subject transform maps `cf.in.*` and `cf.svc.*` here, keeping who published) |
//! | `cf.job.<conv>` | compaction jobs (work-queue stream) |
//! | `cf.dead.<conv>` | jobs that failed too often, with the reason |
//! | `cf.dead.partition.<p>` | records a partition refused with no conversation to count them against, and decisions it could not publish |
//! | `cf.api.<op>.<conv>` | request/reply API on one conversation; any process answers or forwards |
//! | `cf.admin.<op>` | operations on the whole service (global `status`) |
//! | `cf.api.p.<partition>.<op>.<conv>` | the API served by the owner of a partition |

use crate::api::Op;
use crate::core::event::Origin;
use crate::core::intake::Address;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;

pub use crate::core::intake::limits::MAX_CONVERSATION_KEY_BYTES;

/// Marks a base64url token; never part of a plain token.
pub const ENCODED_MARKER: char = '~';

/// Why a key, token, prefix or subject was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubjectError {
    #[error("conversation key is empty")]
    EmptyKey,
    #[error(
        "conversation key of {0} bytes is longer than the {MAX_CONVERSATION_KEY_BYTES}-byte limit"
    )]
    KeyTooLong(usize),
    #[error("subject token {token:?} is not a conversation token: {reason}")]
    BadToken { token: String, reason: &'static str },
    #[error(
        "subject prefix {0:?} is invalid: use dot-separated tokens of A-Z a-z 0-9 _ - (e.g. `cf` or `acme.cf`)"
    )]
    BadPrefix(String),
    #[error("subject {subject:?} is not an events subject under prefix {prefix:?}")]
    NotAnEventSubject { subject: String, prefix: String },
    #[error(
        "subject {subject:?} is not a request subject under prefix {prefix:?}: use \
         `{prefix}.api.<op>.<conversation token>` or `{prefix}.admin.status`"
    )]
    NotAnApiSubject { subject: String, prefix: String },
}

/// What a request subject says: the operation and, unless it is an admin
/// subject, the conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiSubject {
    pub op: String,
    pub conversation: Option<String>,
}

/// What a stored event's subject `cf.ev.<partition>.<in|svc>.<conv>` says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredSubject {
    pub partition: u32,
    /// `in`: an agent published it; `svc`: the service did.
    pub origin: Origin,
    pub conversation: String,
}

/// The subject token of an origin: agents publish to `in`, the service to
/// `svc`; the stream keeps the token in the stored subject.
fn origin_token(origin: Origin) -> &'static str {
    match origin {
        Origin::Agent => "in",
        Origin::Service | Origin::Legacy => "svc",
    }
}

fn origin_of_token(token: &str) -> Option<Origin> {
    match token {
        "in" => Some(Origin::Agent),
        "svc" => Some(Origin::Service),
        _ => None,
    }
}

fn is_plain_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b'-'
}

/// The one subject token for a conversation key (see the module docs).
pub fn encode_conversation(key: &str) -> Result<String, SubjectError> {
    if key.is_empty() {
        return Err(SubjectError::EmptyKey);
    }
    if key.len() > MAX_CONVERSATION_KEY_BYTES {
        return Err(SubjectError::KeyTooLong(key.len()));
    }
    if key.bytes().all(is_plain_byte) {
        return Ok(key.to_string());
    }
    let mut token = String::with_capacity(1 + key.len().div_ceil(3) * 4);
    token.push(ENCODED_MARKER);
    URL_SAFE_NO_PAD.encode_string(key.as_bytes(), &mut token);
    Ok(token)
}

/// The conversation key of a token made by [`encode_conversation`]; refuses
/// every other token, so `encode(decode(t)) == t` whenever decoding succeeds.
pub fn decode_conversation(token: &str) -> Result<String, SubjectError> {
    let bad = |reason| SubjectError::BadToken {
        token: token.chars().take(80).collect(),
        reason,
    };
    let Some(encoded) = token.strip_prefix(ENCODED_MARKER) else {
        if token.is_empty() {
            return Err(bad("empty token"));
        }
        if !token.bytes().all(is_plain_byte) {
            return Err(bad("plain tokens hold only A-Z a-z 0-9 _ -"));
        }
        if token.len() > MAX_CONVERSATION_KEY_BYTES {
            return Err(SubjectError::KeyTooLong(token.len()));
        }
        return Ok(token.to_string());
    };
    // The engine refuses padding and non-zero trailing bits, so each byte
    // string has exactly one accepted spelling.
    let bytes = URL_SAFE_NO_PAD
        .decode(encoded)
        .map_err(|_| bad("not canonical unpadded base64url after `~`"))?;
    let key = String::from_utf8(bytes).map_err(|_| bad("encoded key is not UTF-8"))?;
    if key.is_empty() {
        return Err(bad("encoded key is empty"));
    }
    if key.len() > MAX_CONVERSATION_KEY_BYTES {
        return Err(SubjectError::KeyTooLong(key.len()));
    }
    if key.bytes().all(is_plain_byte) {
        return Err(bad("this key is sent plain, not `~`-encoded"));
    }
    Ok(key)
}

/// The partition of a conversation token: FNV-1a (32-bit) of the token's
/// bytes modulo `partitions`, exactly what the server's
/// `{{partition(N,2)}}` mapping computes (over the token, its second
/// wildcard), so any client can tell which
/// partition (and so which owner) a conversation belongs to.
pub fn partition_of_token(token: &str, partitions: u32) -> u32 {
    const OFFSET: u32 = 0x811c_9dc5;
    const PRIME: u32 = 0x0100_0193;
    let hash = token
        .bytes()
        .fold(OFFSET, |h, b| (h ^ u32::from(b)).wrapping_mul(PRIME));
    hash % partitions.max(1)
}

/// The partition that owns a conversation, as the events stream computes it.
pub fn partition_of(conversation: &str, partitions: u32) -> Result<u32, SubjectError> {
    Ok(partition_of_token(
        &encode_conversation(conversation)?,
        partitions,
    ))
}

/// Checks a subject prefix: one or more `.`-separated tokens of
/// `A-Z a-z 0-9 _ -`.
pub fn validate_prefix(prefix: &str) -> Result<(), SubjectError> {
    let ok = !prefix.is_empty()
        && prefix
            .split('.')
            .all(|t| !t.is_empty() && t.bytes().all(is_plain_byte));
    if ok {
        Ok(())
    } else {
        Err(SubjectError::BadPrefix(prefix.to_string()))
    }
}

/// Every subject and JetStream resource name under one prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subjects {
    prefix: String,
    /// Stream/bucket name stem: the prefix upper-cased, `.` -> `_`.
    stem: String,
}

impl Subjects {
    pub fn new(prefix: &str) -> Result<Subjects, SubjectError> {
        validate_prefix(prefix)?;
        Ok(Subjects {
            prefix: prefix.to_string(),
            stem: prefix.replace('.', "_"),
        })
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// `cf.in.<conv>`: where agents publish a conversation's events.
    pub fn inbound(&self, conversation: &str) -> Result<String, SubjectError> {
        self.publish(Origin::Agent, conversation)
    }

    /// `cf.svc.<conv>`: where the service publishes a conversation's events
    /// (decisions, summaries, rolling state, sweep ends, compactions asked
    /// through the API). Agents must not be permitted to publish here.
    pub fn service(&self, conversation: &str) -> Result<String, SubjectError> {
        self.publish(Origin::Service, conversation)
    }

    /// The subject `origin` publishes a conversation's events to.
    pub fn publish(&self, origin: Origin, conversation: &str) -> Result<String, SubjectError> {
        Ok(format!(
            "{}.{}.{}",
            self.prefix,
            origin_token(origin),
            encode_conversation(conversation)?
        ))
    }

    /// `cf.in.*`: every agent's inbound subject.
    pub fn inbound_wildcard(&self) -> String {
        format!("{}.in.*", self.prefix)
    }

    /// `cf.svc.*`: every service subject.
    pub fn service_wildcard(&self) -> String {
        format!("{}.svc.*", self.prefix)
    }

    /// The events stream's subjects: `cf.in.*` and `cf.svc.*`.
    pub fn events_stream_subjects(&self) -> Vec<String> {
        vec![self.inbound_wildcard(), self.service_wildcard()]
    }

    /// `cf.*.*`: the source of the events stream's subject transform (it
    /// sees only what the stream's subjects capture).
    pub fn partition_transform_source(&self) -> String {
        format!("{}.*.*", self.prefix)
    }

    /// `cf.ev.{{partition(N,2)}}.{{wildcard(1)}}.{{wildcard(2)}}`: the events
    /// stream's subject transform destination. The partition is the hash of
    /// the conversation token alone, so agents' and the service's events of
    /// a conversation share a partition and one order.
    pub fn partition_transform_destination(&self, partitions: u32) -> String {
        format!(
            "{}.ev.{{{{partition({partitions},2)}}}}.{{{{wildcard(1)}}}}.{{{{wildcard(2)}}}}",
            self.prefix
        )
    }

    /// `cf.ev.<partition>.<in|svc>.<conv>`: the subject a stored event has.
    pub fn event(
        &self,
        partition: u32,
        origin: Origin,
        conversation: &str,
    ) -> Result<String, SubjectError> {
        Ok(format!(
            "{}.ev.{partition}.{}.{}",
            self.prefix,
            origin_token(origin),
            encode_conversation(conversation)?
        ))
    }

    /// `cf.ev.<partition>.*.*`: a folder's consumer filter.
    pub fn partition_filter(&self, partition: u32) -> String {
        format!("{}.ev.{partition}.*.*", self.prefix)
    }

    /// `cf.ev.*.*.*`: every stored event.
    pub fn events_wildcard(&self) -> String {
        format!("{}.ev.*.*.*", self.prefix)
    }

    /// Partition, origin and conversation of a stored event's subject.
    pub fn parse_event_subject(&self, subject: &str) -> Result<StoredSubject, SubjectError> {
        let not_event = || SubjectError::NotAnEventSubject {
            subject: subject.chars().take(200).collect(),
            prefix: self.prefix.clone(),
        };
        let rest = subject
            .strip_prefix(self.prefix.as_str())
            .and_then(|r| r.strip_prefix(".ev."))
            .ok_or_else(not_event)?;
        let mut parts = rest.splitn(3, '.');
        let (Some(partition), Some(origin), Some(token)) =
            (parts.next(), parts.next(), parts.next())
        else {
            return Err(not_event());
        };
        let partition: u32 = partition.parse().map_err(|_| not_event())?;
        let origin = origin_of_token(origin).ok_or_else(not_event)?;
        Ok(StoredSubject {
            partition,
            origin,
            conversation: decode_conversation(token)?,
        })
    }

    /// Who published a stored message and which conversation its subject
    /// names, as intake needs them. A subject that is not a stored event
    /// subject (of `partition`, when given) names no conversation, and
    /// gives no more than an agent's rights.
    pub fn stored_routing(&self, subject: &str, partition: Option<u32>) -> (Origin, Address) {
        match self.parse_event_subject(subject) {
            Ok(stored) if partition.is_none_or(|p| p == stored.partition) => {
                (stored.origin, Address::Conversation(stored.conversation))
            }
            Ok(stored) => (
                Origin::Agent,
                Address::Unroutable(format!(
                    "stored under partition {}, not {}",
                    stored.partition,
                    partition.unwrap_or_default()
                )),
            ),
            Err(e) => (Origin::Agent, Address::Unroutable(e.to_string())),
        }
    }

    /// `cf.job.<conv>`: a conversation's compaction job.
    pub fn job(&self, conversation: &str) -> Result<String, SubjectError> {
        Ok(format!(
            "{}.job.{}",
            self.prefix,
            encode_conversation(conversation)?
        ))
    }

    /// `cf.job.*`: the job stream's subjects.
    pub fn jobs_wildcard(&self) -> String {
        format!("{}.job.*", self.prefix)
    }

    /// `cf.dead.<conv>`: a dead-lettered job of a conversation.
    pub fn dead_letter(&self, conversation: &str) -> Result<String, SubjectError> {
        Ok(format!(
            "{}.dead.{}",
            self.prefix,
            encode_conversation(conversation)?
        ))
    }

    /// `cf.dead.partition.<p>`: records partition `p` refused without a
    /// conversation to count them against (a subject that names none),
    /// and decisions it could not publish, with the reason.
    pub fn partition_dead_letter(&self, partition: u32) -> String {
        format!("{}.dead.partition.{partition}", self.prefix)
    }

    /// The dead-letter stream's subjects: `cf.dead.*` (jobs) and
    /// `cf.dead.partition.*` (records).
    pub fn dead_letter_stream_subjects(&self) -> Vec<String> {
        vec![
            format!("{}.dead.*", self.prefix),
            format!("{}.dead.partition.*", self.prefix),
        ]
    }

    /// `cf.api.<op>.<conv>`: the request/reply subject of an operation on
    /// one conversation. Permissions on it (e.g. an agent may request only
    /// `cf.api.*.<its token>`) scope reads and compactions.
    pub fn api(&self, op: Op, conversation: &str) -> Result<String, SubjectError> {
        Ok(format!(
            "{}.api.{op}.{}",
            self.prefix,
            encode_conversation(conversation)?
        ))
    }

    /// `cf.api.*.*`: every conversation-scoped request subject.
    pub fn api_wildcard(&self) -> String {
        format!("{}.api.*.*", self.prefix)
    }

    /// `cf.admin.<op>`: operations on the whole service (global `status`),
    /// for operators only.
    pub fn admin(&self, op: Op) -> String {
        format!("{}.admin.{op}", self.prefix)
    }

    /// `cf.admin.*`: every admin subject.
    pub fn admin_wildcard(&self) -> String {
        format!("{}.admin.*", self.prefix)
    }

    /// `cf.api.p.<partition>.<op>.<conv>`: answered by the partition's
    /// owner; only the service forwards here.
    pub fn api_for_partition(
        &self,
        partition: u32,
        op: Op,
        conversation: &str,
    ) -> Result<String, SubjectError> {
        Ok(format!(
            "{}.api.p.{partition}.{op}.{}",
            self.prefix,
            encode_conversation(conversation)?
        ))
    }

    /// `cf.api.p.<partition>.*.*`: every subject a partition's owner answers.
    pub fn api_partition_wildcard(&self, partition: u32) -> String {
        format!("{}.api.p.{partition}.*.*", self.prefix)
    }

    /// `cf.api.p.<partition>.status.~`: the partition's own status (its
    /// conversations' totals and its health), answered by its owner; what
    /// `cf.admin.status` gathers from the processes that hold the
    /// partitions its own process does not. `~` alone is the token of the
    /// empty key, which is no conversation's.
    pub fn partition_status(&self, partition: u32) -> String {
        format!("{}.api.p.{partition}.status.{ENCODED_MARKER}", self.prefix)
    }

    /// The partition a [`Subjects::partition_status`] subject asks about.
    pub fn parse_partition_status(&self, subject: &str) -> Option<u32> {
        subject
            .strip_prefix(self.prefix.as_str())?
            .strip_prefix(".api.p.")?
            .strip_suffix(&format!(".status.{ENCODED_MARKER}"))?
            .parse()
            .ok()
    }

    /// The operation and target of a request subject (any of the three
    /// forms above).
    pub fn parse_api_subject(&self, subject: &str) -> Result<ApiSubject, SubjectError> {
        let not_api = || SubjectError::NotAnApiSubject {
            subject: subject.chars().take(200).collect(),
            prefix: self.prefix.clone(),
        };
        let rest = subject
            .strip_prefix(self.prefix.as_str())
            .and_then(|r| r.strip_prefix('.'))
            .ok_or_else(not_api)?;
        if let Some(op) = rest.strip_prefix("admin.") {
            if op.contains('.') {
                return Err(not_api());
            }
            return Ok(ApiSubject {
                op: op.to_string(),
                conversation: None,
            });
        }
        let rest = rest.strip_prefix("api.").ok_or_else(not_api)?;
        let rest = match rest.strip_prefix("p.") {
            Some(forwarded) => forwarded.split_once('.').ok_or_else(not_api)?.1,
            None => rest,
        };
        let (op, token) = rest.split_once('.').ok_or_else(not_api)?;
        if token.contains('.') {
            return Err(not_api());
        }
        Ok(ApiSubject {
            op: op.to_string(),
            conversation: Some(decode_conversation(token)?),
        })
    }

    /// Events stream name (`CF_EVENTS`).
    pub fn events_stream(&self) -> String {
        format!("{}_EVENTS", self.stem.to_ascii_uppercase())
    }

    /// Compaction job work-queue stream name (`CF_JOBS`).
    pub fn jobs_stream(&self) -> String {
        format!("{}_JOBS", self.stem.to_ascii_uppercase())
    }

    /// Dead-letter stream name (`CF_DEAD`).
    pub fn dead_letter_stream(&self) -> String {
        format!("{}_DEAD", self.stem.to_ascii_uppercase())
    }

    /// Partition lease KV bucket (`cf_leases`).
    pub fn lease_bucket(&self) -> String {
        format!("{}_leases", self.stem)
    }

    /// Large-payload object store bucket (`cf_payloads`).
    pub fn payload_bucket(&self) -> String {
        format!("{}_payloads", self.stem)
    }

    /// Durable consumer of a partition's folder (`cf_fold_3`).
    pub fn folder_consumer(&self, partition: u32) -> String {
        format!("{}_fold_{partition}", self.stem)
    }

    /// Durable consumer shared by all summarizers (`cf_summarizers`).
    pub fn summarizer_consumer(&self) -> String {
        format!("{}_summarizers", self.stem)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// What the NATS server accepts as one literal token, and what the
    /// docs recommend (printable ASCII).
    fn is_valid_literal_token(t: &str) -> bool {
        !t.is_empty()
            && t != "*"
            && t != ">"
            && t.bytes()
                .all(|b| b.is_ascii_graphic() && b != b'.' && b != b'*' && b != b'>')
    }

    #[test]
    fn partition_of_follows_the_token_hash() {
        let key = "team:alpha/session 1";
        let token = encode_conversation(key).unwrap();
        assert_eq!(
            partition_of(key, 16).unwrap(),
            partition_of_token(&token, 16)
        );
        assert!(partition_of("", 16).is_err());
    }

    #[test]
    fn plain_keys_pass_unchanged() {
        for key in ["agent-7_main", "A", "0", "session_42"] {
            assert_eq!(encode_conversation(key).unwrap(), key);
            assert_eq!(decode_conversation(key).unwrap(), key);
        }
    }

    #[test]
    fn other_keys_are_marked_base64url() {
        assert_eq!(
            encode_conversation("agent:alpha").unwrap(),
            "~YWdlbnQ6YWxwaGE"
        );
        assert_eq!(encode_conversation("a.b").unwrap(), "~YS5i");
        for key in ["a b", "x/y", "*", ">", "日本", "a.b.c", "~", "x~y"] {
            let token = encode_conversation(key).unwrap();
            assert!(token.starts_with('~'), "{key} -> {token}");
            assert!(is_valid_literal_token(&token), "{key} -> {token}");
            assert_eq!(decode_conversation(&token).unwrap(), key);
        }
    }

    #[test]
    fn non_canonical_tokens_are_refused() {
        // "abc" travels plain, so its encoded spelling must not decode.
        let encoded_plain = format!("~{}", URL_SAFE_NO_PAD.encode("abc"));
        assert!(decode_conversation(&encoded_plain).is_err());
        // Padding, trailing bits, foreign characters, empty.
        for bad in ["~YS5i=", "~YS5", "~YS+i", "", "~", "a.b", "a b", "a:b"] {
            assert!(decode_conversation(bad).is_err(), "{bad:?} decoded");
        }
        // "~YS5" differs from "~YS4" only in the unused trailing bits of
        // its last symbol: accepting it would give "a." two tokens.
        assert_eq!(decode_conversation("~YS4").unwrap(), "a.");
    }

    #[test]
    fn empty_and_oversized_keys_are_refused() {
        assert_eq!(encode_conversation(""), Err(SubjectError::EmptyKey));
        let long = "x".repeat(MAX_CONVERSATION_KEY_BYTES + 1);
        assert!(matches!(
            encode_conversation(&long),
            Err(SubjectError::KeyTooLong(_))
        ));
        assert!(encode_conversation(&"x".repeat(MAX_CONVERSATION_KEY_BYTES)).is_ok());
    }

    #[test]
    fn fnv1a_matches_reference_vectors() {
        // Published FNV-1a 32-bit test vectors.
        assert_eq!(partition_of_token("", u32::MAX), 0x811c_9dc5);
        assert_eq!(partition_of_token("a", u32::MAX), 0xe40c_292c);
        assert_eq!(partition_of_token("foobar", u32::MAX), 0xbf9c_f968);
    }

    #[test]
    fn prefixes_are_validated() {
        for ok in ["cf", "acme.cf", "a-b_c.d9"] {
            assert!(Subjects::new(ok).is_ok(), "{ok}");
        }
        for bad in ["", ".cf", "cf.", "c f", "cf.*", "cf.>", "a..b", "ünï"] {
            assert!(Subjects::new(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn names_follow_the_prefix() {
        let s = Subjects::new("acme.cf").unwrap();
        assert_eq!(
            s.inbound("agent:alpha").unwrap(),
            "acme.cf.in.~YWdlbnQ6YWxwaGE"
        );
        assert_eq!(s.service("x").unwrap(), "acme.cf.svc.x");
        assert_eq!(
            s.events_stream_subjects(),
            ["acme.cf.in.*", "acme.cf.svc.*"]
        );
        assert_eq!(s.partition_transform_source(), "acme.cf.*.*");
        assert_eq!(
            s.partition_transform_destination(16),
            "acme.cf.ev.{{partition(16,2)}}.{{wildcard(1)}}.{{wildcard(2)}}"
        );
        assert_eq!(s.event(3, Origin::Agent, "x").unwrap(), "acme.cf.ev.3.in.x");
        assert_eq!(
            s.event(3, Origin::Service, "x").unwrap(),
            "acme.cf.ev.3.svc.x"
        );
        assert_eq!(s.partition_filter(3), "acme.cf.ev.3.*.*");
        assert_eq!(
            s.api(Op::Assemble, "a:b").unwrap(),
            "acme.cf.api.assemble.~YTpi"
        );
        assert_eq!(s.admin(Op::Status), "acme.cf.admin.status");
        assert_eq!(s.partition_status(7), "acme.cf.api.p.7.status.~");
        assert_eq!(s.parse_partition_status(&s.partition_status(7)), Some(7));
        assert_eq!(s.parse_partition_status("acme.cf.api.p.7.status.abc"), None);
        assert_eq!(s.parse_partition_status("acme.cf.api.p.x.status.~"), None);
        assert_eq!(
            s.api_for_partition(5, Op::Status, "x").unwrap(),
            "acme.cf.api.p.5.status.x"
        );
        assert_eq!(s.partition_dead_letter(4), "acme.cf.dead.partition.4");
        assert_eq!(s.events_stream(), "ACME_CF_EVENTS");
        assert_eq!(s.lease_bucket(), "acme_cf_leases");
        assert_eq!(s.folder_consumer(2), "acme_cf_fold_2");
        let covered = |subject: &str, wildcard: &str| {
            let (a, b): (Vec<_>, Vec<_>) =
                (subject.split('.').collect(), wildcard.split('.').collect());
            a.len() == b.len() && a.iter().zip(&b).all(|(x, w)| w == &"*" || x == w)
        };
        for &op in Op::ALL {
            assert_eq!(Op::parse(op.as_str()), Some(op));
            // The wildcards cover exactly the subjects they serve, and the
            // subjects parse back.
            let public = s.api(op, "agent:alpha").unwrap();
            assert!(covered(&public, &s.api_wildcard()), "{public}");
            let owned = s.api_for_partition(7, op, "agent:alpha").unwrap();
            assert!(covered(&owned, &s.api_partition_wildcard(7)), "{owned}");
            assert!(!covered(&owned, &s.api_wildcard()), "{owned}");
            for subject in [public, owned] {
                assert_eq!(
                    s.parse_api_subject(&subject).unwrap(),
                    ApiSubject {
                        op: op.as_str().into(),
                        conversation: Some("agent:alpha".into())
                    }
                );
            }
            let admin = s.admin(op);
            assert!(covered(&admin, &s.admin_wildcard()));
            assert_eq!(s.parse_api_subject(&admin).unwrap().conversation, None);
        }
        for bad in [
            "acme.cf.api.status",
            "acme.cf.api.status.~!",
            "acme.cf.admin.status.x",
            "acme.cf.api.p.3",
            "other.api.status.x",
        ] {
            assert!(s.parse_api_subject(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_stored_subject_gives_origin_and_conversation() {
        let s = Subjects::new("cf").unwrap();
        assert_eq!(
            s.stored_routing(&s.event(3, Origin::Agent, "agent:a").unwrap(), Some(3)),
            (Origin::Agent, Address::Conversation("agent:a".into()))
        );
        assert_eq!(
            s.stored_routing(&s.event(3, Origin::Service, "x").unwrap(), None),
            (Origin::Service, Address::Conversation("x".into()))
        );
        // Another partition's, a malformed token, a non-canonical spelling:
        // no conversation, and only an agent's rights.
        for subject in [
            s.event(4, Origin::Service, "x").unwrap(),
            "cf.ev.3.svc.~!!".to_string(),
            "cf.ev.3.svc.~YWJj".to_string(),
            "cf.ev.3.abc".to_string(),
        ] {
            let (origin, address) = s.stored_routing(&subject, Some(3));
            assert_eq!(origin, Origin::Agent, "{subject}");
            assert!(matches!(address, Address::Unroutable(_)), "{subject}");
        }
    }

    #[test]
    fn event_subjects_parse_back() {
        let s = Subjects::new("cf").unwrap();
        for origin in [Origin::Agent, Origin::Service] {
            let subject = s.event(11, origin, "user/42: chat").unwrap();
            assert_eq!(
                s.parse_event_subject(&subject).unwrap(),
                StoredSubject {
                    partition: 11,
                    origin,
                    conversation: "user/42: chat".to_string()
                }
            );
        }
        for bad in [
            "cf.in.x",
            "cf.ev.x",
            "cf.ev.1.x",
            "cf.ev.one.in.x",
            "other.ev.1.in.x",
            "cf.ev.1.in.a.b",
            "cf.ev.1.out.a",
        ] {
            assert!(s.parse_event_subject(bad).is_err(), "{bad}");
        }
    }

    proptest! {
        #[test]
        fn any_key_round_trips_through_one_valid_token(key in "\\PC{1,64}|[A-Za-z0-9_-]{1,16}|[.:/ *>~]{1,8}") {
            let token = encode_conversation(&key).unwrap();
            prop_assert!(is_valid_literal_token(&token), "{:?} -> {:?}", key, token);
            prop_assert_eq!(decode_conversation(&token).unwrap(), key.as_str());
            let s = Subjects::new("cf").unwrap();
            let subject = s.inbound(&key).unwrap();
            prop_assert_eq!(subject.split('.').count(), 3);
        }

        #[test]
        fn arbitrary_bytes_round_trip(bytes in proptest::collection::vec(any::<u8>(), 1..64)) {
            let key = String::from_utf8_lossy(&bytes).into_owned();
            let token = encode_conversation(&key).unwrap();
            prop_assert_eq!(decode_conversation(&token).unwrap(), key);
        }

        #[test]
        fn decoding_accepts_only_canonical_tokens(token in "~?[A-Za-z0-9_=+/.-]{0,24}") {
            if let Ok(key) = decode_conversation(&token) {
                prop_assert_eq!(encode_conversation(&key).unwrap(), token);
            }
        }

        #[test]
        fn the_subject_check_agrees_with_parsing(
            key in "\\PC{1,12}|[A-Za-z0-9_-]{1,8}|[.:/ ~]{1,4}",
            other in "\\PC{1,12}|[A-Za-z0-9_-]{1,8}",
            token in "~?[A-Za-z0-9_=+/.-]{0,16}",
            p in 0u32..4,
            q in 0u32..4,
        ) {
            let s = Subjects::new("cf").unwrap();
            let parsed_as = |subject: &str, conversation: &str, partition: u32| {
                s.parse_event_subject(subject)
                    .ok()
                    .filter(|st| st.partition == partition && st.conversation == conversation)
                    .map(|st| st.origin)
            };
            let own = s.event(p, Origin::Agent, &key).unwrap();
            let candidates = [
                own.clone(),
                s.event(p, Origin::Service, &key).unwrap(),
                s.event(p, Origin::Agent, &other).unwrap(),
                format!("cf.ev.{p}.in.{token}"),
                format!("cf.ev.{p}.svc.{key}"),
                format!("cf.ev.{p}.{key}"),
                own.replace("cf.ev.", "cf.in."),
                own.replace(".in.", ".xx."),
                format!("{own}.x"),
            ];
            // What the folder gets for a message: the origin, when the
            // subject is this conversation's in this partition.
            let routed = |subject: &str, partition: u32, conversation: &str| {
                match s.stored_routing(subject, Some(partition)) {
                    (origin, Address::Conversation(c)) if c == conversation => Some(origin),
                    _ => None,
                }
            };
            for subject in &candidates {
                for (conversation, partition) in [(&key, p), (&key, q), (&other, p)] {
                    prop_assert_eq!(
                        routed(subject, partition, conversation),
                        parsed_as(subject, conversation, partition),
                        "{:?} {:?} {}", subject, conversation, partition
                    );
                }
            }
            prop_assert_eq!(routed(&own, p, &key), Some(Origin::Agent));
        }

        #[test]
        fn partitions_are_in_range(token in "[A-Za-z0-9_~-]{1,40}", n in 1u32..1024) {
            prop_assert!(partition_of_token(&token, n) < n);
        }
    }
}
