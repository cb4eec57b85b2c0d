//! The completion stage against a real MongoDB-compatible server, for the
//! writes no scripted collection can stand in for: a document named by its
//! `_id` and `attempts` as stored, byte for byte.

use std::time::Duration;

use bson::{doc, oid::ObjectId, Bson, Document, RawDocumentBuf};
use mongodb::{Collection, Database};
use tokio_util::sync::CancellationToken;

use super::CompletionStage;
use crate::checkpoint::CheckpointStore;
use crate::config::{DeadLetters, RelayConfig};
use crate::contract::{ContractViolation, DecodeRules, Rule, StoredFields};
use crate::lease::Term;
use crate::observe::Metrics;
use crate::order::{HeldKey, HoldKind, Holder, KeyOrder};
use crate::unreadable::RawField;
use crate::work::{Again, Budget, Finished, LastDelivery, Unmarkable, Verdict, Work};

fn stage(outbox: Collection<Document>) -> CompletionStage {
    let config = RelayConfig::new("mongodb://unused", "unused");
    CompletionStage {
        outbox,
        checkpoints: None,
        batch_size: 10,
        checkpoint_interval: Duration::from_secs(1),
        mark_delay: Duration::ZERO,
        budget: Budget::new(1 << 20),
        retry: config.retry(),
        abandon: CancellationToken::new(),
        metrics: Metrics::new(),
        unmarkable: Unmarkable::default(),
        deliveries: LastDelivery::default(),
        tenure: None,
        acknowledged: Default::default(),
    }
}

/// A running stage: the way to feed it, and its task.
type Stage = (
    tokio::sync::mpsc::Sender<Finished>,
    tokio::task::JoinHandle<crate::work::Tally>,
);

/// The stage running on its own task, and the way to feed it.
fn running(stage: CompletionStage) -> Stage {
    let (input, received) = tokio::sync::mpsc::channel(8);
    (input, tokio::spawn(stage.run(received)))
}

/// Waits until `filter` matches `n` documents; fails the test, saying
/// `what` should have happened, after 30 s.
async fn until_counted(outbox: &Collection<Document>, filter: Document, n: u64, what: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while outbox.count_documents(filter.clone()).await.expect("count") != n {
        assert!(tokio::time::Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The verdict on a message read from the collection, its `_id` `id`.
fn verdict_on(id: ObjectId, verdict: Verdict) -> Finished {
    let document = doc! { "_id": id, "type": "t", "payload": 1 };
    Finished {
        work: Work::from_catch_up(DecodeRules::any_relay().decode(&document)),
        verdict,
    }
}

/// A database of its own whose outbox holds `n` pending messages, as a
/// writer inserts them, and their `_id`s.
async fn outbox_with_pending(n: usize) -> (Database, Collection<Document>, Vec<ObjectId>) {
    let database = crate::testing::database().await;
    let outbox = database.collection::<Document>("outbox");
    let ids: Vec<ObjectId> = (0..n).map(|_| ObjectId::new()).collect();
    for id in &ids {
        let message = doc! { "_id": id, "type": "t", "payload": 1, "status": "pending" };
        outbox.insert_one(message).await.expect("insert");
    }
    (database, outbox, ids)
}

/// The document `id` read back as stored, and decoded as if the driver
/// could not read its `_id` and `attempts`: addressed by their bytes.
async fn as_unreadable(outbox: &Collection<Document>, id: ObjectId) -> Work {
    let raw: RawDocumentBuf = outbox
        .clone_with_type::<RawDocumentBuf>()
        .find_one(doc! { "_id": id })
        .await
        .expect("read")
        .expect("the document");
    let mut decoded = DecodeRules::any_relay().decode_raw(&raw);
    decoded.stored = Some(StoredFields {
        id: RawField::of(&raw, "_id"),
        attempts: RawField::of(&raw, "attempts"),
    });
    Work::from_catch_up(decoded)
}

#[tokio::test]
async fn a_document_named_by_its_stored_bytes_is_failed_and_the_fences_still_hold() {
    let database = crate::testing::database().await;
    let outbox = database.collection::<Document>("outbox");
    let (broken, counted_since) = (ObjectId::new(), ObjectId::new());
    outbox
        .insert_many([
            doc! { "_id": broken, "payload": 1, "status": "pending", "attempts": 3 },
            doc! { "_id": counted_since, "payload": 1, "status": "pending", "attempts": 3 },
        ])
        .await
        .expect("insert");
    let violation = ContractViolation::new(Rule::Type, "type must be a non-empty string");
    let broken_work = as_unreadable(&outbox, broken).await;
    let stale_work = as_unreadable(&outbox, counted_since).await;
    // Another processor counted an attempt since this one read it.
    outbox
        .update_one(
            doc! { "_id": counted_since },
            doc! { "$inc": { "attempts": 1 } },
        )
        .await
        .expect("update");

    let stage = stage(outbox.clone());
    let batch = [broken_work, stale_work].map(|work| Finished {
        work,
        verdict: Verdict::Rejected(violation.clone()),
    });
    let tally = stage.record(&batch).await.expect("recorded");

    assert_eq!(tally.failed, 1, "only the document still as it was read");
    let failed = outbox
        .find_one(doc! { "_id": broken })
        .await
        .expect("read")
        .expect("the document");
    assert_eq!(failed.get_str("status"), Ok("failed"));
    assert_eq!(
        failed.get_str("lastError"),
        Ok(violation.to_string().as_str())
    );
    let untouched = outbox
        .find_one(doc! { "_id": counted_since })
        .await
        .expect("read")
        .expect("the document");
    assert_eq!(untouched.get_str("status"), Ok("pending"));
    assert_eq!(untouched.get("attempts"), Some(&Bson::Int32(4)));
    assert_eq!(
        stage.unmarkable.len(),
        0,
        "a fence that does not match is no refusal"
    );
    database.drop().await.expect("drop");
}

#[tokio::test]
async fn a_stage_that_gives_up_remembers_the_deliveries_it_did_not_mark() {
    let database = crate::testing::database().await;
    let mut stage = stage(database.collection("outbox"));
    stage.tenure = Some(crate::testing::tenure(Some(Term(7)), None));
    stage.abandon.cancel();
    let acknowledged = stage.acknowledged.clone();
    let (delivered, queued, refused) = (ObjectId::new(), ObjectId::new(), ObjectId::new());
    let (input, received) = tokio::sync::mpsc::channel(8);
    input
        .send(verdict_on(delivered, Verdict::Delivered))
        .await
        .unwrap();
    let refusal = Verdict::Refused {
        reason: "no".into(),
        own: true,
        maybe_stored: false,
    };
    input.send(verdict_on(refused, refusal)).await.unwrap();
    input
        .send(verdict_on(queued, Verdict::Delivered))
        .await
        .unwrap();
    // The first verdict is the batch it gives up on; the rest it never took.
    stage.batch_size = 1;
    stage.run(received).await;

    assert_eq!(acknowledged.again(&delivered, Some(Term(8))), Again::Stored);
    assert_eq!(acknowledged.again(&queued, Some(Term(8))), Again::Stored);
    assert_eq!(acknowledged.again(&refused, Some(Term(8))), Again::Unseen);
    assert!(input.is_closed(), "nothing more is taken");
    database.drop().await.expect("drop");
}

#[tokio::test]
async fn a_stage_that_finds_a_newer_leaders_checkpoint_remembers_what_it_did_not_mark() {
    let (database, outbox, ids) = outbox_with_pending(2).await;
    let (marked, queued) = (ids[0], ids[1]);
    let checkpoints = CheckpointStore::new(&database, "checkpoints", "outbox");
    database
        .collection::<Document>("checkpoints")
        .insert_one(
            doc! { "_id": format!("{}.outbox", database.name()), "owner": "next", "term": 8 },
        )
        .await
        .expect("a newer leader's checkpoint");
    let mut stage = stage(outbox.clone());
    stage.checkpoints = Some(checkpoints.fenced("this", Term(7)));
    stage.tenure = Some(crate::testing::tenure(Some(Term(7)), None));
    stage.batch_size = 1;
    // Every batch is followed by a save, which finds the newer leader.
    stage.checkpoint_interval = Duration::ZERO;
    let acknowledged = stage.acknowledged.clone();
    let from_stream = |id: ObjectId| {
        let document = doc! { "_id": id, "type": "t", "payload": 1 };
        let decoded = DecodeRules::any_relay().decode(&document);
        let token =
            bson::from_bson(Bson::Document(doc! { "_data": id.to_hex() })).expect("a token");
        Finished {
            work: Work::from_stream(decoded, token, None),
            verdict: Verdict::Delivered,
        }
    };
    let (input, received) = tokio::sync::mpsc::channel(8);
    input.send(from_stream(marked)).await.unwrap();
    input.send(from_stream(queued)).await.unwrap();
    stage.run(received).await;

    let status = |id: ObjectId| {
        let outbox = outbox.clone();
        async move {
            let stored = outbox.find_one(doc! { "_id": id }).await.expect("read");
            stored.and_then(|d| d.get_str("status").ok().map(str::to_owned))
        }
    };
    assert_eq!(status(marked).await.as_deref(), Some("processed"));
    assert_eq!(acknowledged.again(&marked, Some(Term(8))), Again::Unseen);
    assert_eq!(status(queued).await.as_deref(), Some("pending"));
    assert_eq!(
        acknowledged.again(&queued, Some(Term(8))),
        Again::Stored,
        "a delivery the stage took no more is remembered"
    );
    assert!(input.is_closed(), "nothing more is taken");
    database.drop().await.expect("drop");
}

#[tokio::test]
async fn marks_wait_for_others_to_share_an_update_until_the_batch_fills_or_the_input_ends() {
    let (database, outbox, ids) = outbox_with_pending(4).await;
    let mut stage = stage(outbox.clone());
    stage.batch_size = 3;
    // Longer than any test: only a full batch or the input's end writes.
    stage.mark_delay = Duration::from_secs(3600);
    let delivered = |id: ObjectId| verdict_on(id, Verdict::Delivered);
    let pending = || {
        let outbox = outbox.clone();
        async move {
            outbox
                .count_documents(doc! { "status": "pending" })
                .await
                .expect("count")
        }
    };
    let (input, running) = running(stage);
    input.send(delivered(ids[0])).await.unwrap();
    input.send(delivered(ids[1])).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(pending().await, 4, "two marks wait for a third");

    input.send(delivered(ids[2])).await.unwrap();
    let a_full_batch = "a full batch is marked at once";
    until_counted(&outbox, doc! { "status": "pending" }, 1, a_full_batch).await;

    input.send(delivered(ids[3])).await.unwrap();
    drop(input);
    let tally = tokio::time::timeout(Duration::from_secs(30), running)
        .await
        .expect("the stage ends with its input")
        .expect("no panic");
    assert_eq!(tally.delivered, 4);
    assert_eq!(pending().await, 0, "the input's end marks what waits");
    database.drop().await.expect("drop");
}

#[tokio::test]
async fn a_verdict_other_than_a_mark_is_written_without_the_delay() {
    let (database, outbox, ids) = outbox_with_pending(2).await;
    let (delivered, refused) = (ids[0], ids[1]);
    let mut stage = stage(outbox.clone());
    // Longer than any test: only a verdict that may not wait ends it.
    stage.mark_delay = Duration::from_secs(3600);
    let (input, running) = running(stage);
    input
        .send(verdict_on(delivered, Verdict::Delivered))
        .await
        .unwrap();
    let refusal = Verdict::Refused {
        reason: "no".into(),
        own: true,
        maybe_stored: false,
    };
    input.send(verdict_on(refused, refusal)).await.unwrap();
    let both = doc! { "$or": [
        { "_id": delivered, "status": "processed" },
        { "_id": refused, "attempts": 1 },
    ] };
    let at_once = "a refusal, and the mark before it, are written at once";
    until_counted(&outbox, both, 2, at_once).await;
    drop(input);
    running.await.expect("no panic");
    database.drop().await.expect("drop");
}

#[tokio::test]
async fn a_retry_of_a_message_that_may_be_stored_counts_as_sent_again() {
    let (database, outbox, ids) = outbox_with_pending(2).await;
    let stage = stage(outbox.clone());
    let metrics = stage.metrics.clone();
    let (input, running) = running(stage);
    for (id, maybe_stored) in [(ids[0], true), (ids[1], false)] {
        let refusal = Verdict::Refused {
            reason: "timed out".into(),
            own: true,
            maybe_stored,
        };
        input.send(verdict_on(id, refusal)).await.unwrap();
    }
    drop(input);
    running.await.expect("no panic");
    let scrape = metrics.render();
    assert!(scrape.contains("outbox_retries_total 2"), "{scrape}");
    assert!(scrape.contains("outbox_resent_total 1"), "{scrape}");
    database.drop().await.expect("drop");
}

/// A stage on `budget`, with a delivery whose mark could wait an hour;
/// the mark is on `id` in `database`'s outbox.
async fn a_mark_waiting_on(budget: &Budget) -> (Database, Collection<Document>, ObjectId, Stage) {
    let (database, outbox, ids) = outbox_with_pending(1).await;
    let id = ids[0];
    let mut stage = stage(outbox.clone());
    stage.mark_delay = Duration::from_secs(3600);
    stage.budget = budget.clone();
    let (input, running) = running(stage);
    input
        .send(verdict_on(id, Verdict::Delivered))
        .await
        .unwrap();
    (database, outbox, id, (input, running))
}

#[tokio::test]
async fn marks_do_not_wait_while_the_budget_is_short() {
    let budget = Budget::new(1000);
    // Work read and waiting for room: no verdict comes until this mark
    // is written and its room given back.
    let _held = budget.try_reserve(600).expect("room");
    let (database, outbox, id, (input, running)) = a_mark_waiting_on(&budget).await;
    let marked = doc! { "_id": id, "status": "processed" };
    until_counted(&outbox, marked, 1, "the mark is written at once").await;
    drop(input);
    running.await.expect("no panic");
    database.drop().await.expect("drop");
}

#[tokio::test]
async fn marks_stop_waiting_when_a_source_starts_waiting_for_budget() {
    let budget = Budget::new(1000);
    // The waiting mark's work holds a little of the budget.
    let held = budget.try_reserve(100).expect("room");
    let (database, outbox, id, (input, running)) = a_mark_waiting_on(&budget).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pending = doc! { "_id": id, "status": "pending" };
    let waits = "the mark waits while the budget has room";
    until_counted(&outbox, pending, 1, waits).await;
    // A message larger than the budget wants all of it, and waits.
    let reading = tokio::spawn({
        let budget = budget.clone();
        async move { budget.reserve(5000).await }
    });
    let marked = doc! { "_id": id, "status": "processed" };
    let at_once = "the mark is written once a source waits for room";
    until_counted(&outbox, marked, 1, at_once).await;
    drop(held);
    let read = tokio::time::timeout(Duration::from_secs(30), reading).await;
    assert!(matches!(read, Ok(Ok(Some(_)))), "the source gets its room");
    drop(input);
    running.await.expect("no panic");
    database.drop().await.expect("drop");
}

/// The verdict on a keyed message, in an outbox whose validator refuses
/// every document with one of `refused_fields`, under `--on-dead-letter
/// hold`, its key held by it as the publish stage holds it for that
/// verdict (as a dead letter for a rejection, else as retrying): its
/// document as the stage left it, the stage's tally, what the stage's
/// metrics say, and the holds of its key after.
async fn decided_where_the_document_refuses(
    refused_fields: &[&str],
    verdict: Verdict,
) -> (Document, crate::work::Tally, String, Vec<HoldKind>) {
    let database = crate::testing::database().await;
    let absent: Vec<Document> = refused_fields
        .iter()
        .map(|field| doc! { *field: { "$exists": false } })
        .collect();
    database
        .create_collection("outbox")
        .validator(doc! { "$and": absent })
        .await
        .expect("create the outbox");
    let outbox = database.collection::<Document>("outbox");
    let id = ObjectId::new();
    let message = doc! { "_id": id, "type": "t", "key": "k", "payload": 1, "status": "pending" };
    outbox.insert_one(message.clone()).await.expect("insert");
    let mut stage = stage(outbox.clone());
    let retrying = HeldKey {
        key: "k".into(),
        holders: vec![Holder {
            id,
            dead_letter: matches!(verdict, Verdict::Rejected(_)),
        }],
        parked: 0,
        since: id.timestamp(),
    };
    let order = KeyOrder::new(vec![retrying], DeadLetters::Hold, true, Metrics::new());
    stage.tenure = Some(crate::testing::tenure(None, Some(order.clone())));
    let metrics = stage.metrics.clone();
    let (input, running) = running(stage);
    let finished = Finished {
        work: Work::from_catch_up(DecodeRules::any_relay().decode(&message)),
        verdict,
    };
    input.send(finished).await.unwrap();
    drop(input);
    let tally = running.await.expect("no panic");
    let stored = outbox
        .find_one(doc! { "_id": id })
        .await
        .expect("read")
        .expect("the document");
    database.drop().await.expect("drop");
    let held = order.held().into_iter().map(|(_, _, kind)| kind).collect();
    (stored, tally, metrics.render(), held)
}

/// A refusal the broker may take back later.
fn refusal() -> Verdict {
    Verdict::Refused {
        reason: "no".into(),
        own: false,
        maybe_stored: false,
    }
}

#[tokio::test]
async fn a_refusal_whose_document_takes_no_schedule_is_failed_and_counted_so() {
    let (stored, tally, metrics, held) =
        decided_where_the_document_refuses(&["nextAttemptAt"], refusal()).await;
    assert_eq!(stored.get_str("status"), Ok("failed"), "{stored}");
    let error = stored.get_str("lastError").unwrap_or_default();
    assert!(
        error.starts_with("no (its document takes no schedule"),
        "{stored}"
    );
    assert_eq!(stored.get_i32("attempts"), Ok(1), "{stored}");
    assert_eq!(stored.get_bool("holdsKey"), Ok(true), "{stored}");
    assert_eq!((tally.retried, tally.failed), (0, 1), "{tally:?}");
    assert!(
        metrics.contains("outbox_failed_total{kind=\"rejected\"} 1"),
        "{metrics}"
    );
    assert_eq!(held, [HoldKind::DeadLetter], "held as its document says");
}

#[tokio::test]
async fn a_refusal_failed_with_the_least_change_does_not_hold_its_key() {
    let refused = ["nextAttemptAt", "lastError"];
    let (stored, tally, _, held) = decided_where_the_document_refuses(&refused, refusal()).await;
    assert_eq!(stored.get_str("status"), Ok("failed"), "{stored}");
    assert!(stored.get("holdsKey").is_none(), "{stored}");
    assert_eq!((tally.retried, tally.failed), (0, 1), "{tally:?}");
    // Let go: its parked messages, were there any, would be read back.
    assert_eq!(held, [HoldKind::Releasing], "the document holds no key");
}

#[tokio::test]
async fn a_rejection_failed_with_the_least_change_does_not_hold_its_key() {
    let violation = ContractViolation::new(Rule::Type, "type must be a non-empty string");
    let (stored, tally, _, held) =
        decided_where_the_document_refuses(&["lastError"], Verdict::Rejected(violation)).await;
    assert_eq!(stored.get_str("status"), Ok("failed"), "{stored}");
    assert!(stored.get("holdsKey").is_none(), "{stored}");
    assert_eq!(tally.failed, 1, "{tally:?}");
    assert_eq!(held, [HoldKind::Releasing], "the document holds no key");
}

/// The mark delay's stretch, delivery by delivery: `gap` apart, `n` times.
fn paced(delay: Duration, gap: Duration, n: usize) -> super::Pace {
    let mut pace = super::Pace::new(delay);
    let start = tokio::time::Instant::now();
    for i in 0..n {
        let at = start + gap * u32::try_from(i).expect("few");
        pace.came(&verdict_on(ObjectId::new(), Verdict::Delivered), at);
    }
    pace
}

#[test]
fn a_marks_wait_stretches_to_two_gaps_between_deliveries_and_no_further() {
    let delay = Duration::from_millis(20);
    // 20 a second: two gaps, so a mark shares its update with one or two.
    assert_eq!(
        paced(delay, Duration::from_millis(50), 10).wait(),
        Duration::from_millis(100)
    );
    // 200 a second: the delay holds several already; nothing changes.
    assert_eq!(paced(delay, Duration::from_millis(5), 10).wait(), delay);
    // One a second: at most five delays, whatever the gap.
    assert_eq!(
        paced(delay, Duration::from_secs(1), 10).wait(),
        Duration::from_millis(100)
    );
    // Before a second delivery there is no gap; and no delay, no wait.
    assert_eq!(paced(delay, Duration::from_secs(1), 1).wait(), delay);
    assert_eq!(
        paced(Duration::ZERO, Duration::from_millis(50), 10).wait(),
        Duration::ZERO
    );
}

#[test]
fn a_burst_after_a_pause_is_back_at_its_own_pace_within_a_few_deliveries() {
    let delay = Duration::from_millis(20);
    let mut pace = paced(delay, Duration::from_millis(5), 10);
    let quiet_hour = tokio::time::Instant::now() + Duration::from_secs(3600);
    let delivered = || verdict_on(ObjectId::new(), Verdict::Delivered);
    pace.came(&delivered(), quiet_hour);
    // A pause counts as no longer than half the longest wait: without the
    // cap, an hour in the smoothed gap would stretch every mark of the
    // burst to the longest wait for dozens of deliveries.
    let stretched = pace.wait();
    assert!(
        delay < stretched && stretched < Duration::from_millis(50),
        "the pause stretches the next wait a little: {stretched:?}"
    );
    for i in 1..=6u32 {
        pace.came(&delivered(), quiet_hour + Duration::from_millis(5) * i);
    }
    assert_eq!(pace.wait(), delay, "six deliveries at 200 a second later");
}

#[test]
fn only_deliveries_set_the_pace() {
    let mut pace = paced(Duration::from_millis(20), Duration::from_millis(50), 4);
    let at = tokio::time::Instant::now() + Duration::from_secs(60);
    let refusal = Verdict::Refused {
        reason: "no".into(),
        own: true,
        maybe_stored: false,
    };
    pace.came(&verdict_on(ObjectId::new(), refusal), at);
    assert_eq!(
        pace.wait(),
        Duration::from_millis(100),
        "a refusal a minute later leaves the gap as it was"
    );
}
