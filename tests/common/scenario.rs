//! What a fault scenario needs: its own servers, a writer committing
//! messages in transactions while the fault happens, a core-NATS count of
//! every publish (a repeat JetStream drops still counts), and the check at
//! the end that everything committed arrived once in the stream, each key
//! in commit order, with the figures written to `target/fault-report.jsonl`.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bson::{doc, oid::ObjectId, Document};
use futures::{StreamExt, TryStreamExt};
use outbox_relay::{NewMessage, Outbox};
use tokio_util::sync::CancellationToken;

use super::{manifest_dir, MongoProcess, NatsProcess, RelayProcess, TestEnv, WAIT};

/// The longest a scenario waits for everything to be delivered at the end:
/// a bound for a relay that stopped, not a speed to meet. SecantusDB's
/// Python build drains about a hundred messages a second here with the
/// test's reads beside it, so 6,000 take about a minute on an idle machine.
pub const DRAIN: Duration = Duration::from_secs(240);

/// Every publish seen on the scenario's subjects, with when it arrived.
#[derive(Clone, Default)]
pub struct Publishes(Arc<Mutex<Vec<(String, Instant)>>>);

impl Publishes {
    pub async fn watch(env: &TestEnv) -> Self {
        let publishes = Publishes::default();
        let mut subscriber = env
            .nats
            .subscribe(format!("{}.>", env.prefix))
            .await
            .unwrap();
        env.nats.flush().await.unwrap();
        let sink = publishes.clone();
        tokio::spawn(async move {
            while let Some(message) = subscriber.next().await {
                if let Some(id) = super::msg_id(&message) {
                    if let Ok(mut all) = sink.0.lock() {
                        all.push((id, Instant::now()));
                    }
                }
            }
        });
        publishes
    }

    /// Publishes past the first of each message: the repeats.
    pub fn repeats(&self) -> usize {
        let Ok(all) = self.0.lock() else {
            return 0;
        };
        let distinct: HashSet<&String> = all.iter().map(|(id, _)| id).collect();
        all.len() - distinct.len()
    }

    pub fn count(&self) -> usize {
        self.0.lock().map(|all| all.len()).unwrap_or(0)
    }

    /// The longest time without any publish between `from` and `to`: with
    /// messages committed every 20 ms, the pause a fault caused.
    /// The window starts a second before `from`, so the last publishes
    /// before the fault are in it.
    pub fn longest_gap(&self, from: Instant, to: Instant) -> Duration {
        let from = from.checked_sub(Duration::from_secs(1)).unwrap_or(from);
        let Ok(all) = self.0.lock() else {
            return Duration::ZERO;
        };
        let mut times: Vec<Instant> = all
            .iter()
            .map(|(_, at)| *at)
            .filter(|at| *at >= from && *at <= to)
            .collect();
        times.sort();
        times
            .windows(2)
            .map(|w| w[1] - w[0])
            .max()
            .unwrap_or_default()
    }

    /// The messages published after `since`.
    pub fn published_after(&self, since: Instant) -> HashSet<String> {
        let Ok(all) = self.0.lock() else {
            return HashSet::new();
        };
        all.iter()
            .filter(|(_, at)| *at > since)
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// The first publish arriving after `since`.
    pub fn first_after(&self, since: Instant) -> Option<Instant> {
        let all = self.0.lock().ok()?;
        all.iter().map(|(_, at)| *at).filter(|at| *at > since).min()
    }

    /// Waits until `n` publishes arrived after `since`.
    pub async fn wait_count_after(&self, since: Instant, n: usize) {
        super::wait_until(&format!("{n} publishes after the fault"), || async {
            self.0
                .lock()
                .map(|all| all.iter().filter(|(_, at)| *at > since).count() >= n)
                .unwrap_or(false)
        })
        .await;
    }

    pub async fn wait_first_after(&self, since: Instant) -> Duration {
        super::wait_until("a publish after the fault", || async {
            self.first_after(since).is_some()
        })
        .await;
        self.first_after(since)
            .map(|at| at - since)
            .unwrap_or_default()
    }
}

/// What a relay killed at the scenarios' rates (50 to 150 messages a
/// second) may have published and not yet marked: the most a takeover or
/// a restart after SIGKILL may publish again (docs/guarantees.md, the
/// fault matrix).
pub const IN_FLIGHT_AT_MOST: usize = 10;

impl Publishes {
    /// Fails the scenario if more than `bound` publishes were repeats.
    pub fn assert_repeats_at_most(&self, bound: usize, scenario: &str) {
        let repeats = self.repeats();
        assert!(
            repeats <= bound,
            "{scenario}: {repeats} messages published again, more than the {bound} the docs allow"
        );
    }
}

/// Writes orders with their outbox messages in transactions, one every
/// 20 ms, until stopped, over five keys in turn (or as many as asked);
/// every tenth transaction is aborted on purpose. Failed writes (a server
/// is down) are retried. Returns the aborted ids.
pub struct Writer {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Vec<ObjectId>>,
}

impl Writer {
    pub fn start(env: &TestEnv) -> Self {
        Self::start_every(env, Duration::from_millis(20))
    }

    /// A writer that starts a transaction every `interval` (as far as
    /// the server keeps up: a late one is not made up for).
    pub fn start_every(env: &TestEnv, interval: Duration) -> Self {
        Self::start_on(env.client.clone(), env, interval)
    }

    /// A writer every `interval` over `keys` keys in turn, so that they
    /// spread over many partitions.
    pub fn start_keyed(env: &TestEnv, interval: Duration, keys: i64) -> Self {
        Self::start_with(env.client.clone(), env, interval, keys)
    }

    /// A writer of its own `client` (one a fail point may name) into the
    /// database of `env`.
    pub fn start_on(client: mongodb::Client, env: &TestEnv, interval: Duration) -> Self {
        Self::start_with(client, env, interval, KEYS)
    }

    fn start_with(client: mongodb::Client, env: &TestEnv, interval: Duration, keys: i64) -> Self {
        let stop = CancellationToken::new();
        let db = client.database(&env.name);
        let until = stop.clone();
        let task = tokio::spawn(async move {
            let outbox = Outbox::new(&db);
            let orders = db.collection::<Document>("orders");
            let mut aborted = Vec::new();
            let mut ticks = tokio::time::interval(interval);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            while !until.is_cancelled() {
                ticks.tick().await;
                let n = NUMBERED.fetch_add(1, Ordering::Relaxed) + 1;
                let abort = n % 10 == 0;
                let key = format!("k{}", n % keys);
                match write_keyed(&client, &outbox, &orders, n, abort, &key).await {
                    Ok(id) if abort => aborted.push(id),
                    Ok(_) => {}
                    Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                }
            }
            aborted
        });
        Writer { stop, task }
    }

    pub async fn finish(self) -> Vec<ObjectId> {
        self.stop.cancel();
        tokio::time::timeout(WAIT, self.task)
            .await
            .expect("writer stops")
            .expect("writer task")
    }
}

/// The number of the last order any writer of this process wrote: a test
/// that starts a second writer after the first goes on numbering, so that
/// each key's commit order is its orders' order (`committed_per_key`).
static NUMBERED: AtomicI64 = AtomicI64::new(0);

/// How many keys a writer writes in turn, unless asked for more.
const KEYS: i64 = 5;

pub async fn write_one(
    client: &mongodb::Client,
    outbox: &Outbox,
    orders: &mongodb::Collection<Document>,
    n: i64,
    abort: bool,
) -> outbox_relay::Result<ObjectId> {
    write_keyed(client, outbox, orders, n, abort, &key_of(n)).await
}

/// Writes order `n` with its outbox message of `key` in one transaction,
/// and aborts it if `abort`.
pub async fn write_keyed(
    client: &mongodb::Client,
    outbox: &Outbox,
    orders: &mongodb::Collection<Document>,
    n: i64,
    abort: bool,
    key: &str,
) -> outbox_relay::Result<ObjectId> {
    let failed = |e| outbox_relay::Error::Config(format!("write failed: {e}"));
    let mut session = client.start_session().await.map_err(failed)?;
    session.start_transaction().await.map_err(failed)?;
    orders
        .insert_one(doc! { "n": n })
        .session(&mut session)
        .await
        .map_err(failed)?;
    // A few keys, so each scenario checks the order of each key too; one
    // writer writes them in turn, so `n` is commit order.
    let message = NewMessage::serialized("order.placed", &doc! { "n": n })?.key(key);
    let id = outbox.add(&mut session, message).await?;
    if abort {
        session.abort_transaction().await.map_err(failed)?;
    } else {
        session.commit_transaction().await.map_err(failed)?;
    }
    Ok(id)
}

pub fn key_of(n: i64) -> String {
    format!("k{}", n % KEYS)
}

/// Each key's committed messages in commit order (by the writer's `n`).
pub fn committed_per_key(documents: &[Document]) -> HashMap<String, Vec<ObjectId>> {
    let mut numbered: Vec<(i64, String, ObjectId)> = documents
        .iter()
        .filter_map(|d| {
            let n = d.get_document("payload").ok()?.get_i64("n").ok()?;
            Some((
                n,
                d.get_str("key").ok()?.to_owned(),
                d.get_object_id("_id").ok()?,
            ))
        })
        .collect();
    numbered.sort();
    let mut per_key: HashMap<String, Vec<ObjectId>> = HashMap::new();
    for (_, key, id) in numbered {
        per_key.entry(key).or_default().push(id);
    }
    per_key
}

/// Waits until nothing is pending, then checks the stream against the
/// collection (each key in commit order), and writes the scenario's
/// figures to the report.
pub async fn verify(
    env: &TestEnv,
    scenario: &str,
    publishes: &Publishes,
    aborted: &[ObjectId],
    extra: serde_json::Value,
) {
    verify_with_deleted(env, scenario, publishes, aborted, &[], extra).await;
}

/// [`verify`], where the messages `deleted` were delivered and then
/// deleted from the outbox (as `--retention` does): committed all the same.
pub async fn verify_with_deleted(
    env: &TestEnv,
    scenario: &str,
    publishes: &Publishes,
    aborted: &[ObjectId],
    deleted: &[ObjectId],
    extra: serde_json::Value,
) {
    let outbox = env.outbox();
    let deadline = Instant::now() + DRAIN;
    loop {
        let pending = outbox
            .count_documents(doc! { "status": "pending" })
            .await
            .unwrap_or(u64::MAX);
        if pending == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{scenario}: {pending} messages still pending"
        );
        // SecantusDB counts a backlog slowly and holds other work meanwhile
        // (README): a tighter poll would slow the relay it waits for.
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let documents: Vec<Document> = outbox
        .find(doc! {})
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    let failed: Vec<&Document> = documents
        .iter()
        .filter(|d| d.get_str("status") != Ok("processed"))
        .collect();
    assert!(failed.is_empty(), "{scenario}: not processed: {failed:?}");
    let committed: HashSet<String> = documents
        .iter()
        .filter_map(|d| d.get_object_id("_id").ok())
        .chain(deleted.iter().copied())
        .map(|id| id.to_hex())
        .collect();

    let stored = env.stored().await;
    let mut in_stream: HashMap<String, usize> = HashMap::new();
    for message in &stored {
        *in_stream.entry(message.id.clone()).or_default() += 1;
    }
    let stream_ids: HashSet<String> = in_stream.keys().cloned().collect();
    let missing: Vec<&String> = committed.difference(&stream_ids).collect();
    let phantom: Vec<&String> = stream_ids.difference(&committed).collect();
    assert!(
        missing.is_empty(),
        "{scenario}: {} committed messages never reached the stream: {missing:?}",
        missing.len()
    );
    assert!(
        phantom.is_empty(),
        "{scenario}: {} messages in the stream were never committed: {phantom:?}",
        phantom.len()
    );
    assert!(
        in_stream.values().all(|&n| n == 1),
        "{scenario}: the stream holds a message twice"
    );
    let aborted_seen: Vec<String> = aborted
        .iter()
        .map(|id| id.to_hex())
        .filter(|id| stream_ids.contains(id))
        .collect();
    assert!(
        aborted_seen.is_empty(),
        "{scenario}: aborted transactions published: {aborted_seen:?}"
    );
    assert!(
        committed.len() >= 20,
        "{scenario}: too few messages written to mean anything"
    );
    assert_order_of(&stored, &documents);

    // Let late duplicates land before counting them.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let raw = publishes.count();
    let mut report = serde_json::json!({
        "scenario": scenario,
        "committed": committed.len(),
        "aborted": aborted.len(),
        "raw_publishes": raw,
        "duplicate_publishes": raw.saturating_sub(committed.len()),
    });
    if let (Some(report), Some(extra)) = (report.as_object_mut(), extra.as_object()) {
        report.extend(extra.clone());
    }
    append_report(&report);
}

/// Asserts that the stream (`stored`) holds each key's messages of
/// `documents` in their commit order; messages of other documents (deleted
/// ones, checked when they were there) are left out.
pub fn assert_order_of(stored: &[super::Stored], documents: &[Document]) {
    let ids: HashSet<String> = documents
        .iter()
        .filter_map(|d| d.get_object_id("_id").ok())
        .map(|id| id.to_hex())
        .collect();
    let theirs: Vec<super::Stored> = stored
        .iter()
        .filter(|message| ids.contains(&message.id))
        .cloned()
        .collect();
    super::assert_order_per_key(&theirs, &committed_per_key(documents));
}

/// Adds a scenario's figures to `target/fault-report.jsonl`.
pub fn append_report(report: &serde_json::Value) {
    let line = format!("{report}\n");
    let path = manifest_dir().join("target").join("fault-report.jsonl");
    let appended = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut file| std::io::Write::write_all(&mut file, line.as_bytes()));
    assert!(appended.is_ok(), "write the fault report");
}

/// A scenario's own servers, so its faults cannot touch other tests.
pub struct Servers {
    pub mongo: MongoProcess,
    pub nats: NatsProcess,
}

impl Servers {
    pub async fn start() -> Self {
        Servers {
            mongo: MongoProcess::start().await,
            nats: NatsProcess::start().await,
        }
    }

    /// Servers whose MongoDB takes `configureFailPoint` (see [`super::failpoint`]).
    pub async fn with_fail_points() -> Self {
        Servers {
            mongo: MongoProcess::start_with(&["--enable-test-commands"]).await,
            nats: NatsProcess::start().await,
        }
    }

    /// A test environment on these servers.
    pub async fn env(&self) -> TestEnv {
        TestEnv::on(&self.mongo.uri(), &self.nats.url()).await
    }
}

/// Which relay (by pid) holds each of `count` partitions' leases, live by
/// this host's clock (the servers run on it).
pub async fn partition_holders(env: &TestEnv, count: u32) -> Vec<Option<u32>> {
    let checkpoints = env.db.collection::<Document>("outbox_checkpoints");
    let now = bson::DateTime::now();
    let mut holders = Vec::new();
    for index in 0..count {
        let lease = checkpoints
            .find_one(doc! { "_id": partition_document(env, index, count) })
            .await
            .ok()
            .flatten();
        let holder = lease.and_then(|lease| {
            let live = lease.get_datetime("expiresAt").is_ok_and(|at| *at > now);
            let owner = lease.get_str("owner").ok()?;
            let pid = owner.split('/').nth(1)?.parse().ok()?;
            live.then_some(pid)
        });
        holders.push(holder);
    }
    holders
}

/// The `_id` of the document holding partition `index` of `count`'s lease
/// and position: the whole outbox's where there is one partition.
fn partition_document(env: &TestEnv, index: u32, count: u32) -> String {
    if count == 1 {
        format!("{}.outbox", env.name)
    } else {
        format!("{}.outbox:{index}/{count}", env.name)
    }
}

/// Waits until each of `count` partitions has a stored position: its
/// stream is open, and a relay that starts from it replays rather than
/// reads a snapshot. On SecantusDB a write committed while a first start
/// reads its snapshot can be missed by both the snapshot and the stream,
/// and reach NATS only by the sweep, after its key's later messages
/// (docs/developing.md, "SecantusDB"): a test that checks each key's order
/// writes once its partitions' streams are open, not while they start.
pub async fn wait_positions(env: &TestEnv, count: u32) {
    let checkpoints = env.db.collection::<Document>("outbox_checkpoints");
    let ids: Vec<String> = (0..count)
        .map(|index| partition_document(env, index, count))
        .collect();
    super::wait_until("every partition's stream to store its position", || {
        let filter = doc! { "_id": { "$in": &ids }, "token": { "$exists": true } };
        let checkpoints = checkpoints.clone();
        async move {
            checkpoints
                .count_documents(filter)
                .await
                .is_ok_and(|stored| stored == u64::from(count))
        }
    })
    .await;
}

/// Waits until `relays` hold all `count` partitions between them in fair
/// shares (none more than one above another), each with its stream open
/// ([`wait_positions`]), and returns each relay's count in the order given.
pub async fn wait_shared(env: &TestEnv, relays: &[&RelayProcess], count: u32) -> Vec<usize> {
    let pids: Vec<u32> = relays.iter().map(|r| r.pid()).collect();
    let shares_of = |holders: &[Option<u32>]| -> Vec<usize> {
        pids.iter()
            .map(|pid| holders.iter().filter(|h| **h == Some(*pid)).count())
            .collect()
    };
    let deadline = Instant::now() + WAIT;
    loop {
        let holders = partition_holders(env, count).await;
        let shares = shares_of(&holders);
        let (least, most) = (shares.iter().min(), shares.iter().max());
        if holders
            .iter()
            .all(|h| h.is_some_and(|pid| pids.contains(&pid)))
            && most
                .zip(least)
                .is_some_and(|(most, least)| most - least <= 1)
        {
            wait_positions(env, count).await;
            return shares;
        }
        assert!(
            Instant::now() < deadline,
            "{} relays did not share the {count} partitions: {holders:?}",
            pids.len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
