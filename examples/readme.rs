//! The documents' Rust snippets as a program, so that they compile: the
//! docs test checks that every snippet appears here token for token.
//!
//! It writes two orders with their messages, then consumes what a relay
//! delivered until it has caught up. Beside the local servers
//! (scripts/services.sh), run a relay first:
//!
//!     outbox-relay run --database readme --subject-prefix shop --create-stream OUTBOX
//!
//! Settings (environment): MONGODB_URI, NATS_URL, DEMO_DATABASE (readme).

use std::error::Error;
use std::time::Duration;

use bson::{doc, Document};
use futures::FutureExt;
use outbox_relay::async_nats;
use outbox_relay::inbox::{Delivery, Handler, HandlerError, Inbox};
use outbox_relay::mongodb::{Client, ClientSession, Collection, Database};
use outbox_relay::{MessageType, NewMessage, Outbox};
use tokio_util::sync::CancellationToken;

type Fallible = Result<(), Box<dyn Error + Send + Sync>>;

/// README, "Writing from any language".
async fn write(client: Client, db: Database) -> Fallible {
    let orders = db.collection::<Document>("orders");
    #[derive(serde::Serialize)]
    struct OrderPlaced {
        order: String,
        total_cents: i64,
    }

    impl MessageType for OrderPlaced {
        const MESSAGE_TYPE: &'static str = "order.placed"; // part of the wire contract
    }

    let outbox = Outbox::new(&db); // or Outbox::with_collection(&db, "events_outbox")
    let mut session = client.start_session().await?;
    session.start_transaction().await?;
    orders
        .insert_one(doc! { "_id": "o-1001", "total_cents": 4200 })
        .session(&mut session)
        .await?;
    let placed = OrderPlaced {
        order: "o-1001".into(),
        total_cents: 4200,
    };
    let message = NewMessage::typed(&placed)?
        .key("o-1001")
        .correlation_id("checkout-77");
    outbox.add(&mut session, message).await?;
    session.commit_transaction().await?;
    Ok(())
}

/// docs/libraries.md, "The writer": a transaction run again after a
/// transient error.
async fn write_retrying(client: Client, db: Database) -> Fallible {
    let (orders, outbox) = (db.collection::<Document>("orders"), Outbox::new(&db));
    let mut session = client.start_session().await?;
    session
        .start_transaction()
        .and_run((&orders, &outbox), |session, (orders, outbox)| {
            async move {
                let order = doc! { "_id": "o-1002", "total_cents": 990 };
                orders.insert_one(order).session(&mut *session).await?;
                let message = NewMessage::serialized("order.placed", &doc! { "order": "o-1002" })?;
                outbox.add(session, message).await?;
                Ok(())
            }
            .boxed()
        })
        .await?;
    Ok(())
}

/// README, "Consuming with the inbox".
async fn consume(
    db: Database,
    nats: async_nats::Client,
    invoices: Collection<Document>,
) -> Fallible {
    struct Billing {
        invoices: Collection<Document>,
    }

    impl Handler for Billing {
        async fn handle(
            &self,
            session: &mut ClientSession,
            message: &Delivery,
        ) -> Result<(), HandlerError> {
            let order: Document = message.json()?;
            self.invoices.insert_one(order).session(session).await?; // joins the transaction
            Ok(())
        }
    }

    let inbox = Inbox::builder(&db, "billing").build().await?; // the consumer's name
    let consumer = inbox
        .consumer(async_nats::jetstream::new(nats), "OUTBOX") // stream name
        .filter_subject("shop.order.placed")
        .bind() // creates or binds the durable consumer
        .await?;
    let shutdown = CancellationToken::new(); // tokio_util: cancel() stops after what is in flight
    let (backlog, stop) = (consumer.backlog(), shutdown.clone()); // a batch job stops once caught up:
    tokio::spawn(async move {
        backlog.caught_up(Duration::from_secs(1)).await;
        stop.cancel()
    });
    consumer.run(Billing { invoices }, shutdown).await?;
    Ok(())
}

#[tokio::main]
async fn main() -> Fallible {
    let setting =
        |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.into());
    let client = outbox_relay::connect::connect_mongodb(&setting(
        "MONGODB_URI",
        "mongodb://127.0.0.1:27017",
    ))
    .await?;
    let db = client.database(&setting("DEMO_DATABASE", "readme"));
    write(client.clone(), db.clone()).await?;
    write_retrying(client.clone(), db.clone()).await?;
    let nats = async_nats::connect(setting("NATS_URL", "nats://127.0.0.1:4222")).await?;
    let invoices = db.collection("invoices");
    consume(db, nats, invoices).await
}
