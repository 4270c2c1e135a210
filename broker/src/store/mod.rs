//! Persistence: everything under `--data-dir`.
//!
//! * `FORMAT` — the data format version; a newer one is refused, never rewritten.
//! * `LOCK` — held with `flock` while a broker runs; a second broker on the same directory
//!   refuses to start.
//! * `wiring.json` — durable exchanges, queues and bindings of every vhost, replaced
//!   atomically (write, fsync, rename, fsync directory) by the journal writer.
//! * `journal/NNNNNNNNNNNNNNNN.seg` — the journal segments (see [`journal`]).
//! * `snapshot` — the queue indexes as of a journal position (see [`snapshot`]), replaced
//!   atomically by the journal's snapshot thread.

pub mod index;
pub mod journal;
pub mod paging;
pub mod record;
pub mod recovery;
pub mod snapshot;
pub mod spare;

#[cfg(test)]
mod tests;

use crate::core::wiring::Wiring;
use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// The data format this broker writes.
pub const FORMAT_VERSION: u32 = 1;
/// The first bytes of every segment file.
pub const SEGMENT_MAGIC: &[u8; 8] = b"RMQJ\x00\x00\x00\x01";

/// Why the data directory cannot be used.
#[derive(Debug, Error)]
pub enum StoreError {
    /// An I/O operation failed; the text says which.
    #[error("{0}: {1}")]
    Io(String, #[source] std::io::Error),
    /// Another broker holds the directory.
    #[error(
        "data dir {0} is in use by another ringmq-broker ({1}); stop it or choose another --data-dir"
    )]
    Locked(PathBuf, String),
    /// The directory was written by a newer broker.
    #[error(
        "data dir {dir} has format version {found}, newer than this broker's {FORMAT_VERSION}; run a newer ringmq-broker or choose another --data-dir"
    )]
    NewerFormat {
        /// Directory.
        dir: PathBuf,
        /// Version found.
        found: u32,
    },
    /// A file holds something this broker cannot read.
    #[error("{0} is unreadable: {1}")]
    Corrupt(PathBuf, String),
}

/// Path of segment `number`.
pub fn segment_path(dir: &Path, number: u64) -> PathBuf {
    dir.join("journal").join(format!("{number:016}.seg"))
}

/// fsyncs the journal directory of `data_dir`, so that a created or deleted segment
/// survives a power loss.
pub fn sync_journal_dir(data_dir: &Path) -> Result<(), StoreError> {
    let dir = data_dir.join("journal");
    File::open(&dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| StoreError::Io(format!("syncing directory {}", dir.display()), e))
}

#[derive(serde::Serialize, serde::Deserialize)]
struct WiringFile {
    format: u32,
    vhosts: BTreeMap<String, Wiring>,
}

/// Replaces `wiring.json` atomically.
pub fn write_wiring_file(dir: &Path, wiring: &BTreeMap<String, Wiring>) -> Result<(), StoreError> {
    let json = serde_json::to_vec(&WiringFile {
        format: FORMAT_VERSION,
        vhosts: wiring.clone(),
    })
    .expect("wiring serializes to JSON");
    crate::atomic_file::write_atomically(dir, "wiring.json", &json).map_err(|e| {
        StoreError::Io(
            format!("replacing {}", dir.join("wiring.json").display()),
            e,
        )
    })
}

/// Reads `wiring.json` (empty when absent).
pub fn read_wiring_file(dir: &Path) -> Result<BTreeMap<String, Wiring>, StoreError> {
    let path = dir.join("wiring.json");
    match std::fs::read(&path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(BTreeMap::new()),
        Err(e) => Err(StoreError::Io(format!("reading {}", path.display()), e)),
        Ok(bytes) => {
            let file: WiringFile = serde_json::from_slice(&bytes)
                .map_err(|e| StoreError::Corrupt(path.clone(), e.to_string()))?;
            Ok(file.vhosts)
        }
    }
}

/// The data directory, locked for this process.
#[derive(Debug)]
pub struct DataDir {
    /// Its path.
    pub path: PathBuf,
    _lock: File,
}

impl DataDir {
    /// Creates (if needed), locks and checks the format of `path`.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        std::fs::create_dir_all(path.join("journal"))
            .map_err(|e| StoreError::Io(format!("creating {}", path.display()), e))?;
        let lock_path = path.join("LOCK");
        let mut lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&lock_path)
            .map_err(|e| StoreError::Io(format!("opening {}", lock_path.display()), e))?;
        // SAFETY: flock on a descriptor we own.
        if unsafe {
            libc::flock(
                std::os::fd::AsRawFd::as_raw_fd(&lock),
                libc::LOCK_EX | libc::LOCK_NB,
            )
        } != 0
        {
            let holder = std::fs::read_to_string(&lock_path).unwrap_or_default();
            return Err(StoreError::Locked(
                path.to_owned(),
                format!("pid {}", holder.trim()),
            ));
        }
        lock.set_len(0)
            .map_err(|e| StoreError::Io(format!("writing {}", lock_path.display()), e))?;
        write!(lock, "{}", std::process::id())
            .map_err(|e| StoreError::Io(format!("writing {}", lock_path.display()), e))?;
        let format_path = path.join("FORMAT");
        match std::fs::read_to_string(&format_path) {
            Ok(s) => {
                let found = s
                    .trim()
                    .strip_prefix("ringmq-data ")
                    .and_then(|v| v.parse::<u32>().ok())
                    .ok_or_else(|| {
                        StoreError::Corrupt(
                            format_path.clone(),
                            format!("unexpected content {s:?}"),
                        )
                    })?;
                if found > FORMAT_VERSION {
                    return Err(StoreError::NewerFormat {
                        dir: path.to_owned(),
                        found,
                    });
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                std::fs::write(&format_path, format!("ringmq-data {FORMAT_VERSION}\n"))
                    .map_err(|e| StoreError::Io(format!("writing {}", format_path.display()), e))?;
            }
            Err(e) => {
                return Err(StoreError::Io(
                    format!("reading {}", format_path.display()),
                    e,
                ));
            }
        }
        Ok(Self {
            path: path.to_owned(),
            _lock: lock,
        })
    }
}
