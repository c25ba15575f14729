//! A lean EXISTS pipeline over plain TCP: the lookup hot path only.
//!
//! A batch of EXISTS commands is written as one pre-packed RESP buffer and
//! the integer replies are read straight into booleans, on connections from
//! a small pool (one pipeline per connection at a time). redis-rs builds two
//! heap objects per command and parses every reply into a generic value;
//! on a cluster, where the client's CPU is the bottleneck, that was most of
//! the cost per key.
//!
//! Anything unusual is an error here and the caller asks redis-rs instead:
//! an error reply (MOVED, ASK, NOAUTH, LOADING...), a broken or slow
//! connection, a failed handshake. The connection is then dropped. So this
//! path never decides an outcome redis-rs would decide differently; it only
//! makes the common case cheap. TLS connections always go through redis-rs.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use lookup_core::OffloadKey;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Idle connections kept per server.
const MAX_IDLE: usize = 32;

/// Why the lean path gave up (the caller then asks redis-rs).
#[derive(Debug)]
pub(crate) enum LeanError {
    Io(std::io::Error),
    Timeout,
    /// An error reply (`-MOVED ...`, `-NOAUTH ...`), or a handshake refused.
    Server(String),
    /// Bytes that are not the integer replies EXISTS gives.
    Protocol(&'static str),
}

impl std::fmt::Display for LeanError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Io(e) => write!(f, "i/o: {e}"),
            Self::Timeout => f.write_str("timed out"),
            Self::Server(line) => write!(f, "server replied {line}"),
            Self::Protocol(what) => write!(f, "protocol: {what}"),
        }
    }
}

impl From<std::io::Error> for LeanError {
    fn from(e: std::io::Error) -> Self {
        Self::Io(e)
    }
}

/// How to reach and enter one server.
#[derive(Clone)]
pub(crate) struct Endpoint {
    pub(crate) host: String,
    pub(crate) port: u16,
    pub(crate) username: Option<String>,
    pub(crate) password: Option<String>,
    pub(crate) db: i64,
    pub(crate) connect_timeout: Duration,
    pub(crate) response_timeout: Duration,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // No credentials.
        write!(f, "{}:{}/{}", self.host, self.port, self.db)
    }
}

/// Connections to one server, each used by one pipeline at a time.
#[derive(Debug)]
pub(crate) struct LeanPool {
    endpoint: Endpoint,
    idle: Mutex<Vec<Conn>>,
}

#[derive(Debug)]
struct Conn {
    stream: TcpStream,
    read: Vec<u8>,
}

impl LeanPool {
    pub(crate) fn new(endpoint: Endpoint) -> Self {
        Self {
            endpoint,
            idle: Mutex::new(Vec::new()),
        }
    }

    /// Whether each `prefix` + key exists, in order.
    pub(crate) async fn exists<'a>(
        &self,
        prefix: &[u8],
        keys: impl ExactSizeIterator<Item = &'a OffloadKey>,
    ) -> Result<Vec<bool>, LeanError> {
        let n = keys.len();
        let mut out = Vec::with_capacity(n * (prefix.len() + 64));
        for key in keys {
            encode_exists(&mut out, prefix, key.as_bytes());
        }
        let idle = self
            .idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop();
        let mut conn = match idle {
            Some(conn) => conn,
            None => self.connect().await?,
        };
        let mut found = Vec::with_capacity(n);
        let answered = tokio::time::timeout(self.endpoint.response_timeout, async {
            conn.stream.write_all(&out).await?;
            conn.read_replies(n, &mut found).await
        })
        .await
        .map_err(|_| LeanError::Timeout)
        .and_then(|r| r);
        if let Err(e) = answered {
            // This connection goes (it may hold unread replies). After
            // connection trouble the idle ones are likely dead too (a
            // restarted server): drop them rather than fail on each in turn.
            if !matches!(e, LeanError::Server(_)) {
                self.idle
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .clear();
            }
            return Err(e);
        }
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        if idle.len() < MAX_IDLE {
            idle.push(conn);
        }
        Ok(found)
    }

    async fn connect(&self) -> Result<Conn, LeanError> {
        let e = &self.endpoint;
        let stream = tokio::time::timeout(
            e.connect_timeout,
            TcpStream::connect((e.host.as_str(), e.port)),
        )
        .await
        .map_err(|_| LeanError::Timeout)??;
        stream.set_nodelay(true)?;
        let mut conn = Conn {
            stream,
            read: Vec::with_capacity(16 << 10),
        };
        let mut hello = Vec::new();
        let mut expect = 0;
        if let Some(password) = &e.password {
            match &e.username {
                Some(user) => encode(&mut hello, &[b"AUTH", user.as_bytes(), password.as_bytes()]),
                None => encode(&mut hello, &[b"AUTH", password.as_bytes()]),
            }
            expect += 1;
        }
        if e.db != 0 {
            encode(&mut hello, &[b"SELECT", e.db.to_string().as_bytes()]);
            expect += 1;
        }
        if expect > 0 {
            tokio::time::timeout(e.response_timeout, async {
                conn.stream.write_all(&hello).await?;
                conn.read_ok(expect).await
            })
            .await
            .map_err(|_| LeanError::Timeout)??;
        }
        Ok(conn)
    }
}

impl Conn {
    /// Reads `n` integer replies into `found` (non-zero: exists).
    async fn read_replies(&mut self, n: usize, found: &mut Vec<bool>) -> Result<(), LeanError> {
        self.read.clear();
        let mut at = 0;
        while found.len() < n {
            at += parse_integers(&self.read[at..], n - found.len(), found)?;
            if found.len() < n {
                // Keep the unparsed tail, then read more after it.
                self.read.drain(..at);
                at = 0;
                if self.stream.read_buf(&mut self.read).await? == 0 {
                    return Err(LeanError::Protocol("connection closed mid-reply"));
                }
            }
        }
        if at != self.read.len() {
            return Err(LeanError::Protocol("more replies than commands"));
        }
        Ok(())
    }

    /// Reads `n` `+OK` replies.
    async fn read_ok(&mut self, n: usize) -> Result<(), LeanError> {
        self.read.clear();
        let mut seen = 0;
        let mut at = 0;
        while seen < n {
            match line(&self.read[at..]) {
                Some((b"+OK", used)) => {
                    seen += 1;
                    at += used;
                }
                Some((other, _)) => {
                    return Err(LeanError::Server(
                        String::from_utf8_lossy(other).into_owned(),
                    ));
                }
                None => {
                    if self.stream.read_buf(&mut self.read).await? == 0 {
                        return Err(LeanError::Protocol("connection closed in the handshake"));
                    }
                }
            }
        }
        Ok(())
    }
}

/// Appends one command as a RESP array of bulk strings.
fn encode(out: &mut Vec<u8>, args: &[&[u8]]) {
    out.push(b'*');
    push_decimal(out, args.len());
    out.extend_from_slice(b"\r\n");
    for arg in args {
        out.push(b'$');
        push_decimal(out, arg.len());
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(arg);
        out.extend_from_slice(b"\r\n");
    }
}

/// Appends `EXISTS <prefix><key>` without building the name first.
fn encode_exists(out: &mut Vec<u8>, prefix: &[u8], key: &[u8]) {
    out.extend_from_slice(b"*2\r\n$6\r\nEXISTS\r\n$");
    push_decimal(out, prefix.len() + key.len());
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(prefix);
    out.extend_from_slice(key);
    out.extend_from_slice(b"\r\n");
}

fn push_decimal(out: &mut Vec<u8>, mut n: usize) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[i..]);
}

/// The first line of `buf` without its CRLF, and the bytes it takes.
fn line(buf: &[u8]) -> Option<(&[u8], usize)> {
    let end = buf.windows(2).position(|w| w == b"\r\n")?;
    Some((&buf[..end], end + 2))
}

/// Parses up to `want` complete integer replies (`:<n>\r\n`) from `buf` into
/// `found`; returns the bytes consumed. An incomplete reply at the end is
/// left for the next read; an error reply or anything else is an error.
fn parse_integers(buf: &[u8], want: usize, found: &mut Vec<bool>) -> Result<usize, LeanError> {
    let mut at = 0;
    let mut parsed = 0;
    while parsed < want {
        let Some((reply, used)) = line(&buf[at..]) else {
            break;
        };
        match reply.split_first() {
            Some((b':', digits)) => {
                let (negative, digits) = match digits.split_first() {
                    Some((b'-', rest)) => (true, rest),
                    _ => (false, digits),
                };
                if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
                    return Err(LeanError::Protocol("malformed integer reply"));
                }
                found.push(!negative && digits.iter().any(|&d| d != b'0'));
            }
            Some((b'-', message)) => {
                return Err(LeanError::Server(
                    String::from_utf8_lossy(message).into_owned(),
                ));
            }
            _ => return Err(LeanError::Protocol("not an integer reply")),
        }
        at += used;
        parsed += 1;
    }
    Ok(at)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_resp_arrays() {
        let mut out = Vec::new();
        encode(&mut out, &[b"EXISTS", b"p:\x00\r\n"]);
        assert_eq!(out, b"*2\r\n$6\r\nEXISTS\r\n$5\r\np:\x00\r\n\r\n");
        let mut same = Vec::new();
        encode_exists(&mut same, b"p:", b"\x00\r\n");
        assert_eq!(same, out);
        let mut n = Vec::new();
        push_decimal(&mut n, 0);
        push_decimal(&mut n, 1234567890);
        assert_eq!(n, b"01234567890");
    }

    #[test]
    fn parses_integer_replies_and_rejects_the_rest() {
        let mut found = Vec::new();
        assert_eq!(
            parse_integers(b":1\r\n:0\r\n:12\r\n:0", 5, &mut found).unwrap(),
            13
        );
        assert_eq!(found, [true, false, true]);
        let mut found = Vec::new();
        assert!(matches!(
            parse_integers(b":1\r\n-MOVED 3999 127.0.0.1:6381\r\n", 2, &mut found),
            Err(LeanError::Server(m)) if m.starts_with("MOVED")
        ));
        assert!(matches!(
            parse_integers(b"+OK\r\n", 1, &mut Vec::new()),
            Err(LeanError::Protocol(_))
        ));
        assert!(matches!(
            parse_integers(b":x\r\n", 1, &mut Vec::new()),
            Err(LeanError::Protocol(_))
        ));
        // Never more than asked for.
        let mut found = Vec::new();
        assert_eq!(parse_integers(b":1\r\n:1\r\n", 1, &mut found).unwrap(), 4);
        assert_eq!(found, [true]);
    }

    proptest::proptest! {
        /// However the replies are split across reads, the answers are the same.
        #[test]
        fn split_reads_give_the_same_answers(
            values in proptest::collection::vec(0u8..3, 1..200),
            cuts in proptest::collection::vec(proptest::num::usize::ANY, 0..8),
        ) {
            let mut wire = Vec::new();
            for v in &values {
                wire.extend_from_slice(format!(":{v}\r\n").as_bytes());
            }
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (wire.len() + 1)).collect();
            cuts.push(wire.len());
            cuts.sort_unstable();
            // Feed the bytes as a reader would: a growing buffer with an unparsed tail.
            let mut found = Vec::new();
            let mut buf: Vec<u8> = Vec::new();
            let mut from = 0;
            for cut in cuts {
                buf.extend_from_slice(&wire[from..cut]);
                from = cut;
                let used = parse_integers(&buf, values.len() - found.len(), &mut found).unwrap();
                buf.drain(..used);
            }
            proptest::prop_assert!(buf.is_empty());
            let expected: Vec<bool> = values.iter().map(|&v| v > 0).collect();
            proptest::prop_assert_eq!(found, expected);
        }
    }
}
