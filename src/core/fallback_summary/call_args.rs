//! A tool call's arguments as a draft reads them: the string value of a
//! top-level key of a JSON object (`file_path`, `command`, `new_string`).
//!
//! Only those strings are ever asked for, so the arguments are not built
//! into a `serde_json::Value` (a written file's whole content copied into
//! a tree, then copied again to be kept): each top-level string is borrowed
//! from the arguments' text where it holds no escape. The texts taken for
//! JSON, and what each key says, are exactly `Value`'s:
//!
//! - what is not a top-level string (a number, a nested object or array) is
//!   parsed as `Value` parses it, with the same errors and nesting limit,
//!   and dropped;
//! - a key given twice says what its last value says, as `Value`'s map
//!   keeps;
//! - anything the direct parse refuses is parsed as `Value` after all, and
//!   read from that: valid JSON that is not an object (which then has no
//!   keys), and an object holding the key serde_json reserves for its raw
//!   values (which `Value` reads its own way).
//!
//! `tests::a_key_says_what_the_value_tree_says` holds this to `Value`.

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::Value;
use std::borrow::Cow;
use std::fmt;

/// A call's arguments: each top-level key with its value when that is a
/// string (none when the JSON is not an object).
#[derive(Debug, Default, PartialEq)]
pub(super) struct CallArgs<'a> {
    entries: Vec<(Cow<'a, str>, Option<Cow<'a, str>>)>,
}

impl<'a> CallArgs<'a> {
    /// `arguments` read, when they are JSON (`None` when not).
    pub(super) fn parse(arguments: &'a str) -> Option<CallArgs<'a>> {
        match serde_json::from_str::<CallArgs<'a>>(arguments) {
            Ok(args) => Some(args),
            Err(_) => serde_json::from_str::<Value>(arguments)
                .ok()
                .map(|value| CallArgs::of_value(&value)),
        }
    }

    fn of_value(value: &Value) -> CallArgs<'a> {
        let entries = value.as_object().map_or_else(Vec::new, |object| {
            object
                .iter()
                .map(|(key, value)| {
                    (
                        Cow::Owned(key.clone()),
                        value.as_str().map(|s| Cow::Owned(s.to_string())),
                    )
                })
                .collect()
        });
        CallArgs { entries }
    }

    /// The string `key` holds (its last value, when the object repeats it),
    /// or `None` when it holds something else or is absent.
    pub(super) fn string(&self, key: &str) -> Option<&str> {
        self.entries
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .and_then(|(_, v)| v.as_deref())
    }

    /// The string of the first of `keys` that holds one.
    pub(super) fn first_string(&self, keys: &[&str]) -> Option<&str> {
        keys.iter().find_map(|key| self.string(key))
    }
}

/// The key serde_json reserves for its raw values: `Value` reads an object
/// whose first key it is its own way, so the direct parse refuses it.
const RAW_VALUE_KEY: &str = "$serde_json::private::RawValue";

impl<'de> Deserialize<'de> for CallArgs<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(ArgsVisitor)
    }
}

struct ArgsVisitor;

impl<'de> Visitor<'de> for ArgsVisitor {
    type Value = CallArgs<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object (anything else is read through `Value`)")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut entries = Vec::new();
        while let Some(Text(key)) = map.next_key::<Text<'de>>()? {
            if key == RAW_VALUE_KEY {
                return Err(de::Error::custom("serde_json's raw value key"));
            }
            let StringOrNot(value) = map.next_value()?;
            entries.push((key, value));
        }
        Ok(CallArgs { entries })
    }
}

/// A key: borrowed from the text when it holds no escape.
#[derive(serde::Deserialize)]
struct Text<'a>(#[serde(borrow)] Cow<'a, str>);

/// A top-level value: its text when it is a string, else parsed as
/// `Value` parses it and dropped.
struct StringOrNot<'de>(Option<Cow<'de, str>>);

impl<'de> Deserialize<'de> for StringOrNot<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ValueVisitor;
        impl<'de> Visitor<'de> for ValueVisitor {
            type Value = StringOrNot<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_borrowed_str<E: de::Error>(self, s: &'de str) -> Result<Self::Value, E> {
                Ok(StringOrNot(Some(Cow::Borrowed(s))))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
                Ok(StringOrNot(Some(Cow::Owned(s.to_string()))))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                Value::deserialize(de::value::MapAccessDeserializer::new(map))?;
                Ok(StringOrNot(None))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
                Value::deserialize(de::value::SeqAccessDeserializer::new(seq))?;
                Ok(StringOrNot(None))
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
                Ok(StringOrNot(None))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
                Ok(StringOrNot(None))
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
                Ok(StringOrNot(None))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
                Ok(StringOrNot(None))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(StringOrNot(None))
            }
        }
        deserializer.deserialize_any(ValueVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// What `Value` says `key` holds, as [`CallArgs::string`] answers.
    fn value_says<'v>(value: &'v Value, key: &str) -> Option<&'v str> {
        value.as_object()?.get(key)?.as_str()
    }

    fn agrees(text: &str, keys: &[&str]) -> Result<(), TestCaseError> {
        let value = serde_json::from_str::<Value>(text).ok();
        let args = CallArgs::parse(text);
        prop_assert_eq!(args.is_some(), value.is_some(), "JSON or not: {:?}", text);
        if let (Some(args), Some(value)) = (args, value) {
            for key in keys {
                prop_assert_eq!(
                    args.string(key),
                    value_says(&value, key),
                    "{:?} in {:?}",
                    key,
                    text
                );
            }
        }
        Ok(())
    }

    /// A JSON value of a few shapes, with strings that need escapes.
    fn json() -> impl Strategy<Value = String> {
        let leaf = prop_oneof![
            Just("null".to_string()),
            Just("true".to_string()),
            Just("-12.5e3".to_string()),
            Just("1e400".to_string()),
            Just("18446744073709551616".to_string()),
            "[a-c\\\\\"\\n é✓]{0,6}".prop_map(|s| serde_json::to_string(&s).unwrap_or_default()),
            Just("\"\\ud800\"".to_string()),
            Just("\"a\\u00e9\\n\"".to_string()),
        ];
        leaf.prop_recursive(4, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4)
                    .prop_map(|v| format!("[{}]", v.join(","))),
                prop::collection::vec((key(), inner), 0..5).prop_map(|entries| {
                    let body: Vec<String> = entries
                        .into_iter()
                        .map(|(k, v)| format!("{k}:{v}"))
                        .collect();
                    format!("{{{}}}", body.join(","))
                }),
            ]
        })
    }

    /// A key as JSON: a few names (so objects repeat them), one escaped,
    /// and serde_json's raw value key.
    fn key() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("\"path\"".to_string()),
            Just("\"command\"".to_string()),
            Just("\"p\\u0061th\"".to_string()),
            Just("\"new_string\"".to_string()),
            Just(format!("\"{RAW_VALUE_KEY}\"")),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Valid JSON, and JSON cut short or with bytes added: the same
        /// texts are JSON, and every key says what `Value` says it holds.
        #[test]
        fn a_key_says_what_the_value_tree_says(
            text in json(),
            cut in 0usize..64,
            tail in prop_oneof![Just(""), Just(" "), Just("}"), Just(",1"), Just("x")],
        ) {
            let keys = ["path", "command", "new_string", RAW_VALUE_KEY, "absent"];
            agrees(&text, &keys)?;
            agrees(&format!("{text}{tail}"), &keys)?;
            let end = (0..=text.len().saturating_sub(cut))
                .rev()
                .find(|&i| text.is_char_boundary(i))
                .unwrap_or(0);
            agrees(&text[..end], &keys)?;
        }
    }

    #[test]
    fn strings_without_escapes_are_borrowed_and_the_last_of_a_key_counts() {
        let text =
            r#"{"file_path":"src/lib.rs","old":"a\nb","path":1,"path":"x","n":{"path":"deep"}}"#;
        let args = CallArgs::parse(text).unwrap_or_default();
        assert!(matches!(
            args.entries[0].1,
            Some(Cow::Borrowed("src/lib.rs"))
        ));
        assert_eq!(args.string("old"), Some("a\nb"));
        assert_eq!(args.string("path"), Some("x"));
        assert_eq!(args.string("n"), None);
        assert_eq!(
            args.first_string(&["file", "file_path"]),
            Some("src/lib.rs")
        );
        assert_eq!(CallArgs::parse("[1, 2]"), Some(CallArgs::default()));
        assert_eq!(CallArgs::parse("not json"), None);
        assert_eq!(CallArgs::parse(r#"{"a": 1e400}"#), None);
        let raw = format!(r#"{{"{RAW_VALUE_KEY}": "{{\"path\": \"x\"}}"}}"#);
        assert_eq!(
            CallArgs::parse(&raw).and_then(|a| a.string("path").map(str::to_string)),
            Some("x".to_string())
        );
    }
}
