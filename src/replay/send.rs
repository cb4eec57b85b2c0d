//! Sending a replay's messages: read in `_id` order, paced, published with
//! a window of acknowledgements awaited together, each key's messages one
//! at a time.
//!
//! The order of a key's messages is the order the relay delivers them in
//! (see README, per-key order): where the broker acknowledges storage
//! (JetStream), a message waits for the answer to the one before it of its
//! key, so a failure can never let a later one be stored first. The
//! answers are taken in the order the messages were read, so the progress
//! written is always a point every message before which was answered.
//!
//! What is held is bounded whatever the range: one batch of the cursor,
//! and the window (`--max-in-flight` messages, `--max-buffered-bytes` of
//! them). A message that cannot be sent is skipped and counted where it
//! lands: one that breaks the contract now, whose new subject is not
//! allowed, that the replay's headers make too large, or that JetStream
//! refuses while its stream takes others (a size limit: the stream is
//! asked, [`Publisher::probe`]). A broker that takes nothing, no stream
//! that captures a subject, or a subject the user may not publish to,
//! stops the replay, to be resumed.

use std::collections::HashMap;
use std::time::Duration;

use bson::{doc, oid::ObjectId, Document, RawDocumentBuf};
use futures::future::BoxFuture;
use futures::stream::{FuturesOrdered, StreamExt};
use futures::{FutureExt, TryStreamExt};
use mongodb::Collection;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::record::{Progress, Records, State};
use super::selection::Selection;
use super::Report;
use crate::contract::{field, header, DecodeRules, OutboxMessage};
use crate::error::{Error, Result};
use crate::publish::{Ack, Health, PublishError, Publisher, PERMISSION_DENIED};

/// How often progress is written to the record.
const SAVE_EVERY: Duration = Duration::from_secs(1);

/// How often progress is reported to the operator.
const REPORT_EVERY: Duration = Duration::from_millis(250);

/// How late a paced send may be and still be made up by the next: a
/// tenth of a second's worth of messages at most go back to back.
const PACE_SLACK: Duration = Duration::from_millis(100);

/// Documents a read of the outbox asks for at a time.
const READ_BATCH: u32 = 256;

/// How a run of a replay ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ended {
    /// Every selected message was sent.
    Finished,
    /// The replay was stopped; what was sent is recorded.
    Interrupted,
}

/// What becomes of one document read.
pub(super) enum Outgoing {
    /// The patterns do not select it.
    Unselected,
    /// Selected, but it cannot be sent; the text says why.
    Skipped(String),
    Send(Box<OutboxMessage>),
}

/// What becomes of `document`: sent as it was first delivered, under the
/// prefix, with the replay's headers, if it is selected and may be. A
/// document that cannot be read as a message is skipped only if what can
/// be read of it is selected.
pub(super) fn outgoing(
    document: &RawDocumentBuf,
    rules: &DecodeRules,
    selection: &Selection,
    prefix: Option<&str>,
    replay_id: &str,
) -> Outgoing {
    let decoded = rules.decode_raw(document);
    let mut message = match decoded.message {
        Ok(message) => message,
        Err(violation) => {
            let message_type = document.get_str(field::TYPE).unwrap_or_default();
            let subject = rules.likely_subject(document);
            if !selection.matches(message_type, &subject) {
                return Outgoing::Unselected;
            }
            return Outgoing::Skipped(format!("it breaks the outbox contract: {violation}"));
        }
    };
    if !selection.matches(&message.message_type, &message.subject) {
        return Outgoing::Unselected;
    }
    if let Some(prefix) = prefix {
        message.subject = format!("{prefix}.{}", message.subject);
        if let Err(violation) = rules.subjects.check(&message.subject) {
            return Outgoing::Skipped(violation.to_string());
        }
    }
    let original = message.id.to_hex();
    let mut headers = Vec::with_capacity(message.headers.len() + 2);
    for (name, value) in message.headers.drain(..) {
        if name == header::MSG_ID {
            headers.push((name, format!("{original}:{replay_id}")));
            headers.push((header::REPLAY.to_owned(), replay_id.to_owned()));
            headers.push((header::REPLAY_OF.to_owned(), original.clone()));
        } else {
            headers.push((name, value));
        }
    }
    message.headers = headers;
    if message.wire_size() > rules.max_payload {
        return Outgoing::Skipped(format!(
            "with the replay's headers it is {} bytes, more than the {} NATS takes",
            message.wire_size(),
            rules.max_payload
        ));
    }
    Outgoing::Send(Box::new(message))
}

/// One replay's sending.
pub(super) struct Sender<'a> {
    pub outbox: &'a Collection<Document>,
    pub rules: &'a DecodeRules,
    pub selection: &'a Selection,
    pub replay_prefix: Option<&'a str>,
    pub replay_id: &'a str,
    pub publisher: &'a dyn Publisher,
    /// The least time between two sends (`--rate`).
    pub pace: Option<Duration>,
    pub records: &'a Records,
    pub max_in_flight: usize,
    pub max_bytes: usize,
    pub report: &'a (dyn Fn(&Report) + Sync),
    /// How many documents the selection's filter matches, if counted.
    pub total: Option<u64>,
}

/// A document read, on its way to its place in the progress.
struct Landed {
    id: ObjectId,
    /// What became of it, once its answer (if any) is in.
    fate: Fate,
    key: Option<String>,
    bytes: usize,
}

/// What a document read comes to.
enum Fate {
    /// Not selected.
    Passed,
    /// Selected and not sendable; the text says why.
    Skipped(String),
    /// Sent as this type, to this subject.
    Sent {
        message_type: String,
        subject: String,
    },
}

type Answer = Result<Ack, PublishError>;

/// The documents read and not yet in the progress, in the order read.
#[derive(Default)]
struct Window {
    landings: FuturesOrdered<BoxFuture<'static, (Landed, Answer)>>,
    /// Keys with a message on its way, and how many.
    keys: HashMap<String, usize>,
    bytes: usize,
}

impl Window {
    fn push(&mut self, landed: Landed, answer: BoxFuture<'static, Answer>) {
        if let Some(key) = &landed.key {
            *self.keys.entry(key.clone()).or_default() += 1;
        }
        self.bytes += landed.bytes;
        self.landings
            .push_back(answer.map(move |answer| (landed, answer)).boxed());
    }

    /// The next answer, in the order the documents were read.
    async fn next(&mut self) -> Option<(Landed, Answer)> {
        let (landed, answer) = self.landings.next().await?;
        if let Some(key) = &landed.key {
            if let Some(count) = self.keys.get_mut(key) {
                *count -= 1;
                if *count == 0 {
                    self.keys.remove(key);
                }
            }
        }
        self.bytes -= landed.bytes;
        Some((landed, answer))
    }

    fn len(&self) -> usize {
        self.landings.len()
    }

    fn holds(&self, key: Option<&str>) -> bool {
        key.is_some_and(|key| self.keys.contains_key(key))
    }
}

/// An answer known without the broker.
fn known() -> BoxFuture<'static, Answer> {
    futures::future::ready(Ok(Ack::default())).boxed()
}

impl Sender<'_> {
    /// Sends the selected messages after `progress.after`, recording
    /// progress as it goes, until the last or a stop.
    pub async fn run(&self, progress: &mut Progress, stop: &CancellationToken) -> Result<Ended> {
        let failed = |e| {
            Error::mongo("reading the messages to replay failed", e)
                .needing("find", self.outbox.namespace())
        };
        let mut cursor = self
            .outbox
            .clone_with_type::<RawDocumentBuf>()
            .find(self.selection.filter(progress.after))
            .sort(doc! { field::ID: 1 })
            .batch_size(self.read_batch())
            .await
            .map_err(failed)?;
        let mut window = Window::default();
        let started = Instant::now();
        let (mut saved, mut reported, mut due) = (started, started, started);
        let mut scanned = 0u64;
        let ended = loop {
            let next = tokio::select! {
                biased;
                _ = stop.cancelled() => break Ended::Interrupted,
                next = cursor.try_next() => next.map_err(failed)?,
            };
            let Some(document) = next else {
                break Ended::Finished;
            };
            scanned += 1;
            let Ok(id) = document.get_object_id(field::ID) else {
                continue;
            };
            let outgoing = outgoing(
                &document,
                self.rules,
                self.selection,
                self.replay_prefix,
                self.replay_id,
            );
            drop(document);
            let message = match outgoing {
                Outgoing::Send(message) => message,
                // Nothing before it is waiting: the progress passes it now.
                Outgoing::Unselected if window.len() == 0 => {
                    progress.after = Some(id);
                    continue;
                }
                Outgoing::Unselected | Outgoing::Skipped(_) => {
                    let fate = match outgoing {
                        Outgoing::Skipped(why) => Fate::Skipped(why),
                        _ => Fate::Passed,
                    };
                    self.make_room(&mut window, progress, None, 0).await?;
                    window.push(Landed::at(id, fate), known());
                    continue;
                }
            };
            let key = message.key().map(str::to_owned);
            let bytes = message.wire_size();
            self.make_room(&mut window, progress, key.as_deref(), bytes)
                .await?;
            if !self.wait_turn(&mut due, stop).await {
                break Ended::Interrupted;
            }
            let answer = tokio::select! {
                biased;
                _ = stop.cancelled() => break Ended::Interrupted,
                sent = self.publisher.send(&message) => match sent {
                    Ok(answer) => answer,
                    Err(error) => futures::future::ready(Err(error)).boxed(),
                },
            };
            let fate = Fate::Sent {
                message_type: message.message_type.clone(),
                subject: message.subject.clone(),
            };
            window.push(
                Landed {
                    id,
                    fate,
                    key,
                    bytes,
                },
                answer,
            );
            if saved.elapsed() >= SAVE_EVERY {
                self.records
                    .save(self.replay_id, progress, State::Running)
                    .await?;
                saved = Instant::now();
            }
            if reported.elapsed() >= REPORT_EVERY {
                self.report(progress, scanned, started);
                reported = Instant::now();
            }
        };
        while window.len() > 0 {
            self.land(&mut window, progress).await?;
        }
        self.report(progress, scanned, started);
        Ok(ended)
    }

    /// Lands answers until the window has room for a message of `key` and
    /// `bytes`: fewer than `--max-in-flight` on their way, the bytes
    /// within the budget (one message alone always goes), and, where the
    /// broker acknowledges storage, nothing of its key on its way.
    async fn make_room(
        &self,
        window: &mut Window,
        progress: &mut Progress,
        key: Option<&str>,
        bytes: usize,
    ) -> Result<()> {
        let ordered = self.publisher.acknowledges_storage();
        while window.len() >= self.max_in_flight
            || (window.len() > 0 && window.bytes + bytes > self.max_bytes)
            || (ordered && window.holds(key))
        {
            self.land(window, progress).await?;
        }
        Ok(())
    }

    /// Documents a read asks for: at most [`READ_BATCH`], and few enough
    /// that a slow pace reads again within a minute, long before the
    /// server drops an idle cursor (ten minutes by default).
    fn read_batch(&self) -> u32 {
        let Some(pace) = self.pace.filter(|pace| !pace.is_zero()) else {
            return READ_BATCH;
        };
        let per_minute = Duration::from_secs(60).as_nanos() / pace.as_nanos();
        u32::try_from(per_minute)
            .unwrap_or(READ_BATCH)
            .clamp(1, READ_BATCH)
    }

    /// Takes the next answer: the progress moves past its document, which
    /// is counted sent or skipped, or the replay stops at the broker's
    /// failure.
    async fn land(&self, window: &mut Window, progress: &mut Progress) -> Result<()> {
        let Some((landed, answer)) = window.next().await else {
            return Ok(());
        };
        match (landed.fate, answer) {
            (Fate::Passed, _) => {}
            (Fate::Skipped(why), _) => self.skipped(progress, landed.id, &why),
            (Fate::Sent { message_type, .. }, Ok(_)) => progress.sent_one(&message_type),
            (Fate::Sent { subject, .. }, Err(error)) => match self.judge(&subject, &error).await {
                Some(why) => self.skipped(progress, landed.id, &why),
                None => {
                    let hint = match error {
                        PublishError::Uncaptured(_) => {
                            "; no JetStream stream captures it: create one for the replay's \
                             subjects (--create-stream NAME), then resume"
                        }
                        _ => "",
                    };
                    return Err(Error::Nats {
                        context: format!(
                            "message {} was not stored on {subject:?}; the replay stops here, \
                             everything before it sent{hint}",
                            landed.id
                        ),
                        source: Box::new(error),
                    });
                }
            },
        }
        progress.after = Some(landed.id);
        Ok(())
    }

    fn skipped(&self, progress: &mut Progress, id: ObjectId, why: &str) {
        progress.skipped += 1;
        tracing::warn!(%id, "not replayed: {why}");
    }

    /// Whether a failure is the message's own (then, why), asking the
    /// broker where it could be either: a message JetStream refuses (a
    /// stream's size or per-subject limit) while the stream takes others is
    /// skipped; an outage, no stream for the subject (the replay's stream
    /// is missing), or a subject NATS does not let this user publish to
    /// (which no message under it would pass) stops the replay.
    async fn judge(&self, subject: &str, error: &PublishError) -> Option<String> {
        match error {
            PublishError::Invalid(violation) => Some(violation.to_string()),
            PublishError::Refused(why) if why.starts_with(PERMISSION_DENIED) => None,
            PublishError::Refused(_) => match self.publisher.probe(subject).await {
                Health::Takes => Some(format!("{error}, while the broker takes others")),
                Health::TakesOthers(why) => Some(format!("{error} ({why})")),
                Health::TakesNone(_) | Health::Unknown => None,
            },
            PublishError::Uncaptured(_) | PublishError::Unavailable(_) => None,
        }
    }

    /// Waits until the pace lets the next message go: the pace after the
    /// one before, less what the one before was late by, up to
    /// [`PACE_SLACK`] (a timer's grain, a progress write), so the rate is
    /// kept, while a longer stall is not made up with a burst. False if
    /// the replay is stopped first.
    async fn wait_turn(&self, due: &mut Instant, stop: &CancellationToken) -> bool {
        let Some(pace) = self.pace else {
            return !stop.is_cancelled();
        };
        let turn = *due;
        let waited = tokio::select! {
            biased;
            _ = stop.cancelled() => false,
            _ = tokio::time::sleep_until(turn) => true,
        };
        let now = Instant::now();
        *due = turn.max(now.checked_sub(PACE_SLACK).unwrap_or(now)) + pace;
        waited
    }

    fn report(&self, progress: &Progress, scanned: u64, started: Instant) {
        (self.report)(&Report {
            scanned,
            total: self.total,
            sent: u64::try_from(progress.sent).unwrap_or(0),
            skipped: u64::try_from(progress.skipped).unwrap_or(0),
            elapsed: started.elapsed(),
        });
    }
}

impl Landed {
    /// A document that goes nowhere, landing in its place.
    fn at(id: ObjectId, fate: Fate) -> Self {
        Landed {
            id,
            fate,
            key: None,
            bytes: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use bson::{doc, oid::ObjectId, RawDocumentBuf};

    use super::*;
    use crate::contract::{SubjectRules, SubjectTemplate};

    #[test]
    fn a_broken_document_is_selected_by_the_subject_its_template_gives() {
        let template = SubjectTemplate::parse("{prefix}.{type}.{key}").expect("a template");
        let subjects = SubjectRules::under("outbox")
            .and_then(|rules| rules.with_template(template))
            .expect("rules");
        let rules = DecodeRules::new(subjects, usize::MAX);
        let selection = Selection {
            subjects: vec!["outbox.order.placed.*".into()],
            include_failed: true,
            ..Selection::default()
        };
        let broken = |key: Option<&str>| {
            let mut document = doc! {
                "_id": ObjectId::new(), "type": "order.placed", "payload": 5, "status": "failed",
            };
            if let Some(key) = key {
                document.insert("key", key);
            }
            RawDocumentBuf::from_document(&document).expect("a raw document")
        };
        let keyed = outgoing(&broken(Some("o-1")), &rules, &selection, None, "r");
        assert!(
            matches!(&keyed, Outgoing::Skipped(why) if why.contains("payload")),
            "selected, and skipped for what it breaks"
        );
        // Without a key the template cannot say its subject: the type's.
        let keyless = outgoing(&broken(None), &rules, &selection, None, "r");
        assert!(matches!(keyless, Outgoing::Unselected));
    }
}
