//! The catch-up pass: delivers what is already pending in the collection.
//!
//! Run when there is no resume token, the stream cannot resume from it, or
//! more is pending than `--max-replay`. It reads a snapshot of the
//! collection (MongoDB's snapshot reads), and the change stream is opened,
//! while the pass is fed, at the snapshot's cluster time: anything
//! committed up to that moment is in the snapshot, anything after arrives
//! on the stream, so nothing falls between the two, and the two never race
//! on one key: a message the stream shows committed after every message
//! the pass read. A message committed at the snapshot's very moment is in
//! both; the pass returns the ids it queued so the stream can skip those
//! (see `change_stream`), and should one slip through anyway, JetStream
//! drops the repeat by its `Nats-Msg-Id` and the second mark matches nothing.
//!
//! Only ids that could still appear on the stream are kept: those created
//! within [`REPEAT_WINDOW`] of the snapshot, and of those the newest
//! [`MAX_REMEMBERED`] (the stream can repeat only what committed last). A
//! backlog of ten million older messages costs no memory here.
//!
//! A snapshot lasts as long as the server keeps its history
//! (`minSnapshotHistoryWindowInSeconds`, 5 minutes by default). A pass that
//! outlives it fails and is run again on a new snapshot, from what is still
//! pending, with the stream opened at the new snapshot's time.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bson::{doc, oid::ObjectId, Bson, DateTime, Document, RawArray, RawDocumentBuf, Timestamp};
use futures::TryStreamExt;
use mongodb::options::{CollectionOptions, ReadConcern};
use mongodb::raw_batch_cursor::{RawBatch, SessionRawBatchCursor};
use mongodb::{ClientSession, Collection};
use tokio_util::sync::CancellationToken;

use crate::contract::{field, status, DecodeRules};
use crate::error::{is_max_time_expired, is_unauthorized, Error, Result};
use crate::partition::Partition;
use crate::work::{Feed, Work};

use super::progress::StreamProgress;

/// How long before the snapshot a message the stream may still show can
/// have been created: an ObjectId is made when the writer inserts, and its
/// transaction may commit up to a minute later (MongoDB's default
/// `transactionLifetimeLimitSeconds`), plus clock skew between hosts.
pub(crate) const REPEAT_WINDOW: Duration = Duration::from_secs(300);

/// The most ids a pass remembers, the newest; past it, a repeat is dropped
/// by JetStream.
pub(crate) const MAX_REMEMBERED: usize = 100_000;

/// The most documents a read asks the server for at a time. Left to the
/// server, a batch is 16 MiB; a thousand is a round trip per thousand
/// messages, against one mark per 500.
pub(crate) const READ_BATCH: u32 = 1000;

/// About how many bytes a read asks the server for at a time. A batch is
/// held whole while its documents wait for room in the pipeline, beside the
/// budget's worth under way; a 16 MiB batch of large messages would be
/// memory no budget counts.
const READ_BYTES: f64 = (4 << 20) as f64;

/// The longest the server may take to say the collection's sizes.
const STATS_TIME: Duration = Duration::from_secs(5);

/// The fewest documents a read asks for: sixteen of the largest are at
/// most the server's 16 MiB a batch, and a size the server got wrong (its
/// figures can be off after an unclean shutdown) cannot make a read of a
/// backlog one round trip a message.
const LEAST_READ_BATCH: u32 = 16;

/// Whether the relay has said it cannot read the collection's sizes: said
/// once, as it is asked at every start of the stream.
static SIZES_UNKNOWN_SAID: AtomicBool = AtomicBool::new(false);

/// How many documents to ask the server for at a time in reading the
/// outbox: [`READ_BYTES`] over its documents' average size, as
/// `$collStats` keeps it (a figure the server holds, not a read of the
/// documents; one for each shard, weighed by its count), from
/// [`LEAST_READ_BATCH`] to [`READ_BATCH`]. The average is the whole
/// collection's, kept messages among them. `None` from a server that
/// cannot say: a catch-up pass then judges it from the documents it reads
/// first ([`Snapshot::judged_batch`]), and other reads ask for the most,
/// which MongoDB caps at 16 MiB a batch.
pub(crate) async fn read_batch(outbox: &Collection<Document>) -> Option<u32> {
    let stats = async {
        outbox
            .aggregate([doc! { "$collStats": { "storageStats": {} } }])
            .max_time(STATS_TIME)
            .await?
            .try_collect::<Vec<Document>>()
            .await
    };
    match stats.await {
        // A server may keep no average (one build says 0).
        Ok(shards) => average_size(&shards).map(|average| batch_for(Some(average))),
        Err(error) => {
            let why = if is_max_time_expired(&error) {
                format!(
                    "the server took longer than {} to say it ($collStats)",
                    humantime::format_duration(STATS_TIME)
                )
            } else if is_unauthorized(&error) {
                "the relay's user needs the collStats action on the outbox".to_owned()
            } else {
                "$collStats failed".to_owned()
            };
            if SIZES_UNKNOWN_SAID.swap(true, Ordering::Relaxed) {
                tracing::debug!(%error, "could not read the outbox's average document size: {why}");
            } else {
                tracing::warn!(
                    %error,
                    "could not read the outbox's average document size: {why}; a catch-up pass \
                     judges its reads' batch from the documents it reads first, and other reads \
                     ask for {READ_BATCH} documents at a time, up to 16 MiB a batch beside the \
                     byte budget"
                );
            }
            None
        }
    }
}

/// The average document size over every shard's figures, each weighed by
/// its count; `None` if no shard gave both.
fn average_size(shards: &[Document]) -> Option<f64> {
    let (bytes, count) = shards
        .iter()
        .filter_map(|shard| {
            let stats = shard.get_document("storageStats").ok()?;
            let average = number(stats.get("avgObjSize")?)?;
            let count = number(stats.get("count")?)?;
            (average > 0.0 && count > 0.0).then_some((average * count, count))
        })
        .fold((0.0, 0.0), |(b, c), (bytes, count)| (b + bytes, c + count));
    (count > 0.0).then(|| bytes / count)
}

/// The batch for documents the size of `documents`' on average; `None`
/// if there are none.
fn batch_judged_from(documents: &RawArray) -> Option<u32> {
    let count = documents.into_iter().count();
    // The array's own framing, a few bytes a document, is no matter.
    (count > 0).then(|| batch_for(Some(documents.as_bytes().len() as f64 / count as f64)))
}

/// A number as the server may write it.
fn number(value: &Bson) -> Option<f64> {
    match value {
        Bson::Int32(n) => Some(f64::from(*n)),
        Bson::Int64(n) => Some(*n as f64),
        Bson::Double(n) => Some(*n),
        _ => None,
    }
}

/// A read's batch for documents of `average` bytes.
fn batch_for(average: Option<f64>) -> u32 {
    match average {
        // Saturating: a NaN or infinite quotient is 0 or the most.
        Some(average) if average >= 1.0 => {
            ((READ_BYTES / average) as u32).clamp(LEAST_READ_BATCH, READ_BATCH)
        }
        _ => READ_BATCH,
    }
}

/// The filter for pending messages whose next attempt is due. Anything
/// but a future date counts as due: a `nextAttemptAt` the relay did not
/// write (a string, say) must not hide a message.
pub(crate) fn due_filter(now: DateTime) -> Document {
    doc! {
        field::STATUS: status::PENDING,
        field::NEXT_ATTEMPT_AT: { "$not": { "$gt": now } },
    }
}

/// The due pending messages as of one moment, oldest first.
pub(crate) struct Snapshot {
    session: ClientSession,
    cursor: SessionRawBatchCursor,
    /// When the snapshot was taken, by the relay's clock.
    taken: DateTime,
    /// The server's time just before the snapshot was asked for.
    before: Option<Timestamp>,
    /// Documents a read asks for (see [`read_batch`]).
    batch: u32,
    /// The first batch, read with the snapshot and not yet fed.
    first: Option<RawBatch>,
}

impl Snapshot {
    /// Starts reading a snapshot of the due pending messages, `batch`
    /// documents at a time (see [`read_batch`]).
    pub async fn read(
        outbox: &Collection<Document>,
        partition: Partition,
        batch: u32,
    ) -> Result<Self> {
        let failed = |e| {
            Error::mongo("reading pending messages failed", e).needing("find", outbox.namespace())
        };
        let taken = DateTime::now();
        let namespace = outbox.namespace();
        let database = outbox.client().database(&namespace.db);
        let mut probe = outbox.client().start_session().await.map_err(failed)?;
        database
            .run_command(doc! { "ping": 1 })
            .session(&mut probe)
            .await
            .map_err(failed)?;
        let mut session = outbox
            .client()
            .start_session()
            .snapshot(true)
            .await
            .map_err(failed)?;
        // The handle's own read concern (majority, for the relay's other
        // reads) would stand in the snapshot's place: the driver sets the
        // snapshot's level only where the command names none.
        let options = CollectionOptions::builder()
            .read_concern(ReadConcern::snapshot())
            .selection_criteria(outbox.selection_criteria().cloned())
            .build();
        // Read a batch at a time, each document straight from the server's
        // reply: the driver's own cursor copies every document out of it.
        let mut cursor = database
            .collection_with_options::<RawDocumentBuf>(&namespace.coll, options)
            .find(partition.scope(due_filter(taken)))
            .sort(doc! { field::ID: 1 })
            .batch_size(batch)
            .session(&mut session)
            .batch()
            .await
            .map_err(failed)?;
        // The first batch is in the find's reply: taken now, its documents
        // can size the pass's reads where the server could not.
        let first = cursor
            .stream(&mut session)
            .try_next()
            .await
            .map_err(failed)?;
        Ok(Snapshot {
            session,
            cursor,
            taken,
            before: probe.operation_time(),
            batch,
            first,
        })
    }

    /// When the snapshot was taken, by the relay's clock: everything
    /// committed before it is in the snapshot.
    pub fn taken(&self) -> DateTime {
        self.taken
    }

    /// Documents the pass's reads ask for, judged from the outbox's
    /// average document size.
    pub fn batch(&self) -> u32 {
        self.batch
    }

    /// The batch [`read_batch`] would ask for, judged from the documents
    /// of the snapshot's first batch; `None` if it held none.
    pub fn judged_batch(&self) -> Option<u32> {
        batch_judged_from(self.first.as_ref()?.doc_slices().ok()?)
    }

    /// The cluster time the snapshot reads at, as the server reports it.
    pub fn cluster_time(&self) -> Option<Timestamp> {
        self.session.snapshot_time()
    }

    /// Where the stream starts: the snapshot's cluster time, or the
    /// server's time just before it was asked for, if that is earlier (a
    /// server that reports a later time than its snapshot's would
    /// otherwise leave a gap; the overlap is skipped as repeats). `None`
    /// from a server that said neither.
    pub fn start(&self) -> Option<Timestamp> {
        match (self.before, self.cluster_time()) {
            (Some(before), Some(at)) => Some(before.min(at)),
            (before, at) => before.or(at),
        }
    }

    /// Feeds every message of the snapshot into the pipeline. Returns what
    /// it queued; `None` if the relay stopped first.
    pub async fn feed(
        mut self,
        rules: &DecodeRules,
        output: &Feed,
        progress: &StreamProgress,
        shutdown: &CancellationToken,
    ) -> Result<Option<Fed>> {
        let window = i64::try_from(REPEAT_WINDOW.as_millis()).unwrap_or(i64::MAX);
        let recent = self.taken.timestamp_millis().saturating_sub(window);
        let mut queued = VecDeque::new();
        let mut count = 0;
        let failed = |e| Error::mongo("reading pending messages failed", e);
        let mut first = self.first.take();
        let mut batches = self.cursor.stream(&mut self.session);
        loop {
            let next = match first.take() {
                Some(batch) => Some(batch),
                None => tokio::select! {
                    _ = shutdown.cancelled() => return Ok(None),
                    next = batches.try_next() => next.map_err(failed)?,
                },
            };
            let Some(batch) = next else {
                return Ok(Some(Fed {
                    count,
                    recent: queued.into_iter().collect(),
                }));
            };
            for document in batch.doc_slices().map_err(failed)? {
                // A stop is heeded between documents, not only batches.
                if shutdown.is_cancelled() {
                    return Ok(None);
                }
                let document = document
                    .map_err(|e| e.to_string())
                    .and_then(|d| d.as_document().ok_or_else(|| "not a document".to_owned()))
                    .map_err(|why| {
                        Error::Protocol(format!("the server's batch of pending messages: {why}"))
                    })?;
                let decoded = rules.decode_raw(document);
                if let Bson::ObjectId(id) = decoded.id {
                    let created = id.timestamp().timestamp_millis();
                    if created >= recent {
                        if queued.len() == MAX_REMEMBERED {
                            queued.pop_front();
                        }
                        queued.push_back(id);
                    }
                }
                if output.send(Work::from_catch_up(decoded)).await.is_err() {
                    return Ok(None);
                }
                count += 1;
                progress.read(None);
            }
        }
    }
}

/// What a catch-up pass queued.
pub(crate) struct Fed {
    /// How many messages.
    pub count: u64,
    /// The ids of those the stream may still show.
    pub recent: HashSet<ObjectId>,
}

#[cfg(test)]
mod tests {
    use bson::{rawdoc, RawArrayBuf};

    use super::*;

    #[test]
    fn a_read_batch_is_judged_from_the_documents_read_where_the_server_cannot_say() {
        let batch_of = |payload: usize, count: usize| {
            let mut documents = RawArrayBuf::new();
            for _ in 0..count {
                documents.push(rawdoc! { "payload": bson::Binary {
                    subtype: bson::spec::BinarySubtype::Generic,
                    bytes: vec![0; payload],
                } });
            }
            batch_judged_from(&documents)
        };
        assert_eq!(batch_of(200, 50), Some(READ_BATCH), "small: the most");
        assert_eq!(batch_of(100_000, 3), Some(41));
        assert_eq!(batch_of(0, 0), None, "no documents: no judgement");
    }

    #[test]
    fn a_read_batch_holds_about_four_mebibytes_of_documents() {
        assert_eq!(batch_for(Some(300.0)), READ_BATCH, "small: the most");
        assert_eq!(batch_for(Some(100_000.0)), 41);
        assert_eq!(batch_for(Some(16_000_000.0)), LEAST_READ_BATCH);
        for unknown in [None, Some(0.0), Some(f64::NAN), Some(-1.0)] {
            assert_eq!(batch_for(unknown), READ_BATCH);
        }
    }

    #[test]
    fn shards_are_weighed_by_their_counts() {
        let shard = |average: f64, count: i64| {
            doc! { "storageStats": { "avgObjSize": average, "count": count } }
        };
        let shards = [
            shard(100.0, 900),
            shard(1000.0, 100),
            doc! { "storageStats": {} },
        ];
        assert_eq!(average_size(&shards), Some(190.0));
        assert_eq!(average_size(&[shard(0.0, 0)]), None, "an empty collection");
        assert_eq!(average_size(&[]), None);
    }

    /// `$collStats` through mongos: a document for each shard holding the
    /// collection, each with the shard's own figures (an empty shard says
    /// no average), to be added up rather than any one taken for all.
    #[test]
    fn a_reply_through_mongos_is_added_up_over_its_shards() {
        let shard = |name: &str, storage: Document| {
            doc! {
                "ns": "shop.outbox", "shard": name, "host": format!("{name}-1:27018"),
                "localTime": DateTime::now(), "storageStats": storage,
            }
        };
        let through_mongos = [
            shard(
                "shard-a",
                doc! { "count": 1000_i64, "avgObjSize": 300_i32, "numOrphanDocs": 0_i64 },
            ),
            shard(
                "shard-b",
                doc! { "count": 1000_i64, "avgObjSize": 3000_i32, "numOrphanDocs": 0_i64 },
            ),
            shard("shard-c", doc! { "count": 0_i64, "numOrphanDocs": 0_i64 }),
        ];
        assert_eq!(average_size(&through_mongos), Some(1650.0));
        assert_eq!(
            average_size(&through_mongos[..1]),
            Some(300.0),
            "one shard, or a replica set, is its own average"
        );
    }

    #[test]
    fn a_size_is_read_in_any_number_type_the_server_writes() {
        assert_eq!(number(&Bson::Int32(300)), Some(300.0));
        assert_eq!(number(&Bson::Int64(300)), Some(300.0));
        assert_eq!(number(&Bson::Double(300.5)), Some(300.5));
        assert_eq!(number(&Bson::String("300".into())), None);
    }
}
