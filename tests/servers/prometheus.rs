//! The operator's kit against a real Prometheus (Debian's `prometheus`,
//! started here on a free port, scraping every second and evaluating
//! `deploy/prometheus/alerts.yaml` every second): the delivery-paused alert
//! fires while NATS is frozen and clears once it is back; a takeover within
//! the lease fires no no-leader alert; and every query of
//! `deploy/grafana/outbox-relay.json` returns data from a running relay and
//! inbox consumer, so a renamed metric fails here, not on a dashboard.
//!
//! The rules are loaded with each `for:` divided by three, so that an
//! alert fires within a test's wait. The no-leader alert's margin over a
//! takeover stays at least what it is in production: the relays here take
//! over within a lease of 2 s (`QUICK_TAKEOVER`, a fifth of the default
//! 10 s the file's durations are derived from; measured 1.78 to 2.14 s),
//! and Prometheus scrapes and evaluates every second where the file allows
//! 15 s, so no relay leads for about 4 s as Prometheus sees it, against a
//! `for:` of 20 s (in production 40.5 s against 60 s). The room left is for
//! a loaded machine, whose server can make a takeover take several times
//! the lease. The delivery-paused alert waits 20 s where the file says 1m.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use bson::{doc, oid::ObjectId, Document};
use futures::FutureExt;
use outbox_relay::inbox::{handler, HandlerError, Inbox, InboxMetrics};
use percent_encoding::{utf8_percent_encode, NON_ALPHANUMERIC};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::common::{
    free_port, get, manifest_dir, mongodb_uri, on_path, ready_as, wait_until, write_orders,
    NatsProcess, RelayProcess, TestEnv, LEADING, QUICK_TAKEOVER, WAIT,
};

/// The relays' scrape job, as the rules group by it.
const JOB: &str = "outbox-relay";
/// The inbox consumer's service.
const SERVICE: &str = "shop";
/// How much shorter each `for:` is here than in the file (see above).
const FOR_DIVISOR: u64 = 3;

/// A Prometheus of the test's own.
struct PrometheusProcess {
    child: Child,
    port: u16,
    dir: PathBuf,
}

impl PrometheusProcess {
    /// Debian's `prometheus` (or `PROMETHEUS`); missing, the test fails
    /// saying how to get it.
    fn binary() -> PathBuf {
        std::env::var_os("PROMETHEUS")
            .filter(|path| !path.is_empty())
            .map(PathBuf::from)
            .or_else(|| on_path("prometheus"))
            .unwrap_or_else(|| {
                panic!(
                    "this test needs Prometheus, which is not installed: scripts/services.sh \
                     installs it (apt-get install prometheus), or point PROMETHEUS at it"
                )
            })
    }

    /// Starts Prometheus scraping each `(job, ports)` every second, with the
    /// alerting rules (their `for:` shortened) evaluated every second.
    async fn start(jobs: &[(&str, Vec<u16>)]) -> Self {
        let binary = Self::binary();
        let port = free_port();
        let dir = std::env::temp_dir().join(format!(
            "outbox-relay-prometheus-{port}-{}",
            ObjectId::new()
        ));
        std::fs::create_dir_all(&dir).expect("a folder for Prometheus");
        let rules = std::fs::read_to_string(manifest_dir().join("deploy/prometheus/alerts.yaml"))
            .expect("read deploy/prometheus/alerts.yaml");
        std::fs::write(dir.join("alerts.yaml"), shortened(&rules)).expect("write the rules");
        let mut config = String::from(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\n  evaluation_interval: 1s\n\
             rule_files:\n  - alerts.yaml\nscrape_configs:\n",
        );
        for (job, ports) in jobs {
            let targets: Vec<String> = ports.iter().map(|p| format!("'127.0.0.1:{p}'")).collect();
            config.push_str(&format!(
                "  - job_name: {job}\n    static_configs:\n      - targets: [{}]\n",
                targets.join(", ")
            ));
        }
        std::fs::write(dir.join("prometheus.yml"), config).expect("write the configuration");
        let log = std::fs::File::create(dir.join("prometheus.log")).expect("a log file");
        let child = Command::new(&binary)
            .arg(format!(
                "--config.file={}",
                dir.join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", binary.display()));
        let prometheus = PrometheusProcess { child, port, dir };
        wait_until("Prometheus to be ready", || async {
            get(port, "/-/ready")
                .await
                .is_some_and(|(status, _)| status == 200)
        })
        .await;
        prometheus
    }

    /// The `data` of an API call, which must succeed.
    async fn api(&self, path: &str) -> Value {
        let (status, body) = get(self.port, path)
            .await
            .unwrap_or_else(|| panic!("Prometheus answers {path}"));
        let answer: Value =
            serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path}: {e}: {body}"));
        assert_eq!(status, 200, "{path}: {body}");
        answer["data"].clone()
    }

    /// The result of an instant query.
    async fn query(&self, query: &str) -> Vec<Value> {
        let path = format!("/api/v1/query?query={}", encoded(query));
        let data = self.api(&path).await;
        data["result"].as_array().cloned().unwrap_or_default()
    }

    /// Prometheus's clock, in seconds since the epoch.
    async fn now(&self) -> f64 {
        let data = self
            .api(&format!("/api/v1/query?query={}", encoded("time()")))
            .await;
        data["result"][0].as_f64().expect("time() has a timestamp")
    }

    /// The series of a range query from `start` to `end`, a second apart.
    async fn query_range(&self, query: &str, start: f64, end: f64) -> Vec<Value> {
        let path = format!(
            "/api/v1/query_range?query={}&start={start:.3}&end={end:.3}&step=1",
            encoded(query)
        );
        let data = self.api(&path).await;
        data["result"].as_array().cloned().unwrap_or_default()
    }

    /// The state (`pending`, `firing`) of each active alert named `name`.
    async fn alert_states(&self, name: &str) -> Vec<String> {
        let data = self.api("/api/v1/alerts").await;
        data["alerts"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|alert| alert["labels"]["alertname"] == name)
            .filter_map(|alert| alert["state"].as_str().map(str::to_owned))
            .collect()
    }

    /// Waits until alert `name` is in `state` (`None`: not active at all).
    async fn wait_for_alert(&self, name: &str, state: Option<&str>) {
        let what = match state {
            Some(state) => format!("{name} {state} in Prometheus"),
            None => format!("{name} no longer active in Prometheus"),
        };
        wait_until(&what, || async {
            let states = self.alert_states(name).await;
            match state {
                Some(state) => states.iter().any(|s| s == state),
                None => states.is_empty(),
            }
        })
        .await;
    }

    /// Waits until alert `name` is pending, then until it fires: each
    /// step within a wait, however long its `for:`.
    async fn wait_until_firing(&self, name: &str) {
        self.wait_for_alert(name, Some("pending")).await;
        self.wait_for_alert(name, Some("firing")).await;
    }

    /// When the rules were last evaluated, by Prometheus's clock.
    async fn last_evaluation(&self) -> f64 {
        let data = self.api("/api/v1/rules").await;
        let at = data["groups"][0]["lastEvaluation"]
            .as_str()
            .expect("the group was evaluated");
        let at = bson::DateTime::parse_rfc3339_str(at).expect("an RFC 3339 time");
        at.timestamp_millis() as f64 / 1000.0
    }

    /// Waits until every query has a result; fails naming those without.
    async fn wait_for_data(&self, queries: &[(String, String)]) {
        let deadline = Instant::now() + WAIT;
        loop {
            let mut empty = Vec::new();
            for (panel, query) in queries {
                if self.query(query).await.is_empty() {
                    empty.push(format!("{panel}: {query}"));
                }
            }
            if empty.is_empty() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "dashboard queries with no data (a metric renamed, or not exported?):\n{}",
                empty.join("\n")
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

impl Drop for PrometheusProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::env::var_os("KEEP_PROMETHEUS_DIR").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

fn encoded(query: &str) -> String {
    utf8_percent_encode(query, NON_ALPHANUMERIC).to_string()
}

/// The rules with every `for:` divided by [`FOR_DIVISOR`] (see the module's
/// documentation for why that keeps each alert's meaning).
fn shortened(rules: &str) -> String {
    let mut changed = 0;
    let text: Vec<String> = rules
        .lines()
        .map(|line| {
            let Some((indent, duration)) = line.split_once("for: ") else {
                return line.to_owned();
            };
            let seconds = humantime::parse_duration(duration.trim())
                .unwrap_or_else(|e| panic!("a for: duration, {line:?}: {e}"))
                .as_secs();
            changed += 1;
            format!("{indent}for: {}s", (seconds / FOR_DIVISOR).max(1))
        })
        .collect();
    assert!(changed > 0, "the rules have for: durations");
    text.join("\n") + "\n"
}

#[test]
fn the_rules_are_loaded_with_each_for_a_third_as_long() {
    let rules = "      - alert: A\n        for: 1m\n      - alert: B\n        for: 10m\n";
    assert_eq!(
        shortened(rules),
        "      - alert: A\n        for: 20s\n      - alert: B\n        for: 200s\n"
    );
}

/// Every query of the dashboard's panels, named by its panel, with
/// Grafana's variables given values: every job, relay and consumer, and a
/// minute for `$__rate_interval`.
fn dashboard_queries() -> Vec<(String, String)> {
    let path = manifest_dir().join("deploy/grafana/outbox-relay.json");
    let text = std::fs::read_to_string(&path).expect("read the dashboard");
    let dashboard: Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().expect("a target has an expression");
            let expr = expr
                .replace("$__rate_interval", "1m")
                .replace("$job", ".*")
                .replace("$instance", ".*")
                .replace("$consumer", ".*");
            assert!(
                !expr.contains('$'),
                "a variable the test does not fill: {expr}"
            );
            let title = panel["title"].as_str().unwrap_or("?").to_owned();
            queries.push((title, expr));
        }
    }
    assert!(queries.len() > 20, "the dashboard has its panels");
    queries
}

#[test]
fn the_dashboards_panels_have_their_own_ids_and_places() {
    let path = manifest_dir().join("deploy/grafana/outbox-relay.json");
    let text = std::fs::read_to_string(&path).expect("read the dashboard");
    let dashboard: Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let mut ids = std::collections::HashSet::new();
    let mut cells = std::collections::HashMap::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        let title = panel["title"].as_str().unwrap_or("?");
        assert!(
            ids.insert(panel["id"].as_u64()),
            "{title}: an id used twice"
        );
        let at = |field: &str| panel["gridPos"][field].as_u64().expect("a grid position");
        assert!(at("x") + at("w") <= 24, "{title}: wider than the grid");
        for x in at("x")..at("x") + at("w") {
            for y in at("y")..at("y") + at("h") {
                if let Some(other) = cells.insert((x, y), title) {
                    panic!("{title} overlaps {other}");
                }
            }
        }
    }
}

/// The times of a range query's points, in seconds from `from`, as runs
/// of consecutive steps ("2-4, 9"), or "none".
fn runs(series: &[Value], from: f64) -> String {
    let mut times: Vec<f64> = series
        .iter()
        .flat_map(|s| s["values"].as_array().cloned().unwrap_or_default())
        .filter_map(|point| point[0].as_f64())
        .map(|at| at - from)
        .collect();
    times.sort_by(f64::total_cmp);
    let mut runs: Vec<(f64, f64)> = Vec::new();
    for at in times {
        match runs.last_mut() {
            Some((_, end)) if at - *end <= 1.5 => *end = at,
            _ => runs.push((at, at)),
        }
    }
    if runs.is_empty() {
        return "none".into();
    }
    let runs: Vec<String> = runs
        .iter()
        .map(|(start, end)| format!("{start:.0}-{end:.0}"))
        .collect();
    runs.join(", ")
}

/// Every `outbox_*` metric name in `text`.
fn metric_names(text: &str) -> Vec<String> {
    let mut names: Vec<String> = text
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|word| word.starts_with("outbox_"))
        .map(str::to_owned)
        .collect();
    names.sort();
    names.dedup();
    names
}

/// Serves `metrics` on `/metrics` at `port`, as a service embedding an
/// inbox consumer does, until `stop`.
async fn serve_inbox_metrics(metrics: InboxMetrics, port: u16, stop: CancellationToken) {
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .expect("bind the inbox's metrics port");
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let metrics = metrics.clone();
            async move { metrics.render() }
        }),
    );
    tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(stop.cancelled_owned())
            .await;
    });
}

/// Publishes to the test's stream as the relay would, with `headers`.
async fn publish(env: &TestEnv, subject: &str, headers: &[(&str, &str)]) {
    let mut map = HeaderMap::new();
    for (name, value) in headers {
        map.insert(*name, *value);
    }
    env.jetstream
        .publish_with_headers(format!("{}.{subject}", env.prefix), map, "{}".into())
        .await
        .expect("publish")
        .await
        .expect("stored");
}

/// Writes an order with its outbox message every 100 ms until `stop`.
fn keep_writing(env: &TestEnv, stop: CancellationToken) -> tokio::task::JoinHandle<()> {
    let env = env.clone_handles();
    tokio::spawn(async move {
        while !stop.is_cancelled() {
            write_orders(&env, 1).await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
}

#[tokio::test]
async fn prometheus_fires_and_clears_delivery_paused_and_every_dashboard_query_has_data() {
    let nats = NatsProcess::start().await;
    let env = TestEnv::on(&mongodb_uri(), &nats.url()).await;
    let relay_port = free_port();
    let relay_addr = format!("127.0.0.1:{relay_port}");
    let mut relay = RelayProcess::start_with(
        &env,
        "prometheus-paused",
        &[
            ("OUTBOX_METRICS_ADDR", relay_addr.as_str()),
            ("OUTBOX_COLLECT_INTERVAL", "1s"),
            // A lease a loaded server renews through the freeze: a term
            // that ends drops its pause, and the alert would wait for the
            // next term's.
            ("OUTBOX_LEASE_DURATION", "1m"),
            ("OUTBOX_LEASE_RENEW_INTERVAL", "5s"),
        ],
    );
    ready_as(relay_port, LEADING).await;

    // An inbox consumer of the stream, in this process, serving its metrics
    // as a service would. It gives up on `poison` after two attempts.
    let stop = CancellationToken::new();
    let inbox_metrics = InboxMetrics::new();
    let inbox_port = free_port();
    serve_inbox_metrics(inbox_metrics.clone(), inbox_port, stop.clone()).await;
    let inbox = Inbox::builder(&env.db, "billing")
        .metrics(inbox_metrics.clone())
        .build()
        .await
        .expect("an inbox");
    let consumer = inbox
        .consumer(env.jetstream.clone(), &env.stream)
        .retry_delay(Duration::from_millis(20), Duration::from_millis(50))
        .ack_wait(Duration::from_secs(1))
        .max_deliveries(2)
        .bind()
        .await
        .expect("bind the inbox consumer");
    let effects = env.db.collection::<Document>("effects");
    let handling = handler(move |session, message| {
        let effects = effects.clone();
        let poison = message.subject.ends_with(".poison");
        async move {
            if poison {
                return Err(HandlerError::new("a message this handler cannot take"));
            }
            effects
                .insert_one(doc! { "subject": &message.subject })
                .session(session)
                .await?;
            Ok(())
        }
        .boxed()
    });
    let consuming = tokio::spawn(consumer.run(handling, stop.clone()));

    let prometheus =
        PrometheusProcess::start(&[(JOB, vec![relay_port]), (SERVICE, vec![inbox_port])]).await;
    let writing = keep_writing(&env, stop.clone());
    // A dead letter (a type with a space breaks the contract), an inbox
    // message given up on, and a repeat the inbox recognises (a replay of
    // a message it handled): the series a healthy run would not create.
    env.outbox()
        .insert_one(doc! { "type": "bad type!", "payload": {}, "status": "pending" })
        .await
        .unwrap();
    publish(
        &env,
        "poison",
        &[("Nats-Msg-Id", &ObjectId::new().to_hex())],
    )
    .await;
    let handled = ObjectId::new().to_hex();
    publish(&env, "order.direct", &[("Nats-Msg-Id", &handled)]).await;
    wait_until("the inbox to handle, retry and give up", || async {
        let counts = inbox_metrics.counts("billing");
        counts.handled > 0 && counts.failed > 0 && counts.retried > 0
    })
    .await;
    let replay = ObjectId::new().to_hex();
    publish(
        &env,
        "order.direct",
        &[("Nats-Msg-Id", &replay), ("Outbox-Replay-Of", &handled)],
    )
    .await;
    wait_until("the inbox to see the repeat", || async {
        inbox_metrics.counts("billing").repeats > 0
    })
    .await;
    wait_until("Prometheus to see the relay lead", || async {
        !prometheus
            .query(&format!("outbox_leader{{job=\"{JOB}\"}} == 1"))
            .await
            .is_empty()
    })
    .await;
    assert!(prometheus
        .alert_states("OutboxDeliveryPaused")
        .await
        .is_empty());

    // NATS frozen while orders are written: the relay pauses delivery.
    nats.pause();
    let paused = Instant::now();
    prometheus.wait_until_firing("OutboxDeliveryPaused").await;
    let fired = paused.elapsed();
    nats.resume();
    let resumed = Instant::now();
    prometheus
        .wait_for_alert("OutboxDeliveryPaused", None)
        .await;
    let cleared = resumed.elapsed();
    eprintln!(
        "OutboxDeliveryPaused (for: 20s here): firing {:.1} s after NATS froze, cleared {:.1} s \
         after it was back",
        fired.as_secs_f64(),
        cleared.as_secs_f64()
    );

    // Every panel's queries, against what the relay and the inbox export,
    // NATS's reconnection included.
    prometheus.wait_for_data(&dashboard_queries()).await;
    // And every metric the rules watch is one Prometheus has scraped.
    let scraped = prometheus.api("/api/v1/label/__name__/values").await;
    let scraped: Vec<&str> = scraped
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    let rules = std::fs::read_to_string(manifest_dir().join("deploy/prometheus/alerts.yaml"))
        .expect("read the rules");
    let unknown: Vec<String> = metric_names(&rules)
        .into_iter()
        // A histogram is scraped as its buckets, sum and count.
        .filter(|name| {
            ![name.clone(), format!("{name}_bucket")]
                .iter()
                .any(|n| scraped.contains(&n.as_str()))
        })
        .collect();
    assert!(
        unknown.is_empty(),
        "the rules watch metrics never scraped: {unknown:?}"
    );

    stop.cancel();
    writing.await.expect("the writer ends");
    consuming
        .await
        .expect("the consumer did not panic")
        .expect("the consumer ran without error");
    relay.terminate().await;
    drop(prometheus);
    env.drop().await;
}

#[tokio::test]
async fn a_takeover_within_the_lease_fires_no_no_leader_alert() {
    let env = TestEnv::new().await;
    let ports = [free_port(), free_port()];
    let addrs = ports.map(|port| format!("127.0.0.1:{port}"));
    let start = |n: usize| {
        let mut settings = vec![("OUTBOX_METRICS_ADDR", addrs[n].as_str())];
        settings.extend(QUICK_TAKEOVER);
        RelayProcess::start_with(&env, &format!("prometheus-takeover-{n}"), &settings)
    };
    let mut relays = [start(0), start(1)];
    for port in ports {
        wait_until(&format!("the relay on {port} ready"), || async {
            get(port, "/readyz")
                .await
                .is_some_and(|(status, _)| status == 200)
        })
        .await;
    }
    let prometheus = PrometheusProcess::start(&[(JOB, ports.to_vec())]).await;
    // Which relay leads, as Prometheus sees it (on a loaded machine the
    // lease may have changed hands since the first took it).
    let leading = format!("outbox_leader{{job=\"{JOB}\"}} == 1");
    let leader = std::cell::Cell::new(None);
    wait_until("Prometheus to see both relays, one leading", || {
        let leader = &leader;
        let leading = &leading;
        let prometheus = &prometheus;
        async move {
            let up = prometheus.query(&format!("up{{job=\"{JOB}\"}} == 1")).await;
            let leaders = prometheus.query(leading).await;
            leader.set(
                leaders
                    .first()
                    .and_then(|series| series["metric"]["instance"].as_str())
                    .and_then(|instance| {
                        ports
                            .iter()
                            .position(|p| instance.ends_with(&format!(":{p}")))
                    }),
            );
            up.len() == 2 && leaders.len() == 1
        }
    })
    .await;
    let leader = leader.get().expect("a leader");
    let standby = 1 - leader;
    // Nothing left pending from before (Prometheus's first scrapes, or a
    // lease that changed hands on a loaded machine), so that the window
    // below is the takeover's alone.
    prometheus.wait_for_alert("OutboxNoLeader", None).await;

    let killed_at = prometheus.now().await;
    relays[leader].kill9();
    wait_until("Prometheus to see the standby lead", || async {
        let led = format!(
            "outbox_leader{{job=\"{JOB}\",instance=\"127.0.0.1:{}\"}} == 1",
            ports[standby]
        );
        !prometheus.query(&led).await.is_empty()
    })
    .await;
    // Two evaluations after Prometheus saw a leader again: the rule has
    // seen the condition end, so no later evaluation can fire it for this
    // window.
    let seen = prometheus.now().await;
    wait_until("two rule evaluations after the takeover", || async {
        prometheus.last_evaluation().await > seen + 2.0
    })
    .await;
    let end = prometheus.now().await;
    let query =
        |state: &str| format!("ALERTS{{alertname=\"OutboxNoLeader\",alertstate=\"{state}\"}}");
    // What Prometheus saw: when no relay led, and when the alert was
    // pending (allowed: its for: is longer than a takeover).
    let leaderless = prometheus
        .query_range(
            &format!("max(outbox_leader{{job=\"{JOB}\"}}) < 1"),
            killed_at,
            end,
        )
        .await;
    let pending = prometheus
        .query_range(&query("pending"), killed_at, end)
        .await;
    let (leaderless, pending) = (runs(&leaderless, killed_at), runs(&pending, killed_at));
    let firing = prometheus
        .query_range(&query("firing"), killed_at, end)
        .await;
    assert!(
        firing.is_empty(),
        "OutboxNoLeader fired through a takeover: no leader in Prometheus at {leaderless} s \
         after the kill (a takeover longer than the 20 s for: is a machine too loaded for the \
         2 s lease); {firing:?}"
    );
    eprintln!(
        "takeover: no leader in Prometheus at {leaderless} s after the kill; OutboxNoLeader \
         (for: 20s here) pending at {pending} s, never firing"
    );

    // The rule is not blind: with the last relay gone too, it fires.
    relays[standby].kill9();
    prometheus.wait_until_firing("OutboxNoLeader").await;
    drop(prometheus);
    env.drop().await;
}
