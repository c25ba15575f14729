//! kvtier's test harness for real servers, shared by the tier crates' tests
//! and the end-to-end tests (a crate of its own, depending on no tier, so
//! that every test crate can use it without a dependency cycle).
//!
//! Shared services come from `scripts/services.sh` (`KVTIER_*` variables).
//! With `KVTIER_REQUIRE_SERVICES=1` (CI) a missing service fails the test;
//! otherwise the test prints `SKIPPED` and which service it lacked. Fault
//! tests start private servers on free ports, so killing them disturbs no
//! other test.

#![deny(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used)] // test harness: failing loudly is the point

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Whether CI demands every service.
pub fn required() -> bool {
    std::env::var("KVTIER_REQUIRE_SERVICES").is_ok_and(|v| v == "1")
}

/// `var`'s value; `None` after saying loudly which test skipped (a panic when required).
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

/// The path of a server binary; `None` after saying which test skipped.
pub fn binary(name: &str, test: &str) -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|dir| dir.join(name))
        .find(|p| p.is_file());
    let cargo_bin = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .map(|home| home.join("bin").join(name))
        .filter(|p| p.is_file());
    match on_path.or(cargo_bin) {
        Some(path) => Some(path),
        None if required() => panic!(
            "KVTIER_REQUIRE_SERVICES=1 but {name} is not installed: run `scripts/services.sh start`"
        ),
        None => {
            eprintln!("SKIPPED {test}: {name} is not installed (run `scripts/services.sh start`)");
            None
        }
    }
}

/// A port nothing listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn wait_port(port: u16, what: &str) {
    let start = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "{what} did not listen on {port}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A server process of this test's own, on a fixed port and directory, that
/// can be killed and started again; killed on drop.
#[derive(Debug)]
pub struct PrivateServer {
    /// Its port.
    pub port: u16,
    /// Its data directory.
    pub dir: tempfile::TempDir,
    program: PathBuf,
    args: Vec<String>,
    child: Option<Child>,
    name: &'static str,
    /// A redis-server: ready once it answers PING, not just once it listens.
    answers_ping: bool,
}

/// Whether a redis-server on `port` answers (PONG, or NOAUTH from a server
/// with a password: up all the same).
fn redis_answers(port: u16) -> bool {
    Command::new("redis-cli")
        .args(["-p", &port.to_string(), "ping"])
        .output()
        .is_ok_and(|o| {
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
            text.contains("PONG") || text.contains("NOAUTH")
        })
}

/// Whether the cluster node on `port` reports `cluster_state:ok`.
pub fn cluster_ok(port: u16) -> bool {
    Command::new("redis-cli")
        .args(["-p", &port.to_string(), "cluster", "info"])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("cluster_state:ok"))
}

impl PrivateServer {
    /// A redis-server keeping nothing on disk.
    pub fn redis(binary: PathBuf) -> Self {
        Self::redis_with(binary, &[])
    }

    /// A redis-server keeping nothing on disk, with `extra` arguments
    /// (`--requirepass ...`, cluster mode...).
    pub fn redis_with(binary: PathBuf, extra: &[&str]) -> Self {
        let port = free_port();
        let dir = tempfile::tempdir().unwrap();
        let args = [
            "--bind",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([dir.path().display().to_string()])
        .chain(extra.iter().map(|s| s.to_string()))
        .collect();
        let mut me = Self {
            port,
            dir,
            program: binary,
            args,
            child: None,
            name: "redis-server",
            answers_ping: true,
        };
        me.start();
        me
    }

    /// An s3s-fs server with `bucket`, keys `access` / `secret`, data in its directory.
    pub fn s3(binary: PathBuf, bucket: &str, access: &str, secret: &str) -> Self {
        let port = free_port();
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join(bucket)).unwrap();
        let args = vec![
            "--host".into(),
            "127.0.0.1".into(),
            "--port".into(),
            port.to_string(),
            "--access-key".into(),
            access.into(),
            "--secret-key".into(),
            secret.into(),
            dir.path().display().to_string(),
        ];
        let mut me = Self {
            port,
            dir,
            program: binary,
            args,
            child: None,
            name: "s3s-fs",
            answers_ping: false,
        };
        me.start();
        me
    }

    /// Starts it (again) and waits until it listens.
    pub fn start(&mut self) {
        self.kill();
        let child = Command::new(&self.program)
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{} failed to start: {e}", self.name));
        self.child = Some(child);
        wait_port(self.port, self.name);
        if self.answers_ping {
            // Listening is not yet answering: wait for PING.
            let start = Instant::now();
            while !redis_answers(self.port) {
                assert!(
                    start.elapsed() < Duration::from_secs(10),
                    "redis on {} did not answer",
                    self.port
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    /// Its `redis://` URL (for a redis-server).
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Its process id, while it runs (for `kill -STOP` / `-CONT`).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Kills it with SIGKILL, as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for PrivateServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A private 3-master Redis Cluster of its own servers.
#[derive(Debug)]
pub struct PrivateCluster {
    /// Its nodes, all masters.
    pub nodes: Vec<PrivateServer>,
}

impl PrivateCluster {
    /// Starts three cluster-enabled servers from `binary`, joins them with
    /// `redis-cli --cluster create` and waits until the cluster is ok.
    pub fn start(binary: &std::path::Path) -> Self {
        let nodes: Vec<PrivateServer> = (0..3)
            .map(|_| {
                PrivateServer::redis_with(
                    binary.to_owned(),
                    &[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-node-timeout",
                        "1000",
                    ],
                )
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

    /// The nodes' URLs.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(PrivateServer::url).collect()
    }

    /// Waits until every node reports `cluster_state:ok`.
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
