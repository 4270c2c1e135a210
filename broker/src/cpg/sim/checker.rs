//! What the simulation records and the properties it checks on the record:
//! virtual synchrony, no delivery on a cut-off minority, quorum lost within a lease and before
//! the majority declares the member failed, and progress once a majority is connected.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use crate::cpg::{CpgConfig, CpgEvent, MemberId};

/// Something that happened in a simulated run.
#[derive(Clone, Debug)]
pub(crate) enum Record {
    Started {
        member: MemberId,
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
    Partitioned {
        minority: Vec<MemberId>,
        /// The last log index on the cut-off side when the cut happened.
        appended: u64,
    },
    Healed,
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

/// Checks every property; `Err` says which one broke and where.
pub(crate) fn check(trace: &Trace, config: &CpgConfig, max_delay_ms: u64) -> Result<(), String> {
    let mut per_member: BTreeMap<MemberId, Vec<&CpgEvent>> = BTreeMap::new();
    let mut global: BTreeMap<u64, &CpgEvent> = BTreeMap::new();
    let mut started: BTreeSet<MemberId> = BTreeSet::new();
    for (_, r) in &trace.records {
        if let Record::Started { member } = r {
            started.insert(*member);
        }
        if let Record::Event { member, event } = r {
            if !started.contains(member) {
                return Err(format!("member {member} delivered before it was admitted"));
            }
            let list = per_member.entry(*member).or_default();
            if list
                .last()
                .is_some_and(|last| last.index() >= event.index())
            {
                return Err(format!(
                    "member {member}: index {} not increasing",
                    event.index()
                ));
            }
            list.push(event);
            match global.get(&event.index()) {
                Some(seen) if *seen != event => {
                    return Err(format!(
                        "index {} delivered differently: {seen:?} vs {event:?}",
                        event.index()
                    ));
                }
                _ => {
                    global.insert(event.index(), event);
                }
            }
        }
    }
    // Virtual synchrony: each member saw every event of the group from its join to its end.
    for (member, list) in &per_member {
        let (Some(first), Some(last)) = (list.first(), list.last()) else {
            continue;
        };
        let mine: BTreeSet<u64> = list.iter().map(|e| e.index()).collect();
        for idx in global.range(first.index()..=last.index()).map(|(i, _)| *i) {
            if !mine.contains(&idx) {
                return Err(format!(
                    "member {member} skipped index {idx} within its membership"
                ));
            }
        }
    }
    check_minorities(trace, config, max_delay_ms)?;
    check_failures_after_lease(trace)?;
    check_quiescence(trace, &per_member)
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

fn check_minorities(trace: &Trace, config: &CpgConfig, max_delay_ms: u64) -> Result<(), String> {
    let recs = &trace.records;
    let mut first_delivery: BTreeMap<u64, u64> = BTreeMap::new();
    for (t, r) in recs {
        if let Record::Event { event, .. } = r {
            first_delivery.entry(event.index()).or_insert(*t);
        }
    }
    for (pos, (t_p, r)) in recs.iter().enumerate() {
        let Record::Partitioned { minority, appended } = r else {
            continue;
        };
        let end = recs[pos + 1..]
            .iter()
            .position(|(_, r)| {
                matches!(
                    r,
                    Record::Partitioned { .. } | Record::Healed | Record::Quiesced { .. }
                )
            })
            .map_or(recs.len(), |p| pos + 1 + p);
        let t_h = recs.get(end).map_or(u64::MAX, |(t, _)| *t);
        // A commit made before the cut reaches a follower with the next heartbeat, so it may
        // still deliver for one heartbeat plus a round trip.
        let quiet_from = t_p + config.heartbeat_ms + 2 * max_delay_ms + 10;
        let lease_deadline = t_p + config.lease_ms + config.heartbeat_ms + 10;
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
                        "member {m} cut off at {t_p} ms delivered at {t} ms: {event:?}"
                    ));
                }
            }
            if t_h > lease_deadline {
                let upto = recs[..end]
                    .iter()
                    .position(|(t, _)| *t > lease_deadline)
                    .unwrap_or(end);
                if quorum_at(trace, m, upto) {
                    return Err(format!(
                        "member {m} cut off at {t_p} ms still claims quorum at {lease_deadline} ms"
                    ));
                }
            }
        }
    }
    Ok(())
}

fn check_failures_after_lease(trace: &Trace) -> Result<(), String> {
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
            if declared.insert(f.id) && quorum_at(trace, f.id, pos) {
                return Err(format!(
                    "member {} declared failed at {t} ms while it still had quorum",
                    f.id
                ));
            }
        }
    }
    Ok(())
}

fn check_quiescence(
    trace: &Trace,
    per_member: &BTreeMap<MemberId, Vec<&CpgEvent>>,
) -> Result<(), String> {
    let Some((live, finals)) = trace.records.iter().rev().find_map(|(_, r)| match r {
        Record::Quiesced { live, finals } => Some((live, finals)),
        _ => None,
    }) else {
        return Err("run did not reach quiescence".into());
    };
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
                    .filter_map(|e| match e {
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
