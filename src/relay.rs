//! The relay: connects the stages and runs them until shutdown.
//!
//! ```text
//! change stream ──▶ publish stage ──▶ completion stage
//! (+ catch-up)      (NATS, ordered,    (marks in MongoDB,
//!                    acks pipelined)    then checkpoint)
//! sweep, every interval ──▶ its own publish and completion stages
//! ```
//!
//! Each stage is a task joined by bounded channels, so a slow stage holds
//! back the ones before it rather than piling up memory. Shutdown runs front
//! to back: the sources stop reading, the publish stages finish what is in
//! flight, and the completion stages record it and write the final token.
//! In poll mode the sweep runs alone.
//!
//! Only the relay holding the lease publishes, in either mode: the stream
//! and the sweep of one term share its per-key order ([`KeyOrder`]), read
//! back from MongoDB when the term starts, so each key has one line.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mongodb::change_stream::event::ResumeToken;
use mongodb::Database;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::checkpoint::{CheckpointStore, KeptPlace};
use crate::config::{RelayConfig, RelayMode};
use crate::connect::{connect_mongodb_for_coordination, connect_mongodb_observed, coordinated};
use crate::contract::DecodeRules;
use crate::error::{Error, Result};
use crate::group::{balance, watch::Changes, Group, OutboxLease, Renewal};
use crate::lease::{Held, Lease, Term};
use crate::observe::{self, Metrics, Role};
use crate::order::{self, KeyOrder};
use crate::partition::Partition;
use crate::pipeline::Pipeline;
use crate::publish::{NatsPublisher, Publisher, StreamSetup};
use crate::retry::{until_ok, until_settled, Outage};
use crate::server_clock::ServerClock;
use crate::setup;
use crate::source::change_stream::{ChangeStreamSource, Prepare};
use crate::source::progress::StreamProgress;
use crate::source::sweep::Sweeper;
use crate::stop::Stop;
use crate::work::{Acknowledged, Budget, LastDelivery, Tally, Tenure, Underway, Unmarkable};

/// A connected relay, ready to run.
pub struct Relay {
    config: RelayConfig,
    /// How documents become messages, for any broker's largest message.
    rules: DecodeRules,
    database: Database,
    /// Where the lease and the checkpoint are kept: a client of its own
    /// where the relay connects itself (see
    /// [`Relay::with_coordination`]).
    coordination: Database,
    publisher: Arc<dyn Publisher>,
    metrics: Metrics,
    unmarkable: Unmarkable,
    budget: Budget,
    underway: Underway,
    deliveries: LastDelivery,
    /// Where this relay's last term of each partition stopped, for its
    /// next (see `KeptPlace`).
    places: Mutex<BTreeMap<Partition, KeptPlace>>,
    /// What NATS acknowledged and is not marked yet, across terms.
    acknowledged: Acknowledged,
}

impl Relay {
    /// Checks the configuration, connects to MongoDB and NATS, and prepares
    /// the outbox collection (indexes, retention, validator if asked).
    pub async fn connect(config: RelayConfig) -> Result<Self> {
        Self::connect_observed(config, Metrics::new()).await
    }

    /// [`Relay::connect`] for `sweep --once`, which creates a missing sweep
    /// index but leaves retention and the validator to the relays
    /// ([`setup::Preparer`]).
    pub async fn connect_for_sweep_once(config: RelayConfig) -> Result<Self> {
        Self::connect_as(config, Metrics::new(), setup::Preparer::SweepOnce).await
    }

    /// [`Relay::connect`], recording into `metrics` from the first connection on.
    pub async fn connect_observed(config: RelayConfig, metrics: Metrics) -> Result<Self> {
        Self::connect_as(config, metrics, setup::Preparer::Run).await
    }

    async fn connect_as(
        config: RelayConfig,
        metrics: Metrics,
        preparer: setup::Preparer,
    ) -> Result<Self> {
        config.validate()?;
        let streams = config.partitions;
        let (client, _) =
            connect_mongodb_observed(&config.mongodb_uri, Some(&metrics), streams).await?;
        let database = client.database(&config.database);
        let coordination = connect_mongodb_for_coordination(&config.mongodb_uri, config.partitions)
            .await?
            .database(&config.database);
        let nats = NatsPublisher::connect(&config, &metrics).await?;
        if let Some(name) = &config.create_stream {
            StreamSetup::for_relay(name, &config)
                .ensure(&nats.client())
                .await?;
        }
        crate::check::jetstream(&nats.client(), &config).await?;
        let mut relay = Self::with_publisher(config, database, Arc::new(nats))?
            .with_coordination(&coordination);
        relay.metrics = metrics;
        setup::prepare(&relay.database, &relay.config, preparer).await?;
        Ok(relay)
    }

    /// A relay over an existing database handle and any publisher. Call
    /// [`Relay::prepare`] before the first run if the collection is new.
    pub fn with_publisher(
        config: RelayConfig,
        database: Database,
        publisher: Arc<dyn Publisher>,
    ) -> Result<Self> {
        config.validate()?;
        // Writes wait no longer than a lease lasts: past that, a renewal
        // is too late anyway.
        let database = coordinated(&database, config.lease_duration);
        Ok(Relay {
            rules: config.decode_rules(usize::MAX)?,
            budget: Budget::new(u32::try_from(config.max_buffered_bytes.0).unwrap_or(u32::MAX)),
            coordination: database.clone(),
            config,
            database,
            publisher,
            metrics: Metrics::new(),
            unmarkable: Unmarkable::default(),
            underway: Underway::default(),
            deliveries: LastDelivery::default(),
            places: Mutex::default(),
            acknowledged: Acknowledged::default(),
        })
    }

    /// Keeps the lease and the checkpoint through `database` (a handle on
    /// the same database by a client of its own, say), so that renewing
    /// the lease never waits for a connection behind the relay's own reads
    /// and marks. Without it they share the relay's handle.
    pub fn with_coordination(mut self, database: &Database) -> Self {
        self.coordination = coordinated(database, self.config.lease_duration);
        self
    }

    /// The relay's metrics and readiness.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Ensures the outbox collection's indexes, retention and validator.
    /// A server that does not finish this within [`setup::SETUP_TIMEOUT`] is
    /// reported rather than waited on forever.
    pub async fn prepare(&self) -> Result<()> {
        setup::prepare(&self.database, &self.config, setup::Preparer::Run).await
    }

    /// Runs until `shutdown` fires, then stops gracefully: in-flight messages
    /// are finished and recorded and the resume token is written, within the
    /// configured shutdown timeout.
    pub async fn run(self, shutdown: CancellationToken) -> Result<()> {
        let config = self.config.clone();
        let config = &config;
        let stop = Stop::after_grace(shutdown.clone(), config.shutdown_timeout);
        let pipeline = self.pipeline(&stop);
        tracing::info!(
            database = %config.database,
            collection = %config.collection,
            subject_prefix = %config.subject_prefix,
            mode = ?config.mode,
            nats_mode = ?config.nats_mode,
            "relay running"
        );
        // The endpoints outlive the pipeline, so readiness can be watched
        // while a stop drains; they close when `run` returns, however it does.
        let stop_serving = CancellationToken::new();
        let _serving = stop_serving.clone().drop_guard();
        if let Some(addr) = config.metrics_addr {
            observe::serve(addr, self.metrics.clone(), stop_serving).await?;
        }
        let mut tasks = JoinSet::new();
        tasks.spawn(mark_stopping(self.metrics.clone(), shutdown.clone()));
        tasks.spawn(observe::collect(self.collector(), shutdown.clone()));
        tasks.spawn(crate::audit::watch(self.audit_watch(), shutdown.clone()));
        let relay = Arc::new(self);
        let led = relay.lead_while_elected(&pipeline, &stop).await;
        if led.is_err() {
            shutdown.cancel();
        }
        while let Some(joined) = tasks.join_next().await {
            if let Err(error) = joined {
                shutdown.cancel();
                return Err(Error::Internal(format!(
                    "a relay task stopped unexpectedly: {error}"
                )));
            }
        }
        led?;
        if stop.abandon.is_cancelled() {
            return Err(Error::ShutdownTimeout(config.shutdown_timeout));
        }
        tracing::info!("relay stopped");
        Ok(())
    }

    /// Takes and delivers this relay's share of the outbox's partitions
    /// (all of them, or none, with one), in rounds (see [`group`]), until
    /// `shutdown` fires: then each partition it holds is finished,
    /// recorded and released, so the others take it at once.
    ///
    /// An error if the group runs with another partition count as this
    /// relay starts. One that takes another count later (this relay was
    /// cut off for a lease, and relays of that count started meanwhile)
    /// stops this relay's deliveries at once, and it stands by until
    /// those relays are gone.
    async fn lead_while_elected(self: &Arc<Self>, pipeline: &Pipeline, stop: &Stop) -> Result<()> {
        // The group's announcements and rounds count on a reading of the
        // server's clock for three quarters of a lease (see
        // `server_clock`): the partitions' renewals read it afresh, and a
        // relay that holds none reads it every other announcement.
        let clock = Arc::new(ServerClock::new(
            self.coordination.client(),
            self.config.lease_duration.mul_f64(0.75),
        ));
        let lease = self.lease().with_clock(Arc::clone(&clock));
        let group = self.group(lease.owner()).with_clock(clock);
        self.metrics.set_role_unless_stopping(Role::Standby);
        let watching = stop.shutdown.child_token();
        let _stop_watching = watching.clone().drop_guard();
        let changes = group.watch(&self.database, watching);
        let member = Membership {
            group: &group,
            lease: &lease,
            pipeline,
            stop,
            changes: &changes,
        };
        let mut shares = Shares::default();
        let mut refused_at_start = true;
        let ended = loop {
            // A refusal as the relay starts is a setting to change; later,
            // a group to wait out.
            let joining = until_settled(
                "MongoDB joining the group of relays",
                &stop.shutdown,
                || group.join(),
                |error| refused_at_start && matches!(error, Error::Config(_)),
            );
            let joined = tokio::select! {
                biased;
                _ = stop.shutdown.cancelled() => None,
                joined = joining => joined,
            };
            match joined {
                None => break Ok(()),
                Some(Err(error)) => break Err(error),
                Some(Ok(())) => {}
            }
            refused_at_start = false;
            match self.take_shares(&member, &mut shares).await {
                Ok(()) => break Ok(()),
                Err(error) => {
                    tracing::error!(
                        %error,
                        "the group now runs with another partition count: this relay stops \
                         delivering, and stands by until those relays are gone"
                    );
                    shares.abandon_all().await;
                    self.show_role(&shares);
                }
            }
        };
        // A stopping relay leaves at once, so the others count it out of
        // the share while it finishes its partitions; a MongoDB that does
        // not answer delays neither.
        let leaving = async {
            match tokio::time::timeout(RELEASE_TIMEOUT, group.leave()).await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => tracing::warn!(
                    %error,
                    "could not leave the group of relays; its announcement expires"
                ),
                Err(_) => tracing::warn!(
                    "MongoDB did not answer within {RELEASE_TIMEOUT:?}: this relay's \
                     announcement expires instead"
                ),
            }
        };
        tokio::join!(leaving, shares.stop_all());
        ended
    }

    /// The rounds of [`Relay::lead_while_elected`], until `shutdown` fires
    /// (`Ok`) or the group turns out to use another partition count.
    ///
    /// A round comes when the group changes (see [`group::watch`]), when
    /// something the last one read lapses, when one of this relay's
    /// partitions ends, and every `--standby-poll-interval` while moves
    /// are still to be made or the watch is not open; a settled group is
    /// read again only every [`SETTLED_ROUNDS`] leases. Renewals come every
    /// half lease, and before a take where the last is older than a
    /// renewal interval.
    async fn take_shares(
        self: &Arc<Self>,
        member: &Membership<'_>,
        shares: &mut Shares,
    ) -> Result<()> {
        let stop = member.stop;
        let mut outages = Outages {
            renewing: Outage::new("MongoDB renewing this relay in its group"),
            reading: Outage::new("MongoDB reading the group of relays"),
        };
        shares.next_round = None;
        loop {
            // A stop does not wait for a MongoDB that does not answer: a
            // take cut short leaves a lease that lapses unused.
            let round = self.renew_and_round(member, shares, &mut outages);
            tokio::select! {
                biased;
                _ = stop.shutdown.cancelled() => return Ok(()),
                refused = round => refused?,
            }
            self.show_role(shares);
            let wake = self.next_wake(shares);
            tokio::select! {
                _ = stop.shutdown.cancelled() => return Ok(()),
                Some(ended) = shares.serving.join_next() => {
                    shares.ended(ended);
                    shares.next_round = None;
                }
                _ = member.changes.changed() => shares.next_round = None,
                // A watch that closes hears no more: the rounds poll.
                _ = member.changes.closed(), if member.changes.open() => shares.next_round = None,
                _ = tokio::time::sleep_until(wake) => {}
            }
        }
    }

    /// When the loop wakes next: for the next round, or for a renewal due
    /// first. A renewal that keeps failing is tried again every quarter of
    /// a poll, not at once.
    fn next_wake(&self, shares: &Shares) -> tokio::time::Instant {
        let now = tokio::time::Instant::now();
        let poll = self.config.standby_poll_interval;
        let renewal = match shares.renewed_at {
            Some(at) => self.membership_renewal().saturating_sub(at.elapsed()),
            None => Duration::ZERO,
        };
        let renewal = now + renewal.max(poll / 4);
        shares
            .next_round
            .map_or(renewal, |round| round.min(renewal))
    }

    /// How often this relay renews its place in the group: every half of
    /// the lease its announcement lasts (never more often than a
    /// partition's lease, whose `--lease-renew-interval` is at most half of
    /// it, is renewed by its own keeper).
    fn membership_renewal(&self) -> Duration {
        self.config.lease_duration / 2
    }

    /// Renews this relay's place in the group when due and runs a round
    /// when one is. Errors other than a refusal are the outages' to report.
    async fn renew_and_round(
        self: &Arc<Self>,
        member: &Membership<'_>,
        shares: &mut Shares,
        outages: &mut Outages,
    ) -> Result<()> {
        if shares
            .renewed_at
            .is_none_or(|at| at.elapsed() >= self.membership_renewal())
        {
            let renewal = match (shares.units.is_empty(), shares.held_by_others) {
                (true, true) => Renewal::Announcement,
                _ => Renewal::Whole,
            };
            self.renew(member, shares, outages, renewal).await?;
        }
        let now = tokio::time::Instant::now();
        if shares.next_round.is_some_and(|due| now < due) {
            return Ok(());
        }
        let next = match self.round(member, shares, outages).await {
            Ok(RoundEnd::Settled { lapse }) if member.changes.open() => {
                outages.reading.recovered();
                self.settled_round(shares, lapse)
            }
            Ok(_) => {
                outages.reading.recovered();
                now + self.config.standby_poll_interval
            }
            Err(error @ Error::Config(_)) => return Err(error),
            Err(error) => {
                outages.reading.failed(&error);
                now + self.config.standby_poll_interval
            }
        };
        shares.next_round = Some(next);
        Ok(())
    }

    /// Renews this relay's place in the group as `renewal` says, timed
    /// from before the server read its clock, as a lease is.
    async fn renew(
        &self,
        member: &Membership<'_>,
        shares: &mut Shares,
        outages: &mut Outages,
        renewal: Renewal,
    ) -> Result<()> {
        let began = Instant::now();
        match member.group.renew(renewal).await {
            Ok(()) => {
                shares.renewed_at = Some(began);
                if renewal == Renewal::Whole {
                    shares.group_renewed_at = Some(began);
                }
                outages.renewing.recovered();
            }
            Err(error @ Error::Config(_)) => return Err(error),
            Err(error) => outages.renewing.failed(&error),
        }
        Ok(())
    }

    /// When the round after a settled one comes, with the watch open: when
    /// something the round read lapses, or cooling or a rejoin falls due,
    /// and at the latest [`SETTLED_ROUNDS`] leases on (a change the watch
    /// missed is read then). Never sooner than a quarter of a poll: no
    /// loop spins on a lapse the server's clock has not reached.
    fn settled_round(
        &self,
        shares: &Shares,
        lapse: Option<tokio::time::Instant>,
    ) -> tokio::time::Instant {
        let now = tokio::time::Instant::now();
        let latest = now + self.config.lease_duration.saturating_mul(SETTLED_ROUNDS);
        let cooling = shares.cooling_until.map(tokio::time::Instant::from_std);
        let rejoin = shares
            .rejoined_at
            .filter(|_| shares.units.is_empty())
            .map(|at| {
                tokio::time::Instant::from_std(
                    at + self.config.lease_duration.saturating_mul(REJOIN_LEASES),
                )
            });
        // A lapse may have come while the round read (a slow server): it
        // is due at once. Cooling or a rejoin that is past is nothing to
        // wake for.
        let later = [cooling, rejoin]
            .into_iter()
            .flatten()
            .filter(|at| *at > now);
        lapse
            .into_iter()
            .chain(later)
            .fold(latest, tokio::time::Instant::min)
            .max(now + self.config.standby_poll_interval / 4)
    }

    /// One round: reads the group, and takes or hands over partitions as
    /// [`balance::moves`] says.
    ///
    /// A relay takes a partition only while its renewal of the group's
    /// document is younger than half a lease: one whose renewals stall
    /// could otherwise take a lease beside relays of another count that
    /// took the group meanwhile. Before a take it renews the document where
    /// the last renewal of it is older than a renewal interval.
    async fn round(
        self: &Arc<Self>,
        member: &Membership<'_>,
        shares: &mut Shares,
        outages: &mut Outages,
    ) -> Result<RoundEnd> {
        let Membership {
            group,
            lease,
            pipeline,
            stop,
            ..
        } = *member;
        let view = group.view().await?;
        self.metrics.group_read();
        // Held by another member: a `sweep --once` run holds the outbox's
        // lease without being one, and keeps no other count out.
        shares.held_by_others = view.holders.values().any(|holder| {
            matches!(holder, balance::Holder::Relay(name)
                if name != lease.owner() && view.members.iter().any(|m| &m.name == name))
        });
        // A lease of this relay's with no unit delivering it (its keeper
        // gave up on a renewal answered late) lapses with no write to
        // hear: the rounds poll until it does, and take it back.
        let lapsing = view.holders.iter().any(|(partition, holder)| {
            matches!(holder, balance::Holder::Relay(name) if name == lease.owner())
                && !shares.units.contains_key(partition)
        });
        let settled = if lapsing {
            RoundEnd::Unsettled
        } else {
            RoundEnd::Settled {
                lapse: view.next_lapse,
            }
        };
        if view.lapsed {
            group.clear_lapsed().await;
        }
        let mine: Vec<Partition> = shares.units.keys().copied().collect();
        let lease_duration = self.config.lease_duration;
        // A relay that holds nothing and no longer counts as joining (its
        // leases lapsed while it was cut off, or a hand-over to it took
        // long) joins anew, so that the others make room for it; not more
        // often than every few leases, so that one that cannot keep a
        // partition does not keep the others handing theirs over.
        let counted = view
            .members
            .iter()
            .any(|m| m.name == lease.owner() && m.counts);
        let rejoin_due = shares
            .rejoined_at
            .is_none_or(|at| at.elapsed() >= lease_duration.saturating_mul(REJOIN_LEASES));
        if mine.is_empty() && !counted && rejoin_due {
            group.rejoin().await?;
            shares.rejoined_at = Some(Instant::now());
            // The others make room from their next rounds: this relay
            // looks again at the next poll.
            return Ok(RoundEnd::Unsettled);
        }
        let cooling = shares
            .cooling_until
            .is_some_and(|until| Instant::now() < until);
        let moves = balance::moves(lease.owner(), &mine, &view.members, &view.holders, cooling);
        for partition in moves.give {
            if let Some(unit) = shares.units.get_mut(&partition) {
                if !unit.handing_over {
                    tracing::info!(%partition, "handing the partition over to a relay below its share");
                    unit.handing_over = true;
                    unit.stop.shutdown.cancel();
                    shares.cooling_until = Some(Instant::now() + lease_duration);
                }
            }
        }
        // A take beside another holder of the outbox's own lease would be
        // released at once (see `lease`): the group waits for it instead.
        if view.outbox != shares.outbox {
            shares.outbox = view.outbox;
            match view.outbox {
                OutboxLease::Open => {
                    tracing::info!("the outbox's own lease is free: the group takes its partitions")
                }
                OutboxLease::Taken => tracing::info!(
                    "the outbox's own lease is held by a relay of one partition, a sweep --once \
                     run, a relay from before groups or a group of another count: this relay \
                     takes no partition until it ends"
                ),
            }
        }
        if view.outbox == OutboxLease::Taken {
            return Ok(RoundEnd::Unsettled);
        }
        if moves.take.is_empty() {
            return Ok(settled);
        }
        // The whole renewal finds a group that took another count.
        if shares
            .group_renewed_at
            .is_none_or(|at| at.elapsed() >= self.config.lease_renew_interval)
        {
            self.renew(member, shares, outages, Renewal::Whole).await?;
        }
        let renewed_lately = shares
            .group_renewed_at
            .is_some_and(|at| at.elapsed() < lease_duration / 2);
        if !renewed_lately {
            return Ok(RoundEnd::Unsettled);
        }
        let mut end = settled;
        for partition in moves.take {
            let partition_lease = lease.of_partition(partition);
            let Ok(held) = partition_lease.try_acquire().await? else {
                end = RoundEnd::Unsettled;
                continue;
            };
            let unit_stop = stop.inner_with_grace(self.config.shutdown_timeout);
            let pipeline = Pipeline {
                partition,
                ..pipeline.clone()
            };
            let (relay, serving_stop) = (Arc::clone(self), unit_stop.clone());
            let task = shares.serving.spawn(async move {
                relay
                    .deliver_partition(&pipeline, partition_lease, held, &serving_stop)
                    .await;
                partition
            });
            shares.units.insert(
                partition,
                Unit {
                    stop: unit_stop,
                    handing_over: false,
                    task: task.id(),
                },
            );
        }
        Ok(end)
    }

    /// Readiness and the leader gauge: leading while this relay holds a
    /// partition, standing by (ready) while it holds none.
    fn show_role(&self, shares: &Shares) {
        let role = match (shares.units.is_empty(), self.config.mode) {
            (true, _) => Role::Standby,
            (false, RelayMode::Push) => Role::Leading,
            (false, RelayMode::Poll) => Role::Polling,
        };
        // The stream reports itself tailing: leading is only news to a
        // relay that held nothing.
        if role != Role::Leading || self.metrics.role() == Role::Standby {
            self.metrics.set_role_unless_stopping(role);
        }
    }

    /// Delivers one partition for one term: from the take until `stop`
    /// (the hand-over's, or the relay's) shuts it down, when its lease is
    /// released, or until the lease is lost.
    async fn deliver_partition(&self, pipeline: &Pipeline, lease: Lease, held: Held, stop: &Stop) {
        let partition = pipeline.partition;
        let holding = Holding::new(&self.metrics, partition, held.term);
        // The term ends with the unit's stop, or abandoned when the lease
        // is lost: then the completion stage writes nothing more.
        let term_stop = stop.inner();
        let keeper_stop = CancellationToken::new();
        // Should this unit panic, its term's tasks end, and the lease is
        // left to lapse rather than renewed by a keeper nobody stops.
        let _abandon_on_panic = term_stop.abandon.clone().drop_guard();
        let _stop_keeping_on_panic = keeper_stop.clone().drop_guard();
        let keeper = tokio::spawn(lease.clone().keep(
            held,
            term_stop.abandon.clone(),
            keeper_stop.clone(),
        ));
        self.serve_term(pipeline, lease.owner(), held.term, &term_stop)
            .await;
        // However the term ended, nothing of it runs on.
        term_stop.shutdown.cancel();
        // The next holder publishes what this term left unanswered:
        // nothing of this term may reach NATS after it (a stop that
        // answered everything leaves nothing to do). The connection is
        // shared by the relay's partitions: another's sends that it held
        // unanswered are sent again on the new one, as after an outage.
        self.publisher.end_term().await;
        keeper_stop.cancel();
        let held = keeper.await.unwrap_or(held);
        if stop.shutdown.is_cancelled() {
            release(&lease, &held).await;
        } else {
            tracing::warn!(term = held.term.0, %partition, "no longer holding the partition: another relay took it");
        }
        drop(holding);
    }

    /// Delivers for one term, until its `stop` shuts it down: the sweep,
    /// and in push mode the change stream, sharing the term's per-key order.
    async fn serve_term(&self, pipeline: &Pipeline, owner: &str, term: Term, stop: &Stop) {
        let shutdown = &stop.shutdown;
        let order = self.unread_order();
        // The holds are read beside the source's start rather than before
        // it: no message takes its turn until they are known (see
        // `KeyOrder::unread`), and a new leader over a large backlog does
        // not wait for two reads of it one after the other.
        let reading = self.read_stored_holds(order.clone(), pipeline.partition, shutdown.clone());
        // Every claim made before now is a former holder's: the lease is ours.
        let term_pipeline = Pipeline {
            tenure: Some(Tenure::begun(term, order, self.config.most_unrecorded())),
            ..pipeline.with_stop(stop)
        };
        let interval = match self.config.mode {
            RelayMode::Push => self.config.sweep_interval,
            RelayMode::Poll => self.config.poll_interval,
        };
        let progress = match self.config.mode {
            RelayMode::Push => StreamProgress::new(self.stall_window()),
            RelayMode::Poll => StreamProgress::without_stream(),
        };
        // The sweep clears a former leader's claims before its first claim
        // (see `Sweeper::clear_claims_once`), not before the stream starts.
        let sweeper = self.sweeper(term_pipeline.clone(), progress.clone());
        let sweeping = tokio::spawn({
            let shutdown = shutdown.clone();
            async move {
                // A pass before the stored holds are known would claim
                // messages only to hold them, claimed, at its stage's gate.
                if sweeper.await_stored_holds(&shutdown).await {
                    sweeper.run(interval, shutdown).await;
                }
            }
        });
        let serving = async {
            if self.config.mode == RelayMode::Push {
                self.tail(&term_pipeline, owner, term, progress, shutdown)
                    .await;
            }
            if let Err(error) = sweeping.await {
                tracing::error!(%error, "the sweep stopped unexpectedly");
            }
        };
        tokio::join!(reading, serving);
    }

    /// A new term's order, its stored holds still to be read.
    fn unread_order(&self) -> KeyOrder {
        KeyOrder::unread(
            self.config.on_dead_letter,
            self.publisher.acknowledges_storage(),
            self.metrics.clone(),
        )
    }

    /// A new term's order with the held keys MongoDB records. `None` if
    /// the term ended first.
    async fn read_order(&self, shutdown: &CancellationToken) -> Option<KeyOrder> {
        let order = self.unread_order();
        self.read_stored_holds(order.clone(), Partition::WHOLE, shutdown.clone())
            .await
            .then_some(order)
    }

    /// Reads the held keys as MongoDB records them into a new term's
    /// order, retrying until it succeeds or the term ends (a read under
    /// way is not waited for). Resolves to false if the term ended first.
    /// Readiness reports the read from the call on, not from the first
    /// poll, and until the holds are taken on.
    fn read_stored_holds(
        &self,
        order: KeyOrder,
        partition: Partition,
        shutdown: CancellationToken,
    ) -> impl Future<Output = bool> {
        let reading = self.metrics.reading_holds();
        let outbox = self.database.collection(&self.config.collection);
        let dead_letters = self.config.on_dead_letter;
        async move {
            let read = until_ok("MongoDB reading held keys", &shutdown, || {
                order::held_keys(&outbox, partition, dead_letters)
            });
            let held = tokio::select! {
                biased;
                _ = shutdown.cancelled() => None,
                held = read => held,
            };
            let Some(held) = held else {
                return false;
            };
            if !held.is_empty() {
                tracing::info!(keys = held.len(), "keys held by refused or failed messages");
            }
            order.adopt_stored(held);
            drop(reading);
            true
        }
    }

    /// Runs the change-stream pipeline for one term, until `shutdown` fires.
    async fn tail(
        &self,
        term_pipeline: &Pipeline,
        owner: &str,
        term: Term,
        progress: StreamProgress,
        shutdown: &CancellationToken,
    ) {
        let config = &self.config;
        let partition = term_pipeline.partition;
        let place = self.place(partition);
        let checkpoints = CheckpointStore::for_config(&self.coordination, config)
            .of_partition(partition)
            .fenced(owner, term)
            .keeping(place.clone());
        let token = match place.take_before(term) {
            Some(token) => {
                tracing::info!(
                    term = term.0,
                    "leading again right after this relay's own term: resuming where it stopped"
                );
                Some(token)
            }
            None => match self.stored_position(&checkpoints, shutdown).await {
                Some(token) => token,
                None => return,
            },
        };
        let stream = term_pipeline.start(Some(checkpoints));
        let source = ChangeStreamSource {
            outbox: term_pipeline.outbox.clone(),
            partition,
            rules: self.rules(),
            max_await_time: config.max_await_time,
            idle_checkpoint_interval: config.idle_checkpoint_interval,
            grace_period: config.grace_period,
            max_replay: config.max_replay,
            metrics: self.metrics.clone(),
            prepare: self.preparation(),
            progress,
        };
        source.run(token, stream.input, shutdown.clone()).await;
        if let Err(error) = stream.done.await {
            tracing::error!(%error, "the stream's pipeline stopped unexpectedly");
        }
    }

    /// The stored position the term's stream starts after; `None` if the
    /// term ended first.
    async fn stored_position(
        &self,
        checkpoints: &CheckpointStore,
        shutdown: &CancellationToken,
    ) -> Option<Option<ResumeToken>> {
        let loaded = until_settled(
            "MongoDB reading the checkpoint",
            shutdown,
            || checkpoints.load(),
            |error| matches!(error, Error::StoredState(_)),
        )
        .await?;
        match loaded {
            Ok(token) => Some(token),
            // No retry mends a stored token that cannot be read; the
            // catch-up pass that follows a missing token delivers all that
            // is pending, and the next checkpoint replaces the bad one.
            Err(error) => {
                tracing::error!(%error, "starting from the pending messages instead");
                Some(None)
            }
        }
    }

    /// Sweeps until nothing due is left, once (`outbox-relay sweep --once`),
    /// holding the lease meanwhile so that no other relay publishes the same
    /// keys. Gives up if another relay leads (it sweeps already), or if the
    /// servers keep it from finishing within `give_up_after` (an outage of
    /// NATS or MongoDB): what it did not deliver stays pending, and its
    /// claims are released.
    pub async fn sweep_once(&self, give_up_after: Duration) -> Result<Tally> {
        let config = &self.config;
        let lease = self.lease().for_sweep_once();
        // The whole outbox, as one partition. It joins no group: it holds
        // the outbox's own lease for its run, which a group holds while it
        // delivers (see `lease`), and a group starting meanwhile waits for
        // it to end. Relays of another count refuse it: those of earlier
        // versions, which do not hold the outbox's lease, by their leases
        // and their group's document, asked before the take and after it.
        let group = Group::new(
            &self.coordination,
            &config.checkpoint_collection,
            &config.collection,
            lease.owner(),
            1,
            config.lease_timing(),
        );
        let beside_a_group = |why: String| {
            Error::GaveUp(format!(
                "{why}: a group of relays runs on this outbox and sweeps it already; run \
                 sweep --once only where no relay is running"
            ))
        };
        match group.admits_one().await {
            Ok(()) => {}
            Err(Error::Config(why)) => return Err(beside_a_group(why)),
            Err(error) => return Err(error),
        }
        self.sweep_once_holding(&lease, &group, give_up_after)
            .await
            .map_err(|error| match error {
                Error::Config(why) => beside_a_group(why),
                other => other,
            })
    }

    /// [`Relay::sweep_once`], once no group of another count is seen.
    async fn sweep_once_holding(
        &self,
        lease: &Lease,
        group: &Group,
        give_up_after: Duration,
    ) -> Result<Tally> {
        let deadline = tokio::time::Instant::now() + give_up_after;
        let Ok(held) = lease.try_acquire().await? else {
            return Err(Error::GaveUp(
                "another relay, or a group of relays, leads this outbox and sweeps it already; \
                 run sweep --once only where no relay is running"
                    .to_owned(),
            ));
        };
        // A relay of an earlier version may have joined a group of another
        // count between the first look and the take; it sees the lease now.
        if let Err(refused) = group.admits_one().await {
            release(lease, &held).await;
            return Err(refused);
        }
        // Abandoned by the keeper when the lease is lost, or here when the
        // time is up; what was not delivered stays pending either way.
        let stop = Stop::new();
        let _abandon_on_return = stop.abandon.clone().drop_guard();
        let keeper_stop = CancellationToken::new();
        let _stop_keeping_on_return = keeper_stop.clone().drop_guard();
        let keeper = tokio::spawn(lease.clone().keep(
            held,
            stop.abandon.clone(),
            keeper_stop.clone(),
        ));
        let drain = self.drain_holding(held, &stop);
        tokio::pin!(drain);
        let ended = tokio::select! {
            // A lost lease is reported as such, even at the limit.
            biased;
            // An abandoned sweep winds down (its claims released); what
            // it says then is the reason's to tell.
            _ = stop.abandon.cancelled() => {
                let _abandoned = drain.await;
                SweepEnd::LeaseLost
            }
            _ = tokio::time::sleep_until(deadline) => {
                stop.abandon.cancel();
                let _abandoned = drain.await;
                SweepEnd::TimeUp
            }
            drained = &mut drain => SweepEnd::Drained(drained),
        };
        keeper_stop.cancel();
        let held = keeper.await.unwrap_or(held);
        match ended {
            SweepEnd::Drained(drained) => {
                release(lease, &held).await;
                drained
            }
            SweepEnd::TimeUp => Err(Error::GaveUp(format!(
                "the sweep did not finish within {} (is NATS or MongoDB down?); what it did not \
                 deliver stays pending for the next sweep or relay (raise --give-up-after to \
                 wait longer)",
                humantime::format_duration(give_up_after)
            ))),
            SweepEnd::LeaseLost => Err(Error::GaveUp(
                "lost the lease to another relay during the sweep; it delivers the rest".to_owned(),
            )),
        }
    }

    /// The sweep of `sweep --once`, in the term `held` names, until
    /// nothing due is left or `stop` ends it (then what it did not
    /// deliver stays pending, its claims released).
    async fn drain_holding(&self, held: Held, stop: &Stop) -> Result<Tally> {
        let Some(order) = self.read_order(&stop.shutdown).await else {
            return Ok(Tally::default());
        };
        let pipeline = Pipeline {
            tenure: Some(Tenure::begun(
                held.term,
                order,
                self.config.most_unrecorded(),
            )),
            ..self.pipeline(stop)
        };
        let sweeper = self.sweeper(pipeline, StreamProgress::without_stream());
        sweeper.drain().await
    }

    /// Where this relay's last term of `partition` stopped.
    fn place(&self, partition: Partition) -> KeptPlace {
        match self.places.lock() {
            Ok(mut places) => places.entry(partition).or_default().clone(),
            // A panic while the map was held: a place of its own serves,
            // as one that kept nothing.
            Err(_) => KeptPlace::default(),
        }
    }

    /// This relay's membership in the group of its outbox, kept through
    /// the coordination client as the leases are (see
    /// `connect_mongodb_for_coordination`: a connection of its own, so
    /// that a round waiting on a slow server holds none a renewal needs).
    fn group(&self, me: &str) -> Group {
        let config = &self.config;
        Group::new(
            &self.coordination,
            &config.checkpoint_collection,
            &config.collection,
            me,
            config.partitions,
            config.lease_timing(),
        )
    }

    fn lease(&self) -> Lease {
        let config = &self.config;
        Lease::new(
            &self.coordination,
            &config.checkpoint_collection,
            &config.collection,
            config.lease_timing(),
        )
    }

    /// What prepares the outbox collection again, for a change stream that
    /// finds it dropped and recreated.
    fn preparation(&self) -> Prepare {
        let (database, config) = (self.database.clone(), self.config.clone());
        Arc::new(move || {
            let (database, config) = (database.clone(), config.clone());
            Box::pin(async move { setup::prepare(&database, &config, setup::Preparer::Run).await })
        })
    }

    fn audit_watch(&self) -> crate::audit::Watch {
        let (database, config) = (self.database.clone(), self.config.clone());
        crate::audit::Watch::new(database, config, self.metrics.clone())
    }

    fn collector(&self) -> observe::Collector {
        let config = &self.config;
        observe::Collector {
            outbox: self.database.collection(&config.collection),
            // Polling reads no stream, and keeps no position in it.
            checkpoints: match config.mode {
                RelayMode::Push => Some(CheckpointStore::for_config(&self.database, config)),
                RelayMode::Poll => None,
            },
            partitions: config.partitions,
            client: self.database.client().clone(),
            metrics: self.metrics.clone(),
            interval: config.collect_interval,
            // Polling reads no change stream, and has no place in the
            // oplog to lose.
            headroom_warning: match config.mode {
                RelayMode::Push => config.oplog_headroom_warning,
                RelayMode::Poll => None,
            },
            started: bson::DateTime::now(),
        }
    }

    /// How long the stream source may pass nothing on and still hold the
    /// sweep back: the grace period, and more than two idle waits (an idle
    /// stream reports its position after each).
    fn stall_window(&self) -> Duration {
        let config = &self.config;
        config
            .grace_period
            .max(config.max_await_time.saturating_mul(2))
            .max(Duration::from_secs(1))
    }

    fn rules(&self) -> DecodeRules {
        DecodeRules {
            max_payload: self.publisher.max_payload(),
            ..self.rules.clone()
        }
    }

    fn pipeline(&self, stop: &Stop) -> Pipeline {
        let config = &self.config;
        Pipeline {
            publisher: self.publisher.clone(),
            outbox: self.database.collection(&config.collection),
            max_in_flight: config.max_in_flight,
            batch_size: config.batch_size,
            checkpoint_interval: config.checkpoint_interval,
            mark_delay: config.mark_delay,
            retry: config.retry(),
            metrics: self.metrics.clone(),
            unmarkable: self.unmarkable.clone(),
            budget: self.budget.clone(),
            underway: self.underway.clone(),
            deliveries: self.deliveries.clone(),
            tenure: None,
            partition: Partition::WHOLE,
            acknowledged: self.acknowledged.clone(),
            shutdown: stop.shutdown.clone(),
            abandon: stop.abandon.clone(),
        }
    }

    /// A sweeper over `pipeline`. In push mode it leaves never-tried
    /// messages to the change stream until a grace period after the stream
    /// has read up to them (`progress`); in poll mode there is no stream to
    /// leave them to.
    fn sweeper(&self, pipeline: Pipeline, progress: StreamProgress) -> Sweeper {
        let grace_period = match self.config.mode {
            RelayMode::Push => self.config.grace_period,
            RelayMode::Poll => Duration::ZERO,
        };
        Sweeper {
            rules: self.rules(),
            batch_size: self.config.batch_size,
            lock_timeout: self.config.lock_timeout,
            grace_period,
            progress,
            max_pass_bytes: usize::try_from(self.config.max_buffered_bytes.0).unwrap_or(usize::MAX),
            misfits_read: Arc::default(),
            // A sweeper serves one term, whose holds are read as it starts
            // (see `Sweeper::await_stored_holds`).
            holds_read: Arc::new(Mutex::new(Some(Instant::now()))),
            holds_interval: self.config.collect_interval,
            late_writes_until: Instant::now() + self.config.lease_duration.saturating_mul(2),
            dead_letters: self.config.on_dead_letter,
            claims_cleared: Arc::default(),
            pipeline,
        }
    }
}

/// A partition this relay holds, as its metrics say: from the take until
/// dropped, however the unit ends.
struct Holding {
    metrics: Metrics,
    partition: Partition,
}

impl Holding {
    fn new(metrics: &Metrics, partition: Partition, term: Term) -> Self {
        metrics.partition_held(partition, Some(term.0));
        Holding {
            metrics: metrics.clone(),
            partition,
        }
    }
}

impl Drop for Holding {
    fn drop(&mut self) {
        self.metrics.partition_held(self.partition, None);
    }
}

/// This relay as a member of its outbox's group: what each round reads
/// and takes partitions with.
#[derive(Clone, Copy)]
struct Membership<'a> {
    group: &'a Group,
    /// Names this relay, and takes each partition's lease.
    lease: &'a Lease,
    /// The pipeline each partition's is made from.
    pipeline: &'a Pipeline,
    /// The relay's stop, inside which each partition's runs.
    stop: &'a Stop,
    /// What tells the rounds that the group changed.
    changes: &'a Changes,
}

/// Why a `sweep --once` run ended: one value, decided where the run
/// ends, as the reason a connection's loop ends is in async-nats.
enum SweepEnd {
    /// Nothing due was left (or the servers kept it from reading which
    /// keys are held, and the run ended without sweeping): its tally.
    Drained(Result<Tally>),
    /// `--give-up-after` passed first: the sweep was abandoned.
    TimeUp,
    /// Another relay took the lease: the sweep was abandoned.
    LeaseLost,
}

/// The partitions this relay delivers, one unit each.
#[derive(Default)]
struct Shares {
    units: BTreeMap<Partition, Unit>,
    /// Each unit's task, which returns its partition when it ends.
    serving: JoinSet<Partition>,
    /// Until when this relay takes no free partition beyond its fewest,
    /// having just handed one over (see [`balance`]).
    cooling_until: Option<Instant>,
    /// When this relay last renewed its place in the group (from before
    /// the renewal was sent).
    renewed_at: Option<Instant>,
    /// When it last renewed the group's document with it: a take waits
    /// for one younger than half a lease (see [`Relay::round`]).
    group_renewed_at: Option<Instant>,
    /// When this relay last joined anew for holding nothing.
    rejoined_at: Option<Instant>,
    /// When the next round is due; `None`: at once.
    next_round: Option<tokio::time::Instant>,
    /// Whether another relay held a partition at the last round: then
    /// this one, holding none, renews its announcement alone (see
    /// [`Renewal`]).
    held_by_others: bool,
    /// The outbox's own lease as the last round found it, to say so only
    /// when it changes.
    outbox: OutboxLease,
}

/// The group's two kinds of MongoDB work, each reported as it fails and
/// recovers.
struct Outages {
    renewing: Outage,
    reading: Outage,
}

/// How many leases a relay that holds nothing waits before joining anew
/// again (see [`Relay::round`]).
const REJOIN_LEASES: u32 = 4;

/// How many leases a settled group goes unread at most, while the watch on
/// it is open (see [`Relay::take_shares`]).
const SETTLED_ROUNDS: u32 = 6;

/// What a round leaves to the next.
enum RoundEnd {
    /// Nothing left to take: the next round comes when the group changes,
    /// or when something this one read lapses (`lapse`).
    Settled { lapse: Option<tokio::time::Instant> },
    /// A take that failed or must wait (a renewal too old, the outbox's
    /// own lease held by another, a rejoin just announced): the next round
    /// polls.
    Unsettled,
}

/// One partition this relay delivers.
struct Unit {
    /// Its stop: a hand-over shuts it down gracefully.
    stop: Stop,
    handing_over: bool,
    /// Its task in [`Shares::serving`].
    task: tokio::task::Id,
}

impl Shares {
    /// A unit's task ended: the hand-over finished, or the lease was lost.
    fn ended(&mut self, ended: std::result::Result<Partition, tokio::task::JoinError>) {
        match ended {
            Ok(partition) => {
                self.units.remove(&partition);
            }
            Err(error) => {
                tracing::error!(%error, "delivering a partition stopped unexpectedly");
                let task = error.id();
                self.units.retain(|_, unit| unit.task != task);
            }
        }
    }

    /// Stops every unit at once (publishing and writing nothing more) and
    /// waits for them: the group runs with another count now.
    async fn abandon_all(&mut self) {
        for unit in self.units.values() {
            unit.stop.abandon.cancel();
        }
        self.stop_all().await;
    }

    /// Waits for every unit to end (each has been told to stop with the
    /// relay's stop, whose child it is).
    async fn stop_all(&mut self) {
        for unit in self.units.values() {
            unit.stop.shutdown.cancel();
        }
        while let Some(ended) = self.serving.join_next().await {
            if let Err(error) = ended {
                tracing::error!(%error, "delivering a partition stopped unexpectedly");
            }
        }
        self.units.clear();
    }
}

/// Reports the relay as stopping once `shutdown` fires, so readiness drops
/// while in-flight work finishes.
async fn mark_stopping(metrics: Metrics, shutdown: CancellationToken) {
    shutdown.cancelled().await;
    metrics.set_role(Role::Stopping);
}

/// How long a stopping relay tries to release its lease. A MongoDB that
/// does not answer by then leaves the lease to expire, and the stop takes
/// at most `--shutdown-timeout` and this.
pub const RELEASE_TIMEOUT: Duration = Duration::from_secs(5);

/// Gives the lease up as the relay stops, so a standby takes over at once.
async fn release(lease: &Lease, held: &Held) {
    let released = tokio::time::timeout(RELEASE_TIMEOUT, lease.release(held)).await;
    let error = match released {
        Ok(Ok(())) => return,
        Ok(Err(error)) => error.to_string(),
        Err(_) => format!("MongoDB did not answer within {RELEASE_TIMEOUT:?}"),
    };
    tracing::warn!(%error, "could not release the lease; a standby takes over when it expires");
}
