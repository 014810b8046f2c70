//! Prometheus plumbing shared by both daemons' admin servers.
//!
//! **`/metrics` in two formats** ([`Format`], [`response`]): the classic
//! Prometheus text format 0.0.4 and OpenMetrics 1.0.0, both written by
//! prometheus-client's own encoders (`encoding::prometheus_text` and
//! `encoding::text`) from the one registry, chosen by the scraper's `Accept`
//! header as Prometheus's content negotiation describes (the highest `q` of the
//! formats offered; Prometheus sends both, OpenMetrics preferred). They differ
//! where it matters to parsers: a counter's `HELP`/`TYPE` name is `x_total` in
//! the text format and `x` in OpenMetrics (whose samples are `x_total`), which a
//! text-format parser such as `promtool check metrics` reads as a sample without
//! help. Without an `Accept` that names either, the answer is OpenMetrics.
//!
//! **Process memory**, read at scrape time ([`ProcessCollector`]):
//!
//! - `process_resident_memory_bytes`: resident set size, from `/proc/self/statm`
//!   (the name the Prometheus client libraries' process collectors use);
//! - `census_process_heap_live_bytes`: bytes allocated and not yet freed, counted by
//!   [`crate::CountingJemalloc`] (absent when it is not the global allocator);
//! - `census_process_jemalloc_{allocated,active,resident,metadata,retained}_bytes`:
//!   jemalloc's own statistics (`stats.*`), which say where RSS above the live heap
//!   goes: bytes handed out, rounded up to size classes (`allocated`); pages of runs
//!   in use (`active`: those bytes and the free slots of partly used slabs); pages
//!   jemalloc holds resident (`resident`: active, metadata, and dirty pages not yet
//!   purged); its metadata; address space kept mapped but given back to the OS
//!   (`retained`, not in RSS). Absent with any other global allocator.

use std::fmt;

use axum::{
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::gauge::ConstGauge,
    registry::Registry,
};

/// An exposition format `/metrics` can answer in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// OpenMetrics text 1.0.0 (`application/openmetrics-text`).
    OpenMetrics,
    /// The Prometheus text format 0.0.4 (`text/plain; version=0.0.4`).
    Text,
}

impl Format {
    /// The format an `Accept` header asks for: of the media ranges that name a
    /// format written here, the one with the highest `q` (the first of equals);
    /// `text/*` is the text format; anything else, or no header, OpenMetrics.
    pub fn negotiate(accept: Option<&str>) -> Self {
        let mut best: Option<(f32, Self)> = None;
        for range in accept.unwrap_or_default().split(',') {
            let mut parts = range.split(';').map(str::trim);
            let media = parts.next().unwrap_or_default().to_ascii_lowercase();
            let mut q = 1.0_f32;
            let mut version = None;
            for param in parts {
                let Some((key, value)) = param.split_once('=') else {
                    continue;
                };
                let value = value.trim().trim_matches('"');
                match key.trim().to_ascii_lowercase().as_str() {
                    "q" => q = value.parse().unwrap_or(0.0),
                    "version" => version = Some(value.to_owned()),
                    _ => {}
                }
            }
            let format = match (media.as_str(), version.as_deref()) {
                ("application/openmetrics-text", None | Some("0.0.1" | "1.0.0")) => {
                    Self::OpenMetrics
                }
                ("text/plain", None | Some("0.0.4")) | ("text/*", None) => Self::Text,
                _ => continue,
            };
            if q > 0.0 && best.is_none_or(|(best_q, _)| q > best_q) {
                best = Some((q, format));
            }
        }
        best.map_or(Self::OpenMetrics, |(_, format)| format)
    }

    /// The `Content-Type` of an answer in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Self::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
            Self::Text => prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
        }
    }

    /// The registry's metrics in this format.
    pub fn encode(self, registry: &Registry) -> Result<String, fmt::Error> {
        let mut body = String::new();
        match self {
            Self::OpenMetrics => prometheus_client::encoding::text::encode(&mut body, registry)?,
            Self::Text => {
                prometheus_client::encoding::prometheus_text::encode(&mut body, registry)?;
            }
        }
        Ok(body)
    }
}

/// The answer to `GET /metrics`: the registry in the format the request's
/// `Accept` asks for (`Vary: Accept`, so caches keep the formats apart).
pub fn response(registry: &Registry, headers: &HeaderMap) -> Response {
    let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
    let format = Format::negotiate(accept);
    let mut response = match format.encode(registry) {
        Ok(body) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, format.content_type())],
            body,
        )
            .into_response(),
        Err(_) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            "encoding the metrics failed\n",
        )
            .into_response(),
    };
    response
        .headers_mut()
        .insert(header::VARY, HeaderValue::from_static("accept"));
    response
}

use crate::alloc::live_heap_bytes;

/// Resident set size of this process, in bytes; `None` where `/proc` cannot tell.
pub fn resident_memory_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages.saturating_mul(rustix::param::page_size() as u64))
}

/// Reads the process's memory at scrape time.
#[derive(Debug, Default, Clone, Copy)]
pub struct ProcessCollector;

impl ProcessCollector {
    pub fn new() -> Self {
        Self
    }
}

/// Encodes one gauge read at scrape time (a `Collector`'s building block); a value
/// beyond `i64` reads as `i64::MAX`.
pub fn gauge(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    value: u64,
) -> Result<(), fmt::Error> {
    let g = ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX));
    g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), fmt::Error> {
        if let Some(rss) = resident_memory_bytes() {
            gauge(
                &mut encoder,
                "process_resident_memory_bytes",
                "Resident memory size in bytes",
                rss,
            )?;
        }
        if let Some(live) = live_heap_bytes() {
            gauge(
                &mut encoder,
                "census_process_heap_live_bytes",
                "Heap bytes allocated and not yet freed (counted by the global allocator)",
                live,
            )?;
            for (name, help, value) in jemalloc_stats() {
                gauge(&mut encoder, name, help, value)?;
            }
        }
        Ok(())
    }
}

/// jemalloc's statistics, refreshed (`epoch`) at each read; none that cannot be read.
fn jemalloc_stats() -> Vec<(&'static str, &'static str, u64)> {
    use tikv_jemalloc_ctl::{epoch, stats};
    if epoch::advance().is_err() {
        return Vec::new();
    }
    let read = [
        (
            "census_process_jemalloc_allocated_bytes",
            "Bytes jemalloc has handed out and not had back (its own count of the live heap)",
            stats::allocated::read(),
        ),
        (
            "census_process_jemalloc_active_bytes",
            "Bytes in pages of jemalloc's runs in use (the live heap and free slots of partly used slabs)",
            stats::active::read(),
        ),
        (
            "census_process_jemalloc_resident_bytes",
            "Bytes in pages jemalloc holds resident (active, metadata, dirty pages not yet purged)",
            stats::resident::read(),
        ),
        (
            "census_process_jemalloc_metadata_bytes",
            "Bytes of jemalloc's own metadata",
            stats::metadata::read(),
        ),
        (
            "census_process_jemalloc_retained_bytes",
            "Bytes of address space jemalloc keeps mapped but has returned to the OS (not resident)",
            stats::retained::read(),
        ),
    ];
    read.into_iter()
        .filter_map(|(name, help, value)| Some((name, help, value.ok()? as u64)))
        .collect()
}

#[cfg(test)]
mod tests {
    use prometheus_client::{encoding::text::encode, metrics::counter::Counter};

    use super::*;

    #[test]
    fn the_format_is_the_scrapers_preference() {
        use Format::{OpenMetrics, Text};
        for (accept, want) in [
            (None, OpenMetrics),
            (Some("*/*"), OpenMetrics),
            (Some("text/plain"), Text),
            (Some("text/plain; version=0.0.4"), Text),
            (Some("text/plain;version=0.0.4;q=0.3,*/*;q=0.2"), Text),
            (Some("text/*"), Text),
            (Some("application/openmetrics-text"), OpenMetrics),
            // Prometheus 2's default scrape protocols.
            (
                Some(
                    "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;\
                     version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.1",
                ),
                OpenMetrics,
            ),
            // Prometheus 3's, with the text format first.
            (
                Some(
                    "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.6,text/plain;version=0.0.4;q=0.5,\
                     application/openmetrics-text;version=1.0.0;q=0.4,*/*;q=0.2",
                ),
                Text,
            ),
            (
                Some("application/openmetrics-text;q=0.2, TEXT/PLAIN;q=0.9"),
                Text,
            ),
            (Some("text/plain;q=0, application/json"), OpenMetrics),
            (Some("text/plain;version=9.9"), OpenMetrics),
        ] {
            assert_eq!(Format::negotiate(accept), want, "{accept:?}");
        }
    }

    #[test]
    fn counters_are_named_as_each_format_wants() -> Result<(), fmt::Error> {
        let mut registry = Registry::default();
        let counter = Counter::<u64>::default();
        counter.inc();
        registry.register("things", "Things done", counter);
        let text = Format::Text.encode(&registry)?;
        assert!(
            text.contains("# HELP things_total Things done.\n"),
            "{text}"
        );
        assert!(text.contains("# TYPE things_total counter\n"), "{text}");
        assert!(!text.contains("# EOF"), "{text}");
        let open = Format::OpenMetrics.encode(&registry)?;
        assert!(open.contains("# HELP things Things done.\n"), "{open}");
        assert!(open.ends_with("# EOF\n"), "{open}");
        Ok(())
    }

    #[test]
    fn resident_memory_is_read() {
        assert!(resident_memory_bytes().is_some_and(|b| b > 0));
    }

    #[test]
    fn the_collector_encodes_rss() -> Result<(), fmt::Error> {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(ProcessCollector::new()));
        let mut text = String::new();
        encode(&mut text, &registry)?;
        assert!(
            text.contains("# TYPE process_resident_memory_bytes gauge"),
            "{text}"
        );
        Ok(())
    }
}
