//! The local agent's admin port: `GET /v1/endpoints` and `GET /v1/version`, over
//! plain HTTP/1.1, bounded by `--timeout`.
//!
//! The answers are read into the agent's own types ([`census_agent::admin::api`]),
//! which keep what a newer agent adds, so `census endpoint list -o json` prints them
//! as they are (docs/cli.md).

use std::{future::poll_fn, pin::Pin, time::Duration};

use census_agent::admin::api::{
    ENDPOINTS_PATH, EndpointsResponse, SERVICES_PATH, ServicesResponse, VERSION_PATH,
    VersionResponse,
};
use hyper::body::Body as _;
use hyper_util::rt::TokioIo;
use serde::de::DeserializeOwned;
use tokio::net::TcpStream;

use super::{
    args::ServerAddr,
    error::{CliError, Peer, one_line},
    operator::root_cause,
};

/// Answers larger than this are refused rather than read.
const MAX_BODY: usize = 64 * 1024 * 1024;
/// Bytes of an error answer's body quoted in the message.
const MAX_QUOTED: usize = 200;

/// The local agent's admin port.
#[derive(Debug, Clone)]
pub(crate) struct Agent {
    addr: ServerAddr,
    timeout: Duration,
}

impl Agent {
    pub(crate) fn new(addr: &ServerAddr, timeout: Duration) -> Self {
        Self {
            addr: addr.clone(),
            timeout,
        }
    }

    pub(crate) fn addr(&self) -> &ServerAddr {
        &self.addr
    }

    pub(crate) async fn endpoints(&self) -> Result<EndpointsResponse, CliError> {
        self.get_json(ENDPOINTS_PATH).await
    }

    pub(crate) async fn services(&self) -> Result<ServicesResponse, CliError> {
        self.get_json(SERVICES_PATH).await
    }

    pub(crate) async fn version(&self) -> Result<VersionResponse, CliError> {
        self.get_json(VERSION_PATH).await
    }

    async fn get_json<T: DeserializeOwned>(&self, path: &'static str) -> Result<T, CliError> {
        let (status, body) = match tokio::time::timeout(self.timeout, self.get(path)).await {
            Ok(answer) => answer?,
            Err(_) => {
                return Err(self.unreachable(format!(
                    "no answer within {}",
                    humantime::format_duration(self.timeout)
                )));
            }
        };
        if status != 200 {
            let text = String::from_utf8_lossy(&body);
            let mut quoted = census_proto::text::cut(&one_line(&text), MAX_QUOTED).into_owned();
            if quoted.is_empty() {
                quoted = "(no body)".to_owned();
            }
            return Err(CliError::AgentFailed {
                addr: self.addr.clone(),
                path,
                status,
                body: quoted,
            });
        }
        serde_json::from_slice(&body).map_err(|e| CliError::BadAnswer {
            peer: Peer::Agent,
            addr: self.addr.clone(),
            reason: format!("GET {path}: {e}"),
        })
    }

    fn unreachable(&self, reason: String) -> CliError {
        CliError::AgentUnreachable {
            addr: self.addr.clone(),
            reason,
        }
    }

    /// One GET on its own connection: status code and body.
    async fn get(&self, path: &'static str) -> Result<(u16, Vec<u8>), CliError> {
        let authority = self.addr.authority();
        let stream = TcpStream::connect(authority)
            .await
            .map_err(|e| self.unreachable(root_cause(&e)))?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| self.unreachable(root_cause(&e)))?;
        let driver = tokio::spawn(connection);
        let request = http::Request::get(path)
            .header(http::header::HOST, authority)
            .header(http::header::ACCEPT, "application/json")
            .body(String::new())
            .map_err(|e| self.unreachable(e.to_string()))?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| self.unreachable(root_cause(&e)))?;
        let status = response.status().as_u16();
        let mut body = response.into_body();
        let mut bytes = Vec::new();
        while let Some(frame) = poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
            let frame = frame.map_err(|e| self.unreachable(root_cause(&e)))?;
            if let Ok(data) = frame.into_data() {
                if bytes.len() + data.len() > MAX_BODY {
                    return Err(CliError::BadAnswer {
                        peer: Peer::Agent,
                        addr: self.addr.clone(),
                        reason: format!("GET {path}: the answer is over {MAX_BODY} bytes"),
                    });
                }
                bytes.extend_from_slice(&data);
            }
        }
        driver.abort();
        Ok((status, bytes))
    }
}
