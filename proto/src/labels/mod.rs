//! The label model: `source:key=value` labels with Kubernetes syntax, and canonical
//! label sets, the allocation key of an identity.
//!
//! A [`LabelSet`] is stored as one canonical string (`k8s:app=web;k8s:tier=db`):
//! labels sorted by source and key, duplicates removed. The string is shared
//! (`Arc<str>`), so the allocator can intern one copy per identity and drop it with
//! its last user.

mod filter;
pub(crate) mod syntax;

use std::{cmp::Ordering, collections::BTreeMap, fmt, hash::Hash, str::FromStr, sync::Arc};

pub use filter::{DEFAULT_EXCLUDE, KeyPattern, LabelFilter, PatternError};
pub use syntax::SyntaxError;

/// The source census uses for the labels of Kubernetes pods (and endpoints from a file).
pub const K8S_SOURCE: &str = "k8s";
/// Labels with this source name census's own reserved identities; they are never allocated.
pub const RESERVED_SOURCE: &str = "reserved";
/// The label census adds with the endpoint's namespace.
pub const NAMESPACE_KEY: &str = "io.kubernetes.pod.namespace";
/// The label census adds with the endpoint's service account.
pub const SERVICE_ACCOUNT_KEY: &str = "io.kubernetes.pod.serviceaccount";

const SEPARATOR: char = ';';

/// Size limits applied to a label set. Kubernetes' own limits (63-character names and
/// values, 253-character prefixes) always apply on top.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LabelLimits {
    /// Labels in one set.
    pub max_labels: usize,
}

impl Default for LabelLimits {
    fn default() -> Self {
        Self { max_labels: 64 }
    }
}

/// Why a label or a label set was refused. Every variant names the label.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LabelError {
    #[error("label {label:?}: {reason}")]
    Syntax { label: String, reason: SyntaxError },
    #[error("labels {first:?} and {second:?} give the same key two values")]
    Conflict { first: String, second: String },
    #[error("{count} labels exceed the limit of {max}")]
    TooMany { count: usize, max: usize },
    #[error(
        "label {label:?}: source {RESERVED_SOURCE:?} names census's reserved identities and cannot be allocated"
    )]
    Reserved { label: String },
    #[error("a label set must have at least one label")]
    Empty,
}

impl LabelError {
    fn syntax(label: &str, reason: SyntaxError) -> Self {
        Self::Syntax {
            label: shorten(label),
            reason,
        }
    }
}

/// Labels in error messages are cut so a hostile input cannot make them huge.
fn shorten(s: &str) -> String {
    crate::text::cut(s, 300).into_owned()
}

/// One label, borrowed from its text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Label<'a> {
    pub source: &'a str,
    pub key: &'a str,
    pub value: &'a str,
}

impl<'a> Label<'a> {
    /// Parses and validates `source:key=value`.
    pub fn parse(text: &'a str) -> Result<Self, LabelError> {
        let (source, rest) = text
            .split_once(':')
            .ok_or_else(|| LabelError::syntax(text, SyntaxError::MissingSource))?;
        let (key, value) = rest
            .split_once('=')
            .ok_or_else(|| LabelError::syntax(text, SyntaxError::MissingValue))?;
        syntax::check_source(source).map_err(|e| LabelError::syntax(text, e))?;
        syntax::check_key(key).map_err(|e| LabelError::syntax(text, e))?;
        syntax::check_value(value).map_err(|e| LabelError::syntax(text, e))?;
        Ok(Self { source, key, value })
    }

    /// Splits a label of a canonical set, which is known to be valid.
    fn split_valid(text: &'a str) -> Self {
        let (source, rest) = text.split_once(':').unwrap_or(("", text));
        let (key, value) = rest.split_once('=').unwrap_or((rest, ""));
        Self { source, key, value }
    }

    fn sort_key(&self) -> (&'a str, &'a str) {
        (self.source, self.key)
    }
}

impl fmt::Display for Label<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}={}", self.source, self.key, self.value)
    }
}

/// A canonical label set: validated, sorted by source and key, without duplicates.
///
/// Equality, ordering and hashing are those of the canonical string.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LabelSet(Arc<str>);

impl LabelSet {
    /// Validates, sorts and deduplicates `labels` (each `source:key=value`).
    ///
    /// Two labels with the same source and key but different values are a conflict.
    /// The `reserved` source is refused: it is census's own.
    pub fn parse<I, S>(labels: I, limits: &LabelLimits) -> Result<Self, LabelError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        Self::parse_indexed(labels, limits).map_err(|(_, e)| e)
    }

    /// As [`parse`](Self::parse); an error about one label comes with its index in
    /// `labels`, so the caller can name the field (`labels[3]`).
    pub fn parse_indexed<I, S>(
        labels: I,
        limits: &LabelLimits,
    ) -> Result<Self, (Option<usize>, LabelError)>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        Self::parse_keeping(labels, limits, |_| true)
    }

    /// As [`parse_indexed`](Self::parse_indexed), keeping only the labels `filter`
    /// keeps (the labels census adds always are): every label is checked, and the
    /// limit counts the labels kept, as the agent counts a pod's labels after the
    /// filter ([`Self::for_pod`]).
    pub fn parse_filtered_indexed<I, S>(
        labels: I,
        filter: &LabelFilter,
        limits: &LabelLimits,
    ) -> Result<Self, (Option<usize>, LabelError)>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        Self::parse_keeping(labels, limits, |label| filter.keeps(label.key))
    }

    fn parse_keeping<I, S>(
        labels: I,
        limits: &LabelLimits,
        keep: impl Fn(&Label<'_>) -> bool,
    ) -> Result<Self, (Option<usize>, LabelError)>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let owned: Vec<S> = labels.into_iter().collect();
        if owned.len() > limits.max_labels.saturating_mul(4) {
            // Far over the limit even if most were duplicates: refuse before parsing.
            return Err((
                None,
                LabelError::TooMany {
                    count: owned.len(),
                    max: limits.max_labels,
                },
            ));
        }
        let mut parsed = Vec::with_capacity(owned.len());
        for (i, text) in owned.iter().enumerate() {
            let text = text.as_ref();
            let label = Label::parse(text).map_err(|e| (Some(i), e))?;
            if label.source == RESERVED_SOURCE {
                return Err((
                    Some(i),
                    LabelError::Reserved {
                        label: shorten(text),
                    },
                ));
            }
            if keep(&label) {
                parsed.push(label);
            }
        }
        Self::from_labels(parsed, limits).map_err(|e| (None, e))
    }

    /// Builds the set from labels that are already valid (sorting and deduplicating).
    fn from_labels(mut labels: Vec<Label<'_>>, limits: &LabelLimits) -> Result<Self, LabelError> {
        labels.sort_unstable_by(|a, b| a.sort_key().cmp(&b.sort_key()).then(a.value.cmp(b.value)));
        labels.dedup();
        for pair in labels.windows(2) {
            if pair[0].sort_key() == pair[1].sort_key() {
                return Err(LabelError::Conflict {
                    first: shorten(&pair[0].to_string()),
                    second: shorten(&pair[1].to_string()),
                });
            }
        }
        if labels.is_empty() {
            return Err(LabelError::Empty);
        }
        if labels.len() > limits.max_labels {
            return Err(LabelError::TooMany {
                count: labels.len(),
                max: limits.max_labels,
            });
        }
        let mut canonical = String::with_capacity(
            labels
                .iter()
                .map(|l| l.source.len() + l.key.len() + l.value.len() + 3)
                .sum(),
        );
        for (i, label) in labels.iter().enumerate() {
            if i > 0 {
                canonical.push(SEPARATOR);
            }
            canonical.push_str(label.source);
            canonical.push(':');
            canonical.push_str(label.key);
            canonical.push('=');
            canonical.push_str(label.value);
        }
        Ok(Self(canonical.into()))
    }

    /// Parses a canonical string (as stored), checking that it is canonical.
    pub fn from_canonical(canonical: &str, limits: &LabelLimits) -> Result<Self, LabelError> {
        let set = Self::parse(canonical.split(SEPARATOR), limits)?;
        if &*set.0 != canonical {
            return Err(LabelError::syntax(canonical, SyntaxError::NotCanonical));
        }
        Ok(set)
    }

    /// The identity labels of a pod: its labels (source `k8s`) passed through the
    /// filter, plus the namespace and service-account labels census adds.
    pub fn for_pod(
        pod_labels: &BTreeMap<String, String>,
        namespace: &str,
        service_account: &str,
        filter: &LabelFilter,
        limits: &LabelLimits,
    ) -> Result<Self, LabelError> {
        let mut texts: Vec<String> = pod_labels
            .iter()
            .filter(|(key, _)| filter.keeps(key))
            .map(|(key, value)| format!("{K8S_SOURCE}:{key}={value}"))
            .collect();
        texts.push(format!("{K8S_SOURCE}:{NAMESPACE_KEY}={namespace}"));
        texts.push(format!(
            "{K8S_SOURCE}:{SERVICE_ACCOUNT_KEY}={service_account}"
        ));
        Self::parse(&texts, limits)
    }

    /// Applies `filter` to a set; the labels census adds are always kept.
    pub fn filtered(&self, filter: &LabelFilter, limits: &LabelLimits) -> Result<Self, LabelError> {
        if self.iter().all(|l| filter.keeps(l.key)) {
            return Ok(self.clone());
        }
        let kept: Vec<Label<'_>> = self.iter().filter(|l| filter.keeps(l.key)).collect();
        Self::from_labels(kept, limits)
    }

    /// The canonical string: `source:key=value` joined by `;`.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The shared canonical string, for interning.
    pub fn as_arc(&self) -> &Arc<str> {
        &self.0
    }

    pub fn iter(&self) -> impl Iterator<Item = Label<'_>> + '_ {
        self.0.split(SEPARATOR).map(Label::split_valid)
    }

    pub fn len(&self) -> usize {
        self.iter().count()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The labels as strings, for the wire.
    pub fn to_strings(&self) -> Vec<String> {
        self.0.split(SEPARATOR).map(str::to_owned).collect()
    }

    /// True if every label of `selector` is in this set.
    pub fn contains_all(&self, selector: &LabelSet) -> bool {
        let mut mine = self.iter().peekable();
        'outer: for wanted in selector.iter() {
            while let Some(label) = mine.peek() {
                match label.sort_key().cmp(&wanted.sort_key()) {
                    Ordering::Less => {
                        mine.next();
                    }
                    Ordering::Equal if label.value == wanted.value => continue 'outer,
                    _ => return false,
                }
            }
            return false;
        }
        true
    }

    /// A stable 64-bit hash of the canonical string (xxh3), for quarantine tombstones.
    /// Stable across processes and versions: it is persisted.
    pub fn stable_hash(&self) -> u64 {
        xxhash_rust::xxh3::xxh3_64(self.0.as_bytes())
    }
}

impl fmt::Debug for LabelSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LabelSet({:?})", &*self.0)
    }
}

impl fmt::Display for LabelSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for LabelSet {
    type Err = LabelError;

    /// Parses labels separated by `,` or `;` (`k8s:app=web,k8s:tier=db`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(
            s.split([',', ';']).map(str::trim).filter(|l| !l.is_empty()),
            &LabelLimits::default(),
        )
    }
}

impl serde::Serialize for LabelSet {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeSeq;
        let mut seq = serializer.serialize_seq(None)?;
        for label in self.0.split(SEPARATOR) {
            seq.serialize_element(label)?;
        }
        seq.end()
    }
}

impl<'de> serde::Deserialize<'de> for LabelSet {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let labels = Vec::<String>::deserialize(deserializer)?;
        Self::parse(&labels, &LabelLimits::default()).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests;
