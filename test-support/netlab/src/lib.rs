//! Network namespaces for privileged tests.
