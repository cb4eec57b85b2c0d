//! The key states and their moves, without a broker or a database.

use std::time::Duration;

use bson::{oid::ObjectId, Bson, DateTime};

use super::*;

fn order(held: Vec<HeldKey>, dead_letters: DeadLetters) -> KeyOrder {
    KeyOrder::new(held, dead_letters, true, Metrics::new())
}

/// An ObjectId named `name`: ids sort as their names do.
fn oid(name: &str) -> ObjectId {
    let mut bytes = [0u8; 12];
    bytes[..4].copy_from_slice(&1_700_000_000u32.to_be_bytes());
    for (slot, byte) in bytes[4..].iter_mut().zip(name.bytes()) {
        *slot = byte;
    }
    ObjectId::from_bytes(bytes)
}

fn id(name: &str) -> Bson {
    Bson::ObjectId(oid(name))
}

const SEND: Option<()> = None;
const PARK: Option<()> = Some(());

/// Lets a message in, waits its turn, and sends or parks it.
async fn admit(order: &KeyOrder, key: &str, name: &str, release: bool) -> Admission {
    let mut turn = order.enter(key, &id(name), release);
    tokio::time::timeout(Duration::from_secs(5), turn.wait())
        .await
        .expect("the turn before ends");
    turn.admit()
}

/// The turn of a message that goes, as it should, `why`.
fn sent(admission: Admission, why: &str) -> Turn {
    match admission {
        Admission::Send(turn) => turn,
        Admission::Park(_) => panic!("parked, though {why}"),
    }
}

/// The ticket of a message parked, as it should be, `why`.
fn parked_ticket(admission: Admission, why: &str) -> ParkTicket {
    match admission {
        Admission::Send(_) => panic!("sent, though {why}"),
        Admission::Park(ticket) => ticket,
    }
}

/// Lets go of `name`'s hold on `key`, as a check that found it settled.
fn let_go(order: &KeyOrder, key: &str, name: &str) {
    let version = order
        .holders()
        .into_iter()
        .find(|(k, _, _)| k == key)
        .map_or(0, |(_, _, version)| version);
    order.let_go_of(key, &id(name), version);
}

/// The holders, without their versions.
fn holders(order: &KeyOrder) -> Vec<(String, Bson)> {
    let holders = order.holders().into_iter();
    holders.map(|(key, id, _)| (key, id)).collect()
}

/// Whether the message was parked. The admission goes with the answer:
/// a message sent is left unanswered, and its turn, dropped, holds its key.
fn parked(admission: Admission) -> Option<()> {
    matches!(admission, Admission::Park(_)).then_some(())
}

/// The kind of each held key.
fn kinds(order: &KeyOrder) -> std::collections::HashMap<String, HoldKind> {
    order
        .held()
        .into_iter()
        .map(|(key, _, kind)| (key, kind))
        .collect()
}

#[tokio::test]
async fn a_held_key_admits_its_holder_and_parks_the_rest_until_released() {
    let order = order(Vec::new(), DeadLetters::Release);
    let turn = sent(admit(&order, "k", "m1", false).await, "it may go");
    turn.finish(Outcome::Refused);
    assert_eq!(parked(admit(&order, "k", "m2", false).await), PARK);
    assert_eq!(
        parked(admit(&order, "other", "o1", false).await),
        SEND,
        "other keys go on"
    );

    let turn = sent(
        admit(&order, "k", "m1", false).await,
        "the holder's retry goes",
    );
    turn.finish(Outcome::Delivered);
    assert_eq!(order.held()[0].2, HoldKind::Releasing);
    assert_eq!(
        parked(admit(&order, "k", "m3", false).await),
        PARK,
        "newer messages wait for the parked"
    );
    assert_eq!(
        parked(admit(&order, "k", "m2", true).await),
        SEND,
        "parked messages are released"
    );
}

#[tokio::test]
async fn a_releasing_key_is_free_only_once_every_park_is_written_and_read() {
    let order = order(Vec::new(), DeadLetters::Release);
    let turn = sent(admit(&order, "k", "m1", false).await, "it may go");
    turn.finish(Outcome::Refused);
    let ticket = parked_ticket(admit(&order, "k", "m2", false).await, "its key is held");
    let_go(&order, "k", "m1");

    // A read that began before m2's park was written proves nothing.
    let before = order.releasing(10)[0].1;
    drop(ticket);
    assert!(!order.released("k", before));
    assert_eq!(order.held().len(), 1, "m2 may not have been seen");

    let before = order.releasing(10)[0].1;
    assert!(order.released("k", before));
    assert!(order.held().is_empty(), "nothing parked is left unread");

    // A park decided while a read ran keeps the key.
    let turn = sent(admit(&order, "k", "m3", false).await, "it may go");
    turn.finish(Outcome::Refused);
    let_go(&order, "k", "m3");
    let before = order.releasing(10)[0].1;
    let ticket = parked_ticket(admit(&order, "k", "m4", false).await, "its key is held");
    drop(ticket);
    assert!(!order.released("k", before));
    assert_eq!(order.held().len(), 1);
}

#[tokio::test]
async fn a_dead_letter_releases_its_key_or_holds_it() {
    let release = order(Vec::new(), DeadLetters::Release);
    let turn = sent(admit(&release, "k", "m1", false).await, "it may go");
    turn.finish(Outcome::Refused);
    release.dead_letter("k", &id("m1"), false);
    assert_eq!(release.held()[0].2, HoldKind::Releasing);

    let hold = order(Vec::new(), DeadLetters::Hold);
    let turn = sent(admit(&hold, "k", "m1", false).await, "it may go");
    turn.finish(Outcome::Failed);
    assert_eq!(hold.held()[0].2, HoldKind::DeadLetter);
    assert_eq!(parked(admit(&hold, "k", "m2", false).await), PARK);
    let_go(&hold, "k", "m1");
    assert_eq!(
        hold.held()[0].2,
        HoldKind::Releasing,
        "replayed or discarded"
    );
}

fn stored(key: &str, holders: &[(&str, bool)], parked: u64) -> HeldKey {
    HeldKey {
        key: key.to_owned(),
        holders: holders
            .iter()
            .map(|(name, dead_letter)| Holder {
                id: oid(name),
                dead_letter: *dead_letter,
            })
            .collect(),
        parked,
        since: DateTime::now(),
    }
}

#[tokio::test]
async fn a_new_term_starts_from_the_holds_the_collection_records() {
    let held = vec![
        stored("retrying", &[("r1", false)], 1),
        stored("dead", &[("d1", true)], 1),
        stored("dead, nothing parked", &[("d1", true)], 0),
        stored("parked", &[], 1),
    ];
    let order = order(held.clone(), DeadLetters::Release);
    let found = kinds(&order);
    assert_eq!(found["retrying"], HoldKind::Retrying);
    assert_eq!(
        found["dead"],
        HoldKind::Releasing,
        "release mode lets dead letters go"
    );
    assert!(!found.contains_key("dead, nothing parked"));
    assert_eq!(found["parked"], HoldKind::Releasing);
    assert_eq!(parked(admit(&order, "retrying", "zz", false).await), PARK);

    let hold = KeyOrder::new(held, DeadLetters::Hold, true, Metrics::new());
    assert_eq!(kinds(&hold)["dead"], HoldKind::DeadLetter);
}

#[tokio::test]
async fn a_key_with_two_holders_releases_only_once_both_have_gone() {
    let order = order(Vec::new(), DeadLetters::Release);
    let turn = sent(admit(&order, "k", "m2", false).await, "it may go");
    turn.finish(Outcome::Refused);
    // An older message turns up (a replay, say): it came first, so it goes,
    // and it is refused too.
    let turn = sent(admit(&order, "k", "m1", false).await, "it came first");
    turn.finish(Outcome::Refused);
    assert_eq!(holders(&order).len(), 2);

    let_go(&order, "k", "m1");
    assert_eq!(order.held()[0].2, HoldKind::Retrying, "m2 still holds");
    assert!(order.releasing(10).is_empty());
    assert_eq!(parked(admit(&order, "k", "m3", false).await), PARK);
    let turn = sent(admit(&order, "k", "m2", false).await, "a holder goes");
    turn.finish(Outcome::Delivered);
    assert_eq!(order.held()[0].2, HoldKind::Releasing);
}

#[tokio::test]
async fn a_turn_dropped_without_an_answer_lets_the_next_wait_end_but_holds_its_key() {
    let order = order(Vec::new(), DeadLetters::Release);
    // Sent and never answered, or never sent though its turn had come:
    // either way it may not be overtaken.
    let first = order.enter("k", &id("m1"), false);
    let mut second = order.enter("k", &id("m2"), false);
    assert!(!second.first());
    drop(first);
    tokio::time::timeout(Duration::from_secs(5), second.wait())
        .await
        .expect("the wait ends once the turn before is dropped");
    assert!(matches!(second.admit(), Admission::Park(_)));
    assert_eq!(holders(&order), [("k".to_owned(), id("m1"))]);

    let turn = sent(admit(&order, "k", "m1", false).await, "it may go");
    turn.finish(Outcome::Delivered);
    assert_eq!(order.held()[0].2, HoldKind::Releasing);
}

#[tokio::test]
async fn a_parked_turn_passes_the_key_on_without_holding_it() {
    let order = order(Vec::new(), DeadLetters::Release);
    let turn = sent(admit(&order, "k", "m1", false).await, "it may go");
    turn.finish(Outcome::Refused);
    let ticket = parked_ticket(admit(&order, "k", "m2", false).await, "its key is held");
    let mut next = order.enter("k", &id("m3"), false);
    assert!(next.first(), "nothing of k is on the wire");
    drop(ticket);
    assert_eq!(holders(&order), [("k".to_owned(), id("m1"))]);
}

#[tokio::test]
async fn only_an_object_id_holds_a_key() {
    let order = order(Vec::new(), DeadLetters::Hold);
    let turn = order.enter("k", &Bson::String("not an ObjectId".into()), false);
    let turn = sent(turn.admit(), "its key is free");
    turn.finish(Outcome::Failed);
    assert!(
        order.held().is_empty(),
        "no `_id` order could place it again"
    );
}

#[tokio::test]
async fn holds_found_later_are_adopted_for_keys_not_held_already() {
    let order = order(Vec::new(), DeadLetters::Release);
    let turn = sent(admit(&order, "known", "k1", false).await, "it may go");
    turn.finish(Outcome::Refused);
    let adopted = order.adopt(vec![
        stored("known", &[("k0", false)], 3),
        stored("stranded", &[], 2),
    ]);
    assert_eq!(adopted, 1);
    assert_eq!(
        holders(&order),
        [("known".to_owned(), id("k1"))],
        "a key held already keeps what this relay knows of it"
    );
    assert_eq!(kinds(&order)["stranded"], HoldKind::Releasing);
    assert_eq!(order.releasing(10)[0].0, "stranded");
}

#[tokio::test]
async fn a_check_lets_go_of_no_holder_taken_on_again_since_it_read() {
    let order = order(Vec::new(), DeadLetters::Release);
    let turn = sent(admit(&order, "k", "m1", false).await, "it may go");
    turn.finish(Outcome::Refused);
    let (_, _, read_at) = order.holders().remove(0);
    // Another copy of m1 is refused after the check read the collection.
    let turn = sent(admit(&order, "k", "m1", false).await, "it may go");
    turn.finish(Outcome::Refused);
    order.let_go_of("k", &id("m1"), read_at);
    assert_eq!(holders(&order), [("k".to_owned(), id("m1"))]);
    let_go(&order, "k", "m1");
    assert_eq!(order.held()[0].2, HoldKind::Releasing);
}

#[tokio::test]
async fn stored_holds_are_in_place_when_the_wait_for_them_ends_and_win_over_a_stop() {
    let unread = KeyOrder::unread(DeadLetters::Release, true, Metrics::new());
    assert!(!unread.stored_holds_adopted());
    assert!(
        !unread.stored_holds_before(std::future::ready(())).await,
        "a stop ends the wait for holds not yet read"
    );
    let waiting = tokio::spawn({
        let order = unread.clone();
        async move {
            let known = order.stored_holds_before(std::future::pending()).await;
            (known, order.holders().len())
        }
    });
    unread.adopt_stored(vec![stored("a", &[("a1", false)], 0)]);
    let (known, holders) = tokio::time::timeout(Duration::from_secs(60), waiting)
        .await
        .expect("the wait ends once the holds are taken on")
        .expect("the waiting task ends cleanly");
    assert!(known);
    assert_eq!(holders, 1, "the holds are in place when the wait ends");
    assert!(unread.stored_holds_adopted());
    assert!(
        unread.stored_holds_before(std::future::ready(())).await,
        "holds known win over a stop that came at the same time"
    );
}
