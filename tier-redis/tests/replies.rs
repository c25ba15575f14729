//! Replies no Redis server gives to EXISTS, from a fake server speaking
//! crafted bytes: the lean path and the redis-rs path agree that each is an
//! error, and every call returns within its bound however the server
//! misbehaves.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvtier_core::testkit::unique_keys;
use kvtier_redis::{RedisConfig, RedisTier, RedisTierError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// How the fake server answers EXISTS (every other command gets a plain
/// answer: ECHO its argument, PING +PONG, TYPE +none, CLUSTER SLOTS a
/// one-node cluster of itself, anything else +OK).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Answer {
    /// `:1` to every EXISTS: a well-behaved server.
    Honest,
    /// An integer that does not fit in 64 bits.
    Overflowing,
    /// A negative count.
    Negative,
    /// A count no single-key EXISTS gives.
    Two,
    /// A bulk string `"1"` instead of an integer.
    Bulk,
    /// Two replies to the first EXISTS.
    Extra,
    /// No reply to the first EXISTS.
    Missing,
    /// A reply line to the first EXISTS that never ends.
    Endless,
    /// `-MOVED` to the first EXISTS the server sees on any connection,
    /// `:1` to every other.
    MovedOnce,
    /// The connection closed, unanswered, at the first EXISTS the server
    /// sees on any connection; `:1` to every other.
    HangUpOnce,
    /// Silence, the connection kept open, from the first EXISTS the server
    /// sees on any connection; `:1` to every other on other connections.
    SilentOnce,
    /// [`LATE`] of silence at the first EXISTS the server sees on any
    /// connection, then `:1` to it and to every other.
    LateOnce,
    /// [`LATER`] of silence at the first EXISTS the server sees on any
    /// connection; to it and to every other, `:1` for a key whose last
    /// byte is odd and `:0` for the others.
    LaterOnceByKey,
}

/// How late [`Answer::LateOnce`] answers.
const LATE: Duration = Duration::from_millis(1000);

/// How late [`Answer::LaterOnceByKey`] answers.
const LATER: Duration = Duration::from_millis(1125);

/// What the fake server saw, across its connections.
#[derive(Default)]
struct Seen {
    /// Connections whose first command was EXISTS: the lean path's (it
    /// sends no handshake to a server without a password or a database;
    /// redis-rs starts with its own commands).
    lean_connections: AtomicUsize,
    /// Whether the `...Once` misbehaviour happened.
    fired: AtomicBool,
}

/// A fake server on a free loopback port; stops when dropped.
struct FakeRedis {
    port: u16,
    seen: Arc<Seen>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeRedis {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FakeRedis {
    async fn start(answer: Answer) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen = Arc::new(Seen::default());
        let shared = Arc::clone(&seen);
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            while let Ok((conn, _)) = listener.accept().await {
                conns.spawn(serve(conn, answer, port, Arc::clone(&shared)));
            }
        });
        Self { port, seen, task }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }
}

/// One complete command (a RESP array of bulk strings) at the start of
/// `buf`, and the bytes it takes.
fn command(buf: &[u8]) -> Option<(Vec<Vec<u8>>, usize)> {
    fn line(buf: &[u8], at: usize) -> Option<(&[u8], usize)> {
        let end = at + buf.get(at..)?.windows(2).position(|w| w == b"\r\n")?;
        Some((&buf[at..end], end + 2))
    }
    let (head, mut at) = line(buf, 0)?;
    let n: usize = std::str::from_utf8(head.strip_prefix(b"*")?)
        .ok()?
        .parse()
        .ok()?;
    let mut args = Vec::with_capacity(n);
    for _ in 0..n {
        let (len, next) = line(buf, at)?;
        let len: usize = std::str::from_utf8(len.strip_prefix(b"$")?)
            .ok()?
            .parse()
            .ok()?;
        let arg = buf.get(next..next + len)?;
        if buf.get(next + len..next + len + 2)? != b"\r\n" {
            return None;
        }
        args.push(arg.to_vec());
        at = next + len + 2;
    }
    Some((args, at))
}

async fn serve(mut conn: TcpStream, answer: Answer, port: u16, seen: Arc<Seen>) {
    let mut buf = Vec::new();
    let mut exists_seen = 0;
    let mut commands_seen = 0;
    let mut chunk = [0u8; 16 << 10];
    loop {
        let mut out = Vec::new();
        while let Some((args, used)) = command(&buf) {
            buf.drain(..used);
            let name = args[0].to_ascii_uppercase();
            commands_seen += 1;
            if commands_seen == 1 && name == b"EXISTS" {
                seen.lean_connections.fetch_add(1, Ordering::SeqCst);
            }
            match name.as_slice() {
                b"EXISTS" => {
                    exists_seen += 1;
                    let first = exists_seen == 1;
                    let first_anywhere = !seen.fired.swap(true, Ordering::SeqCst);
                    match answer {
                        Answer::MovedOnce if first_anywhere => out.extend_from_slice(
                            format!("-MOVED 0 127.0.0.1:{port}\r\n").as_bytes(),
                        ),
                        Answer::HangUpOnce if first_anywhere => return,
                        Answer::SilentOnce if first_anywhere => loop {
                            // Reads on, answers nothing.
                            match conn.read(&mut chunk).await {
                                Ok(0) | Err(_) => return,
                                Ok(_) => {}
                            }
                        },
                        Answer::LateOnce if first_anywhere => {
                            tokio::time::sleep(LATE).await;
                            out.extend_from_slice(b":1\r\n");
                        }
                        Answer::LaterOnceByKey => {
                            if first_anywhere {
                                tokio::time::sleep(LATER).await;
                            }
                            let odd = args.get(1).and_then(|k| k.last()).is_some_and(|b| b % 2 == 1);
                            out.extend_from_slice(if odd { b":1\r\n" } else { b":0\r\n" });
                        }
                        Answer::MovedOnce
                        | Answer::HangUpOnce
                        | Answer::SilentOnce
                        | Answer::LateOnce => {
                            out.extend_from_slice(b":1\r\n");
                        }
                        Answer::Honest => out.extend_from_slice(b":1\r\n"),
                        Answer::Overflowing => {
                            out.extend_from_slice(b":99999999999999999999999\r\n");
                        }
                        Answer::Negative => out.extend_from_slice(b":-1\r\n"),
                        Answer::Two => out.extend_from_slice(b":2\r\n"),
                        Answer::Bulk => out.extend_from_slice(b"$1\r\n1\r\n"),
                        Answer::Extra if first => out.extend_from_slice(b":1\r\n:0\r\n"),
                        Answer::Missing if first => {}
                        Answer::Extra | Answer::Missing => out.extend_from_slice(b":0\r\n"),
                        Answer::Endless => {
                            // ":1111..." without end, 16 KiB a millisecond
                            // (a bounded rate: the client must stop it, and
                            // a slow client must not fill this machine).
                            let _ = conn.write_all(b":").await;
                            let ones = [b'1'; 16 << 10];
                            while conn.write_all(&ones).await.is_ok() {
                                tokio::time::sleep(Duration::from_millis(1)).await;
                            }
                            return;
                        }
                    }
                }
                b"ECHO" => {
                    let arg = args.get(1).cloned().unwrap_or_default();
                    out.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
                    out.extend_from_slice(&arg);
                    out.extend_from_slice(b"\r\n");
                }
                b"PING" => out.extend_from_slice(b"+PONG\r\n"),
                b"TYPE" => out.extend_from_slice(b"+none\r\n"),
                // A one-node cluster: every slot is this server's.
                b"CLUSTER" => out.extend_from_slice(
                    format!(
                        "*1\r\n*3\r\n:0\r\n:16383\r\n*3\r\n$9\r\n127.0.0.1\r\n:{port}\r\n$40\r\n{}\r\n",
                        "f".repeat(40)
                    )
                    .as_bytes(),
                ),
                _ => out.extend_from_slice(b"+OK\r\n"),
            }
        }
        if !out.is_empty() && conn.write_all(&out).await.is_err() {
            return;
        }
        match conn.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// A tier of the fake server: single node, or a cluster of it.
fn tier(
    server: &FakeRedis,
    lean: bool,
    cluster: bool,
    connect_ms: u64,
    response_ms: u64,
) -> RedisTier {
    chunked_tier(server, lean, cluster, connect_ms, response_ms, 512)
}

/// The same, with `chunk` keys per pipeline.
fn chunked_tier(
    server: &FakeRedis,
    lean: bool,
    cluster: bool,
    connect_ms: u64,
    response_ms: u64,
    chunk: usize,
) -> RedisTier {
    let base = if cluster {
        RedisConfig::cluster([server.url()])
    } else {
        RedisConfig::from_url(server.url())
    };
    RedisTier::new(RedisConfig {
        lean_pipelines: lean,
        connect_timeout_ms: connect_ms,
        response_timeout_ms: response_ms,
        pipeline_chunk: chunk,
        ..base
    })
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fake_server_answers_an_honest_exists_on_both_paths() {
    let server = FakeRedis::start(Answer::Honest).await;
    for (lean, cluster) in [(true, false), (false, false), (true, true), (false, true)] {
        let tier = tier(&server, lean, cluster, 200, 300);
        let found = tier.exists_many(&unique_keys(4, 36)).await.unwrap();
        assert_eq!(found, [true; 4], "lean {lean}, cluster {cluster}");
        assert_eq!(tier.pipeline_stats().lean, u64::from(lean));
        assert_eq!(tier.pipeline_stats().fallbacks, 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replies_exists_never_gives_are_errors_on_both_paths() {
    let mut wrong = Vec::new();
    for answer in [
        Answer::Overflowing,
        Answer::Negative,
        Answer::Two,
        Answer::Bulk,
        Answer::Extra,
        Answer::Missing,
    ] {
        let server = FakeRedis::start(answer).await;
        for (lean, cluster) in [(true, false), (false, false), (true, true), (false, true)] {
            let tier = tier(&server, lean, cluster, 200, 300);
            let start = Instant::now();
            let got = tier.exists_many(&unique_keys(4, 36)).await;
            let took = start.elapsed();
            if got.is_ok() || took >= Duration::from_millis(3 * 500) {
                wrong.push(format!(
                    "{answer:?}, lean {lean}, cluster {cluster}: {got:?} after {took:?}"
                ));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "not an error in time:\n{}",
        wrong.join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_line_that_never_ends_is_a_typed_error_within_the_response_timeout() {
    let server = FakeRedis::start(Answer::Endless).await;
    // The bound of a direct call: response timeout plus connect timeout.
    let bound = Duration::from_millis(1_000 + 500);
    for lean in [true, false] {
        let tier = tier(&server, lean, false, 500, 1_000);
        let start = Instant::now();
        let err = tier.exists_many(&unique_keys(4, 36)).await.unwrap_err();
        let took = start.elapsed();
        assert!(took < 3 * bound, "lean {lean}: {took:?}, {err}");
        if lean {
            // The lean path stops at its line cap, long before the timeout:
            // what it holds of the line is bounded by the cap.
            assert!(
                matches!(&err, RedisTierError::UnexpectedReply { detail, .. } if detail.contains("longer than")),
                "{err:?}"
            );
            assert!(took < bound, "{took:?}");
        } else {
            assert!(
                matches!(err, RedisTierError::Timeout { .. }),
                "redis-rs: {err:?}"
            );
        }
    }
}

/// An error reply in one pipeline fails that pipeline only: the pipelines
/// written behind it on the same connection are answered, and the
/// connection stays (the rest of the refused pipeline's replies are read,
/// so it is still in step). Before, the connection was dropped with the
/// refused pipeline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_reply_fails_its_own_pipeline_and_the_connection_stays_in_step() {
    for cluster in [false, true] {
        let server = FakeRedis::start(Answer::MovedOnce).await;
        // 16 pipelines of 4 keys, up to 8 on the connection at once.
        let tier = chunked_tier(&server, true, cluster, 500, 1_000, 4);
        let keys = unique_keys(64, 36);
        assert_eq!(tier.exists_many(&keys).await.unwrap(), [true; 64]);
        // The refused pipeline was asked again through redis-rs; a moved
        // slot does not pause the lean path.
        let stats = tier.pipeline_stats();
        assert_eq!((stats.lean, stats.fallbacks), (15, 1), "cluster {cluster}");
        assert_eq!(tier.exists_many(&keys).await.unwrap(), [true; 64]);
        let stats = tier.pipeline_stats();
        assert_eq!((stats.lean, stats.fallbacks), (31, 1), "cluster {cluster}");
        // Every lean pipeline went over one connection.
        assert_eq!(
            server.seen.lean_connections.load(Ordering::SeqCst),
            1,
            "cluster {cluster}"
        );
    }
}

/// A server that hangs up with pipelines in flight on the shared
/// connection: every one of them is asked again through redis-rs (which
/// reconnects), so the lookup answers right, with no error; after the lean
/// path's pause, a new connection takes the lean pipelines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_hanging_up_mid_batch_fails_the_pipelines_in_flight_over_to_redis_rs() {
    for cluster in [false, true] {
        let server = FakeRedis::start(Answer::HangUpOnce).await;
        let tier = chunked_tier(&server, true, cluster, 500, 1_000, 4);
        let keys = unique_keys(64, 36);
        assert_eq!(tier.exists_many(&keys).await.unwrap(), [true; 64]);
        let stats = tier.pipeline_stats();
        assert!(stats.fallbacks >= 1, "cluster {cluster}: {stats:?}");
        tokio::time::sleep(Duration::from_millis(1_100)).await;
        assert_eq!(tier.exists_many(&keys).await.unwrap(), [true; 64]);
        let after = tier.pipeline_stats();
        assert_eq!(after.lean, stats.lean + 16, "cluster {cluster}: {after:?}");
        assert_eq!(after.fallbacks, stats.fallbacks, "cluster {cluster}");
        assert_eq!(
            server.seen.lean_connections.load(Ordering::SeqCst),
            2,
            "cluster {cluster}"
        );
    }
}

/// A server that goes silent with pipelines queued on the shared
/// connection: on a single node the lookup is a typed timeout within its
/// bound (no fallback to redis-rs, which would wait as long again); on a
/// cluster the timed-out shard is asked key by key, as any failed shard.
/// The connection goes with the timeout either way, so the next lookup
/// opens a new one and is answered on the lean path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_server_times_the_pipelines_out_and_the_next_lookup_reconnects() {
    for cluster in [false, true] {
        let server = FakeRedis::start(Answer::SilentOnce).await;
        let tier = chunked_tier(&server, true, cluster, 500, 300, 4);
        let keys = unique_keys(64, 36);
        let start = Instant::now();
        let first = tier.exists_many(&keys).await;
        let took = start.elapsed();
        assert!(
            took < Duration::from_millis(3 * 800),
            "cluster {cluster}: {took:?}"
        );
        if cluster {
            assert_eq!(first.unwrap(), [true; 64]);
        } else {
            let err = first.unwrap_err();
            assert!(matches!(err, RedisTierError::Timeout { .. }), "{err:?}");
        }
        let stats = tier.pipeline_stats();
        assert_eq!(stats.fallbacks, 0, "cluster {cluster}: {stats:?}");
        assert_eq!(tier.exists_many(&keys).await.unwrap(), [true; 64]);
        let after = tier.pipeline_stats();
        assert_eq!(after.lean, stats.lean + 16, "cluster {cluster}: {after:?}");
        assert_eq!(
            server.seen.lean_connections.load(Ordering::SeqCst),
            2,
            "cluster {cluster}"
        );
    }
}

/// A server late for one pipeline (its replies come after its deadline)
/// times that pipeline out alone: a pipeline written after it on the same
/// connection, whose deadline the late replies still meet, is answered on
/// the lean path. Before, the reader ended the connection at the first
/// deadline and failed every pipeline queued behind it as timed out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_late_for_one_pipeline_still_answers_the_next_in_time() {
    let server = FakeRedis::start(Answer::LateOnce).await;
    // One pipeline per lookup. The first is written at 0 ms (deadline
    // 700 ms) and answered at LATE (1,000 ms); the second is written at
    // 500 ms (deadline 1,200 ms) behind it and answered right after.
    let tier = Arc::new(chunked_tier(&server, true, false, 500, 700, 64));
    let (first_keys, second_keys) = (unique_keys(64, 36), unique_keys(64, 36));
    let first = tokio::spawn({
        let tier = Arc::clone(&tier);
        async move { tier.exists_many(&first_keys).await }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let second = tier.exists_many(&second_keys).await;
    let first = first.await.unwrap();
    assert!(
        matches!(first, Err(RedisTierError::Timeout { .. })),
        "{first:?}"
    );
    assert_eq!(second.unwrap(), [true; 64]);
    let stats = tier.pipeline_stats();
    assert_eq!(stats.fallbacks, 0, "{stats:?}");
    assert_eq!(stats.lean, 1, "{stats:?}");
    assert_eq!(server.seen.lean_connections.load(Ordering::SeqCst), 1);
}

/// A server late past two pipelines' deadlines: both time out, and the
/// third, written behind them on the same connection, gets its own replies
/// (its keys answer `:1`, the second's `:0`), not the second's. Before,
/// the reader drained the first pipeline's late replies, then read the
/// second's as the third's answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_late_past_two_deadlines_answers_the_third_pipeline_with_its_own_replies() {
    let server = FakeRedis::start(Answer::LaterOnceByKey).await;
    // Written at 0, 250 and 600 ms (deadlines 700, 950 and 1,300 ms); the
    // replies come from LATER (1,125 ms) on.
    let tier = Arc::new(chunked_tier(&server, true, false, 500, 700, 64));
    let odd = |keys: Vec<kvtier_core::OffloadKey>| -> Vec<kvtier_core::OffloadKey> {
        keys.iter()
            .map(|k| {
                let mut bytes = k.as_bytes().to_vec();
                *bytes.last_mut().unwrap() = 1;
                kvtier_core::OffloadKey::new(&bytes)
            })
            .collect()
    };
    let (first_keys, second_keys) = (unique_keys(64, 36), unique_keys(64, 36));
    let third_keys = odd(unique_keys(64, 36));
    let lookup = |keys: Vec<kvtier_core::OffloadKey>, after_ms: u64| {
        let tier = Arc::clone(&tier);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(after_ms)).await;
            tier.exists_many(&keys).await
        })
    };
    let first = lookup(first_keys, 0);
    let second = lookup(second_keys, 250);
    let third = lookup(third_keys, 600);
    let (first, second, third) = (
        first.await.unwrap(),
        second.await.unwrap(),
        third.await.unwrap(),
    );
    for late in [&first, &second] {
        assert!(
            matches!(late, Err(RedisTierError::Timeout { .. })),
            "{late:?}"
        );
    }
    assert_eq!(third.unwrap(), [true; 64]);
    let stats = tier.pipeline_stats();
    assert_eq!(stats.fallbacks, 0, "{stats:?}");
    assert_eq!(stats.lean, 1, "{stats:?}");
    assert_eq!(server.seen.lean_connections.load(Ordering::SeqCst), 1);
}
