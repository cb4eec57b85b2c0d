//! Connecting to MongoDB the way every command does: a bounded server
//! selection, the relay's app name, monitoring for readiness, and a check
//! that the deployment can serve change streams and transactions. The relay,
//! the start-up check, `status`, `dlq` and the benchmark all connect here,
//! so none of them imports another to reach a server.
//!
//! What kind of deployment a connection reaches ([`Deployment`]) is read
//! from one `hello` reply, here and nowhere else: a replica set and a
//! sharded cluster's router (mongos) serve the relay alike, but for what
//! mongos cannot read (the oplog).

use std::time::Duration;

use bson::{doc, Document};
use mongodb::options::{
    Acknowledgment, ClientOptions, DatabaseOptions, ReadConcern, ReadPreference, SelectionCriteria,
    WriteConcern,
};
use mongodb::{Client, Database};

use crate::error::{CheckKind, Error, Result};
use crate::observe::{self, Metrics};
use crate::redact;

/// What a connection reaches, as the server's `hello` reply describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deployment {
    /// A replica set (one member will do): its oplog, `local.oplog.rs`, is
    /// readable where the user may read it.
    ReplicaSet,
    /// A sharded cluster, through its router, mongos (`msg: "isdbgrid"`):
    /// each shard keeps an oplog of its own, and mongos refuses every
    /// command on the `local` database.
    ShardedCluster,
    /// A server alone: no oplog, no change streams, no transactions.
    Standalone,
}

/// Why the oplog is not read through mongos, as the relay says it.
const NO_OPLOG_THROUGH_MONGOS: &str = "the oplog is not readable through mongos: each shard \
    keeps its own (local.oplog.rs), which only a connection to that shard's replica set reads";

impl Deployment {
    /// The deployment a `hello` reply describes: mongos says `isdbgrid` in
    /// `msg`, a replica set member names its set in `setName`.
    pub fn of_hello(hello: &Document) -> Self {
        if hello.get_str("msg") == Ok("isdbgrid") {
            Deployment::ShardedCluster
        } else if hello.get_str("setName").is_ok() {
            Deployment::ReplicaSet
        } else {
            Deployment::Standalone
        }
    }

    /// Asks the server `client` reaches what it is (one `hello`).
    pub async fn detect(client: &Client) -> mongodb::error::Result<Self> {
        let hello = client
            .database("admin")
            .run_command(doc! { "hello": 1 })
            .await?;
        Ok(Self::of_hello(&hello))
    }

    /// Why the oplog cannot be read through this connection, whatever the
    /// user may read, as a sentence; `None` where it can.
    pub fn oplog_unreadable(self) -> Option<&'static str> {
        match self {
            Deployment::ShardedCluster => Some(NO_OPLOG_THROUGH_MONGOS),
            Deployment::Standalone => Some("a standalone server keeps no oplog"),
            Deployment::ReplicaSet => None,
        }
    }
}

impl std::fmt::Display for Deployment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Deployment::ReplicaSet => "a replica set",
            Deployment::ShardedCluster => "a sharded cluster (through mongos)",
            Deployment::Standalone => "a standalone server",
        })
    }
}

/// Connects to MongoDB and checks that it is a replica set or a sharded
/// cluster, since change streams and transactions need one.
pub async fn connect_mongodb(uri: &str) -> Result<Client> {
    connect_mongodb_observed(uri, None, 1)
        .await
        .map(|(client, _)| client)
}

/// The driver's own pool size, where a connection string names none.
const DRIVER_POOL: u32 = 10;

/// [`connect_mongodb`], reporting whether the server is reachable to
/// `metrics`, with the deployment it reached.
///
/// `streams` change streams will be open at once (one a partition the
/// relay holds), each keeping a connection while the server holds its
/// read: the pool grows by as many, so that marks and sweeps still find
/// connections.
pub(crate) async fn connect_mongodb_observed(
    uri: &str,
    metrics: Option<&Metrics>,
    streams: u32,
) -> Result<(Client, Deployment)> {
    let (mut options, shown) = parsed(uri).await?;
    match options.max_pool_size {
        None => options.max_pool_size = Some(DRIVER_POOL.max(streams.saturating_add(8))),
        Some(size) if size > 0 && size < streams.saturating_add(2) => tracing::warn!(
            max_pool_size = size,
            streams,
            "maxPoolSize in --mongodb-uri leaves too few connections beside the change streams \
             of the partitions this relay may hold: raise it to {} or more, or leave it out",
            streams.saturating_add(8)
        ),
        Some(_) => {}
    }
    options
        .app_name
        .get_or_insert_with(|| "outbox-relay".to_owned());
    options
        .server_selection_timeout
        .get_or_insert(Duration::from_secs(10));
    if let Some(metrics) = metrics {
        options.sdam_event_handler = Some(observe::reachability_handler(metrics.clone()));
    }
    let client = Client::with_options(options)
        .map_err(|e| Error::mongo(format!("cannot use {shown}"), e))?;
    let deployment = Deployment::detect(&client).await.map_err(|e| {
        Error::check(
            CheckKind::MongodbUnreachable,
            format!(
                "cannot reach MongoDB at {shown}: {}; check --mongodb-uri, the credentials \
                     and that the server is running",
                crate::error::brief(&e)
            ),
        )
    })?;
    if deployment == Deployment::Standalone {
        return Err(Error::check(
            CheckKind::NotReplicaSet,
            format!(
                "{shown} is a standalone MongoDB server; the relay needs change streams and \
             transactions, which need a replica set or a sharded cluster (a single-member \
             replica set will do: start mongod with --replSet and run rs.initiate())"
            ),
        ));
    }
    Ok((client, deployment))
}

/// A client of its own for coordination (the lease and the checkpoint),
/// to the server `uri` names, which [`connect_mongodb`] has checked: its
/// few connections are never busy with the relay's reads and marks, so a
/// renewal waits in no queue of the relay's own making. (A server that
/// runs one operation at a time, as SecantusDB does with a slow read, still
/// makes it wait: see docs/developing.md.)
///
/// One connection a partition beside one of its own: each partition's
/// lease and checkpoint are written apart from the others'.
pub(crate) async fn connect_mongodb_for_coordination(uri: &str, partitions: u32) -> Result<Client> {
    let (mut options, shown) = parsed(uri).await?;
    let app_name = options.app_name.as_deref().unwrap_or("outbox-relay");
    options.app_name = Some(format!("{app_name} (coordination)"));
    options
        .server_selection_timeout
        .get_or_insert(Duration::from_secs(10));
    options.max_pool_size = Some(partitions.saturating_add(1).max(2));
    options.min_pool_size = Some(1);
    Client::with_options(options).map_err(|e| Error::mongo(format!("cannot use {shown}"), e))
}

/// The options a connection string gives, and the string as it may be
/// shown (its secrets masked).
async fn parsed(uri: &str) -> Result<(ClientOptions, String)> {
    let shown = redact::uri(uri);
    let options = ClientOptions::parse(uri).await.map_err(|e| {
        Error::Config(format!(
            "mongodb-uri {shown} is not a valid connection string: {}",
            crate::error::brief(&e)
        ))
    })?;
    Ok((options, shown))
}

/// The handle every read and write of the relay goes through: write concern
/// `majority` (waiting at most `write_timeout`), read concern `majority`,
/// reads from the primary, whatever the connection string says.
///
/// A write only the primary took can be rolled back after a failover: a
/// lease renewal rolled back lets two relays lead, a mark rolled back
/// publishes a message twice. A read of what only the primary holds can
/// publish an insert that is later rolled back, although its transaction
/// never committed for the application. Majority on both sides rules both
/// out; a write the majority did not take in time fails, and is handled as
/// any failed write (a failed renewal ends in a lost lease).
pub fn coordinated(database: &Database, write_timeout: Duration) -> Database {
    let write_concern = WriteConcern::builder()
        .w(Acknowledgment::Majority)
        .w_timeout(write_timeout)
        .build();
    let options = DatabaseOptions::builder()
        .write_concern(write_concern)
        .read_concern(ReadConcern::majority())
        .selection_criteria(SelectionCriteria::ReadPreference(ReadPreference::Primary))
        .build();
    database
        .client()
        .database_with_options(database.name(), options)
}

#[cfg(test)]
mod tests {
    use bson::DateTime;

    use super::*;

    #[test]
    fn a_hello_reply_says_which_deployment_answered() {
        let member = doc! {
            "isWritablePrimary": true, "setName": "rs0", "hosts": ["db1:27017"],
            "localTime": DateTime::now(), "ok": 1.0,
        };
        assert_eq!(Deployment::of_hello(&member), Deployment::ReplicaSet);
        // As mongos answers: no set, and `isdbgrid` in `msg`.
        let router = doc! {
            "isWritablePrimary": true, "msg": "isdbgrid", "localTime": DateTime::now(),
            "maxWireVersion": 21, "ok": 1.0,
        };
        assert_eq!(Deployment::of_hello(&router), Deployment::ShardedCluster);
        let alone = doc! { "isWritablePrimary": true, "ok": 1.0 };
        assert_eq!(Deployment::of_hello(&alone), Deployment::Standalone);
        let other_message = doc! { "isWritablePrimary": true, "msg": "hello", "setName": "rs0" };
        assert_eq!(Deployment::of_hello(&other_message), Deployment::ReplicaSet);
    }

    #[test]
    fn only_a_replica_set_lets_the_oplog_be_read() {
        assert_eq!(Deployment::ReplicaSet.oplog_unreadable(), None);
        let why = Deployment::ShardedCluster.oplog_unreadable();
        assert!(why.is_some_and(|why| why.contains("mongos")), "{why:?}");
        assert!(Deployment::Standalone.oplog_unreadable().is_some());
    }
}
