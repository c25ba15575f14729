//! The Redis servers on a CPU of their own, for the redis workload's pinned
//! measurements.

/// The Redis servers' processes, from the service script's pid files
/// (`KVTIER_REDIS_PIDFILE`, or the cluster's under
/// `KVTIER_REDIS_CLUSTER_PIDDIR`); empty when they are not known.
pub(crate) fn redis_server_pids(cluster: bool) -> Vec<u32> {
    let read = |path: &std::path::Path| {
        std::fs::read_to_string(path)
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok())
    };
    if !cluster {
        return std::env::var_os("KVTIER_REDIS_PIDFILE")
            .and_then(|p| read(std::path::Path::new(&p)))
            .into_iter()
            .collect();
    }
    let Some(dir) = std::env::var_os("KVTIER_REDIS_CLUSTER_PIDDIR") else {
        return Vec::new();
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("cluster-"))
        .filter_map(|e| read(&e.path().join("pid")))
        .collect();
    pids.sort_unstable();
    pids
}

/// The servers on CPU 0, this process (every thread) and the baseline
/// clients on the other CPUs, as when the servers have hosts of their own;
/// the previous affinities come back on drop. On a 2-core machine the
/// client otherwise competes with three servers for CPU time, which
/// measures the machine more than the client.
pub(crate) struct Pinning {
    /// (pid, its affinity mask before) for the servers and this process.
    previous: Vec<(u32, String)>,
    pub(crate) client_cpus: String,
}

impl Pinning {
    pub(crate) fn new(servers: &[u32]) -> Result<Self, String> {
        let cpus = std::thread::available_parallelism().map_or(1, usize::from);
        if cpus < 2 {
            return Err(format!("{cpus} CPU available"));
        }
        if servers.is_empty() {
            return Err("server processes unknown (no pid files from scripts/services.sh)".into());
        }
        let client_cpus = if cpus == 2 {
            "1".to_owned()
        } else {
            format!("1-{}", cpus - 1)
        };
        let mut pinning = Self {
            previous: Vec::new(),
            client_cpus,
        };
        let me = std::process::id();
        for &pid in servers.iter().chain([&me]) {
            let mask = taskset(&["-p", &pid.to_string()])?
                .rsplit(':')
                .next()
                .map(|m| m.trim().to_owned())
                .ok_or("cannot read taskset's mask")?;
            let cpus = if pid == me {
                pinning.client_cpus.clone()
            } else {
                "0".to_owned()
            };
            taskset(&["-a", "-p", "-c", &cpus, &pid.to_string()])?;
            pinning.previous.push((pid, mask));
        }
        Ok(pinning)
    }
}

impl Drop for Pinning {
    fn drop(&mut self) {
        for (pid, mask) in &self.previous {
            if let Err(e) = taskset(&["-a", "-p", mask, &pid.to_string()]) {
                eprintln!("kvbench: could not restore the CPU affinity of {pid}: {e}");
            }
        }
    }
}

fn taskset(args: &[&str]) -> Result<String, String> {
    let out = std::process::Command::new("taskset")
        .args(args)
        .output()
        .map_err(|e| format!("taskset: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "taskset {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
