//! Kubernetes label syntax (apimachinery's `IsQualifiedName` and `IsValidLabelValue`),
//! and census's label sources.

use std::fmt;

const NAME_MAX: usize = 63;
const PREFIX_MAX: usize = 253;
const SOURCE_MAX: usize = 32;

/// What is wrong with a label's text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyntaxError {
    MissingSource,
    MissingValue,
    EmptySource,
    SourceTooLong,
    SourceChars,
    EmptyKey,
    EmptyName,
    NameTooLong,
    NameChars,
    PrefixTooLong,
    PrefixChars,
    ValueTooLong,
    ValueChars,
    NotCanonical,
}

impl fmt::Display for SyntaxError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = match self {
            Self::MissingSource => "expected `source:key=value` (no `:` after the source)",
            Self::MissingValue => {
                "expected `source:key=value` (no `=`; use `key=` for an empty value)"
            }
            Self::EmptySource => "the source is empty",
            Self::SourceTooLong => "the source is longer than 32 characters",
            Self::SourceChars => {
                "the source must be lowercase letters, digits and `-`, starting and ending with a letter or digit"
            }
            Self::EmptyKey => "the key is empty",
            Self::EmptyName => "the key's name (after any `prefix/`) is empty",
            Self::NameTooLong => "the key's name is longer than 63 characters",
            Self::NameChars => {
                "the key's name must be letters, digits, `-`, `_` and `.`, starting and ending with a letter or digit"
            }
            Self::PrefixTooLong => "the key's prefix is longer than 253 characters",
            Self::PrefixChars => "the key's prefix must be a DNS subdomain (lowercase, `a-z0-9-.`)",
            Self::ValueTooLong => "the value is longer than 63 characters",
            Self::ValueChars => {
                "the value must be empty or letters, digits, `-`, `_` and `.`, starting and ending with a letter or digit"
            }
            Self::NotCanonical => {
                "not in canonical form (sorted by source and key, `;`-separated, no duplicates)"
            }
        };
        f.write_str(text)
    }
}

fn is_alnum(b: u8) -> bool {
    b.is_ascii_alphanumeric()
}

/// `([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]`
fn is_qualified_name_part(s: &str) -> bool {
    let b = s.as_bytes();
    match (b.first(), b.last()) {
        (Some(&first), Some(&last)) => {
            is_alnum(first)
                && is_alnum(last)
                && b.iter()
                    .all(|&c| is_alnum(c) || c == b'-' || c == b'_' || c == b'.')
        }
        _ => false,
    }
}

/// RFC 1123 subdomain: dot-separated labels of `[a-z0-9]([-a-z0-9]*[a-z0-9])?`.
pub(crate) fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= PREFIX_MAX
        && s.split('.').all(|part| {
            let b = part.as_bytes();
            match (b.first(), b.last()) {
                (Some(&first), Some(&last)) => {
                    is_lower_alnum(first)
                        && is_lower_alnum(last)
                        && b.iter().all(|&c| is_lower_alnum(c) || c == b'-')
                }
                _ => false,
            }
        })
}

fn is_lower_alnum(b: u8) -> bool {
    b.is_ascii_lowercase() || b.is_ascii_digit()
}

/// RFC 1123 label: `[a-z0-9]([-a-z0-9]*[a-z0-9])?`, at most 63 characters.
pub(crate) fn is_dns_label(s: &str) -> bool {
    s.len() <= NAME_MAX && !s.contains('.') && is_dns_subdomain(s)
}

pub(super) fn check_source(source: &str) -> Result<(), SyntaxError> {
    if source.is_empty() {
        return Err(SyntaxError::EmptySource);
    }
    if source.len() > SOURCE_MAX {
        return Err(SyntaxError::SourceTooLong);
    }
    if !is_dns_label(source) {
        return Err(SyntaxError::SourceChars);
    }
    Ok(())
}

pub(super) fn check_key(key: &str) -> Result<(), SyntaxError> {
    if key.is_empty() {
        return Err(SyntaxError::EmptyKey);
    }
    let name = match key.split_once('/') {
        Some((prefix, name)) => {
            if prefix.len() > PREFIX_MAX {
                return Err(SyntaxError::PrefixTooLong);
            }
            if !is_dns_subdomain(prefix) {
                return Err(SyntaxError::PrefixChars);
            }
            name
        }
        None => key,
    };
    if name.is_empty() {
        return Err(SyntaxError::EmptyName);
    }
    if name.len() > NAME_MAX {
        return Err(SyntaxError::NameTooLong);
    }
    if !is_qualified_name_part(name) {
        return Err(SyntaxError::NameChars);
    }
    Ok(())
}

pub(super) fn check_value(value: &str) -> Result<(), SyntaxError> {
    if value.is_empty() {
        return Ok(());
    }
    if value.len() > NAME_MAX {
        return Err(SyntaxError::ValueTooLong);
    }
    if !is_qualified_name_part(value) {
        return Err(SyntaxError::ValueChars);
    }
    Ok(())
}
