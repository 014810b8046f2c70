//! What an API server client keeps after its first requests, which seed-leak's idle
//! reading waits for (bench/src/presets.rs, `warmup_min`): nothing new until the
//! 33rd request over one kept-alive connection, then one step, then nothing more.
//! The step is tokio's: a channel allocates its second block of 32 slots at its
//! 33rd message and keeps it for reuse; kube's client queues every request in one
//! (tower's Buffer) and hyper every request of a connection in another.

use std::{convert::Infallible, time::Duration};

use census_daemon::{
    alloc::{CountingJemalloc, live_heap_bytes},
    apiserver::{Pool, client},
};
use hyper::{Request, Response, body::Incoming, server::conn::http1, service::service_fn};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

#[global_allocator]
static GLOBAL: CountingJemalloc = CountingJemalloc::new();

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// A plain-HTTP server on loopback answering every request with `{}`, on a thread
/// and runtime of its own; returns its URL.
fn server() -> std::io::Result<String> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    listener.set_nonblocking(true)?;
    let url = format!("http://{}", listener.local_addr()?);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    std::thread::spawn(move || {
        runtime.block_on(async move {
            let Ok(listener) = TcpListener::from_std(listener) else {
                return;
            };
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let answer = service_fn(|_: Request<Incoming>| async {
                        Ok::<_, Infallible>(Response::new("{}".to_owned()))
                    });
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), answer)
                        .await;
                });
            }
        });
    });
    Ok(url)
}

/// The live heap once what the last request used has been freed.
async fn live_after_pause() -> i64 {
    tokio::time::sleep(Duration::from_millis(200)).await;
    live_heap_bytes().map_or(0, |b| b as i64)
}

#[tokio::test(flavor = "current_thread")]
async fn a_client_keeps_one_step_more_after_its_33rd_request_and_nothing_after() -> TestResult {
    let url = server()?;
    // One connection kept alive throughout, as the Lease's.
    let pool = Pool {
        max_idle: 1,
        idle_timeout: Duration::from_secs(600),
    };
    let client = client(kube::Config::new(url.parse()?), pool, false)?;
    let mut sent = 0;
    let mut live = Vec::new();
    for upto in [1, 32, 33, 400] {
        while sent < upto {
            client
                .request_text(Request::get("/version").body(Vec::new())?)
                .await?;
            sent += 1;
        }
        live.push(live_after_pause().await);
    }
    let (first_32, the_33rd, to_400) = (live[1] - live[0], live[2] - live[1], live[3] - live[2]);
    assert!(
        first_32.abs() < 1024,
        "requests 2 to 32 kept {first_32} bytes"
    );
    assert!(
        (4 * 1024..64 * 1024).contains(&the_33rd),
        "the 33rd request kept {the_33rd} bytes (two blocks of 32 slots expected)"
    );
    assert!(
        to_400.abs() < 1024,
        "requests 34 to 400 kept {to_400} bytes"
    );
    Ok(())
}
