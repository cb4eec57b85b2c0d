//! The writers in other languages (`examples/writers/`) spell out what the
//! contract's CloudEvents rules are made of: the source pattern, the core
//! attributes' names, the longest attribute name. They are held here to
//! the relay's own constants, so that changing one without the others
//! fails at once, and not as a document one writer takes and the relay
//! refuses.

use std::path::PathBuf;

use outbox_relay::contract::cloudevents::{CORE_ATTRIBUTES, MAX_ATTRIBUTE_NAME, URI_REFERENCE};

/// The writers, by language, with the source of each.
fn writers() -> [(&'static str, String); 2] {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/writers");
    let read = |path: &str| {
        let path = root.join(path);
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    };
    [
        ("Python", read("python/outbox.py")),
        ("Node.js", read("node/outbox.js")),
    ]
}

/// The quoted words of the list a writer names `CORE_ATTRIBUTES`, from its
/// definition to the bracket that closes it.
fn core_attributes(writer: &str, source: &str) -> Vec<String> {
    let start = source
        .find("CORE_ATTRIBUTES = ")
        .unwrap_or_else(|| panic!("{writer} defines CORE_ATTRIBUTES"));
    let list = &source[start..];
    let end = list
        .find([')', ']'])
        .unwrap_or_else(|| panic!("{writer}: CORE_ATTRIBUTES is closed"));
    list[..end]
        .split(['"', '\''])
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

#[test]
fn each_writer_matches_sources_with_the_relays_own_pattern() {
    for (writer, source) in writers() {
        assert!(
            source.contains(URI_REFERENCE),
            "{writer}'s writer does not hold the relay's URI_REFERENCE verbatim: a source one \
             of them takes, the other may refuse"
        );
    }
}

#[test]
fn each_writer_reserves_the_core_attributes_and_limits_names_as_the_relay_does() {
    for (writer, source) in writers() {
        assert_eq!(
            core_attributes(writer, &source),
            CORE_ATTRIBUTES,
            "{writer}: the core attributes, in the relay's order"
        );
        let limit = format!("MAX_ATTRIBUTE_NAME = {MAX_ATTRIBUTE_NAME}");
        let defined = source.lines().any(|line| {
            let line = line.trim().trim_start_matches("export const ");
            line.trim_end_matches(';') == limit
        });
        assert!(defined, "{writer} defines {limit}");
    }
}
