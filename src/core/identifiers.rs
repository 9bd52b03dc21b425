//! STUB (summarizer branch): opaque-identifier extraction. The real
//! implementation is written on another branch with this exact signature;
//! the lead keeps that one when merging. This stub only has to be good
//! enough for the summarizer's identifier checks and tests.

use regex::Regex;
use std::collections::HashSet;
use std::sync::OnceLock;

fn pattern() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| {
        // Order matters: longer, more specific shapes first.
        let url = r"[a-zA-Z][a-zA-Z0-9+.-]*://[^\s<>()\[\]{}'`]+";
        let uuid = r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b";
        let ip_port = r"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d{1,5})?\b";
        let path = r"(?:~|\.{1,2})?/[A-Za-z0-9._\-]+(?:/[A-Za-z0-9._\-]+)+/?|\b[A-Za-z0-9_\-]+(?:/[A-Za-z0-9._\-]+)+\.[A-Za-z0-9]{1,8}\b";
        let file = r"\b[A-Za-z0-9_\-]+\.(?:rs|py|ts|js|go|java|toml|json|yaml|yml|md|txt|sh|c|h|cpp|lock|log|sql|html|css)\b";
        let host_port = r"\b[a-zA-Z0-9][a-zA-Z0-9\-]*(?:\.[a-zA-Z0-9\-]+)+:\d{2,5}\b";
        let hex = r"\b[0-9a-f]{7,64}\b";
        Regex::new(&format!(
            "{url}|{uuid}|{ip_port}|{host_port}|{path}|{file}|{hex}"
        ))
        .expect("identifier pattern is a constant and compiles")
    })
}

/// Opaque identifiers in `text`, unique, in order of first appearance.
pub fn extract(text: &str) -> Vec<String> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for m in pattern().find_iter(text) {
        let s = m.as_str().trim_end_matches(['.', ',', ';', ':', '!', '?']);
        // A hex run needs at least one digit and one letter to be a hash
        // rather than a word like "deadbeef" or a plain number.
        if s.chars().all(|c| c.is_ascii_hexdigit())
            && !(s.chars().any(|c| c.is_ascii_digit())
                && s.chars().any(|c| c.is_ascii_alphabetic()))
        {
            continue;
        }
        if !s.is_empty() && seen.insert(s.to_string()) {
            out.push(s.to_string());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_common_identifier_shapes_in_order() {
        let text = "see /srv/app/config.toml and https://example.test/a?b=1, \
                    id 123e4567-e89b-12d3-a456-426614174000 at 10.0.0.5:8080, \
                    commit 9fceb02d0ae598e95dc970b74767f19372d61af8, again /srv/app/config.toml";
        let ids = extract(text);
        assert_eq!(
            ids,
            vec![
                "/srv/app/config.toml",
                "https://example.test/a?b=1",
                "123e4567-e89b-12d3-a456-426614174000",
                "10.0.0.5:8080",
                "9fceb02d0ae598e95dc970b74767f19372d61af8",
            ]
        );
    }

    #[test]
    fn plain_words_are_not_identifiers() {
        assert!(extract("the cat sat on the mat, decade after decade").is_empty());
    }
}
