//! What kind of deployment a connection reaches, read from one `hello`
//! reply, here and nowhere else: a replica set and a sharded cluster's
//! router (mongos) serve the relay alike, but for what mongos cannot read
//! (the oplog). A leaf: connecting, `status` and the collector all ask it.

use bson::{doc, Document};
use mongodb::Client;

/// What a connection reaches, as the server's `hello` reply describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deployment {
    /// A replica set (one member will do): its oplog, `local.oplog.rs`, is
    /// readable where the user may read it.
    ReplicaSet,
    /// A sharded cluster, through its router, mongos (`msg: "isdbgrid"`):
    /// each shard keeps an oplog of its own, and mongos refuses every
    /// command on the `local` database.
    ShardedCluster,
    /// A server alone: no oplog, no change streams, no transactions.
    Standalone,
}

/// Why the oplog is not read through mongos, as the relay says it.
const NO_OPLOG_THROUGH_MONGOS: &str = "the oplog is not readable through mongos: each shard \
    keeps its own (local.oplog.rs), which only a connection to that shard's replica set reads";

impl Deployment {
    /// The deployment a `hello` reply describes: mongos says `isdbgrid` in
    /// `msg`, a replica set member names its set in `setName`.
    pub fn of_hello(hello: &Document) -> Self {
        if hello.get_str("msg") == Ok("isdbgrid") {
            Deployment::ShardedCluster
        } else if hello.get_str("setName").is_ok() {
            Deployment::ReplicaSet
        } else {
            Deployment::Standalone
        }
    }

    /// Asks the server `client` reaches what it is (one `hello`).
    pub async fn detect(client: &Client) -> mongodb::error::Result<Self> {
        let hello = client
            .database("admin")
            .run_command(doc! { "hello": 1 })
            .await?;
        Ok(Self::of_hello(&hello))
    }

    /// Why the oplog cannot be read through this connection, whatever the
    /// user may read, as a sentence; `None` where it can.
    pub fn oplog_unreadable(self) -> Option<&'static str> {
        match self {
            Deployment::ShardedCluster => Some(NO_OPLOG_THROUGH_MONGOS),
            Deployment::Standalone => Some("a standalone server keeps no oplog"),
            Deployment::ReplicaSet => None,
        }
    }
}

impl std::fmt::Display for Deployment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Deployment::ReplicaSet => "a replica set",
            Deployment::ShardedCluster => "a sharded cluster (through mongos)",
            Deployment::Standalone => "a standalone server",
        })
    }
}

#[cfg(test)]
mod tests {
    use bson::DateTime;

    use super::*;

    #[test]
    fn a_hello_reply_says_which_deployment_answered() {
        let member = doc! {
            "isWritablePrimary": true, "setName": "rs0", "hosts": ["db1:27017"],
            "localTime": DateTime::now(), "ok": 1.0,
        };
        assert_eq!(Deployment::of_hello(&member), Deployment::ReplicaSet);
        // As mongos answers: no set, and `isdbgrid` in `msg`.
        let router = doc! {
            "isWritablePrimary": true, "msg": "isdbgrid", "localTime": DateTime::now(),
            "maxWireVersion": 21, "ok": 1.0,
        };
        assert_eq!(Deployment::of_hello(&router), Deployment::ShardedCluster);
        let alone = doc! { "isWritablePrimary": true, "ok": 1.0 };
        assert_eq!(Deployment::of_hello(&alone), Deployment::Standalone);
        let other_message = doc! { "isWritablePrimary": true, "msg": "hello", "setName": "rs0" };
        assert_eq!(Deployment::of_hello(&other_message), Deployment::ReplicaSet);
    }

    #[test]
    fn only_a_replica_set_lets_the_oplog_be_read() {
        assert_eq!(Deployment::ReplicaSet.oplog_unreadable(), None);
        let why = Deployment::ShardedCluster.oplog_unreadable();
        assert!(why.is_some_and(|why| why.contains("mongos")), "{why:?}");
        assert!(Deployment::Standalone.oplog_unreadable().is_some());
    }
}
