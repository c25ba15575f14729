//! CPU time of the Redis servers and of the client, from `/proc`: whether a
//! run is limited by the machine (every core busy) rather than by the
//! client, in numbers.

/// Clock ticks per second of `/proc/*/stat` times (`getconf CLK_TCK`,
/// 100 on Linux).
const TICKS_PER_S: f64 = 100.0;

/// (utime + stime, cutime + cstime) of `/proc/<who>/stat`, in clock ticks.
fn stat_ticks(who: &str) -> Option<(u64, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{who}/stat")).ok()?;
    // The fields after the command name, which ends at the last ')'; the
    // first of them is field 3 (state): utime is field 14.
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<u64> = rest
        .split_whitespace()
        .skip(11)
        .take(4)
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    match fields[..] {
        [utime, stime, cutime, cstime] => Some((utime + stime, cutime + cstime)),
        _ => None,
    }
}

/// CPU time so far: the servers', this process's (every thread) and its
/// finished children's (redis-benchmark), with the wall clock.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CpuSample {
    servers: u64,
    client: u64,
    children: u64,
    at: std::time::Instant,
}

impl CpuSample {
    /// `None` when `/proc` cannot be read (not Linux) or no server is known.
    pub(crate) fn now(servers: &[u32]) -> Option<Self> {
        if servers.is_empty() {
            return None;
        }
        let mut total = 0;
        for pid in servers {
            total += stat_ticks(&pid.to_string())?.0;
        }
        let (client, children) = stat_ticks("self")?;
        Some(Self {
            servers: total,
            client,
            children,
            at: std::time::Instant::now(),
        })
    }
}

/// CPU seconds spent over runs of a workload, and its keys.
#[derive(Debug, Default)]
pub(crate) struct CpuTally {
    servers_s: f64,
    client_s: f64,
    wall_s: f64,
    keys: f64,
}

impl CpuTally {
    /// Adds the run from `before` to now, of `keys` keys; the client is
    /// this process, or its children when `child_client`.
    pub(crate) fn add(
        &mut self,
        before: Option<CpuSample>,
        servers: &[u32],
        keys: f64,
        child_client: bool,
    ) {
        self.add_span(before, CpuSample::now(servers), keys, child_client);
    }

    /// Adds the run from `before` to `after`, as [`add`](Self::add).
    pub(crate) fn add_span(
        &mut self,
        before: Option<CpuSample>,
        after: Option<CpuSample>,
        keys: f64,
        child_client: bool,
    ) {
        let (Some(before), Some(after)) = (before, after) else {
            return;
        };
        let ticks = |a: u64, b: u64| a.saturating_sub(b) as f64 / TICKS_PER_S;
        self.servers_s += ticks(after.servers, before.servers);
        self.client_s += if child_client {
            ticks(after.children, before.children)
        } else {
            ticks(after.client, before.client)
        };
        self.wall_s += (after.at - before.at).as_secs_f64();
        self.keys += keys;
    }

    /// µs of CPU per key (servers, client), and the cores busy on average.
    pub(crate) fn json(&self) -> serde_json::Value {
        if self.keys == 0.0 || self.wall_s == 0.0 {
            return serde_json::Value::Null;
        }
        let per_key = |s: f64| (s * 1e6 / self.keys * 1000.0).round() / 1000.0;
        serde_json::json!({
            "servers_cpu_us_per_key": per_key(self.servers_s),
            "client_cpu_us_per_key": per_key(self.client_s),
            "cores_busy": ((self.servers_s + self.client_s) / self.wall_s * 100.0).round() / 100.0,
        })
    }
}
