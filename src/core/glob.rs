//! Session-key globs: which conversations a rule (threshold override,
//! ignore, stateless) applies to.
//!
//! A session key is a list of segments separated by `:` (`agent:main:cron:42`).
//! In a glob, `**` as a whole segment matches any number of segments,
//! including none; `*` matches any run of characters other than `:` (so a
//! whole-segment `*` is exactly one segment, and `agent:*-test` matches
//! `agent:unit-test`); everything else is literal. When several globs match,
//! the caller takes the one with the greatest [`SessionGlob::specificity`].

use std::fmt;
use thiserror::Error;

/// Why a glob was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum GlobError {
    #[error("empty session glob: write `**` to match every session key")]
    Empty,
    #[error(
        "session glob {glob:?}: `**` must be a whole segment (as in `agent:**` or `**:cron`); \
         use `*` to match part of a segment"
    )]
    DoubleStarInSegment { glob: String },
}

/// One segment of a glob.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    /// `**`: any number of whole segments.
    AnyDepth,
    /// Literal pieces between `*` wildcards. `["agent", "-test"]` for
    /// `agent*-test`; one piece means no wildcard.
    Pieces(Vec<String>),
}

/// A parsed session-key glob. In configuration it is its text: it is
/// parsed once, when the configuration is read (a bad glob is reported
/// there), and written back as written.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct SessionGlob {
    source: String,
    segments: Vec<Segment>,
}

impl SessionGlob {
    pub fn parse(glob: &str) -> Result<SessionGlob, GlobError> {
        if glob.is_empty() {
            return Err(GlobError::Empty);
        }
        let mut segments = Vec::new();
        for part in glob.split(':') {
            if part == "**" {
                // `a:**:**:b` means the same as `a:**:b`.
                if segments.last() != Some(&Segment::AnyDepth) {
                    segments.push(Segment::AnyDepth);
                }
            } else if part.contains("**") {
                return Err(GlobError::DoubleStarInSegment {
                    glob: glob.to_string(),
                });
            } else {
                segments.push(Segment::Pieces(
                    part.split('*').map(str::to_string).collect(),
                ));
            }
        }
        Ok(SessionGlob {
            source: glob.to_string(),
            segments,
        })
    }

    /// The glob as written.
    pub fn as_str(&self) -> &str {
        &self.source
    }

    /// Does the session key match?
    pub fn matches(&self, key: &str) -> bool {
        let parts: Vec<&str> = key.split(':').collect();
        // reachable[j]: the glob segments seen so far can consume exactly
        // the first j key segments. O(glob segments x key segments).
        let mut reachable = vec![false; parts.len() + 1];
        reachable[0] = true;
        for segment in &self.segments {
            let mut next = vec![false; parts.len() + 1];
            match segment {
                Segment::AnyDepth => {
                    let mut any = false;
                    for j in 0..=parts.len() {
                        any |= reachable[j];
                        next[j] = any;
                    }
                }
                Segment::Pieces(pieces) => {
                    for j in 0..parts.len() {
                        if reachable[j] && pieces_match(pieces, parts[j]) {
                            next[j + 1] = true;
                        }
                    }
                }
            }
            reachable = next;
            if !reachable.iter().any(|&r| r) {
                return false;
            }
        }
        reachable[parts.len()]
    }

    /// How specific the glob is; compare with `>`: the greater wins.
    ///
    /// In order: more literal characters (separators excluded), then fewer
    /// `**`, then fewer `*`. A glob without wildcards is more specific than
    /// any glob that can match the same key.
    pub fn specificity(&self) -> (u32, u32, u32) {
        let mut literal = 0u32;
        let mut any_depth = 0u32;
        let mut stars = 0u32;
        for segment in &self.segments {
            match segment {
                Segment::AnyDepth => any_depth += 1,
                Segment::Pieces(pieces) => {
                    stars += pieces.len().saturating_sub(1) as u32;
                    for piece in pieces {
                        literal = literal.saturating_add(piece.chars().count() as u32);
                    }
                }
            }
        }
        (literal, u32::MAX - any_depth, u32::MAX - stars)
    }
}

impl fmt::Display for SessionGlob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.source)
    }
}

impl TryFrom<String> for SessionGlob {
    type Error = GlobError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        SessionGlob::parse(&s)
    }
}

impl From<SessionGlob> for String {
    fn from(glob: SessionGlob) -> String {
        glob.source
    }
}

impl std::str::FromStr for SessionGlob {
    type Err = GlobError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        SessionGlob::parse(s)
    }
}

/// Does one key segment match literal pieces separated by `*` wildcards?
fn pieces_match(pieces: &[String], segment: &str) -> bool {
    let (first, rest) = match pieces.split_first() {
        Some(split) => split,
        None => return segment.is_empty(),
    };
    let Some(after_first) = segment.strip_prefix(first.as_str()) else {
        return false;
    };
    let Some((last, middle)) = rest.split_last() else {
        return after_first.is_empty();
    };
    if after_first.len() < last.len() || !after_first.ends_with(last.as_str()) {
        return false;
    }
    let mut hay = &after_first[..after_first.len() - last.len()];
    // Leftmost placement of each middle piece is optimal: it leaves the
    // most room for the pieces after it.
    for piece in middle {
        match hay.find(piece.as_str()) {
            Some(at) => hay = &hay[at + piece.len()..],
            None => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn glob(s: &str) -> SessionGlob {
        match SessionGlob::parse(s) {
            Ok(g) => g,
            Err(e) => panic!("{s:?}: {e}"),
        }
    }

    #[test]
    fn star_is_one_segment() {
        let g = glob("agent:*:cron");
        assert!(g.matches("agent:main:cron"));
        assert!(!g.matches("agent:main:x:cron"));
        assert!(!g.matches("agent:cron"));
        assert!(glob("*").matches("main"));
        assert!(!glob("*").matches("a:b"));
    }

    #[test]
    fn star_inside_a_segment() {
        let g = glob("agent:*-test");
        assert!(g.matches("agent:unit-test"));
        assert!(g.matches("agent:-test"));
        assert!(!g.matches("agent:unit-test:x"));
        assert!(!g.matches("agent:a:b-test"));
        assert!(glob("a*b*c").matches("abbbc"));
        assert!(glob("a*b*c").matches("axbyc"));
        assert!(!glob("a*b*c").matches("acb"));
        assert!(!glob("ab*ba").matches("aba"));
    }

    #[test]
    fn double_star_is_any_depth() {
        let g = glob("agent:**");
        assert!(g.matches("agent"));
        assert!(g.matches("agent:main"));
        assert!(g.matches("agent:main:cron:42"));
        assert!(!g.matches("other:main"));
        let g = glob("agent:**:cron");
        assert!(g.matches("agent:cron"));
        assert!(g.matches("agent:a:b:c:cron"));
        assert!(!g.matches("agent:a:cron:x"));
        assert!(glob("**").matches(""));
        assert!(glob("**").matches("x:y:z"));
        assert!(glob("**:x").matches("x"));
    }

    #[test]
    fn literals_match_exactly() {
        let g = glob("agent:main");
        assert!(g.matches("agent:main"));
        assert!(!g.matches("agent:mainx"));
        assert!(!g.matches("Agent:main"));
        assert!(glob("chat:日本:ü").matches("chat:日本:ü"));
        assert!(glob("a::b").matches("a::b"));
        assert!(!glob("a::b").matches("a:b"));
    }

    #[test]
    fn refuses_bad_globs() {
        assert_eq!(SessionGlob::parse(""), Err(GlobError::Empty));
        assert!(matches!(
            SessionGlob::parse("agent:ma**"),
            Err(GlobError::DoubleStarInSegment { .. })
        ));
        assert!(matches!(
            SessionGlob::parse("***"),
            Err(GlobError::DoubleStarInSegment { .. })
        ));
        let message = SessionGlob::parse("a**").err().map(|e| e.to_string());
        assert!(message.is_some_and(|m| m.contains("whole segment")));
    }

    #[test]
    fn most_specific_wins() {
        let rules = [
            "**",
            "agent:**",
            "agent:*",
            "agent:*:cron",
            "agent:main:cron",
        ];
        let key = "agent:main:cron";
        let best = rules
            .iter()
            .map(|r| glob(r))
            .filter(|g| g.matches(key))
            .max_by_key(|g| g.specificity())
            .map(|g| g.to_string());
        assert_eq!(best.as_deref(), Some("agent:main:cron"));
        assert!(glob("agent:*").specificity() > glob("agent:**").specificity());
        assert!(glob("agent:*-test").specificity() > glob("agent:*").specificity());
        assert!(glob("a:b").specificity() > glob("a:*").specificity());
    }

    /// Reference semantics through the regex crate.
    fn reference(glob: &str, key: &str) -> bool {
        let mut segments: Vec<&str> = glob.split(':').collect();
        segments.dedup_by(|a, b| *a == "**" && *b == "**");
        let mut pattern = String::from("^");
        for (i, seg) in segments.iter().enumerate() {
            let sep = if i == 0 { "" } else { ":" };
            if *seg == "**" {
                if i == 0 {
                    // Zero or more leading segments, each followed by `:`,
                    // unless it is also the last one.
                    if segments.len() == 1 {
                        pattern.push_str(".*");
                    } else {
                        pattern.push_str("(?:[^:]*:)*");
                    }
                } else {
                    pattern.push_str("(?::[^:]*)*");
                }
                continue;
            }
            let prev_any = i > 0 && segments[i - 1] == "**";
            if !(prev_any && i == 1) {
                pattern.push_str(sep);
            }
            let body: Vec<String> = seg.split('*').map(regex::escape).collect();
            pattern.push_str(&body.join("[^:]*"));
        }
        pattern.push('$');
        regex::Regex::new(&pattern).is_ok_and(|re| re.is_match(key))
    }

    fn segment_strategy() -> impl Strategy<Value = String> {
        prop_oneof![
            4 => "[ab]{0,3}",
            2 => "[ab]{0,2}\\*[ab]{0,2}",
            1 => Just("*".to_string()),
            1 => Just("**".to_string()),
        ]
    }

    fn glob_strategy() -> impl Strategy<Value = String> {
        proptest::collection::vec(segment_strategy(), 1..5).prop_map(|s| s.join(":"))
    }

    fn key_strategy() -> impl Strategy<Value = String> {
        proptest::collection::vec("[ab]{0,3}", 1..6).prop_map(|s| s.join(":"))
    }

    proptest! {
        #[test]
        fn agrees_with_regex_reference(g in glob_strategy(), key in key_strategy()) {
            let parsed = SessionGlob::parse(&g);
            prop_assume!(parsed.is_ok());
            if let Ok(parsed) = parsed {
                prop_assert_eq!(parsed.matches(&key), reference(&g, &key), "glob {} key {}", g, key);
            }
        }

        #[test]
        fn a_key_is_its_own_most_specific_glob(key in "[a-z0-9_.-]{1,6}(:[a-z0-9_.-]{0,6}){0,4}", other in key_strategy()) {
            let exact = glob(&key);
            prop_assert!(exact.matches(&key));
            prop_assert_eq!(exact.matches(&other), other == key);
            // Any generalization still matches and is less specific.
            let parts: Vec<&str> = key.split(':').collect();
            for i in 0..parts.len() {
                let mut star = parts.clone();
                star[i] = "*";
                let g = glob(&star.join(":"));
                prop_assert!(g.matches(&key));
                prop_assert!(g.specificity() < exact.specificity() || parts[i].is_empty());
                for j in i..parts.len() {
                    let mut any: Vec<&str> = parts[..i].to_vec();
                    any.push("**");
                    any.extend_from_slice(&parts[j + 1..]);
                    let g = glob(&any.join(":"));
                    prop_assert!(g.matches(&key), "{} vs {}", any.join(":"), key);
                    prop_assert!(g.specificity() < exact.specificity());
                }
            }
        }

        #[test]
        fn never_panics(g in "\\PC{0,12}", key in "\\PC{0,16}") {
            if let Ok(parsed) = SessionGlob::parse(&g) {
                let _ = parsed.matches(&key);
                let _ = parsed.specificity();
            }
        }

        #[test]
        fn single_star_never_crosses_a_colon(key in "[ab:]{0,8}") {
            prop_assert_eq!(glob("*").matches(&key), !key.contains(':'));
            prop_assert!(glob("**").matches(&key));
        }
    }
}
