//! Spare segments: journal files filled with zeros ahead of time, on a thread of their own.
//!
//! On ext4 (and XFS) an `fdatasync` after a write that makes a file longer must also commit
//! the new size through the filesystem's own journal; after a write over blocks that already
//! hold data it flushes the data alone. On the project's test machine (ext4 on virtio) a
//! 110 KB write and its `fdatasync` took 590 µs at the end of a file and 295 µs over zeros
//! written beforehand (`docs/performance.md`). The confirm of a persistent message waits for
//! that sync, so the journal writes its segments over zeros. `fallocate` would not do: the
//! extents it reserves are "unwritten", and the first write into one is a metadata change
//! again.
//!
//! The zeros cost one sequential write of each segment, made here, off the confirm path,
//! flushed a slice at a time so that a journal sync never queues behind a whole segment.
//! When no spare is ready (a burst faster than the disk, or a disk too full for one, which is
//! tried again every ten seconds), the journal starts a segment the old way and loses nothing
//! but the speed. A spare is named `spare-N.tmp` until the journal
//! takes it, writes the segment header and renames it; recovery deletes what is left of
//! them and reads a zero record header as the end of what a segment holds.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, sync_channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long after a spare could not be made (a full disk, say) the thread tries again.
const RETRY_AFTER: Duration = Duration::from_secs(10);

/// Bytes of zeros written (and flushed) per step: small enough that a journal sync waiting
/// behind one step waits about a millisecond on a slow disk.
const STEP_BYTES: usize = 256 * 1024;

/// A zero-filled file, flushed to disk, ready to become a segment.
#[derive(Debug)]
pub struct Spare {
    /// The file, open for writing at any offset.
    pub file: File,
    /// Its temporary name in the journal directory.
    pub path: PathBuf,
}

/// The thread that keeps one spare segment ready.
pub struct Spares {
    ready: Option<Receiver<Spare>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Spares {
    /// Deletes the spares a previous run left in `journal_dir` and starts preparing spares
    /// of `size` bytes there.
    pub fn start(journal_dir: PathBuf, size: u64) -> std::io::Result<Self> {
        Self::start_retrying(journal_dir, size, RETRY_AFTER)
    }

    /// As [`Spares::start`], trying again `retry` after a spare could not be made.
    fn start_retrying(journal_dir: PathBuf, size: u64, retry: Duration) -> std::io::Result<Self> {
        remove_leftovers(&journal_dir)?;
        // A rendezvous: the thread holds one finished spare until the journal takes it.
        let (tx, rx) = sync_channel(0);
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let thread = std::thread::Builder::new()
            .name("ringmq-spares".into())
            .spawn(move || {
                let mut failing = false;
                for n in 0u64.. {
                    let path = journal_dir.join(format!("spare-{n}.tmp"));
                    let file = match fill(&path, size, &stopping) {
                        Ok(Some(file)) => file,
                        Ok(None) => break,
                        Err(e) => {
                            // Not fatal: the journal starts segments the old way meanwhile.
                            if !failing {
                                tracing::warn!(path = %path.display(), error = %e, retry_s = retry.as_secs_f64(),
                                    "cannot prepare a spare journal segment; segments grow as they are written until it can");
                            }
                            failing = true;
                            let _ = std::fs::remove_file(&path);
                            if !pause(retry, &stopping) {
                                break;
                            }
                            continue;
                        }
                    };
                    if failing {
                        tracing::info!("spare journal segments are prepared again");
                        failing = false;
                    }
                    if let Err(unsent) = tx.send(Spare { file, path }) {
                        let _ = std::fs::remove_file(&unsent.0.path);
                        break;
                    }
                }
            })?;
        Ok(Self {
            ready: Some(rx),
            stop,
            thread: Some(thread),
        })
    }

    /// A spare if one is ready; never waits.
    pub fn take(&self) -> Option<Spare> {
        self.ready.as_ref()?.try_recv().ok()
    }
}

impl Drop for Spares {
    /// Stops the thread and waits for it: it deletes the spare it was holding or filling.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.ready = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Writes `size` bytes of zeros to a new file at `path`, flushing every step; `None` (and no
/// file) when asked to stop meanwhile.
fn fill(path: &Path, size: u64, stop: &AtomicBool) -> std::io::Result<Option<File>> {
    let mut file = OpenOptions::new()
        .create_new(true)
        .read(true)
        .write(true)
        .open(path)?;
    let zeros = vec![0u8; STEP_BYTES];
    let mut left = size;
    while left > 0 {
        if stop.load(Ordering::Relaxed) {
            drop(file);
            std::fs::remove_file(path)?;
            return Ok(None);
        }
        let step = left.min(STEP_BYTES as u64) as usize;
        file.write_all(&zeros[..step])?;
        file.sync_data()?;
        left -= step as u64;
    }
    Ok(Some(file))
}

/// Sleeps `how_long` in short steps; false as soon as asked to stop.
fn pause(how_long: Duration, stop: &AtomicBool) -> bool {
    let until = Instant::now() + how_long;
    while Instant::now() < until {
        if stop.load(Ordering::Relaxed) {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20).min(how_long));
    }
    !stop.load(Ordering::Relaxed)
}

/// Deletes `spare-*.tmp` files in `journal_dir` (none if it does not exist yet).
fn remove_leftovers(journal_dir: &Path) -> std::io::Result<()> {
    let entries = match std::fs::read_dir(journal_dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        entries => entries?,
    };
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name();
        if name
            .to_str()
            .is_some_and(|n| n.starts_with("spare-") && n.ends_with(".tmp"))
        {
            std::fs::remove_file(entry.path())?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fresh_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ringmq-spares-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn wait_for_spare(spares: &Spares) -> Spare {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(s) = spares.take() {
                return s;
            }
            assert!(Instant::now() < deadline, "no spare within 10 s");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn a_spare_is_all_zeros_of_the_asked_size_and_the_next_has_another_name() {
        let dir = fresh_dir("size");
        let spares = Spares::start(dir.clone(), 300_000).unwrap();
        let first = wait_for_spare(&spares);
        let data = std::fs::read(&first.path).unwrap();
        assert_eq!(data.len(), 300_000);
        assert!(data.iter().all(|b| *b == 0));
        let second = wait_for_spare(&spares);
        assert_ne!(first.path, second.path);
        drop(spares);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn leftovers_are_deleted_at_start_and_the_held_spare_at_stop() {
        let dir = fresh_dir("leftovers");
        std::fs::write(dir.join("spare-7.tmp"), b"old").unwrap();
        std::fs::write(dir.join("0000000000000001.seg"), b"keep").unwrap();
        let spares = Spares::start(dir.clone(), 4096).unwrap();
        assert!(!dir.join("spare-7.tmp").exists());
        let taken = wait_for_spare(&spares);
        // The thread fills the next one and holds it until dropped.
        std::thread::sleep(Duration::from_millis(100));
        drop(spares);
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        let taken_name = taken
            .path
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .to_string();
        assert_eq!(names, vec!["0000000000000001.seg".to_string(), taken_name]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_spare_that_cannot_be_made_is_tried_again_until_it_can() {
        let dir = fresh_dir("retry");
        let later = dir.join("later");
        let spares =
            Spares::start_retrying(later.clone(), 4096, Duration::from_millis(20)).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        assert!(spares.take().is_none(), "no directory, no spare");
        std::fs::create_dir(&later).unwrap();
        let spare = wait_for_spare(&spares);
        assert_eq!(std::fs::metadata(&spare.path).unwrap().len(), 4096);
        drop(spares);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
