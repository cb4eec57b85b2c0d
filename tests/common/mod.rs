//! Shared set-up for tests against the real servers.
//!
//! Each test gets its own database, subject prefix and JetStream stream, so
//! tests run in parallel without seeing each other's messages. Servers come
//! from MONGODB_URI and NATS_URL (scripts/services.sh starts local ones); a
//! missing server fails the test with a message saying so.

#![allow(dead_code)]

pub mod container;
pub mod failpoint;
pub mod history;
pub mod scenario;

use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use bson::{doc, oid::ObjectId, Document};
use futures::{FutureExt, StreamExt, TryStreamExt};
use mongodb::{Client, Collection, Database};
use outbox_relay::{Relay, RelayConfig};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The longest any single wait in a test may take.
pub const WAIT: Duration = Duration::from_secs(30);

pub fn mongodb_uri() -> String {
    std::env::var("MONGODB_URI").unwrap_or_else(|_| "mongodb://127.0.0.1:27017".into())
}

pub fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// One test's private corner of the servers.
pub struct TestEnv {
    pub mongodb_uri: String,
    pub nats_url: String,
    pub name: String,
    pub client: Client,
    pub db: Database,
    pub nats: async_nats::Client,
    pub jetstream: jetstream::Context,
    pub prefix: String,
    pub stream: String,
}

impl TestEnv {
    pub async fn new() -> Self {
        Self::on(&mongodb_uri(), &nats_url()).await
    }

    /// A test's corner of the given servers.
    pub async fn on(mongodb_uri: &str, nats_url: &str) -> Self {
        let name = format!("t{}", ObjectId::new().to_hex());
        let client = outbox_relay::connect::connect_mongodb(mongodb_uri)
            .await
            .unwrap_or_else(|e| {
                panic!("tests need a MongoDB replica set (scripts/services.sh start): {e}")
            });
        let nats = connect_nats(nats_url)
            .await
            .unwrap_or_else(|e| panic!("tests need nats-server (scripts/services.sh start): {e}"));
        let jetstream = jetstream::new(nats.clone());
        let prefix = name.clone();
        let stream = name.to_uppercase();
        let config = jetstream::stream::Config {
            name: stream.clone(),
            subjects: vec![format!("{prefix}.>")],
            // Long enough for the relay's start-up check under any
            // interval a test sets (its redelivery gap grows with them).
            duplicate_window: Duration::from_secs(4 * 3600),
            ..Default::default()
        };
        // nats-server 2.9 removes an account's stream directory with its
        // last stream, and a stream created at that moment fails to make
        // its store (docs/developing.md): tests create and delete streams
        // side by side, so a failed creation is tried again, a few times.
        let mut tries = 0;
        while let Err(error) = jetstream.create_stream(config.clone()).await {
            tries += 1;
            assert!(tries < 5, "create the test stream: {error}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let db = client.database(&name);
        // Collections and the outbox's indexes exist before any relay or
        // writer starts: SecantusDB's index builds can miss inserts that
        // race them (docs/developing.md, SecantusDB), and a document missing from the
        // index is invisible to every query the index serves.
        for collection in ["outbox", "orders"] {
            db.create_collection(collection)
                .await
                .expect("create a collection");
        }
        outbox_relay::setup::ensure_sweep_index(&db.collection("outbox"))
            .await
            .expect("create the outbox's indexes");
        TestEnv {
            mongodb_uri: mongodb_uri.to_owned(),
            nats_url: nats_url.to_owned(),
            name,
            client,
            db,
            nats,
            jetstream,
            prefix,
            stream,
        }
    }

    pub fn config(&self) -> RelayConfig {
        let mut config = RelayConfig::new(self.mongodb_uri.clone(), self.name.clone());
        config.nats_url = self.nats_url.clone();
        config.subject_prefix = self.prefix.clone();
        config.checkpoint_interval = Duration::from_millis(50);
        config.max_await_time = Duration::from_millis(100);
        config.idle_checkpoint_interval = Duration::from_millis(200);
        config.ack_timeout = Duration::from_secs(2);
        // Tests run many relays at once; a test that scrapes one serves it.
        config.metrics_addr = None;
        // SecantusDB walks its oplog to find its ends, and holds every
        // write meanwhile (README).
        config.oplog_headroom_warning = None;
        config
    }

    /// A configuration whose sweeps and retries come quickly: refused
    /// messages are retried after 20 to 40 ms, `max_attempts` times.
    pub fn quick_config(&self, max_attempts: u32) -> RelayConfig {
        let mut config = self.config();
        config.sweep_interval = Duration::from_millis(50);
        config.grace_period = Duration::from_millis(100);
        config.retry_initial_delay = Duration::from_millis(20);
        config.retry_max_delay = Duration::from_millis(40);
        config.max_attempts = max_attempts;
        config
    }

    /// A configuration for one of several relays: short lease timings, and
    /// no sweep of fresh messages, so only a leader's stream delivers them.
    pub fn replica_config(&self) -> RelayConfig {
        let mut config = self.config();
        config.grace_period = Duration::from_secs(3600);
        config.lease_duration = Duration::from_millis(1500);
        config.lease_renew_interval = Duration::from_millis(300);
        config.standby_poll_interval = Duration::from_millis(100);
        config
    }

    pub fn outbox(&self) -> Collection<Document> {
        self.db.collection("outbox")
    }

    /// A core NATS subscription to every subject of this test.
    pub async fn subscribe(&self) -> Receiver {
        let subscriber = self
            .nats
            .subscribe(format!("{}.>", self.prefix))
            .await
            .expect("subscribe");
        self.nats.flush().await.expect("flush subscription");
        Receiver { subscriber }
    }

    /// How many messages the test's JetStream stream holds.
    pub async fn stream_count(&self) -> u64 {
        let mut stream = self
            .jetstream
            .get_stream(&self.stream)
            .await
            .expect("stream");
        stream.info().await.expect("stream info").state.messages
    }

    /// Every message in this test's stream, in stream order.
    pub async fn stored(&self) -> Vec<Stored> {
        let mut stream = self
            .jetstream
            .get_stream(&self.stream)
            .await
            .expect("stream");
        stream_messages(&mut stream)
            .await
            .iter()
            .map(|message| Stored {
                sequence: message.sequence,
                id: stored_header(message, "Nats-Msg-Id").unwrap_or_default(),
                key: stored_header(message, "Outbox-Key"),
            })
            .collect()
    }

    /// Inserts a pending message of `key` whose payload is `size` bytes;
    /// returns its id once it is committed.
    pub async fn insert_keyed(&self, key: &str, size: usize) -> ObjectId {
        let id = ObjectId::new();
        self.outbox()
            .insert_one(doc! {
                "_id": id, "type": "keyed", "key": key, "payload": "x".repeat(size),
                "status": "pending",
            })
            .await
            .expect("insert a keyed message");
        id
    }

    /// The stored resume token of this test's outbox, if any.
    pub async fn checkpoint_token(&self) -> Option<bson::Bson> {
        self.db
            .collection::<Document>("outbox_checkpoints")
            .find_one(doc! { "_id": format!("{}.outbox", self.name) })
            .await
            .expect("read the checkpoint")
            .and_then(|checkpoint| checkpoint.get("token").cloned())
    }

    /// Counts outbox documents matching `filter`.
    pub async fn count(&self, filter: Document) -> u64 {
        self.outbox().count_documents(filter).await.expect("count")
    }

    /// Waits until `count(filter) == expected`. Timed out, it says how many
    /// documents of each status the outbox holds, which tells a writer held
    /// up by the server from a relay that did not deliver.
    pub async fn wait_count(&self, filter: Document, expected: u64) {
        let outbox = self.outbox();
        let reached = poll_until(|| {
            let outbox = outbox.clone();
            let filter = filter.clone();
            async move { outbox.count_documents(filter.clone()).await.ok() == Some(expected) }
        })
        .await;
        if !reached {
            panic!(
                "timed out waiting for {expected} documents matching {filter}; \
                 the outbox holds {}",
                self.statuses().await
            );
        }
    }

    /// How many documents of each status the outbox holds.
    pub async fn statuses(&self) -> String {
        let grouped = async {
            let pipeline = [doc! { "$group": { "_id": "$status", "n": { "$sum": 1 } } }];
            let cursor = self.outbox().aggregate(pipeline).await?;
            cursor.try_collect::<Vec<Document>>().await
        };
        // A server stuck enough to time a wait out may not answer this either.
        let Ok(Ok(groups)) = tokio::time::timeout(Duration::from_secs(10), grouped).await else {
            return "(unreadable)".into();
        };
        let counts: Vec<String> = groups
            .iter()
            .map(|group| {
                format!(
                    "{}: {}",
                    group.get("_id").map_or("?".into(), |s| s.to_string()),
                    group.get("n").map_or("?".into(), |n| n.to_string())
                )
            })
            .collect();
        format!("{{ {} }}", counts.join(", "))
    }

    /// Creates this test's stream (its subjects) on another NATS server.
    pub async fn create_stream_on(&self, nats_url: &str) {
        let client = connect_nats(nats_url)
            .await
            .expect("connect to the other NATS");
        jetstream::new(client)
            .create_stream(jetstream::stream::Config {
                name: self.stream.clone(),
                subjects: vec![format!("{}.>", self.prefix)],
                ..Default::default()
            })
            .await
            .expect("create the test stream");
    }

    /// A second handle on the same servers and names, for another task.
    pub fn clone_handles(&self) -> TestEnv {
        TestEnv {
            mongodb_uri: self.mongodb_uri.clone(),
            nats_url: self.nats_url.clone(),
            name: self.name.clone(),
            client: self.client.clone(),
            db: self.db.clone(),
            nats: self.nats.clone(),
            jetstream: self.jetstream.clone(),
            prefix: self.prefix.clone(),
            stream: self.stream.clone(),
        }
    }

    pub async fn drop(self) {
        let _ = self.db.drop().await;
        let _ = self.jetstream.delete_stream(&self.stream).await;
    }
}

/// Messages arriving on the test's subjects.
pub struct Receiver {
    pub subscriber: async_nats::Subscriber,
}

impl Receiver {
    /// The next message; fails the test if none arrives in time.
    pub async fn next(&mut self) -> async_nats::Message {
        tokio::time::timeout(WAIT, self.subscriber.next())
            .await
            .expect("timed out waiting for a NATS message")
            .expect("subscription closed")
    }

    /// The next `n` messages.
    pub async fn take(&mut self, n: usize) -> Vec<async_nats::Message> {
        let mut messages = Vec::with_capacity(n);
        for _ in 0..n {
            messages.push(self.next().await);
        }
        messages
    }

    /// Collects messages until one has the given message id; returns all of them.
    pub async fn until_id(&mut self, id: ObjectId) -> Vec<async_nats::Message> {
        let mut messages = Vec::new();
        loop {
            let message = self.next().await;
            let done = msg_id(&message) == Some(id.to_hex());
            messages.push(message);
            if done {
                return messages;
            }
        }
    }

    /// Takes every message NATS delivered before this call, so that what
    /// comes next is only what is published after it. A relay may publish
    /// a message twice (a message in doubt is asked again, and the first
    /// start's catch-up can meet the stream on one message); JetStream
    /// keeps one, a plain subscription sees both, the second possibly
    /// after the test moved on. Call it once relays publishing to
    /// JetStream have stopped: the server routed their messages before it
    /// answered them, so a fence this client sends itself now comes back
    /// after them, and the client hands out what it reads in the order it
    /// reads it. (A core NATS publish has no answer, so one could overtake
    /// the fence; a subscription holds 65,536 messages before it drops any.)
    pub async fn drain_delivered(&mut self, nats: &async_nats::Client) -> Vec<async_nats::Message> {
        let fence = nats.new_inbox();
        let mut fenced = nats.subscribe(fence.clone()).await.expect("subscribe");
        nats.publish(fence, "".into())
            .await
            .expect("publish the fence");
        tokio::time::timeout(WAIT, fenced.next())
            .await
            .expect("timed out waiting for the fence")
            .expect("subscription closed");
        let mut messages = Vec::new();
        // Unconstrained: tokio's budget would end the loop after 128 polls.
        while let Some(Some(message)) =
            tokio::task::unconstrained(self.subscriber.next()).now_or_never()
        {
            messages.push(message);
        }
        messages
    }
}

/// Every message `stream` holds, in stream order, with its headers.
pub async fn stream_messages(
    stream: &mut jetstream::stream::Stream,
) -> Vec<jetstream::message::StreamMessage> {
    let state = stream.info().await.expect("stream info").state.clone();
    let mut messages = Vec::new();
    for sequence in state.first_sequence..=state.last_sequence {
        // Deleted, or never there (an empty stream): skipped.
        if let Ok(message) = stream.get_raw_message(sequence).await {
            messages.push(message);
        }
    }
    messages
}

/// A header of a message as a stream holds it.
pub fn stored_header(message: &jetstream::message::StreamMessage, name: &str) -> Option<String> {
    message
        .headers
        .get(name)
        .map(|value| value.as_str().to_owned())
}

pub fn header(message: &async_nats::Message, name: &str) -> Option<String> {
    message
        .headers
        .as_ref()
        .and_then(|h| h.get(name))
        .map(|v| v.as_str().to_owned())
}

pub fn msg_id(message: &async_nats::Message) -> Option<String> {
    header(message, "Nats-Msg-Id")
}

/// Counts messages per message id.
pub fn count_by_id(messages: &[async_nats::Message]) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for message in messages {
        if let Some(id) = msg_id(message) {
            *counts.entry(id).or_default() += 1;
        }
    }
    counts
}

/// Polls `condition` every 20 ms until it holds; fails the test after [`WAIT`].
pub async fn wait_until<F, Fut>(what: &str, condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    assert!(poll_until(condition).await, "timed out waiting for {what}");
}

/// Polls `condition` every 20 ms until it holds (true) or [`WAIT`] passes
/// (false).
pub async fn poll_until<F, Fut>(mut condition: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + WAIT;
    while !condition().await {
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    true
}

/// One message as a JetStream stream holds it.
#[derive(Debug, Clone)]
pub struct Stored {
    pub sequence: u64,
    /// `Nats-Msg-Id`: the outbox message's id.
    pub id: String,
    /// `Outbox-Key`.
    pub key: Option<String>,
}

/// Asserts that the stream holds each key's messages exactly as committed:
/// `committed` gives each key's ids in commit order, and the stream must
/// hold those ids, in that order by stream sequence, each once, and no
/// other message of the key.
pub fn assert_order_per_key(stored: &[Stored], committed: &HashMap<String, Vec<ObjectId>>) {
    let mut by_key: HashMap<&str, Vec<&str>> = HashMap::new();
    for message in stored {
        if let Some(key) = &message.key {
            by_key.entry(key).or_default().push(&message.id);
        }
    }
    for (key, ids) in committed {
        let expected: Vec<String> = ids.iter().map(|id| id.to_hex()).collect();
        let found = by_key.remove(key.as_str()).unwrap_or_default();
        assert_eq!(
            found, expected,
            "key {key}: the stream's messages (left) are not the committed ones in commit order"
        );
    }
    assert!(
        by_key.is_empty(),
        "messages of keys never committed: {:?}",
        by_key.keys()
    );
}

/// A relay running in this process.
pub struct RunningRelay {
    shutdown: CancellationToken,
    handle: JoinHandle<outbox_relay::Result<()>>,
    /// The relay's own metrics, which say its role as `/readyz` does.
    pub metrics: outbox_relay::Metrics,
}

impl RunningRelay {
    pub async fn start(config: RelayConfig) -> Self {
        Self::run(Relay::connect(config).await.expect("relay connects"))
    }

    fn run(relay: Relay) -> Self {
        let shutdown = CancellationToken::new();
        let metrics = relay.metrics().clone();
        let handle = tokio::spawn(relay.run(shutdown.clone()));
        RunningRelay {
            shutdown,
            handle,
            metrics,
        }
    }

    /// Whether the relay is in `role` (as `/readyz` says: [`LEADING`], [`STANDING_BY`]).
    pub fn is(&self, role: &str) -> bool {
        self.metrics
            .readiness()
            .conditions
            .iter()
            .any(|c| c == role)
    }

    /// Waits until the relay is in `role`.
    pub async fn wait_for_role(&self, role: &str) {
        wait_until(&format!("a relay {role}"), || {
            let now = self.is(role);
            async move { now }
        })
        .await;
    }

    /// A relay that has taken the lease and opened its change stream. On
    /// SecantusDB a write committed while a first start reads its snapshot
    /// can be missed by both the snapshot and the stream (docs/developing.md),
    /// and reach NATS only by the sweep, after its key's later messages: a
    /// test of per-key order writes once this returns.
    pub async fn start_tailing(config: RelayConfig) -> Self {
        let running = Self::run(Relay::connect(config).await.expect("relay connects"));
        running.wait_for_role(LEADING).await;
        running
    }

    /// Stops gracefully and returns what `run` returned.
    pub async fn stop(self) -> outbox_relay::Result<()> {
        self.shutdown.cancel();
        tokio::time::timeout(WAIT, self.handle)
            .await
            .expect("relay did not stop in time")
            .expect("relay task panicked")
    }
}

/// Writes `count` orders, each with its outbox message, in one transaction per order.
pub async fn write_orders(env: &TestEnv, count: usize) -> Vec<ObjectId> {
    let outbox = outbox_relay::Outbox::new(&env.db);
    let orders = env.db.collection::<Document>("orders");
    let mut ids = Vec::with_capacity(count);
    for n in 0..count {
        let mut session = env.client.start_session().await.expect("session");
        session
            .start_transaction()
            .await
            .expect("start transaction");
        orders
            .insert_one(doc! { "n": n as i64 })
            .session(&mut session)
            .await
            .expect("insert order");
        let message = outbox_relay::NewMessage::serialized("order.placed", &doc! { "n": n as i64 })
            .expect("payload");
        ids.push(
            outbox
                .add(&mut session, message)
                .await
                .expect("add to outbox"),
        );
        session.commit_transaction().await.expect("commit");
    }
    ids
}

/// A nats-server of one test's own, which the test may stop and restart.
pub struct NatsProcess {
    child: Option<std::process::Child>,
    pub port: u16,
    dir: std::path::PathBuf,
    /// The user clients put in the URL (password `secret`), if the server requires one.
    user: Option<&'static str>,
    /// The server asks for credentials or TLS that a plain URL lacks, so
    /// its start is seen by its port accepting connections.
    secured: bool,
    /// The port of its monitoring endpoint, if it serves one.
    monitor_port: Option<u16>,
}

impl NatsProcess {
    pub async fn start() -> Self {
        Self::start_with("", None).await
    }

    /// A server whose monitoring endpoint (`/connz` and the like) answers,
    /// on [`NatsProcess::monitoring`].
    pub async fn start_monitored() -> Self {
        let port = free_port();
        let mut nats = Self::start_with(&format!("http: \"127.0.0.1:{port}\""), None).await;
        nats.monitor_port = Some(port);
        nats
    }

    /// Starts a server with extra configuration (for example `authorization`).
    pub async fn start_with(extra_config: &str, user: Option<&'static str>) -> Self {
        let port = free_port();
        let dir =
            std::env::temp_dir().join(format!("outbox-relay-nats-{port}-{}", ObjectId::new()));
        std::fs::create_dir_all(&dir).expect("nats-server directory");
        let config = format!(
            "listen: \"127.0.0.1:{port}\"\njetstream {{ store_dir: {:?} }}\n{extra_config}\n",
            dir.join("store")
        );
        std::fs::write(dir.join("nats.conf"), config).expect("nats-server config");
        let mut nats = NatsProcess {
            child: None,
            port,
            dir,
            user,
            secured: false,
            monitor_port: None,
        };
        nats.restart().await;
        nats
    }

    /// Starts a server whose `extra_config` (authorization, TLS) a plain
    /// client cannot pass; `files` are written into its folder first, and
    /// the config may name them by `{dir}`.
    pub async fn start_secured(extra_config: &str, files: &[(&str, &str)]) -> Self {
        let port = free_port();
        let dir =
            std::env::temp_dir().join(format!("outbox-relay-nats-{port}-{}", ObjectId::new()));
        std::fs::create_dir_all(&dir).expect("nats-server directory");
        for (name, text) in files {
            std::fs::write(dir.join(name), text).expect("a file for nats-server");
        }
        let extra = extra_config.replace("{dir}", &dir.display().to_string());
        let config = format!("listen: \"127.0.0.1:{port}\"\n{extra}\n");
        std::fs::write(dir.join("nats.conf"), config).expect("nats-server config");
        let mut nats = NatsProcess {
            child: None,
            port,
            dir,
            user: None,
            secured: true,
            monitor_port: None,
        };
        nats.restart().await;
        nats
    }

    /// The server's folder, where test files may be written.
    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    pub fn url(&self) -> String {
        match self.user {
            Some(user) => format!("nats://{user}:secret@127.0.0.1:{}", self.port),
            None => format!("nats://127.0.0.1:{}", self.port),
        }
    }

    /// Starts the server again on the same port and store.
    pub async fn restart(&mut self) {
        let child = std::process::Command::new("nats-server")
            .arg("-c")
            .arg(self.dir.join("nats.conf"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start nats-server (scripts/services.sh installs it)");
        self.child = Some(child);
        let (url, secured, port) = (self.url(), self.secured, self.port);
        wait_until("nats-server to accept connections", || {
            let url = url.clone();
            async move {
                if secured {
                    tokio::net::TcpStream::connect(("127.0.0.1", port))
                        .await
                        .is_ok()
                } else {
                    connect_nats(&url).await.is_ok()
                }
            }
        })
        .await;
    }

    /// Kills the server (SIGKILL: no goodbye to clients).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Freezes the server (SIGSTOP): its connections stay open and its
    /// clients hear nothing, as across a network partition.
    pub fn pause(&self) {
        signal(self.child.as_ref(), "-STOP");
    }

    /// Lets a frozen server go on (SIGCONT).
    pub fn resume(&self) {
        signal(self.child.as_ref(), "-CONT");
    }

    /// A JSON page of the server's monitoring endpoint (see
    /// [`NatsProcess::start_monitored`]).
    pub async fn monitoring(&self, path: &str) -> serde_json::Value {
        let port = self.monitor_port.expect("a server started with monitoring");
        let (status, body) = get(port, path)
            .await
            .expect("the monitoring endpoint answers");
        assert_eq!(status, 200, "{body}");
        serde_json::from_str(&body).expect("monitoring JSON")
    }
}

/// Sends `sig` to a child process of the test, if it runs.
fn signal(child: Option<&std::process::Child>, sig: &str) {
    if let Some(child) = child {
        let sent = Command::new("kill")
            .args([sig, &child.id().to_string()])
            .status();
        assert!(sent.is_ok_and(|s| s.success()), "kill {sig}");
    }
}

impl Drop for NatsProcess {
    fn drop(&mut self) {
        self.stop();
        if std::env::var_os("KEEP_NATS_DIR").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// GETs `path` with HTTP/1.0; the status code and body, or `None` if
/// nothing answers yet.
pub async fn get(port: u16, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    let request = format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut response = String::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_string(&mut response))
        .await
        .ok()?
        .ok()?;
    let status = response.split(' ').nth(1)?.parse().ok()?;
    let body = response.split_once("\r\n\r\n")?.1.to_owned();
    Some((status, body))
}

/// What `/readyz` says of a leader tailing its change stream.
pub const LEADING: &str = "role: leading, tailing the change stream";
/// What `/readyz` says of a standby.
pub const STANDING_BY: &str = "role: standing by";

/// Waits until the relay serving on `port` is ready in `role` (as `/readyz` says).
pub async fn ready_as(port: u16, role: &str) {
    wait_until(&format!("the relay on {port} ready, {role}"), || async {
        get(port, "/readyz")
            .await
            .is_some_and(|(status, body)| status == 200 && body.contains(role))
    })
    .await;
}

/// A loopback port nothing listens on now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("pick a free port")
        .port()
}

/// Connects as the relay does (credentials in the URL are used).
pub async fn connect_nats(url: &str) -> outbox_relay::Result<async_nats::Client> {
    outbox_relay::publish::connect_nats(url, Duration::from_secs(2)).await
}

/// Whether a query plan (explain output) scans the named index.
pub fn plan_uses_index(plan: &bson::Bson, index: &str) -> bool {
    match plan {
        bson::Bson::Document(document) => {
            document.get_str("indexName") == Ok(index)
                || document.values().any(|v| plan_uses_index(v, index))
        }
        bson::Bson::Array(items) => items.iter().any(|v| plan_uses_index(v, index)),
        _ => false,
    }
}

/// A private SecantusDB that a scenario may stop and start (data kept).
pub struct MongoProcess {
    child: Option<Child>,
    pub port: u16,
    dir: PathBuf,
    /// Flags beyond address and storage, such as `--standalone`.
    /// Flags the server is started with.
    pub extra: Vec<String>,
    /// Connection-string options a client needs (`&tls=true&...`).
    pub options: String,
    /// Which server runs.
    build: Build,
}

/// Which SecantusDB a [`MongoProcess`] runs.
#[derive(Clone)]
enum Build {
    /// The Python build (or `SECANTUSD`).
    Python,
    /// The Python build with its `hello.localTime` this far ahead of the
    /// host's clock, for tests of what is judged on the server's clock.
    Ahead(Duration),
    /// The Python build refusing the `local` database as mongos does, and
    /// saying it is mongos where `says_mongos` (see [`REFUSING_LOCAL`]).
    RefusingLocal { says_mongos: bool },
    /// The Rust build, at this path.
    Rust(PathBuf),
}

/// Starts SecantusDB (the Python build) with its `hello.localTime` moved
/// ahead by the seconds given first: the clock the relay judges leases and
/// holds by, skewed from the host's without touching the host.
const SKEWED_SERVER: &str = r#"
import datetime as dt
import sys

from secantus import commands

ahead = dt.timedelta(seconds=float(sys.argv.pop(1)))
for name in ("hello", "isMaster", "ismaster"):
    def skewed(doc, ctx, original=commands._HANDLERS[name]):
        reply = original(doc, ctx)
        reply["localTime"] = reply["localTime"] + ahead
        return reply
    commands._HANDLERS[name] = skewed

from secantus.cli import main

sys.exit(main())
"#;

/// Starts SecantusDB (the Python build) refusing every command on the
/// `local` database with mongos's error, and, given `mongos` first,
/// answering `hello` as mongos does: no replica set named, and
/// `msg: "isdbgrid"`. The rest it serves as the replica set it is, as
/// mongos serves a sharded cluster's collections.
const REFUSING_LOCAL: &str = r#"
import sys

from secantus import commands

says_mongos = sys.argv.pop(1) == "mongos"

# What a replica set member says of its set, and mongos does not.
MEMBER_ONLY = ("setName", "setVersion", "hosts", "passives", "arbiters", "primary", "me",
               "secondary", "arbiterOnly", "hidden", "tags", "electionId", "lastWrite")
HANDSHAKES = ("hello", "isMaster", "ismaster")

for name in HANDSHAKES if says_mongos else ():
    def as_router(doc, ctx, original=commands._HANDLERS[name]):
        reply = original(doc, ctx)
        for field in MEMBER_ONLY:
            reply.pop(field, None)
        reply["msg"] = "isdbgrid"
        return reply
    commands._HANDLERS[name] = as_router

for name, handler in list(commands._HANDLERS.items()):
    if name in HANDSHAKES:
        continue
    def refusing_local(doc, ctx, original=handler):
        if ctx.db_name == "local":
            return {"ok": 0.0, "errmsg": "Can't use 'local' database through mongos",
                    "code": 20, "codeName": "IllegalOperation"}
        return original(doc, ctx)
    commands._HANDLERS[name] = refusing_local

from secantus.cli import main

sys.exit(main())
"#;

impl MongoProcess {
    pub async fn start() -> Self {
        Self::start_with(&[]).await
    }

    /// A private server started with extra flags.
    pub async fn start_with(extra: &[&str]) -> Self {
        let mut mongo = Self::unstarted(extra.iter().map(|s| (*s).to_owned()).collect());
        mongo.restart().await;
        mongo
    }

    /// A server not started yet, with its port and folder chosen, so that
    /// files it needs can be written into the folder first.
    pub fn unstarted(extra: Vec<String>) -> Self {
        let port = free_port();
        let dir =
            std::env::temp_dir().join(format!("outbox-relay-mongo-{port}-{}", ObjectId::new()));
        std::fs::create_dir_all(&dir).expect("a folder for SecantusDB");
        MongoProcess {
            child: None,
            port,
            dir,
            extra,
            options: String::new(),
            build: Build::Python,
        }
    }

    /// A private server of SecantusDB's Rust build, which ends a dead
    /// client's open transaction at its lifetime (60 s) as MongoDB does,
    /// where the Python build keeps it while a write waits on it
    /// (docs/developing.md). Found by `SECANTUSD_RS` (scripts/test.sh sets
    /// it), else on the PATH; missing, the test fails saying how to get it.
    pub async fn start_rust_build(extra: &[&str]) -> Self {
        let server = std::env::var_os("SECANTUSD_RS")
            .filter(|path| !path.is_empty())
            .map(PathBuf::from)
            .or_else(|| on_path("secantusd-rs"))
            .unwrap_or_else(|| {
                panic!(
                    "this test needs SecantusDB's Rust build (secantusd-rs), which is not \
                     installed: scripts/services.sh installs it (or cargo install secantus-mdb \
                     --version 0.5.3-beta.193 --ignore-rust-version --locked, with Debian's \
                     cmake); or point SECANTUSD_RS at it"
                )
            });
        let mut flags = vec!["--cache-size".to_owned(), "256M".to_owned()];
        flags.extend(extra.iter().map(|s| (*s).to_owned()));
        let mut mongo = Self::unstarted(flags);
        mongo.build = Build::Rust(server);
        mongo.restart().await;
        mongo
    }

    /// The server's folder.
    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    pub fn uri(&self) -> String {
        format!(
            "mongodb://127.0.0.1:{}/?serverSelectionTimeoutMS=2000{}",
            self.port, self.options
        )
    }

    /// A server that answers as a sharded cluster's router, mongos, does
    /// (it says it is one, and refuses the `local` database), or, unless
    /// `says_mongos`, a replica set that refuses `local` as mongos does.
    pub async fn start_refusing_local(says_mongos: bool) -> Self {
        let mut mongo = Self::unstarted(Vec::new());
        mongo.build = Build::RefusingLocal { says_mongos };
        mongo.restart().await;
        mongo
    }

    /// A server whose clock (`hello.localTime`) runs `ahead` of this host's.
    pub async fn start_ahead(ahead: Duration) -> Self {
        let mut mongo = Self::unstarted(Vec::new());
        mongo.build = Build::Ahead(ahead);
        mongo.restart().await;
        mongo
    }

    pub async fn restart(&mut self) {
        let (server, mut command) = match self.build.clone() {
            Build::Python => {
                let server = std::env::var_os("SECANTUSD")
                    .map(PathBuf::from)
                    .unwrap_or_else(|| manifest_dir().join(".services/venv/bin/secantusd-py"));
                (server.clone(), Command::new(server))
            }
            Build::Ahead(ahead) => {
                let script = self.dir.join("skewed.py");
                std::fs::write(&script, SKEWED_SERVER).expect("the skewed server's script");
                let python = manifest_dir().join(".services/venv/bin/python");
                let mut command = Command::new(&python);
                command.arg(script).arg(ahead.as_secs_f64().to_string());
                (python, command)
            }
            Build::RefusingLocal { says_mongos } => {
                let script = self.dir.join("refusing-local.py");
                std::fs::write(&script, REFUSING_LOCAL).expect("the server's script");
                let python = manifest_dir().join(".services/venv/bin/python");
                let mut command = Command::new(&python);
                command
                    .arg(script)
                    .arg(if says_mongos { "mongos" } else { "replica-set" });
                (python, command)
            }
            Build::Rust(server) => (server.clone(), Command::new(server)),
        };
        let child = command
            .args([
                "--host",
                "127.0.0.1",
                "--port",
                &self.port.to_string(),
                "--storage-path",
            ])
            .arg(&self.dir)
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "start {} (scripts/services.sh installs it): {e}",
                    server.display()
                )
            });
        self.child = Some(child);
        let uri = self.uri();
        wait_until("SecantusDB to answer", || {
            let uri = uri.clone();
            async move {
                // Answering is enough: a standalone server answers with a refusal.
                !matches!(
                    outbox_relay::connect::connect_mongodb(&uri).await,
                    Err(outbox_relay::Error::Check {
                        kind: outbox_relay::CheckKind::MongodbUnreachable,
                        ..
                    })
                )
            }
        })
        .await;
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing is
    /// answered, as when it is cut off or swamped.
    pub fn pause(&self) {
        signal(self.child.as_ref(), "-STOP");
    }

    /// Lets a frozen server go on (SIGCONT).
    pub fn resume(&self) {
        signal(self.child.as_ref(), "-CONT");
    }

    /// A clean stop (SIGTERM), as an operator's restart would do.
    pub fn stop(&mut self) {
        // A frozen server would not hear it.
        self.resume();
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
            let deadline = Instant::now() + WAIT;
            while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for MongoProcess {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Where `program` is on the PATH, if it is.
pub fn on_path(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
}

pub fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn logs_dir() -> PathBuf {
    let dir = manifest_dir().join("target").join("relay-logs");
    std::fs::create_dir_all(&dir).expect("log directory");
    dir
}

/// The services' virtualenv's Python (`scripts/services.sh`), which has
/// pymongo and the CloudEvents SDK; `OUTBOX_PYTHON` names another.
pub fn python() -> std::path::PathBuf {
    if let Ok(python) = std::env::var("OUTBOX_PYTHON") {
        return python.into();
    }
    let services = std::env::var("OUTBOX_SERVICES_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| manifest_dir().join(".services"));
    services.join("venv/bin/python")
}

/// The `outbox-relay` binary, pointed at the test's servers, database and
/// subjects, with no terminal.
pub fn relay_command(env: &TestEnv) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_outbox-relay"));
    command
        .env("OUTBOX_MONGODB_URI", &env.mongodb_uri)
        .env("OUTBOX_DATABASE", &env.name)
        .env("OUTBOX_NATS_URL", &env.nats_url)
        .env("OUTBOX_SUBJECT_PREFIX", &env.prefix)
        .env("NO_COLOR", "1")
        .stdin(Stdio::null());
    command
}

/// Runs a command to its end, failing the test if it takes longer than
/// [`WAIT`] (a hang is a failure, not a stuck suite).
pub async fn bounded(command: Command) -> std::process::Output {
    bounded_for(command, WAIT).await
}

/// [`bounded`], for a command that may take longer than a short wait.
pub async fn bounded_for(command: Command, within: Duration) -> std::process::Output {
    let run = tokio::process::Command::from(command)
        .kill_on_drop(true)
        .output();
    tokio::time::timeout(within, run)
        .await
        .expect("the command ends by itself")
        .expect("run the command")
}

/// What a command printed, standard output then standard error.
pub fn output_text(output: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// The command exited with `code`, saying `saying`, without a panic.
pub fn assert_exit(output: &std::process::Output, code: i32, saying: &str) {
    let text = output_text(output);
    assert_eq!(output.status.code(), Some(code), "{text}");
    assert!(text.contains(saying), "should say {saying:?}: {text}");
    assert!(!text.contains("panicked"), "{text}");
}

/// Lease timings under which a standby takes over within about two
/// seconds, for the tests that kill or stop a leader; a relay that only
/// has to lead keeps the default lease, which a loaded machine can renew.
pub const QUICK_TAKEOVER: [(&str, &str); 2] = [
    ("OUTBOX_LEASE_DURATION", "2s"),
    ("OUTBOX_LEASE_RENEW_INTERVAL", "500ms"),
];

/// A relay process, logging to `target/relay-logs`.
pub struct RelayProcess {
    child: Child,
    pub log: PathBuf,
    /// The container it runs in, where it runs in the image.
    container: Option<(container::Image, String)>,
}

impl RelayProcess {
    pub fn start(env: &TestEnv, label: &str) -> Self {
        Self::start_with(env, label, &[])
    }

    /// A relay with these settings (`OUTBOX_*` variables) added or replaced.
    pub fn start_with(env: &TestEnv, label: &str, settings: &[(&str, &str)]) -> Self {
        let (mut command, log) = Self::command(env, label, settings);
        let child = command.spawn().expect("start outbox-relay");
        RelayProcess {
            child,
            log,
            container: None,
        }
    }

    /// A relay in a container of `image`, with the same settings as
    /// [`start_with`](Self::start_with), but for its metrics address: the
    /// image's own unless `settings` name one.
    pub fn start_in(
        image: container::Image,
        env: &TestEnv,
        label: &str,
        settings: &[(&str, &str)],
    ) -> Self {
        let (mut relay, log) = Self::command(env, label, settings);
        if !settings
            .iter()
            .any(|(name, _)| *name == "OUTBOX_METRICS_ADDR")
        {
            relay.env_remove("OUTBOX_METRICS_ADDR");
        }
        let name = format!("{}-{label}", env.name);
        image.remove(&name);
        let mut command = image.run(&relay, &name);
        command.stdin(Stdio::null()).stdout(Stdio::null());
        command.stderr(Stdio::from(
            std::fs::File::create(&log).expect("relay log file"),
        ));
        let child = command.spawn().expect("start a container of the image");
        RelayProcess {
            child,
            log,
            container: Some((image, name)),
        }
    }

    /// The relay's command, with these settings, logging to its log file.
    fn command(env: &TestEnv, label: &str, settings: &[(&str, &str)]) -> (Command, PathBuf) {
        let log = logs_dir().join(format!("{}-{label}.log", env.name));
        let file = std::fs::File::create(&log).expect("relay log file");
        let mut command = relay_command(env);
        command
            .arg("run")
            .env("OUTBOX_CHECKPOINT_INTERVAL", "100ms")
            .env("OUTBOX_MAX_AWAIT_TIME", "200ms")
            .env("OUTBOX_ACK_TIMEOUT", "1s")
            .env("OUTBOX_LEASE_DURATION", "10s")
            .env("OUTBOX_LEASE_RENEW_INTERVAL", "1s")
            .env("OUTBOX_STANDBY_POLL_INTERVAL", "100ms")
            // SecantusDB walks its oplog to find its ends, and holds every
            // write meanwhile (README): a relay reads them only where a
            // test asks for the headroom.
            .env("OUTBOX_OPLOG_HEADROOM_WARNING", "off")
            // Nor are the depths read unless a test asks: on SecantusDB a
            // count of a backlog takes seconds and holds the writes too.
            .env("OUTBOX_COLLECT_INTERVAL", "5m")
            .env("OUTBOX_SWEEP_INTERVAL", "1s")
            .env("OUTBOX_GRACE_PERIOD", "3s")
            .env("OUTBOX_METRICS_ADDR", "127.0.0.1:0")
            .env(
                "RUST_LOG",
                std::env::var("RELAY_LOG").unwrap_or_else(|_| "info".into()),
            )
            .envs(settings.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::from(file));
        (command, log)
    }

    /// The relay's process id on this host.
    pub fn pid(&self) -> u32 {
        match &self.container {
            Some((image, name)) => image.host_pid(name),
            None => self.child.id(),
        }
    }

    /// The container the relay runs in, if any.
    pub fn container(&self) -> Option<&str> {
        self.container.as_ref().map(|(_, name)| name.as_str())
    }

    /// Sends `signal` (`TERM`, `KILL`) to the relay.
    pub fn signal(&self, signal: &str) {
        match &self.container {
            Some((image, name)) => image.signal(name, signal),
            None => {
                let sent = Command::new("kill")
                    .args([&format!("-{signal}"), &self.pid().to_string()])
                    .status();
                assert!(sent.is_ok_and(|s| s.success()), "send SIG{signal}");
            }
        }
    }

    pub fn running(&mut self) -> bool {
        self.child.try_wait().ok().flatten().is_none()
    }

    pub fn kill9(&mut self) {
        if let Some((image, name)) = &self.container {
            image.remove(name);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits for the relay to exit by itself; its exit status, or `None`
    /// if it still runs `within` from now.
    pub async fn exit_within(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait for the relay") {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGTERM, then waits for the exit; fails the test if it does not exit cleanly.
    pub async fn terminate(&mut self) {
        self.signal("TERM");
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait for the relay") {
                assert!(
                    status.success(),
                    "relay exited with {status}; log {}",
                    self.log.display()
                );
                return;
            }
            assert!(
                Instant::now() < deadline,
                "relay ignored SIGTERM; log {}",
                self.log.display()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        self.kill9();
    }
}
