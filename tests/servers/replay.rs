//! `outbox-relay replay`: delivered messages sent again, chosen by time,
//! type and key, into a new subject space, resumable, paced, and refused
//! with a clear message when asked wrongly.

use std::collections::HashMap;
use std::time::Duration;

use async_nats::jetstream;
use bson::{doc, oid::ObjectId, Document};

use crate::common::history::*;
use crate::common::*;

/// An ObjectId made `ago` before now, as a writer's driver then made it.
fn id_made(ago: Duration) -> ObjectId {
    let seconds = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .saturating_sub(ago)
        .as_secs();
    let mut bytes = ObjectId::new().bytes();
    bytes[..4].copy_from_slice(&u32::try_from(seconds).expect("a 32-bit time").to_be_bytes());
    ObjectId::from_bytes(bytes)
}

#[tokio::test]
async fn a_replay_by_time_and_type_into_a_new_prefix_sends_each_selected_message_once_in_key_order()
{
    // Three hours of history: types by the hour, five keys throughout.
    let mut written: Vec<(ObjectId, &str, String)> = Vec::new();
    for (hours_ago, message_type) in [
        (3, "order.placed"),
        (2, "order.placed"),
        (2, "order.paid"),
        (2, "invoice.sent"),
        (1, "order.paid"),
    ] {
        for n in 0..10 {
            let ago = Duration::from_secs(hours_ago * 3600 - 60 - n);
            let key = format!("k{}", n % 5);
            written.push((id_made(ago), message_type, key));
        }
    }
    written.sort_by_key(|(id, ..)| *id);
    // Written pending, and delivered by the relay first.
    let pending: Vec<Document> = written
        .iter()
        .map(|(id, message_type, key)| {
            let mut message = delivered(*id, message_type, key);
            message.insert("status", "pending");
            message.remove("processedAt");
            message
        })
        .collect();
    let mut history = History::of(pending).await;
    let (env, prefix) = (history.env.clone_handles(), history.prefix.clone());
    let relay = RunningRelay::start(env.config()).await;
    env.wait_count(doc! { "status": "processed" }, written.len() as u64)
        .await;
    relay.stop().await.expect("the relay stops");

    let output = bounded(history.replay(&[
        "--since",
        "150m",
        "--until",
        "90m",
        "--type",
        "order.*",
        "--replay-prefix",
        &prefix,
        "--json",
    ]))
    .await;
    assert_exit(&output, 0, "");
    let summary = summary(&output);
    let replay_id = summary["replay_id"].as_str().expect("an id").to_owned();

    // Two hours ago, orders only: placed and paid, not invoices.
    let two_hours = |id: &ObjectId| {
        let age = std::time::SystemTime::now()
            .duration_since(id.timestamp().to_system_time())
            .unwrap_or_default();
        age > Duration::from_secs(90 * 60) && age < Duration::from_secs(150 * 60)
    };
    let selected: Vec<&(ObjectId, &str, String)> = written
        .iter()
        .filter(|(id, message_type, _)| two_hours(id) && message_type.starts_with("order."))
        .collect();
    assert_eq!(selected.len(), 20);
    assert_eq!(summary["sent"], 20, "{summary}");
    assert_eq!(summary["skipped"], 0);

    let stored = history.stored().await;
    let replayed: Vec<String> = stored
        .iter()
        .map(|m| stored_header(m, "Outbox-Replay-Of").expect("the first delivery's id"))
        .collect();
    let mut once: HashMap<&str, usize> = HashMap::new();
    for id in &replayed {
        *once.entry(id).or_default() += 1;
    }
    assert_eq!(once.len(), 20, "each selected message, and only those");
    assert!(once.values().all(|n| *n == 1), "each once: {once:?}");
    for (id, _, _) in &selected {
        assert!(once.contains_key(id.to_hex().as_str()), "{id} replayed");
    }
    // Each key's messages in their first order (the `_id` order).
    let mut by_key: HashMap<String, Vec<String>> = HashMap::new();
    for message in &stored {
        let key = stored_header(message, "Outbox-Key").expect("a key");
        by_key
            .entry(key)
            .or_default()
            .push(stored_header(message, "Outbox-Replay-Of").unwrap_or_default());
    }
    for (key, ids) in &by_key {
        let mut sorted = ids.clone();
        sorted.sort();
        assert_eq!(ids, &sorted, "key {key} in order");
    }
    // The first delivery's body and headers, the replay's own beside them.
    let mut originals = env
        .jetstream
        .get_stream(&env.stream)
        .await
        .expect("the relay's stream");
    let first = stream_messages(&mut originals).await;
    let original = |id: &str| {
        first
            .iter()
            .find(|m| stored_header(m, "Nats-Msg-Id").as_deref() == Some(id))
            .expect("first delivered")
    };
    for message in &stored {
        let of = stored_header(message, "Outbox-Replay-Of").unwrap_or_default();
        let before = original(&of);
        assert_eq!(message.payload, before.payload);
        assert_eq!(
            message.subject.as_str(),
            format!("{prefix}.{}", before.subject)
        );
        assert_eq!(
            stored_header(message, "Nats-Msg-Id"),
            Some(format!("{of}:{replay_id}"))
        );
        assert_eq!(
            stored_header(message, "Outbox-Replay").as_deref(),
            Some(replay_id.as_str())
        );
        for name in ["Outbox-Type", "Outbox-Key", "Content-Type"] {
            assert_eq!(
                stored_header(message, name),
                stored_header(before, name),
                "{name}"
            );
        }
    }
    // A replay is not a redelivery: the messages are as they were.
    assert_eq!(
        env.count(doc! { "status": "processed" }).await,
        written.len() as u64
    );
    history.drop().await;
}

#[tokio::test]
async fn an_interrupted_replay_resumed_sends_the_rest_and_nothing_twice() {
    let mut history = History::delivered(300, 7).await;
    // Every publish, repeats included: the stream's duplicate window (an
    // hour) would hide a message sent again under its id.
    let mut published = Receiver {
        subscriber: history
            .env
            .nats
            .subscribe(format!("{}.>", history.prefix))
            .await
            .expect("subscribe to the replay's subjects"),
    };
    history
        .env
        .nats
        .flush()
        .await
        .expect("the subscription made");
    // Paced so that it is still running when it is stopped.
    let running = tokio::process::Command::from(history.replay_all(&["--rate", "100"]))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start the replay");
    let pid = running.id().expect("a pid").to_string();
    wait_until("the replay to send some", || {
        let mut stream = history.stream.clone();
        async move {
            let info = stream.info().await;
            info.is_ok_and(|info| info.state.messages >= 30)
        }
    })
    .await;
    // Two runs of one replay never send at once.
    let records = history.env.db.collection::<Document>("outbox_replays");
    let running_id = records
        .find_one(doc! {})
        .await
        .expect("read the record")
        .and_then(|record| record.get_str("_id").ok().map(str::to_owned))
        .expect("the running replay's record");
    let twice = bounded(history.replay(&["--resume", &running_id])).await;
    assert_exit(&twice, 2, "running in another process");
    let interrupted = std::process::Command::new("kill")
        .args(["-INT", &pid])
        .status();
    assert!(interrupted.is_ok_and(|s| s.success()), "send SIGINT");
    let output = tokio::time::timeout(WAIT, running.wait_with_output())
        .await
        .expect("the replay stops")
        .expect("its output");
    assert_exit(&output, 130, "");
    let first = summary(&output);
    assert_eq!(first["state"], "stopped");
    let sent_first = first["sent"].as_u64().expect("a count");
    assert!(sent_first < 300, "stopped before the end: {first}");
    let replay_id = first["replay_id"].as_str().expect("an id").to_owned();

    let output = bounded(history.replay(&["--resume", &replay_id, "--json"])).await;
    assert_exit(&output, 0, "");
    let rest = summary(&output);
    assert_eq!(rest["state"], "done");
    assert_eq!(
        rest["sent"], 300,
        "the record counts the whole replay: {rest}"
    );

    let ids: Vec<String> = history
        .stored()
        .await
        .iter()
        .filter_map(|m| stored_header(m, "Outbox-Replay-Of"))
        .collect();
    let distinct: std::collections::HashSet<&String> = ids.iter().collect();
    assert_eq!(distinct.len(), 300, "every message");
    assert_eq!(ids.len(), 300, "none twice");
    // A stop answered by Ctrl-C waits for the answers to what it sent and
    // records them (docs/replay.md), so the resumed run sends each of the
    // rest, and nothing the first one sent: every message is published
    // exactly once.
    let publishes = published.drain_delivered(&history.env.nats).await;
    let mut times: HashMap<String, usize> = HashMap::new();
    for message in &publishes {
        let of = header(message, "Outbox-Replay-Of").expect("a replayed message");
        *times.entry(of).or_default() += 1;
    }
    assert_eq!(times.len(), 300, "every message published");
    let repeated: Vec<_> = times.iter().filter(|(_, &n)| n != 1).collect();
    assert!(
        repeated.is_empty(),
        "published more than once: {repeated:?}"
    );

    // Done is done: resuming again is refused.
    let again = bounded(history.replay(&["--resume", &replay_id])).await;
    assert_exit(&again, 2, "is done");
    history.drop().await;
}

/// The server's clock, which judges replay holds.
async fn server_time(env: &TestEnv) -> bson::DateTime {
    let hello = env
        .client
        .database("admin")
        .run_command(doc! { "hello": 1 })
        .await
        .expect("hello");
    *hello.get_datetime("localTime").expect("the server's time")
}

#[tokio::test]
async fn a_run_whose_replay_another_takes_over_stops_with_exit_1_and_says_so() {
    let mut history = History::delivered(300, 7).await;
    // Paced so that it is still running when its replay is taken.
    let running = tokio::process::Command::from(history.replay_all(&["--rate", "50"]))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start the replay");
    wait_until("the replay to send some", || {
        let mut stream = history.stream.clone();
        async move {
            let info = stream.info().await;
            info.is_ok_and(|info| info.state.messages >= 10)
        }
    })
    .await;
    // What another run does when this one's hold has lapsed.
    let held_until =
        bson::DateTime::from_millis(server_time(&history.env).await.timestamp_millis() + 3_600_000);
    let records = history.env.db.collection::<Document>("outbox_replays");
    let taken = records
        .update_one(
            doc! {},
            doc! { "$set": { "owner": "elsewhere/1/another", "heldUntil": held_until } },
        )
        .await
        .expect("take the replay over");
    assert_eq!(taken.modified_count, 1);
    let output = tokio::time::timeout(WAIT, running.wait_with_output())
        .await
        .expect("the run stops")
        .expect("its output");
    // Not a bad setting, and nothing for this user to resume: the other
    // run goes on.
    assert_exit(&output, 1, "taken over by another run");
    let text = output_text(&output);
    assert!(
        text.contains("elsewhere/1/another"),
        "names the other run: {text}"
    );
    assert!(text.contains("nothing to resume"), "{text}");
    assert!(!text.contains("--resume"), "{text}");
    let record = records
        .find_one(doc! {})
        .await
        .expect("read")
        .expect("recorded");
    assert_eq!(
        record.get_str("owner"),
        Ok("elsewhere/1/another"),
        "{record}"
    );
    assert_eq!(
        record.get_str("state"),
        Ok("running"),
        "left to the other run: {record}"
    );
    assert!(history.count().await < 300);
    history.drop().await;
}

#[tokio::test]
async fn a_replays_hold_is_judged_on_the_servers_clock() {
    // The server's clock an hour ahead of this host's: a hold that lapsed
    // a minute ago by the server's clock is 59 minutes off by the host's.
    let mongo = MongoProcess::start_ahead(Duration::from_secs(3600)).await;
    let env = TestEnv::on(&mongo.uri(), &nats_url()).await;
    let messages: Vec<Document> = (0..100)
        .map(|n| delivered(ObjectId::new(), "order.placed", &format!("k{}", n % 5)))
        .collect();
    env.outbox().insert_many(messages).await.expect("insert");
    let history = History::on(env).await;
    let running = tokio::process::Command::from(history.replay_all(&["--rate", "50"]))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start the replay");
    let pid = running.id().expect("a pid").to_string();
    wait_until("the replay to send some", || {
        let mut stream = history.stream.clone();
        async move {
            let info = stream.info().await;
            info.is_ok_and(|info| info.state.messages >= 5)
        }
    })
    .await;
    let interrupted = std::process::Command::new("kill")
        .args(["-INT", &pid])
        .status();
    assert!(interrupted.is_ok_and(|s| s.success()), "send SIGINT");
    let output = tokio::time::timeout(WAIT, running.wait_with_output())
        .await
        .expect("the replay stops")
        .expect("its output");
    assert_exit(&output, 130, "");
    let replay_id = summary(&output)["replay_id"]
        .as_str()
        .expect("an id")
        .to_owned();
    let records = history.env.db.collection::<Document>("outbox_replays");
    // The history's commands name the skewed server.
    let resume = || bounded(history.replay(&["--resume", &replay_id, "--json"]));
    // As another run left it: held for a minute more, by the server's clock.
    let now = server_time(&history.env).await.timestamp_millis();
    let held = |until: i64| {
        doc! { "$set": {
            "state": "running", "owner": "elsewhere/1/another",
            "heldUntil": bson::DateTime::from_millis(until),
        } }
    };
    records
        .update_one(doc! { "_id": &replay_id }, held(now + 60_000))
        .await
        .expect("hold the replay");
    assert_exit(&resume().await, 2, "running in another process");
    // Its run crashed a minute ago, by the server's clock.
    records
        .update_one(doc! { "_id": &replay_id }, held(now - 60_000))
        .await
        .expect("let the hold lapse");
    let output = resume().await;
    assert_exit(&output, 0, "");
    assert_eq!(summary(&output)["state"], "done");
    history.drop().await;
}

#[tokio::test]
async fn a_message_the_stream_refuses_is_skipped_and_the_rest_sent() {
    let env = TestEnv::new().await;
    let mut messages: Vec<Document> = (0..20)
        .map(|n| delivered(ObjectId::new(), "order.placed", &format!("k{}", n % 3)))
        .collect();
    let large = ObjectId::new();
    let mut too_large = delivered(large, "order.placed", "k0");
    too_large.insert("payload", "x".repeat(4000));
    messages.insert(7, too_large);
    env.outbox().insert_many(messages).await.expect("insert");
    let mut history = History::with_largest(env, 2000).await;
    let output = bounded(history.replay_all(&[])).await;
    assert_exit(&output, 0, "");
    let summary = summary(&output);
    assert_eq!(
        (summary["sent"].as_u64(), summary["skipped"].as_u64()),
        (Some(20), Some(1))
    );
    assert!(
        output_text(&output).contains(&large.to_hex()),
        "the skipped one is named"
    );
    assert_eq!(history.count().await, 20);
    history.drop().await;
}

#[tokio::test]
async fn a_subject_nats_denies_stops_the_replay_to_be_resumed() {
    let history = History::delivered(5, 5).await;
    let prefix = &history.prefix;
    let nats = NatsProcess::start_with(
        &format!(
            "authorization {{ users: [ {{ user: relay, password: secret, permissions: \
             {{ publish: {{ allow: [\">\"], deny: [\"{prefix}.>\"] }} }} }} ] }}"
        ),
        Some("relay"),
    )
    .await;
    let client = connect_nats(&nats.url()).await.expect("connect");
    jetstream::new(client)
        .create_stream(jetstream::stream::Config {
            name: prefix.to_uppercase(),
            subjects: vec![format!("{prefix}.>")],
            ..Default::default()
        })
        .await
        .expect("the replay's stream");
    let mut command = history.replay_all(&[]);
    command
        .env("OUTBOX_NATS_URL", nats.url())
        .env("OUTBOX_ACK_TIMEOUT", "300ms");
    // No message under the prefix would pass: not skipped one by one, but
    // stopped, resumable once the permission is given.
    let output = bounded(command).await;
    assert_exit(&output, 1, "permission denied");
    assert!(
        output_text(&output).contains("--resume"),
        "says how to resume"
    );
    let records = history.env.db.collection::<Document>("outbox_replays");
    let record = records
        .find_one(doc! {})
        .await
        .expect("read")
        .expect("recorded");
    assert_eq!(record.get_str("state"), Ok("stopped"), "{record}");
    history.drop().await;
}

#[tokio::test]
async fn a_rate_holds_the_replay_to_that_many_messages_a_second() {
    let history = History::delivered(40, 40).await;
    let output = bounded(history.replay_all(&["--rate", "20"])).await;
    assert_exit(&output, 0, "");
    let summary = summary(&output);
    assert_eq!(summary["sent"], 40);
    // Forty at twenty a second: the last goes 39 twentieths after the first.
    let seconds = summary["seconds"].as_f64().expect("a duration");
    assert!(seconds >= 1.95, "paced: {seconds} s");
    history.drop().await;
}

#[tokio::test]
async fn bad_input_is_explained_with_exit_2_and_nothing_is_sent() {
    let mut history = History::delivered(1, 1).await;
    let cases: [(&[&str], &str); 12] = [
        (&["--since", "yesterday"], "RFC 3339"),
        (&["--since", "1h", "--until", "2h"], "is not before --until"),
        (&["--since", "2206-01-01T00:00:00Z"], "is in the future"),
        (&["--all", "--rate", "0.001"], "at least one a minute"),
        (&["--subject", "nomatch.>"], "matches no delivered message"),
        (&["--type", "order.*.late"], "matches no delivered message"),
        (&["--type", "order..placed"], "--type"),
        (&["--subject", "a.>.b"], "--subject"),
        (&["--all", "--replay-prefix", "$JS.API"], "reserved"),
        (
            &["--all", "--replay-prefix", "elsewhere"],
            "--allow-subject",
        ),
        (&["--type", "invoice.*"], "matches no delivered message"),
        (&[], "--all"),
    ];
    for (args, saying) in cases {
        let output = bounded(history.replay(args)).await;
        assert_exit(&output, 2, saying);
    }
    let mut missing = history.replay(&["--all"]);
    missing.env("OUTBOX_COLLECTION", "no_such_outbox");
    assert_exit(&bounded(missing).await, 2, "no outbox collection");
    assert_eq!(history.count().await, 0, "nothing sent");
    let records = history.env.db.collection::<Document>("outbox_replays");
    let recorded = records.count_documents(doc! {}).await.expect("count");
    assert_eq!(recorded, 0, "no replay recorded");
    history.drop().await;
}

#[tokio::test]
async fn a_replay_beside_a_running_relay_leaves_live_delivery_whole() {
    let mut history = History::delivered(3000, 50).await;
    let env = history.env.clone_handles();
    let relay = RunningRelay::start(env.config()).await;
    // The history's type only: the live messages, delivered meanwhile, are
    // not replayed.
    let prefix = history.prefix.clone();
    let args = [
        "--type",
        "order.placed",
        "--replay-prefix",
        &prefix,
        "--json",
    ];
    let replaying = bounded_for(history.replay(&args), Duration::from_secs(300));
    let writing = async {
        let mut live = Vec::new();
        for n in 0..100 {
            live.push(env.insert_keyed(&format!("live{}", n % 10), 10).await);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        live
    };
    let (output, live) = tokio::join!(replaying, writing);
    assert_exit(&output, 0, "");
    assert_eq!(summary(&output)["sent"], 3000);
    for id in &live {
        env.wait_count(doc! { "_id": id, "status": "processed" }, 1)
            .await;
    }
    let first = env.stored().await;
    for id in &live {
        let copies = first.iter().filter(|m| m.id == id.to_hex()).count();
        assert_eq!(copies, 1, "live message {id} delivered once");
    }
    assert_eq!(history.count().await, 3000);
    relay.stop().await.expect("the relay stops");
    history.drop().await;
}
