//! Finding (or starting) real Redis servers for tests.
//!
//! Shared servers come from `scripts/services.sh` through `KVTIER_REDIS_URL`
//! and `KVTIER_REDIS_CLUSTER_URLS`. With `KVTIER_REQUIRE_SERVICES=1` (CI) a
//! missing one fails the test; otherwise the test says loudly that it
//! skipped. Fault tests start private servers on free ports, so killing them
//! disturbs no other test.
#![allow(dead_code)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn required() -> bool {
    std::env::var("KVTIER_REQUIRE_SERVICES").is_ok_and(|v| v == "1")
}

/// The value of `var`, or `None` after saying loudly that the test is skipped.
pub fn service(var: &str, test: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(v) if !v.is_empty() => Some(v),
        _ if required() => panic!(
            "KVTIER_REQUIRE_SERVICES=1 but {var} is not set: run `scripts/services.sh start` and `source .services/env`"
        ),
        _ => {
            eprintln!(
                "SKIPPED {test}: {var} is not set (run `scripts/services.sh start` and `source .services/env`)"
            );
            None
        }
    }
}

/// Whether a binary is on PATH, failing loudly when services are required.
pub fn have(binary: &str, test: &str) -> bool {
    let found = Command::new(binary)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok();
    if !found {
        if required() {
            panic!(
                "KVTIER_REQUIRE_SERVICES=1 but {binary} is not installed: run `scripts/services.sh start`"
            );
        }
        eprintln!("SKIPPED {test}: {binary} is not installed");
    }
    found
}

/// A port nothing listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A redis-server of this test's own, stopped (killed) on drop.
pub struct PrivateRedis {
    pub port: u16,
    pub dir: tempfile::TempDir,
    args: Vec<String>,
    child: Option<Child>,
}

impl PrivateRedis {
    pub fn start(extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut me = Self {
            port: free_port(),
            dir,
            args: extra.iter().map(|s| s.to_string()).collect(),
            child: None,
        };
        me.restart();
        me
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    pub fn dir_path(&self) -> PathBuf {
        self.dir.path().to_owned()
    }

    /// Kills the server (SIGKILL), as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port and directory.
    pub fn restart(&mut self) {
        self.kill();
        let child = Command::new("redis-server")
            .args([
                "--bind",
                "127.0.0.1",
                "--port",
                &self.port.to_string(),
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .arg("--dir")
            .arg(self.dir.path())
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server starts");
        self.child = Some(child);
        wait_ping(self.port);
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        self.kill();
    }
}

pub fn wait_ping(port: u16) {
    let start = Instant::now();
    loop {
        let out = Command::new("redis-cli")
            .args(["-p", &port.to_string(), "ping"])
            .output();
        // A server with requirepass answers NOAUTH: it is up all the same.
        if out.is_ok_and(|o| {
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
            text.contains("PONG") || text.contains("NOAUTH")
        }) {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "redis on {port} did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub fn cluster_ok(port: u16) -> bool {
    Command::new("redis-cli")
        .args(["-p", &port.to_string(), "cluster", "info"])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("cluster_state:ok"))
}

/// A private 3-master cluster.
pub struct PrivateCluster {
    pub nodes: Vec<PrivateRedis>,
}

impl PrivateCluster {
    pub fn start() -> Self {
        let nodes: Vec<PrivateRedis> = (0..3)
            .map(|_| {
                PrivateRedis::start(&[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "1000",
                ])
            })
            .collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let status = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap();
        assert!(status.success(), "redis-cli --cluster create failed");
        let me = Self { nodes };
        me.wait_ok();
        me
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(PrivateRedis::url).collect()
    }

    pub fn wait_ok(&self) {
        let start = Instant::now();
        while !self.nodes.iter().all(|n| cluster_ok(n.port)) {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "cluster did not become ok"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}
