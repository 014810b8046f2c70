//! Label and field selectors, parsed and matched as `k8s.io/apimachinery`'s
//! `labels.Parse` and `fields.ParseSelector` do.

use serde_json::{Map, Value};

use crate::{error::ApiError, resource::ResourceSpec};

/// A selector that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SelectorError {
    /// A label selector requirement is malformed.
    #[error("unable to parse requirement: {reason} in {selector:?}")]
    Label {
        /// The whole selector.
        selector: String,
        /// What is wrong.
        reason: &'static str,
    },
    /// A field selector term has no operator.
    #[error("invalid selector: '{selector}'; can't understand '{term}'")]
    Field {
        /// The whole selector.
        selector: String,
        /// The term.
        term: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum LabelReq {
    Exists(String),
    NotExists(String),
    Eq(String, String),
    NotEq(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Gt(String, i64),
    Lt(String, i64),
}

/// A parsed label selector; the empty selector matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct LabelSelector {
    reqs: Vec<LabelReq>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Token {
    Ident(String),
    Not,
    Eq,
    DoubleEq,
    NotEq,
    Gt,
    Lt,
    Open,
    Close,
    Comma,
}

fn tokenize(input: &str) -> Vec<Token> {
    let mut tokens = Vec::new();
    let mut chars = input.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            c if c.is_whitespace() => {}
            '!' if chars.peek() == Some(&'=') => {
                chars.next();
                tokens.push(Token::NotEq);
            }
            '!' => tokens.push(Token::Not),
            '=' if chars.peek() == Some(&'=') => {
                chars.next();
                tokens.push(Token::DoubleEq);
            }
            '=' => tokens.push(Token::Eq),
            '>' => tokens.push(Token::Gt),
            '<' => tokens.push(Token::Lt),
            '(' => tokens.push(Token::Open),
            ')' => tokens.push(Token::Close),
            ',' => tokens.push(Token::Comma),
            c => {
                let mut ident = String::from(c);
                while let Some(&n) = chars.peek() {
                    if n.is_whitespace() || "!=<>(),".contains(n) {
                        break;
                    }
                    ident.push(n);
                    chars.next();
                }
                tokens.push(Token::Ident(ident));
            }
        }
    }
    tokens
}

fn valid_label_value(v: &str) -> bool {
    v.is_empty()
        || (v.len() <= 63
            && v.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
            && v.starts_with(|c: char| c.is_ascii_alphanumeric())
            && v.ends_with(|c: char| c.is_ascii_alphanumeric()))
}

fn valid_label_key(k: &str) -> bool {
    let (prefix, name) = match k.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, k),
    };
    let prefix_ok = prefix.is_none_or(|p| {
        !p.is_empty()
            && p.len() <= 253
            && p.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "-.".contains(c))
    });
    prefix_ok && !name.is_empty() && valid_label_value(name)
}

/// One requirement of a label selector: `!key`, `key`, or `key` with an operator;
/// what is wrong with it, if it does not parse.
fn requirement(it: &mut Tokens) -> Result<LabelReq, &'static str> {
    let negated = it.next_if_eq(&Token::Not).is_some();
    let key = match it.next() {
        Some(Token::Ident(k)) => k,
        _ => return Err("found unexpected token, expected a key"),
    };
    if !valid_label_key(&key) {
        return Err("invalid label key");
    }
    if negated {
        return Ok(LabelReq::NotExists(key));
    }
    match it.peek() {
        None | Some(Token::Comma) => Ok(LabelReq::Exists(key)),
        Some(Token::Eq | Token::DoubleEq | Token::NotEq) => equality(key, it),
        Some(Token::Gt | Token::Lt) => comparison(key, it),
        Some(Token::Ident(op)) if op == "in" || op == "notin" => {
            let is_in = op == "in";
            it.next();
            set(key, is_in, it)
        }
        Some(_) => Err("found unexpected token, expected an operator"),
    }
}

/// `key=value`, `key==value` or `key!=value` (the value may be empty).
fn equality(key: String, it: &mut Tokens) -> Result<LabelReq, &'static str> {
    let negate = it.next() == Some(Token::NotEq);
    let value = match it.peek() {
        Some(Token::Ident(_)) => match it.next() {
            Some(Token::Ident(v)) => v,
            _ => String::new(),
        },
        None | Some(Token::Comma) => String::new(),
        Some(_) => {
            return Err("found unexpected token, expected a value");
        }
    };
    if !valid_label_value(&value) {
        return Err("invalid label value");
    }
    Ok(if negate {
        LabelReq::NotEq(key, value)
    } else {
        LabelReq::Eq(key, value)
    })
}

/// `key>n` or `key<n`.
fn comparison(key: String, it: &mut Tokens) -> Result<LabelReq, &'static str> {
    let greater = it.next() == Some(Token::Gt);
    let Some(Token::Ident(v)) = it.next() else {
        return Err("expected an integer value");
    };
    let n: i64 = v.parse().map_err(|_| "expected an integer value")?;
    Ok(if greater {
        LabelReq::Gt(key, n)
    } else {
        LabelReq::Lt(key, n)
    })
}

/// The set of `key in (a, b)` (`is_in`) or `key notin (a, b)`: at least one value.
fn set(key: String, is_in: bool, it: &mut Tokens) -> Result<LabelReq, &'static str> {
    if it.next() != Some(Token::Open) {
        return Err("expected '(' after set operator");
    }
    let mut values = Vec::new();
    loop {
        match it.next() {
            Some(Token::Ident(v)) => {
                if !valid_label_value(&v) {
                    return Err("invalid label value");
                }
                values.push(v);
                match it.next() {
                    Some(Token::Comma) => {}
                    Some(Token::Close) => break,
                    _ => return Err("expected ',' or ')' in value set"),
                }
            }
            Some(Token::Close) if values.is_empty() => {
                return Err("for 'in', 'notin' operators, values set can't be empty");
            }
            _ => return Err("expected a value in value set"),
        }
    }
    Ok(if is_in {
        LabelReq::In(key, values)
    } else {
        LabelReq::NotIn(key, values)
    })
}

/// The selector's tokens, read one requirement at a time.
type Tokens = std::iter::Peekable<std::vec::IntoIter<Token>>;

impl LabelSelector {
    pub(crate) fn parse(selector: &str) -> Result<Self, SelectorError> {
        let fail = |reason| SelectorError::Label {
            selector: selector.to_owned(),
            reason,
        };
        let tokens = tokenize(selector);
        let mut it = tokens.into_iter().peekable();
        let mut reqs = Vec::new();
        while it.peek().is_some() {
            reqs.push(requirement(&mut it).map_err(fail)?);
            match it.next() {
                None => break,
                Some(Token::Comma) if it.peek().is_some() => {}
                Some(_) => return Err(fail("found unexpected token, expected ','")),
            }
        }
        Ok(Self { reqs })
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.reqs.is_empty()
    }

    /// Whether an object with these `metadata.labels` matches.
    pub(crate) fn matches(&self, labels: Option<&Map<String, Value>>) -> bool {
        let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        self.reqs.iter().all(|req| match req {
            LabelReq::Exists(k) => get(k).is_some(),
            LabelReq::NotExists(k) => get(k).is_none(),
            LabelReq::Eq(k, v) => get(k) == Some(v.as_str()),
            LabelReq::NotEq(k, v) => get(k) != Some(v.as_str()),
            LabelReq::In(k, vs) => get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
            LabelReq::NotIn(k, vs) => get(k).is_none_or(|x| vs.iter().all(|v| v != x)),
            LabelReq::Gt(k, n) => get(k)
                .and_then(|x| x.parse::<i64>().ok())
                .is_some_and(|x| x > *n),
            LabelReq::Lt(k, n) => get(k)
                .and_then(|x| x.parse::<i64>().ok())
                .is_some_and(|x| x < *n),
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct FieldReq {
    field: String,
    value: String,
    negate: bool,
}

/// A parsed field selector; the empty selector matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct FieldSelector {
    reqs: Vec<FieldReq>,
}

/// Split on separators not escaped by a backslash, keeping escapes.
fn split_unescaped(s: &str, sep: char) -> Vec<String> {
    let mut parts = Vec::new();
    let mut cur = String::new();
    let mut escaped = false;
    for c in s.chars() {
        if escaped {
            cur.push(c);
            escaped = false;
        } else if c == '\\' {
            cur.push(c);
            escaped = true;
        } else if c == sep {
            parts.push(std::mem::take(&mut cur));
        } else {
            cur.push(c);
        }
    }
    parts.push(cur);
    parts
}

fn unescape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut escaped = false;
    for c in s.chars() {
        if escaped || c != '\\' {
            out.push(c);
            escaped = false;
        } else {
            escaped = true;
        }
    }
    out
}

impl FieldSelector {
    pub(crate) fn parse(selector: &str) -> Result<Self, SelectorError> {
        let mut reqs = Vec::new();
        if selector.trim().is_empty() {
            return Ok(Self { reqs });
        }
        for term in split_unescaped(selector, ',') {
            let term = term.trim();
            if term.is_empty() {
                continue;
            }
            let (field, value, negate) = if let Some((f, v)) = term.split_once("!=") {
                (f, v, true)
            } else if let Some((f, v)) = term.split_once("==") {
                (f, v, false)
            } else if let Some((f, v)) = term.split_once('=') {
                (f, v, false)
            } else {
                return Err(SelectorError::Field {
                    selector: selector.to_owned(),
                    term: term.to_owned(),
                });
            };
            reqs.push(FieldReq {
                field: field.trim().to_owned(),
                value: unescape(value.trim()),
                negate,
            });
        }
        Ok(Self { reqs })
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.reqs.is_empty()
    }

    /// 400 for a field the resource does not support selecting on.
    pub(crate) fn check_supported(&self, spec: &ResourceSpec) -> Result<(), ApiError> {
        let probe = Value::Object(Map::new());
        match self
            .reqs
            .iter()
            .find(|r| field_value(spec, &probe, &r.field).is_none())
        {
            Some(r) => Err(ApiError::UnsupportedField {
                field: r.field.clone(),
            }),
            None => Ok(()),
        }
    }

    pub(crate) fn matches(&self, spec: &ResourceSpec, obj: &Value) -> bool {
        self.reqs.iter().all(|r| {
            let v = field_value(spec, obj, &r.field).unwrap_or_default();
            (v == r.value) != r.negate
        })
    }
}

fn string_at(obj: &Value, path: &[&str]) -> String {
    let mut cur = obj;
    for p in path {
        cur = &cur[*p];
    }
    match cur {
        Value::String(s) => s.clone(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        _ => String::new(),
    }
}

fn bool_at(obj: &Value, path: &[&str]) -> String {
    let mut cur = obj;
    for p in path {
        cur = &cur[*p];
    }
    cur.as_bool().unwrap_or(false).to_string()
}

/// The value of a selectable field, or `None` if the resource does not
/// support selecting on it (the real server's per-resource field sets).
fn field_value(spec: &ResourceSpec, obj: &Value, field: &str) -> Option<String> {
    match field {
        "metadata.name" => return Some(string_at(obj, &["metadata", "name"])),
        "metadata.namespace" => return Some(string_at(obj, &["metadata", "namespace"])),
        _ => {}
    }
    if !spec.group.is_empty() {
        return None;
    }
    let value = match (spec.plural.as_str(), field) {
        ("pods", "spec.nodeName") => string_at(obj, &["spec", "nodeName"]),
        ("pods", "spec.restartPolicy") => string_at(obj, &["spec", "restartPolicy"]),
        ("pods", "spec.schedulerName") => string_at(obj, &["spec", "schedulerName"]),
        ("pods", "spec.serviceAccountName") => string_at(obj, &["spec", "serviceAccountName"]),
        ("pods", "spec.hostNetwork") => bool_at(obj, &["spec", "hostNetwork"]),
        ("pods", "status.phase") => string_at(obj, &["status", "phase"]),
        ("pods", "status.podIP") => string_at(obj, &["status", "podIP"]),
        ("pods", "status.nominatedNodeName") => string_at(obj, &["status", "nominatedNodeName"]),
        ("nodes", "spec.unschedulable") => bool_at(obj, &["spec", "unschedulable"]),
        ("secrets", "type") => string_at(obj, &["type"]),
        ("namespaces", "status.phase") => string_at(obj, &["status", "phase"]),
        ("events", f) => match f.strip_prefix("involvedObject.") {
            Some(
                sub @ ("kind" | "namespace" | "name" | "uid" | "apiVersion" | "resourceVersion"
                | "fieldPath"),
            ) => string_at(obj, &["involvedObject", sub]),
            Some(_) => return None,
            None => match f {
                "reason" | "reportingComponent" | "type" => string_at(obj, &[f]),
                "source" => string_at(obj, &["source", "component"]),
                _ => return None,
            },
        },
        _ => return None,
    };
    Some(value)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn labels(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => Map::new(),
        }
    }

    #[test]
    fn label_operators() {
        let l = labels(json!({"app": "web", "tier": "front", "n": "5"}));
        let m = |s: &str| LabelSelector::parse(s).map(|sel| sel.matches(Some(&l)));
        assert_eq!(m("app=web"), Ok(true));
        assert_eq!(m("app==web,tier=front"), Ok(true));
        assert_eq!(m("app!=web"), Ok(false));
        assert_eq!(m("missing!=x"), Ok(true));
        assert_eq!(m("app in (db, web)"), Ok(true));
        assert_eq!(m("app notin (web)"), Ok(false));
        assert_eq!(m("missing notin (web)"), Ok(true));
        assert_eq!(m("app"), Ok(true));
        assert_eq!(m("!app"), Ok(false));
        assert_eq!(m("!missing"), Ok(true));
        assert_eq!(m("n>4,n<6"), Ok(true));
        assert_eq!(m(""), Ok(true));
        assert!(m("app in ()").is_err());
        assert!(m("app=").is_ok());
        assert!(m("=x").is_err());
        assert!(m("app=web,").is_err());
        assert!(m("app=(").is_err());
    }

    #[test]
    fn field_selectors() -> Result<(), SelectorError> {
        let pods = ResourceSpec::namespaced("", "v1", "Pod", "pods");
        let pod = json!({"metadata": {"name": "a", "namespace": "ns"}, "spec": {"nodeName": "n1"}});
        let sel = FieldSelector::parse("spec.nodeName=n1,metadata.namespace!=other")?;
        assert!(sel.check_supported(&pods).is_ok());
        assert!(sel.matches(&pods, &pod));
        let sel = FieldSelector::parse("spec.nodeName==n2")?;
        assert!(!sel.matches(&pods, &pod));
        let sel = FieldSelector::parse("spec.hostNetwork=false")?;
        assert!(sel.matches(&pods, &pod));
        let cms = ResourceSpec::namespaced("", "v1", "ConfigMap", "configmaps");
        let sel = FieldSelector::parse("spec.nodeName=n1")?;
        assert!(matches!(
            sel.check_supported(&cms),
            Err(ApiError::UnsupportedField { .. })
        ));
        assert!(FieldSelector::parse("nonsense").is_err());
        let sel = FieldSelector::parse(r"metadata.name=a\,b")?;
        let obj = json!({"metadata": {"name": "a,b"}});
        assert!(sel.matches(&cms, &obj));
        Ok(())
    }
}
