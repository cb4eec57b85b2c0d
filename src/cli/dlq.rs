//! `outbox-relay dlq`: its subcommands and flags, and what each prints.

use std::io::IsTerminal;

use bson::oid::ObjectId;
use clap::{Args, Subcommand};
use outbox_relay::admin::dlq::{self, Selection};
use outbox_relay::{Error, Result};

use super::{open_database, to_json, RunArgs};

/// `outbox-relay dlq ...`.
#[derive(Debug, Subcommand)]
pub enum DlqCommand {
    /// List the newest failed messages.
    List {
        /// Only messages of this type.
        #[arg(long = "type")]
        message_type: Option<String>,
        /// At most this many (at least 1).
        #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..))]
        limit: u32,
        /// Print JSON for scripts.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        settings: RunArgs,
    },
    /// Put failed messages back to pending, attempts reset, last error kept in errorHistory.
    Replay {
        #[command(flatten)]
        selection: SelectionArgs,
        /// Show how many would be replayed, and change nothing.
        #[arg(long)]
        dry_run: bool,
        #[command(flatten)]
        settings: RunArgs,
    },
    /// Delete failed messages (asks first unless --yes).
    Discard {
        #[command(flatten)]
        selection: SelectionArgs,
        /// Show how many would be deleted, and change nothing.
        #[arg(long)]
        dry_run: bool,
        /// Do not ask for confirmation.
        #[arg(long)]
        yes: bool,
        #[command(flatten)]
        settings: RunArgs,
    },
}

/// Which failed messages a dlq command acts on: exactly one of these.
#[derive(Debug, Args)]
#[group(required = true, multiple = false)]
pub struct SelectionArgs {
    /// The message with this _id (repeatable).
    #[arg(long = "id")]
    pub ids: Vec<String>,
    /// Every failed message of this type.
    #[arg(long = "type")]
    pub message_type: Option<String>,
    /// Every failed message.
    #[arg(long)]
    pub all: bool,
}

impl SelectionArgs {
    /// The checked selection.
    pub fn resolve(self) -> Result<Selection> {
        if self.all {
            return Ok(Selection::All);
        }
        if let Some(message_type) = self.message_type {
            return Ok(Selection::Type(message_type));
        }
        self.ids
            .iter()
            .map(|id| {
                ObjectId::parse_str(id.trim()).map_err(|_| {
                    Error::Config(format!(
                        "--id {id:?} is not an ObjectId (24 hexadecimal digits, as dlq list shows)"
                    ))
                })
            })
            .collect::<Result<Vec<_>>>()
            .map(Selection::Ids)
    }
}

impl DlqCommand {
    /// Runs the command: each prints what it did and how many.
    pub async fn run(self) -> Result<()> {
        match self {
            DlqCommand::List {
                message_type,
                limit,
                json,
                settings,
            } => {
                let outbox = open_outbox(settings).await?;
                let selection = message_type.map_or(Selection::All, Selection::Type);
                let total = dlq::count(&outbox, &selection).await?;
                let listed = dlq::list(&outbox, &selection, limit).await?;
                if json {
                    println!(
                        "{}",
                        to_json(&serde_json::json!({ "total": total, "messages": listed }))?
                    );
                    return Ok(());
                }
                for message in &listed {
                    println!(
                        "{}  {}  {}  attempts {}  {}",
                        message.id,
                        message.message_type.as_deref().unwrap_or("(no type)"),
                        message.failed_at.as_deref().unwrap_or("-"),
                        message.attempts,
                        message
                            .last_error
                            .as_deref()
                            .unwrap_or("(no error recorded)")
                    );
                }
                println!("{} of {total} failed messages shown", listed.len());
            }
            DlqCommand::Replay {
                selection,
                dry_run,
                settings,
            } => {
                let selection = selection.resolve()?;
                let outbox = open_outbox(settings).await?;
                if dry_run {
                    let matched = dlq::count(&outbox, &selection).await?;
                    println!("would replay {matched} failed messages (dry run: nothing changed)");
                } else {
                    let replayed = dlq::replay(&outbox, &selection).await?;
                    println!("replayed {replayed} failed messages: pending again, delivered by the next sweep");
                }
            }
            DlqCommand::Discard {
                selection,
                dry_run,
                yes,
                settings,
            } => {
                let selection = selection.resolve()?;
                let outbox = open_outbox(settings).await?;
                let matched = dlq::count(&outbox, &selection).await?;
                if dry_run {
                    println!("would discard {matched} failed messages (dry run: nothing changed)");
                } else if matched == 0 {
                    println!("discarded 0 failed messages: none matched");
                } else if yes || confirm(&format!("delete {matched} failed messages for good?"))? {
                    let discarded = dlq::discard(&outbox, &selection).await?;
                    println!("discarded {discarded} failed messages");
                } else {
                    println!("discarded 0 failed messages: not confirmed");
                }
            }
        }
        Ok(())
    }
}

/// Asks a yes-or-no question on the terminal. Without a terminal there is
/// no one to ask, so the caller must say `--yes`.
fn confirm(question: &str) -> Result<bool> {
    use std::io::{BufRead, Write};
    if !std::io::stdin().is_terminal() {
        return Err(Error::Config(format!(
            "{question} There is no terminal to confirm on: pass --yes to go ahead"
        )));
    }
    eprint!("{question} [y/N] ");
    let _ = std::io::stderr().flush();
    let mut answer = String::new();
    std::io::stdin()
        .lock()
        .read_line(&mut answer)
        .map_err(|e| Error::io("cannot read the answer", e))?;
    Ok(matches!(answer.trim(), "y" | "Y" | "yes" | "YES" | "Yes"))
}

/// The outbox collection `settings` name, connected to.
async fn open_outbox(settings: RunArgs) -> Result<mongodb::Collection<bson::Document>> {
    let config = settings.resolve()?;
    Ok(open_database(&config).await?.collection(&config.collection))
}
