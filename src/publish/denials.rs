//! The subjects NATS refused this relay, shared by the connection that
//! hears the refusals and the publisher that must tell a refusal from an
//! outage. It lives apart from both so that neither imports the other.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Subjects the server recently refused publishes to.
///
/// NATS reports a publish permission violation on the connection (an
/// `-ERR`), not as a reply, so a JetStream publish to a denied subject just
/// goes unacknowledged. Remembering the denials lets an acknowledgement
/// timeout on such a subject count as a refusal of that message rather than
/// an outage of the broker.
#[derive(Debug, Clone, Default)]
pub(crate) struct Denials(Arc<Mutex<HashMap<String, Instant>>>);

impl Denials {
    const PREFIX: &'static str = "permissions violation for publish to ";

    /// Records the subject of a server error if it is a publish denial.
    pub(crate) fn note(&self, server_error: &str) {
        let lower = server_error.to_ascii_lowercase();
        let Some(start) = lower.find(Self::PREFIX) else {
            return;
        };
        let subject = server_error[start + Self::PREFIX.len()..]
            .trim()
            .trim_matches(|c| c == '"' || c == '\'' || c == '`');
        if let Ok(mut denials) = self.0.lock() {
            if denials.insert(subject.to_owned(), Instant::now()).is_none() {
                tracing::warn!(%subject, "NATS denies this relay publishing to the subject");
            }
        }
    }

    /// Whether publishing to `subject` was denied within `window`.
    pub(crate) fn denied(&self, subject: &str, window: Duration) -> bool {
        self.0.lock().is_ok_and(|mut denials| {
            denials.retain(|_, at| at.elapsed() <= window);
            denials.contains_key(subject)
        })
    }
}
