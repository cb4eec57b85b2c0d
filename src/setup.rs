//! Preparing the outbox collection: indexes, retention and the validator.
//!
//! Every relay does this on start, so it must be idempotent and safe when
//! several relays start at once: creating an index that exists is a no-op,
//! a changed TTL is applied with `collMod`, and dropping an index that
//! another relay already dropped is not an error.

use std::time::Duration;

use bson::{doc, Document};
use mongodb::options::IndexOptions;
use mongodb::{Collection, Database, IndexModel};

use crate::config::RelayConfig;
use crate::contract::{contract_schema, field, SubjectRules};
use crate::error::{command_code, CheckKind, Error, Result};

/// The index the sweep's claims scan: equality on status, then the retry
/// time, then `_id` for order.
pub const SWEEP_INDEX: &str = "outbox_sweep";
/// TTL index removing processed messages after the retention period.
pub const PROCESSED_TTL_INDEX: &str = "outbox_processed_ttl";
/// TTL index removing failed messages after the retention period.
pub const FAILED_TTL_INDEX: &str = "outbox_failed_ttl";

const NAMESPACE_NOT_FOUND: i32 = 26;
const INDEX_NOT_FOUND: i32 = 27;
const NAMESPACE_EXISTS: i32 = 48;
const INDEX_OPTIONS_CONFLICT: i32 = 85;
const INDEX_KEY_SPECS_CONFLICT: i32 = 86;

/// The longest the relay waits for the outbox collection's set-up on start.
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(30);

/// Whether `database` holds a collection named `name`.
pub(crate) async fn collection_exists(
    database: &Database,
    name: &str,
) -> mongodb::error::Result<bool> {
    let names = database
        .list_collection_names()
        .filter(doc! { "name": name })
        .await?;
    Ok(!names.is_empty())
}

/// Prepares the outbox collection `config` names: indexes, retention, and
/// the validator if asked. A server that does not finish within
/// [`SETUP_TIMEOUT`] is reported rather than waited on forever.
pub async fn prepare(database: &Database, config: &RelayConfig) -> Result<()> {
    let outbox = database.collection(&config.collection);
    let namespace = format!("{}.{}", config.database, config.collection);
    let steps = async {
        ensure_indexes(&outbox, config.retention).await?;
        if config.install_validator {
            install_validator(database, &config.collection, &config.subject_rules()?).await?;
            tracing::info!(collection = %config.collection, "installed the outbox validator");
        }
        Ok::<_, Error>(())
    };
    match tokio::time::timeout(SETUP_TIMEOUT, steps).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(error)) => Err(Error::check(
            CheckKind::OutboxSetup,
            format!(
                "cannot prepare the outbox collection {namespace}: {error}; check that the user \
                 may create indexes there"
            ),
        )),
        Err(_) => Err(Error::check(
            CheckKind::OutboxSetup,
            format!(
                "MongoDB did not finish preparing {namespace} (indexes, validator) within \
                 {SETUP_TIMEOUT:?}; check the server's health and locks, then start the relay again"
            ),
        )),
    }
}

/// Ensures the sweep index and the retention TTL indexes (or their absence).
pub async fn ensure_indexes(
    outbox: &Collection<Document>,
    retention: Option<Duration>,
) -> Result<()> {
    let sweep = IndexModel::builder()
        .keys(doc! { field::STATUS: 1, field::NEXT_ATTEMPT_AT: 1, field::ID: 1 })
        .options(IndexOptions::builder().name(SWEEP_INDEX.to_owned()).build())
        .build();
    outbox
        .create_index(sweep)
        .await
        .map_err(|e| Error::mongo(format!("creating index {SWEEP_INDEX} failed"), e))?;
    for (name, key) in [
        (PROCESSED_TTL_INDEX, field::PROCESSED_AT),
        (FAILED_TTL_INDEX, field::FAILED_AT),
    ] {
        match retention {
            Some(retention) => ensure_ttl(outbox, name, key, retention).await?,
            None => drop_index(outbox, name).await?,
        }
    }
    Ok(())
}

async fn ensure_ttl(
    outbox: &Collection<Document>,
    name: &str,
    key: &str,
    retention: Duration,
) -> Result<()> {
    let model = IndexModel::builder()
        .keys(doc! { key: 1 })
        .options(
            IndexOptions::builder()
                .name(name.to_owned())
                .expire_after(retention)
                .build(),
        )
        .build();
    match outbox.create_index(model).await {
        Ok(_) => Ok(()),
        Err(e)
            if matches!(
                command_code(&e),
                Some(INDEX_OPTIONS_CONFLICT | INDEX_KEY_SPECS_CONFLICT)
            ) =>
        {
            let seconds = i64::try_from(retention.as_secs()).unwrap_or(i64::MAX);
            outbox
                .client()
                .database(&outbox.namespace().db)
                .run_command(doc! {
                    "collMod": outbox.name(),
                    "index": { "name": name, "expireAfterSeconds": seconds },
                })
                .await
                .map_err(|e| Error::mongo(format!("changing the retention of {name} failed"), e))?;
            Ok(())
        }
        Err(e) => Err(Error::mongo(format!("creating index {name} failed"), e)),
    }
}

async fn drop_index(outbox: &Collection<Document>, name: &str) -> Result<()> {
    match outbox.drop_index(name).await {
        Ok(()) => {
            tracing::info!(index = name, "retention is off: dropped the TTL index");
            Ok(())
        }
        Err(e)
            if matches!(
                command_code(&e),
                Some(INDEX_NOT_FOUND | NAMESPACE_NOT_FOUND)
            ) =>
        {
            Ok(())
        }
        Err(e) => Err(Error::mongo(format!("dropping index {name} failed"), e)),
    }
}

/// Installs (or replaces) a `$jsonSchema` validator that enforces the
/// document contract, so a malformed insert fails in the writer's own
/// transaction instead of reaching the relay.
///
/// The level is `moderate`: inserts, and updates of documents that already
/// pass, are checked; a document written before the validator (or one that
/// breaks it some other way) can still be updated, so the relay can always
/// mark it processed or failed rather than leave it pending for ever.
pub async fn install_validator(
    database: &Database,
    collection: &str,
    subjects: &SubjectRules,
) -> Result<()> {
    let validator = doc! { "$jsonSchema": contract_schema(subjects) };
    let modify = doc! {
        "collMod": collection,
        "validator": validator.clone(),
        "validationLevel": "moderate",
        "validationAction": "error",
    };
    let failed = |e| {
        Error::mongo(
            format!("installing the validator on {collection} failed"),
            e,
        )
    };
    match database.run_command(modify.clone()).await {
        Ok(_) => Ok(()),
        Err(e) if command_code(&e) == Some(NAMESPACE_NOT_FOUND) => {
            let created = database
                .create_collection(collection)
                .validator(validator)
                .validation_level(mongodb::options::ValidationLevel::Moderate)
                .validation_action(mongodb::options::ValidationAction::Error)
                .await;
            match created {
                Ok(()) => Ok(()),
                Err(e) if command_code(&e) == Some(NAMESPACE_EXISTS) => {
                    database.run_command(modify).await.map(drop).map_err(failed)
                }
                Err(e) => Err(failed(e)),
            }
        }
        Err(e) => Err(failed(e)),
    }
}
