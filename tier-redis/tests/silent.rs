//! A server that accepts connections and never answers (issue 25.8): a
//! lookup fails as a timeout, within its response timeout, on both paths.
//! The bound checked is the documented contract, with room for a loaded
//! machine; it is no measure of speed.

use std::time::{Duration, Instant};

use kvtier_core::testkit::unique_keys;
use kvtier_redis::{RedisConfig, RedisTier, RedisTierError};
use tokio::net::TcpListener;

/// Accepts every connection and keeps it open, reading and writing nothing.
async fn silent_server() -> (u16, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((conn, _)) = listener.accept().await {
            held.push(conn);
        }
    });
    (port, task)
}

/// Looks up 4 keys; the error, and how long it took to come.
async fn timed_lookup(tier: &RedisTier) -> (RedisTierError, Duration) {
    let started = Instant::now();
    let err = tier.exists_many(&unique_keys(4, 36)).await.unwrap_err();
    (err, started.elapsed())
}

/// On the lean path (the default), the server's silence is a timeout after
/// the response timeout, however long the connect timeout: redis-rs is not
/// asked again to wait as long once more.
#[tokio::test]
async fn a_lean_lookup_against_a_silent_server_times_out_within_its_response_timeout() {
    const RESPONSE_TIMEOUT_MS: u64 = 1000;
    let (port, server) = silent_server().await;
    let tier = RedisTier::new(RedisConfig {
        response_timeout_ms: RESPONSE_TIMEOUT_MS,
        // Long, so that only the response timeout can end the call in time.
        connect_timeout_ms: 10_000,
        ..RedisConfig::from_url(format!("redis://127.0.0.1:{port}/"))
    })
    .unwrap();
    // Twice: the second lookup comes right after the first one's timeout.
    for attempt in 0..2 {
        let (err, elapsed) = timed_lookup(&tier).await;
        assert!(
            matches!(err, RedisTierError::Timeout { .. }),
            "attempt {attempt}: {err:?}"
        );
        assert!(
            elapsed < Duration::from_millis(2 * RESPONSE_TIMEOUT_MS),
            "attempt {attempt}: answered after {elapsed:?}, response timeout {RESPONSE_TIMEOUT_MS} ms"
        );
    }
    server.abort();
}

/// Through redis-rs (lean path off), the call ends as a timeout within the
/// connect timeout plus the response timeout: redis-rs waits for its
/// handshake's reply as part of connecting.
#[tokio::test]
async fn a_redis_rs_lookup_against_a_silent_server_times_out_within_its_bound() {
    let (port, server) = silent_server().await;
    let config = RedisConfig {
        lean_pipelines: false,
        ..RedisConfig::from_url(format!("redis://127.0.0.1:{port}/"))
    };
    let bound = Duration::from_millis(config.connect_timeout_ms + config.response_timeout_ms);
    let tier = RedisTier::new(config).unwrap();
    for attempt in 0..2 {
        let (err, elapsed) = timed_lookup(&tier).await;
        assert!(
            matches!(err, RedisTierError::Timeout { .. }),
            "attempt {attempt}: {err:?}"
        );
        assert!(
            elapsed < 2 * bound,
            "attempt {attempt}: answered after {elapsed:?}, bound {bound:?}"
        );
    }
    server.abort();
}
