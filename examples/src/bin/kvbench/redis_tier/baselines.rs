//! The redis workload's baselines: redis-benchmark (on its usual keys and on keys that cost
//! the server what the tier's cost) and the redis-rs client alone.

use std::time::Instant;

use crate::Failure;
use crate::common::Step;

/// `host` and `port` of a `redis://host:port/...` URL.
pub(crate) fn host_port(url: &str) -> Option<(String, u16)> {
    let rest = url.split("://").nth(1)?;
    let authority = rest.split('/').next()?;
    let authority = authority.rsplit('@').next()?;
    let (host, port) = authority.rsplit_once(':')?;
    Some((host.to_owned(), port.parse().ok()?))
}

/// Slot ranges `(first, last, master index)` and each master's URL: from
/// `CLUSTER SLOTS` when `urls` are a cluster's seeds, else the one server
/// (with no ranges).
pub(crate) async fn redis_layout(
    urls: &[String],
) -> Result<(Vec<(u16, u16, usize)>, Vec<String>), Failure> {
    if urls.len() < 2 {
        return Ok((Vec::new(), urls.to_vec()));
    }
    let seed = redis::Client::open(urls[0].as_str())?;
    let mut conn = seed.get_multiplexed_async_connection().await?;
    let reply: Vec<(u16, u16, (String, u16))> = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async::<Vec<redis::Value>>(&mut conn)
        .await?
        .into_iter()
        .map(|entry| {
            let redis::Value::Array(fields) = entry else {
                return Err("CLUSTER SLOTS: not an array");
            };
            let int = |v: &redis::Value| redis::from_redis_value_ref::<u16>(v).ok();
            let host_port = match fields.get(2) {
                Some(redis::Value::Array(node)) => node
                    .first()
                    .and_then(|h| redis::from_redis_value_ref::<String>(h).ok())
                    .zip(node.get(1).and_then(int)),
                _ => None,
            };
            match (
                fields.first().and_then(int),
                fields.get(1).and_then(int),
                host_port,
            ) {
                (Some(a), Some(b), Some(node)) => Ok((a, b, node)),
                _ => Err("CLUSTER SLOTS: unexpected entry"),
            }
        })
        .collect::<Result<_, _>>()?;
    let mut ranges = Vec::new();
    let mut masters: Vec<(String, u16)> = Vec::new();
    for (a, b, node) in reply {
        let idx = match masters.iter().position(|m| *m == node) {
            Some(i) => i,
            None => {
                masters.push(node);
                masters.len() - 1
            }
        };
        ranges.push((a, b, idx));
    }
    let urls = masters
        .iter()
        .map(|(host, port)| format!("redis://{host}:{port}/"))
        .collect();
    Ok((ranges, urls))
}

/// Per step, per master (of `masters`, owning `ranges` from
/// [`redis_layout`]): the full key names of the step's keys that master
/// holds, as the tier names them.
pub(crate) fn names_by_master(
    ranges: &[(u16, u16, usize)],
    masters: usize,
    tier: &kvtier_redis::RedisTier,
    steps: &[Step],
) -> Vec<Vec<Vec<Vec<u8>>>> {
    steps
        .iter()
        .map(|(_, keys, _)| {
            let mut groups = vec![Vec::new(); masters];
            for key in keys {
                let name = tier.key_name(key);
                groups[master_of(ranges, &name)].push(name);
            }
            groups
        })
        .collect()
}

/// How many of `steps`' keys are present: the hits a loop must find.
pub(crate) fn present_keys(steps: &[Step]) -> usize {
    steps
        .iter()
        .map(|s| s.2.iter().filter(|&&p| p).count())
        .sum()
}

/// The master owning `name`'s slot, among `ranges` from [`redis_layout`];
/// 0 on a single server (no ranges).
fn master_of(ranges: &[(u16, u16, usize)], name: &[u8]) -> usize {
    let slot = kvtier_redis::key_slot(name);
    ranges
        .iter()
        .find(|&&(a, b, _)| a <= slot && slot <= b)
        .map_or(0, |&(_, _, m)| m)
}

/// The client library alone on `steps`' keys: one EXISTS pipeline per step
/// and master (keys grouped by master before the clock starts), over one
/// redis-rs multiplexed connection per master, eight steps in flight like
/// the manager's default. Returns keys/s; checks the number of hits.
pub(crate) async fn raw_redis_loop(
    urls: &[String],
    tier: &kvtier_redis::RedisTier,
    steps: &[Step],
) -> Result<f64, Failure> {
    use futures_util::StreamExt;
    let (ranges, masters) = redis_layout(urls).await?;
    let mut conns = Vec::new();
    for url in &masters {
        let client = redis::Client::open(url.as_str())?;
        conns.push(client.get_multiplexed_async_connection().await?);
    }
    let grouped = names_by_master(&ranges, conns.len(), tier, steps);
    let t = Instant::now();
    let work = grouped.iter().map(|groups| {
        let conns = &conns;
        async move {
            let pipelines =
                groups
                    .iter()
                    .zip(conns)
                    .filter(|(g, _)| !g.is_empty())
                    .map(|(names, conn)| {
                        let mut conn = conn.clone();
                        let mut pipe = redis::Pipeline::with_capacity(names.len());
                        for name in names {
                            let mut cmd = redis::Cmd::with_capacity(2, 6 + name.len());
                            cmd.arg("EXISTS").arg(name.as_slice());
                            pipe.add_command(cmd);
                        }
                        async move { pipe.query_async::<Vec<i64>>(&mut conn).await }
                    });
            let mut hits = 0usize;
            for answer in futures_util::future::join_all(pipelines).await {
                hits += answer?.iter().filter(|&&n| n > 0).count();
            }
            Ok::<usize, redis::RedisError>(hits)
        }
    });
    let hits: Vec<Result<usize, redis::RedisError>> = futures_util::stream::iter(work)
        .buffer_unordered(8)
        .collect()
        .await;
    let elapsed = t.elapsed().as_secs_f64();
    let hits: usize = hits.into_iter().sum::<Result<usize, _>>()?;
    let keys: usize = steps.iter().map(|s| s.1.len()).sum();
    let present = present_keys(steps);
    if hits != present {
        return Err(format!("raw redis-rs loop found {hits} of {present} keys").into());
    }
    Ok(keys as f64 / elapsed)
}

/// What redis-benchmark asks for: `EXISTS <key>`, where `__rand_int__` in
/// `key` is a 12-digit number below `keyspace` (and, on a cluster, `{tag}`
/// the hash tag of the connection's master).
pub(crate) struct BenchKeys {
    pub(crate) key: String,
    pub(crate) keyspace: u64,
}

impl BenchKeys {
    /// The usual redis-benchmark keys: short, and none of them exists.
    pub(crate) fn short_absent(cluster: bool) -> Self {
        Self {
            key: if cluster {
                "kvbench:base:{tag}:__rand_int__"
            } else {
                "kvbench:base:__rand_int__"
            }
            .to_owned(),
            keyspace: 1_000_000,
        }
    }
}

/// Runs redis-benchmark with EXISTS on `keys`, 1,000 commands per pipeline
/// and `connections` connections (on a cluster, with `--cluster`: each
/// connection talks to one master, its keys carrying that master's hash
/// tag), on `cpus` if given, and returns its requests per second.
#[allow(clippy::too_many_arguments)]
pub(crate) fn redis_benchmark(
    host: &str,
    port: u16,
    cluster: bool,
    connections: usize,
    n: u64,
    keys: &BenchKeys,
    cpus: Option<&str>,
) -> Result<f64, Failure> {
    let mut cmd = match cpus {
        Some(cpus) => {
            let mut c = std::process::Command::new("taskset");
            c.args(["-c", cpus, "redis-benchmark"]);
            c
        }
        None => std::process::Command::new("redis-benchmark"),
    };
    cmd.args(["-h", host, "-p", &port.to_string(), "-P", "1000"]);
    cmd.args(["-c", &connections.to_string()]);
    if cluster {
        cmd.arg("--cluster");
    }
    let out = cmd
        .args(["-n", &n.to_string(), "-r", &keys.keyspace.to_string()])
        .args(["-q", "EXISTS", &keys.key])
        .stderr(std::process::Stdio::null())
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout).replace('\r', "\n");
    let line = text
        .lines()
        .rev()
        .find(|l| l.contains("requests per second"))
        .ok_or_else(|| format!("redis-benchmark printed no rate: {text}"))?;
    let rps = line
        .split("requests per second")
        .next()
        .and_then(|s| s.split_whitespace().next_back())
        .and_then(|s| s.parse::<f64>().ok())
        .ok_or_else(|| format!("cannot read redis-benchmark's rate from {line:?}"))?;
    Ok(rps)
}

/// redis-benchmark keys that cost the server what the tier's keys cost:
/// names of `name_len` bytes, half of them present. The usual baseline asks
/// for short names that do not exist, which is cheaper for the server (no
/// key compare, no access-time update on a hit, fewer bytes to read and
/// hash) and so flatters it.
///
/// On a cluster, redis-benchmark replaces `{tag}` with a fixed hash tag per
/// master; a short SET run finds those tags. Then every even number below
/// the keyspace is stored under each tag (in the first run; later runs find
/// them), so half of what redis-benchmark asks for exists, as in the tier's steps.
pub(crate) async fn matched_bench_keys(
    urls: &[String],
    name_len: usize,
    present_per_master: u64,
) -> Result<BenchKeys, Failure> {
    let cluster = urls.len() > 1;
    let (_, masters) = redis_layout(urls).await?;
    let (host, port) = host_port(&urls[0]).ok_or("cannot read host:port from the Redis URL")?;
    let head = if cluster {
        "kvbench:mb:{tag}:"
    } else {
        "kvbench:mb:"
    };
    let pad = name_len
        .checked_sub(head.len() + 12)
        .ok_or("the tier's key names are too short for a matched baseline")?;
    let key = format!("{head}{}__rand_int__", "p".repeat(pad));
    let mut conns = Vec::with_capacity(masters.len());
    for master in &masters {
        conns.push(
            redis::Client::open(master.as_str())?
                .get_multiplexed_async_connection()
                .await?,
        );
    }
    // Each master's tag (redis-benchmark's own choice), or none.
    let mut tags: Vec<Option<String>> = vec![None; masters.len()];
    if cluster {
        const PROBE: &str = "kvbench:tagprobe:{tag}";
        let status = std::process::Command::new("redis-benchmark")
            .args(["-h", &host, "-p", &port.to_string(), "--cluster", "-q"])
            .args([
                "-c",
                &masters.len().to_string(),
                "-n",
                "300",
                "SET",
                PROBE,
                "x",
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()?;
        if !status.success() {
            return Err(format!("redis-benchmark SET probe failed: {status}").into());
        }
        let open = PROBE.find('{').unwrap_or(0);
        for (conn, tag) in conns.iter_mut().zip(&mut tags) {
            let probes: Vec<String> = redis::cmd("KEYS")
                .arg("kvbench:tagprobe:*")
                .query_async(conn)
                .await?;
            *tag = probes
                .iter()
                .find_map(|k| k.get(open..open + "{tag}".len()))
                .map(str::to_owned);
            for probe in &probes {
                redis::cmd("DEL").arg(probe).query_async::<()>(conn).await?;
            }
        }
        if tags.iter().any(Option::is_none) {
            return Err("redis-benchmark's SET probe did not reach every master".into());
        }
    }
    for (conn, tag) in conns.iter_mut().zip(&tags) {
        let name = |id: u64| {
            let mut k = key.replace("__rand_int__", &format!("{id:012}"));
            if let Some(tag) = tag {
                k = k.replacen("{tag}", tag, 1);
            }
            k
        };
        // Stored already by an earlier run?
        let (last_even, last_odd) = (2 * (present_per_master - 1), 2 * present_per_master - 1);
        let (even, odd): (bool, bool) = redis::pipe()
            .exists(name(last_even))
            .exists(name(last_odd))
            .query_async(conn)
            .await?;
        if even && !odd {
            continue;
        }
        for start in (0..present_per_master).step_by(1000) {
            let mut pipe = redis::pipe();
            for i in start..(start + 1000).min(present_per_master) {
                pipe.set(name(2 * i), "x").ignore();
            }
            pipe.query_async::<()>(conn).await?;
        }
    }
    Ok(BenchKeys {
        key,
        keyspace: 2 * present_per_master,
    })
}
