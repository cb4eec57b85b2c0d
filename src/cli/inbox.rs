//! `outbox-relay inbox`: a look into a consumer's inbox, and what it prints.

use clap::{Args, Subcommand};
use outbox_relay::inbox::FailedMessage;
use outbox_relay::{Error, Result};

use super::to_json;

/// `outbox-relay inbox ...`.
#[derive(Debug, Subcommand)]
pub enum InboxCommand {
    /// List the newest messages a consumer gave up on (recorded failed).
    List(InboxListArgs),
}

/// `outbox-relay inbox list`: where a consumer's inbox is, not the relay's
/// settings (a consumer's database is its own).
#[derive(Debug, Args)]
pub struct InboxListArgs {
    /// MongoDB connection string of the consumer's deployment.
    #[arg(
        long,
        env = "OUTBOX_MONGODB_URI",
        hide_env_values = true,
        required_unless_present = "mongodb_uri_file"
    )]
    pub mongodb_uri: Option<String>,
    /// Read the connection string from this file (a mounted secret).
    #[arg(long, env = "OUTBOX_MONGODB_URI_FILE", conflicts_with = "mongodb_uri")]
    pub mongodb_uri_file: Option<std::path::PathBuf>,
    /// Database holding the consumer's inbox: the one its Inbox was built on.
    #[arg(long, env = "OUTBOX_INBOX_DATABASE")]
    pub database: String,
    /// The inbox collection in --database.
    #[arg(long, default_value = outbox_relay::inbox::DEFAULT_COLLECTION)]
    pub inbox_collection: String,
    /// The consumer's name, as its Inbox was built with.
    #[arg(long)]
    pub consumer: String,
    /// At most this many (at least 1).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..))]
    pub limit: u32,
    /// Print JSON for scripts: {"total", "messages": [{"messageId", "subject",
    /// "streamSequence", "attempts", "failedAt", "lastError"}]}.
    #[arg(long)]
    pub json: bool,
}

impl InboxCommand {
    /// Runs the subcommand and prints what it found.
    pub async fn run(self) -> Result<()> {
        match self {
            InboxCommand::List(args) => args.list().await,
        }
    }
}

impl InboxListArgs {
    /// `outbox-relay inbox list`: the newest messages a consumer gave up on.
    async fn list(self) -> Result<()> {
        let client = outbox_relay::connect::connect_mongodb(&self.uri()?).await?;
        let collection = client
            .database(&self.database)
            .collection(&self.inbox_collection);
        outbox_relay::inbox::check_consumer(&collection, &self.consumer).await?;
        let limit = i64::from(self.limit);
        let (total, failed) =
            outbox_relay::inbox::failed_messages(&collection, &self.consumer, limit).await?;
        if self.json {
            let listed = serde_json::json!({ "total": total, "messages": failed });
            println!("{}", to_json(&listed)?);
        } else {
            println!("{}", render(&self.consumer, total, &failed));
        }
        Ok(())
    }

    /// The connection string, from the file if one is named.
    fn uri(&self) -> Result<String> {
        match (&self.mongodb_uri, &self.mongodb_uri_file) {
            (_, Some(path)) => outbox_relay::config::read_secret("mongodb-uri-file", path),
            (Some(uri), None) => Ok(uri.clone()),
            (None, None) => Err(Error::Config(
                "give --mongodb-uri or --mongodb-uri-file: where the consumer's inbox is".into(),
            )),
        }
    }
}

/// One line a failed message, then how many of how many were shown.
fn render(consumer: &str, total: u64, failed: &[FailedMessage]) -> String {
    let mut lines: Vec<String> = failed
        .iter()
        .map(|message| {
            format!(
                "{}  {}  {}  attempts {}  {}",
                message.message_id,
                message.subject.as_deref().unwrap_or("(no subject)"),
                message.failed_at.as_deref().unwrap_or("-"),
                message.attempts.unwrap_or(0),
                message
                    .last_error
                    .as_deref()
                    .unwrap_or("(no error recorded)")
            )
        })
        .collect();
    lines.push(match total {
        0 => format!("consumer {consumer:?} has given up on no message"),
        _ => format!(
            "{} of {total} failed messages of consumer {consumer:?} shown",
            failed.len()
        ),
    });
    lines.join("\n")
}
