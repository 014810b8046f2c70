//! Rendering: aligned plain tables for people (comfy-table, no borders), JSON and YAML
//! for scripts, and the short durations tables show.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::ValueEnum;
use comfy_table::{ContentArrangement, presets};
use serde::Serialize;

use super::error::CliError;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Format {
    /// Aligned columns.
    Table,
    /// JSON (pretty-printed; see docs/cli.md for every shape).
    Json,
    /// YAML (the same shapes as JSON).
    Yaml,
}

/// A table: a header and rows of cells, rendered as aligned columns without borders.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
    /// Printed above the table (with its header).
    preamble: Vec<String>,
}

/// Columns are separated by this many spaces.
const GAP: u16 = 2;

impl Table {
    pub(crate) fn new<S: Into<String>>(header: impl IntoIterator<Item = S>) -> Self {
        Self {
            header: header.into_iter().map(Into::into).collect(),
            ..Self::default()
        }
    }

    pub(crate) fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// A line printed above the header (not with `--no-headers`).
    pub(crate) fn preamble(&mut self, line: String) {
        self.preamble.push(line);
    }

    pub(crate) fn render(&self, no_headers: bool) -> String {
        let mut out = String::new();
        if !no_headers {
            for line in &self.preamble {
                out.push_str(line);
                out.push('\n');
            }
        }
        let show_header = !no_headers && !self.header.is_empty();
        if !show_header && self.rows.is_empty() {
            return out;
        }
        let mut table = comfy_table::Table::new();
        table
            .load_style(presets::NOTHING)
            .set_content_arrangement(ContentArrangement::Disabled)
            .force_no_tty();
        if show_header {
            table.set_header(self.header.clone());
        }
        for row in &self.rows {
            table.add_row(row.clone());
        }
        for column in table.column_iter_mut() {
            column.set_padding((0, GAP));
        }
        out.push_str(&table.trim_fmt());
        out.push('\n');
        out
    }
}

/// `value` as JSON or YAML, or `table()` rendered.
pub(crate) fn render<T: Serialize + ?Sized>(
    format: Format,
    no_headers: bool,
    value: &T,
    table: impl FnOnce() -> Table,
) -> Result<String, CliError> {
    match format {
        Format::Table => Ok(table().render(no_headers)),
        Format::Json => serde_json::to_string_pretty(value)
            .map(|mut json| {
                json.push('\n');
                json
            })
            .map_err(|e| CliError::Encode {
                format: "JSON",
                reason: e.to_string(),
            }),
        Format::Yaml => serde_yaml_ng::to_string(value).map_err(|e| CliError::Encode {
            format: "YAML",
            reason: e.to_string(),
        }),
    }
}

/// `d` in at most two units: `45s`, `3m4s`, `2h5m`, `3d4h`.
pub(crate) fn short_duration(d: Duration) -> String {
    let s = d.as_secs();
    let (days, hours, minutes, seconds) = (s / 86_400, s / 3600 % 24, s / 60 % 60, s % 60);
    match (days, hours, minutes) {
        (0, 0, 0) => format!("{seconds}s"),
        (0, 0, _) => format!("{minutes}m{seconds}s"),
        (0, _, _) => format!("{hours}h{minutes}m"),
        _ => format!("{days}d{hours}h"),
    }
}

/// Milliseconds since the Unix epoch as a point in time.
pub(crate) fn from_millis(ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms)
}

/// How long ago `ms` (ms since the Unix epoch) was: `12s ago`, or `never` for 0.
pub(crate) fn ago(now: SystemTime, ms: u64) -> String {
    if ms == 0 {
        return "never".to_owned();
    }
    let elapsed = now.duration_since(from_millis(ms)).unwrap_or_default();
    format!("{} ago", short_duration(elapsed))
}

/// How long until `ms` (ms since the Unix epoch), zero if it has passed.
pub(crate) fn until(now: SystemTime, ms: u64) -> String {
    short_duration(from_millis(ms).duration_since(now).unwrap_or_default())
}

/// `None` for the wire's "unset" 0.
pub(crate) fn nonzero(ms: u64) -> Option<u64> {
    (ms != 0).then_some(ms)
}

pub(crate) fn yes_no(b: bool) -> String {
    if b { "yes" } else { "no" }.to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_are_aligned_without_borders() {
        let mut table = Table::new(["ID", "LABELS"]);
        table.row(vec!["256".into(), "k8s:app=web".into()]);
        table.row(vec!["65535".into(), String::new()]);
        assert_eq!(
            table.render(false),
            "ID     LABELS\n256    k8s:app=web\n65535\n"
        );
        assert_eq!(table.render(true), "256    k8s:app=web\n65535\n");
    }

    #[test]
    fn an_empty_table_is_its_header() {
        let mut table = Table::new(["A", "B"]);
        table.preamble("node n1".into());
        assert_eq!(table.render(false), "node n1\nA  B\n");
        assert_eq!(table.render(true), "");
    }

    #[test]
    fn durations_are_short() {
        let cases = [
            (0, "0s"),
            (45, "45s"),
            (184, "3m4s"),
            (7500, "2h5m"),
            (3 * 86_400 + 4 * 3600 + 5, "3d4h"),
        ];
        for (secs, want) in cases {
            assert_eq!(short_duration(Duration::from_secs(secs)), want);
        }
        let now = from_millis(100_000);
        assert_eq!(ago(now, 0), "never");
        assert_eq!(ago(now, 88_000), "12s ago");
        assert_eq!(ago(now, 200_000), "0s ago", "clock skew is not negative");
        assert_eq!(until(now, 160_000), "1m0s");
    }
}
