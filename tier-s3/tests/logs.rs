//! What the AWS SDK logs through the S3 tier, down to TRACE: never a
//! secret (the secret key, the session token, an endpoint's password).
//! (A test binary of its own: it installs the process-wide subscriber.)

use std::io::Write;
use std::sync::{Arc, Mutex, PoisonError};

use kvtier_core::BlockStore;
use kvtier_core::testkit::unique_keys;
use kvtier_s3::{S3Config, S3Tier, S3TierError};
use kvtier_test_services::required;

const SESSION_TOKEN: &str = "kvtier-session-token-Sup3rSecret";
const ENDPOINT_PASSWORD: &str = "Endp0intSecret";

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

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(PoisonError::into_inner)).into_owned()
    }
}

#[test]
fn no_secret_reaches_the_logs_even_at_trace() {
    let (Ok(endpoint), Ok(bucket), Ok(access), Ok(secret)) = (
        std::env::var("KVTIER_S3_ENDPOINT"),
        std::env::var("KVTIER_S3_BUCKET"),
        std::env::var("AWS_ACCESS_KEY_ID"),
        std::env::var("AWS_SECRET_ACCESS_KEY"),
    ) else {
        assert!(
            !required(),
            "KVTIER_REQUIRE_SERVICES=1 but the S3 server's variables are not set"
        );
        eprintln!(
            "SKIPPED no_secret_reaches_the_logs_even_at_trace: KVTIER_S3_ENDPOINT is not set"
        );
        return;
    };
    let logs = Captured::default();
    let writer = logs.clone();
    tracing::subscriber::set_global_default(
        tracing_subscriber::fmt()
            .with_ansi(false)
            .with_max_level(tracing::Level::TRACE)
            .with_writer(move || writer.clone())
            .finish(),
    )
    .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let keys = unique_keys(2, 36);
    let config = S3Config {
        endpoint: Some(endpoint.clone()),
        force_path_style: true,
        prefix: "test-logs/".into(),
        access_key_id: Some(access),
        secret_access_key: Some(secret.clone()),
        session_token: Some(SESSION_TOKEN.into()),
        credentials_from_aws_chain: false,
        max_attempts: 1,
        ..S3Config::new(bucket)
    };
    rt.block_on(async {
        let tier = S3Tier::new(config.clone()).await.unwrap();
        // Whatever the server says of the token, each request is signed
        // and sent: the SDK logs all of it.
        let _ = tier.check().await;
        let _ = tier.exists_many(&keys).await;
        let _ = BlockStore::store(&tier, &keys[0], b"logged?").await;
        let _ = BlockStore::load(&tier, &keys[0]).await;
        // An endpoint with a password in it is refused before the SDK
        // sees it (the SDK would log it at DEBUG).
        let with_password = endpoint.replacen("://", &format!("://kvtier:{ENDPOINT_PASSWORD}@"), 1);
        let err = S3Tier::new(S3Config {
            endpoint: Some(with_password),
            ..config
        })
        .await
        .unwrap_err();
        assert!(
            matches!(
                err,
                S3TierError::InvalidConfig {
                    field: "endpoint",
                    ..
                }
            ),
            "{err:?}"
        );
        let shown = format!("{err} {err:?}");
        assert!(!shown.contains(ENDPOINT_PASSWORD), "{shown}");
        assert!(shown.contains("access_key_id"), "{shown}");
    });
    drop(rt);
    let text = logs.text();
    // The SDK's own lines were captured, TRACE ones too: only the dumps
    // of whole requests are held back.
    assert!(
        text.lines().any(|line| line.contains(" TRACE ")
            && line.contains("aws_smithy_runtime::client::interceptors")),
        "no SDK TRACE line was captured"
    );
    let mut leaks = Vec::new();
    for (what, secret) in [
        ("secret access key", secret.as_str()),
        ("session token", SESSION_TOKEN),
        ("endpoint password", ENDPOINT_PASSWORD),
    ] {
        for line in text.lines().filter(|line| line.contains(secret)) {
            leaks.push(format!(
                "{what}: {}",
                line.chars().take(300).collect::<String>()
            ));
        }
    }
    assert!(
        leaks.is_empty(),
        "{} lines of {} bytes of logs show a secret:\n{}",
        leaks.len(),
        text.len(),
        leaks.join("\n")
    );
    assert!(
        !text
            .lines()
            .any(|line| line.contains(" TRACE ") && line.contains("aws_sigv4")),
        "a TRACE line of the signer was logged"
    );
}
