//! Which messages a replay sends again.
//!
//! Time is the `_id`'s: the second the writer's driver made the ObjectId,
//! just before the message committed. It is the order the relay itself
//! reads a key's messages in from the collection (see README, per-key
//! order), the `_id` index serves a range of it without another index, and
//! a message keeps it whatever became of its delivery. Its unit is the
//! second: `--since` takes the whole second it falls in, `--until` none of
//! its own second.
//!
//! The time range, the keys, the state and the types are asked of MongoDB
//! (a type pattern as the anchored regular expression the validator's
//! allow-list uses); subjects, which a message may leave to its type, are
//! matched here, and types again, as NATS matches a pattern (a type is read
//! as the dot-separated tokens its default subject ends in).

use std::time::{Duration, SystemTime};

use bson::{doc, oid::ObjectId, Bson, DateTime, Document};
use serde::{Deserialize, Serialize};

use crate::contract::{field, pattern_matches, pattern_regex, status, validate_pattern};
use crate::time::{later, object_id_at, shown};

/// The messages a replay sends: delivered ones (and, if asked, failed
/// ones) matching every criterion given, and any value of one not given.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Selection {
    /// Messages created at or after this moment (the `_id`'s second).
    pub since: Option<DateTime>,
    /// Messages created before this moment's second.
    pub until: Option<DateTime>,
    /// Type patterns: a message matches if its type matches any.
    pub types: Vec<String>,
    /// Patterns over the subject the message was delivered to.
    pub subjects: Vec<String>,
    /// Keys: a message matches if its key is one of them.
    pub keys: Vec<String>,
    /// Failed messages too, not only delivered ones.
    pub include_failed: bool,
}

/// Reads a moment as a flag gives it: an RFC 3339 time, or a duration ago
/// (`2h`, `30m`, `7days`). The error completes "--since VALUE ...".
pub fn parse_moment(text: &str, now: SystemTime) -> Result<DateTime, String> {
    let text = text.trim();
    if let Ok(at) = DateTime::parse_rfc3339_str(text) {
        return Ok(at);
    }
    match humantime::parse_duration(text) {
        Ok(ago) => Ok(DateTime::from_system_time(
            now.checked_sub(ago).unwrap_or(SystemTime::UNIX_EPOCH),
        )),
        Err(_) => Err(format!(
            "{text:?} is neither an RFC 3339 time (2026-12-04T10:00:00Z) nor a duration ago \
             (2h, 30m, 7days)"
        )),
    }
}

impl Selection {
    /// Checks the criteria; the error says which is wrong and how.
    pub fn validate(&self) -> Result<(), String> {
        if let (Some(since), Some(until)) = (self.since, self.until) {
            if since >= until {
                return Err(format!(
                    "--since ({}) is not before --until ({}): the range selects nothing",
                    shown(since),
                    shown(until)
                ));
            }
        }
        for (flag, patterns) in [("--type", &self.types), ("--subject", &self.subjects)] {
            for pattern in patterns {
                validate_pattern(pattern).map_err(|e| format!("{flag}: {e}"))?;
            }
        }
        if let Some(key) = self.keys.iter().find(|key| key.is_empty()) {
            return Err(format!("--key {key:?}: a key is a non-empty string"));
        }
        Ok(())
    }

    /// The selection as run at `now`: ending, at the latest, at the end of
    /// `now`'s second (as `_id`s count), so a run that resumes or audits
    /// again takes what was there, not what came since. The error says
    /// what is wrong with it.
    pub fn ending_by(mut self, now: DateTime) -> Result<Selection, String> {
        if self.since.is_some_and(|since| since > now) {
            return Err("--since is in the future: no message was written after it yet".to_owned());
        }
        let end = later(now, Duration::from_secs(1));
        self.until = Some(self.until.map_or(end, |until| until.min(end)));
        self.validate()?;
        Ok(self)
    }

    /// Whether no criterion narrows it: every delivered message.
    pub fn is_everything(&self) -> bool {
        self.since.is_none()
            && self.until.is_none()
            && self.types.is_empty()
            && self.subjects.is_empty()
            && self.keys.is_empty()
    }

    /// The MongoDB filter of the messages after `after` (in `_id` order)
    /// that may be selected; [`Selection::matches`] decides each exactly.
    pub fn filter(&self, after: Option<ObjectId>) -> Document {
        let mut states = vec![status::PROCESSED];
        if self.include_failed {
            states.push(status::FAILED);
        }
        let mut filter = doc! { field::STATUS: { "$in": states } };
        filter.extend(self.criteria(after));
        filter
    }

    /// The MongoDB filter of every message in the range and of the keys
    /// and types, whatever its state: what an audit compares.
    pub fn window_filter(&self) -> Document {
        self.criteria(None)
    }

    /// The range after `after`, the keys and the types, as a filter.
    fn criteria(&self, after: Option<ObjectId>) -> Document {
        let mut filter = Document::new();
        let mut id = Document::new();
        // Only ObjectIds: an `_id` of another type has no time, and no
        // message of it was delivered.
        id.insert("$type", "objectId");
        match (after, self.since) {
            (Some(after), _) => {
                id.insert("$gt", after);
            }
            (None, Some(since)) => {
                id.insert("$gte", object_id_at(since));
            }
            (None, None) => {}
        }
        if let Some(until) = self.until {
            id.insert("$lt", object_id_at(until));
        }
        filter.insert(field::ID, id);
        if !self.keys.is_empty() {
            filter.insert(field::KEY, doc! { "$in": &self.keys });
        }
        if !self.types.is_empty() {
            let types: Vec<Bson> = self
                .types
                .iter()
                .map(|pattern| {
                    Bson::RegularExpression(bson::Regex {
                        pattern: pattern_regex(pattern),
                        options: String::new(),
                    })
                })
                .collect();
            filter.insert(field::TYPE, doc! { "$in": types });
        }
        filter
    }

    /// Whether a moment's `_id`s are in the range: at or after `since`'s
    /// second, before `until`'s.
    pub fn in_range(&self, id: &ObjectId) -> bool {
        self.since.is_none_or(|since| *id >= object_id_at(since))
            && self.until.is_none_or(|until| *id < object_id_at(until))
    }

    /// Whether `key` is among the keys asked for (any, if none is).
    pub fn has_key(&self, key: Option<&str>) -> bool {
        self.keys.is_empty() || key.is_some_and(|key| self.keys.iter().any(|k| k == key))
    }

    /// Whether a message of `message_type`, delivered to `subject`,
    /// matches the type and subject patterns.
    pub fn matches(&self, message_type: &str, subject: &str) -> bool {
        self.matches_type(message_type) && any_matches(&self.subjects, subject)
    }

    /// Whether a message of `message_type` matches the type patterns.
    pub fn matches_type(&self, message_type: &str) -> bool {
        any_matches(&self.types, message_type)
    }
}

/// Whether `value` matches one of `patterns`, or none is given.
fn any_matches(patterns: &[String], value: &str) -> bool {
    patterns.is_empty() || patterns.iter().any(|p| pattern_matches(p, value))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// The moment `by` before `now`.
    fn ago(now: SystemTime, by: Duration) -> DateTime {
        DateTime::from_system_time(now - by)
    }

    #[test]
    fn a_moment_is_a_time_or_a_duration_ago_and_nothing_else() {
        let now = SystemTime::now();
        assert_eq!(
            parse_moment("2026-12-04T10:00:00Z", now),
            Ok(DateTime::parse_rfc3339_str("2026-12-04T10:00:00Z").expect("a time"))
        );
        assert_eq!(
            parse_moment(" 2h ", now),
            Ok(ago(now, Duration::from_secs(7200)))
        );
        let error = parse_moment("yesterday", now).expect_err("not a moment");
        assert!(
            error.contains("RFC 3339") && error.contains("2h"),
            "{error}"
        );
    }

    #[test]
    fn types_and_subjects_match_as_nats_patterns() {
        let selection = Selection {
            types: vec!["order.*".into(), "invoice.>".into()],
            subjects: vec!["outbox.>".into()],
            ..Selection::default()
        };
        assert!(selection.matches("order.placed", "outbox.order.placed"));
        assert!(selection.matches("invoice.paid.late", "outbox.x"));
        assert!(!selection.matches("order.placed.late", "outbox.x"));
        assert!(!selection.matches("orders.placed", "outbox.x"));
        assert!(!selection.matches("order.placed", "elsewhere.order.placed"));
        assert!(Selection::default().matches("anything", "any.subject"));
    }

    #[test]
    fn mongodb_is_asked_for_the_types_the_patterns_match() {
        let filter = |types: &[&str]| {
            let selection = Selection {
                types: types.iter().map(|t| (*t).to_owned()).collect(),
                ..Selection::default()
            };
            selection.filter(None).get("type").cloned()
        };
        let regex = |pattern: &str| {
            Bson::RegularExpression(bson::Regex {
                pattern: pattern.into(),
                options: String::new(),
            })
        };
        assert_eq!(
            filter(&["order.*", "a+b", "*.placed", "audit.>"]),
            Some(Bson::Document(doc! { "$in": [
                regex("^order\\.[^.]+$"),
                regex("^a\\+b$"),
                regex("^[^.]+\\.placed$"),
                regex("^audit\\..+$"),
            ] }))
        );
        assert_eq!(filter(&[]), None);
    }

    #[test]
    fn bad_criteria_are_refused_with_the_flag_named() {
        let now = SystemTime::now();
        let bad = |selection: Selection| selection.validate().expect_err("refused");
        let backwards = Selection {
            since: Some(ago(now, Duration::from_secs(60))),
            until: Some(ago(now, Duration::from_secs(3600))),
            ..Selection::default()
        };
        assert!(bad(backwards).contains("--since"));
        let broken = Selection {
            types: vec!["order..placed".into()],
            ..Selection::default()
        };
        assert!(bad(broken).contains("--type"));
        let middle = Selection {
            subjects: vec!["a.>.b".into()],
            ..Selection::default()
        };
        assert!(bad(middle).contains("--subject"));
        assert!(Selection::default().validate().is_ok());
        assert!(Selection::default().is_everything());
    }
}
