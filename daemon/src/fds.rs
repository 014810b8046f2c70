//! The process's limit on open descriptors, which caps on connections must fit in.

/// Descriptors a daemon keeps for itself besides its gRPC connections: listeners, the
/// store's files, the API server's connections, the admin port's clients, logs.
pub const RESERVED_FDS: u64 = 256;

/// The soft limit on open descriptors (`RLIMIT_NOFILE`), if it has one.
pub fn soft_limit() -> Option<u64> {
    rustix::process::getrlimit(rustix::process::Resource::Nofile).current
}

/// Why `max_connections` cannot all be open under a descriptor limit of `limit`, with
/// [`RESERVED_FDS`] kept back; `None` when they fit (or there is no limit).
pub fn over_limit(flag: &str, max_connections: u64, limit: Option<u64>) -> Option<String> {
    let limit = limit?;
    let room = limit.saturating_sub(RESERVED_FDS);
    (max_connections > room).then(|| {
        format!(
            "{flag} {max_connections} is above what the open-file limit allows: {limit} descriptors, {RESERVED_FDS} of them kept for listeners, files and other clients, leave room for {room} connections; past that, accepting fails (EMFILE) and every client waits. Raise the limit (ulimit -n, LimitNOFILE, the container runtime's nofile) or lower {flag}"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_must_fit_under_the_limit_with_room_kept_back() {
        assert_eq!(over_limit("--max-connections", 8192, None), None);
        assert_eq!(over_limit("--max-connections", 8192, Some(1 << 20)), None);
        assert_eq!(over_limit("--max-connections", 768, Some(1024)), None);
        let warning = over_limit("--max-connections", 8192, Some(1024)).unwrap_or_default();
        assert!(
            warning.contains("--max-connections 8192")
                && warning.contains("1024 descriptors")
                && warning.contains("room for 768"),
            "{warning}"
        );
        assert!(over_limit("--max-connections", 10, Some(100)).is_some());
    }

    #[test]
    fn this_process_has_a_limit() {
        assert!(soft_limit().is_some_and(|n| n > 0));
    }
}
