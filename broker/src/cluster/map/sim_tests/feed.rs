//! Each member's CPG events fed into its real [`ClusterMap`], and the actions the map returns
//! carried out the way `cluster::node` carries them out (hellos, snapshots, joins, answers).

use super::*;

impl World {
    pub(super) fn booted(&mut self, slot: usize, proc: Proc, cpg: &Cpg, founder: bool) {
        self.start.get_or_insert_with(tokio::time::Instant::now);
        let s = &mut self.slots[slot];
        let (map, applied) = match s.checkpoint.clone().filter(|_| cpg.is_restart()) {
            Some(c) => (ClusterMap::resume(cpg.id(), c.clone()), c.through),
            None => {
                s.checkpoint = None;
                (ClusterMap::new(cpg.id(), founder && !cpg.is_restart()), 0)
            }
        };
        s.member = Some(Member {
            proc,
            cpg: cpg.clone(),
            map,
            applied,
            next_request: 1,
            marks: BTreeMap::new(),
            links: BTreeMap::new(),
        });
        let text = format!("slot {slot} ({}) booted as member {}", s.node, cpg.id());
        self.note(text);
    }

    pub(super) fn gone(&mut self, slot: usize) {
        if self.slots[slot].member.take().is_some() {
            let text = format!("slot {slot} ({}) gone", self.slots[slot].node);
            self.note(text);
        }
    }

    /// Feeds `ev` to slot `slot`'s map (process `proc`), carries out its actions and checks
    /// what it decided. Returns the index of the checkpoint it saved, if it saved one.
    pub(super) fn event(&mut self, slot: usize, proc: Proc, ev: CpgEvent) -> Option<u64> {
        if self.slots[slot]
            .member
            .as_ref()
            .is_none_or(|m| m.proc != proc)
        {
            return None;
        }
        if ev.group().is_some_and(|g| g != GROUP) {
            return None;
        }
        let index = ev.index();
        let group_event = !matches!(ev, CpgEvent::Started { .. });
        let conf = matches!(ev, CpgEvent::ConfChg { .. });
        self.first = group_event && index > self.newest;
        if self.first {
            self.newest = index;
        }
        let s = &mut self.slots[slot];
        let m = s.member.as_mut().expect("checked above");
        let actions = match m.map.on_event(ev, &mut s.store) {
            Ok(a) => a,
            Err(e) => {
                self.fail(format!("slot {slot}: the map cannot go on: {e}"));
                return None;
            }
        };
        if group_event {
            m.applied = index;
        }
        if conf {
            self.views.insert(index);
        }
        for a in actions {
            self.act(slot, a);
        }
        let s = &mut self.slots[slot];
        let m = s.member.as_ref().expect("acting keeps the member");
        if group_event && m.map.is_synced() {
            let (membership, roles) = (m.map.membership(), m.map.roles());
            match self.agreed.get(&index) {
                None => {
                    let entry = (m.cpg.id(), membership.clone(), roles.clone());
                    self.agreed.insert(index, entry);
                }
                Some((first, ms, rs)) if ms != membership || rs != roles => {
                    let why = format!(
                        "after index {index}, member {} of slot {slot} holds {membership:?} {roles:?}, member {first} held {ms:?} {rs:?}",
                        m.cpg.id()
                    );
                    self.fail(why);
                }
                Some(_) => {}
            }
        }
        let s = &mut self.slots[slot];
        let m = s.member.as_ref().expect("acting keeps the member");
        if let Some(c) = m.map.checkpoint(&mut s.store)
            && self.rng.gen_bool(0.3)
        {
            let through = c.through;
            s.checkpoint = Some(c);
            return Some(through);
        }
        None
    }

    /// Carries out one of slot `slot`'s map actions, as `cluster::node` does.
    pub(super) fn act(&mut self, slot: usize, action: Action) {
        let s = &mut self.slots[slot];
        let node = s.node.clone();
        let m = s.member.as_mut().expect("a running member acts");
        match action {
            // The session directory has its own tests (`session::directory`).
            Action::SessionChanged { .. } => {}
            // Only the admin API's copies of the membership and the rebalance follow them.
            Action::MembershipChanged | Action::RebalanceChanged => {}
            Action::SendHello => {
                let info = MemberInfo {
                    node_id: node,
                    amqp: format!("a{slot}"),
                    admin: String::new(),
                    zone: String::new(),
                    default_backups: u8::try_from(slot % 3).unwrap_or(1),
                    ring_order: None,
                    places_ring: true,
                    lays_out_ring: true,
                    holds_for_sessions: true,
                    process: m.proc + 1,
                };
                spawn_announce(m.cpg.clone(), ClusterMsg::Hello(info));
            }
            Action::SendSnapshot { to, through } => {
                let msg = m.map.snapshot(to, through, &mut s.store);
                spawn_announce(m.cpg.clone(), msg);
            }
            Action::Answer { request, outcome } => {
                if let Some(mark) = m.marks.remove(&request)
                    && outcome.is_ok()
                {
                    if mark.in_sync {
                        self.stats.in_sync_marks += 1;
                    } else {
                        self.stats.out_of_sync_marks += 1;
                    }
                }
            }
            Action::RolesChanged {
                vhost,
                queue,
                was,
                now,
            } => self.roles_changed(slot, &vhost, &queue, was, now),
            Action::Join => spawn_join(m.cpg.clone(), false),
            Action::Rejoin => spawn_join(m.cpg.clone(), true),
            Action::HostsChanged | Action::Synced => {}
        }
    }

    /// Slot `slot`'s map changed a queue's roles: the store routes to the primary, a member
    /// that became primary starts its links afresh (images first), and the decision is
    /// checked: a new primary was in sync and holds every confirmed op.
    pub(super) fn roles_changed(
        &mut self,
        slot: usize,
        vhost: &str,
        queue: &str,
        was: Option<QueueRoles>,
        now: Option<QueueRoles>,
    ) {
        let s = &mut self.slots[slot];
        let me = s.node.clone();
        if let Some(r) = &now {
            s.store
                .vhosts
                .get_mut(vhost)
                .expect("the test vhost")
                .set_queue_home(queue, &r.primary);
            let key = (queue.to_owned(), r.incarnation);
            let was_mine = was.as_ref().is_some_and(|w| {
                w.incarnation == r.incarnation && w.primary == me && !w.unavailable
            });
            let m = s.member.as_mut().expect("a running member acts");
            if !was_mine || r.unavailable || r.primary != me {
                m.links.retain(|(k, _), _| *k != key);
            } else {
                m.links
                    .retain(|(k, b), _| *k != key || r.backups.contains(b));
            }
        }
        if was.is_none() && now.is_some() && slot == 0 {
            self.stats.queues += 1;
        }
        let (Some(was), Some(now)) = (was, now) else {
            return;
        };
        if was.incarnation != now.incarnation {
            return;
        }
        let key = (queue.to_owned(), now.incarnation);
        if now.unavailable && !was.unavailable {
            self.note(format!("slot {slot}: {queue} unavailable: {now:?}"));
            if slot == 0 {
                self.stats.unavailable += 1;
            }
        }
        if was.primary != now.primary {
            self.note(format!(
                "slot {slot}: {queue} elected {} (was {was:?})",
                now.primary
            ));
            if slot == 0 {
                self.stats.elections += 1;
                if was.moving_to.as_deref() == Some(now.primary.as_str()) {
                    self.stats.moves += 1;
                }
            }
            if !was.in_sync.contains(&now.primary) {
                self.fail(format!(
                    "slot {slot} promoted {} of {queue}, not in sync in {was:?}",
                    now.primary
                ));
            }
        }
        if self.first && !now.unavailable && (was.primary != now.primary || was.unavailable) {
            self.check_holds_confirmed(&now.primary, &key, "after an election");
        }
    }
}

/// Multicasts `msg` from slot `slot`'s member `m` in the background; a mark whose multicast
/// fails is no longer in flight.
pub(super) fn spawn_mcast(
    world: &Arc<Mutex<World>>,
    slot: usize,
    m: &Member,
    request: Option<u64>,
    msg: ClusterMsg,
) {
    let (world, cpg, proc) = (Arc::clone(world), m.cpg.clone(), m.proc);
    tokio::spawn(async move {
        let sent = cpg.mcast(GROUP, Bytes::from(msg.encode())).await;
        if sent.is_err()
            && let Some(request) = request
        {
            let mut w = world.lock();
            if let Some(m) = w.slots[slot].member.as_mut().filter(|m| m.proc == proc) {
                m.marks.remove(&request);
            }
        }
    });
}

/// Multicasts this member's hello or a snapshot for a joiner, retrying on errors as
/// `cluster::node` does.
pub(super) fn spawn_announce(cpg: Cpg, msg: ClusterMsg) {
    tokio::spawn(async move {
        for _ in 0..50 {
            match cpg.mcast(GROUP, Bytes::from(msg.encode())).await {
                Ok(_) | Err(CpgError::Stopped(_)) => return,
                Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
            }
        }
    });
}

/// Joins the cluster group (after leaving it, for a rejoin), retrying as `cluster::node`
/// does, until done or the process stopped.
pub(super) fn spawn_join(cpg: Cpg, leave_first: bool) {
    tokio::spawn(async move {
        if leave_first {
            for _ in 0..50 {
                match cpg.leave(GROUP).await {
                    Ok(_) | Err(CpgError::Stopped(_) | CpgError::NotInGroup { .. }) => break,
                    Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                }
            }
        }
        for _ in 0..50 {
            match cpg.join(GROUP).await {
                Ok(_) | Err(CpgError::Stopped(_)) => return,
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    });
}
