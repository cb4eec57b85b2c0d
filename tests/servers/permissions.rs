//! The roles docs/configuration.md gives the relay's users, against a
//! server that enforces them: with exactly the documented privileges every
//! command works, and a user missing one fails with a message naming the
//! action and where it is needed, never a hang or a raw driver error.
//!
//! The roles are read from the guide itself, so the two cannot drift.
//! SecantusDB judges a privilege by database, not by collection, and
//! checks neither `changeStream` nor `collStats` on an aggregation
//! (docs/developing.md, SecantusDB): an action is taken away here from
//! every collection at once, and those two are not tried.

use std::process::Output;

use bson::{doc, Bson, Document};
use mongodb::Database;

use crate::common::{
    assert_exit, bounded, nats_url, output_text as text, relay_command, wait_until, MongoProcess,
    RelayProcess, TestEnv,
};

const GUIDE: &str = include_str!("../../docs/configuration.md");

/// The database the guide's roles are written for.
const GUIDE_DATABASE: &str = "shop";

const PASSWORD: &str = "pw-of-relay";

/// Each `createRole({...})` the guide shows, as the document it passes.
fn documented_roles() -> Vec<Document> {
    GUIDE
        .split("createRole(")
        .skip(1)
        .map(|call| {
            let end = call.find("\n})").expect("a createRole call ends with })");
            let role: serde_json::Value =
                serde_json::from_str(&call[..end + 2]).expect("a role in JSON");
            bson::to_document(&role).expect("a role as BSON")
        })
        .collect()
}

/// The guide's role `name`, for `database` instead of the guide's.
fn documented_role(name: &str, database: &str) -> Document {
    let mut role = documented_roles()
        .into_iter()
        .find(|role| role.get_str("role") == Ok(name))
        .unwrap_or_else(|| panic!("docs/configuration.md gives no role {name}"));
    for privilege in privileges(&mut role) {
        let resource = privilege
            .get_document_mut("resource")
            .expect("a privilege's resource");
        if resource.get_str("db") == Ok(GUIDE_DATABASE) {
            resource.insert("db", database);
        }
    }
    role
}

fn privileges(role: &mut Document) -> impl Iterator<Item = &mut Document> {
    role.get_array_mut("privileges")
        .expect("a role's privileges")
        .iter_mut()
        .map(|privilege| match privilege {
            Bson::Document(privilege) => privilege,
            other => panic!("a privilege is a document: {other}"),
        })
}

/// `role` without `action`, on every resource, under its own name.
fn without(mut role: Document, action: &str) -> Document {
    for privilege in privileges(&mut role) {
        let actions = privilege
            .get_array_mut("actions")
            .expect("a privilege's actions");
        actions.retain(|granted| granted.as_str() != Some(action));
    }
    role.insert("role", format!("without_{action}"));
    role
}

/// A private SecantusDB requiring users, a test's corner of it, and the
/// users holding the given roles, each named after its role.
struct Secured {
    mongo: MongoProcess,
    env: TestEnv,
    /// The test's database, as `root` sees it.
    db: Database,
}

impl Secured {
    /// `roles` gives the roles for the test's database.
    async fn start(roles: impl Fn(&str) -> Vec<Document>) -> Self {
        let mut mongo = MongoProcess::start_with(&[]).await;
        // The collections, the sweep index and the stream, made before
        // the server asks who is there.
        let env = TestEnv::on(&mongo.uri(), &nats_url()).await;
        let admin = env.client.database("admin");
        admin
            .run_command(doc! { "createUser": "root", "pwd": PASSWORD, "roles": ["root"] })
            .await
            .expect("create the administrator");
        for role in roles(&env.name) {
            let name = role.get_str("role").expect("a role's name").to_owned();
            let mut create = doc! { "createRole": &name };
            create.extend(role.into_iter().filter(|(key, _)| key != "role"));
            admin.run_command(create).await.expect("create a role");
            admin
                .run_command(doc! {
                    "createUser": &name, "pwd": PASSWORD,
                    "roles": [{ "role": &name, "db": "admin" }],
                })
                .await
                .expect("create a user of the role");
        }
        mongo.stop();
        mongo.extra = vec!["--auth".into()];
        mongo.restart().await;
        let root = mongodb::Client::with_uri_str(uri(&mongo, "root"))
            .await
            .expect("a client for root");
        let db = root.database(&env.name);
        Secured { mongo, env, db }
    }

    /// Runs the relay with `args` as `user`.
    async fn relay(&self, user: &str, args: &[&str]) -> Output {
        let mut command = relay_command(&self.env);
        command
            .env("OUTBOX_MONGODB_URI", uri(&self.mongo, user))
            .args(args);
        bounded(command).await
    }

    async fn insert_pending(&self) -> bson::oid::ObjectId {
        let id = bson::oid::ObjectId::new();
        self.db
            .collection::<Document>("outbox")
            .insert_one(doc! {
                "_id": id, "type": "order.placed", "key": "k", "payload": { "n": 1 },
                "status": "pending",
            })
            .await
            .expect("insert a message");
        id
    }

    async fn status_of(&self, id: bson::oid::ObjectId) -> Option<String> {
        self.db
            .collection::<Document>("outbox")
            .find_one(doc! { "_id": id })
            .await
            .ok()
            .flatten()
            .and_then(|message| message.get_str("status").ok().map(str::to_owned))
    }
}

fn uri(mongo: &MongoProcess, user: &str) -> String {
    format!(
        "mongodb://{user}:{PASSWORD}@127.0.0.1:{}/?authSource=admin&serverSelectionTimeoutMS=2000",
        mongo.port
    )
}

#[tokio::test]
async fn the_documented_roles_serve_every_command() {
    let secured = Secured::start(|database| {
        vec![
            documented_role("outboxRelay", database),
            documented_role("outboxOperator", database),
        ]
    })
    .await;
    let env = &secured.env;
    let relay = "outboxRelay";
    assert_exit(&secured.relay(relay, &["check"]).await, 0, "ok    mongodb");
    let waiting = secured.insert_pending().await;
    let swept = ["sweep", "--once", "--grace-period", "0s"];
    assert_exit(&secured.relay(relay, &swept).await, 0, "");
    assert_eq!(
        secured.status_of(waiting).await.as_deref(),
        Some("processed")
    );
    // Without clusterMonitor the oplog's figures are missing, and said so.
    assert_exit(&secured.relay(relay, &["status"]).await, 0, "not readable");
    assert_exit(&secured.relay(relay, &["status", "--json"]).await, 0, "{");

    let uri = uri(&secured.mongo, relay);
    let mut running = RelayProcess::start_with(env, "permitted", &[("OUTBOX_MONGODB_URI", &uri)]);
    let id = secured.insert_pending().await;
    wait_until("the relay to deliver the message", || async {
        secured.status_of(id).await.as_deref() == Some("processed")
    })
    .await;
    running.terminate().await;
    let log = std::fs::read_to_string(&running.log).expect("the relay's log");
    assert!(!log.contains("not authorized"), "{log}");

    let operator = "outboxOperator";
    assert_exit(&secured.relay(operator, &["dlq", "list"]).await, 0, "");
    let replay = ["replay", "--since", "1h"];
    assert_exit(&secured.relay(operator, &replay).await, 0, "");
    secured.env.clone_handles().drop().await;
}

/// What each action taken away breaks: the command that needs it, its
/// exit code, and the collection the message names.
const NEEDED: [(&str, &[&str], i32, &str); 4] = [
    ("listIndexes", &["check"], 5, "outbox"),
    ("listCollections", &["check"], 5, "outbox"),
    ("find", &["status"], 1, "outbox"),
    ("update", &["sweep", "--once"], 1, "outbox_checkpoints"),
];

#[tokio::test]
async fn a_user_missing_a_privilege_is_told_which() {
    let actions: Vec<&str> = NEEDED
        .iter()
        .map(|(action, ..)| *action)
        .chain(["insert", "remove", "createIndex"])
        .collect();
    let secured = Secured::start(|database| {
        let relay = documented_role("outboxRelay", database);
        actions
            .iter()
            .map(|action| without(relay.clone(), action))
            .collect()
    })
    .await;
    for (action, args, code, collection) in NEEDED {
        let output = secured.relay(&format!("without_{action}"), args).await;
        let said = text(&output);
        assert_eq!(output.status.code(), Some(code), "without {action}: {said}");
        let named = format!("the relay's user needs the {action}");
        let or_with = format!("and {action} action");
        assert!(
            (said.contains(&named) || said.contains(&or_with))
                && said.contains(&format!("{}.{collection}", secured.env.name)),
            "without {action}, {args:?} says the user needs it on {collection}: {said}"
        );
    }
    // A group of relays (partitions) inserts its document, and removes a
    // relay's announcement when it stops; a lone relay only upserts, which
    // SecantusDB lets `update` alone do.
    let partitioned = |user: &str| {
        let uri = uri(&secured.mongo, user);
        RelayProcess::start_with(
            &secured.env,
            user,
            &[("OUTBOX_MONGODB_URI", &uri), ("OUTBOX_PARTITIONS", "2")],
        )
    };
    let namespace = format!("{}.outbox_checkpoints", secured.env.name);
    // A relay refused a write it needs says so, and tries again with
    // backoff, as for any failing write: a grant made meanwhile lets it go
    // on, and a stop ends it.
    let mut refused = partitioned("without_insert");
    let said = format!("needs the insert action on {namespace}");
    wait_until("the relay to say it needs insert", || async {
        std::fs::read_to_string(&refused.log).is_ok_and(|log| log.contains(&said))
    })
    .await;
    refused.terminate().await;
    let mut stays = partitioned("without_remove");
    wait_until("the relay to take a share", || async {
        std::fs::read_to_string(&stays.log).is_ok_and(|log| log.contains("took the lease"))
    })
    .await;
    stays.terminate().await;
    let log = std::fs::read_to_string(&stays.log).expect("the relay's log");
    assert!(
        log.contains(&format!("needs the remove action on {namespace}")),
        "{log}"
    );

    // Only a missing sweep index needs createIndex.
    secured
        .db
        .collection::<Document>("outbox")
        .drop_index(outbox_relay::setup::SWEEP_INDEX)
        .await
        .expect("drop the sweep index");
    let output = secured
        .relay("without_createIndex", &["sweep", "--once"])
        .await;
    assert_exit(&output, 5, "the relay's user needs the createIndex action");
    secured.env.clone_handles().drop().await;
}
