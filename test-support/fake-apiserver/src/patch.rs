//! Patch formats: JSON merge patch (RFC 7386) and JSON patch (RFC 6902).
//! Strategic merge and server-side apply are served as merge patches (see the
//! crate docs for what that leaves out).

use serde_json::Value;

/// The patch type, from the request's `Content-Type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PatchKind {
    Merge,
    Json,
    Strategic,
    Apply,
}

impl PatchKind {
    pub(crate) fn from_content_type(content_type: &str) -> Option<Self> {
        let media = content_type.split(';').next().unwrap_or_default().trim();
        match media {
            "application/merge-patch+json" => Some(Self::Merge),
            "application/json-patch+json" => Some(Self::Json),
            "application/strategic-merge-patch+json" => Some(Self::Strategic),
            "application/apply-patch+yaml" | "application/apply-patch+json" => Some(Self::Apply),
            _ => None,
        }
    }
}

/// A JSON patch that cannot be applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PatchError {
    /// The patch document is not a list of operations.
    #[error("a JSON patch must be an array of operations")]
    NotAnArray,
    /// An operation is malformed.
    #[error("malformed JSON patch operation #{index}: {reason}")]
    Malformed {
        /// Position in the patch.
        index: usize,
        /// What is wrong.
        reason: &'static str,
    },
    /// A path does not exist in the document.
    #[error("path {path:?} does not exist")]
    MissingPath {
        /// The JSON pointer.
        path: String,
    },
    /// A `test` operation failed.
    #[error("testing value {path:?} failed")]
    TestFailed {
        /// The JSON pointer.
        path: String,
    },
    /// A merge patch that is not a JSON object (apply configurations must be).
    #[error("the patch is not a JSON object")]
    NotAnObject,
}

/// RFC 7386: objects merge recursively, `null` deletes, anything else replaces.
pub(crate) fn merge(target: &mut Value, patch: &Value) {
    let Value::Object(patch_map) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(serde_json::Map::new());
    }
    if let Value::Object(target_map) = target {
        for (k, v) in patch_map {
            if v.is_null() {
                target_map.remove(k);
            } else {
                merge(target_map.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
    }
}

fn parse_pointer(path: &str, index: usize) -> Result<Vec<String>, PatchError> {
    if path.is_empty() {
        return Ok(Vec::new());
    }
    let Some(rest) = path.strip_prefix('/') else {
        return Err(PatchError::Malformed {
            index,
            reason: "a path must start with '/'",
        });
    };
    Ok(rest
        .split('/')
        .map(|t| t.replace("~1", "/").replace("~0", "~"))
        .collect())
}

fn get<'a>(doc: &'a Value, tokens: &[String]) -> Option<&'a Value> {
    tokens.iter().try_fold(doc, |cur, t| match cur {
        Value::Object(m) => m.get(t),
        Value::Array(a) => t.parse::<usize>().ok().and_then(|i| a.get(i)),
        _ => None,
    })
}

fn get_mut<'a>(doc: &'a mut Value, tokens: &[String]) -> Option<&'a mut Value> {
    tokens.iter().try_fold(doc, |cur, t| match cur {
        Value::Object(m) => m.get_mut(t),
        Value::Array(a) => t.parse::<usize>().ok().and_then(|i| a.get_mut(i)),
        _ => None,
    })
}

fn missing(tokens: &[String]) -> PatchError {
    PatchError::MissingPath {
        path: tokens.iter().map(|t| format!("/{t}")).collect(),
    }
}

fn remove(doc: &mut Value, tokens: &[String]) -> Result<Value, PatchError> {
    let Some((last, parent)) = tokens.split_last() else {
        return Ok(std::mem::take(doc));
    };
    match get_mut(doc, parent) {
        Some(Value::Object(m)) => m.remove(last).ok_or_else(|| missing(tokens)),
        Some(Value::Array(a)) => match last.parse::<usize>() {
            Ok(i) if i < a.len() => Ok(a.remove(i)),
            _ => Err(missing(tokens)),
        },
        _ => Err(missing(tokens)),
    }
}

fn add(doc: &mut Value, tokens: &[String], value: Value) -> Result<(), PatchError> {
    let Some((last, parent)) = tokens.split_last() else {
        *doc = value;
        return Ok(());
    };
    match get_mut(doc, parent) {
        Some(Value::Object(m)) => {
            m.insert(last.clone(), value);
            Ok(())
        }
        Some(Value::Array(a)) => {
            let i = if last == "-" {
                a.len()
            } else {
                last.parse::<usize>().map_err(|_| missing(tokens))?
            };
            if i > a.len() {
                return Err(missing(tokens));
            }
            a.insert(i, value);
            Ok(())
        }
        _ => Err(missing(tokens)),
    }
}

/// RFC 6902: apply the operations in order; any failure leaves `doc` unchanged.
pub(crate) fn json_patch(doc: &mut Value, patch: &Value) -> Result<(), PatchError> {
    let ops = patch.as_array().ok_or(PatchError::NotAnArray)?;
    let mut work = doc.clone();
    for (index, op) in ops.iter().enumerate() {
        let malformed = |reason| PatchError::Malformed { index, reason };
        let name = op["op"].as_str().ok_or(malformed("missing \"op\""))?;
        let path = parse_pointer(
            op["path"].as_str().ok_or(malformed("missing \"path\""))?,
            index,
        )?;
        let value = || {
            op.get("value")
                .cloned()
                .ok_or(malformed("missing \"value\""))
        };
        let from = || -> Result<Vec<String>, PatchError> {
            parse_pointer(
                op["from"].as_str().ok_or(malformed("missing \"from\""))?,
                index,
            )
        };
        match name {
            "add" => add(&mut work, &path, value()?)?,
            "remove" => {
                remove(&mut work, &path)?;
            }
            "replace" => {
                let v = value()?;
                *get_mut(&mut work, &path).ok_or_else(|| missing(&path))? = v;
            }
            "move" => {
                let v = remove(&mut work, &from()?)?;
                add(&mut work, &path, v)?;
            }
            "copy" => {
                let src = from()?;
                let v = get(&work, &src).cloned().ok_or_else(|| missing(&src))?;
                add(&mut work, &path, v)?;
            }
            "test" => {
                if get(&work, &path) != Some(&value()?) {
                    return Err(PatchError::TestFailed {
                        path: op["path"].as_str().unwrap_or_default().to_owned(),
                    });
                }
            }
            _ => return Err(malformed("unknown \"op\"")),
        }
    }
    *doc = work;
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn merge_patch_rfc7386() {
        let mut doc = json!({"a": "b", "c": {"d": "e", "f": "g"}, "l": [1, 2]});
        merge(&mut doc, &json!({"a": "z", "c": {"f": null}, "l": [3]}));
        assert_eq!(doc, json!({"a": "z", "c": {"d": "e"}, "l": [3]}));
    }

    #[test]
    fn json_patch_ops() -> Result<(), PatchError> {
        let mut doc = json!({"metadata": {"labels": {"a/b": "1"}}, "l": [1, 2]});
        json_patch(
            &mut doc,
            &json!([
                {"op": "test", "path": "/metadata/labels/a~1b", "value": "1"},
                {"op": "add", "path": "/l/-", "value": 3},
                {"op": "replace", "path": "/l/0", "value": 0},
                {"op": "copy", "from": "/l/0", "path": "/x"},
                {"op": "move", "from": "/x", "path": "/y"},
                {"op": "remove", "path": "/metadata/labels/a~1b"},
            ]),
        )?;
        assert_eq!(
            doc,
            json!({"metadata": {"labels": {}}, "l": [0, 2, 3], "y": 0})
        );
        let before = doc.clone();
        let err = json_patch(
            &mut doc,
            &json!([{"op": "add", "path": "/z", "value": 1}, {"op": "test", "path": "/y", "value": 9}]),
        );
        assert!(matches!(err, Err(PatchError::TestFailed { .. })));
        assert_eq!(doc, before, "a failed patch changes nothing");
        Ok(())
    }
}
