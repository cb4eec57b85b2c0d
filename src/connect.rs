//! Connecting to MongoDB the way every command does: a bounded server
//! selection, the relay's app name, monitoring for readiness, and a check
//! that the deployment can serve change streams and transactions. The relay,
//! the start-up check, `status`, `dlq` and the benchmark all connect here,
//! so none of them imports another to reach a server.

use std::time::Duration;

use bson::doc;
use mongodb::options::ClientOptions;
use mongodb::Client;

use crate::config::redact_uri;
use crate::error::{CheckKind, Error, Result};
use crate::observe::{self, Metrics};

/// Connects to MongoDB and checks that it is a replica set or a sharded
/// cluster, since change streams and transactions need one.
pub async fn connect_mongodb(uri: &str) -> Result<Client> {
    connect_mongodb_observed(uri, None).await
}

/// [`connect_mongodb`], reporting whether the server is reachable to `metrics`.
pub(crate) async fn connect_mongodb_observed(
    uri: &str,
    metrics: Option<&Metrics>,
) -> Result<Client> {
    let shown = redact_uri(uri);
    let mut options = ClientOptions::parse(uri).await.map_err(|e| {
        Error::Config(format!(
            "mongodb-uri {shown} is not a valid connection string: {}",
            crate::error::brief(&e)
        ))
    })?;
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
    let hello = client
        .database("admin")
        .run_command(doc! { "hello": 1 })
        .await
        .map_err(|e| {
            Error::check(
                CheckKind::MongodbUnreachable,
                format!(
                    "cannot reach MongoDB at {shown}: {}; check --mongodb-uri, the credentials \
                     and that the server is running",
                    crate::error::brief(&e)
                ),
            )
        })?;
    let replica_set = hello.get_str("setName").is_ok();
    let sharded = hello.get_str("msg") == Ok("isdbgrid");
    if !replica_set && !sharded {
        return Err(Error::check(
            CheckKind::NotReplicaSet,
            format!(
                "{shown} is a standalone MongoDB server; the relay needs change streams and \
             transactions, which need a replica set or a sharded cluster (a single-member \
             replica set will do: start mongod with --replSet and run rs.initiate())"
            ),
        ));
    }
    Ok(client)
}
