//! The daemons' client of the Kubernetes API server: kube's client with a bounded
//! connection pool.
//!
//! kube's own [`kube::Client::try_from`] builds hyper's pool with no limit on idle
//! connections and no timer to expire them, so every connection a burst of
//! concurrent requests opened (the operator writes Identity objects 64 at a time)
//! stays open, with its TLS state and buffers (30–40 KiB each), until the API server
//! closes it. [`client`] builds the same stack (base URI, retry, authentication, extra
//! headers, the connect/read/write timeouts) over a pool that keeps at most
//! [`Pool::max_idle`] idle connections and closes each after [`Pool::idle_timeout`].

use std::time::Duration;

use http_body_util::BodyExt as _;
use hyper_timeout::TimeoutConnector;
use hyper_util::{
    client::legacy::{Client as HyperClient, connect::HttpConnector},
    rt::{TokioExecutor, TokioTimer},
};
use kube::client::{Body, ClientBuilder, ConfigExt as _, DynBody, retry::RetryPolicy};
use tower::{BoxError, ServiceBuilder, ServiceExt as _, retry::RetryLayer};

/// How many idle connections to the API server a client keeps, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pool {
    /// Idle connections kept for reuse; a connection returned beyond these is closed.
    pub max_idle: usize,
    /// An idle connection is closed after this long unused.
    pub idle_timeout: Duration,
}

impl Default for Pool {
    /// Four idle connections, each closed after 10 s unused: long enough that a burst
    /// of requests reuses them, short enough that what a burst opened is gone soon
    /// after (a connection costs one TLS handshake to open again).
    fn default() -> Self {
        Self {
            max_idle: 4,
            idle_timeout: Duration::from_secs(10),
        }
    }
}

/// A client of the API server `config` names, over a [`Pool`]-bounded connection
/// pool. With `retry`, requests answered 429, 503 or 504 are retried with backoff as
/// kube's default client does.
pub fn client(config: kube::Config, pool: Pool, retry: bool) -> Result<kube::Client, kube::Error> {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    let https = config.rustls_https_connector_with_connector(http)?;
    let mut connector = TimeoutConnector::new(https);
    connector.set_connect_timeout(config.connect_timeout);
    connector.set_read_timeout(config.read_timeout);
    connector.set_write_timeout(config.write_timeout);
    connector.set_reset_reader_on_write(config.reset_reader_on_write);
    let hyper: HyperClient<_, Body> = HyperClient::builder(TokioExecutor::new())
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(pool.idle_timeout)
        .pool_max_idle_per_host(pool.max_idle)
        .build(connector);
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(retry.then(|| RetryLayer::new(RetryPolicy::server_retry())))
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(BoxError::from)
        .service(hyper)
        .map_response(|response: http::Response<hyper::body::Incoming>| {
            response.map(|body| Box::new(body.map_err(BoxError::from)) as Box<DynBody>)
        })
        .boxed();
    Ok(ClientBuilder::new(service, config.default_namespace).build())
}

#[cfg(test)]
mod tests {
    use std::{
        convert::Infallible,
        sync::{
            Arc,
            atomic::{AtomicUsize, Ordering},
        },
    };

    use hyper::{Request, Response, body::Incoming, server::conn::http1, service::service_fn};
    use hyper_util::rt::TokioIo;
    use tokio::net::TcpListener;

    use super::*;

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    /// A plain-HTTP server on loopback answering every request with `{}`, and its
    /// count of open connections.
    async fn server() -> std::io::Result<(kube::Config, Arc<AtomicUsize>)> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let open = Arc::new(AtomicUsize::new(0));
        let counted = open.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let open = counted.clone();
                open.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let answer = service_fn(|_: Request<Incoming>| async {
                        // Slow enough that concurrent requests need connections of
                        // their own.
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        Ok::<_, Infallible>(Response::new("{}".to_owned()))
                    });
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), answer)
                        .await;
                    open.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        let url = url
            .parse()
            .map_err(|e| std::io::Error::other(format!("{url}: {e}")))?;
        Ok((kube::Config::new(url), open))
    }

    async fn burst(client: &kube::Client, requests: usize) -> TestResult {
        let mut all = Vec::with_capacity(requests);
        for _ in 0..requests {
            all.push(client.request_text(Request::get("/version").body(Vec::new())?));
        }
        for answer in futures::future::join_all(all).await {
            answer?;
        }
        Ok(())
    }

    async fn open_after(open: &AtomicUsize, wait: Duration) -> usize {
        tokio::time::sleep(wait).await;
        open.load(Ordering::SeqCst)
    }

    #[tokio::test]
    async fn a_burst_leaves_at_most_the_idle_cap_open_and_none_after_the_idle_timeout() -> TestResult
    {
        let (config, open) = server().await?;
        let pool = Pool {
            max_idle: 2,
            idle_timeout: Duration::from_millis(600),
        };
        let client = client(config, pool, false)?;
        burst(&client, 16).await?;
        let after_burst = open_after(&open, Duration::from_millis(150)).await;
        assert!(
            after_burst <= pool.max_idle,
            "{after_burst} connections still open after a burst of 16 (idle cap {})",
            pool.max_idle
        );
        let after_timeout = open_after(&open, Duration::from_millis(1500)).await;
        assert_eq!(
            after_timeout, 0,
            "idle connections outlived the pool's idle timeout"
        );
        // The client still works once its pool has emptied.
        burst(&client, 2).await
    }

    /// Why this module exists: kube's own client keeps every connection of a burst.
    #[tokio::test]
    async fn kubes_own_client_keeps_every_connection_of_a_burst() -> TestResult {
        let (config, open) = server().await?;
        let client = kube::Client::try_from(config)?;
        burst(&client, 16).await?;
        let left = open_after(&open, Duration::from_millis(1500)).await;
        assert!(left > Pool::default().max_idle, "{left} left open");
        Ok(())
    }
}
