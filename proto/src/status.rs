//! gRPC status codes as bounded metric labels and log words, one spelling for both
//! daemons: the names of the gRPC specification (`OK`, `InvalidArgument`, ...), which
//! is what grpc-go's and grpc-java's Prometheus interceptors put in `grpc_code`, so
//! existing dashboards and alerts work on census's metrics unchanged.

use tonic::Code;

/// The label of `code`.
pub fn code_label(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "Cancelled",
        Code::Unknown => "Unknown",
        Code::InvalidArgument => "InvalidArgument",
        Code::DeadlineExceeded => "DeadlineExceeded",
        Code::NotFound => "NotFound",
        Code::AlreadyExists => "AlreadyExists",
        Code::PermissionDenied => "PermissionDenied",
        Code::ResourceExhausted => "ResourceExhausted",
        Code::FailedPrecondition => "FailedPrecondition",
        Code::Aborted => "Aborted",
        Code::OutOfRange => "OutOfRange",
        Code::Unimplemented => "Unimplemented",
        Code::Internal => "Internal",
        Code::Unavailable => "Unavailable",
        Code::DataLoss => "DataLoss",
        Code::Unauthenticated => "Unauthenticated",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_has_its_own_label_in_the_specification_spelling() {
        let labels: std::collections::BTreeSet<_> =
            (0..=16).map(|n| code_label(Code::from_i32(n))).collect();
        assert_eq!(labels.len(), 17, "{labels:?}");
        assert_eq!(code_label(Code::Ok), "OK");
        assert_eq!(code_label(Code::InvalidArgument), "InvalidArgument");
        // tonic's Debug is the same spelling, except for OK.
        for n in 1..=16 {
            let code = Code::from_i32(n);
            assert_eq!(code_label(code), format!("{code:?}"));
        }
    }
}
