//! Which messages a partition holds, as a query the server answers: a
//! leaf, so that the lease, the checkpoint and every source can name one.
//!
//! A message belongs to partition `keyHash mod P`: a key's messages share
//! their hash, so they share a partition, and a partition is a fixed
//! query, so a resume token stays good for it whoever owns it (a token is
//! only good for the pipeline that produced it). A document whose
//! `keyHash` is missing, not a number, an array or negative (written by
//! hand, or by an older writer) belongs to partition 0, the complement of
//! the others, so every document belongs to exactly one partition.

use bson::{doc, Bson, Document};

use crate::contract::field;

/// The most partitions a group may share: each is a change stream, a
/// lease and a sweep, and partition 0's query names every other.
pub const MOST_PARTITIONS: u32 = 64;

/// One of the `count` partitions of an outbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Partition {
    index: u32,
    count: u32,
}

impl Partition {
    /// The whole outbox: what a relay with `--partitions 1` delivers.
    pub const WHOLE: Partition = Partition { index: 0, count: 1 };

    /// Partition `index` of `count`; `None` unless `index < count`.
    pub fn new(index: u32, count: u32) -> Option<Partition> {
        (index < count).then_some(Partition { index, count })
    }

    /// Every partition of `count`, in order.
    pub fn all(count: u32) -> impl Iterator<Item = Partition> {
        (0..count).map(move |index| Partition { index, count })
    }

    pub fn index(self) -> u32 {
        self.index
    }

    pub fn count(self) -> u32 {
        self.count
    }

    /// The id of its lease and checkpoint document, from the outbox's
    /// (`<db>.<collection>`): the outbox's own for the whole, so that a
    /// relay with one partition keeps the document it always kept.
    pub fn document_id(self, outbox_id: &str) -> String {
        if self == Partition::WHOLE {
            outbox_id.to_owned()
        } else {
            format!("{outbox_id}:{}/{}", self.index, self.count)
        }
    }

    /// `filter`, narrowed to this partition's documents.
    pub fn scope(self, filter: Document) -> Document {
        match self.selector("") {
            Some(selector) => doc! { "$and": [filter, selector] },
            None => filter,
        }
    }

    /// The query selecting this partition's documents, whose fields are
    /// under `prefix` (`"fullDocument."` in a change event); `None` for
    /// the whole outbox.
    pub fn selector(self, prefix: &str) -> Option<Document> {
        if self == Partition::WHOLE {
            return None;
        }
        let path = format!("{prefix}{}", field::KEY_HASH);
        // `$mod` matches an array by any element, so arrays are kept out:
        // a document in two partitions would be published twice.
        let residue = |index: u32| {
            doc! { &path: {
                "$mod": [i64::from(self.count), i64::from(index)],
                "$not": { "$type": "array" },
            } }
        };
        Some(match self.index {
            0 => doc! {
                "$nor": (1..self.count).map(|i| Bson::Document(residue(i))).collect::<Vec<_>>()
            },
            index => residue(index),
        })
    }
}

impl std::fmt::Display for Partition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_whole_outbox_keeps_its_document_and_its_queries() {
        let filter = doc! { "status": "pending" };
        assert_eq!(Partition::WHOLE.scope(filter.clone()), filter);
        assert_eq!(Partition::WHOLE.document_id("app.outbox"), "app.outbox");
        assert!(Partition::WHOLE.selector("fullDocument.").is_none());
    }

    #[test]
    fn a_partition_has_a_document_of_its_own_naming_the_count() {
        let two_of_four = Partition::new(2, 4).expect("a partition");
        assert_eq!(two_of_four.document_id("app.outbox"), "app.outbox:2/4");
        assert_eq!(two_of_four.to_string(), "2/4");
        assert!(Partition::new(4, 4).is_none());
        assert_eq!(Partition::all(3).count(), 3);
    }

    #[test]
    fn partition_zero_takes_what_no_other_selects() {
        let zero = Partition::new(0, 3).expect("a partition");
        let expected = doc! { "$nor": [
            { "fullDocument.keyHash": { "$mod": [3_i64, 1_i64], "$not": { "$type": "array" } } },
            { "fullDocument.keyHash": { "$mod": [3_i64, 2_i64], "$not": { "$type": "array" } } },
        ] };
        assert_eq!(zero.selector("fullDocument."), Some(expected));
        let two = Partition::new(2, 3).expect("a partition");
        assert_eq!(
            two.scope(doc! { "status": "pending" }),
            doc! { "$and": [
                { "status": "pending" },
                { "keyHash": { "$mod": [3_i64, 2_i64], "$not": { "$type": "array" } } },
            ] }
        );
    }
}
