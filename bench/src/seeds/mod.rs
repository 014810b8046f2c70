//! The field reports (`seeds/`), replayed on a real control plane: each report's own
//! recipe run against census as deployed in a cluster ([`world`]), with the
//! report's published figure beside census's. One module per report.

pub(crate) mod cache;
pub(crate) mod gc;
pub(crate) mod leak;
pub(crate) mod ready;
pub(crate) mod uid;
pub(crate) mod world;
