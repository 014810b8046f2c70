//! census's gRPC methods by path, as bounded names for metrics and refusals.

/// The EndpointSync stream: its messages after an accepted Hello may be snapshots.
pub const SYNC_PATH: &str = "/census.v1.EndpointSync/Sync";

/// A bounded metric label for a gRPC path.
pub fn method_name(path: &str) -> &'static str {
    match path {
        "/census.v1.IdentityService/Allocate" => "IdentityService/Allocate",
        "/census.v1.IdentityService/Get" => "IdentityService/Get",
        "/census.v1.IdentityService/Lookup" => "IdentityService/Lookup",
        "/census.v1.IdentityService/List" => "IdentityService/List",
        "/census.v1.IdentityService/Watch" => "IdentityService/Watch",
        SYNC_PATH => "EndpointSync/Sync",
        "/census.v1.EndpointMap/Watch" => "EndpointMap/Watch",
        "/census.v1.EndpointMap/Lookup" => "EndpointMap/Lookup",
        "/census.v1.NodeService/ListNodes" => "NodeService/ListNodes",
        "/census.v1.NodeService/GetNode" => "NodeService/GetNode",
        "/census.v1.NodeService/GetVersion" => "NodeService/GetVersion",
        "/grpc.health.v1.Health/Check" => "Health/Check",
        "/grpc.health.v1.Health/Watch" => "Health/Watch",
        p if p.starts_with("/grpc.reflection.") => "reflection",
        _ => "other",
    }
}

/// The methods whose requests are streams of messages: their message timer runs
/// per message rather than from the start of the call.
pub fn is_client_stream(path: &str) -> bool {
    path == SYNC_PATH || path.starts_with("/grpc.reflection.")
}
