//! The coupled floor: the tier's workload shape with nothing else in it.
//!
//! redis-benchmark's connections never wait for each other: a master the OS
//! scheduler favours simply answers more of the requests. The tier cannot
//! do that. Each step's keys are split over the masters by slot, and a step
//! has its answer only when its slowest master has answered. With three
//! servers and the client on two cores, that coupling leaves cores idle
//! whoever the client is. This baseline measures how much, with a client
//! that does nothing but the I/O: per step and master one `EXISTS`
//! pipeline, encoded before the clock starts, written on one raw TCP
//! connection per master, replies read as 4-byte `:0` / `:1` frames. It
//! runs on one thread, as redis-benchmark does, with `window` steps in
//! flight: 8 as in the manager's default, or every step of a round at once.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Instant;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;

use super::baselines::{names_by_master, present_keys, redis_layout};
use super::cpu::{CpuSample, CpuTally};
use crate::Failure;
use crate::common::Step;

/// One master's share of every step: its encoded pipeline and how many
/// commands it holds.
struct Share {
    bytes: Vec<u8>,
    commands: usize,
}

/// `steps` run `repeats` times with at most `window` steps in flight;
/// returns keys/s over the timed parts and adds their CPU to `cpu`. Checks
/// that the hits found are the steps' present keys.
pub(crate) fn coupled_floor(
    urls: &[String],
    tier: &kvtier_redis::RedisTier,
    steps: &[Step],
    window: usize,
    repeats: usize,
    server_pids: &[u32],
    cpu: &mut CpuTally,
) -> Result<f64, Failure> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let (ranges, masters) = redis_layout(urls).await?;
        // shares[master][step]
        let mut shares: Vec<Vec<Share>> = (0..masters.len()).map(|_| Vec::new()).collect();
        for groups in names_by_master(&ranges, masters.len(), tier, steps) {
            for (master, names) in groups.into_iter().enumerate() {
                let mut bytes = Vec::new();
                for name in &names {
                    bytes.extend_from_slice(b"*2\r\n$6\r\nEXISTS\r\n$");
                    bytes.extend_from_slice(format!("{}\r\n", name.len()).as_bytes());
                    bytes.extend_from_slice(name);
                    bytes.extend_from_slice(b"\r\n");
                }
                shares[master].push(Share {
                    bytes,
                    commands: names.len(),
                });
            }
        }
        let shares = Arc::new(shares);
        let mut conns = Vec::with_capacity(masters.len());
        for url in &masters {
            let (host, port) = super::baselines::host_port(url)
                .ok_or("cannot read host:port from a master URL")?;
            let stream = tokio::net::TcpStream::connect((host.as_str(), port)).await?;
            stream.set_nodelay(true)?;
            conns.push(stream.into_split());
        }
        let present = present_keys(steps);
        let keys: usize = steps.iter().map(|s| s.1.len()).sum();
        let mut secs = 0.0;
        for _ in 0..repeats {
            let before = CpuSample::now(server_pids);
            let t = Instant::now();
            let hits = tokio::time::timeout(
                std::time::Duration::from_secs(60),
                one_pass(&mut conns, &shares, steps.len(), window),
            )
            .await
            .map_err(|_| "a pass of the coupled floor did not end within 60 s")??;
            secs += t.elapsed().as_secs_f64();
            cpu.add(before, server_pids, keys as f64, false);
            if hits != present {
                return Err(format!("the coupled floor found {hits} of {present} keys").into());
            }
        }
        Ok(keys as f64 * repeats as f64 / secs)
    })
}

type Halves = (
    tokio::net::tcp::OwnedReadHalf,
    tokio::net::tcp::OwnedWriteHalf,
);

/// Every step once: per master a writer (waiting for room in the window)
/// and a reader (marking the step answered by its master); a step leaves
/// the window when every master has answered it. Returns the hits.
async fn one_pass(
    conns: &mut Vec<Halves>,
    shares: &Arc<Vec<Vec<Share>>>,
    steps: usize,
    window: usize,
) -> Result<usize, Failure> {
    let masters = conns.len();
    // How many masters still owe each step, whether it is answered, and the
    // number of leading steps answered (what the window slides on).
    let owed: Arc<Vec<AtomicUsize>> = Arc::new(
        (0..steps)
            .map(|s| AtomicUsize::new((0..masters).filter(|&m| shares[m][s].commands > 0).count()))
            .collect(),
    );
    // A step with no keys at all (none in practice) is answered at once.
    let answered: Arc<Vec<AtomicBool>> = Arc::new(
        owed.iter()
            .map(|o| AtomicBool::new(o.load(Ordering::Relaxed) == 0))
            .collect(),
    );
    let first = answered
        .iter()
        .take_while(|a| a.load(Ordering::Relaxed))
        .count();
    let (done_tx, done_rx) = watch::channel(first);
    let done_tx = Arc::new(done_tx);
    let hits = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for (master, (read, mut write)) in std::mem::take(conns).into_iter().enumerate() {
        let writer = {
            let shares = Arc::clone(shares);
            let mut done = done_rx.clone();
            tokio::spawn(async move {
                for (s, share) in shares[master].iter().enumerate() {
                    if share.commands == 0 {
                        continue;
                    }
                    done.wait_for(|&d| s < d + window)
                        .await
                        .map_err(|e| e.to_string())?;
                    write
                        .write_all(&share.bytes)
                        .await
                        .map_err(|e| e.to_string())?;
                }
                Ok::<_, String>(write)
            })
        };
        let reader = {
            let (shares, owed, answered, done_tx, hits) = (
                Arc::clone(shares),
                Arc::clone(&owed),
                Arc::clone(&answered),
                Arc::clone(&done_tx),
                Arc::clone(&hits),
            );
            tokio::spawn(async move {
                let read =
                    read_replies(read, master, &shares, &owed, &answered, &done_tx, &hits).await;
                if read.is_err() {
                    // Let every writer finish, so the other masters' readers
                    // get all their replies and the pass ends with this error.
                    done_tx.send_replace(usize::MAX / 2);
                }
                read
            })
        };
        tasks.push((reader, writer));
    }
    let mut back = Vec::with_capacity(masters);
    let mut first_error = None;
    for (reader, writer) in tasks {
        match (reader.await?, writer.await?) {
            (Ok(read), Ok(write)) => back.push((read, write)),
            (Err(e), _) | (_, Err(e)) => {
                first_error.get_or_insert(e);
            }
        }
    }
    if let Some(e) = first_error {
        return Err(format!("the coupled floor: {e}").into());
    }
    *conns = back;
    Ok(hits.load(Ordering::Relaxed))
}

/// Reads `master`'s replies to every step in order, counting hits and
/// marking each step answered by it (sliding the window once every master
/// has answered it); returns the read half for the next pass.
async fn read_replies(
    mut read: tokio::net::tcp::OwnedReadHalf,
    master: usize,
    shares: &[Vec<Share>],
    owed: &[AtomicUsize],
    answered: &[AtomicBool],
    done_tx: &watch::Sender<usize>,
    hits: &AtomicUsize,
) -> Result<tokio::net::tcp::OwnedReadHalf, String> {
    let mut buf = vec![0u8; 64 * 1024];
    let (mut have, mut start) = (0usize, 0usize);
    for (s, share) in shares[master].iter().enumerate() {
        let mut left = share.commands;
        while left > 0 {
            while have - start >= 4 && left > 0 {
                match &buf[start..start + 4] {
                    b":1\r\n" => {
                        hits.fetch_add(1, Ordering::Relaxed);
                    }
                    b":0\r\n" => {}
                    other => {
                        return Err(format!("unexpected reply {other:?}"));
                    }
                }
                start += 4;
                left -= 1;
            }
            if left == 0 {
                break;
            }
            buf.copy_within(start..have, 0);
            have -= start;
            start = 0;
            let n = read
                .read(&mut buf[have..])
                .await
                .map_err(|e| e.to_string())?;
            if n == 0 {
                return Err("a master closed the connection".to_owned());
            }
            have += n;
        }
        if share.commands > 0 && owed[s].fetch_sub(1, Ordering::AcqRel) == 1 {
            answered[s].store(true, Ordering::Release);
            done_tx.send_modify(|d| {
                while *d < answered.len() && answered[*d].load(Ordering::Acquire) {
                    *d += 1;
                }
            });
        }
    }
    Ok(read)
}
