//! Validation of custom resources against their CRD's `openAPIV3Schema`, as the
//! API server's apiextensions validation does on create and update (also of
//! `/status`): the structural schema (types, `required`, `nullable`, `enum`,
//! `pattern`, `minItems`/`maxItems`, `minLength`/`maxLength`,
//! `minProperties`/`maxProperties`, `x-kubernetes-list-type: set`), then every
//! `x-kubernetes-validations` CEL rule with `self` (and `oldSelf` for transition
//! rules, on update only), evaluated by `kube-cel` (the `cel` crate with the
//! Kubernetes CEL libraries). The rules are read from the CRD object that was
//! created in the server, never from a copy.
//!
//! The errors are the real field errors (k8s.io/apimachinery
//! `pkg/util/validation/field`, as apiextensions-apiserver's
//! `pkg/apiserver/schema/{objectmeta,validation}` and `.../cel/validation.go`
//! produce them): one `StatusCause` per error with `reason`, `message` (the
//! error body) and `field`, and a top-level message `Kind.group "name" is
//! invalid: cause` (several in brackets).
//!
//! Not modelled: pruning of unknown fields, `format` checks, defaulting
//! beyond what `kube-cel` applies for the rules, `x-kubernetes-list-type: map`
//! keys, `x-kubernetes-int-or-string`/`embedded-resource`, and the CEL cost
//! budget (a test on a real cluster covers it).

use std::fmt;

use serde_json::Value;

/// One field error of a 422 Invalid answer, as the `details.causes` of the
/// real `Status`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldCause {
    /// `FieldValueInvalid`, `FieldValueRequired`, `FieldValueTooMany`, ...
    pub reason: &'static str,
    /// The field's path, e.g. `spec.labels[2]`; `<nil>` for the object itself.
    pub field: String,
    /// The error body, e.g. `Too many: 300: must have at most 256 items`.
    pub message: String,
}

impl fmt::Display for FieldCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

/// The causes as the real aggregate error prints them: one alone, several in
/// brackets.
pub(crate) fn causes_text(causes: &[FieldCause]) -> String {
    match causes {
        [one] => one.to_string(),
        many => {
            let parts: Vec<String> = many.iter().map(ToString::to_string).collect();
            format!("[{}]", parts.join(", "))
        }
    }
}

fn json_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

fn quoted(value: &Value) -> String {
    match value {
        Value::String(s) => format!("{s:?}"),
        other => other.to_string(),
    }
}

fn child(path: &str, name: &str) -> String {
    if path.is_empty() {
        name.to_owned()
    } else {
        format!("{path}.{name}")
    }
}

fn display(path: &str) -> String {
    if path.is_empty() {
        "<nil>".to_owned()
    } else {
        path.to_owned()
    }
}

fn push(causes: &mut Vec<FieldCause>, reason: &'static str, path: &str, message: String) {
    causes.push(FieldCause {
        reason,
        field: display(path),
        message,
    });
}

/// The structural schema checks (kube-openapi's validate package as
/// apiextensions runs it). `path` is the field path of `value`.
pub(crate) fn check_schema(schema: &Value, value: &Value, path: &str, out: &mut Vec<FieldCause>) {
    if !check_type(schema, value, path, out) {
        return;
    }
    check_enum(schema, value, path, out);
    match value {
        Value::String(s) => check_string(schema, s, path, out),
        Value::Array(items) => check_array(schema, items, path, out),
        Value::Object(map) => check_object(schema, map, path, out),
        _ => {}
    }
}

/// How a message names the field at `path`.
fn in_body(path: &str) -> String {
    if path.is_empty() {
        "body".to_owned()
    } else {
        format!("{path} in body")
    }
}

/// Whether `value` is of the schema's type (a null only where the schema allows
/// it; anything for an int-or-string), so that its other checks apply; a wrong
/// type is reported.
fn check_type(schema: &Value, value: &Value, path: &str, out: &mut Vec<FieldCause>) -> bool {
    if value.is_null() {
        if schema["nullable"].as_bool() != Some(true) && schema.get("type").is_some() {
            let ty = schema["type"].as_str().unwrap_or_default();
            push(
                out,
                "FieldValueTypeInvalid",
                path,
                format!(
                    "Invalid value: \"null\": {} must be of type {ty}: \"null\"",
                    in_body(path)
                ),
            );
        }
        return false;
    }
    if schema["x-kubernetes-int-or-string"].as_bool() == Some(true) {
        return false;
    }
    if let Some(ty) = schema["type"].as_str() {
        let actual = json_type(value);
        let ok = actual == ty || (ty == "number" && actual == "integer");
        if !ok {
            push(
                out,
                "FieldValueTypeInvalid",
                path,
                format!(
                    "Invalid value: {actual:?}: {} must be of type {ty}: {actual:?}",
                    in_body(path)
                ),
            );
            return false;
        }
    }
    true
}

/// A value the schema's `enum` does not list.
fn check_enum(schema: &Value, value: &Value, path: &str, out: &mut Vec<FieldCause>) {
    if let Some(allowed) = schema["enum"].as_array()
        && !allowed.contains(value)
    {
        let list: Vec<String> = allowed.iter().map(quoted).collect();
        push(
            out,
            "FieldValueNotSupported",
            path,
            format!(
                "Unsupported value: {}: supported values: {}",
                quoted(value),
                list.join(", ")
            ),
        );
    }
}

/// A string's length and pattern.
fn check_string(schema: &Value, s: &str, path: &str, out: &mut Vec<FieldCause>) {
    let len = s.len();
    if let Some(max) = schema["maxLength"].as_u64()
        && len as u64 > max
    {
        push(
            out,
            "FieldValueTooLong",
            path,
            format!("Too long: may not be more than {max} bytes"),
        );
    }
    if let Some(min) = schema["minLength"].as_u64()
        && (s.chars().count() as u64) < min
    {
        push(
            out,
            "FieldValueInvalid",
            path,
            format!(
                "Invalid value: {s:?}: {} should be at least {min} chars long",
                in_body(path)
            ),
        );
    }
    if let Some(pattern) = schema["pattern"].as_str() {
        match regex::Regex::new(pattern) {
            Ok(re) if !re.is_match(s) => push(
                out,
                "FieldValueInvalid",
                path,
                format!(
                    "Invalid value: {s:?}: {} should match '{pattern}'",
                    in_body(path)
                ),
            ),
            Ok(_) => {}
            Err(error) => push(
                out,
                "FieldValueInvalid",
                path,
                format!(
                    "Invalid value: {pattern:?}: the schema's pattern does not compile: {error}"
                ),
            ),
        }
    }
}

/// An array's size, a set's duplicates, and each item against the items' schema.
fn check_array(schema: &Value, items: &[Value], path: &str, out: &mut Vec<FieldCause>) {
    let n = items.len() as u64;
    if let Some(max) = schema["maxItems"].as_u64()
        && n > max
    {
        push(
            out,
            "FieldValueTooMany",
            path,
            format!("Too many: {n}: must have at most {max} items"),
        );
    }
    if let Some(min) = schema["minItems"].as_u64()
        && n < min
    {
        push(
            out,
            "FieldValueInvalid",
            path,
            format!(
                "Invalid value: {n}: {} should have at least {min} items",
                in_body(path)
            ),
        );
    }
    if schema["x-kubernetes-list-type"].as_str() == Some("set") {
        for (i, item) in items.iter().enumerate() {
            if items[..i].contains(item) {
                push(
                    out,
                    "FieldValueDuplicate",
                    &format!("{path}[{i}]"),
                    format!("Duplicate value: {}", quoted(item)),
                );
            }
        }
    }
    if schema["items"].is_object() {
        for (i, item) in items.iter().enumerate() {
            check_schema(&schema["items"], item, &format!("{path}[{i}]"), out);
        }
    }
}

/// An object's size, its required properties, and each property against its
/// schema (or the additional properties').
fn check_object(
    schema: &Value,
    map: &serde_json::Map<String, Value>,
    path: &str,
    out: &mut Vec<FieldCause>,
) {
    let n = map.len() as u64;
    if let Some(max) = schema["maxProperties"].as_u64()
        && n > max
    {
        push(
            out,
            "FieldValueTooMany",
            path,
            format!("Too many: {n}: must have at most {max} items"),
        );
    }
    if let Some(min) = schema["minProperties"].as_u64()
        && n < min
    {
        push(
            out,
            "FieldValueInvalid",
            path,
            format!(
                "Invalid value: {n}: {} should have at least {min} properties",
                in_body(path)
            ),
        );
    }
    for name in schema["required"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
    {
        if !map.contains_key(name) {
            push(
                out,
                "FieldValueRequired",
                &child(path, name),
                "Required value".to_owned(),
            );
        }
    }
    let properties = schema["properties"].as_object();
    for (name, v) in map {
        // The root's apiVersion, kind and metadata are checked by the
        // server's own object-meta validation.
        if path.is_empty() && matches!(name.as_str(), "apiVersion" | "kind" | "metadata") {
            continue;
        }
        match properties.and_then(|p| p.get(name)) {
            Some(prop) => check_schema(prop, v, &child(path, name), out),
            None if schema["additionalProperties"].is_object() => {
                check_schema(&schema["additionalProperties"], v, &child(path, name), out);
            }
            None => {}
        }
    }
}

/// A CRD version's compiled validation: its schema and its CEL rules.
pub(crate) struct CrdValidation {
    schema: Value,
    compiled: kube_cel::CompiledSchema,
    root: kube_cel::RootContext,
}

impl fmt::Debug for CrdValidation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CrdValidation").finish_non_exhaustive()
    }
}

thread_local! {
    static VALIDATOR: kube_cel::Validator = kube_cel::Validator::new();
}

/// What CEL sees of an object's metadata at the root: only `name` and
/// `generateName` (apiextensions-apiserver `pkg/apiserver/schema/cel/model`).
fn cel_view(obj: &Value) -> Value {
    let mut view = obj.clone();
    if let Some(map) = view.as_object_mut() {
        let meta = &obj["metadata"];
        let mut reduced = serde_json::Map::new();
        for field in ["name", "generateName"] {
            if let Some(v) = meta.get(field) {
                reduced.insert(field.to_owned(), v.clone());
            }
        }
        map.insert("metadata".to_owned(), Value::Object(reduced));
    }
    view
}

impl CrdValidation {
    /// The validation of `version` of a CRD object, if it has a schema.
    pub(crate) fn from_crd(crd: &Value, version: &str) -> Option<Self> {
        let spec = &crd["spec"];
        let v = spec["versions"]
            .as_array()?
            .iter()
            .find(|v| v["name"].as_str() == Some(version))?;
        let schema = v["schema"]["openAPIV3Schema"].clone();
        if !schema.is_object() {
            return None;
        }
        let group = spec["group"].as_str().unwrap_or_default();
        Some(Self {
            compiled: kube_cel::compile_schema(&schema),
            schema,
            root: kube_cel::RootContext {
                api_version: format!("{group}/{version}"),
                api_group: group.to_owned(),
                kind: spec["names"]["kind"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            },
        })
    }

    /// Every error of `obj` (and of the change from `old`, on update).
    pub(crate) fn validate(&self, obj: &Value, old: Option<&Value>) -> Vec<FieldCause> {
        let mut causes = Vec::new();
        check_schema(&self.schema, obj, "", &mut causes);
        if !causes.is_empty() {
            // The real server runs the CEL rules only on a structurally valid object.
            return causes;
        }
        let view = cel_view(obj);
        let old_view = old.map(cel_view);
        let result = VALIDATOR.with(|v| {
            v.validate_compiled_with_context(
                &self.compiled,
                &view,
                old_view.as_ref(),
                Some(&self.root),
            )
        });
        if let Err(errors) = result {
            for e in errors.iter() {
                let ty = json_type(pointer(obj, &e.field_path).unwrap_or(&Value::Null));
                causes.push(FieldCause {
                    reason: match e.reason.as_deref() {
                        Some("FieldValueForbidden") => "FieldValueForbidden",
                        Some("FieldValueRequired") => "FieldValueRequired",
                        Some("FieldValueDuplicate") => "FieldValueDuplicate",
                        _ => "FieldValueInvalid",
                    },
                    field: display(&e.field_path),
                    message: match e.kind {
                        kube_cel::ErrorKind::ValidationFailure => {
                            format!("Invalid value: {ty:?}: {}", e.message)
                        }
                        _ => format!("Invalid value: {ty:?}: rule {:?}: {}", e.rule, e.message),
                    },
                });
            }
        }
        causes
    }
}

/// The value at a dotted field path (`spec.labels[2]`), for its type name.
fn pointer<'a>(obj: &'a Value, path: &str) -> Option<&'a Value> {
    let mut at = obj;
    if path.is_empty() {
        return Some(at);
    }
    for part in path.split('.') {
        let (name, index) = match part.split_once('[') {
            Some((name, rest)) => (name, rest.trim_end_matches(']').parse::<usize>().ok()),
            None => (part, None),
        };
        at = at.get(name)?;
        if let Some(i) = index {
            at = at.get(i)?;
        }
    }
    Some(at)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn crd() -> Value {
        json!({"spec": {"group": "g", "names": {"kind": "K"}, "versions": [{"name": "v1", "schema": {"openAPIV3Schema": {
            "type": "object",
            "x-kubernetes-validations": [{"rule": "self.metadata.name.matches('^[0-9]+$') && int(self.metadata.name) >= 256", "message": "numeric"}],
            "properties": {"spec": {"type": "object", "required": ["labels"], "properties": {"labels": {
                "type": "array", "maxItems": 2, "x-kubernetes-list-type": "set",
                "items": {"type": "string", "maxLength": 3},
                "x-kubernetes-validations": [{"rule": "self == oldSelf", "message": "immutable"}],
            }}}},
        }}}]}})
    }

    #[test]
    fn structural_errors_then_rules() -> Result<(), String> {
        let v = CrdValidation::from_crd(&crd(), "v1").ok_or("no schema")?;
        let obj = |name: &str, labels: Value| json!({"metadata": {"name": name, "uid": "u"}, "spec": {"labels": labels}});
        assert_eq!(v.validate(&obj("300", json!(["a"])), None), []);
        let causes = v.validate(&obj("300", json!(["a", "a", "long"])), None);
        let text = causes_text(&causes);
        assert!(
            text.contains("spec.labels: Too many: 3: must have at most 2 items"),
            "{text}"
        );
        assert!(
            text.contains("spec.labels[1]: Duplicate value: \"a\""),
            "{text}"
        );
        assert!(
            text.contains("spec.labels[2]: Too long: may not be more than 3 bytes"),
            "{text}"
        );
        let causes = v.validate(
            &json!({"metadata": {"name": "300"}, "spec": {"labels": 5}}),
            None,
        );
        assert_eq!(causes[0].reason, "FieldValueTypeInvalid");
        let causes = v.validate(&json!({"metadata": {"name": "300"}, "spec": {}}), None);
        assert_eq!(causes_text(&causes), "spec.labels: Required value");
        let causes = v.validate(&obj("12", json!(["a"])), None);
        assert_eq!(
            causes_text(&causes),
            "<nil>: Invalid value: \"object\": numeric"
        );
        // Transition rules run on update only.
        let causes = v.validate(&obj("300", json!(["b"])), Some(&obj("300", json!(["a"]))));
        assert_eq!(
            causes_text(&causes),
            "spec.labels: Invalid value: \"array\": immutable"
        );
        assert_eq!(
            v.validate(&obj("300", json!(["a"])), Some(&obj("300", json!(["a"])))),
            []
        );
        Ok(())
    }
}
