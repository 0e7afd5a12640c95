//! JSON values as the contract handles them: `serde_json::Value`, numbers as
//! `serde_json::Number` (an id keeps its JSON type), keys sorted.
//!
//! §7.7 kit-json-safe-response, as it applies to Rust: a Rust `String` cannot
//! hold a lone surrogate, so whatever an agent returns serialises as valid
//! UTF-8 JSON. Lone surrogates arrive only as `\uD83D`-style escapes in JSON
//! text (a model's answer cut mid-emoji, a dispatch that carries one); the
//! decoder here turns each into U+FFFD instead of refusing the whole
//! document, and joins a pair split into two escapes as JSON always did.

use serde_json::Value;
use std::borrow::Cow;

/// JSON text with every unpaired `\uD800`-`\uDFFF` escape replaced by `\uFFFD`.
pub fn repair_lone_surrogates(text: &str) -> Cow<'_, str> {
    if !text.contains("\\u") {
        return Cow::Borrowed(text);
    }
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    let mut changed = false;
    let hex = |at: usize| -> Option<u16> {
        if at + 6 <= bytes.len() && bytes[at] == b'\\' && bytes[at + 1] == b'u' {
            std::str::from_utf8(&bytes[at + 2..at + 6])
                .ok()
                .and_then(|h| u16::from_str_radix(h, 16).ok())
        } else {
            None
        }
    };
    let mut last = 0;
    while i < bytes.len() {
        if bytes[i] != b'\\' {
            i += 1;
            continue;
        }
        match hex(i) {
            Some(unit @ 0xD800..=0xDBFF) => {
                if let Some(0xDC00..=0xDFFF) = hex(i + 6) {
                    i += 12; // a pair: keep it
                } else {
                    out.push_str(&text[last..i]);
                    out.push_str("\\uFFFD");
                    let _ = unit;
                    i += 6;
                    last = i;
                    changed = true;
                }
            }
            Some(0xDC00..=0xDFFF) => {
                out.push_str(&text[last..i]);
                out.push_str("\\uFFFD");
                i += 6;
                last = i;
                changed = true;
            }
            Some(_) => i += 6,
            None => i += 2, // any other escape, `\\` included
        }
    }
    if !changed {
        return Cow::Borrowed(text);
    }
    out.push_str(&text[last..]);
    Cow::Owned(out)
}

/// One JSON document from bytes: valid UTF-8, lone surrogate escapes made
/// U+FFFD, nesting within serde_json's limit (128), nothing after it.
pub fn decode(data: &[u8]) -> Result<Value, String> {
    let text = std::str::from_utf8(data).map_err(|_| "not valid UTF-8".to_string())?;
    serde_json::from_str(&repair_lone_surrogates(text)).map_err(|e| e.to_string())
}

/// Compact JSON text (no spaces), as Python's `separators=(",", ":")`.
pub fn compact(value: &Value) -> String {
    value.to_string()
}

/// JSON text with Python's default separators (`", "` and `": "`), so every
/// port gives the same `final_response` for a structured value.
pub fn spaced(value: &Value) -> String {
    match value {
        Value::Array(items) => {
            let parts: Vec<String> = items.iter().map(spaced).collect();
            format!("[{}]", parts.join(", "))
        }
        Value::Object(map) => {
            let parts: Vec<String> = map
                .iter()
                .map(|(k, v)| format!("{}: {}", Value::String(k.clone()), spaced(v)))
                .collect();
            format!("{{{}}}", parts.join(", "))
        }
        other => other.to_string(),
    }
}

/// A JSON value's type for a message: "an object", "a number", ...
pub fn json_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// At most `limit` characters of `text`, with an ellipsis when cut.
pub fn short(text: &str, limit: usize) -> String {
    match text.char_indices().nth(limit) {
        None => text.to_string(),
        Some((at, _)) => format!("{}…", &text[..at]),
    }
}

/// A value as it may appear in a message: JSON-quoted, shortened.
pub fn quoted(value: &Value, limit: usize) -> String {
    match value {
        Value::String(s) => compact(&Value::String(short(s, limit))),
        other => compact(other),
    }
}

/// A string as it may appear in a message.
pub fn quoted_str(text: &str, limit: usize) -> String {
    quoted(&Value::String(text.to_string()), limit)
}

/// Python truthiness of a JSON value.
pub fn truthy(value: &Value) -> bool {
    match value {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lone_surrogates_become_replacement_characters() {
        let v =
            decode(br#"{"a": "cut \ud83d", "b": "\udc00x", "c": "\ud83d\ude00", "d": "\\ud83d"}"#)
                .unwrap();
        assert_eq!(v["a"], "cut \u{FFFD}");
        assert_eq!(v["b"], "\u{FFFD}x");
        assert_eq!(v["c"], "\u{1F600}");
        assert_eq!(v["d"], "\\ud83d"); // an escaped backslash, not an escape
    }

    #[test]
    fn spaced_uses_python_separators() {
        let v: Value = serde_json::from_str(r#"{"b": [1, 2], "a": {"x": null}}"#).unwrap();
        assert_eq!(spaced(&v), r#"{"a": {"x": null}, "b": [1, 2]}"#);
    }

    #[test]
    fn short_cuts_on_characters() {
        assert_eq!(short("héllo", 2), "hé…");
        assert_eq!(short("hi", 2), "hi");
    }
}
