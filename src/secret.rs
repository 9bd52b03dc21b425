//! Secrets in the configuration, and credentials inside URLs.
//!
//! A [`Secret`] is a string that is never shown: its `Debug` and its serde
//! serialization are `***`, so neither a `tracing` field, an error built
//! with `{:?}`, nor `contextfold config` can print it. The value itself is
//! reached only through [`Secret::expose`], at the one place that hands it
//! to a client library.
//!
//! URLs may carry credentials in their userinfo (`nats://user:pw@host`,
//! `nats://token@host`). [`split_userinfo`] takes them out (percent-decoded)
//! and returns the URL without them; [`redact_url`] is the form every
//! message prints: `nats://user:***@host`, `nats://***@host`. Both work on
//! the text alone, so a URL too broken to parse is still redacted.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// What a secret (or a URL's password or token) is shown as.
pub const REDACTED: &str = "***";

/// A string that is never printed or serialized (both give `***`).
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Secret {
        Secret(value.into())
    }

    /// The value itself, for the client library that needs it. Never
    /// format it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(REDACTED)
    }
}

impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(REDACTED)
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Secret, D::Error> {
        deserializer.deserialize_any(SecretVisitor)
    }
}

/// Takes strings only, and words every other error without the value (the
/// default serde message would quote a numeric password).
struct SecretVisitor;

impl SecretVisitor {
    fn refuse<E: serde::de::Error>(kind: &str) -> E {
        E::custom(format!(
            "a secret must be a string, got {kind} (value not shown); quote it"
        ))
    }
}

impl<'de> serde::de::Visitor<'de> for SecretVisitor {
    type Value = Secret;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string")
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Secret, E> {
        Ok(Secret::new(v))
    }

    fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Secret, E> {
        Ok(Secret(v))
    }

    fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<Secret, E> {
        Err(Self::refuse("a boolean"))
    }

    fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<Secret, E> {
        Err(Self::refuse("a number"))
    }

    fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<Secret, E> {
        Err(Self::refuse("a number"))
    }

    fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<Secret, E> {
        Err(Self::refuse("a number"))
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, _: A) -> Result<Secret, A::Error> {
        Err(Self::refuse("a list"))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, _: A) -> Result<Secret, A::Error> {
        Err(Self::refuse("a table"))
    }
}

/// Credentials found in a URL's userinfo, percent-decoded.
#[derive(Clone, PartialEq, Eq)]
pub enum UrlCredentials {
    /// `scheme://user:password@host`.
    UserPassword { user: String, password: Secret },
    /// `scheme://token@host` (a user without a password, which NATS
    /// clients read as a token).
    Token(Secret),
}

impl fmt::Debug for UrlCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UrlCredentials::UserPassword { user, .. } => write!(f, "user {user:?} with a password"),
            UrlCredentials::Token(_) => f.write_str("a token"),
        }
    }
}

/// Byte range of the userinfo (without its `@`) and of the whole
/// `userinfo@` in `url`, if it has one.
fn userinfo_span(url: &str) -> Option<(usize, usize)> {
    let start = url.find("://").map_or(0, |i| i + 3);
    let rest = &url[start..];
    let end = rest.find(['/', '?', '#']).map_or(url.len(), |i| start + i);
    let at = url[start..end].rfind('@')? + start;
    Some((start, at))
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok();
            if let Some(b) = hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The credentials in `url`'s userinfo (if any) and `url` without them.
pub fn split_userinfo(url: &str) -> (Option<UrlCredentials>, String) {
    let Some((start, at)) = userinfo_span(url) else {
        return (None, url.to_string());
    };
    let userinfo = &url[start..at];
    let stripped = format!("{}{}", &url[..start], &url[at + 1..]);
    let credentials = match userinfo.split_once(':') {
        Some((user, password)) => UrlCredentials::UserPassword {
            user: percent_decode(user),
            password: Secret(percent_decode(password)),
        },
        None => UrlCredentials::Token(Secret(percent_decode(userinfo))),
    };
    (Some(credentials), stripped)
}

/// `url` as it may be printed: a password becomes `***`
/// (`nats://user:***@host`), a user without a password (a token) too
/// (`nats://***@host`). A URL without userinfo is returned as is.
pub fn redact_url(url: &str) -> String {
    let Some((start, at)) = userinfo_span(url) else {
        return url.to_string();
    };
    let shown = match url[start..at].split_once(':') {
        Some((user, _)) => format!("{user}:{REDACTED}"),
        None => REDACTED.to_string(),
    };
    format!("{}{shown}{}", &url[..start], &url[at..])
}

/// Every URL of a list (entries may themselves be comma-separated), each
/// redacted, joined with `,`.
pub fn redact_urls<S: AsRef<str>>(urls: &[S]) -> String {
    urls.iter()
        .flat_map(|u| u.as_ref().split(','))
        .map(|u| redact_url(u.trim()))
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_is_never_shown() {
        let s = Secret::new("hunter2");
        assert_eq!(format!("{s:?}"), "***");
        assert_eq!(format!("{:?}", Some(s.clone())), "Some(***)");
        assert_eq!(serde_json::to_string(&s).unwrap(), "\"***\"");
        assert_eq!(s.expose(), "hunter2");
        let back: Secret = serde_json::from_str("\"hunter2\"").unwrap();
        assert_eq!(back, s);
    }

    #[test]
    fn a_secret_of_the_wrong_type_is_refused_without_its_value() {
        #[derive(Debug, Deserialize)]
        struct T {
            #[allow(dead_code)]
            password: Secret,
        }
        for text in ["password = 918273", "password = true", "password = 1.5"] {
            // As the config loader reads: the file into a table, then the table.
            let table: toml::Table = text.parse().unwrap();
            let err = toml::Value::Table(table)
                .try_into::<T>()
                .unwrap_err()
                .to_string();
            assert!(err.contains("quote it"), "{err}");
            assert!(!err.contains("918273"), "{err}");
        }
    }

    #[test]
    fn userinfo_is_split_and_percent_decoded() {
        let (c, url) = split_userinfo("nats://alice:p%40ss%3Aw0rd@127.0.0.1:4222");
        assert_eq!(url, "nats://127.0.0.1:4222");
        match c {
            Some(UrlCredentials::UserPassword { user, password }) => {
                assert_eq!(user, "alice");
                assert_eq!(password.expose(), "p@ss:w0rd");
            }
            other => panic!("{other:?}"),
        }
        let (c, url) = split_userinfo("tls://s3cr3t@host/x?y");
        assert_eq!(url, "tls://host/x?y");
        assert!(matches!(c, Some(UrlCredentials::Token(t)) if t.expose() == "s3cr3t"));
        let (c, url) = split_userinfo("bob:pw@host:4222");
        assert_eq!(url, "host:4222");
        assert!(matches!(c, Some(UrlCredentials::UserPassword { user, .. }) if user == "bob"));
        // An `@` after the authority is not userinfo.
        let (c, url) = split_userinfo("http://host/v1/a@b");
        assert!(c.is_none());
        assert_eq!(url, "http://host/v1/a@b");
        assert_eq!(split_userinfo("nats://host").0, None);
        assert_eq!(percent_decode("100%"), "100%");
        assert_eq!(percent_decode("%zz%41"), "%zzA");
    }

    #[test]
    fn printed_urls_carry_no_password_or_token() {
        assert_eq!(
            redact_url("nats://alice:hunter2@127.0.0.1:4222"),
            "nats://alice:***@127.0.0.1:4222"
        );
        assert_eq!(redact_url("nats://tok3n@host"), "nats://***@host");
        assert_eq!(
            redact_url("https://u:p@llm.internal/v1"),
            "https://u:***@llm.internal/v1"
        );
        assert_eq!(redact_url("nats://host:4222"), "nats://host:4222");
        assert_eq!(redact_url("u:p@host"), "u:***@host");
        assert_eq!(redact_url("http://[nope"), "http://[nope");
        assert_eq!(
            redact_urls(&["nats://a:x@h1,nats://h2", "tls://t@h3"]),
            "nats://a:***@h1,nats://h2,tls://***@h3"
        );
    }
}
