//! The field reports (`seeds/`), replayed on a real control plane: each report's own
//! recipe run against census as deployed in a cluster ([`world`]), with the
//! report's published figure beside census's. One module per report, and [`demo`],
//! seed-leak's story for a user to watch.

pub(crate) mod cache;
pub(crate) mod demo;
pub(crate) mod gc;
pub(crate) mod leak;
pub(crate) mod ready;
pub(crate) mod uid;
pub(crate) mod world;
