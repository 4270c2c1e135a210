//! The broker's vhosts: made in one place ([`new_vhost`]) whether they come from the
//! configuration, from the data directory at start, from the admin API or from a cluster
//! snapshot, so every vhost records its ops and has the configured limits.

use super::Broker;
use crate::clock::now_ms;
use crate::config::Config;
use crate::core::VHost;
use crate::store::journal::{DiskState, Job};
use crate::store::{DataDir, StoreError};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

/// A vhost as the broker runs it: with the configured limits, filled by `restore` (what the
/// data directory holds; nothing for a new vhost), then recording its queue ops for the
/// journal — restoring is not a change, the journal already holds it.
fn new_vhost(
    config: &Config,
    name: &str,
    name_seed: u64,
    restore: impl FnOnce(&mut VHost),
) -> VHost {
    let mut vhost = VHost::new(name, name_seed);
    // Limits first: restoring messages pages out those beyond the memory budget.
    vhost.set_limits(config.vhost_limits());
    restore(&mut vhost);
    if config.cluster_listen.is_some() {
        vhost.set_node(&config.node_id);
    }
    vhost.set_record_ops(true);
    vhost
}

/// What recovery gives the broker: its vhosts with their durable wiring and messages back,
/// and the journal's state to go on from.
pub(super) struct Recovered {
    /// The vhosts, by name.
    pub vhosts: HashMap<String, Arc<Mutex<VHost>>>,
    /// Their names: the configured ones, then those only the data directory knows.
    pub names: Vec<String>,
    /// The journal's index of what it holds.
    pub disk: DiskState,
    /// The next journal segment to write.
    pub next_segment: u64,
}

/// Reads the data directory and rebuilds the configured vhosts, and those the data dir
/// holds durable objects for (created at run time through the admin API), from it.
pub(super) fn recover(config: &Config, data_dir: &DataDir) -> Result<Recovered, StoreError> {
    let started = std::time::Instant::now();
    let mut recovered = crate::store::recovery::recover(&data_dir.path)?;
    let read_ms = started.elapsed().as_millis() as u64;
    for line in &recovered.damage {
        tracing::warn!(damage = %line, "journal damage found during recovery");
    }
    if let Some(reason) = &recovered.snapshot_ignored {
        tracing::warn!(%reason, "snapshot ignored; recovering from the whole journal");
    }
    let seed = now_ms() ^ u64::from(std::process::id()).rotate_left(32);
    let now = now_ms();
    let mut vhosts = HashMap::new();
    let mut restored = 0usize;
    let mut names: Vec<String> = config.vhosts.clone();
    names.extend(
        recovered
            .disk
            .wiring
            .keys()
            .filter(|v| !config.vhosts.contains(v))
            .cloned(),
    );
    for (i, name) in names.iter().enumerate() {
        let vhost = new_vhost(config, name, seed.wrapping_add(i as u64), |vhost| {
            let Some(wiring) = recovered.disk.wiring.get(name).cloned() else {
                return;
            };
            let queues: Vec<(u64, String)> = wiring
                .queues
                .iter()
                .map(|q| (q.uid, q.name.clone()))
                .collect();
            for skipped in vhost.restore_wiring(wiring, now) {
                tracing::warn!(vhost = %name, %skipped, "durable object not restored");
            }
            for (uid, queue) in queues {
                if let Some(messages) = recovered.messages.remove(&uid) {
                    restored += messages.len();
                    vhost.restore_messages(&queue, messages);
                }
                if let Some(table) = recovered.disk.producers.get(&uid) {
                    vhost.restore_producers(&queue, &table.highest());
                }
            }
        });
        vhosts.insert(name.clone(), Arc::new(Mutex::new(vhost)));
    }
    tracing::info!(
        records = recovered.records,
        snapshot_records = recovered.snapshot_records,
        messages = restored,
        segments = recovered.disk.index.segments.len(),
        read_ms,
        elapsed_ms = started.elapsed().as_millis() as u64,
        "recovery done"
    );
    Ok(Recovered {
        vhosts,
        names,
        disk: recovered.disk,
        next_segment: recovered.next_segment,
    })
}

impl Broker {
    /// A vhost by name.
    pub fn vhost(&self, name: &str) -> Option<Arc<Mutex<VHost>>> {
        self.vhosts.read().get(name).cloned()
    }

    /// All vhosts, sorted by name.
    pub fn vhosts(&self) -> Vec<(String, Arc<Mutex<VHost>>)> {
        let mut v: Vec<_> = self
            .vhosts
            .read()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// Creates a vhost; returns false if it existed.
    pub fn add_vhost(&self, name: &str) -> bool {
        let mut vhosts = self.vhosts.write();
        if vhosts.contains_key(name) {
            return false;
        }
        let seed = now_ms() ^ (vhosts.len() as u64).rotate_left(48);
        let vhost = new_vhost(&self.config, name, seed, |_| {});
        vhosts.insert(name.to_owned(), Arc::new(Mutex::new(vhost)));
        tracing::info!(vhost = name, "vhost created");
        true
    }

    /// Deletes a vhost, closing its connections (320) and forgetting its permissions;
    /// returns false if it did not exist.
    pub fn remove_vhost(&self, name: &str) -> bool {
        if self.vhosts.write().remove(name).is_none() {
            return false;
        }
        self.journal.submit(Job::VhostDeleted {
            vhost: name.to_owned(),
        });
        self.users.forget_vhost(name);
        for c in self.registry.connections() {
            if c.vhost == name {
                self.force_close(c.id, &format!("vhost '{name}' is deleted"));
            }
        }
        tracing::info!(vhost = name, "vhost deleted");
        true
    }
}
