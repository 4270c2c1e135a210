//! What the simulation records and the properties it checks on the record: virtual
//! synchrony (from a member's join on, no gap and no duplicate), the index `join`/`mcast`
//! return is that of the event delivered for them, no delivery on a cut-off minority, quorum
//! lost within a lease and before the majority declares the member failed and never regained
//! by that incarnation, a member reporting quorum is not far behind, and progress once a
//! majority is connected. Timing bounds follow each member's clock rate ([`Timing`]).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use super::skewed;
use crate::cpg::{CpgConfig, CpgEvent, MemberId};

/// Something that happened in a simulated run.
#[derive(Clone, Debug)]
pub(crate) enum Record {
    Started {
        member: MemberId,
        /// Its clock's rate, per mille of virtual time (1000: not skewed); the checker judges
        /// its timing by it.
        clock_per_mille: u64,
    },
    Crashed {
        member: MemberId,
    },
    Event {
        member: MemberId,
        event: CpgEvent,
    },
    Quorum {
        member: MemberId,
        has_quorum: bool,
    },
    /// The links changed (a partition, one-way cut or bridge).
    Partitioned {
        /// Which fault, for the reader of a trace.
        fault: String,
        /// Members no member that could lead a majority can send to: they deliver nothing
        /// appended after the cut.
        minority: Vec<MemberId>,
        /// Members that can complete no exchange with any member that could lead a majority
        /// (a superset of `minority`): they lose quorum within a lease.
        leaseless: Vec<MemberId>,
        /// The last log index on the cut-off side when the cut happened.
        appended: u64,
    },
    Healed,
    /// A member crashed or started while a cut may hold: which side holds a majority of the
    /// voters may have changed (seeds 301566, 302383, 304793: a restarted member's side became
    /// the majority), so the minority judgement of the cut in force ends here.
    Regrouped,
    /// The member's messages, both ways, are held from now on (as if SIGSTOPped).
    Paused {
        member: MemberId,
    },
    /// The member's held messages are released; `has_quorum_now` is what it answered at
    /// once when asked.
    Resumed {
        member: MemberId,
        has_quorum_now: bool,
    },
    /// The member's incarnation started at agreed `index` ([`CpgEvent::Started`]);
    /// `resumed`: its group membership carried over (else its earlier one ended unseen, as
    /// at a crash, and it joins again).
    Incarnated {
        member: MemberId,
        index: u64,
        resumed: bool,
    },
    /// `join` returned `Ok(index)`.
    Joined {
        member: MemberId,
        index: u64,
    },
    /// `mcast` of `payload` returned `Ok(index)`.
    Sent {
        member: MemberId,
        payload: String,
        index: u64,
    },
    FinalSent {
        member: MemberId,
        ok: bool,
    },
    Note {
        member: MemberId,
        text: String,
    },
    Quiesced {
        live: Vec<MemberId>,
        finals: Vec<String>,
        /// Members still running (not stopped) that could not join the group after healing.
        stranded: Vec<MemberId>,
    },
}

/// The run, in the order things happened, with virtual times in ms.
#[derive(Clone, Debug, Default)]
pub(crate) struct Trace {
    records: Vec<(u64, Record)>,
}

impl Trace {
    pub fn push(&mut self, at_ms: u64, r: Record) {
        self.records.push((at_ms, r));
    }

    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    pub fn deliveries(&self) -> usize {
        self.records
            .iter()
            .filter(|(_, r)| matches!(r, Record::Event { event, .. } if event.is_delivery()))
            .count()
    }

    /// The last `n` records, one a line, for a failure report.
    pub fn dump_tail(&self, n: usize) -> String {
        let skip = self.records.len().saturating_sub(n);
        let mut s = String::new();
        for (t, r) in self.records.iter().skip(skip) {
            // Writing to a String cannot fail.
            let _ = match r {
                Record::Note { member, text } => writeln!(s, "{t:>8} ms note {member}: {text}"),
                _ => writeln!(s, "{t:>8} ms {r:?}"),
            };
        }
        s
    }
}

/// Checks every property, `config` being the members' configuration on an unskewed clock;
/// `Err` says which one broke and where.
pub(crate) fn check(trace: &Trace, config: &CpgConfig, max_delay_ms: u64) -> Result<(), String> {
    let timing = Timing::new(trace, config);
    let delivered = Delivered::collect(trace)?;
    delivered.check_no_gaps(trace)?;
    check_returned_indices(trace, &delivered)?;
    check_minorities(trace, &timing, max_delay_ms)?;
    check_failures_after_lease(trace, &timing)?;
    check_no_quorum_after_failure(trace)?;
    check_no_quorum_on_resume(trace, &timing)?;
    check_quiescence(trace, &delivered.per_member)?;
    // Last: it fails on a design gap (see its comment) that would otherwise hide the rest.
    check_quorum_freshness(trace, &timing, &delivered)
}

/// The durations timing bounds are judged by, under clock-rate skew. Every member times with
/// its own clock, whose rate the trace records when it starts: a bound on a member's own timer
/// (its heartbeat, which updates its quorum watch) uses its configuration scaled by that rate.
/// A bound that involves another member's timer uses the longest of the run, that of the
/// slowest clock: a follower's lease runs a lease on its own clock from its ping, but a leader
/// on its side of a cut may grant it one after the cut, which then ends with that leader's
/// lease; and a commit reaches a follower with its leader's heartbeat.
struct Timing {
    /// Each member's own configuration.
    own: BTreeMap<MemberId, CpgConfig>,
    /// The configuration on the slowest clock of the run.
    longest: CpgConfig,
}

impl Timing {
    fn new(trace: &Trace, config: &CpgConfig) -> Self {
        let clocks: BTreeMap<MemberId, u64> = trace
            .records
            .iter()
            .filter_map(|(_, r)| match r {
                Record::Started {
                    member,
                    clock_per_mille,
                } => Some((*member, *clock_per_mille)),
                _ => None,
            })
            .collect();
        let slowest = clocks.values().copied().min().unwrap_or(1000);
        Self {
            own: clocks
                .into_iter()
                .map(|(m, clock)| (m, skewed(config, clock)))
                .collect(),
            longest: skewed(config, slowest),
        }
    }

    /// `member`'s own configuration (the slowest clock's for a member that never started).
    fn of(&self, member: MemberId) -> &CpgConfig {
        self.own.get(&member).unwrap_or(&self.longest)
    }
}

/// A member paused for longer than its lease answers "no quorum" to the first question after
/// it resumes (`Cpg::has_quorum_now` reads the clock; nothing cached survives the pause). Its
/// own lease: whoever granted it, a lease ends at most `lease_ms` on the member's clock after
/// the ping it answered, and every ping answered before the resume was sent before the pause.
fn check_no_quorum_on_resume(trace: &Trace, timing: &Timing) -> Result<(), String> {
    let mut paused_at: BTreeMap<MemberId, u64> = BTreeMap::new();
    for (t, r) in &trace.records {
        match r {
            Record::Paused { member } => {
                paused_at.insert(*member, *t);
            }
            Record::Resumed {
                member,
                has_quorum_now: true,
            } if paused_at
                .get(member)
                .is_some_and(|p| t.saturating_sub(*p) > timing.of(*member).lease_ms) =>
            {
                return Err(format!(
                    "member {member} claimed quorum at {t} ms, the instant it resumed from a pause longer than its lease"
                ));
            }
            _ => {}
        }
    }
    Ok(())
}

/// Every delivery of the run, per member and per index.
struct Delivered<'a> {
    /// Each member's events, with the time it delivered them.
    per_member: BTreeMap<MemberId, Vec<(u64, &'a CpgEvent)>>,
    /// The event at each index (checked to be the same on every member).
    global: BTreeMap<u64, &'a CpgEvent>,
    /// When some member first delivered each index.
    first_at: BTreeMap<u64, u64>,
}

impl<'a> Delivered<'a> {
    /// Collects the deliveries, checking on the way that each member was started first,
    /// delivers strictly increasing indices, starts with its own join, never delivers a payload
    /// twice, and that every member saw the same event at each index.
    fn collect(trace: &'a Trace) -> Result<Self, String> {
        let mut d = Delivered {
            per_member: BTreeMap::new(),
            global: BTreeMap::new(),
            first_at: BTreeMap::new(),
        };
        let mut started: BTreeSet<MemberId> = BTreeSet::new();
        let mut payloads: BTreeSet<(MemberId, &[u8])> = BTreeSet::new();
        for (t, r) in &trace.records {
            if let Record::Started { member, .. } = r {
                started.insert(*member);
            }
            let Record::Event { member, event } = r else {
                continue;
            };
            if !started.contains(member) {
                return Err(format!("member {member} delivered before it was admitted"));
            }
            let list = d.per_member.entry(*member).or_default();
            if list.is_empty() && !lists_joined(event, *member) {
                return Err(format!(
                    "member {member}'s first event is not the configuration change that lists it \
                     in `joined` (it missed what came before): {event:?}"
                ));
            }
            if list
                .last()
                .is_some_and(|(_, last)| last.index() >= event.index())
            {
                return Err(format!(
                    "member {member}: index {} not increasing",
                    event.index()
                ));
            }
            if let CpgEvent::Deliver { payload, .. } = event
                && !payloads.insert((*member, payload.as_ref()))
            {
                return Err(format!(
                    "member {member} delivered payload {payload:?} twice, again at index {}",
                    event.index()
                ));
            }
            list.push((*t, event));
            d.first_at.entry(event.index()).or_insert(*t);
            match d.global.get(&event.index()) {
                Some(seen) if *seen != event => {
                    return Err(format!(
                        "index {} delivered differently: {seen:?} vs {event:?}",
                        event.index()
                    ));
                }
                _ => {
                    d.global.insert(event.index(), event);
                }
            }
        }
        Ok(d)
    }

    /// Virtual synchrony: each member saw every event of the group from its join to its end
    /// (a member with a disk may be declared failed and join again: the events between its
    /// failure and its next join are not its).
    fn check_no_gaps(&self, trace: &Trace) -> Result<(), String> {
        // A new incarnation that did not resume its membership ends the previous one unseen
        // (as a crash does): membership spans are checked one by one.
        let resets = resets(trace);
        for (member, list) in &self.per_member {
            let cuts = resets.get(member).map(Vec::as_slice).unwrap_or_default();
            let span_of = |idx: u64| cuts.iter().filter(|(c, _)| *c < idx).count();
            let mut spans: BTreeMap<usize, Vec<u64>> = BTreeMap::new();
            for (_, e) in list {
                spans.entry(span_of(e.index())).or_default().push(e.index());
            }
            for indices in spans.values() {
                let (Some(first), Some(last)) = (indices.first(), indices.last()) else {
                    continue;
                };
                let mine: BTreeSet<u64> = indices.iter().copied().collect();
                for idx in self.global.range(*first..=*last).map(|(i, _)| *i) {
                    if !mine.contains(&idx) && self.receives(*member, idx) {
                        return Err(format!(
                            "member {member} skipped index {idx} within its membership"
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// When `member` delivered index `idx`, if it did.
    fn delivered_at(&self, member: MemberId, idx: u64) -> Option<u64> {
        let list = self.per_member.get(&member)?;
        let pos = list.binary_search_by_key(&idx, |(_, e)| e.index()).ok()?;
        Some(list[pos].0)
    }

    /// Whether `member` receives the event at `idx`: the group's newest configuration change
    /// at or before it lists the member (or lists it as leaving, at `idx` itself). Every
    /// configuration change before a delivered event was itself delivered by someone (its
    /// recipients deliver without gaps), so `global` knows the newest one.
    fn receives(&self, member: MemberId, idx: u64) -> bool {
        let Some(event) = self.global.get(&idx) else {
            return false;
        };
        let group = event.group();
        self.global
            .range(..=idx)
            .rev()
            .find_map(|(i, e)| match e {
                CpgEvent::ConfChg {
                    group: g,
                    members,
                    left,
                    failed,
                    ..
                } if Some(g.as_str()) == group => Some(
                    members.iter().any(|m| m.id == member)
                        || (*i == idx && left.iter().chain(failed).any(|m| m.id == member)),
                ),
                _ => None,
            })
            .unwrap_or(false)
    }
}

/// Per member, where (agreed index, time) an incarnation started without resuming its group
/// membership: the earlier membership ended there unseen, as at a crash.
fn resets(trace: &Trace) -> BTreeMap<MemberId, Vec<(u64, u64)>> {
    let mut out: BTreeMap<MemberId, Vec<(u64, u64)>> = BTreeMap::new();
    for (t, r) in &trace.records {
        if let Record::Incarnated {
            member,
            index,
            resumed: false,
        } = r
        {
            out.entry(*member).or_default().push((*index, *t));
        }
    }
    out
}

fn lists_joined(event: &CpgEvent, member: MemberId) -> bool {
    matches!(event, CpgEvent::ConfChg { joined, .. } if joined.iter().any(|m| m.id == member))
}

/// The index `join` or `mcast` returned is the index of the event delivered for it: the
/// configuration change listing the joiner, or the delivery of that very payload from that
/// sender. (A `join` of a member already in the group changes nothing and emits no event; no
/// other event can then sit at its index, since an entry emits at most one event per group.)
fn check_returned_indices(trace: &Trace, delivered: &Delivered<'_>) -> Result<(), String> {
    let mut at_index: BTreeMap<&[u8], BTreeSet<u64>> = BTreeMap::new();
    for (idx, e) in &delivered.global {
        if let CpgEvent::Deliver { payload, .. } = e {
            at_index.entry(payload.as_ref()).or_default().insert(*idx);
        }
    }
    for (t, r) in &trace.records {
        match r {
            Record::Joined { member, index } => {
                if let Some(e) = delivered.global.get(index)
                    && !lists_joined(e, *member)
                {
                    return Err(format!(
                        "join of member {member} returned index {index} at {t} ms, but that \
                         index delivered {e:?}"
                    ));
                }
            }
            Record::Sent {
                member,
                payload,
                index,
            } => {
                let ok = |e: &CpgEvent| {
                    matches!(e, CpgEvent::Deliver { sender, payload: p, .. }
                        if sender == member && p.as_ref() == payload.as_bytes())
                };
                if let Some(e) = delivered.global.get(index)
                    && !ok(e)
                {
                    return Err(format!(
                        "mcast of {payload} by member {member} returned index {index} at {t} ms, \
                         but that index delivered {e:?}"
                    ));
                }
                let elsewhere = at_index
                    .get(payload.as_bytes())
                    .and_then(|s| s.iter().find(|i| *i != index));
                if let Some(other) = elsewhere {
                    return Err(format!(
                        "mcast of {payload} by member {member} returned index {index} at {t} ms, \
                         but it was delivered at index {other}"
                    ));
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// Allowance after a paused member resumes before its quorum watch must be right again, for a
/// member with configuration `config` (its own): the watch is updated by the member's monitor
/// once a heartbeat, and a paused member's monitor does not run, so a lease that ran out
/// during the pause is seen on the first tick after it (one heartbeat, plus the 10 ms of
/// scheduling slack the other deadlines use). While paused, a member can act on nothing, so
/// what its watch says then is not judged.
fn resume_allowance_ms(config: &CpgConfig) -> u64 {
    config.heartbeat_ms + 10
}

/// The time at which `member`'s quorum watch is judged for a claim it would make at `at_ms`:
/// `at_ms` itself, or, if it was paused then or resumed less than `allowance_ms` before, the
/// end of that allowance after its resume (`None` if it never resumed).
fn judged_at(trace: &Trace, member: MemberId, at_ms: u64, allowance_ms: u64) -> Option<u64> {
    let mut resumed: Option<Option<u64>> = None;
    for (t, r) in &trace.records {
        match r {
            Record::Paused { member: m } if *m == member && *t <= at_ms => resumed = Some(None),
            Record::Resumed { member: m, .. } if *m == member && resumed == Some(None) => {
                resumed = Some(Some(*t));
            }
            _ => {}
        }
    }
    match resumed {
        Some(Some(r)) if at_ms < r + allowance_ms => Some(r + allowance_ms),
        Some(None) => None,
        _ => Some(at_ms),
    }
}

/// Where in the trace the state at `at_ms` is final: the first record after it.
fn position_after(trace: &Trace, at_ms: u64) -> usize {
    trace
        .records
        .iter()
        .position(|(t, _)| *t > at_ms)
        .unwrap_or(trace.records.len())
}

fn quorum_at(trace: &Trace, member: MemberId, upto: usize) -> bool {
    trace.records[..upto]
        .iter()
        .rev()
        .find_map(|(_, r)| match r {
            Record::Quorum {
                member: m,
                has_quorum,
            } if *m == member => Some(*has_quorum),
            Record::Crashed { member: m } if *m == member => Some(false),
            _ => None,
        })
        .unwrap_or(false)
}

fn check_minorities(trace: &Trace, timing: &Timing, max_delay_ms: u64) -> Result<(), String> {
    let recs = &trace.records;
    let mut first_delivery: BTreeMap<u64, u64> = BTreeMap::new();
    for (t, r) in recs {
        if let Record::Event { event, .. } = r {
            first_delivery.entry(event.index()).or_insert(*t);
        }
    }
    for (pos, (t_p, r)) in recs.iter().enumerate() {
        let Record::Partitioned {
            fault,
            minority,
            leaseless,
            appended,
        } = r
        else {
            continue;
        };
        let end = recs[pos + 1..]
            .iter()
            .position(|(_, r)| {
                matches!(
                    r,
                    Record::Partitioned { .. }
                        | Record::Healed
                        | Record::Regrouped
                        | Record::Quiesced { .. }
                )
            })
            .map_or(recs.len(), |p| pos + 1 + p);
        let t_h = recs.get(end).map_or(u64::MAX, |(t, _)| *t);
        // A commit made before the cut reaches a follower with its leader's next heartbeat, so
        // it may still deliver for one heartbeat plus a round trip.
        let quiet_from = t_p + timing.longest.heartbeat_ms + 2 * max_delay_ms + 10;
        for &m in minority {
            for (t, r) in &recs[pos..end] {
                // Old entries may still reach it from a leader on its side: committed before
                // the cut, or appended before it and committed after (a lagging member on the
                // leader's side completes a majority with acknowledgements the other side sent
                // before the cut: seed 1663). An entry appended after the cut must not.
                if let Record::Event { member, event } = r
                    && *member == m
                    && *t > quiet_from
                    && event.index() > *appended
                    && first_delivery
                        .get(&event.index())
                        .is_none_or(|f| *f > quiet_from)
                {
                    return Err(format!(
                        "member {m} cut off at {t_p} ms ({fault}) delivered at {t} ms: {event:?}"
                    ));
                }
            }
        }
        for &m in leaseless {
            // Its lease ends a lease on its own clock after its last ping to the other side,
            // or with the lease of a leader on its side (see `Timing`); its watch follows
            // within its own heartbeat.
            let own = timing.of(m);
            let lease_deadline = t_p + timing.longest.lease_ms + own.heartbeat_ms + 10;
            let Some(judged) = judged_at(trace, m, lease_deadline, resume_allowance_ms(own)) else {
                continue;
            };
            if t_h > judged && quorum_at(trace, m, position_after(trace, judged).min(end)) {
                return Err(format!(
                    "member {m} cut off at {t_p} ms ({fault}) still claims quorum at {judged} ms"
                ));
            }
        }
    }
    Ok(())
}

/// When a configuration change lists member X in `failed`, X's quorum watch is already false
/// (or it crashed). A paused X is judged once it has had a heartbeat (its own) after resuming.
fn check_failures_after_lease(trace: &Trace, timing: &Timing) -> Result<(), String> {
    let mut declared: BTreeSet<MemberId> = BTreeSet::new();
    for (pos, (t, r)) in trace.records.iter().enumerate() {
        let Record::Event {
            event: CpgEvent::ConfChg { failed, .. },
            ..
        } = r
        else {
            continue;
        };
        for f in failed {
            if !declared.insert(f.id) {
                continue;
            }
            let Some(judged) = judged_at(trace, f.id, *t, resume_allowance_ms(timing.of(f.id)))
            else {
                continue;
            };
            let upto = if judged == *t {
                pos
            } else {
                position_after(trace, judged)
            };
            if quorum_at(trace, f.id, upto) {
                return Err(format!(
                    "member {} declared failed at {t} ms while it still had quorum (judged at \
                     {judged} ms)",
                    f.id
                ));
            }
        }
    }
    Ok(())
}

/// A member a configuration change lists in `failed` never reports quorum again under that
/// incarnation: only a later `Started` of it (a restart) may.
fn check_no_quorum_after_failure(trace: &Trace) -> Result<(), String> {
    // Member -> index of the configuration change that declared it failed.
    let mut failed: BTreeMap<MemberId, u64> = BTreeMap::new();
    // Member -> the newest index at which an incarnation of it started.
    let mut incarnated: BTreeMap<MemberId, u64> = BTreeMap::new();
    for (t, r) in &trace.records {
        match r {
            // (Every member delivers the same failure, some much later than others: one that
            // an incarnation agreed after it has superseded is no longer news.)
            Record::Event {
                event:
                    CpgEvent::ConfChg {
                        failed: f, index, ..
                    },
                ..
            } => {
                for m in f {
                    if incarnated.get(&m.id).is_none_or(|i| i < index) {
                        // (A reset start ends its predecessor's memberships in the same entry:
                        // the failure at its own index is the predecessor's.)
                        failed.entry(m.id).or_insert(*index);
                    }
                }
            }
            // A new process (no disk: a new member id anyway), or the incarnation of a member
            // with a disk whose start was agreed after the failure: the failure was its
            // predecessor's.
            Record::Incarnated { member, index, .. } => {
                let newest = incarnated.entry(*member).or_insert(*index);
                *newest = (*newest).max(*index);
                if failed.get(member).is_some_and(|f| f <= index) {
                    failed.remove(member);
                }
            }
            Record::Quorum {
                member,
                has_quorum: true,
            } => {
                if let Some(at) = failed.get(member) {
                    return Err(format!(
                        "member {member} reports quorum at {t} ms although it was declared \
                         failed at index {at} and no incarnation of it started after that"
                    ));
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// The intervals `[from, to)` in which `member`'s quorum watch says true, less the time it was
/// paused and the allowance after each resume (see [`resume_allowance_ms`]).
fn quorum_intervals(trace: &Trace, member: MemberId, allowance_ms: u64) -> Vec<(u64, u64)> {
    let end = trace.records.last().map_or(0, |(t, _)| *t);
    let mut claims = Vec::new();
    let mut frozen = Vec::new();
    let (mut since, mut paused): (Option<u64>, Option<u64>) = (None, None);
    for (t, r) in &trace.records {
        match r {
            Record::Quorum {
                member: m,
                has_quorum,
            } if *m == member => {
                if *has_quorum {
                    since = since.or(Some(*t));
                } else if let Some(s) = since.take() {
                    claims.push((s, *t));
                }
            }
            Record::Crashed { member: m } if *m == member => {
                if let Some(s) = since.take() {
                    claims.push((s, *t));
                }
            }
            Record::Paused { member: m } if *m == member => paused = Some(*t),
            Record::Resumed { member: m, .. } if *m == member => {
                if let Some(p) = paused.take() {
                    frozen.push((p, *t + allowance_ms));
                }
            }
            _ => {}
        }
    }
    claims.extend(since.map(|s| (s, end)));
    frozen.extend(paused.map(|p| (p, u64::MAX)));
    claims
        .into_iter()
        .flat_map(|c| subtract(c, &frozen))
        .collect()
}

/// `span` less every interval of `holes`.
fn subtract(span: (u64, u64), holes: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut out = vec![span];
    for &(h0, h1) in holes {
        out = out
            .into_iter()
            .flat_map(|(a, b)| [(a, b.min(h0)), (a.max(h1), b)])
            .filter(|(a, b)| a < b)
            .collect();
    }
    out
}

/// A member reporting quorum is not far behind: while member X's watch says it has quorum at
/// time t, X has delivered every event it receives that some member delivered before
/// t − `lease_ms` − `heartbeat_ms`: the longest lease of the run (X's lease may end with that of
/// the leader that granted it, see [`Timing`]) and X's own heartbeat.
///
/// Why it holds: the answer to a ping carries the leader's applied index
/// (`Response::Pong`), and the lease counts for the pinger only once it has applied as far.
/// So X, reporting quorum at t, has applied what the leader had applied when it answered a
/// ping X sent after t − its lease. Before that rule, a member that regained a link to the
/// leader after missing entries got a lease with the first answer, before the appends that
/// caught it up (seed 11 of the debug sweep: quorum 97 ms after the heal, the entries 700 ms
/// later); this check is what found it.
///
/// A paused member is not judged while paused nor for the allowance after it resumes.
fn check_quorum_freshness(
    trace: &Trace,
    timing: &Timing,
    delivered: &Delivered<'_>,
) -> Result<(), String> {
    let members: BTreeSet<MemberId> = trace
        .records
        .iter()
        .filter_map(|(_, r)| match r {
            Record::Quorum { member, .. } => Some(*member),
            _ => None,
        })
        .collect();
    let resets = resets(trace);
    for x in members {
        let cuts = resets.get(&x).map(Vec::as_slice).unwrap_or_default();
        let own = timing.of(x);
        let bound = timing.longest.lease_ms + own.heartbeat_ms;
        for (from, to) in quorum_intervals(trace, x, resume_allowance_ms(own)) {
            for (&idx, &first) in &delivered.first_at {
                let must_by = from.max(first + bound);
                // A membership that ended unseen (a reset start before the claim) owes nothing.
                // (At the reset's own index too: the failure it announces to the others is
                // not delivered to the member, whose `Started` says it instead.)
                let ended = cuts.iter().any(|(c, at)| idx <= *c && *at <= must_by);
                if must_by >= to || ended || !delivered.receives(x, idx) {
                    continue;
                }
                if delivered.delivered_at(x, idx).is_none_or(|at| at > must_by) {
                    return Err(format!(
                        "member {x} reports quorum at {must_by} ms but has not delivered index \
                         {idx}, which it receives and which was first delivered at {first} ms, \
                         more than {bound} ms before"
                    ));
                }
            }
        }
    }
    Ok(())
}

fn check_quiescence(
    trace: &Trace,
    per_member: &BTreeMap<MemberId, Vec<(u64, &CpgEvent)>>,
) -> Result<(), String> {
    let Some((live, finals, stranded)) = trace.records.iter().rev().find_map(|(_, r)| match r {
        Record::Quiesced {
            live,
            finals,
            stranded,
        } => Some((live, finals, stranded)),
        _ => None,
    }) else {
        return Err("run did not reach quiescence".into());
    };
    if let Some(m) = stranded.first() {
        return Err(format!(
            "member {m} still runs after healing but cannot join the group (removed from the \
             cluster without learning it?)"
        ));
    }
    if live.len() < 2 {
        return Err(format!("only {} members live after healing", live.len()));
    }
    for (_, r) in &trace.records {
        if let Record::FinalSent { member, ok: false } = r {
            return Err(format!(
                "no progress: final multicast of member {member} failed with a healed majority"
            ));
        }
    }
    for m in live {
        let got: BTreeSet<&[u8]> = per_member
            .get(m)
            .map(|l| {
                l.iter()
                    .filter_map(|(_, e)| match e {
                        CpgEvent::Deliver { payload, .. } => Some(payload.as_ref()),
                        CpgEvent::ConfChg { .. } | CpgEvent::Started { .. } => None,
                    })
                    .collect()
            })
            .unwrap_or_default();
        for f in finals {
            if !got.contains(f.as_bytes()) {
                return Err(format!("member {m} never delivered {f} after quiescence"));
            }
        }
    }
    Ok(())
}
