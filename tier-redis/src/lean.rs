//! A lean EXISTS pipeline over plain TCP: the lookup hot path only.
//!
//! A batch of EXISTS commands is written as one pre-packed RESP buffer and
//! the integer replies are read straight into booleans. Every pipeline to
//! a server goes over one connection ([`LeanPool`]): callers write theirs
//! whole, one after another, and a reader task hands each its replies in
//! the order written, so the server finds the next pipeline waiting when it
//! finishes one. redis-rs builds two heap objects per command and parses
//! every reply into a generic value; on a cluster, where the client's CPU
//! is the bottleneck, that was most of the cost per key.
//!
//! An error reply (MOVED, ASK, NOAUTH, LOADING...) fails its own pipeline,
//! and a broken connection or a failed handshake the pipelines on it; the
//! caller then asks redis-rs instead. A server silent past the response
//! timeout is a timeout the caller reports as such. A reply that breaks
//! the protocol (an EXISTS answer other than `:0` or `:1`, a reply line
//! without end, replies out of step) is an error on both paths: the caller
//! checks redis-rs's answers with the same rule ([`exists_answer`], and an
//! end marker after each pipeline, see `LeanPool::exists`). [`LeanGate`]
//! says when lookups try this path and counts how it went. So this path
//! never decides an outcome redis-rs would decide differently; it only
//! makes the common case cheap. TLS connections always go through redis-rs.
//!
//! Reading is bounded: a reply line may be at most [`MAX_REPLY_LINE`] bytes
//! long, each byte is scanned for a line end once, and the whole pipeline
//! is bounded by the response timeout.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use kvtier_core::{AbortOnDrop, OffloadKey, Spawner};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{Notify, mpsc, oneshot};
use tokio::time::Instant;

use crate::names::Names;
use crate::reply::exists_answer;

/// The longest reply line read, CRLF excluded. An integer reply takes at
/// most 21 bytes, an error reply (`-MOVED <slot> <host>:<port>`, `-ERR ...`)
/// a few hundred; a longer line is [`LeanError::LineTooLong`], so a server
/// that never ends a line costs at most this much memory.
pub(crate) const MAX_REPLY_LINE: usize = 4096;

/// Bytes asked of the socket per read.
const READ_CHUNK: usize = 16 << 10;

/// Why the lean path gave up.
#[derive(Debug)]
pub(crate) enum LeanError {
    Io(std::io::Error),
    Timeout,
    /// The connection closed before the last reply.
    Closed(&'static str),
    /// An error reply (`-MOVED ...`, `-NOAUTH ...`), or a handshake refused.
    Server(String),
    /// Bytes that are not the replies EXISTS gives: the server broke the
    /// protocol, which is an error whichever path reads it.
    Protocol(&'static str),
    /// A reply line longer than [`MAX_REPLY_LINE`] bytes.
    LineTooLong,
}

impl LeanError {
    /// Whether the server broke the protocol (an error on the redis-rs path
    /// too), rather than refused a command or lost the connection (which
    /// redis-rs may handle: MOVED, a reconnect).
    pub(crate) fn is_protocol_violation(&self) -> bool {
        matches!(self, Self::Protocol(_) | Self::LineTooLong)
    }
}

impl std::fmt::Display for LeanError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Io(e) => write!(f, "i/o: {e}"),
            Self::Timeout => f.write_str("timed out"),
            Self::Closed(when) => write!(f, "connection closed {when}"),
            Self::Server(line) => write!(f, "server replied {line}"),
            Self::Protocol(what) => write!(f, "protocol: {what}"),
            Self::LineTooLong => write!(
                f,
                "protocol: a reply line longer than {MAX_REPLY_LINE} bytes"
            ),
        }
    }
}

impl From<std::io::Error> for LeanError {
    fn from(e: std::io::Error) -> Self {
        Self::Io(e)
    }
}

/// When lookups try the lean path, and how it went: the counters of
/// [`PipelineStats`](crate::PipelineStats), and a pause after connection
/// trouble, so that a failing server is not asked twice per chunk.
#[derive(Debug)]
pub(crate) struct LeanGate {
    epoch: std::time::Instant,
    answered: AtomicU64,
    fallbacks: AtomicU64,
    /// Milliseconds since `epoch` before which the lean path is not tried.
    paused_until: AtomicU64,
}

impl LeanGate {
    /// How long the lean path rests after connection trouble.
    const PAUSE_MS: u64 = 1000;

    pub(crate) fn new() -> Self {
        Self {
            epoch: std::time::Instant::now(),
            answered: AtomicU64::new(0),
            fallbacks: AtomicU64::new(0),
            paused_until: AtomicU64::new(0),
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Whether the lean path may be tried now.
    pub(crate) fn is_open(&self) -> bool {
        self.now_ms() >= self.paused_until.load(Ordering::Relaxed)
    }

    /// Counts a pipeline the lean path answered.
    pub(crate) fn answered(&self) {
        self.answered.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a pipeline handed to redis-rs after `why`. A moved slot is
    /// redis-rs's to follow; anything else (an outage, a refused
    /// handshake) pauses the lean path for a second.
    pub(crate) fn fell_back(&self, why: &LeanError) {
        self.fallbacks.fetch_add(1, Ordering::Relaxed);
        let moved =
            matches!(why, LeanError::Server(m) if m.starts_with("MOVED") || m.starts_with("ASK"));
        if !moved {
            self.paused_until.store(
                self.now_ms().saturating_add(Self::PAUSE_MS),
                Ordering::Relaxed,
            );
        }
    }

    /// Pipelines answered, and pipelines handed to redis-rs.
    pub(crate) fn counts(&self) -> (u64, u64) {
        (
            self.answered.load(Ordering::Relaxed),
            self.fallbacks.load(Ordering::Relaxed),
        )
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

/// One connection to one server, shared by every pipeline sent to it.
///
/// Pipelines are written one after another, each whole, by their callers
/// (under a lock, so that bytes of two never mix), and a reader task reads
/// the replies back in the order the pipelines were written. The server
/// always has the next pipeline queued behind the one it answers, where a
/// connection per pipeline left it idle between one pipeline's end and
/// the next one's arrival on another connection, and a step in flight no
/// longer costs a connection per server. The connection is opened, and
/// its reader runs, on the tier's I/O runtime (`io`), so its socket stays
/// registered with a reactor that lives as long as the tier, whatever
/// runtime the callers run on.
///
/// An error reply (MOVED during resharding, NOAUTH...) fails its own
/// pipeline only: the rest of that pipeline's replies are read, and the
/// connection goes on. A pipeline whose deadline passes unanswered times
/// out alone: the replies still owed to it are read under the next
/// pipeline's deadline, which they may meet. Anything else (connection
/// trouble, a server silent past the last queued pipeline's deadline, a
/// protocol violation) fails the pipeline it hit and every pipeline queued
/// behind it, and ends the connection; the next pipeline opens a new one.
/// A write cut short (an error, the deadline, a cancelled caller) or a
/// caller whose deadline passed unanswered retires the connection: no
/// pipeline is written to it any more (the next opens a new one at once),
/// those written before are still answered or time out at their own
/// deadlines, and it closes when its reader ends.
#[derive(Debug)]
pub(crate) struct LeanPool {
    endpoint: Endpoint,
    io: Spawner,
    conn: tokio::sync::Mutex<Option<Mux>>,
}

/// The writing side of the shared connection, and its reader.
#[derive(Debug)]
struct Mux {
    write: OwnedWriteHalf,
    /// The pipelines written and not yet answered, in the order written.
    /// Closed by the reader when it ends.
    written: mpsc::UnboundedSender<Pending>,
    /// What callers tell the reader.
    signal: Arc<Signal>,
    /// The reader task: aborted when the connection is dropped.
    _reader: AbortOnDrop<()>,
}

/// What callers tell the reader of their connection.
#[derive(Debug, Default)]
struct Signal {
    /// Woken when the connection is retired.
    wake: Notify,
    /// No pipeline will be written any more: the reader ends once those
    /// written are answered or timed out. Set when a write is cut short,
    /// and by a caller whose deadline passed with no answer (a server
    /// silent or late; at worst a healthy connection is replaced).
    retiring: AtomicBool,
}

impl Signal {
    /// Marks the connection retiring, and wakes its reader if it waits.
    fn retire(&self) {
        self.retiring.store(true, Ordering::Release);
        self.wake.notify_one();
    }
}

impl Mux {
    /// Takes the connection out of use (a write cut short, a caller timed
    /// out): the reader answers the pipelines written before, or times
    /// them out at their deadlines (a cut one is never answered), and
    /// ends; the write half stays open until then, since closing it could
    /// make the server drop replies it still owes.
    fn retire(self, io: &Spawner) {
        self.signal.retire();
        drop(io.handle().spawn(async move {
            self.written.closed().await;
            drop(self);
        }));
    }
}

/// A pipeline written, waiting for its replies.
#[derive(Debug)]
struct Pending {
    /// EXISTS commands in it (its end marker excluded).
    n: usize,
    deadline: Instant,
    answer: oneshot::Sender<Result<Vec<bool>, LeanError>>,
}

/// Retires the connection unless the write it guards finished: a write
/// cut short (an error, the deadline, the caller gone) leaves part of a
/// command on the wire.
struct WriteGuard<'a> {
    slot: &'a mut Option<Mux>,
    io: &'a Spawner,
    finished: bool,
}

impl Drop for WriteGuard<'_> {
    fn drop(&mut self) {
        if !self.finished
            && let Some(mux) = self.slot.take()
        {
            mux.retire(self.io);
        }
    }
}

impl LeanPool {
    pub(crate) fn new(endpoint: Endpoint, io: Spawner) -> Self {
        Self {
            endpoint,
            io,
            conn: tokio::sync::Mutex::new(None),
        }
    }

    /// Whether each key's name (see `names`) exists, in order; each key
    /// comes with its tag's CRC if placing it computed one
    /// ([`Names::slot_and_tag`]).
    ///
    /// The pipeline ends with an end marker, `TYPE <first name>` (same
    /// slot, same ACL category as EXISTS), whose simple-string reply must
    /// come right after the last EXISTS answer: a missing or an extra
    /// reply puts it out of place.
    pub(crate) async fn exists<'a>(
        &self,
        names: &Names,
        keys: impl ExactSizeIterator<Item = (&'a OffloadKey, Option<u16>)>,
    ) -> Result<Vec<bool>, LeanError> {
        let n = keys.len();
        let mut out = Vec::with_capacity((n + 1) * names.len(64));
        let mut first = None;
        let mut encoder = ExistsEncoder::new(names);
        for (key, tag) in keys {
            first.get_or_insert(key);
            encoder.encode(&mut out, key.as_bytes(), tag);
        }
        let Some(first) = first else {
            return Ok(Vec::new());
        };
        encode_end_marker(&mut out, names, first.as_bytes());
        let deadline = Instant::now() + self.endpoint.response_timeout;
        let (answer, signal) = tokio::time::timeout_at(deadline, self.write(n, &out, deadline))
            .await
            .map_err(|_| LeanError::Timeout)??;
        match tokio::time::timeout_at(deadline, answer).await {
            Ok(Ok(answered)) => answered,
            Ok(Err(_)) => Err(LeanError::Closed(
                "before the replies: the connection was dropped",
            )),
            Err(_) => {
                // No pipeline is written to this connection any more (the
                // next one opens a new connection, whether or not the reader
                // has seen this yet), and the reader, which may be waiting
                // for a first byte that never comes, reads the first queued
                // pipeline under its deadline: it ends, timed out, or
                // answers what was written and then ends.
                signal.retire();
                Err(LeanError::Timeout)
            }
        }
    }

    /// Writes one pipeline of `n` EXISTS and its end marker on the shared
    /// connection (opened first if there is none, or its reader ended),
    /// and gives where its replies will come, and how to wake its reader.
    async fn write(
        &self,
        n: usize,
        pipeline: &[u8],
        deadline: Instant,
    ) -> Result<(oneshot::Receiver<Result<Vec<bool>, LeanError>>, Arc<Signal>), LeanError> {
        let mut slot = self.conn.lock().await;
        if slot.as_ref().is_none_or(|mux| {
            mux.written.is_closed() || mux.signal.retiring.load(Ordering::Acquire)
        }) {
            // No connection, or its reader ended (an error, or the server
            // closed it while idle), or a caller timed out on it: a new one.
            if let Some(old) = slot.take() {
                old.retire(&self.io);
            }
            *slot = Some(self.connect().await?);
        }
        let mut guard = WriteGuard {
            slot: &mut slot,
            io: &self.io,
            finished: false,
        };
        let Some(mux) = guard.slot.as_mut() else {
            return Err(LeanError::Closed("before the pipeline was written"));
        };
        let (answer, replies) = oneshot::channel();
        // Queued for the reader before the bytes go, so that the reader
        // knows of every pipeline whose replies it may see.
        mux.written
            .send(Pending {
                n,
                deadline,
                answer,
            })
            .map_err(|_| LeanError::Closed("before the pipeline was written"))?;
        let signal = Arc::clone(&mux.signal);
        mux.write.write_all(pipeline).await?;
        guard.finished = true;
        Ok((replies, signal))
    }

    /// A new connection, opened on the I/O runtime, with its reader there.
    async fn connect(&self) -> Result<Mux, LeanError> {
        let (reader, write) = match self.io.spawn(open(self.endpoint.clone())).await {
            Ok(opened) => opened?,
            Err(_) => {
                return Err(LeanError::Closed(
                    "before the handshake: the tier's I/O runtime stopped",
                ));
            }
        };
        let (written, pending) = mpsc::unbounded_channel();
        let signal = Arc::new(Signal::default());
        Ok(Mux {
            write,
            written,
            _reader: self.io.spawn(reader.run(pending, Arc::clone(&signal))),
            signal,
        })
    }
}

/// Connects to `e` and enters it (AUTH, SELECT): the connection's two
/// halves, the reading one holding whatever followed the handshake's
/// replies (nothing, from an honest server).
async fn open(e: Endpoint) -> Result<(Reader, OwnedWriteHalf), LeanError> {
    let e = &e;
    let stream = tokio::time::timeout(
        e.connect_timeout,
        TcpStream::connect((e.host.as_str(), e.port)),
    )
    .await
    .map_err(|_| LeanError::Timeout)??;
    stream.set_nodelay(true)?;
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
    let (read, mut write) = stream.into_split();
    let mut reader = Reader {
        stream: read,
        read: Vec::with_capacity(READ_CHUNK),
        at: 0,
    };
    if expect > 0 {
        let deadline = Instant::now() + e.response_timeout;
        tokio::time::timeout_at(deadline, async {
            write.write_all(&hello).await?;
            reader.read_ok(expect, deadline).await
        })
        .await
        .map_err(|_| LeanError::Timeout)??;
    }
    Ok((reader, write))
}

/// The reading side of the shared connection.
struct Reader {
    stream: OwnedReadHalf,
    /// Bytes read and not yet parsed start at `at`.
    read: Vec<u8>,
    at: usize,
}

impl Reader {
    /// Answers the pipelines in the order written until the connection
    /// breaks, or is retired and has nothing left to answer, or the pool
    /// drops it. Then every pipeline still waiting fails: those behind a
    /// silent server as timed out, the rest as closed.
    async fn run(mut self, mut written: mpsc::UnboundedReceiver<Pending>, signal: Arc<Signal>) {
        let mut next = None;
        let timed_out = loop {
            let pending = match next.take() {
                Some(pending) => pending,
                None => match self.idle(&mut written, &signal).await {
                    Some(pending) => pending,
                    None => break false,
                },
            };
            let (pending, read) = self.read_answer(pending, &mut written).await;
            let answer = match read {
                Ok((found, refused)) => {
                    let extra = self.at != self.read.len();
                    if extra {
                        // The next pipeline's replies, if one was written
                        // (each is queued before its bytes go).
                        next = written.try_recv().ok();
                    }
                    match refused {
                        _ if extra && next.is_none() => {
                            Err(LeanError::Protocol("more replies than commands"))
                        }
                        Some(line) => Err(LeanError::Server(line)),
                        None => Ok(found),
                    }
                }
                Err(e) => Err(e),
            };
            // An error reply leaves the connection in step; anything else
            // ends it.
            let ends = !matches!(answer, Ok(_) | Err(LeanError::Server(_)));
            let timed_out = matches!(answer, Err(LeanError::Timeout));
            let _ = pending.answer.send(answer);
            if ends {
                break timed_out;
            }
        };
        written.close();
        for pending in next
            .into_iter()
            .chain(std::iter::from_fn(|| written.try_recv().ok()))
        {
            let _ = pending.answer.send(Err(if timed_out {
                LeanError::Timeout
            } else {
                LeanError::Closed("after an earlier pipeline on it failed")
            }));
        }
    }

    /// Reads the replies of `pending`'s pipeline: its answers and the first
    /// error reply among them. A pipeline whose deadline passes first is
    /// answered as timed out, and if another was written after it, the
    /// rest of its replies are read (and dropped) under that one's
    /// deadline, which is no sooner, and then that one's own: a server
    /// late for one pipeline may answer the next in time, and the
    /// connection stays in step. Every late pipeline's replies are read
    /// in the order written, including those of a queued one whose
    /// deadline passed before its replies started. Gives the pipeline
    /// whose replies were read, or whose deadline passed with no other
    /// queued.
    async fn read_answer(
        &mut self,
        pending: Pending,
        written: &mut mpsc::UnboundedReceiver<Pending>,
    ) -> (Pending, Result<(Vec<bool>, Option<String>), LeanError>) {
        // The pipeline waiting for an answer, and the replies being read:
        // its own, or while `late` holds the replies of pipelines already
        // answered as timed out (`n` of the one being read, then `owed` of
        // each after it, in order).
        let (mut n, mut found) = (pending.n, Vec::with_capacity(pending.n));
        let mut owner = pending;
        let mut late = false;
        let mut owed = VecDeque::new();
        loop {
            let read = tokio::time::timeout_at(
                owner.deadline,
                self.read_pipeline(n, &mut found, owner.deadline),
            )
            .await
            .unwrap_or(Err(LeanError::Timeout));
            match read {
                Err(LeanError::Timeout) => {
                    if let Ok(next) = written.try_recv() {
                        // `read_pipeline` resumes where it stopped: what it
                        // parsed is in `found` and `self.at`, and a read
                        // cut short loses no byte.
                        let timed_out = std::mem::replace(&mut owner, next);
                        if late {
                            // None of its replies were read yet.
                            owed.push_back(timed_out.n);
                        }
                        let _ = timed_out.answer.send(Err(LeanError::Timeout));
                        late = true;
                        continue;
                    }
                }
                // A late pipeline's last reply: the next late one's
                // replies follow, or else the owner's own.
                Ok(_) if late => {
                    n = owed.pop_front().unwrap_or_else(|| {
                        late = false;
                        owner.n
                    });
                    found = Vec::with_capacity(n);
                    continue;
                }
                _ => {}
            }
            return (owner, read.map(|refused| (found, refused)));
        }
    }

    /// Waits for the next pipeline's replies to start. It waits on the
    /// socket alone, and takes the pipeline from `written` when bytes come
    /// (each is queued before its bytes go): a pipeline written does not
    /// wake this task, which would cost each pipeline a wake-up of the I/O
    /// thread. So it cannot see a pipeline's deadline pass while no byte
    /// comes; that pipeline's caller then retires the connection and wakes
    /// it through `signal`, and once retired it takes each pipeline still
    /// queued to read under its own deadline (passed, for that caller's).
    /// `None` when the server closed the connection or sent bytes nobody
    /// asked for while no pipeline was out (the next pipeline opens a new
    /// connection instead of failing on this one), and when the connection
    /// is retired and nothing is left to answer.
    async fn idle(
        &mut self,
        written: &mut mpsc::UnboundedReceiver<Pending>,
        signal: &Signal,
    ) -> Option<Pending> {
        loop {
            if signal.retiring.load(Ordering::Acquire) {
                // The last pipelines written, then the end.
                return written.try_recv().ok();
            }
            tokio::select! {
                biased;
                // Retired: seen at the top of the loop.
                () = signal.wake.notified() => {}
                ready = self.stream.readable() => {
                    if ready.is_err() {
                        return None;
                    }
                    if let Ok(pending) = written.try_recv() {
                        return Some(pending);
                    }
                    // Kept, not dropped: a pipeline may have been queued
                    // since, and these its first replies.
                    self.read.reserve(READ_CHUNK);
                    match self.stream.try_read_buf(&mut self.read) {
                        // A spurious wake-up: nothing to read after all.
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                        Ok(0) | Err(_) => return None,
                        Ok(_) => return written.try_recv().ok(),
                    }
                }
            }
        }
    }

    /// Reads `n` EXISTS answers into `found`, then the end marker's reply.
    /// An error reply in them is kept (the first) and given back after the
    /// pipeline's last reply: the connection is still in step.
    async fn read_pipeline(
        &mut self,
        n: usize,
        found: &mut Vec<bool>,
        deadline: Instant,
    ) -> Result<Option<String>, LeanError> {
        let mut refused = None;
        while found.len() < n {
            let parsed =
                parse_integers(&self.read[self.at..], n - found.len(), found, &mut refused)?;
            self.at += parsed;
            if found.len() < n {
                // The tail holds no complete line: read until a line ends.
                self.fill_line(deadline).await?;
            }
        }
        // The marker's reply: a simple string (`+none`, `+string`...), or
        // the error the pipeline's commands were refused with.
        loop {
            match line(&self.read[self.at..])? {
                Some((reply, used)) => {
                    match reply.split_first() {
                        Some((b'+', _)) => {}
                        Some((b'-', message)) => {
                            refused.get_or_insert_with(|| {
                                String::from_utf8_lossy(message).into_owned()
                            });
                        }
                        Some((b':', _)) => {
                            return Err(LeanError::Protocol("more replies than commands"));
                        }
                        _ => {
                            return Err(LeanError::Protocol("not the end marker's reply"));
                        }
                    }
                    self.at += used;
                    return Ok(refused);
                }
                None => self.fill_line(deadline).await?,
            }
        }
    }

    /// Reads until the unparsed bytes hold a line end: each byte read is
    /// scanned once here, and a line longer than [`MAX_REPLY_LINE`] is an
    /// error. Parsed bytes are dropped first.
    async fn fill_line(&mut self, deadline: Instant) -> Result<(), LeanError> {
        self.read.drain(..self.at);
        self.at = 0;
        let mut scanned = 0;
        loop {
            if self.read[scanned..].contains(&b'\n') {
                return Ok(());
            }
            scanned = self.read.len();
            if scanned > MAX_REPLY_LINE + 1 {
                return Err(LeanError::LineTooLong);
            }
            self.read_more(deadline, "mid-reply").await?;
        }
    }

    /// One read of at least [`READ_CHUNK`] bytes' room (the buffer's spare
    /// capacity), appended to `self.read`.
    async fn read_more(&mut self, deadline: Instant, when: &'static str) -> Result<(), LeanError> {
        // A server that keeps sending cannot keep this loop past its
        // deadline, even if every read is ready at once.
        if Instant::now() >= deadline {
            return Err(LeanError::Timeout);
        }
        // Into the buffer's spare capacity: no zeroing of READ_CHUNK bytes
        // per read (a `memset` was the lean thread's largest item in a
        // profile, for replies of a few KiB).
        self.read.reserve(READ_CHUNK);
        let got = self.stream.read_buf(&mut self.read).await;
        if got? == 0 {
            return Err(LeanError::Closed(when));
        }
        Ok(())
    }

    /// Reads `n` `+OK` replies.
    async fn read_ok(&mut self, n: usize, deadline: Instant) -> Result<(), LeanError> {
        let mut seen = 0;
        while seen < n {
            match line(&self.read[self.at..])? {
                Some((b"+OK", used)) => {
                    seen += 1;
                    self.at += used;
                }
                Some((other, _)) => {
                    return Err(LeanError::Server(
                        String::from_utf8_lossy(other).into_owned(),
                    ));
                }
                None => self.fill_line(deadline).await.map_err(|e| match e {
                    LeanError::Closed(_) => LeanError::Closed("in the handshake"),
                    e => e,
                })?,
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

/// Appends `EXISTS <name of key>` commands without building the names
/// first. What comes before each key's tag and bytes (the array header,
/// the command, the argument's length and the prefix) is the same for
/// keys of one length: it is made once per length and copied whole, where
/// each command wrote its pieces and the length's digits again.
struct ExistsEncoder<'n> {
    names: &'n Names,
    /// The key length `head` is for (`usize::MAX` before the first key).
    key_len: usize,
    head: Vec<u8>,
}

impl<'n> ExistsEncoder<'n> {
    fn new(names: &'n Names) -> Self {
        Self {
            names,
            key_len: usize::MAX,
            head: Vec::new(),
        }
    }

    /// Appends `EXISTS <name of key>`; `tag` is the CRC of its tag if
    /// known (see [`Names::write_unprefixed_with`]).
    #[inline]
    fn encode(&mut self, out: &mut Vec<u8>, key: &[u8], tag: Option<u16>) {
        if key.len() != self.key_len {
            self.start_length(key.len());
        }
        out.extend_from_slice(&self.head);
        self.names.write_unprefixed_with(out, key, tag);
        out.extend_from_slice(b"\r\n");
    }

    #[cold]
    fn start_length(&mut self, key_len: usize) {
        self.key_len = key_len;
        self.head.clear();
        self.head.extend_from_slice(b"*2\r\n$6\r\nEXISTS\r\n$");
        push_decimal(&mut self.head, self.names.len(key_len));
        self.head.extend_from_slice(b"\r\n");
        self.head.extend_from_slice(self.names.prefix());
    }
}

/// Appends the end marker of a pipeline: `TYPE <name of key>`. One per
/// pipeline, so through the generic encoding (the name built whole).
fn encode_end_marker(out: &mut Vec<u8>, names: &Names, key: &[u8]) {
    encode(out, &[b"TYPE", &names.name(key)]);
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

/// The first line of `buf` without its CRLF, and the bytes it takes;
/// `None` if no line ends in `buf`. A line end without its CR (RESP lines
/// end in CRLF, and no reply line holds a LF) is an error.
fn line(buf: &[u8]) -> Result<Option<(&[u8], usize)>, LeanError> {
    let Some(lf) = buf.iter().position(|&b| b == b'\n') else {
        return Ok(None);
    };
    match lf.checked_sub(1).map(|cr| (cr, buf[cr])) {
        Some((cr, b'\r')) => Ok(Some((&buf[..cr], lf + 1))),
        _ => Err(LeanError::Protocol("a line end without CR")),
    }
}

/// Parses up to `want` complete EXISTS answers (`:0\r\n`, `:1\r\n`) from `buf`
/// into `found`; returns the bytes consumed. An incomplete reply at the end
/// is left for the next read. An error reply counts as an answer (`false`
/// in `found`) and the first one is kept in `refused`, so that the rest of
/// the pipeline is read and the connection stays in step; another integer
/// or anything else is an error.
fn parse_integers(
    buf: &[u8],
    want: usize,
    found: &mut Vec<bool>,
    refused: &mut Option<String>,
) -> Result<usize, LeanError> {
    let mut at = 0;
    let mut parsed = 0;
    while parsed < want {
        // Nearly every reply is `:0` or `:1`: read in one comparison,
        // without looking for its line end (the general path below was
        // half of the I/O thread's time in a cluster run).
        if let Some(&[b':', digit @ (b'0' | b'1'), b'\r', b'\n']) = buf.get(at..at + 4) {
            found.push(digit == b'1');
            at += 4;
            parsed += 1;
            continue;
        }
        let Some((reply, used)) = line(&buf[at..])? else {
            break;
        };
        match reply.split_first() {
            Some((b':', b"0")) => found.push(false),
            Some((b':', b"1")) => found.push(true),
            Some((b':', digits)) => {
                // Any other spelling, read as redis-rs reads it (an i64).
                let n = std::str::from_utf8(digits)
                    .ok()
                    .and_then(|d| d.parse::<i64>().ok())
                    .ok_or(LeanError::Protocol(
                        "an integer reply that is not a 64-bit integer",
                    ))?;
                found.push(
                    exists_answer(n)
                        .ok_or(LeanError::Protocol("an EXISTS answer other than 0 or 1"))?,
                );
            }
            Some((b'-', message)) => {
                refused.get_or_insert_with(|| String::from_utf8_lossy(message).into_owned());
                found.push(false);
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
    use proptest::strategy::Strategy;

    use super::*;

    #[test]
    fn encodes_resp_arrays() {
        let mut out = Vec::new();
        encode(&mut out, &[b"EXISTS", b"p:\x00\r\n"]);
        assert_eq!(out, b"*2\r\n$6\r\nEXISTS\r\n$5\r\np:\x00\r\n\r\n");
        let mut same = Vec::new();
        ExistsEncoder::new(&Names::new(b"p:", crate::KeyLayout::Plain)).encode(
            &mut same,
            b"\x00\r\n",
            None,
        );
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
            parse_integers(b":1\r\n:0\r\n:01\r\n:-0\r\n:0", 6, &mut found, &mut None).unwrap(),
            18
        );
        assert_eq!(found, [true, false, true, false]);
        // An error reply is kept (the first) and counted as an answer, so
        // that the rest of the pipeline is read.
        let mut found = Vec::new();
        let mut refused = None;
        let wire = b":1\r\n-MOVED 3999 127.0.0.1:6381\r\n-ASK 1 h:1\r\n:1\r\n";
        assert_eq!(
            parse_integers(wire, 4, &mut found, &mut refused).unwrap(),
            wire.len()
        );
        assert_eq!(found, [true, false, false, true]);
        assert_eq!(refused.as_deref(), Some("MOVED 3999 127.0.0.1:6381"));
        assert!(matches!(
            parse_integers(b"+OK\r\n", 1, &mut Vec::new(), &mut None),
            Err(LeanError::Protocol(_))
        ));
        // What no single-key EXISTS answers, and what redis-rs cannot read
        // as an i64, are errors, as on the redis-rs path.
        for bad in [
            &b":x\r\n"[..],
            b":\r\n",
            b":99999999999999999999999\r\n",
            b":-1\r\n",
            b":2\r\n",
            b":1\n",
            b"$1\r\n1\r\n",
        ] {
            assert!(
                matches!(
                    parse_integers(bad, 1, &mut Vec::new(), &mut None),
                    Err(LeanError::Protocol(_))
                ),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        // Never more than asked for.
        let mut found = Vec::new();
        assert_eq!(
            parse_integers(b":1\r\n:1\r\n", 1, &mut found, &mut None).unwrap(),
            4
        );
        assert_eq!(found, [true]);
    }

    proptest::proptest! {
        /// The encoder writes what the generic RESP encoding of `EXISTS`
        /// and each name gives, for keys of mixed lengths, both layouts.
        #[test]
        fn exists_commands_encode_as_resp_arrays(
            prefix in proptest::collection::vec(proptest::sample::select(vec![b'k', b':', 0]), 0..12),
            // Lengths from a few values, so that runs of one length (the
            // head kept) and changes back and forth (made again) both occur.
            keys in proptest::collection::vec(
                proptest::sample::select(vec![0usize, 36, 40]).prop_flat_map(|len| {
                    proptest::collection::vec(proptest::num::u8::ANY, len)
                }),
                0..12,
            ),
            tagged in proptest::bool::ANY,
        ) {
            let layout = if tagged { crate::KeyLayout::Tagged } else { crate::KeyLayout::Plain };
            let names = Names::new(&prefix, layout);
            let mut expected = Vec::new();
            let mut got = Vec::new();
            let mut encoder = ExistsEncoder::new(&names);
            for key in &keys {
                encode(&mut expected, &[b"EXISTS", &names.name(key)]);
                encoder.encode(&mut got, key, names.slot_and_tag(key).1);
            }
            proptest::prop_assert_eq!(got, expected);
        }

        /// However the replies are split across reads, the answers are the same.
        #[test]
        fn split_reads_give_the_same_answers(
            values in proptest::collection::vec(0u8..2, 1..200),
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
                let used =
                    parse_integers(&buf, values.len() - found.len(), &mut found, &mut None).unwrap();
                buf.drain(..used);
            }
            proptest::prop_assert!(buf.is_empty());
            let expected: Vec<bool> = values.iter().map(|&v| v > 0).collect();
            proptest::prop_assert_eq!(found, expected);
        }
    }
}
