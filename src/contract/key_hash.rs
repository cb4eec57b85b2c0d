//! The key hash every writer stores in `keyHash`.
//!
//! Relays that share one outbox will divide it by partition, each taking
//! the documents whose `keyHash` mod the partition count is its own, a
//! choice the server can make in a query without knowing how keys are
//! hashed. So the hash must be the same in every language: 32-bit FNV-1a
//! over the key's UTF-8 bytes, which is a few lines anywhere and needs no
//! library. `tests/writers/cases.json` (`keyHashes`) holds the vectors
//! all writers are tested against.

use bson::Bson;

const FNV_OFFSET_BASIS: u32 = 0x811c_9dc5;
const FNV_PRIME: u32 = 0x0100_0193;

/// The 32-bit FNV-1a hash of `key`'s UTF-8 bytes: from the offset basis,
/// each byte xored in and the result multiplied by the FNV prime, modulo
/// 2^32.
pub fn key_hash(key: &str) -> u32 {
    key.bytes().fold(FNV_OFFSET_BASIS, |hash, byte| {
        (hash ^ u32::from(byte)).wrapping_mul(FNV_PRIME)
    })
}

/// The `keyHash` a writer stores for a message with `key`: the key's hash,
/// or, for a message without a key, a uniformly random value, so that
/// keyless messages spread over the partitions instead of piling on one.
/// Always an int64: half the hashes do not fit an int32, and a double
/// would be a value no writer stores.
pub fn stored_key_hash(key: Option<&str>) -> Bson {
    let hash = key.map_or_else(rand::random::<u32>, key_hash);
    Bson::Int64(i64::from(hash))
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use serde::Deserialize;

    use super::*;

    /// The vectors every writer is held to, beside the writers' cases.
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Table {
        key_hashes: Vec<Vector>,
    }

    #[derive(Deserialize)]
    struct Vector {
        key: String,
        hash: u32,
    }

    #[test]
    fn the_published_fnv_1a_vectors_hold() {
        assert_eq!(key_hash(""), FNV_OFFSET_BASIS);
        assert_eq!(key_hash("a"), 0xe40c_292c);
        assert_eq!(key_hash("foobar"), 0xbf9c_f968);
    }

    #[test]
    fn every_vector_of_the_writers_table_holds() {
        let text = include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/writers/cases.json"
        ));
        let table: Table = serde_json::from_str(text).expect("the writers' case table");
        assert!(table.key_hashes.len() >= 10, "a table that tests");
        for vector in &table.key_hashes {
            assert_eq!(key_hash(&vector.key), vector.hash, "{:?}", vector.key);
        }
    }

    #[test]
    fn a_keyed_message_stores_its_keys_hash_as_an_int64() {
        assert_eq!(
            stored_key_hash(Some("a")),
            Bson::Int64(0xe40c_292c),
            "a hash past 2^31 stays positive"
        );
    }

    #[test]
    fn keyless_messages_store_spread_int64s_within_32_bits() {
        let hashes: HashSet<i64> = (0..64)
            .map(|_| match stored_key_hash(None) {
                Bson::Int64(hash) => hash,
                other => panic!("not an int64: {other:?}"),
            })
            .collect();
        assert!(hashes.iter().all(|hash| (0..1 << 32).contains(hash)));
        assert!(hashes.len() > 1, "random, not one value for all");
    }
}
