//! census's datapath from the agent's side: loading the eBPF object, the pinned
//! maps (ENDPOINTS, FLOWS) and their layout version, TCX attachments with pinned
//! links, and uninstall.
//!
//! This is the only module of the agent with `unsafe` code (in [`sys`], the raw
//! `bpf(2)` calls aya does not wrap).
//!
//! ```no_run
//! # fn main() -> Result<(), census_agent::bpf::Error> {
//! use census_agent::bpf::{DEFAULT_PIN_DIR, Datapath, Endpoint};
//!
//! let mut datapath = Datapath::open(DEFAULT_PIN_DIR)?;
//! datapath.upsert_endpoint("198.18.0.2".parse().unwrap(), Endpoint::local(4711))?;
//! datapath.attach("lxc0123")?;
//! for flow in datapath.flows()? {
//!     println!("{} -> {}: {} packets", flow.src_identity, flow.dst_identity, flow.packets);
//! }
//! # Ok(())
//! # }
//! ```

mod attach;
mod error;
mod inspect;
mod loader;
mod maps;
mod object;
mod pins;
mod privileges;
mod sys;

pub use attach::{AttachOutcome, Attachment, AttachmentState, Direction};
pub use census_common::{EndpointKey, LAYOUT_VERSION, identity};
pub use error::{CapabilityList, Error};
pub use inspect::{InspectError, Inspector, PinnedMapInfo, map_type_name};
pub use loader::{Datapath, ProgramStats, TestRunOutcome, enable_run_time_stats};
pub use maps::{Endpoint, EndpointFlags, Flow, MapShape};
pub use object::is_embedded as object_is_embedded;
pub use pins::{DEFAULT_PIN_DIR, Uninstalled, uninstall};
pub use privileges::check_capabilities;
