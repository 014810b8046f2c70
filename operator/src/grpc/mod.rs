//! The gRPC server: IdentityService, EndpointSync, EndpointMap, NodeService, gRPC health and
//! reflection (v1 and v1alpha), with a metrics layer.
//!
//! Connections come from the transport crate's accept loop (`census_transport::conn`:
//! a connection cap, handshake and idle timeouts), and every request body is held to
//! its method's message limit and timeout as it streams in (`census_transport::codec`);
//! what a client sent reaches logs and errors only bounded and escaped (`untrusted`).
//!
//! The services reach the operator only through [`Api`], in domain types. This is
//! the one module that knows the wire: it decodes and validates requests, encodes
//! answers and the operator's messages to agents (`convert`), and turns refusals into
//! precise statuses, a follower's naming the leader (`status`).

pub(crate) mod auth;
mod convert;
mod endpoint_map;
mod identity;
mod node;
mod quota;
mod status;
mod sync;
mod untrusted;

use std::{
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::{Duration, Instant},
};

use census_proto::pb::{
    self, identity_service_server::IdentityServiceServer, node_service_server::NodeServiceServer,
};
use census_transport::{
    budget::MessageBudget,
    codec::{self, MessageLimits},
    conn::{self, ConnLimits},
    methods::method_name,
};
use tokio::{net::TcpListener, sync::watch};
use tower::{Layer, Service};

use self::endpoint_map::{EndpointMapServer, EndpointMapService};
pub(crate) use self::{
    endpoint_map::WireMap,
    identity::Identities,
    node::Nodes,
    quota::QuotaLimits,
    sync::{EndpointStreams, EndpointSyncServer},
};
use crate::{
    api::Api,
    metrics::{GrpcLabels, MethodLabels, Metrics},
};

/// The operator, as every service reaches it.
type Operator = Arc<dyn Api>;

#[derive(Debug, thiserror::Error)]
pub(crate) enum ServeError {
    #[error("reflection service: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    #[error("gRPC server: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// HTTP/2 keepalive of every connection: a ping each `interval`, closed when one
/// goes unanswered for `timeout`. It is what makes an agent's stream "open" in the
/// sense of the session rule (DESIGN.md, "Sessions and ordering"): a crashed agent's
/// half-open stream ends within interval + timeout, and a restarted agent whose clock
/// stepped back gets in after that.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Keepalive {
    pub(crate) interval: Duration,
    pub(crate) timeout: Duration,
}

/// What the gRPC server's connections and callers are held to.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Transport {
    pub(crate) keepalive: Keepalive,
    pub(crate) max_connections: usize,
    pub(crate) max_streams_per_connection: u32,
    pub(crate) max_header_list_bytes: u32,
    pub(crate) handshake_timeout: Duration,
    pub(crate) idle_timeout: Duration,
    pub(crate) message_timeout: Duration,
    /// What one caller, and every caller together, may hold open.
    pub(crate) quotas: QuotaLimits,
}

/// The server's TLS, as read from its files: the serving certificate and key (PEM),
/// the CA of client certificates when clients must present one, and how long a
/// handshake may take.
#[derive(Debug, Clone)]
pub(crate) struct ServerTls {
    pub(crate) cert_pem: Vec<u8>,
    pub(crate) key_pem: Vec<u8>,
    /// Required when set: a connection without a certificate of this CA fails its
    /// handshake.
    pub(crate) client_ca_pem: Option<Vec<u8>>,
    /// What a follower verifies the leader with when it forwards (`--tls-ca`).
    pub(crate) leader: Option<LeaderTls>,
    pub(crate) handshake_timeout: Duration,
}

/// What a follower verifies the leader's TLS with when it forwards (`--tls-ca`).
#[derive(Debug, Clone)]
pub(crate) struct LeaderTls {
    /// The CA that signed the serving certificate (PEM).
    pub(crate) ca_pem: Vec<u8>,
    /// The serving certificate's first DNS name, which the leader's certificate must
    /// be valid for.
    pub(crate) server_name: String,
}

impl ServerTls {
    fn config(&self) -> tonic::transport::ServerTlsConfig {
        use tonic::transport::{Certificate, Identity, ServerTlsConfig};
        let config = ServerTlsConfig::new()
            .identity(Identity::from_pem(&self.cert_pem, &self.key_pem))
            .timeout(self.handshake_timeout);
        match &self.client_ca_pem {
            Some(ca) => config.client_ca_root(Certificate::from_pem(ca)),
            None => config,
        }
    }
}

/// Serves `operator` until `shutdown` turns true, then stops accepting and drains.
/// With `tls`, every connection is TLS; `auth` authenticates every call but health
/// and reflection ([`auth::AuthLayer`]).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn serve(
    listener: TcpListener,
    operator: Operator,
    metrics: Metrics,
    transport: Transport,
    map_batch_entries: usize,
    auth: Arc<dyn auth::Authenticate>,
    tls: Option<ServerTls>,
    shutdown: watch::Receiver<bool>,
) -> Result<(), ServeError> {
    let settings = operator.settings();
    let max = settings.max_message_bytes;
    let limits = MessageLimits {
        request_bytes: codec::request_limit(settings.wire.labels.max_labels),
        stream_bytes: max,
        timeout: transport.message_timeout,
        budget: MessageBudget::new(
            transport.quotas.inflight_message_bytes,
            metrics.inflight_message_bytes.clone(),
        ),
    };
    let quotas = quota::Quotas::new(transport.quotas, metrics.quota_refusals.clone());
    // Map messages are chunks of at most `map_batch_entries` items.
    let map = EndpointMapServer::new(EndpointMapService::new(
        operator.clone(),
        metrics.clone(),
        shutdown.clone(),
        endpoint_map::max_batch_bytes(map_batch_entries),
        Arc::clone(&quotas),
    ));
    let identities = IdentityServiceServer::new(Identities::new(
        operator.clone(),
        metrics.clone(),
        shutdown.clone(),
        Arc::clone(&quotas),
    ))
    .max_decoding_message_size(max)
    .max_encoding_message_size(max);
    let sync = EndpointSyncServer::new(
        EndpointStreams::new(operator.clone(), metrics.clone(), shutdown.clone(), quotas),
        max,
    );
    let nodes = NodeServiceServer::new(Nodes::new(operator, tls.as_ref()))
        .max_decoding_message_size(max)
        .max_encoding_message_size(max);

    let health = health().await;
    let (reflection_v1, reflection_v1alpha) = reflection()?;

    let connections = Arc::new(conn::Connections::default());
    let incoming = conn::incoming(
        listener,
        ConnLimits {
            max_connections: transport.max_connections,
            handshake_timeout: transport.handshake_timeout,
            idle_timeout: transport.idle_timeout,
        },
        metrics.grpc_connections.clone(),
        Arc::clone(&connections),
    );
    let requests = conn::RequestLayer {
        connections,
        limits,
        refused: metrics.grpc_messages_refused.clone(),
    };
    let keepalive = transport.keepalive;
    let mut stop = shutdown.clone();
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = &tls {
        builder = builder.tls_config(tls.config())?;
    }
    builder
        .http2_keepalive_interval(Some(keepalive.interval))
        .http2_keepalive_timeout(Some(keepalive.timeout))
        .max_concurrent_streams(Some(transport.max_streams_per_connection))
        .initial_stream_window_size(conn::STREAM_WINDOW_BYTES)
        .initial_connection_window_size(conn::CONNECTION_WINDOW_BYTES)
        .http2_max_header_list_size(Some(transport.max_header_list_bytes))
        // The metrics see the codes the request layer maps.
        .layer(GrpcMetricsLayer { metrics })
        .layer(requests)
        .layer(auth::AuthLayer::new(auth))
        .add_service(identities)
        .add_service(sync)
        .add_service(map)
        .add_service(nodes)
        .add_service(health)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .serve_with_incoming_shutdown(incoming, async move {
            let _ = stop.wait_for(|stopping| *stopping).await;
        })
        .await?;
    Ok(())
}

/// gRPC health, every census service serving.
async fn health()
-> tonic_health::pb::health_server::HealthServer<impl tonic_health::pb::health_server::Health> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_serving::<IdentityServiceServer<Identities>>()
        .await;
    reporter.set_serving::<EndpointSyncServer>().await;
    reporter.set_serving::<NodeServiceServer<Nodes>>().await;
    reporter.set_serving::<EndpointMapServer>().await;
    health
}

/// Reflection, v1 and v1alpha, describing census's services and health.
#[allow(
    clippy::type_complexity,
    reason = "the two services' types, as tonic names them"
)]
fn reflection() -> Result<
    (
        tonic_reflection::pb::v1::server_reflection_server::ServerReflectionServer<
            impl tonic_reflection::pb::v1::server_reflection_server::ServerReflection,
        >,
        tonic_reflection::pb::v1alpha::server_reflection_server::ServerReflectionServer<
            impl tonic_reflection::pb::v1alpha::server_reflection_server::ServerReflection,
        >,
    ),
    ServeError,
> {
    let v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()?;
    Ok((v1, v1alpha))
}

/// Counts calls by method and status code, and times them.
#[derive(Debug, Clone)]
struct GrpcMetricsLayer {
    metrics: Metrics,
}

impl<S> Layer<S> for GrpcMetricsLayer {
    type Service = GrpcMetrics<S>;

    fn layer(&self, inner: S) -> Self::Service {
        GrpcMetrics {
            inner,
            metrics: self.metrics.clone(),
        }
    }
}

#[derive(Debug, Clone)]
struct GrpcMetrics<S> {
    inner: S,
    metrics: Metrics,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, B, RB> Service<http::Request<B>> for GrpcMetrics<S>
where
    S: Service<http::Request<B>, Response = http::Response<RB>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let method = method_name(req.uri().path());
        let started = Instant::now();
        let future = self.inner.call(req);
        let metrics = self.metrics.clone();
        Box::pin(async move {
            let result = future.await;
            let code = match &result {
                // Trailers-only answers (errors) carry the status in the headers; a
                // response that started normally reports OK here.
                Ok(resp) => resp
                    .headers()
                    .get("grpc-status")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse::<i32>().ok())
                    .map_or("OK", |c| {
                        census_proto::status::code_label(tonic::Code::from_i32(c))
                    }),
                Err(_) => "Unknown",
            };
            metrics
                .grpc_requests
                .get_or_create(&GrpcLabels { method, code })
                .inc();
            metrics
                .grpc_duration
                .get_or_create(&MethodLabels { method })
                .observe(started.elapsed().as_secs_f64());
            result
        })
    }
}
