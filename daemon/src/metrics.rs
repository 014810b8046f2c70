//! Process memory for Prometheus, read at scrape time:
//!
//! - `process_resident_memory_bytes`: resident set size, from `/proc/self/statm`
//!   (the name the Prometheus client libraries' process collectors use);
//! - `census_process_heap_live_bytes`: bytes allocated and not yet freed, counted by
//!   [`crate::CountingJemalloc`] (absent when it is not the global allocator).

use std::fmt;

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::gauge::ConstGauge,
};

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

fn gauge(
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
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use prometheus_client::{encoding::text::encode, registry::Registry};

    use super::*;

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
