//! Which reply subjects the API answers on (DESIGN.md invariant 13: replies
//! go only to inboxes).
//!
//! A requester names its reply subject, and a service user needs
//! `allow_responses` to answer across accounts (`_R_.…`), which lets it
//! publish once to whatever subject a request carries, past its own
//! publish permissions. So, unchecked, an agent that may publish only on
//! its own `cf.api.*.<token>` could make the service write a lease key
//! (`$KV.cf_leases.partitions.<p>`), a record in another conversation
//! (`cf.svc.<other>`), a new conversation (`cf.in.<any>`), a job
//! (`cf.job.<any>`) or a JetStream API call (`$JS.API.…`): neither a server
//! `deny` list nor dropping `allow_responses` stops it.
//!
//! The API therefore answers a request only when its reply subject lies
//! below one of the allowed prefixes ([`ReplyPolicy`]): client inboxes
//! (`_INBOX`, and the service connection's own `inbox_prefix`, on which
//! forwarded requests come back) and replies through imported services
//! (`_R_`), by default (`[nats] reply_prefixes`). Any other request is
//! refused before it is read: it gets no answer at all and changes nothing
//! (a `compact` stores no event); it is counted by [`ReplyFamily`] (a
//! closed set, the metric's label) and logged with the family, never with
//! more than a bounded, escaped start of the subject.
//!
//! An allowed prefix may not start with `$` (JetStream, KV, object store,
//! system subjects) nor cover or fall under the service's own subjects
//! (`<prefix>.…`): a configuration that would reopen the hole is refused
//! when it is read.

use crate::nats::subjects::Subjects;

/// The prefixes answered by default: client inboxes and replies through
/// service imports.
pub const DEFAULT_REPLY_PREFIXES: [&str; 2] = ["_INBOX", "_R_"];

/// What a refused reply subject is, as the refusal metric's label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyFamily {
    /// `$KV.…`: KV buckets (leases).
    Kv,
    /// `$O.…`: object stores (job snapshots).
    ObjectStore,
    /// `$JS.API.…`: JetStream API calls.
    JetStreamApi,
    /// Other `$JS.…` subjects (acknowledgements, flow control, events).
    JetStream,
    /// `$SYS.…`: the server's system account.
    System,
    /// Any other `$…` subject.
    Reserved,
    /// `<prefix>.in.…`: agents' inbound events.
    Inbound,
    /// `<prefix>.svc.…`: the service's events of a conversation.
    ServiceEvents,
    /// `<prefix>.ev.…`: stored events.
    Events,
    /// `<prefix>.job.…`: the compaction job queue.
    Jobs,
    /// `<prefix>.dead.…`: dead letters.
    DeadLetters,
    /// `<prefix>.api.…` and `<prefix>.admin.…`: requests.
    Api,
    /// Any other subject under the service's prefix.
    Service,
    /// Not a subject one may publish to (empty tokens, wildcards, spaces).
    Invalid,
    /// Anything else that is no allowed inbox.
    Other,
}

impl ReplyFamily {
    /// Every family, for tests and docs.
    pub const ALL: [ReplyFamily; 15] = [
        ReplyFamily::Kv,
        ReplyFamily::ObjectStore,
        ReplyFamily::JetStreamApi,
        ReplyFamily::JetStream,
        ReplyFamily::System,
        ReplyFamily::Reserved,
        ReplyFamily::Inbound,
        ReplyFamily::ServiceEvents,
        ReplyFamily::Events,
        ReplyFamily::Jobs,
        ReplyFamily::DeadLetters,
        ReplyFamily::Api,
        ReplyFamily::Service,
        ReplyFamily::Invalid,
        ReplyFamily::Other,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ReplyFamily::Kv => "kv",
            ReplyFamily::ObjectStore => "object_store",
            ReplyFamily::JetStreamApi => "jetstream_api",
            ReplyFamily::JetStream => "jetstream",
            ReplyFamily::System => "system",
            ReplyFamily::Reserved => "reserved",
            ReplyFamily::Inbound => "inbound",
            ReplyFamily::ServiceEvents => "service_events",
            ReplyFamily::Events => "events",
            ReplyFamily::Jobs => "jobs",
            ReplyFamily::DeadLetters => "dead_letters",
            ReplyFamily::Api => "api",
            ReplyFamily::Service => "service",
            ReplyFamily::Invalid => "invalid",
            ReplyFamily::Other => "other",
        }
    }

    /// The family of `subject` for a service under `subjects`' prefix.
    pub fn of(subject: &str, subjects: &Subjects) -> ReplyFamily {
        let publishable = subject.split('.').all(|t| {
            !t.is_empty()
                && t != "*"
                && t != ">"
                && t.bytes().all(|b| b.is_ascii_graphic() || b >= 0x80)
        });
        if !publishable {
            return ReplyFamily::Invalid;
        }
        if subject.starts_with('$') {
            return [
                ("$KV.", ReplyFamily::Kv),
                ("$O.", ReplyFamily::ObjectStore),
                ("$JS.API.", ReplyFamily::JetStreamApi),
                ("$JS.", ReplyFamily::JetStream),
                ("$SYS.", ReplyFamily::System),
            ]
            .into_iter()
            .find(|(p, _)| subject.starts_with(p))
            .map_or(ReplyFamily::Reserved, |(_, f)| f);
        }
        let Some(rest) = below(subject, subjects.prefix()) else {
            return ReplyFamily::Other;
        };
        let token = rest.split('.').next().unwrap_or_default();
        match token {
            "in" => ReplyFamily::Inbound,
            "svc" => ReplyFamily::ServiceEvents,
            "ev" => ReplyFamily::Events,
            "job" => ReplyFamily::Jobs,
            "dead" => ReplyFamily::DeadLetters,
            "api" | "admin" => ReplyFamily::Api,
            _ => ReplyFamily::Service,
        }
    }
}

/// What follows `prefix` and a `.` in `subject`, when `subject` lies below
/// the whole tokens of `prefix`.
fn below<'a>(subject: &'a str, prefix: &str) -> Option<&'a str> {
    subject
        .strip_prefix(prefix)
        .and_then(|r| r.strip_prefix('.'))
        .filter(|r| !r.is_empty())
}

/// Why an allowed reply prefix was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReplyPrefixError {
    #[error(
        "{0:?} is not a subject prefix: use `.`-separated tokens without spaces, `*` or `>` \
         (e.g. `_INBOX`)"
    )]
    NotAPrefix(String),
    #[error(
        "{0:?} starts with `$`: JetStream, KV, object-store and system subjects are never \
         replies; the service would write there on any requester's word"
    )]
    Reserved(String),
    #[error(
        "{prefix:?} overlaps the service's own subjects (`{service}.…`): a requester could make \
         the service publish events, jobs or requests there; use an inbox prefix such as `_INBOX`"
    )]
    Service { prefix: String, service: String },
}

/// The reply subjects the API answers on: below one of its prefixes
/// (whole tokens), and nothing else.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplyPolicy {
    prefixes: Vec<String>,
}

impl ReplyPolicy {
    /// `prefixes` (`_INBOX`, `_R_`; a trailing `.` is dropped) for a
    /// service whose subjects start with `service_prefix`.
    pub fn new<S: AsRef<str>>(
        prefixes: impl IntoIterator<Item = S>,
        service_prefix: &str,
    ) -> Result<ReplyPolicy, ReplyPrefixError> {
        let mut out: Vec<String> = Vec::new();
        for p in prefixes {
            let p = check_prefix(p.as_ref(), service_prefix)?;
            if !out.contains(&p) {
                out.push(p);
            }
        }
        Ok(ReplyPolicy { prefixes: out })
    }

    /// The defaults ([`DEFAULT_REPLY_PREFIXES`]) for `service_prefix`.
    pub fn default_for(service_prefix: &str) -> ReplyPolicy {
        ReplyPolicy {
            prefixes: DEFAULT_REPLY_PREFIXES
                .iter()
                .filter(|p| check_prefix(p, service_prefix).is_ok())
                .map(|p| p.to_string())
                .collect(),
        }
    }

    /// The allowed prefixes (without the trailing `.`).
    pub fn prefixes(&self) -> &[String] {
        &self.prefixes
    }

    /// Whether the API may answer on `reply`; else what it is.
    pub fn admit(&self, reply: &str, subjects: &Subjects) -> Result<(), ReplyFamily> {
        let family = ReplyFamily::of(reply, subjects);
        if family == ReplyFamily::Other && self.prefixes.iter().any(|p| below(reply, p).is_some()) {
            return Ok(());
        }
        Err(family)
    }
}

/// `prefix` without a trailing `.`, if it may be answered on.
fn check_prefix(prefix: &str, service_prefix: &str) -> Result<String, ReplyPrefixError> {
    let p = prefix.strip_suffix('.').unwrap_or(prefix);
    let valid = !p.is_empty()
        && p.split('.').all(|t| {
            !t.is_empty() && t != "*" && t != ">" && t.bytes().all(|b| b.is_ascii_graphic())
        })
        && !p.contains(['*', '>']);
    if !valid {
        return Err(ReplyPrefixError::NotAPrefix(prefix.to_string()));
    }
    if p.starts_with('$') {
        return Err(ReplyPrefixError::Reserved(prefix.to_string()));
    }
    let overlaps = |a: &str, b: &str| a == b || below(a, b).is_some();
    if overlaps(p, service_prefix) || overlaps(service_prefix, p) {
        return Err(ReplyPrefixError::Service {
            prefix: prefix.to_string(),
            service: service_prefix.to_string(),
        });
    }
    Ok(p.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cf() -> Subjects {
        Subjects::new("cf").unwrap()
    }

    #[test]
    fn inboxes_are_answered_and_every_family_of_the_issue_is_refused() {
        let policy = ReplyPolicy::default_for("cf");
        for ok in [
            "_INBOX.abc",
            "_INBOX.agent-1.x7.1",
            "_INBOX.cf-service.9.2",
            "_R_.aBc.DeF",
        ] {
            assert_eq!(policy.admit(ok, &cf()), Ok(()), "{ok}");
        }
        for (reply, family) in [
            ("$KV.cf_leases.members.fake-1", ReplyFamily::Kv),
            ("$KV.cf_leases.partitions.3", ReplyFamily::Kv),
            ("$O.cf_payloads.C.x", ReplyFamily::ObjectStore),
            ("$JS.API.STREAM.DELETE.CF_EVENTS", ReplyFamily::JetStreamApi),
            ("$JS.ACK.CF_JOBS.x.1.2.3.4.5.6", ReplyFamily::JetStream),
            ("$SYS.REQ.SERVER.PING", ReplyFamily::System),
            ("$G.x", ReplyFamily::Reserved),
            ("cf.in.phantom-1", ReplyFamily::Inbound),
            ("cf.svc.~dGVhbTphbHBoYQ", ReplyFamily::ServiceEvents),
            ("cf.ev.3.in.a", ReplyFamily::Events),
            ("cf.job.agent-1", ReplyFamily::Jobs),
            ("cf.dead.agent-1", ReplyFamily::DeadLetters),
            ("cf.api.status.agent-2", ReplyFamily::Api),
            ("cf.admin.status", ReplyFamily::Api),
            ("cf.other", ReplyFamily::Service),
            ("reports.daily", ReplyFamily::Other),
            // Not below `_INBOX` as whole tokens.
            ("_INBOXES.x", ReplyFamily::Other),
            ("_INBOX", ReplyFamily::Other),
            ("_INBOX.>", ReplyFamily::Invalid),
            ("_INBOX..a", ReplyFamily::Invalid),
            ("_INBOX.a b", ReplyFamily::Invalid),
        ] {
            assert_eq!(policy.admit(reply, &cf()), Err(family), "{reply}");
        }
        let labels: std::collections::BTreeSet<_> =
            ReplyFamily::ALL.iter().map(|f| f.as_str()).collect();
        assert_eq!(labels.len(), ReplyFamily::ALL.len());
    }

    #[test]
    fn configured_prefixes_are_whole_tokens_and_never_reserved_or_the_services() {
        let policy = ReplyPolicy::new(["_INBOX.", "replies.team-a"], "acme.cf").unwrap();
        assert_eq!(policy.prefixes(), ["_INBOX", "replies.team-a"]);
        let s = Subjects::new("acme.cf").unwrap();
        assert_eq!(policy.admit("replies.team-a.42", &s), Ok(()));
        assert_eq!(
            policy.admit("replies.team-b.42", &s),
            Err(ReplyFamily::Other)
        );
        assert_eq!(policy.admit("_R_.x", &s), Err(ReplyFamily::Other));
        for (bad, kind) in [
            ("$KV", "Reserved"),
            ("$JS.API", "Reserved"),
            ("acme", "Service"),
            ("acme.cf", "Service"),
            ("acme.cf.svc", "Service"),
            ("a.*", "NotAPrefix"),
            ("", "NotAPrefix"),
            ("a b", "NotAPrefix"),
        ] {
            let err = ReplyPolicy::new([bad], "acme.cf").unwrap_err();
            assert!(format!("{err:?}").starts_with(kind), "{bad}: {err:?}");
        }
        // A prefix merely sharing letters with the service's is fine.
        assert!(ReplyPolicy::new(["acme_inbox"], "acme.cf").is_ok());
    }
}
