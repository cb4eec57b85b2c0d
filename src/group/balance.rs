//! Who takes and who gives which partitions: a pure rule over one view
//! of the group, applied by every relay each round.
//!
//! The share is counted over the relays that deliver or have just joined
//! (`Member::counts`): a relay that died holds no lease once its leases
//! lapse, so the survivors' share grows at once rather than when its
//! announcement expires, and a standby beyond the partitions' number
//! waits without lowering anyone's share.
//!
//! With `n` counted relays and `P` partitions each ends with `P / n` or
//! one more (`fewest`, `most`):
//! - a relay holding more than `most` gives the excess back, each gracefully;
//! - a relay below `most` takes a free partition, unless some counted relay
//!   is below `fewest` and it is not: the one below goes first;
//! - when nothing is free and a counted relay is below `fewest`, the relay
//!   holding most (the lowest name among equals) gives one, and does not
//!   take again for a while (`cooling`), so it is the one below that takes it.
//!
//! Every step moves a partition towards a relay below its share, so the
//! group settles, and a settled group moves nothing.

use std::collections::BTreeMap;

use crate::partition::Partition;

/// One relay of the group, as this round's view shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub name: String,
    /// Whether it counts towards the share: it holds a partition, or
    /// joined too recently to have taken one.
    pub counts: bool,
}

/// Who holds a partition, as this round's view shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Holder {
    /// Nobody: never taken, released, or lapsed (or a lease no one can
    /// read, which a take mends).
    Free,
    /// A live lease of this relay.
    Relay(String),
}

/// What one relay does this round.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Moves {
    /// Free partitions to try to take, best first.
    pub take: Vec<Partition>,
    /// Partitions of its own to hand over gracefully.
    pub give: Vec<Partition>,
}

/// What the relay `me` does, holding `mine`, given the group's `members`
/// and the `holders` of every partition. `cooling`: it gave a partition
/// away a short while ago.
pub fn moves(
    me: &str,
    mine: &[Partition],
    members: &[Member],
    holders: &BTreeMap<Partition, Holder>,
    cooling: bool,
) -> Moves {
    let count = u32::try_from(holders.len()).unwrap_or(u32::MAX);
    let mut held: BTreeMap<&str, u32> = BTreeMap::new();
    for member in members.iter().filter(|m| m.counts && m.name != me) {
        held.insert(&member.name, 0);
    }
    held.insert(me, 0);
    for holder in holders.values() {
        if let Holder::Relay(name) = holder {
            if let Some(n) = held.get_mut(name.as_str()) {
                *n += 1;
            }
        }
    }
    // What this relay runs is what it holds, whatever the view says.
    let own = u32::try_from(mine.len()).unwrap_or(u32::MAX);
    held.insert(me, own);
    let relays = u32::try_from(held.len()).unwrap_or(u32::MAX).max(1);
    let (fewest, most) = (count / relays, count.div_ceil(relays));
    let mut moves = Moves::default();
    if own > most {
        let mut giving: Vec<Partition> = mine.to_vec();
        giving.sort_unstable();
        moves.give = giving.split_off(usize::try_from(most).unwrap_or(usize::MAX));
        return moves;
    }
    let short = held.iter().any(|(name, n)| *name != me && *n < fewest);
    let free: Vec<Partition> = holders
        .iter()
        .filter(|(_, holder)| **holder == Holder::Free)
        .map(|(partition, _)| *partition)
        .filter(|partition| !mine.contains(partition))
        .collect();
    if !free.is_empty() {
        let may_take = own < fewest || (own < most && !short && !cooling);
        if may_take {
            let room = usize::try_from(most - own).unwrap_or(usize::MAX);
            moves.take = spread(free, me).into_iter().take(room).collect();
        }
        return moves;
    }
    // Nothing free, and someone below the share: the richest gives one.
    let richest = held
        .iter()
        .max_by(|(a_name, a), (b_name, b)| a.cmp(b).then_with(|| b_name.cmp(a_name)))
        .map(|(name, _)| *name);
    if short && own > fewest && richest == Some(me) {
        moves.give = mine.iter().max().copied().into_iter().collect();
    }
    moves
}

/// The free partitions in an order of this relay's own, so that relays
/// taking at once try different ones first.
fn spread(mut free: Vec<Partition>, me: &str) -> Vec<Partition> {
    let seed = me.bytes().fold(0_u32, |hash, byte| {
        hash.wrapping_mul(31).wrapping_add(u32::from(byte))
    });
    let len = free.len();
    if len > 0 {
        free.rotate_left(usize::try_from(seed).unwrap_or(0) % len);
    }
    free
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A group in a test: each relay's partitions, and who has just joined.
    struct Group {
        count: u32,
        relays: BTreeMap<String, Vec<Partition>>,
        cooling: BTreeMap<String, u32>,
    }

    impl Group {
        fn new(count: u32, names: &[&str]) -> Self {
            Group {
                count,
                relays: names
                    .iter()
                    .map(|n| ((*n).to_owned(), Vec::new()))
                    .collect(),
                cooling: BTreeMap::new(),
            }
        }

        fn holders(&self) -> BTreeMap<Partition, Holder> {
            Partition::all(self.count)
                .map(|p| {
                    let holder = self
                        .relays
                        .iter()
                        .find(|(_, held)| held.contains(&p))
                        .map_or(Holder::Free, |(name, _)| Holder::Relay(name.clone()));
                    (p, holder)
                })
                .collect()
        }

        fn members(&self) -> Vec<Member> {
            self.relays
                .keys()
                .map(|name| Member {
                    name: name.clone(),
                    counts: true,
                })
                .collect()
        }

        /// One round: every relay decides on the same view, gives at once,
        /// and takes in name order where still free. Returns whether
        /// anything moved.
        fn round(&mut self) -> bool {
            let (holders, members) = (self.holders(), self.members());
            let names: Vec<String> = self.relays.keys().cloned().collect();
            let plans: Vec<(String, Moves)> = names
                .iter()
                .map(|name| {
                    let cooling = self.cooling.get(name).is_some_and(|n| *n > 0);
                    (
                        name.clone(),
                        moves(name, &self.relays[name], &members, &holders, cooling),
                    )
                })
                .collect();
            let mut moved = false;
            for cooling in self.cooling.values_mut() {
                *cooling = cooling.saturating_sub(1);
            }
            for (name, plan) in &plans {
                if !plan.give.is_empty() {
                    moved = true;
                    self.relays
                        .get_mut(name)
                        .expect("a relay")
                        .retain(|p| !plan.give.contains(p));
                    self.cooling.insert(name.clone(), 3);
                }
            }
            for (name, plan) in &plans {
                for partition in &plan.take {
                    if self.holders()[partition] == Holder::Free {
                        moved = true;
                        self.relays.get_mut(name).expect("a relay").push(*partition);
                    }
                }
            }
            moved
        }

        /// Rounds until nothing moves; how many it took.
        fn settle(&mut self) -> usize {
            for round in 1..=50 {
                if !self.round() {
                    return round;
                }
            }
            panic!("the group did not settle: {:?}", self.relays);
        }

        fn shares(&self) -> Vec<usize> {
            let mut shares: Vec<usize> = self.relays.values().map(Vec::len).collect();
            shares.sort_unstable();
            shares
        }
    }

    #[test]
    fn one_relay_takes_every_partition() {
        let mut group = Group::new(4, &["a"]);
        group.settle();
        assert_eq!(group.shares(), [4]);
    }

    #[test]
    fn one_partition_has_one_holder_and_the_others_stand_by() {
        let mut group = Group::new(1, &["a", "b", "c"]);
        group.settle();
        assert_eq!(group.shares(), [0, 0, 1]);
    }

    #[test]
    fn relays_joining_one_by_one_end_with_fair_shares() {
        for (count, relays, expected) in [
            (4, 2, vec![2, 2]),
            (4, 3, vec![1, 1, 2]),
            (4, 4, vec![1, 1, 1, 1]),
            (4, 5, vec![0, 1, 1, 1, 1]),
            (7, 3, vec![2, 2, 3]),
            (64, 5, vec![12, 13, 13, 13, 13]),
        ] {
            let names: Vec<String> = (0..relays).map(|i| format!("relay-{i}")).collect();
            let mut group = Group::new(count, &[names[0].as_str()]);
            group.settle();
            for name in &names[1..] {
                group.relays.insert(name.clone(), Vec::new());
                group.settle();
            }
            assert_eq!(
                group.shares(),
                expected,
                "{count} partitions, {relays} relays"
            );
            assert!(!group.round(), "a settled group moves nothing");
        }
    }

    #[test]
    fn the_survivors_share_what_a_relay_that_died_held() {
        let mut group = Group::new(4, &["a", "b", "c"]);
        group.settle();
        let (dead, _) = group
            .relays
            .iter()
            .max_by_key(|(_, held)| held.len())
            .map(|(name, held)| (name.clone(), held.clone()))
            .expect("a relay");
        group.relays.remove(&dead);
        let rounds = group.settle();
        assert_eq!(group.shares(), [2, 2]);
        assert!(rounds <= 2, "took {rounds} rounds");
    }

    #[test]
    fn a_relay_holding_more_than_the_most_gives_the_excess() {
        let mine: Vec<Partition> = Partition::all(4).collect();
        let holders = mine
            .iter()
            .map(|p| (*p, Holder::Relay("a".to_owned())))
            .collect();
        let plan = moves("a", &mine, &members(&["a", "b"], &[]), &holders, false);
        assert_eq!(plan.give, mine[2..].to_vec());
        assert!(plan.take.is_empty());
    }

    /// Members named `counting`, each counted towards the share, and
    /// `standing_by`, each not.
    fn members(counting: &[&str], standing_by: &[&str]) -> Vec<Member> {
        let member = |name: &&str, counts| Member {
            name: (*name).to_owned(),
            counts,
        };
        counting
            .iter()
            .map(|name| member(name, true))
            .chain(standing_by.iter().map(|name| member(name, false)))
            .collect()
    }

    #[test]
    fn a_standby_that_does_not_count_lowers_no_share() {
        let p = |i| Partition::new(i, 4).expect("a partition");
        let holders: BTreeMap<Partition, Holder> = [
            (p(0), Holder::Relay("r0".to_owned())),
            (p(1), Holder::Relay("r0".to_owned())),
            (p(2), Holder::Relay("r1".to_owned())),
            (p(3), Holder::Relay("r1".to_owned())),
        ]
        .into();
        let mine = [p(0), p(1)];
        // Counted, `s` would be below its share, and r0, the richest with
        // the lowest name, would hand it a partition.
        let counted = moves(
            "r0",
            &mine,
            &members(&["r0", "r1", "s"], &[]),
            &holders,
            false,
        );
        assert_eq!(counted.give, [p(1)], "the case the filter decides");
        let standing_by = members(&["r0", "r1"], &["s"]);
        assert_eq!(
            moves("r0", &mine, &standing_by, &holders, false),
            Moves::default()
        );
    }

    #[test]
    fn a_relay_that_gave_lately_leaves_the_free_partition_to_the_one_below() {
        // Five partitions over three relays: each holds one or two. `a`
        // has just handed p1 over; it and `c` are both below the most.
        let p = |i| Partition::new(i, 5).expect("a partition");
        let holders: BTreeMap<Partition, Holder> = [
            (p(0), Holder::Relay("a".to_owned())),
            (p(1), Holder::Free),
            (p(2), Holder::Relay("b".to_owned())),
            (p(3), Holder::Relay("b".to_owned())),
            (p(4), Holder::Relay("c".to_owned())),
        ]
        .into();
        let members = members(&["a", "b", "c"], &[]);
        assert_eq!(
            moves("a", &[p(0)], &members, &holders, false).take,
            [p(1)],
            "not cooling, it would take it back: the case cooling decides"
        );
        assert!(moves("a", &[p(0)], &members, &holders, true)
            .take
            .is_empty());
        assert_eq!(moves("c", &[p(4)], &members, &holders, false).take, [p(1)]);
    }
}
