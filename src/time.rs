//! Moments as MongoDB stores them (`DateTime`, milliseconds), moved by a
//! `Duration`: one saturating conversion for every deadline the relay and
//! the inbox write or compare (lease expiries, lock ages, record expiries);
//! the ObjectId that a moment bounds; and the seconds between two moments,
//! and a moment as RFC 3339 text, as `status` shows them; and how long a
//! read that finds nothing changing waits.

use std::time::Duration;

use bson::{oid::ObjectId, DateTime};

/// How long a read that found nothing changing waits before it is made
/// again, for one made every `interval` while things change: six
/// intervals, at most a minute, and never less than the interval. A quiet
/// relay's reads of what only the database knows (the outbox's depths,
/// the held keys) follow it.
pub(crate) fn quiet_interval(interval: Duration) -> Duration {
    interval.saturating_mul(6).min(QUIET_AT_MOST).max(interval)
}

/// The longest [`quiet_interval`] (for an interval under 10 s, less).
const QUIET_AT_MOST: Duration = Duration::from_secs(60);

/// `time` plus `by`, at the latest representable moment if it overflows.
pub(crate) fn later(time: DateTime, by: Duration) -> DateTime {
    DateTime::from_millis(time.timestamp_millis().saturating_add(millis(by)))
}

/// `time` minus `by`, at the earliest representable moment if it overflows.
pub(crate) fn earlier(time: DateTime, by: Duration) -> DateTime {
    DateTime::from_millis(time.timestamp_millis().saturating_sub(millis(by)))
}

fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// The smallest ObjectId of the second `time` falls in: every id generated
/// before that second sorts below it. A time outside what an ObjectId
/// holds (before 1970, after 2106) bounds at its nearest end.
pub(crate) fn object_id_at(time: DateTime) -> ObjectId {
    let seconds = time
        .timestamp_millis()
        .div_euclid(1000)
        .clamp(0, i64::from(u32::MAX));
    let seconds = u32::try_from(seconds).unwrap_or(u32::MAX);
    let mut bytes = [0u8; 12];
    bytes[..4].copy_from_slice(&seconds.to_be_bytes());
    ObjectId::from_bytes(bytes)
}

/// The second an ObjectId was made in: a message's commit time, as the
/// outbox counts it.
pub(crate) fn made_at(id: &ObjectId) -> DateTime {
    DateTime::from_millis(id.timestamp().timestamp_millis())
}

/// How long from `now` until `then`: zero if it has passed.
pub(crate) fn until(now: DateTime, then: DateTime) -> Duration {
    let millis = then
        .timestamp_millis()
        .saturating_sub(now.timestamp_millis());
    Duration::from_millis(u64::try_from(millis).unwrap_or(0))
}

/// The seconds from `from` to `to`; negative if `to` is earlier.
pub(crate) fn seconds_between(from: DateTime, to: DateTime) -> f64 {
    (to.timestamp_millis() - from.timestamp_millis()) as f64 / 1000.0
}

/// A moment as RFC 3339 text, for a report or a message; its milliseconds
/// where it is out of that range.
pub(crate) fn shown(at: DateTime) -> String {
    at.try_to_rfc3339_string()
        .unwrap_or_else(|_| at.timestamp_millis().to_string())
}

/// Serializes a moment as RFC 3339 text, and none (or one out of range) as
/// null: `#[serde(serialize_with = "as_rfc3339")]`.
pub(crate) fn as_rfc3339<S: serde::Serializer>(
    time: &Option<DateTime>,
    serializer: S,
) -> std::result::Result<S::Ok, S::Error> {
    match time.and_then(|t| t.try_to_rfc3339_string().ok()) {
        Some(text) => serializer.serialize_some(&text),
        None => serializer.serialize_none(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quiet_read_waits_six_intervals_at_most_a_minute_never_less_than_one() {
        let secs = Duration::from_secs;
        assert_eq!(quiet_interval(secs(10)), secs(60));
        assert_eq!(
            quiet_interval(Duration::from_millis(100)),
            Duration::from_millis(600)
        );
        assert_eq!(quiet_interval(secs(30)), secs(60));
        assert_eq!(quiet_interval(secs(300)), secs(300));
    }

    #[test]
    fn a_moment_beyond_what_an_object_id_holds_bounds_at_its_end() {
        let far = DateTime::parse_rfc3339_str("2206-01-01T00:00:00Z").expect("a time");
        assert_eq!(object_id_at(far).bytes()[..4], u32::MAX.to_be_bytes());
        let early = DateTime::from_millis(-5_000);
        assert_eq!(object_id_at(early).bytes()[..4], [0; 4]);
    }
}
