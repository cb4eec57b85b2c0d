//! The container image, run as users run it: against the real servers, on
//! the host's network, read-only and unprivileged. It needs the image
//! (`scripts/image.sh --offline` builds it) and a container engine, so it
//! is not among the default tests: `scripts/test.sh` builds the image and
//! runs these with `cargo test --test image`.

#[path = "../common/mod.rs"]
mod common;

use std::collections::HashSet;
use std::time::Instant;

use bson::{doc, Document};
use common::container::Image;
use common::{
    count_by_id, free_port, get, ready_as, wait_until, write_orders, RelayProcess, TestEnv,
    LEADING, STANDING_BY,
};

/// The image's metrics address: every interface, port 9464.
const IMAGE_METRICS_PORT: u16 = 9464;

/// What `/proc/<pid>/status` says of the relay's process.
fn status_field(pid: u32, field: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("its status");
    status
        .lines()
        .find_map(|line| line.strip_prefix(field))
        .unwrap_or_else(|| panic!("no {field} in the status of {pid}"))
        .trim()
        .to_owned()
}

/// The mount options of the relay's root filesystem.
fn root_mount_options(pid: u32) -> String {
    let mounts = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).expect("its mounts");
    mounts
        .lines()
        .map(|line| line.split(' ').collect::<Vec<_>>())
        .find(|fields| fields.get(4) == Some(&"/"))
        .and_then(|fields| fields.get(5).map(|options| options.to_string()))
        .expect("a root mount")
}

/// Whether something on this host listens on TCP `port` on every IPv4
/// interface (0.0.0.0), not on loopback alone.
fn listens_on_every_interface(port: u16) -> bool {
    let table = std::fs::read_to_string("/proc/net/tcp").expect("the TCP table");
    let local = format!("00000000:{port:04X}");
    table.lines().skip(1).any(|line| {
        let fields: Vec<_> = line.split_whitespace().collect();
        fields.get(1) == Some(&local.as_str()) && fields.get(3) == Some(&"0A")
    })
}

/// The lease in the test's checkpoint document.
async fn lease(env: &TestEnv) -> Document {
    env.db
        .collection::<Document>("outbox_checkpoints")
        .find_one(doc! { "_id": format!("{}.outbox", env.name) })
        .await
        .expect("read the lease")
        .expect("a lease")
}

fn term(lease: &Document) -> i64 {
    lease.get_i64("term").expect("a term")
}

#[tokio::test]
async fn the_image_runs_read_only_unprivileged_as_pid_one_and_serves_every_interface() {
    let image = Image::from_env();
    let env = TestEnv::new().await;
    assert!(
        std::net::TcpListener::bind(("0.0.0.0", IMAGE_METRICS_PORT)).is_ok(),
        "port {IMAGE_METRICS_PORT}, the image's metrics port, is taken on this host"
    );
    let mut receiver = env.subscribe().await;
    let mut relay = RelayProcess::start_in(image, &env, "image", &[]);
    ready_as(IMAGE_METRICS_PORT, LEADING).await;

    let pid = relay.pid();
    let (uid, gid) = (status_field(pid, "Uid:"), status_field(pid, "Gid:"));
    assert_eq!(
        uid.split_whitespace().collect::<HashSet<_>>(),
        ["65532"].into()
    );
    assert_eq!(
        gid.split_whitespace().collect::<HashSet<_>>(),
        ["65532"].into()
    );
    let pid_in_container = status_field(pid, "NSpid:");
    assert_eq!(
        pid_in_container.split_whitespace().last(),
        Some("1"),
        "the relay is the container's first process, so signals reach it"
    );
    assert_eq!(status_field(pid, "CapEff:"), "0000000000000000");
    assert_eq!(status_field(pid, "NoNewPrivs:"), "1");
    let root = root_mount_options(pid);
    assert!(root.split(',').any(|o| o == "ro"), "root mounted {root}");
    assert!(
        listens_on_every_interface(IMAGE_METRICS_PORT),
        "the image listens for probes and scrapes on every interface"
    );

    let ids = write_orders(&env, 5).await;
    let delivered = receiver.until_id(ids[4]).await;
    let counts = count_by_id(&delivered);
    assert!(
        ids.iter().all(|id| counts.get(&id.to_hex()) == Some(&1)),
        "each once: {counts:?}"
    );
    env.wait_count(doc! { "status": "processed" }, 5).await;
    assert_eq!(
        get(IMAGE_METRICS_PORT, "/healthz").await.map(|(s, _)| s),
        Some(200)
    );
    // Counted once the marks' write returned, which may be just after
    // the documents show them.
    wait_until("/metrics to count the deliveries", || async {
        get(IMAGE_METRICS_PORT, "/metrics")
            .await
            .is_some_and(|(status, metrics)| {
                status == 200 && metrics.lines().any(|l| l == "outbox_processed_total 5")
            })
    })
    .await;
    relay.terminate().await;
    env.drop().await;
}

#[tokio::test]
async fn a_stopped_leader_hands_over_at_once_and_a_killed_one_after_its_lease() {
    let env = TestEnv::new().await;
    let mut receiver = env.subscribe().await;
    let ports = [free_port(), free_port(), free_port()];
    let addrs = ports.map(|port| format!("0.0.0.0:{port}"));
    // The first leader holds a lease far longer than any wait here: a
    // standby that leads within a wait led because the lease was released.
    // The others hold short ones, which a standby outlasts after a kill.
    let relay = |label: &str, addr: &str, lease: &str| {
        let settings = [
            ("OUTBOX_METRICS_ADDR", addr),
            ("OUTBOX_LEASE_DURATION", lease),
            ("OUTBOX_LEASE_RENEW_INTERVAL", "1s"),
        ];
        RelayProcess::start_in(Image::from_env(), &env, label, &settings)
    };
    let mut first = relay("first", &addrs[0], "5m");
    ready_as(ports[0], LEADING).await;
    let second = relay("second", &addrs[1], "4s");
    ready_as(ports[1], STANDING_BY).await;
    let before = write_orders(&env, 10).await;
    let mut delivered = receiver.until_id(before[9]).await;

    let held = term(&lease(&env).await);
    let stopping = Instant::now();
    first.terminate().await;
    let stopped = stopping.elapsed();
    ready_as(ports[1], LEADING).await;
    eprintln!(
        "SIGTERM to exit: {stopped:?}; to the standby leading: {:?}",
        stopping.elapsed()
    );
    assert_eq!(term(&lease(&env).await), held + 1, "the standby leads");
    let log = std::fs::read_to_string(&first.log).unwrap_or_default();
    assert!(log.contains("released the lease"), "{log}");
    let handed_over = write_orders(&env, 10).await;
    delivered.extend(receiver.until_id(handed_over[9]).await);
    let counts = count_by_id(&delivered);
    assert!(
        before
            .iter()
            .chain(&handed_over)
            .all(|id| counts.get(&id.to_hex()) == Some(&1)),
        "each once, through a graceful handover: {counts:?}"
    );

    let mut third = relay("third", &addrs[2], "4s");
    ready_as(ports[2], STANDING_BY).await;
    let killing = Instant::now();
    second.signal("KILL");
    ready_as(ports[2], LEADING).await;
    eprintln!("kill -9 to the standby leading: {:?}", killing.elapsed());
    let after = write_orders(&env, 10).await;
    receiver.until_id(after[9]).await;
    env.wait_count(doc! { "status": "processed" }, 30).await;
    // A kill between a publish and its mark publishes it again, which
    // JetStream drops by its id: the stream holds each message once.
    assert_eq!(env.stream_count().await, 30);
    third.terminate().await;
    env.drop().await;
}
