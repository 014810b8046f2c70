//! Text a client sent, as it may appear in a log line or an error message: at most
//! [`SHOWN_BYTES`] of it, control characters escaped, and the full length said when
//! it was cut. Text that is already escaped (a `Debug` form) passes unchanged. A caller's 30 MiB `agent_version` costs the log one short line, and a
//! newline or a terminal escape in a node name cannot forge or colour one.

use std::fmt::{self, Write as _};

/// Bytes of a client's text shown at most.
pub(crate) const SHOWN_BYTES: usize = 256;

/// `text` as it may be shown: see the module's documentation.
pub(crate) fn untrusted(text: &str) -> Untrusted<'_> {
    Untrusted(text)
}

/// A client's text, displayed bounded and escaped.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Untrusted<'a>(&'a str);

impl fmt::Display for Untrusted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut cut = self.0.len().min(SHOWN_BYTES);
        while !self.0.is_char_boundary(cut) {
            cut -= 1;
        }
        for c in self.0[..cut].chars() {
            if c.is_control() {
                write!(f, "{}", c.escape_default())?;
            } else {
                f.write_char(c)?;
            }
        }
        if cut < self.0.len() {
            write!(f, "... ({} bytes in all)", self.0.len())?;
        }
        Ok(())
    }
}

impl Untrusted<'_> {
    /// The shown form, owned.
    pub(crate) fn owned(self) -> String {
        self.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_text_is_cut_at_a_character_and_says_its_length() {
        let long = "é".repeat(1000);
        let shown = untrusted(&long).owned();
        assert!(shown.len() < SHOWN_BYTES + 40, "{}", shown.len());
        assert!(shown.ends_with("... (2000 bytes in all)"), "{shown}");
        assert!(shown.starts_with("éé"));
    }

    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(
            untrusted("node-a\nINFO forged\u{1b}[31m").owned(),
            "node-a\\nINFO forged\\u{1b}[31m"
        );
        assert_eq!(untrusted("v1.2.3").owned(), "v1.2.3");
    }
}
