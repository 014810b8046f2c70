//! census's datapath from the agent's side: loading the eBPF object, the pinned
//! maps (ENDPOINTS, INTERFACES, FLOWS) and their layout version, attachments (TCX
//! links pinned, or TC filters recorded, as the kernel allows), and uninstall.
//!
//! This is the only module of the agent with `unsafe` code (in [`sys`], the raw
//! `bpf(2)` calls aya does not wrap and the mapping of INTERFACES' memory, and in
//! [`probe`], the TCX probe).
//!
//! ```no_run
//! # fn main() -> Result<(), census_agent::bpf::Error> {
//! use census_agent::bpf::{DEFAULT_PIN_DIR, Datapath, Endpoint, Interface};
//!
//! let mut datapath = Datapath::open(DEFAULT_PIN_DIR)?;
//! datapath.upsert_endpoint("198.18.0.2".parse().unwrap(), Endpoint::local(4711))?;
//! let attached = datapath.attach("lxc0123")?;
//! // Once both hooks are attached: the endpoint behind the interface.
//! datapath.set_interface(Interface { ifindex: attached.ifindex, identity: Some(4711) })?;
//! for flow in datapath.flows()? {
//!     println!("{} -> {}: {} packets", flow.src_identity, flow.dst_identity, flow.packets);
//! }
//! # Ok(())
//! # }
//! ```

mod attach;
mod error;
mod filter;
mod inspect;
mod loader;
mod lock;
mod log;
mod maps;
mod migrate;
mod nodes;
mod object;
mod pins;
mod privileges;
mod probe;
mod repin;
mod service_flows;
mod services;
mod sockets;
mod sys;
mod tc;
mod uplink;

pub use self::log::DatapathLog;
pub use attach::{AttachOutcome, Attached, Attachment, AttachmentState, Direction, InFront};
pub use census_common::{EndpointKey, LAYOUT_VERSION, identity, interface_slot};
pub use error::{CapabilityList, Error, NodeRole};
pub use inspect::{InspectError, Inspector, PinnedMapInfo, map_type_name};
pub use loader::{
    Datapath, Options as DatapathOptions, ProgramStats, TestContext, TestRunOutcome,
    enable_run_time_stats,
};
pub use lock::LockHolder;
pub use maps::{DatapathStats, Endpoint, EndpointFlags, Flow, Interface, MapShape};
pub use nodes::NodeRecord;
pub use object::is_embedded as object_is_embedded;
pub use pins::{DEFAULT_PIN_DIR, Uninstalled, uninstall};
pub use privileges::check_capabilities;
pub use probe::{AttachMode, AttachModeChoice, MINIMUM_KERNEL, check_kernel};
pub use repin::Repinned;
pub use service_flows::{ServiceDirection, ServiceFlow, protocol_name};
pub use services::{MarkBit, MarkBitError, ServiceKind};
pub use sockets::find_cgroup2_root;
pub use uplink::default_uplinks;
