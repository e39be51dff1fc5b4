//! Durable state: snapshots of the fleet written to `--state-dir`, and the
//! newest one loaded at start, so a restarted kvroute comes back with its
//! workers, cordons, leases, sessions, bookings, cursors and the exact
//! index, then catches up from the sources (workers resend what came after
//! each saved cursor).
//!
//! A snapshot is taken by the fleet without stopping routing or ingestion
//! (`fleet::state`), encoded and written off the async threads, and
//! written atomically: a temporary file, fsync, rename, fsync of the
//! directory. The two newest snapshots are kept. A file that fails to
//! load (truncated, corrupted, another format version, an impossible
//! state) is renamed aside, logged in one line and counted, and kvroute
//! starts cold, unless `--require-snapshot` makes that a start-up failure.

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
    fleet::{Fleet, state::RestoreReport},
    metrics::Metrics,
};

/// Snapshots kept in the state directory.
pub const KEEP: usize = 2;
const PREFIX: &str = "snapshot-";
const SUFFIX: &str = ".kvs";

/// Why a snapshot could not be written or loaded.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("state directory {dir}: {source}")]
    Dir { dir: String, source: std::io::Error },
    #[error("snapshot {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("snapshot {path} is unusable ({why}); moved aside to {aside}")]
    SetAside {
        path: String,
        why: String,
        aside: String,
    },
    #[error("snapshot {path} is unusable ({why}); --require-snapshot: not starting")]
    Unusable { path: String, why: String },
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

/// The snapshots of one fleet in one directory.
pub struct Snapshots {
    dir: PathBuf,
    fleet: Arc<Fleet>,
    metrics: Arc<Metrics>,
    /// One snapshot at a time; also when the last one was written or loaded.
    last: Mutex<Option<Instant>>,
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
        std::fs::create_dir_all(dir).map_err(|source| SnapshotError::Dir {
            dir: dir.display().to_string(),
            source,
        })?;
        Ok(Self {
            dir: dir.to_path_buf(),
            fleet,
            metrics,
            last: Mutex::new(None),
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
        let written = tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            let taken = unix_ms();
            let bytes = format::encode(&convert::state_to_pb(&state, taken));
            drop(state);
            let path = write_atomically(&dir, taken, &bytes)?;
            prune(&dir, KEEP);
            Ok::<_, SnapshotError>((path, bytes.len() as u64, started.elapsed().as_secs_f64()))
        })
        .await
        .map_err(|e| SnapshotError::Task(e.to_string()))?;
        let s = &self.metrics.snapshot;
        let (path, bytes, write_seconds) = match written {
            Ok(w) => w,
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

    /// Loads the newest snapshot into the fleet (which has no worker yet).
    /// `Ok(None)`: there is none. A file that cannot be loaded is reported
    /// and nothing of it is restored: moved aside ([`SnapshotError::SetAside`])
    /// or, when `required`, left in place ([`SnapshotError::Unusable`]) so
    /// that every start refuses until an operator looks.
    pub(crate) async fn load(&self, required: bool) -> Result<Option<Loaded>, SnapshotError> {
        let mut last = self.last.lock().await;
        let Some(path) = newest(&self.dir)? else {
            return Ok(None);
        };
        let started = Instant::now();
        let read = path.clone();
        let decoded = tokio::task::spawn_blocking(move || {
            let bytes = std::fs::read(&read).map_err(|e| e.to_string())?;
            let state = format::decode(&bytes).map_err(|e| e.to_string())?;
            convert::state_from_pb(state).map_err(|e| e.to_string())
        })
        .await
        .map_err(|e| SnapshotError::Task(e.to_string()))?;
        let state = match decoded {
            Ok(state) => state,
            Err(why) if required => {
                return Err(SnapshotError::Unusable {
                    path: path.display().to_string(),
                    why,
                });
            }
            Err(why) => {
                let aside = set_aside(&path)?;
                self.metrics
                    .snapshot
                    .outcomes
                    .with_label_values(&["set_aside"])
                    .inc();
                return Err(SnapshotError::SetAside {
                    path: path.display().to_string(),
                    why,
                    aside: aside.display().to_string(),
                });
            }
        };
        let report = self.fleet.restore(state).await;
        let seconds = started.elapsed().as_secs_f64();
        *last = Some(Instant::now());
        let s = &self.metrics.snapshot;
        s.outcomes.with_label_values(&["loaded"]).inc();
        s.load_seconds.set(seconds);
        s.entries_restored
            .set(i64::try_from(report.entries).unwrap_or(i64::MAX));
        s.age.set(0.0);
        Ok(Some(Loaded {
            path,
            report,
            seconds,
        }))
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
    let entries = std::fs::read_dir(dir).map_err(|source| SnapshotError::Dir {
        dir: dir.display().to_string(),
        source,
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

/// The newest snapshot in `dir`, if any.
pub(crate) fn newest(dir: &Path) -> Result<Option<PathBuf>, SnapshotError> {
    Ok(snapshot_files(dir)?.pop())
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
        move |source| SnapshotError::Io {
            path: shown,
            source,
        }
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

/// Removes all but the `keep` newest snapshots (failures are only logged:
/// an old file left behind does no harm).
fn prune(dir: &Path, keep: usize) {
    let Ok(files) = snapshot_files(dir) else {
        return;
    };
    for old in files.iter().rev().skip(keep) {
        if let Err(error) = std::fs::remove_file(old) {
            tracing::warn!(path = %old.display(), %error, "old snapshot not removed");
        }
    }
}

/// Renames an unusable snapshot to `NAME.bad-UNIX_MS`, kept for a look.
fn set_aside(path: &Path) -> Result<PathBuf, SnapshotError> {
    let mut aside = path.as_os_str().to_owned();
    aside.push(format!(".bad-{}", unix_ms()));
    let aside = PathBuf::from(aside);
    std::fs::rename(path, &aside).map_err(|source| SnapshotError::Io {
        path: path.display().to_string(),
        source,
    })?;
    Ok(aside)
}
