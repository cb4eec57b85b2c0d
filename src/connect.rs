//! Connecting to MongoDB the way every command does: a bounded server
//! selection, the relay's app name, monitoring for readiness, and a check
//! that the deployment can serve change streams and transactions. The relay,
//! the start-up check, `status`, `dlq` and the benchmark all connect here,
//! so none of them imports another to reach a server.
//! What kind of deployment it reached is [`Deployment`]'s to say.

use std::time::Duration;

use mongodb::options::{
    Acknowledgment, ClientOptions, DatabaseOptions, ReadConcern, ReadPreference, SelectionCriteria,
    ServerMonitoringMode, WriteConcern,
};
use mongodb::{Client, Database};

pub use crate::deployment::Deployment;
use crate::error::{CheckKind, Error, Result};
use crate::observe::{self, Metrics};
use crate::redact;

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

/// How often the coordination client checks its server, where the
/// connection string sets no `heartbeatFrequencyMS` (see
/// [`connect_mongodb_for_coordination`]).
const COORDINATION_HEARTBEAT: Duration = Duration::from_secs(60);

/// A client of its own for coordination (the lease and the checkpoint),
/// to the server `uri` names, which [`connect_mongodb`] has checked: its
/// few connections are never busy with the relay's reads and marks, so a
/// renewal waits in no queue of the relay's own making. (A server that
/// runs one operation at a time, as SecantusDB does with a slow read, still
/// makes it wait: see docs/developing.md.)
///
/// One connection a partition, one for the group's rounds and one more:
/// each partition's lease and checkpoint are written apart from the
/// others', and a round waiting on a slow server holds no connection a
/// renewal needs.
pub(crate) async fn connect_mongodb_for_coordination(uri: &str, partitions: u32) -> Result<Client> {
    let (mut options, shown) = parsed(uri).await?;
    let app_name = options.app_name.as_deref().unwrap_or("outbox-relay");
    options.app_name = Some(format!("{app_name} (coordination)"));
    options
        .server_selection_timeout
        .get_or_insert(Duration::from_secs(10));
    options.max_pool_size = Some(partitions.saturating_add(2));
    options.min_pool_size = Some(1);
    // Where the server streams its state (MongoDB 4.4 and later), it
    // answers a monitor's check at once when its role changes, and the
    // frequency only paces two idle checks a period; a write the primary
    // refuses sends the driver to look again at once too. The relay's own
    // client keeps the driver's pace, which tells the readiness probe of an
    // unreachable server.
    if options.heartbeat_freq.is_none()
        && options.server_monitoring_mode != Some(ServerMonitoringMode::Poll)
    {
        options.heartbeat_freq = Some(COORDINATION_HEARTBEAT);
    }
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
