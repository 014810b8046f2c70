//! The label filter: which pod labels make up an identity.
//!
//! Labels that are unique per pod or per run (`job-name`, `controller-uid`,
//! `pod-template-hash`, ...) would give every pod its own identity and make identities
//! churn with pods. The default filter drops them and keeps what users select on,
//! `app.kubernetes.io/*` included.

use std::{fmt, str::FromStr};

use super::{NAMESPACE_KEY, SERVICE_ACCOUNT_KEY};

/// Keys dropped by default: unique per pod, per run or per revision.
pub const DEFAULT_EXCLUDE: &[&str] = &[
    "controller-uid",
    "batch.kubernetes.io/controller-uid",
    "job-name",
    "batch.kubernetes.io/job-name",
    "pod-template-hash",
    "controller-revision-hash",
    "pod-template-generation",
    "statefulset.kubernetes.io/pod-name",
    "apps.kubernetes.io/pod-index",
    "batch.kubernetes.io/job-completion-index",
    "kubernetes.io/*",
    "k8s.io/*",
    "beta.kubernetes.io/*",
    "io.kubernetes.*",
];

/// A label key, or a key prefix ending in `*`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum KeyPattern {
    Exact(String),
    Prefix(String),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PatternError {
    #[error("label key pattern {0:?} is empty")]
    Empty(String),
    #[error("label key pattern {0:?}: `*` may only end a pattern")]
    InnerStar(String),
    #[error("label key pattern {0:?} has characters no label key can have")]
    Chars(String),
}

impl KeyPattern {
    pub fn matches(&self, key: &str) -> bool {
        match self {
            Self::Exact(k) => k == key,
            Self::Prefix(p) => key.starts_with(p.as_str()),
        }
    }
}

impl FromStr for KeyPattern {
    type Err = PatternError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        let (body, prefix) = match s.strip_suffix('*') {
            Some(body) => (body, true),
            None => (s, false),
        };
        if body.is_empty() && !prefix {
            return Err(PatternError::Empty(s.to_owned()));
        }
        if body.contains('*') {
            return Err(PatternError::InnerStar(s.to_owned()));
        }
        let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/');
        if !body.chars().all(allowed) || body.matches('/').count() > 1 {
            return Err(PatternError::Chars(s.to_owned()));
        }
        Ok(if prefix {
            Self::Prefix(body.to_owned())
        } else {
            Self::Exact(body.to_owned())
        })
    }
}

impl fmt::Display for KeyPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Exact(k) => f.write_str(k),
            Self::Prefix(p) => write!(f, "{p}*"),
        }
    }
}

/// Decides which labels are identity labels. A key is kept when it matches an
/// `include` pattern or matches no `exclude` pattern; the two labels census adds
/// (namespace and service account) are always kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LabelFilter {
    include: Vec<KeyPattern>,
    exclude: Vec<KeyPattern>,
}

impl Default for LabelFilter {
    fn default() -> Self {
        Self::new(Vec::new(), Vec::new(), true)
    }
}

impl LabelFilter {
    /// A filter with `include` and `exclude` patterns, plus [`DEFAULT_EXCLUDE`] when
    /// `with_defaults` is set.
    pub fn new(include: Vec<KeyPattern>, exclude: Vec<KeyPattern>, with_defaults: bool) -> Self {
        let mut all_exclude: Vec<KeyPattern> = if with_defaults {
            DEFAULT_EXCLUDE
                .iter()
                .filter_map(|p| p.parse().ok())
                .collect()
        } else {
            Vec::new()
        };
        for pattern in exclude {
            if !all_exclude.contains(&pattern) {
                all_exclude.push(pattern);
            }
        }
        Self {
            include,
            exclude: all_exclude,
        }
    }

    /// Builds a filter from its wire form, as received in HelloReply. The lists are
    /// complete (defaults already applied by the operator).
    pub fn from_parts<I, E>(include: I, exclude: E) -> Result<Self, PatternError>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
        E: IntoIterator,
        E::Item: AsRef<str>,
    {
        let include = include
            .into_iter()
            .map(|p| p.as_ref().parse())
            .collect::<Result<_, _>>()?;
        let exclude = exclude
            .into_iter()
            .map(|p| p.as_ref().parse())
            .collect::<Result<_, _>>()?;
        Ok(Self { include, exclude })
    }

    pub fn include(&self) -> &[KeyPattern] {
        &self.include
    }

    pub fn exclude(&self) -> &[KeyPattern] {
        &self.exclude
    }

    /// True if a label with this key is an identity label.
    pub fn keeps(&self, key: &str) -> bool {
        key == NAMESPACE_KEY
            || key == SERVICE_ACCOUNT_KEY
            || self.include.iter().any(|p| p.matches(key))
            || !self.exclude.iter().any(|p| p.matches(key))
    }
}
