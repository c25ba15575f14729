//! `scheduler_sim` fails loudly: each misconfiguration a newcomer can make
//! ends the program with a non-zero exit and one line naming the tier and
//! the cause. Runs the real binary; the servers it names are on loopback,
//! and ports where nothing listens (1) stand for unreachable servers.

use std::process::{Command, Output};

fn sim(args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_scheduler_sim"));
    cmd.args(["--steps", "1", "--requests", "1"])
        .args(args)
        // No credential lookup may leave this machine: the AWS chain's
        // instance-metadata step is switched off.
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .env_remove("RUST_LOG");
    cmd.output().expect("scheduler_sim runs")
}

/// Runs the simulation with test credentials in the environment.
fn sim_with_keys(args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_scheduler_sim"));
    cmd.args(["--steps", "1", "--requests", "1"])
        .args(args)
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .env("AWS_ACCESS_KEY_ID", "kvtier-cli-test")
        .env("AWS_SECRET_ACCESS_KEY", "kvtier-cli-test-secret")
        .env("AWS_REGION", "us-east-1")
        .env_remove("RUST_LOG");
    cmd.output().expect("scheduler_sim runs")
}

/// The exit code and the one line on stderr that says why.
fn failure(out: &Output) -> (i32, String) {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out.status.code().unwrap_or(-1), stderr)
}

fn assert_one_line_cause(out: &Output, must_contain: &[&str]) {
    let (code, stderr) = failure(out);
    assert_eq!(code, 1, "exit code; stderr: {stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line of cause, got: {stderr}");
    for needle in must_contain {
        assert!(
            lines[0].to_lowercase().contains(&needle.to_lowercase()),
            "`{needle}` missing from: {}",
            lines[0]
        );
    }
}

#[test]
fn invalid_arguments_are_rejected_by_clap() {
    for (args, needle) in [
        (&["--steps", "0"][..], "invalid value '0' for '--steps"),
        (
            &["--requests", "0"][..],
            "invalid value '0' for '--requests",
        ),
        (
            &["--follow-ups", "2.5"][..],
            "invalid value '2.5' for '--follow-ups",
        ),
        (&["--load-failure=-1"][..], "--load-failure"),
        (
            &["--s3-endpoint", "http://127.0.0.1:1"][..],
            "the following required arguments were not provided",
        ),
        (
            &["--redis-ca", "/tmp/ca.pem"][..],
            "the following required arguments were not provided",
        ),
        (
            &["--prometheus", "nonsense"][..],
            "invalid value 'nonsense' for '--prometheus",
        ),
        (
            &["--prometheus-linger-ms", "5"][..],
            "the following required arguments were not provided",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_scheduler_sim"))
            .args(args)
            .output()
            .expect("scheduler_sim runs");
        let (code, stderr) = failure(&out);
        assert_eq!(code, 2, "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
}

#[test]
fn help_and_version_name_the_program() {
    let out = Command::new(env!("CARGO_BIN_EXE_scheduler_sim"))
        .arg("-V")
        .output()
        .expect("runs");
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("scheduler_sim "));
    let out = Command::new(env!("CARGO_BIN_EXE_scheduler_sim"))
        .arg("--help")
        .output()
        .expect("runs");
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("Simulates a vLLM-like scheduler"), "{help}");
    assert!(
        !help.contains("kvtier's programs"),
        "the crate's description: {help}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_kvbench"))
        .arg("-V")
        .output()
        .expect("runs");
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("kvbench "));
}

#[test]
fn an_unusable_disk_directory_names_the_disk_tier() {
    let file = tempfile::NamedTempFile::new().expect("temp file");
    // A regular file where the directory should be.
    let out = sim(&["--disk-dir", &file.path().display().to_string()]);
    assert_one_line_cause(&out, &["scheduler_sim: disk tier:"]);
}

#[test]
fn an_unreachable_redis_fails_at_start_up() {
    let out = sim(&["--redis", "redis://127.0.0.1:1/"]);
    assert_one_line_cause(&out, &["scheduler_sim: redis tier:", "refused"]);
}

#[test]
fn a_redis_url_that_does_not_parse_names_the_url_and_hides_its_password() {
    let out = sim(&["--redis", "redis//:hunter2secret@127.0.0.1:6379"]);
    assert_one_line_cause(&out, &["scheduler_sim: redis tier:", "redis://"]);
    let (_, stderr) = failure(&out);
    assert!(
        !stderr.contains("hunter2secret"),
        "password shown: {stderr}"
    );
}

#[test]
fn an_unreachable_s3_endpoint_fails_at_start_up() {
    let out = sim_with_keys(&["--s3", "kvtier-test", "--s3-endpoint", "http://127.0.0.1:1"]);
    assert_one_line_cause(&out, &["scheduler_sim: s3 tier:", "connection refused"]);
}

#[test]
fn an_s3_endpoint_that_is_not_a_url_is_a_configuration_error() {
    let out = sim_with_keys(&["--s3", "kvtier-test", "--s3-endpoint", "not-a-url"]);
    assert_one_line_cause(
        &out,
        &[
            "scheduler_sim: s3 tier:",
            "not-a-url",
            "endpoint",
            "http:// or https://",
        ],
    );
}

#[test]
fn s3_without_credentials_says_so() {
    let out = Command::new(env!("CARGO_BIN_EXE_scheduler_sim"))
        .args(["--steps", "1", "--requests", "1"])
        .args(["--s3", "kvtier-test", "--s3-endpoint", "http://127.0.0.1:1"])
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .env("AWS_REGION", "us-east-1")
        .env("AWS_CONFIG_FILE", "/nonexistent/kvtier-aws-config")
        .env(
            "AWS_SHARED_CREDENTIALS_FILE",
            "/nonexistent/kvtier-aws-credentials",
        )
        .env_remove("AWS_ACCESS_KEY_ID")
        .env_remove("AWS_SECRET_ACCESS_KEY")
        .env_remove("AWS_SESSION_TOKEN")
        .env_remove("AWS_PROFILE")
        .env_remove("AWS_WEB_IDENTITY_TOKEN_FILE")
        .env_remove("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")
        .env_remove("AWS_CONTAINER_CREDENTIALS_FULL_URI")
        .env_remove("RUST_LOG")
        .output()
        .expect("scheduler_sim runs");
    assert_one_line_cause(&out, &["scheduler_sim: s3 tier:", "credentials"]);
}

#[test]
fn a_prometheus_address_in_use_is_one_line_naming_it() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    let addr = taken.local_addr().expect("its address").to_string();
    let out = sim(&["--prometheus", &addr]);
    assert_one_line_cause(&out, &["prometheus", &addr, "in use"]);
}

#[test]
fn kvbench_workloads_have_names_and_keep_their_old_ids() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvbench"))
        .arg("--help")
        .output()
        .expect("kvbench runs");
    let help = String::from_utf8_lossy(&out.stdout);
    for (name, id) in [
        ("hot-lookup", "w1"),
        ("step-cycle", "w2"),
        ("step-cycle-slow", "w2-slow"),
        ("memory", "mem"),
        ("redis", "w3"),
        ("s3", "w4"),
        ("disk", "w5"),
    ] {
        assert!(
            help.contains(&format!("- {name}:")) && help.contains(&format!("(alias {id})")),
            "{name} / {id} missing from --help: {help}"
        );
    }
    // A name and its old id run the same workload, and the JSON line keeps
    // the id as its `workload` field.
    for arg in ["memory", "mem"] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvbench"))
            .args([arg, "--quick", "--json"])
            .output()
            .expect("kvbench runs");
        assert!(
            out.status.success(),
            "{arg}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let line: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON line");
        assert_eq!(line["workload"], "mem", "{arg}: {line}");
        assert!(line["bytes_per_tracked_key"].as_f64().is_some(), "{line}");
    }
}
