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
//! | `cf.in.<conv>` | where agents (and the service itself) publish events |
//! | `cf.ev.<partition>.<conv>` | the events stream's stored subject (a stream subject transform maps `cf.in.*` here) |
//! | `cf.job.<conv>` | compaction jobs (work-queue stream) |
//! | `cf.dead.<conv>` | jobs that failed too often, with the reason |
//! | `cf.api.<op>` | request/reply API, any process answers or forwards |
//! | `cf.api.p.<partition>.<op>` | the API served by the owner of a partition |

use crate::api::Op;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;

/// Longest conversation key accepted, in UTF-8 bytes. Its encoded token
/// (at most 1 + 4/3 of it) keeps a subject far below the server's default
/// 4 KiB control-line limit.
pub const MAX_CONVERSATION_KEY_BYTES: usize = 1024;

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

/// Whether `token` is `encode_conversation(conversation)`. The engine
/// decodes only canonical base64 (see [`decode_conversation`]), so a token
/// that decodes to the key is its one encoding.
fn is_token_of(token: &str, conversation: &str) -> bool {
    if conversation.is_empty() || conversation.len() > MAX_CONVERSATION_KEY_BYTES {
        return false;
    }
    if conversation.bytes().all(is_plain_byte) {
        return token == conversation;
    }
    let Some(encoded) = token.strip_prefix(ENCODED_MARKER) else {
        return false;
    };
    let mut key = [0u8; MAX_CONVERSATION_KEY_BYTES];
    matches!(
        URL_SAFE_NO_PAD.decode_slice(encoded, &mut key),
        Ok(n) if &key[..n] == conversation.as_bytes()
    )
}

/// The partition of a conversation token: FNV-1a (32-bit) of the token's
/// bytes modulo `partitions`, exactly what the server's
/// `{{partition(N,1)}}` mapping computes, so any client can tell which
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

    /// `cf.in.<conv>`: where a conversation's events are published.
    pub fn inbound(&self, conversation: &str) -> Result<String, SubjectError> {
        Ok(format!(
            "{}.in.{}",
            self.prefix,
            encode_conversation(conversation)?
        ))
    }

    /// `cf.in.*`: the events stream's subjects (and the transform source).
    pub fn inbound_wildcard(&self) -> String {
        format!("{}.in.*", self.prefix)
    }

    /// `cf.ev.{{partition(N,1)}}.{{wildcard(1)}}`: the events stream's
    /// subject transform destination.
    pub fn partition_transform_destination(&self, partitions: u32) -> String {
        format!(
            "{}.ev.{{{{partition({partitions},1)}}}}.{{{{wildcard(1)}}}}",
            self.prefix
        )
    }

    /// `cf.ev.<partition>.<conv>`: the subject a stored event has.
    pub fn event(&self, partition: u32, conversation: &str) -> Result<String, SubjectError> {
        Ok(format!(
            "{}.ev.{partition}.{}",
            self.prefix,
            encode_conversation(conversation)?
        ))
    }

    /// `cf.ev.<partition>.*`: a folder's consumer filter.
    pub fn partition_filter(&self, partition: u32) -> String {
        format!("{}.ev.{partition}.*", self.prefix)
    }

    /// `cf.ev.*.*`: every stored event.
    pub fn events_wildcard(&self) -> String {
        format!("{}.ev.*.*", self.prefix)
    }

    /// Partition and conversation of a stored event's subject.
    pub fn parse_event_subject(&self, subject: &str) -> Result<(u32, String), SubjectError> {
        let not_event = || SubjectError::NotAnEventSubject {
            subject: subject.chars().take(200).collect(),
            prefix: self.prefix.clone(),
        };
        let rest = subject
            .strip_prefix(self.prefix.as_str())
            .and_then(|r| r.strip_prefix(".ev."))
            .ok_or_else(not_event)?;
        let (partition, token) = rest.split_once('.').ok_or_else(not_event)?;
        let partition: u32 = partition.parse().map_err(|_| not_event())?;
        Ok((partition, decode_conversation(token)?))
    }

    /// Whether `subject` is the events subject of `conversation` in
    /// `partition`: what [`Self::parse_event_subject`] would confirm, without
    /// decoding the token or allocating (the folder asks it of every event).
    pub fn is_event_subject_of(&self, subject: &str, partition: u32, conversation: &str) -> bool {
        let Some(rest) = subject
            .strip_prefix(self.prefix.as_str())
            .and_then(|r| r.strip_prefix(".ev."))
        else {
            return false;
        };
        let Some((p, token)) = rest.split_once('.') else {
            return false;
        };
        p.parse::<u32>() == Ok(partition) && is_token_of(token, conversation)
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

    /// `cf.dead.*`: the dead-letter stream's subjects.
    pub fn dead_letters_wildcard(&self) -> String {
        format!("{}.dead.*", self.prefix)
    }

    /// `cf.api.<op>`: the public request/reply subject.
    pub fn api(&self, op: Op) -> String {
        format!("{}.api.{op}", self.prefix)
    }

    /// `cf.api.p.<partition>.<op>`: answered by the partition's owner.
    pub fn api_for_partition(&self, partition: u32, op: Op) -> String {
        format!("{}.api.p.{partition}.{op}", self.prefix)
    }

    /// `cf.api.*`: every public request/reply subject.
    pub fn api_wildcard(&self) -> String {
        format!("{}.api.*", self.prefix)
    }

    /// `cf.api.p.<partition>.*`: every subject a partition's owner answers.
    pub fn api_partition_wildcard(&self, partition: u32) -> String {
        format!("{}.api.p.{partition}.*", self.prefix)
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
        assert_eq!(s.inbound_wildcard(), "acme.cf.in.*");
        assert_eq!(
            s.partition_transform_destination(16),
            "acme.cf.ev.{{partition(16,1)}}.{{wildcard(1)}}"
        );
        assert_eq!(s.event(3, "x").unwrap(), "acme.cf.ev.3.x");
        assert_eq!(s.partition_filter(3), "acme.cf.ev.3.*");
        assert_eq!(s.api(Op::Assemble), "acme.cf.api.assemble");
        assert_eq!(s.api_for_partition(5, Op::Status), "acme.cf.api.p.5.status");
        assert_eq!(s.events_stream(), "ACME_CF_EVENTS");
        assert_eq!(s.lease_bucket(), "acme_cf_leases");
        assert_eq!(s.folder_consumer(2), "acme_cf_fold_2");
        for op in Op::ALL {
            assert_eq!(Op::parse(op.as_str()), Some(op));
            // The wildcards cover exactly the subjects they serve.
            let public = s.api(op);
            assert_eq!(
                public.rsplit_once('.').unwrap().0,
                s.api_wildcard().rsplit_once('.').unwrap().0
            );
            let owned = s.api_for_partition(7, op);
            assert_eq!(
                owned.rsplit_once('.').unwrap().0,
                s.api_partition_wildcard(7).rsplit_once('.').unwrap().0
            );
        }
    }

    #[test]
    fn event_subjects_parse_back() {
        let s = Subjects::new("cf").unwrap();
        let subject = s.event(11, "user/42: chat").unwrap();
        assert_eq!(
            s.parse_event_subject(&subject).unwrap(),
            (11, "user/42: chat".to_string())
        );
        for bad in [
            "cf.in.x",
            "cf.ev.x",
            "cf.ev.one.x",
            "other.ev.1.x",
            "cf.ev.1.a.b",
        ] {
            assert!(s.parse_event_subject(bad).is_err(), "{bad}");
        }
    }

    proptest! {
        #[test]
        fn any_key_round_trips_through_one_valid_token(key in "\\PC{1,64}|[A-Za-z0-9_-]{1,16}|[.:/ *>~]{1,8}") {
            let token = encode_conversation(&key).unwrap();
            prop_assert!(is_valid_literal_token(&token), "{:?} -> {:?}", key, token);
            prop_assert_eq!(decode_conversation(&token).unwrap(), key.clone());
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
                s.parse_event_subject(subject).ok() == Some((partition, conversation.to_string()))
            };
            let own = s.event(p, &key).unwrap();
            let candidates = [
                own.clone(),
                s.event(p, &other).unwrap(),
                format!("cf.ev.{p}.{token}"),
                format!("cf.ev.{p}.{key}"),
                own.replace("cf.ev.", "cf.in."),
                format!("{own}.x"),
            ];
            for subject in &candidates {
                for (conversation, partition) in [(&key, p), (&key, q), (&other, p)] {
                    prop_assert_eq!(
                        s.is_event_subject_of(subject, partition, conversation),
                        parsed_as(subject, conversation, partition),
                        "{:?} {:?} {}", subject, conversation, partition
                    );
                }
            }
            prop_assert!(s.is_event_subject_of(&own, p, &key));
        }

        #[test]
        fn partitions_are_in_range(token in "[A-Za-z0-9_~-]{1,40}", n in 1u32..1024) {
            prop_assert!(partition_of_token(&token, n) < n);
        }
    }
}
