//! Helpers over objects held as JSON: metadata access, names and timestamps.

use serde_json::{Map, Value};

/// The current time as the API server writes `metav1.Time` (RFC 3339, seconds).
pub(crate) fn now() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

pub(crate) fn meta(obj: &Value) -> Option<&Map<String, Value>> {
    obj.get("metadata").and_then(Value::as_object)
}

/// `metadata`, created if missing; `obj` must be a JSON object.
pub(crate) fn meta_mut(obj: &mut Value) -> Option<&mut Map<String, Value>> {
    let map = obj.as_object_mut()?;
    let meta = map
        .entry("metadata")
        .or_insert_with(|| Value::Object(Map::new()));
    if !meta.is_object() {
        *meta = Value::Object(Map::new());
    }
    meta.as_object_mut()
}

pub(crate) fn meta_str<'a>(obj: &'a Value, field: &str) -> Option<&'a str> {
    meta(obj)?.get(field)?.as_str().filter(|s| !s.is_empty())
}

pub(crate) fn set_meta(obj: &mut Value, field: &str, value: Value) {
    if let Some(m) = meta_mut(obj) {
        m.insert(field.to_owned(), value);
    }
}

pub(crate) fn remove_meta(obj: &mut Value, field: &str) {
    if let Some(m) = meta_mut(obj) {
        m.remove(field);
    }
}

pub(crate) fn generation(obj: &Value) -> i64 {
    meta(obj)
        .and_then(|m| m.get("generation"))
        .and_then(Value::as_i64)
        .unwrap_or(0)
}

pub(crate) fn finalizers(obj: &Value) -> Vec<&str> {
    meta(obj)
        .and_then(|m| m.get("finalizers"))
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

pub(crate) fn labels(obj: &Value) -> Option<&Map<String, Value>> {
    meta(obj)?.get("labels")?.as_object()
}

/// Whether two objects differ outside `metadata` (and `status`, when the
/// status subresource owns it): what bumps `metadata.generation`.
pub(crate) fn spec_differs(a: &Value, b: &Value, ignore_status: bool) -> bool {
    let skip = |k: &str| k == "metadata" || (ignore_status && k == "status");
    let (Some(a), Some(b)) = (a.as_object(), b.as_object()) else {
        return a != b;
    };
    let a_keys = a.iter().filter(|(k, _)| !skip(k));
    let b_len = b.keys().filter(|k| !skip(k)).count();
    let mut a_len = 0;
    for (k, v) in a_keys {
        a_len += 1;
        if b.get(k) != Some(v) {
            return true;
        }
    }
    a_len != b_len
}

/// Whether `name` is a DNS-1123 subdomain, which most resources require.
pub(crate) fn valid_name(name: &str) -> bool {
    name.len() <= 253
        && !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric())
}

/// The first label whose value the API server refuses (`ValidateLabels`: at most 63
/// characters, alphanumerics with `-`, `_` or `.` inside), as (key, value).
pub(crate) fn bad_label_value(obj: &Value) -> Option<(String, String)> {
    labels(obj)?.iter().find_map(|(key, value)| {
        let value = value.as_str().unwrap_or_default();
        let ok = value.is_empty()
            || (value.len() <= 63
                && value
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
                && value.starts_with(|c: char| c.is_ascii_alphanumeric())
                && value.ends_with(|c: char| c.is_ascii_alphanumeric()));
        (!ok).then(|| (key.clone(), value.to_owned()))
    })
}

/// The object reduced to a `PartialObjectMetadata`, as served for
/// `Accept: application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1`.
pub(crate) fn partial_metadata(obj: &Value) -> Value {
    serde_json::json!({
        "kind": "PartialObjectMetadata",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": obj.get("metadata").cloned().unwrap_or_else(|| Value::Object(Map::new())),
    })
}
