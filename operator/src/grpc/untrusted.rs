//! Text a client sent, as it may appear in a log line or an error message: at most
//! [`SHOWN_BYTES`] of it, control characters escaped, and the full length said when
//! it was cut. Text that is already escaped (a `Debug` form) passes unchanged. A caller's 30 MiB `agent_version` costs the log one short line, and a
//! newline or a terminal escape in a node name cannot forge or colour one.

use census_proto::text::Escaped;

/// Bytes of a client's text shown at most.
pub(crate) const SHOWN_BYTES: usize = 256;

/// A client's text, displayed bounded and escaped.
pub(crate) type Untrusted<'a> = Escaped<'a>;

/// `text` as it may be shown: see the module's documentation.
pub(crate) fn untrusted(text: &str) -> Untrusted<'_> {
    Escaped {
        text,
        max: SHOWN_BYTES,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_text_is_cut_at_a_character_and_says_its_length() {
        let long = "é".repeat(1000);
        let shown = untrusted(&long).to_string();
        assert!(shown.len() < SHOWN_BYTES + 40, "{}", shown.len());
        assert!(shown.ends_with("... (2000 bytes in all)"), "{shown}");
        assert!(shown.starts_with("éé"));
    }

    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(
            untrusted("node-a\nINFO forged\u{1b}[31m").to_string(),
            "node-a\\nINFO forged\\u{1b}[31m"
        );
        assert_eq!(untrusted("v1.2.3").to_string(), "v1.2.3");
    }
}
