//! census agent
