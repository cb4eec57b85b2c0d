//! The relay: connects the stages and runs them until shutdown.
//!
//! ```text
//! change stream ──▶ publish stage ──▶ completion stage
//! (+ catch-up)      (NATS, ordered,    (marks in MongoDB,
//!                    acks pipelined)    then checkpoint)
//! ```
//!
//! Each stage is a task joined by bounded channels, so a slow stage holds
//! back the ones before it rather than piling up memory. Shutdown runs front
//! to back: the source stops reading, the publish stage finishes what is in
//! flight, and the completion stage records it and writes the final token.

use std::sync::Arc;
use std::time::Duration;

use bson::doc;
use mongodb::options::ClientOptions;
use mongodb::{Client, Database};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::checkpoint::CheckpointStore;
use crate::complete::CompletionStage;
use crate::config::{redact_uri, RelayConfig};
use crate::contract::DecodeRules;
use crate::error::{Error, Result};
use crate::publish::stage::PublishStage;
use crate::publish::{NatsPublisher, Publisher, StreamSetup};
use crate::source::change_stream::ChangeStreamSource;

/// A connected relay, ready to run.
pub struct Relay {
    config: RelayConfig,
    database: Database,
    publisher: Arc<dyn Publisher>,
}

impl Relay {
    /// Checks the configuration and connects to MongoDB and NATS.
    pub async fn connect(config: RelayConfig) -> Result<Self> {
        config.validate()?;
        let client = connect_mongodb(&config.mongodb_uri).await?;
        let database = client.database(&config.database);
        let nats = NatsPublisher::connect(&config).await?;
        if let Some(name) = &config.create_stream {
            StreamSetup::for_prefix(name, &config.subject_prefix)
                .ensure(nats.client())
                .await?;
        }
        Ok(Self::with_publisher(config, database, Arc::new(nats)))
    }

    /// A relay over an existing database handle and any publisher.
    pub fn with_publisher(
        config: RelayConfig,
        database: Database,
        publisher: Arc<dyn Publisher>,
    ) -> Self {
        Relay {
            config,
            database,
            publisher,
        }
    }

    /// Runs until `shutdown` fires, then stops gracefully: in-flight messages
    /// are finished and recorded and the resume token is written, within the
    /// configured shutdown timeout.
    pub async fn run(self, shutdown: CancellationToken) -> Result<()> {
        let config = &self.config;
        let outbox = self.database.collection(&config.collection);
        let checkpoints = CheckpointStore::new(
            &self.database,
            &config.checkpoint_collection,
            &config.collection,
        );
        let token = checkpoints.load().await?;
        let rules = DecodeRules {
            subject_prefix: config.subject_prefix.clone(),
            max_payload: self.publisher.max_payload(),
        };
        let abandon = abandon_after(&shutdown, config.shutdown_timeout);
        let (work_tx, work_rx) = mpsc::channel(config.batch_size);
        let (done_tx, done_rx) = mpsc::channel(config.batch_size);

        let source = ChangeStreamSource {
            outbox: outbox.clone(),
            rules,
            max_await_time: config.max_await_time,
            idle_checkpoint_interval: config.idle_checkpoint_interval,
            grace_period: config.grace_period,
        };
        let publish = PublishStage {
            publisher: self.publisher.clone(),
            max_in_flight: config.max_in_flight,
            shutdown: shutdown.clone(),
        };
        let complete = CompletionStage {
            outbox,
            checkpoints,
            batch_size: config.batch_size,
            checkpoint_interval: config.checkpoint_interval,
            retry: config.retry.clone(),
            abandon: abandon.clone(),
        };

        tracing::info!(
            database = %config.database,
            collection = %config.collection,
            subject_prefix = %config.subject_prefix,
            mode = ?config.nats_mode,
            "relay running"
        );
        let mut stages = JoinSet::new();
        stages.spawn(source.run(token, work_tx, shutdown.clone()));
        stages.spawn(publish.run(work_rx, done_tx));
        stages.spawn(complete.run(done_rx));
        while let Some(joined) = stages.join_next().await {
            if let Err(error) = joined {
                shutdown.cancel();
                return Err(Error::Config(format!(
                    "a relay stage stopped unexpectedly: {error}"
                )));
            }
        }
        if abandon.is_cancelled() {
            return Err(Error::ShutdownTimeout(config.shutdown_timeout));
        }
        tracing::info!("relay stopped");
        Ok(())
    }
}

/// A token that fires `grace` after `shutdown` does: the moment to stop
/// waiting for servers and leave the rest for the next run.
fn abandon_after(shutdown: &CancellationToken, grace: Duration) -> CancellationToken {
    let abandon = CancellationToken::new();
    let (shutdown, fire) = (shutdown.clone(), abandon.clone());
    tokio::spawn(async move {
        tokio::select! {
            _ = fire.cancelled() => {}
            _ = async {
                shutdown.cancelled().await;
                tokio::time::sleep(grace).await;
            } => fire.cancel(),
        }
    });
    abandon
}

/// Connects to MongoDB and checks that it is a replica set or a sharded
/// cluster, since change streams and transactions need one.
pub async fn connect_mongodb(uri: &str) -> Result<Client> {
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
    let client = Client::with_options(options)
        .map_err(|e| Error::mongo(format!("cannot use {shown}"), e))?;
    let hello = client
        .database("admin")
        .run_command(doc! { "hello": 1 })
        .await
        .map_err(|e| {
            Error::mongo(
                format!("cannot reach {shown}; check --mongodb-uri and that the server is running"),
                e,
            )
        })?;
    let replica_set = hello.get_str("setName").is_ok();
    let sharded = hello.get_str("msg") == Ok("isdbgrid");
    if !replica_set && !sharded {
        return Err(Error::Config(format!(
            "{shown} is a standalone MongoDB server; the relay needs change streams and \
             transactions, which need a replica set or a sharded cluster (a single-member \
             replica set will do: start mongod with --replSet and run rs.initiate())"
        )));
    }
    Ok(client)
}
