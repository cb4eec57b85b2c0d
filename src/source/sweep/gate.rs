//! Which keys a sweep pass may still send.
//!
//! A key's messages go in order, so a pass that cannot send one message of
//! a key sends no later message of it. A message is not the pass's to send
//! when another claim holds it, or when it, or an earlier message of its
//! key, is under way in another pipeline (the stream's, in a drain): that
//! pipeline sends it, and the rest of its key after it. The pass asks this
//! as it reads its candidates and again as it sends them, since another
//! pipeline can take a message up in between; once it has sent a message
//! of a key, what is under way of that key is its own.

use std::collections::HashSet;

use bson::Bson;

use crate::work::Underway;

/// A pass's kind: what it reads, and by whose rules it sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// Due messages, sent behind whatever of their key is under way.
    Due,
    /// Parked messages read back to release their keys: they go first, by
    /// their key's own rules, whatever else of the key is under way (the
    /// newer messages, which will be parked behind them).
    Release,
}

/// The keys a pass holds back and the keys it sends, for one pass.
#[derive(Debug)]
pub(super) struct KeyGate {
    kind: Kind,
    /// Keys of which a message was not the pass's to send.
    held_back: HashSet<String>,
    /// Keys of which the pass has sent a message.
    sending: HashSet<String>,
}

impl KeyGate {
    pub fn new(kind: Kind) -> Self {
        KeyGate {
            kind,
            held_back: HashSet::new(),
            sending: HashSet::new(),
        }
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// Another claim holds a message of `key`.
    pub fn hold_back(&mut self, key: Option<&str>) {
        self.held_back.extend(key.map(str::to_owned));
    }

    /// Whether the pass sends no more messages of `key`.
    pub fn holds_back(&self, key: Option<&str>) -> bool {
        key.is_some_and(|key| self.held_back.contains(key))
    }

    /// Whether the pass leaves message `id` of `key` to another pipeline:
    /// its key is held back, or it is under way elsewhere (which then
    /// holds its key back). A release pass leaves none.
    pub fn leaves(&mut self, underway: &Underway, id: &Bson, key: Option<&str>) -> bool {
        if self.kind == Kind::Release {
            return false;
        }
        if self.holds_back(key) {
            return true;
        }
        if key.is_some_and(|key| self.sending.contains(key)) {
            return false;
        }
        if underway.ahead(id, key) {
            self.hold_back(key);
            return true;
        }
        false
    }

    /// The pass sends a message of `key`.
    pub fn sends(&mut self, key: Option<&str>) {
        self.sending.extend(key.map(str::to_owned));
    }
}

#[cfg(test)]
mod tests {
    use bson::oid::ObjectId;

    use super::*;
    use crate::testing::keyed as message;

    #[test]
    fn a_key_under_way_elsewhere_is_left_whole_and_a_key_the_pass_sends_is_its_own() {
        let [first, second, third, other] = [(); 4].map(|()| ObjectId::new());
        let underway = Underway::default();
        let elsewhere = underway.enter(&message(first, "k"));
        let mut gate = KeyGate::new(Kind::Due);
        let id = |id| Bson::ObjectId(id);
        assert!(!gate.leaves(&underway, &id(other), Some("free")));
        assert!(
            gate.leaves(&underway, &id(second), Some("k")),
            "behind one under way"
        );
        drop(elsewhere);
        assert!(
            gate.leaves(&underway, &id(third), Some("k")),
            "the key stays held back for the rest of the pass"
        );

        // Once the pass sends a message of a key, the key's entries under
        // way are its own.
        let mut gate = KeyGate::new(Kind::Due);
        assert!(!gate.leaves(&underway, &id(first), Some("k")));
        gate.sends(Some("k"));
        let _own = underway.enter(&message(first, "k"));
        assert!(!gate.leaves(&underway, &id(second), Some("k")));

        // Another claim holds a key back, for a release pass too.
        let mut release = KeyGate::new(Kind::Release);
        release.hold_back(Some("held"));
        assert!(release.holds_back(Some("held")));
        assert!(
            !release.leaves(&underway, &id(third), Some("k")),
            "a release goes first, whatever of its key is under way"
        );
    }
}
