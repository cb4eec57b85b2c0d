//! Moments as MongoDB stores them (`DateTime`, milliseconds), moved by a
//! `Duration`: one saturating conversion for every deadline the relay and
//! the inbox write or compare (lease expiries, lock ages, record expiries).

use std::time::Duration;

use bson::DateTime;

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
