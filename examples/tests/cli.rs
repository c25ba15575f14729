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
            // A string with no scheme may be a pasted secret: only its
            // length is shown.
            "<hidden: 9 characters>",
            "endpoint",
            "http:// or https://",
        ],
    );
    assert!(!String::from_utf8_lossy(&out.stderr).contains("not-a-url"));
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

/// Runs the simulation with `args` (and `env`), nothing else preset.
fn sim_raw(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_scheduler_sim"));
    cmd.args(args)
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .env_remove("RUST_LOG");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("scheduler_sim runs")
}

#[test]
fn every_numeric_flag_has_a_range_that_clap_enforces() {
    // Values that used to abort (allocation), wrap, hang, blame another
    // field, or silently become something else.
    for (flag, value) in [
        ("--steps", "1000001"),
        ("--requests", "1000000000000"),
        ("--system-prompts", "0"),
        ("--system-blocks", "257"),
        ("--user-blocks", "0"),
        ("--step-us", "18446744073709551615"),
        ("--compute-steps", "18446744073709551615"),
        ("--disk-capacity-mib", "0"),
        ("--disk-capacity-mib", "18446744073709551615"),
        ("--block-bytes", "1000000000000"),
        ("--block-bytes", "0"),
        ("--mock-latency-us", "10000001"),
        ("--mock-jitter-us", "18446744073709551615"),
        ("--call-timeout-ms", "0"),
        ("--load-failure", "1.5"),
        ("--follow-ups", "-0.1"),
        ("--seed", "18446744073709551616"),
    ] {
        let out = sim_raw(&[&format!("{flag}={value}")], &[]);
        let (code, stderr) = failure(&out);
        assert_eq!(code, 2, "{flag} {value}: {stderr}");
        assert!(
            stderr.contains(&format!("invalid value '{value}' for '{flag}")),
            "{flag} {value}: {stderr}"
        );
        assert!(out.stdout.is_empty(), "{flag} {value}: the run started");
    }
    // Linger needs --prometheus; its own range is checked with it.
    let out = sim_raw(
        &[
            "--prometheus",
            "127.0.0.1:0",
            "--prometheus-linger-ms",
            "3600001",
        ],
        &[],
    );
    let (code, stderr) = failure(&out);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("'--prometheus-linger-ms"), "{stderr}");
}

#[test]
fn a_run_with_too_many_blocks_is_refused_naming_the_flags() {
    let out = sim_raw(&["--requests", "1000000", "--system-blocks", "256"], &[]);
    let (code, stderr) = failure(&out);
    assert_eq!(code, 2, "{stderr}");
    for needle in ["--requests 1000000", "--system-blocks 256", "--user-blocks"] {
        assert!(stderr.contains(needle), "{needle}: {stderr}");
    }
}

#[test]
fn a_block_too_big_for_a_disk_segment_names_the_disk_tier_and_the_flag() {
    // 4 MiB of disk: 512 KiB segments, and a 1 MiB block.
    let out = sim(&["--disk-capacity-mib", "4", "--block-bytes", "1048576"]);
    assert_one_line_cause(
        &out,
        &[
            "scheduler_sim: disk tier:",
            "--block-bytes 1048576",
            "--disk-capacity-mib",
        ],
    );
}

#[test]
fn a_bad_plot_path_is_refused_before_the_run() {
    // The default run (2,000 steps) would take seconds; the check comes first.
    let out = sim_raw(&["--plot", "/proc/nope/x"], &[]);
    let (code, stderr) = failure(&out);
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("invalid value '/proc/nope/x' for '--plot'")
            && stderr.contains("/proc/nope"),
        "{stderr}"
    );
    assert!(
        out.stdout.is_empty(),
        "the run started: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn the_summary_comes_before_the_plot_and_every_figure_uses_one_percentile() {
    let dir = tempfile::tempdir().expect("temp dir");
    let base = dir.path().join("tta");
    let out = sim_raw(
        &[
            "--steps",
            "60",
            "--requests",
            "40",
            "--plot",
            &base.display().to_string(),
        ],
        &[],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary_at = stdout.find("time to answer p50").expect("the summary");
    let plot_at = stdout.find("plot written to").expect("the plot line");
    assert!(summary_at < plot_at, "{stdout}");
    // The header's p50 / p99 and the table's "all requests" row are the
    // same figures.
    let header: Vec<f64> = stdout
        .lines()
        .find_map(|l| l.split("time to answer p50 / p99: ").nth(1))
        .and_then(|rest| rest.split(" ms").next())
        .expect("header figures")
        .split(" / ")
        .map(|v| v.parse().expect("a number"))
        .collect();
    let row: Vec<f64> = stdout
        .lines()
        .find(|l| l.starts_with("all requests"))
        .expect("the table's all-requests row")
        .split_whitespace()
        .skip(3) // "all", "requests", the count
        .map(|v| v.parse().expect("a number"))
        .collect();
    assert_eq!((header[0], header[1]), (row[0], row[2]), "{stdout}");

    let out = sim_raw(&["--steps", "60", "--requests", "40", "--json"], &[]);
    let line: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON line");
    let all = &line["answer_ms_by_deepest_tier"][0];
    assert_eq!(all["group"], "all requests", "{line}");
    assert_eq!(all["p50_ms"], line["answer_ms_p50"], "{line}");
    assert_eq!(all["p99_ms"], line["answer_ms_p99"], "{line}");
}

#[test]
fn a_tier_that_misses_its_deadline_for_most_keys_fails_the_run() {
    // Every mock call takes 200 ms against a 20 ms deadline.
    let out = sim_raw(
        &[
            "--steps",
            "5",
            "--requests",
            "3",
            "--mock-latency-us",
            "200000",
            "--mock-jitter-us",
            "0",
            "--call-timeout-ms",
            "20",
        ],
        &[],
    );
    let (code, stderr) = failure(&out);
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains("scheduler_sim: run failed: mock tier:")
            && stderr.contains("missed the 20 ms call deadline"),
        "{stderr}"
    );
    // The summary is still printed.
    assert!(String::from_utf8_lossy(&out.stdout).contains("time to answer"));
}

#[test]
fn a_garbage_redis_ca_file_is_refused_at_start_up() {
    let ca = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(ca.path(), "not a certificate\n").expect("write");
    // No server is needed: the file is refused before any connection.
    let out = sim(&[
        "--redis",
        "rediss://localhost:1/",
        "--redis-ca",
        &ca.path().display().to_string(),
    ]);
    assert_one_line_cause(
        &out,
        &[
            "scheduler_sim: redis tier: --redis-ca",
            "no PEM certificate",
        ],
    );
}

#[test]
fn a_server_that_is_not_redis_is_named_in_one_line() {
    // An HTTP server on a loopback port, answering anything with a 400.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("address").port();
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        for mut conn in listener.incoming().flatten() {
            let mut buf = [0u8; 1024];
            let _ = conn.read(&mut buf);
            let _ = conn.write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n");
        }
    });
    let out = sim(&["--redis", &format!("redis://127.0.0.1:{port}/")]);
    assert_one_line_cause(
        &out,
        &[
            "scheduler_sim: redis tier:",
            "is not a Redis server (got HTTP?)",
        ],
    );
}

#[test]
fn logs_show_tier_calls_without_colour_and_a_bad_filter_once() {
    let out = sim_raw(
        &["--steps", "3", "--requests", "2"],
        &[("RUST_LOG", "kvtier_core=debug")],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("tier_call{tier=disk") && stderr.contains("outcome=\"answered\""),
        "{stderr}"
    );
    assert!(!stderr.contains('\x1b'), "colour codes in a pipe: {stderr}");

    let out = sim_raw(
        &["--steps", "3", "--requests", "2"],
        &[("RUST_LOG", "kvtier_core=loudest")],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    // Lines about background stores still running when the steps end come
    // and go with the machine's load (the mock tier's stores may finish
    // before or after the last step; `waiting_for_background_stores_...`
    // tests them): every other line counts.
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| !l.contains("background store"))
        .collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(
        lines[0].starts_with("scheduler_sim: RUST_LOG=\"kvtier_core=loudest\" ignored"),
        "{stderr}"
    );
}

#[test]
fn waiting_for_background_stores_is_reported_when_stderr_is_a_pipe() {
    let test = "waiting_for_background_stores_is_reported_when_stderr_is_a_pipe";
    let Some(endpoint) = kvtier_test_services::service("KVTIER_S3_ENDPOINT", test) else {
        return;
    };
    let Some(bucket) = kvtier_test_services::service("KVTIER_S3_BUCKET", test) else {
        return;
    };
    // Requests finish at the last steps, so their S3 stores are still
    // running when the steps end.
    let out = sim_raw(
        &[
            "--steps",
            "10",
            "--requests",
            "10",
            "--compute-steps",
            "0",
            "--step-us",
            "0",
            "--no-mock",
            "--call-timeout-ms",
            "60000",
            "--s3",
            &bucket,
            "--s3-endpoint",
            &endpoint,
        ],
        &[],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("the steps are done; waiting for") && stderr.contains("(by tier: s3 "),
        "{stderr}"
    );
    assert!(stderr.contains("background stores done after"), "{stderr}");
}
