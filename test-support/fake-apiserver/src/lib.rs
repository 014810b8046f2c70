//! A fake Kubernetes API server for tests.
