//! Files replaced whole or not at all: a save that fails (a full disk, a read-only directory, a
//! crash) leaves the previous file under the final name, never a half-written one.
//!
//! Each file is written to `<name>.tmp` in the same directory (a rename is atomic only within
//! one file system), flushed to the disk (`fsync`), and renamed over `<name>`; the directory is
//! then flushed so the rename itself survives a crash. Two saves to the same path at once would
//! share the `.tmp` name: callers serialize their saves.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// Replace `path` with `bytes`, atomically: after an error `path` is as it was (the temporary
/// `<name>.tmp` is removed), after `Ok` it holds exactly `bytes`, on the disk. The directory
/// must exist.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    write_atomic_all(&[(path, bytes)]).map_err(|(_, e)| e)
}

/// Replace several files, each atomically ([`write_atomic`]), and all of them only once every
/// one is written: every `.tmp` is written and flushed first, then they are renamed in order. A
/// failed write therefore replaces none of them; only a failed rename (rare: the temporaries
/// already exist beside their targets) can leave the first files new and the rest old. The
/// error names the file it concerns. For a pair that must match (an adapter's weights and its
/// config, a checkpoint's parts).
pub fn write_atomic_all(files: &[(&Path, &[u8])]) -> Result<(), (PathBuf, io::Error)> {
    let mut staged: Vec<PathBuf> = Vec::with_capacity(files.len());
    // Best effort: the error being reported is the one that matters. (A `.tmp` that is a
    // directory is not removed: `remove_file` refuses directories.)
    let cleanup = |staged: &[PathBuf]| {
        for tmp in staged {
            let _ = fs::remove_file(tmp);
        }
    };
    for &(path, bytes) in files {
        let tmp = temp_path(path);
        // Before the write, so that a partly written temporary is removed too.
        staged.push(tmp.clone());
        if let Err(e) = write_synced(&tmp, bytes) {
            cleanup(&staged);
            return Err((path.to_path_buf(), e));
        }
    }
    for (i, &(path, _)) in files.iter().enumerate() {
        if let Err(e) = fs::rename(&staged[i], path) {
            cleanup(&staged[i..]);
            return Err((path.to_path_buf(), e));
        }
    }
    for &(path, _) in files {
        sync_parent(path).map_err(|e| (path.to_path_buf(), e))?;
    }
    Ok(())
}

/// `<name>.tmp` beside `path`.
fn temp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    path.with_file_name(name)
}

/// `bytes` into a new (or truncated) `path`, flushed to the disk.
fn write_synced(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut file = File::create(path)?;
    file.write_all(bytes)?;
    file.sync_all()
}

/// Flush the directory holding `path`, so that a rename into it is on the disk (Unix; other
/// systems cannot open a directory as a file, and their renames are journaled).
fn sync_parent(path: &Path) -> io::Result<()> {
    #[cfg(unix)]
    {
        let parent = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        File::open(parent)?.sync_all()?;
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}
