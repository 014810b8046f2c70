//! Text from elsewhere (a client, a file, a library's error) bounded before it goes
//! into an error, a log line or a status message, so a hostile or runaway input
//! cannot make one huge. One helper for every such place; each says its own limit.

use std::{
    borrow::Cow,
    fmt::{self, Write as _},
};

/// `text` cut to at most `max` bytes at a character boundary, with `...` after
/// when it was cut.
pub fn cut(text: &str, max: usize) -> Cow<'_, str> {
    if text.len() <= max {
        return Cow::Borrowed(text);
    }
    Cow::Owned(format!("{}...", &text[..text.floor_char_boundary(max)]))
}

/// `text` shown with its control characters escaped, at most `max` bytes of it,
/// and how long it was when it was cut: `abc\n... (70000 bytes in all)`.
#[derive(Debug, Clone, Copy)]
pub struct Escaped<'a> {
    pub text: &'a str,
    pub max: usize,
}

impl fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shown = &self.text[..self.text.floor_char_boundary(self.max)];
        for c in shown.chars() {
            if c.is_control() {
                write!(f, "{}", c.escape_default())?;
            } else {
                f.write_char(c)?;
            }
        }
        if shown.len() < self.text.len() {
            write!(f, "... ({} bytes in all)", self.text.len())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_cut_at_a_character_boundary_and_says_so() {
        assert_eq!(cut("short", 10), "short");
        assert!(matches!(cut("short", 5), Cow::Borrowed(_)));
        assert_eq!(cut("abcdef", 3), "abc...");
        // 'é' is two bytes: the cut falls before it, not inside it.
        assert_eq!(cut("aéb", 2), "a...");
        assert_eq!(cut(&"x".repeat(10_000), 300).len(), 303);
    }

    #[test]
    fn escaped_text_shows_its_control_characters_and_its_length() {
        let show = |text, max| Escaped { text, max }.to_string();
        assert_eq!(show("a\nb\u{1b}", 10), "a\\nb\\u{1b}");
        assert_eq!(show("abcdef", 3), "abc... (6 bytes in all)");
        assert_eq!(show("aéb", 2), "a... (4 bytes in all)");
    }
}
