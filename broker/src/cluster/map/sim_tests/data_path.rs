//! The modelled data path: clients declaring and publishing, primaries replicating to their
//! backups over links that fail and catch up, confirms gated on every counted backup.

use super::*;

impl World {
    /// A turn for slot `slot`: its client's work, then the data path of every primary, then
    /// the checks of the instant.
    pub(super) fn tick(&mut self, world: &Arc<Mutex<World>>, slot: usize, net: &Links) {
        if !self.settling {
            self.client(world, slot);
        }
        for i in 0..self.slots.len() {
            self.replicate(world, i, net);
        }
        self.check_primaries(net);
    }

    /// Slot `slot`'s client: declares and deletes now and then, and publishes to the queues
    /// its member is primary of.
    pub(super) fn client(&mut self, world: &Arc<Mutex<World>>, slot: usize) {
        let node = self.slots[slot].node.clone();
        let ready = self.slots[slot].member.as_ref().is_some_and(|m| {
            m.map.is_live() && m.map.is_synced() && m.map.is_announced() && m.cpg.has_quorum_now()
        });
        if !ready {
            return;
        }
        let newcomer = (self.slots[slot].member.as_ref())
            .is_some_and(|m| m.map.membership().is_newcomer(&node));
        if newcomer && self.rng.gen_bool(0.2) {
            // A member new to the ring claims its share (sent again now and then, as a
            // retried send would be).
            let step = RebalanceStep::Join { node: node.clone() };
            self.submit(world, slot, WiringOp::Rebalance(step), None);
        }
        let name = format!("q{}", self.rng.gen_range(0..QUEUES));
        let roll = self.rng.gen_range(0..100);
        if roll < 6 {
            let mut arguments = FieldTable::default();
            arguments.insert(
                BACKUPS_ARGUMENT.into(),
                AMQPValue::ShortShortUInt(self.rng.gen_range(0..=3)),
            );
            let op = WiringOp::DeclareQueue {
                name,
                durable: true,
                exclusive: false,
                auto_delete: false,
                arguments,
                home: Some(node.clone()),
                server_named: false,
            };
            self.submit(world, slot, op, None);
        } else if roll < 7 {
            let op = WiringOp::DeleteQueue {
                name,
                if_unused: false,
                if_empty: false,
            };
            self.submit(world, slot, op, None);
        } else if roll == 10 && self.rng.gen_bool(0.3) {
            // A member drained or undrained.
            let node = self.slots[self.rng.gen_range(0..self.slots.len())]
                .node
                .clone();
            let draining = self.rng.gen_bool(0.5);
            self.submit(world, slot, WiringOp::DrainMember { node, draining }, None);
        } else if roll == 11 && self.rng.gen_bool(0.3) {
            // A rebalance started (refused while one has moves left) or stopped.
            let step = if self.rng.gen_bool(0.8) {
                RebalanceStep::Start {
                    concurrency: self.rng.gen_range(1..=3),
                }
            } else {
                RebalanceStep::Stop
            };
            self.submit(world, slot, WiringOp::Rebalance(step), None);
        } else if roll < 10 {
            // A planned move to any node (a member or not), now and then called off.
            let incarnation = self.slots[slot]
                .member
                .as_ref()
                .and_then(|m| m.map.roles().get("/", &name).map(|r| r.incarnation));
            if let Some(incarnation) = incarnation {
                let to = self.slots[self.rng.gen_range(0..self.slots.len())]
                    .node
                    .clone();
                let step = if roll < 9 {
                    MoveStep::Request
                } else {
                    MoveStep::Cancel
                };
                let op = WiringOp::MovePrimary {
                    queue: name,
                    incarnation,
                    to,
                    step,
                };
                self.submit(world, slot, op, None);
            }
        }
        let Some(m) = &self.slots[slot].member else {
            return;
        };
        let mine: Vec<QueueKey> = m
            .map
            .roles()
            .iter()
            .filter(|(_, _, r)| r.primary == node && !r.unavailable && !checks::sealed(r))
            .map(|(_, q, r)| (q.to_owned(), r.incarnation))
            .collect();
        for key in mine {
            if self.rng.gen_bool(0.5) {
                self.next_op += 1;
                let op = self.next_op;
                self.slots[slot].held.entry(key).or_default().insert(op);
            }
        }
    }

    /// Multicasts wiring op `op` from slot `slot`'s member; `mark` is what it marks, if it is a
    /// mark (tracked until answered).
    pub(super) fn submit(
        &mut self,
        world: &Arc<Mutex<World>>,
        slot: usize,
        op: WiringOp,
        mark: Option<Mark>,
    ) {
        let Some(m) = self.slots[slot].member.as_mut() else {
            return;
        };
        let request = m.next_request;
        m.next_request += 1;
        if let Some(mark) = mark {
            m.marks.insert(request, mark);
        }
        let msg = ClusterMsg::Op {
            origin: m.cpg.id(),
            request,
            vhost: "/".into(),
            op,
        };
        spawn_mcast(world, slot, m, Some(request), msg);
    }

    /// Slot `i`'s member as a primary: sends its ops to its backups, submits in-sync and
    /// out-of-sync marks, and confirms what every backup it counts acknowledged.
    pub(super) fn replicate(&mut self, world: &Arc<Mutex<World>>, i: usize, net: &Links) {
        let Some(m) = self.running(i, net) else {
            return;
        };
        if !(m.map.is_live() && m.map.is_synced()) {
            return;
        }
        let me = self.slots[i].node.clone();
        let addr = m.cpg.addr().to_owned();
        // Marks are submitted, and confirms sent, only by a member that serves.
        let serves = m.map.is_announced() && m.cpg.has_quorum_now();
        let queues: Vec<(String, QueueRoles)> = m
            .map
            .roles()
            .iter()
            .filter(|(_, _, r)| r.primary == me && !r.unavailable)
            .map(|(_, q, r)| (q.to_owned(), r.clone()))
            .collect();
        for (queue, r) in queues {
            let key = (queue.clone(), r.incarnation);
            let held = self.slots[i].held.get(&key).cloned().unwrap_or_default();
            for b in &r.backups {
                let Some(j) = self.slot_of(b) else { continue };
                let takes = self.running(j, net).is_some_and(|bm| {
                    net.talk(&addr, bm.cpg.addr())
                        && bm.map.is_synced()
                        && bm.map.roles().get("/", &queue).is_some_and(|br| {
                            br.incarnation == r.incarnation
                                && br.primary == me
                                && br.backups.contains(b)
                        })
                });
                let m = self.slots[i].member.as_mut().expect("running");
                let link = m.links.entry((key.clone(), b.clone())).or_default();
                let now = tokio::time::Instant::now();
                if link.down_until.is_none() && !self.settling && self.rng.gen_bool(0.005) {
                    let ms = self.rng.gen_range(100..1_500);
                    link.down_until = Some(now + Duration::from_millis(ms));
                }
                let down = link.down_until.is_some_and(|t| now < t);
                if !down {
                    link.down_until = None;
                }
                if !takes || down {
                    link.streaming = false;
                    continue;
                }
                let streaming = link.streaming;
                if streaming && !self.settling && self.rng.gen_bool(0.25) {
                    // A slow link: this turn's ops (and acknowledgements) arrive later.
                    continue;
                }
                let copy = self.slots[j].held.entry(key.clone()).or_default();
                if streaming {
                    copy.extend(held.iter().copied());
                } else {
                    // An image: the backup's copy becomes the primary's.
                    copy.clone_from(&held);
                }
                let acked = copy.clone();
                let m = self.slots[i].member.as_mut().expect("running");
                let link = m.links.entry((key.clone(), b.clone())).or_default();
                link.streaming = true;
                link.acked = acked;
            }
            if !serves {
                continue;
            }
            // Marks: in sync once a backup holds everything, out of sync once its link failed.
            let m = self.slots[i].member.as_ref().expect("running");
            let mut marks = Vec::new();
            for b in &r.backups {
                let link = m.links.get(&(key.clone(), b.clone()));
                let pending = |in_sync: bool| {
                    m.marks
                        .values()
                        .any(|k| k.queue == key && k.node == *b && k.in_sync == in_sync)
                };
                let streaming = link.is_some_and(|l| l.streaming);
                if r.in_sync.contains(b) {
                    if !streaming && !pending(false) {
                        marks.push((b.clone(), false));
                    }
                } else if streaming
                    && !pending(true)
                    && link.is_some_and(|l| held.is_subset(&l.acked))
                {
                    marks.push((b.clone(), true));
                }
            }
            for (node, in_sync) in marks {
                let op = if in_sync {
                    WiringOp::BackupInSync {
                        queue: queue.clone(),
                        incarnation: r.incarnation,
                        node: node.clone(),
                    }
                } else {
                    WiringOp::BackupOutOfSync {
                        queue: queue.clone(),
                        incarnation: r.incarnation,
                        node: node.clone(),
                    }
                };
                let mark = Mark {
                    queue: key.clone(),
                    node,
                    in_sync,
                };
                self.submit(world, i, op, Some(mark));
            }
            // A sealed queue's switch, once the move's target acknowledged everything held
            // (what keeps the broker's replicator from forgiving the target frames it
            // would refuse as the new primary; here, every confirmed op is on the target by
            // the confirm rule alone, which this checks holds across moves).
            if let Some(to) = r.moving_to.as_ref().filter(|_| checks::sealed(&r)) {
                let m = self.slots[i].member.as_ref().expect("running");
                let caught_up = m
                    .links
                    .get(&(key.clone(), to.clone()))
                    .is_some_and(|l| l.streaming && held.is_subset(&l.acked));
                if caught_up && self.rng.gen_bool(0.3) {
                    let op = WiringOp::MovePrimary {
                        queue: queue.clone(),
                        incarnation: r.incarnation,
                        to: to.clone(),
                        step: MoveStep::Switch,
                    };
                    self.submit(world, i, op, None);
                }
            }
            // Confirms: the backups it counts are its map's in-sync set and those whose
            // in-sync mark is in flight.
            let m = self.slots[i].member.as_ref().expect("running");
            let counted: BTreeSet<&String> = r
                .in_sync
                .iter()
                .chain(
                    m.marks
                        .values()
                        .filter(|k| k.in_sync && k.queue == key)
                        .map(|k| &k.node),
                )
                .collect();
            let acked = |op: &u64| {
                counted.iter().all(|b| {
                    m.links
                        .get(&(key.clone(), (*b).clone()))
                        .is_some_and(|l| l.acked.contains(op))
                })
            };
            let done = self.confirmed.get(&key);
            let new: Vec<u64> = held
                .iter()
                .filter(|op| !done.is_some_and(|d| d.contains(op)) && acked(op))
                .copied()
                .collect();
            self.stats.confirmed += new.len() as u64;
            self.confirmed.entry(key).or_default().extend(new);
        }
    }
}
