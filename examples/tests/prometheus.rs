//! `scheduler_sim --prometheus` serves every tier's metrics in Prometheus
//! text format, and its counters equal the stats the simulation prints.
//! Runs the real binary with the disk and mock tiers (no service needed) and
//! scrapes it with a plain HTTP GET over loopback.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};

use kvtier_core::metrics;

/// The simulation, killed when the test ends however it ends (it lingers
/// to be scraped).
struct Sim(Child);

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_loopback_addr() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    listener.local_addr().expect("its address")
}

/// The body of `GET /metrics` (HTTP/1.0: no chunked body, closed at the end).
fn scrape(addr: SocketAddr) -> String {
    let mut stream = TcpStream::connect(addr).expect("connect to the exporter");
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .expect("send the request");
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .expect("read the response");
    let (head, body) = response
        .split_once("\r\n\r\n")
        .expect("an HTTP response with a body");
    assert!(
        head.lines().next().is_some_and(|l| l.contains(" 200")),
        "status: {head}"
    );
    body.to_owned()
}

/// `(metric name, tier label) -> value` for every sample with a `tier` label.
fn samples(text: &str) -> HashMap<(String, String), f64> {
    let mut out = HashMap::new();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let (series, value) = line.rsplit_once(' ').expect("`series value`");
        let Some((name, labels)) = series.split_once('{') else {
            continue;
        };
        // Summary quantiles carry a second label: keep plain series only.
        if labels.contains("quantile=") {
            continue;
        }
        let tier = labels
            .split(',')
            .find_map(|l| l.trim_end_matches('}').strip_prefix("tier="))
            .map(|t| t.trim_matches('"').to_owned());
        if let Some(tier) = tier {
            out.insert(
                (name.to_owned(), tier),
                value.parse().expect("a numeric value"),
            );
        }
    }
    out
}

#[test]
fn scraped_counters_equal_the_printed_stats() {
    let addr = free_loopback_addr();
    let child = Command::new(env!("CARGO_BIN_EXE_scheduler_sim"))
        .args(["--steps", "300", "--requests", "200", "--step-us", "200"])
        // Failed loads exercise mark_miss, so forced misses are counted too.
        .args(["--load-failure", "0.2", "--json"])
        .args(["--prometheus", &addr.to_string()])
        // Long enough for any machine; the test ends it once it has scraped.
        .args(["--prometheus-linger-ms", "600000"])
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("scheduler_sim starts");
    let mut sim = Sim(child);
    // The summary is printed after every manager has shut down, that is
    // after every counter was published.
    let mut line = String::new();
    BufReader::new(sim.0.stdout.take().expect("piped stdout"))
        .read_line(&mut line)
        .expect("read the summary");
    let summary: serde_json::Value = serde_json::from_str(&line).expect("a JSON summary line");
    let scraped = samples(&scrape(addr));

    let tiers = summary["tiers"].as_array().expect("tiers in the summary");
    let names: Vec<&str> = tiers.iter().filter_map(|t| t["tier"].as_str()).collect();
    assert_eq!(names, ["disk", "mock"], "{summary}");
    let get = |metric: &str, tier: &str| -> f64 {
        *scraped
            .get(&(metric.to_owned(), tier.to_owned()))
            .unwrap_or_else(|| panic!("{metric}{{tier=\"{tier}\"}} not scraped"))
    };
    let mut forced = 0.0;
    for t in tiers {
        let tier = t["tier"].as_str().expect("a tier name");
        for (field, metric) in [
            ("lookups", metrics::LOOKUPS),
            ("hits", metrics::HITS),
            ("misses", metrics::MISSES),
            ("errors", metrics::ERRORS),
            ("timeouts", metrics::TIMEOUTS),
            ("forced_misses", metrics::FORCED_MISSES),
        ] {
            let printed = t[field].as_f64().expect("a number");
            assert_eq!(get(metric, tier), printed, "{metric} of {tier}");
        }
        assert!(get(metrics::LOOKUPS, tier) > 0.0, "{tier} was asked");
        forced += get(metrics::FORCED_MISSES, tier);
        // Every call finished and was counted once in each view.
        let started = get(metrics::CALLS_STARTED, tier);
        assert!(started > 0.0, "{tier} was called");
        assert_eq!(get(metrics::CALLS_FINISHED, tier), started, "{tier}");
        assert_eq!(get(metrics::CALLS_IN_FLIGHT, tier), 0.0, "{tier}");
        assert_eq!(
            get(&format!("{}_count", metrics::KEYS_PER_CALL), tier),
            started,
            "{tier}: one keys-per-call sample per call"
        );
        assert_eq!(
            get(&format!("{}_count", metrics::TIER_CALL_DURATION), tier),
            started,
            "{tier}: one duration sample per call"
        );
        // Every key probed got a first verdict.
        assert!(get(&format!("{}_count", metrics::TIME_TO_VERDICT), tier) > 0.0);
    }
    assert!(forced > 0.0, "failed loads forced misses");
}
