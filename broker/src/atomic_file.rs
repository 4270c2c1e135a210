//! Replacing a small file so that a crash leaves either the old contents or the new, never a
//! mix: write a temporary file beside it, fsync it, rename it over the file, fsync the
//! directory. The store's `wiring.json`, the CPG layer's snapshot, log compaction and member
//! id, and the cluster map checkpoint all need exactly this.

use std::fs::File;
use std::io::{self, Write};
use std::path::Path;

/// Replaces `dir/name` with `bytes` atomically and durably (see the module documentation);
/// the temporary file is `dir/name.tmp`.
pub fn write_atomically(dir: &Path, name: &str, bytes: &[u8]) -> io::Result<()> {
    let tmp = dir.join(format!("{name}.tmp"));
    {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, dir.join(name))?;
    File::open(dir)?.sync_all()
}
