//! The key states and their moves, without a broker or a database.

use bson::{oid::ObjectId, Bson, DateTime};

use super::*;

fn order(held: Vec<HeldKey>, dead_letters: DeadLetters) -> KeyOrder {
    KeyOrder::new(held, dead_letters, true, Metrics::new())
}

fn id(name: &str) -> Bson {
    Bson::String(name.to_owned())
}

const SEND: Option<()> = None;
const PARK: Option<()> = Some(());

/// Lets a message in, waits its turn, and says whether it may go: the
/// park's ticket if it is parked.
async fn admit(
    order: &KeyOrder,
    key: &str,
    name: &str,
    release: bool,
) -> (Turn, Option<ParkTicket>) {
    let mut turn = order.enter(key, &id(name), release);
    turn.wait().await;
    match turn.admit() {
        Admission::Send => (turn, None),
        Admission::Park(ticket) => (turn, Some(ticket)),
    }
}

fn parked(ticket: &Option<ParkTicket>) -> Option<()> {
    ticket.as_ref().map(|_| ())
}

#[tokio::test]
async fn a_held_key_admits_its_holder_and_parks_the_rest_until_released() {
    let order = order(Vec::new(), DeadLetters::Release);
    let (turn, admission) = admit(&order, "k", "m1", false).await;
    assert_eq!(parked(&admission), SEND);
    turn.finish(Outcome::Refused);
    let (_, admission) = admit(&order, "k", "m2", false).await;
    assert_eq!(parked(&admission), PARK);
    let (_, admission) = admit(&order, "other", "o1", false).await;
    assert_eq!(parked(&admission), SEND, "other keys go on");

    let (turn, admission) = admit(&order, "k", "m1", false).await;
    assert_eq!(parked(&admission), SEND, "the holder's retry goes");
    turn.finish(Outcome::Delivered);
    assert_eq!(order.held()[0].2, HoldKind::Releasing);
    let (_, admission) = admit(&order, "k", "m3", false).await;
    assert_eq!(
        parked(&admission),
        PARK,
        "newer messages wait for the parked"
    );
    let (_, admission) = admit(&order, "k", "m2", true).await;
    assert_eq!(parked(&admission), SEND, "parked messages are released");
}

#[tokio::test]
async fn a_releasing_key_is_free_only_once_every_park_is_written_and_read() {
    let order = order(Vec::new(), DeadLetters::Release);
    let (turn, _) = admit(&order, "k", "m1", false).await;
    turn.finish(Outcome::Refused);
    let (_, ticket) = admit(&order, "k", "m2", false).await;
    assert_eq!(parked(&ticket), PARK);
    order.let_go_of("k", &id("m1"));

    // A read that began before m2's park was written proves nothing.
    let before = order.releasing(10)[0].1;
    drop(ticket);
    assert!(!order.released("k", before));
    assert_eq!(order.held().len(), 1, "m2 may not have been seen");

    let before = order.releasing(10)[0].1;
    assert!(order.released("k", before));
    assert!(order.held().is_empty(), "nothing parked is left unread");

    // A park decided while a read ran keeps the key.
    let (turn, _) = admit(&order, "k", "m3", false).await;
    turn.finish(Outcome::Refused);
    order.let_go_of("k", &id("m3"));
    let before = order.releasing(10)[0].1;
    let (_, ticket) = admit(&order, "k", "m4", false).await;
    assert_eq!(parked(&ticket), PARK);
    drop(ticket);
    assert!(!order.released("k", before));
    assert_eq!(order.held().len(), 1);
}

#[tokio::test]
async fn a_dead_letter_releases_its_key_or_holds_it() {
    let release = order(Vec::new(), DeadLetters::Release);
    let (turn, _) = admit(&release, "k", "m1", false).await;
    turn.finish(Outcome::Refused);
    release.dead_letter("k", &id("m1"));
    assert_eq!(release.held()[0].2, HoldKind::Releasing);

    let hold = order(Vec::new(), DeadLetters::Hold);
    let (turn, _) = admit(&hold, "k", "m1", false).await;
    turn.finish(Outcome::Failed);
    assert_eq!(hold.held()[0].2, HoldKind::DeadLetter);
    let (_, admission) = admit(&hold, "k", "m2", false).await;
    assert_eq!(parked(&admission), PARK);
    hold.let_go_of("k", &id("m1"));
    assert_eq!(
        hold.held()[0].2,
        HoldKind::Releasing,
        "replayed or discarded"
    );
}

#[tokio::test]
async fn a_new_term_starts_from_the_holds_the_collection_records() {
    let holder = Bson::ObjectId(ObjectId::new());
    let stored = |key: &str, holder: Option<Bson>, dead_letter: bool| HeldKey {
        key: key.to_owned(),
        holder,
        dead_letter,
        parked: 1,
        since: DateTime::now(),
    };
    let held = vec![
        stored("retrying", Some(holder.clone()), false),
        stored("dead", Some(holder.clone()), true),
        stored("parked", None, false),
    ];
    let order = order(held, DeadLetters::Release);
    let kinds: std::collections::HashMap<String, HoldKind> = order
        .held()
        .into_iter()
        .map(|(k, _, kind)| (k, kind))
        .collect();
    assert_eq!(kinds["retrying"], HoldKind::Retrying);
    assert_eq!(
        kinds["dead"],
        HoldKind::Releasing,
        "release mode lets dead letters go"
    );
    assert_eq!(kinds["parked"], HoldKind::Releasing);
    let (_, admission) = admit(&order, "retrying", "later", false).await;
    assert_eq!(parked(&admission), PARK);
}

#[tokio::test]
async fn a_turn_dropped_lets_the_next_message_of_its_key_go() {
    let order = order(Vec::new(), DeadLetters::Release);
    let first = order.enter("k", &id("m1"), false);
    let mut second = order.enter("k", &id("m2"), false);
    assert!(!second.first());
    drop(first);
    tokio::time::timeout(std::time::Duration::from_secs(5), second.wait())
        .await
        .expect("the wait ends once the turn before is dropped");
    assert!(matches!(second.admit(), Admission::Send));
}

#[tokio::test]
async fn a_message_older_than_the_holder_goes_and_a_sent_turn_dropped_holds_its_key() {
    let order = order(Vec::new(), DeadLetters::Release);
    let (older, holder) = (ObjectId::new(), ObjectId::new());
    let mut turn = order.enter("k", &Bson::ObjectId(holder), false);
    turn.sent();
    turn.finish(Outcome::Refused);
    let mut turn = order.enter("k", &Bson::ObjectId(older), false);
    turn.wait().await;
    assert!(
        matches!(turn.admit(), Admission::Send),
        "it came first: stored already, or it must go first"
    );
    drop(turn);

    let mut unsettled = order.enter("u", &id("u1"), false);
    unsettled.sent();
    drop(unsettled);
    let (_, ticket) = admit(&order, "u", "u2", false).await;
    assert_eq!(parked(&ticket), PARK, "u1 may yet be stored");
}
