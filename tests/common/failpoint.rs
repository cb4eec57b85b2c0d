//! Errors a replica set returns, injected as MongoDB's drivers test
//! themselves: a server started with `--enable-test-commands` takes
//! `configureFailPoint` with `failCommand`, scoped by `appName` to the one
//! process under test, so the test's own clients go on unharmed.

use bson::{doc, Bson, Document};
use mongodb::Client;

/// The label a 4.4+ server sets on errors a change stream may resume after.
pub const RESUMABLE: &str = "ResumableChangeStreamError";

/// One class of error a command can meet, as `failCommand` data.
#[derive(Clone, Debug)]
pub enum Failure {
    /// A reply with this code and these labels.
    Code(i32, &'static [&'static str]),
    /// The connection dropped before a reply.
    CloseConnection,
    /// The command runs, and its reply says the write concern failed.
    WriteConcern(i32),
    /// The connection held this many milliseconds, then the command runs.
    Block(u32),
}

impl Failure {
    fn data(&self) -> Document {
        match self {
            Failure::Code(code, labels) => {
                doc! { "errorCode": code, "errorLabels": labels.to_vec() }
            }
            Failure::CloseConnection => doc! { "closeConnection": true },
            Failure::WriteConcern(code) => doc! {
                "writeConcernError": { "code": code, "errmsg": "injected write concern error" },
            },
            Failure::Block(ms) => doc! { "blockConnection": true, "blockTimeMS": i64::from(*ms) },
        }
    }
}

/// Arms `failCommand` for the next `times` of `commands` sent by clients
/// named `app` (replacing any fail point armed before).
pub async fn arm(client: &Client, app: &str, commands: &[&str], times: u32, failure: &Failure) {
    let mut data = failure.data();
    data.insert("failCommands", commands.to_vec());
    data.insert("appName", app);
    configure(
        client,
        Bson::Document(doc! { "times": i64::from(times) }),
        data,
    )
    .await;
}

/// Arms `failCommand` until [`off`].
pub async fn arm_always(client: &Client, app: &str, commands: &[&str], failure: &Failure) {
    let mut data = failure.data();
    data.insert("failCommands", commands.to_vec());
    data.insert("appName", app);
    configure(client, Bson::String("alwaysOn".into()), data).await;
}

/// Turns the fail point off.
pub async fn off(client: &Client) {
    configure(client, Bson::String("off".into()), doc! {}).await;
}

async fn configure(client: &Client, mode: Bson, data: Document) {
    client
        .database("admin")
        .run_command(doc! { "configureFailPoint": "failCommand", "mode": mode, "data": data })
        .await
        .expect("configureFailPoint (the server needs --enable-test-commands)");
}

/// A connection string for the process under test: named `app`, so fail
/// points reach it alone, and polling the server twice a second, so a
/// driver that marked the server unknown after an error finds it again
/// in half a second rather than at its streaming monitor's next answer.
pub fn uri_for(uri: &str, app: &str) -> String {
    let separator = if uri.contains('?') { '&' } else { '?' };
    format!("{uri}{separator}appName={app}&serverMonitoringMode=poll&heartbeatFrequencyMS=500")
}
