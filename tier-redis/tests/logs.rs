//! What the lookup manager logs about a failing Redis tier: the failure,
//! never a credential of its URL. (A test binary of its own: it installs
//! the process-wide log subscriber.)

use std::io::Write;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use kvtier_core::testkit::unique_keys;
use kvtier_core::{BlockStore, LookupVerdict, ManagerConfig, ReqContext};
use kvtier_redis::{RedisConfig, RedisTier};

const SECRET: &str = "Sup3rSecret";

/// Log output, shared with the subscriber.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn the_managers_warning_names_the_endpoint_without_its_password() {
    let logs = Captured::default();
    let writer = logs.clone();
    tracing::subscriber::set_global_default(
        tracing_subscriber::fmt()
            .with_ansi(false)
            .with_max_level(tracing::Level::WARN)
            .with_writer(move || writer.clone())
            .finish(),
    )
    .unwrap();
    let sock = std::env::temp_dir().join("kvtier-logs-missing.sock");
    for url in [
        format!("redis+unix://{}?pass={SECRET}", sock.display()),
        format!("redis://alice:{SECRET}@127.0.0.1:{}/", {
            kvtier_test_services::free_port()
        }),
    ] {
        let tier = Arc::new(
            RedisTier::new(RedisConfig {
                connect_timeout_ms: 200,
                response_timeout_ms: 300,
                ..RedisConfig::from_url(url)
            })
            .unwrap(),
        );
        let mut manager = tier
            .manager(ManagerConfig {
                call_timeout_ms: 2_000,
                ..ManagerConfig::default()
            })
            .unwrap();
        let key = &unique_keys(1, 36)[0];
        let req = ReqContext::new("r");
        let start = Instant::now();
        while manager.lookup(key, &req).unwrap() == LookupVerdict::Pending {
            assert!(start.elapsed() < Duration::from_secs(10), "no verdict");
            manager.flush();
            std::thread::sleep(Duration::from_millis(5));
        }
        manager.shutdown();
    }
    let shown = String::from_utf8_lossy(&logs.0.lock().unwrap_or_else(PoisonError::into_inner))
        .into_owned();
    assert!(
        shown.contains("kvtier-logs-missing.sock") && shown.contains("127.0.0.1"),
        "the failures were logged with their endpoints: {shown}"
    );
    assert!(!shown.contains(SECRET), "a password in the logs: {shown}");
}
