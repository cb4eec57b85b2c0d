//! Preparing the outbox collection: indexes, retention and the validator.
//!
//! Every relay does this on start, so it must be idempotent and safe when
//! several relays start at once: it reads what is there first and changes
//! only what differs, creating an index that exists is a no-op, a changed
//! TTL is applied with `collMod`, and dropping an index that another relay
//! already dropped is not an error. Which process may change what is
//! [`Preparer`]'s rule.

use std::time::Duration;

use bson::{doc, Bson, Document};
use mongodb::options::IndexOptions;
use mongodb::{Collection, Database, IndexModel};

use crate::config::{RelayConfig, Retention};
use crate::contract::{contract_schema, field, DecodeRules};
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

/// Who prepares the outbox, and so which of its shared settings it may
/// change. The sweep index every process needs is created by whichever
/// finds it missing; retention and the validator, which every process of
/// the outbox shares, are changed only by a relay (`run`) that is told to,
/// so that a process which disagrees or says nothing (a cron job's
/// `sweep --once`) cannot undo them for the others. `check` changes
/// nothing: it reads what [`inspect`] finds and says what [`plan`] would do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preparer {
    /// A relay that delivers: applies what its settings ask.
    Run,
    /// `sweep --once`: creates a missing sweep index, and only says where
    /// its settings differ from the outbox's.
    SweepOnce,
}

/// The outbox collection's set-up as MongoDB holds it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Found {
    /// Whether the sweep's index exists.
    pub sweep_index: bool,
    /// Each retention TTL index found, by name, and its retention (`None`
    /// where the index has none a relay could have set).
    pub retention: Vec<(&'static str, Option<Duration>)>,
    /// The collection's `$jsonSchema` validator as installed, if any, and
    /// whether it is the relay's at the relay's level and action.
    pub validator: Option<Document>,
}

/// One change preparing the outbox would make.
#[derive(Debug, Clone, PartialEq)]
pub enum Change {
    /// The sweep's index is missing.
    CreateSweepIndex,
    /// A TTL index is set (`from` none) or changed to `to`.
    SetRetention {
        index: &'static str,
        from: Option<Duration>,
        to: Duration,
    },
    /// A TTL index is dropped: retention is off.
    DropRetention {
        index: &'static str,
        was: Option<Duration>,
    },
    /// The contract's validator is missing or differs.
    InstallValidator,
}

impl Change {
    /// Whether it changes a setting every process of the outbox shares.
    pub fn is_shared(&self) -> bool {
        !matches!(self, Change::CreateSweepIndex)
    }
}

impl std::fmt::Display for Change {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let shown = |d: &Duration| humantime::format_duration(*d).to_string();
        match self {
            Change::CreateSweepIndex => write!(f, "create the sweep index {SWEEP_INDEX}"),
            Change::SetRetention {
                index,
                from: None,
                to,
            } => write!(f, "create {index}, keeping messages {}", shown(to)),
            Change::SetRetention {
                index,
                from: Some(from),
                to,
            } => write!(f, "change {index} from {} to {}", shown(from), shown(to)),
            Change::DropRetention {
                index,
                was: Some(was),
            } => write!(f, "drop {index} (retention {}): retention off", shown(was)),
            Change::DropRetention { index, was: None } => {
                write!(f, "drop {index}: retention off")
            }
            Change::InstallValidator => write!(f, "install the contract's validator"),
        }
    }
}

/// Reads the outbox collection's indexes and validator; nothing is
/// written. A collection that does not exist yet has none of them.
///
/// Read as the server wrote them, not through the driver's typed
/// options: a TTL some client wrote as a double, or a validation action
/// newer than the driver knows, would otherwise read as no index or fail
/// the read.
pub async fn inspect(database: &Database, collection: &str) -> Result<Found> {
    let namespace = format!("{}.{collection}", database.name());
    let indexes = match listed(database, doc! { "listIndexes": collection }).await {
        Ok(indexes) => indexes,
        Err(e) if command_code(&e) == Some(NAMESPACE_NOT_FOUND) => Vec::new(),
        Err(e) => {
            return Err(
                Error::mongo(format!("listing the indexes of {collection} failed"), e)
                    .needing("listIndexes", namespace),
            )
        }
    };
    let named = |name: &str| {
        indexes
            .iter()
            .find(|index| index.get_str("name") == Ok(name))
    };
    let retention = TTL_INDEXES
        .into_iter()
        .filter_map(|(name, _)| Some((name, ttl_of(named(name)?))))
        .collect();
    let listing = doc! { "listCollections": 1, "filter": { "name": collection } };
    let collections = listed(database, listing).await.map_err(|e| {
        Error::mongo(format!("reading the options of {collection} failed"), e)
            .needing("listCollections", format!("database {}", database.name()))
    })?;
    let validator = collections.first().and_then(|found| {
        let options = found.get_document("options").ok()?;
        let ours = options.get_str("validationLevel") == Ok("moderate")
            && options.get_str("validationAction") == Ok("error");
        options
            .get_document("validator")
            .ok()
            .filter(|_| ours)
            .cloned()
    });
    Ok(Found {
        sweep_index: named(SWEEP_INDEX).is_some(),
        retention,
        validator,
    })
}

/// The documents a listing command returns: its first batch, which holds
/// every index or collection asked for here (a few, under the 101 of a
/// first batch).
async fn listed(database: &Database, command: Document) -> mongodb::error::Result<Vec<Document>> {
    let reply = database.run_command(command).await?;
    Ok(reply
        .get_document("cursor")
        .and_then(|cursor| cursor.get_array("firstBatch"))
        .map(|batch| {
            batch
                .iter()
                .filter_map(|d| d.as_document().cloned())
                .collect()
        })
        .unwrap_or_default())
}

/// An index's TTL, whatever number type the server kept it as; `None`
/// for none, or one no relay could have meant (negative, not a number).
fn ttl_of(index: &Document) -> Option<Duration> {
    let seconds = match index.get("expireAfterSeconds")? {
        Bson::Int32(n) => f64::from(*n),
        Bson::Int64(n) => *n as f64,
        Bson::Double(n) => *n,
        _ => return None,
    };
    (seconds.is_finite() && seconds >= 0.0).then(|| Duration::from_secs(seconds as u64))
}

/// The changes that bring `found` to what `config` asks, in the order
/// they are made; none if it is as asked.
pub fn plan(found: &Found, config: &RelayConfig) -> Result<Vec<Change>> {
    let mut changes = Vec::new();
    if !found.sweep_index {
        changes.push(Change::CreateSweepIndex);
    }
    for (index, _) in TTL_INDEXES {
        // Found: the index is there, with the TTL it keeps, if any.
        let found = found
            .retention
            .iter()
            .find(|(name, _)| *name == index)
            .map(|(_, keep)| *keep);
        match (config.retention, found) {
            (None, _) | (Some(Retention::Off), None) => {}
            (Some(Retention::Off), Some(was)) => changes.push(Change::DropRetention { index, was }),
            (Some(Retention::Keep(to)), Some(Some(kept))) if kept == whole_seconds(to) => {}
            (Some(Retention::Keep(to)), found) => changes.push(Change::SetRetention {
                index,
                from: found.flatten(),
                to,
            }),
        }
    }
    if config.install_validator {
        let wanted = doc! { "$jsonSchema": contract_schema(&config.decode_rules(usize::MAX)?) };
        if found.validator.as_ref() != Some(&wanted) {
            changes.push(Change::InstallValidator);
        }
    }
    Ok(changes)
}

/// A TTL as the server keeps it: whole seconds.
fn whole_seconds(duration: Duration) -> Duration {
    Duration::from_secs(duration.as_secs())
}

/// The retention TTL indexes, and the field each counts from.
const TTL_INDEXES: [(&str, &str); 2] = [
    (PROCESSED_TTL_INDEX, field::PROCESSED_AT),
    (FAILED_TTL_INDEX, field::FAILED_AT),
];

/// Prepares the outbox collection `config` names, as `preparer` may: what
/// [`inspect`] finds missing or different is made as [`plan`] says, and
/// what `preparer` may not change is reported in the log. A server that
/// does not finish within [`SETUP_TIMEOUT`] is reported rather than waited
/// on forever.
pub async fn prepare(database: &Database, config: &RelayConfig, preparer: Preparer) -> Result<()> {
    let namespace = format!("{}.{}", config.database, config.collection);
    let steps = async {
        let found = inspect(database, &config.collection).await?;
        for change in plan(&found, config)? {
            match preparer {
                Preparer::SweepOnce if change.is_shared() => tracing::warn!(
                    collection = %config.collection,
                    "the outbox differs from this process's settings, which would {change}; \
                     sweep --once leaves retention and the validator to the relays (run): \
                     give every process of the outbox the same settings"
                ),
                _ => apply(database, config, &found, &change).await?,
            }
        }
        Ok::<_, Error>(())
    };
    match tokio::time::timeout(SETUP_TIMEOUT, steps).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(error)) => Err(Error::check(
            CheckKind::OutboxSetup,
            format!(
                "cannot prepare the outbox collection {namespace}: {error}; give the user the \
                 role docs/configuration.md#permissions gives"
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

/// Makes one change.
async fn apply(
    database: &Database,
    config: &RelayConfig,
    found: &Found,
    change: &Change,
) -> Result<()> {
    let outbox = database.collection::<Document>(&config.collection);
    match change {
        Change::CreateSweepIndex => ensure_sweep_index(&outbox).await,
        Change::SetRetention { index, from, to } => {
            let key = TTL_INDEXES
                .into_iter()
                .find(|(name, _)| name == index)
                .map_or(field::PROCESSED_AT, |(_, key)| key);
            if from.is_some() {
                tracing::warn!(
                    collection = %config.collection,
                    "retention changed: {change}; every relay of the outbox should say the same \
                     --retention, or each start changes it back"
                );
            }
            ensure_ttl(&outbox, index, key, *to).await
        }
        Change::DropRetention { index, .. } => {
            tracing::warn!(collection = %config.collection, "--retention off: {change}");
            drop_index(&outbox, index).await
        }
        Change::InstallValidator => {
            install_validator(
                database,
                &config.collection,
                &config.decode_rules(usize::MAX)?,
            )
            .await?;
            let replaced = if found.validator.is_some() {
                " (replacing one that differed)"
            } else {
                ""
            };
            tracing::info!(collection = %config.collection, "installed the outbox validator{replaced}");
            Ok(())
        }
    }
}

/// Creates the sweep index (a no-op where it exists): all a benchmark or
/// a test needs of a fresh outbox.
pub async fn ensure_sweep_index(outbox: &Collection<Document>) -> Result<()> {
    let sweep = IndexModel::builder()
        .keys(doc! { field::STATUS: 1, field::NEXT_ATTEMPT_AT: 1, field::ID: 1 })
        .options(IndexOptions::builder().name(SWEEP_INDEX.to_owned()).build())
        .build();
    outbox.create_index(sweep).await.map(drop).map_err(|e| {
        Error::mongo(format!("creating index {SWEEP_INDEX} failed"), e)
            .needing("createIndex", outbox.namespace())
    })
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
                .map_err(|e| {
                    Error::mongo(format!("changing the retention of {name} failed"), e)
                        .needing("collMod", outbox.namespace())
                })?;
            Ok(())
        }
        Err(e) => Err(Error::mongo(format!("creating index {name} failed"), e)
            .needing("createIndex", outbox.namespace())),
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
        Err(e) => Err(Error::mongo(format!("dropping index {name} failed"), e)
            .needing("dropIndex", outbox.namespace())),
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
    rules: &DecodeRules,
) -> Result<()> {
    let validator = doc! { "$jsonSchema": contract_schema(rules) };
    let modify = doc! {
        "collMod": collection,
        "validator": validator.clone(),
        "validationLevel": "moderate",
        "validationAction": "error",
    };
    let namespace = format!("{}.{collection}", database.name());
    let failed = |e| {
        Error::mongo(
            format!("installing the validator on {collection} failed"),
            e,
        )
        .needing("collMod", &namespace)
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
                Err(e) => Err(Error::mongo(
                    format!("creating {collection} with the validator failed"),
                    e,
                )
                .needing("createCollection", &namespace)),
            }
        }
        Err(e) => Err(failed(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ttl_reads_whatever_number_the_server_kept() {
        let day = Some(Duration::from_secs(86_400));
        for ttl in [
            Bson::Int32(86_400),
            Bson::Int64(86_400),
            Bson::Double(86_400.0),
        ] {
            assert_eq!(
                ttl_of(&doc! { "expireAfterSeconds": ttl.clone() }),
                day,
                "{ttl}"
            );
        }
        assert_eq!(ttl_of(&doc! { "expireAfterSeconds": -1 }), None);
        assert_eq!(ttl_of(&doc! { "name": "outbox_processed_ttl" }), None);
    }

    #[test]
    fn retention_off_drops_an_index_of_its_name_whatever_it_keeps() {
        let mut config = RelayConfig {
            retention: Some(Retention::Off),
            ..RelayConfig::default()
        };
        let found = Found {
            sweep_index: true,
            retention: vec![(PROCESSED_TTL_INDEX, None)],
            validator: None,
        };
        let planned = plan(&found, &config).expect("a plan");
        assert_eq!(
            planned,
            [Change::DropRetention {
                index: PROCESSED_TTL_INDEX,
                was: None
            }]
        );
        config.retention = Some(Retention::Keep(Duration::from_secs(60)));
        let planned = plan(&found, &config).expect("a plan");
        assert_eq!(
            planned.len(),
            2,
            "both set, the one found kept nothing: {planned:?}"
        );
    }
}
