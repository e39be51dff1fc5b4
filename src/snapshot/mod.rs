//! Durable state: snapshots of the fleet written to `--state-dir`, and the
//! newest one loaded at start, so a restarted kvroute comes back with its
//! workers, cordons, leases, sessions, bookings, cursors and the exact
//! index, then catches up from the sources (workers resend what came after
//! each saved cursor).
//!
//! A snapshot is taken by the fleet without stopping routing or ingestion
//! (`fleet::state`), encoded and written off the async threads, and
//! written atomically: a temporary file, fsync, rename, fsync of the
//! directory.
//!
//! A snapshot file is untrusted input: it can be planted or damaged. Only
//! regular files are read (no symlink, FIFO or device), the header is
//! checked against the file's size before the body is read, and every
//! worker in it is held to what RegisterWorker would accept now. At start
//! the newest file that loads is loaded: a damaged one (truncated,
//! corrupted, another format version, an impossible state) is renamed
//! aside, logged and counted, and the next older one is tried; one that
//! cannot be read (an I/O error such as a permission denied) is not
//! damage: it is left in place, logged and counted, and the next one is
//! tried. With none that loads kvroute starts cold, unless
//! `--require-snapshot` makes that a start-up failure (then nothing is
//! moved). Pruning keeps the two newest snapshots this process wrote or
//! loaded, and never removes a file newer than them: the last loadable
//! snapshot is never pruned for a damaged or unreadable newer one.

pub mod convert;
pub mod format;

use std::{
    io::Write,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use tokio::{sync::Mutex, time::Instant};

use crate::{
    fleet::{
        Fleet,
        state::{FleetState, RestoreReport},
    },
    metrics::Metrics,
};

/// Snapshots kept in the state directory.
pub const KEEP: usize = 2;
const PREFIX: &str = "snapshot-";
const SUFFIX: &str = ".kvs";

/// Why a snapshot could not be written or loaded.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// The state directory cannot be used (made, listed, synced).
    #[error("state directory {dir}: {error}")]
    Dir { dir: String, error: std::io::Error },
    /// A snapshot file cannot be written, renamed or read.
    #[error("snapshot {path}: {error}")]
    Io { path: String, error: std::io::Error },
    #[error("no snapshot in the state directory loads ({why}); --require-snapshot: not starting")]
    Unusable { why: String },
    #[error("the snapshot writer stopped: {0}")]
    Task(String),
    /// Cluster mode: the cluster's snapshot could not be written now.
    #[error("{0}")]
    Replicated(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// Writes a snapshot now, for Admin `Snapshot`: the state directory's file
/// alone, the cluster's object in cluster mode (`app.rs` chooses).
pub trait WriteSnapshot: Send + Sync + 'static {
    fn write_now(&self) -> futures::future::BoxFuture<'_, Result<Written, SnapshotError>>;
}

impl WriteSnapshot for Snapshots {
    fn write_now(&self) -> futures::future::BoxFuture<'_, Result<Written, SnapshotError>> {
        Box::pin(self.write())
    }
}

/// A snapshot written.
#[derive(Clone, Debug, PartialEq)]
pub struct Written {
    pub path: PathBuf,
    pub bytes: u64,
    pub entries: u64,
    pub workers: u64,
    pub capture_seconds: f64,
    pub write_seconds: f64,
}

/// A snapshot loaded at start.
#[derive(Clone, Debug, PartialEq)]
pub struct Loaded {
    pub path: PathBuf,
    pub report: RestoreReport,
    pub seconds: f64,
}

/// What the start did with the state directory's snapshots.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoadOutcome {
    /// The newest snapshot that loaded, if any did.
    pub loaded: Option<Loaded>,
    /// Newer files passed over, newest first.
    pub passed_over: Vec<PassedOver>,
}

/// A snapshot file passed over at start, and why.
#[derive(Clone, Debug, PartialEq)]
pub struct PassedOver {
    pub path: PathBuf,
    pub why: String,
    /// Where a damaged file was moved; `None` for one left in place (it
    /// could not be read, or `--require-snapshot` refused to start).
    pub moved_to: Option<PathBuf>,
}

/// Why one snapshot file does not load.
#[derive(Debug)]
enum Unloadable {
    /// Its contents are not a snapshot this kvroute restores.
    Damaged(String),
    /// It could not be read: not its contents' fault.
    Unreadable(std::io::Error),
}

impl std::fmt::Display for Unloadable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Damaged(why) => f.write_str(why),
            Self::Unreadable(error) => write!(f, "cannot be read: {error}"),
        }
    }
}

/// The snapshots of one fleet in one directory.
pub struct Snapshots {
    dir: PathBuf,
    fleet: Arc<Fleet>,
    metrics: Arc<Metrics>,
    /// One snapshot at a time; also when the last one was written or loaded.
    last: Mutex<Option<Instant>>,
    /// Snapshots this process wrote or loaded, oldest first: the ones
    /// pruning counts as kept ([`prune`]).
    loadable: parking_lot::Mutex<Vec<PathBuf>>,
}

impl std::fmt::Debug for Snapshots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Snapshots")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Snapshots {
    /// Snapshots of `fleet` in `dir`, created if missing.
    pub(crate) fn open(
        dir: &Path,
        fleet: Arc<Fleet>,
        metrics: Arc<Metrics>,
    ) -> Result<Self, SnapshotError> {
        let dir_error = |error| SnapshotError::Dir {
            dir: dir.display().to_string(),
            error,
        };
        if std::fs::symlink_metadata(dir).is_ok_and(|m| !m.is_dir()) && !dir.is_dir() {
            return Err(dir_error(std::io::Error::new(
                std::io::ErrorKind::NotADirectory,
                "exists and is not a directory",
            )));
        }
        std::fs::create_dir_all(dir).map_err(dir_error)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            fleet,
            metrics,
            last: Mutex::new(None),
            loadable: parking_lot::Mutex::new(Vec::new()),
        })
    }

    /// Takes the fleet's state and writes it (see the module docs).
    pub(crate) async fn write(&self) -> Result<Written, SnapshotError> {
        let mut last = self.last.lock().await;
        let started = Instant::now();
        let state = self.fleet.capture().await;
        let capture_seconds = started.elapsed().as_secs_f64();
        let (entries, workers) = (state.entries(), state.workers.len() as u64);
        let dir = self.dir.clone();
        let mut loadable = self.loadable.lock().clone();
        let written = tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            let taken = unix_ms();
            let bytes = format::encode(&convert::state_to_pb(&state, taken));
            drop(state);
            let path = write_atomically(&dir, taken, &bytes)?;
            loadable.push(path.clone());
            let kept = prune(&dir, KEEP, &loadable);
            Ok::<_, SnapshotError>((
                path,
                kept,
                bytes.len() as u64,
                started.elapsed().as_secs_f64(),
            ))
        })
        .await
        .map_err(|e| SnapshotError::Task(e.to_string()))?;
        let s = &self.metrics.snapshot;
        let (path, bytes, write_seconds) = match written {
            Ok((path, kept, bytes, seconds)) => {
                *self.loadable.lock() = kept;
                (path, bytes, seconds)
            }
            Err(error) => {
                s.outcomes.with_label_values(&["write_failed"]).inc();
                return Err(error);
            }
        };
        *last = Some(Instant::now());
        s.outcomes.with_label_values(&["written"]).inc();
        s.bytes.set(i64::try_from(bytes).unwrap_or(i64::MAX));
        s.entries.set(i64::try_from(entries).unwrap_or(i64::MAX));
        s.capture_seconds.set(capture_seconds);
        s.write_seconds.set(write_seconds);
        s.age.set(0.0);
        tracing::info!(path = %path.display(), bytes, entries, workers, capture_seconds, write_seconds, "snapshot written");
        Ok(Written {
            path,
            bytes,
            entries,
            workers,
            capture_seconds,
            write_seconds,
        })
    }

    /// Loads the newest snapshot that loads into the fleet (which has no
    /// worker yet), passing over newer ones that do not (see the module
    /// docs). `Err` only with `required` when snapshots exist and none
    /// loads (nothing is moved then), or when the directory cannot be
    /// listed.
    pub(crate) async fn load(&self, required: bool) -> Result<LoadOutcome, SnapshotError> {
        let mut last = self.last.lock().await;
        let files = snapshot_files(&self.dir)?;
        let mut outcome = LoadOutcome::default();
        let mut damaged = Vec::new();
        for path in files.iter().rev() {
            let started = Instant::now();
            let read = path.clone();
            let decoded = tokio::task::spawn_blocking(move || read_state(&read))
                .await
                .map_err(|e| SnapshotError::Task(e.to_string()))?;
            let state = match decoded {
                Ok(state) => state,
                Err(why) => {
                    let label = match why {
                        Unloadable::Damaged(_) => "damaged",
                        Unloadable::Unreadable(_) => "unreadable",
                    };
                    self.count(label);
                    if matches!(why, Unloadable::Damaged(_)) {
                        damaged.push(outcome.passed_over.len());
                    }
                    outcome.passed_over.push(PassedOver {
                        path: path.clone(),
                        why: why.to_string(),
                        moved_to: None,
                    });
                    continue;
                }
            };
            let report = self.fleet.restore(state).await;
            let seconds = started.elapsed().as_secs_f64();
            *last = Some(Instant::now());
            self.loadable.lock().push(path.clone());
            let s = &self.metrics.snapshot;
            s.outcomes.with_label_values(&["loaded"]).inc();
            s.load_seconds.set(seconds);
            s.entries_restored
                .set(i64::try_from(report.entries).unwrap_or(i64::MAX));
            s.age.set(0.0);
            outcome.loaded = Some(Loaded {
                path: path.clone(),
                report,
                seconds,
            });
            break;
        }
        if required && outcome.loaded.is_none() && !outcome.passed_over.is_empty() {
            let why = outcome
                .passed_over
                .iter()
                .map(|p| format!("{}: {}", p.path.display(), p.why))
                .collect::<Vec<_>>()
                .join("; ");
            return Err(SnapshotError::Unusable { why });
        }
        // kvroute starts (from an older snapshot, or cold): damaged files
        // go aside, kept for a look and out of pruning's way.
        for at in damaged {
            let passed = &mut outcome.passed_over[at];
            passed.moved_to = Some(set_aside(&passed.path)?);
            self.count("set_aside");
        }
        Ok(outcome)
    }

    fn count(&self, outcome: &str) {
        self.metrics
            .snapshot
            .outcomes
            .with_label_values(&[outcome])
            .inc();
    }

    /// Sets the age gauge (before a scrape).
    pub(crate) fn refresh_age(&self) {
        if let Ok(last) = self.last.try_lock()
            && let Some(at) = *last
        {
            self.metrics.snapshot.age.set(at.elapsed().as_secs_f64());
        }
    }

    /// Writes a snapshot every `interval` until `stop`.
    pub(crate) async fn every(
        &self,
        interval: Duration,
        stop: tokio_util::sync::CancellationToken,
    ) {
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = stop.cancelled() => break,
                _ = ticker.tick() => {}
            }
            if let Err(error) = self.write().await {
                tracing::warn!(%error, "periodic snapshot failed");
            }
        }
    }
}

/// Snapshot files in `dir`, oldest first (their names sort by time).
fn snapshot_files(dir: &Path) -> Result<Vec<PathBuf>, SnapshotError> {
    let entries = std::fs::read_dir(dir).map_err(|error| SnapshotError::Dir {
        dir: dir.display().to_string(),
        error,
    })?;
    let mut files: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(PREFIX) && n.ends_with(SUFFIX))
        })
        .collect();
    files.sort();
    Ok(files)
}

/// Writes `bytes` as the snapshot taken at `taken_unix_ms`: a temporary
/// file, fsync, rename, fsync of the directory, so a crash leaves either
/// the old set of snapshots or the new one, never a torn file by its name.
fn write_atomically(
    dir: &Path,
    taken_unix_ms: u64,
    bytes: &[u8],
) -> Result<PathBuf, SnapshotError> {
    let path = dir.join(format!("{PREFIX}{taken_unix_ms:020}{SUFFIX}"));
    let tmp = dir.join(format!(".{PREFIX}{taken_unix_ms:020}.tmp"));
    let io = |p: &Path| {
        let shown = p.display().to_string();
        move |error| SnapshotError::Io { path: shown, error }
    };
    let written = std::fs::File::create(&tmp).and_then(|mut file| {
        file.write_all(bytes)?;
        file.sync_all()
    });
    if let Err(source) = written {
        // A full disk or a failed sync leaves no half-written file behind.
        let _ = std::fs::remove_file(&tmp);
        return Err(io(&tmp)(source));
    }
    std::fs::rename(&tmp, &path).map_err(io(&path))?;
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io(dir))?;
    Ok(path)
}

/// Removes the snapshots older than the `keep` newest of `loadable` (the
/// ones this process wrote or loaded) and returns those still there: a
/// file newer than them (damaged, unreadable, or not this process's) is
/// left alone, so the last loadable snapshots are never pruned in its
/// favour. Failures are only logged: an old file left behind does no harm.
fn prune(dir: &Path, keep: usize, loadable: &[PathBuf]) -> Vec<PathBuf> {
    let Ok(files) = snapshot_files(dir) else {
        return loadable.to_vec();
    };
    let mut kept: Vec<PathBuf> = loadable
        .iter()
        .filter(|p| files.contains(p))
        .cloned()
        .collect();
    kept.sort();
    kept.dedup();
    let Some(oldest_kept) = kept.len().checked_sub(keep).map(|at| kept[at].clone()) else {
        return kept;
    };
    for old in files.iter().filter(|f| **f < oldest_kept) {
        if let Err(error) = std::fs::remove_file(old) {
            tracing::warn!(path = %old.display(), %error, "old snapshot not removed");
        }
    }
    kept.retain(|p| *p >= oldest_kept);
    kept
}

/// Reads a snapshot file as untrusted input: a regular file only (opened
/// without following a symlink and without blocking, so a FIFO or device
/// planted under a snapshot's name is refused at once), its header checked
/// against its size before the body is read.
fn read_state(path: &Path) -> Result<FleetState, Unloadable> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|error| match error.raw_os_error() {
            // O_NOFOLLOW on a symlink.
            Some(libc::ELOOP) => Unloadable::Damaged("a symlink, not a regular file".into()),
            _ => Unloadable::Unreadable(error),
        })?;
    let metadata = file.metadata().map_err(Unloadable::Unreadable)?;
    if !metadata.is_file() {
        return Err(Unloadable::Damaged("not a regular file".into()));
    }
    let damaged = |e: &dyn std::fmt::Display| Unloadable::Damaged(e.to_string());
    let mut header = [0u8; format::HEADER_BYTES];
    if metadata.len() < header.len() as u64 {
        return Err(damaged(&format::FormatError::Truncated {
            len: usize::try_from(metadata.len()).unwrap_or(usize::MAX),
        }));
    }
    file.read_exact(&mut header)
        .map_err(Unloadable::Unreadable)?;
    let header = format::Header::read(&header, metadata.len()).map_err(|e| damaged(&e))?;
    let payload_len = usize::try_from(header.payload_len())
        .map_err(|_| Unloadable::Damaged("payload larger than memory can address".into()))?;
    let mut payload = Vec::new();
    payload
        .try_reserve_exact(payload_len)
        .map_err(|e| Unloadable::Unreadable(std::io::Error::other(e)))?;
    file.take(header.payload_len())
        .read_to_end(&mut payload)
        .map_err(Unloadable::Unreadable)?;
    let state = header.decode(&payload).map_err(|e| damaged(&e))?;
    drop(payload);
    convert::state_from_pb(state).map_err(|e| damaged(&e))
}

/// Renames an unusable snapshot to `NAME.bad-UNIX_MS`, kept for a look.
fn set_aside(path: &Path) -> Result<PathBuf, SnapshotError> {
    let mut aside = path.as_os_str().to_owned();
    aside.push(format!(".bad-{}", unix_ms()));
    let aside = PathBuf::from(aside);
    std::fs::rename(path, &aside).map_err(|error| SnapshotError::Io {
        path: path.display().to_string(),
        error,
    })?;
    Ok(aside)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "kvroute-snapshot-unit-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
        dir
    }

    fn named(dir: &Path, ms: u64) -> PathBuf {
        dir.join(format!("{PREFIX}{ms:020}{SUFFIX}"))
    }

    fn damaged(result: Result<FleetState, Unloadable>) -> String {
        match result {
            Err(Unloadable::Damaged(why)) => why,
            other => panic!("expected damage, got {other:?}"),
        }
    }

    #[test]
    fn only_regular_files_are_read_and_never_past_a_bad_header() {
        let dir = scratch("read");
        // A FIFO with no writer: opening it must not block.
        let fifo = named(&dir, 1);
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        assert!(made.is_ok_and(|s| s.success()), "mkfifo");
        assert!(damaged(read_state(&fifo)).contains("not a regular file"));
        // A symlink to an endless device.
        let link = named(&dir, 2);
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap_or_else(|e| panic!("{e}"));
        assert!(damaged(read_state(&link)).contains("symlink"));
        // A 1 GiB sparse file whose header claims less than it holds: refused
        // from the header alone.
        let sparse = named(&dir, 3);
        let good = format::encode(&crate::pb::SnapshotState::default());
        let file = std::fs::File::create(&sparse).unwrap_or_else(|e| panic!("{e}"));
        std::io::Write::write_all(&mut &file, &good).unwrap_or_else(|e| panic!("{e}"));
        file.set_len(1 << 30).unwrap_or_else(|e| panic!("{e}"));
        assert!(damaged(read_state(&sparse)).contains("declares 0 payload bytes"));
        // Wrong magic on a huge file: the same.
        std::fs::write(&sparse, b"not a snapshot at all, no").unwrap_or_else(|e| panic!("{e}"));
        assert!(damaged(read_state(&sparse)).contains("shorter than"));
        // A file that cannot be opened is unreadable, not damaged.
        let missing = named(&dir, 4);
        assert!(matches!(
            read_state(&missing),
            Err(Unloadable::Unreadable(_))
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn pruning_keeps_the_newest_loadable_snapshots_whatever_is_newer() {
        let dir = scratch("prune");
        let touch = |ms| {
            let path = named(&dir, ms);
            std::fs::write(&path, b"x").unwrap_or_else(|e| panic!("{e}"));
            path
        };
        let (a, b, c) = (touch(1), touch(2), touch(3));
        // `c` is newest but not known to load (damaged, or unreadable):
        // the two loadable ones stay.
        let kept = prune(&dir, 2, &[a.clone(), b.clone()]);
        assert_eq!(kept, [a.clone(), b.clone()]);
        assert!(a.exists() && b.exists() && c.exists());
        // One loadable is not enough to prune anything for.
        let kept = prune(&dir, 2, std::slice::from_ref(&a));
        assert_eq!(kept, std::slice::from_ref(&a));
        // Two newer loadable ones: everything older goes, unknowns too.
        let d = touch(4);
        let e = touch(5);
        let kept = prune(&dir, 2, &[a.clone(), b.clone(), d.clone(), e.clone()]);
        assert_eq!(kept, [d.clone(), e.clone()]);
        assert!(!a.exists() && !b.exists() && !c.exists());
        assert!(d.exists() && e.exists());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
