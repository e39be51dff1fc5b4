//! `kvroute bench cluster`: three replicas in this process on one NATS
//! JetStream (started here unless `--nats-url`), an op log's events sent
//! through `PublishEvents` at the first replica.
//!
//! Two measurements, one JSON line each:
//! * `cluster_ingest`: every event as fast as the streams take them; the
//!   time runs from the first batch until every replica has applied the
//!   last log record (blocks/s applied on all), and every replica must
//!   hold what an in-process replay holds (equal digests, equal per-rank
//!   block counts).
//! * `cluster_lag`: the log's events paced at a multiple of the trace's own
//!   event rate; the lag from a record's append to its apply at the other
//!   replicas, from their `kvroute_cluster_log_lag_seconds` histograms
//!   (quantiles interpolated within buckets, as Prometheus does), and the
//!   acknowledgement latency the worker sees.

use std::{
    collections::BTreeMap,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use clap::Args;

use super::{
    BenchError, LocalServer, connect,
    histogram::Histogram,
    ingest::{Round, Workload, mismatches},
};
use kvroute::{
    config::{ClusterOptions, ServeConfig},
    pb::{self, admin_client::AdminClient, workers_client::WorkersClient},
};

/// Arguments of `kvroute bench cluster`.
#[derive(Debug, Args)]
pub struct ClusterBenchArgs {
    /// The op log (OPLOG v1; docs/BENCHMARKS.md).
    #[arg(long)]
    pub oplog: PathBuf,
    /// A NATS server with JetStream; unset: `nats-server -js` is started
    /// here on a free port with a temporary store.
    #[arg(long)]
    pub nats_url: Option<String>,
    /// Replicas.
    #[arg(long, default_value_t = 3)]
    pub replicas: usize,
    /// Events per KvEventBatch.
    #[arg(long, default_value_t = 1024)]
    pub batch: usize,
    /// The lag run's rate, as a multiple of the trace's event rate.
    #[arg(long, default_value_t = 10.0)]
    pub rate_multiplier: f64,
    /// The span of the trace the op log was made from, seconds (the
    /// conversation trace's, from `manifest.json`).
    #[arg(long, default_value_t = 3537.0)]
    pub trace_span_secs: f64,
    /// How long the lag run sends.
    #[arg(long, default_value_t = 30.0)]
    pub lag_secs: f64,
    /// The replicas' `--snapshot-interval`. The replica that writes the
    /// snapshot applies no log record while it captures (0.2-0.4 s per
    /// million cached blocks), so a snapshot during the lag run shows as
    /// its worst lag; the default keeps it out, `30s` puts it in.
    #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
    pub snapshot_interval: Duration,
}

/// `nats-server -js` started for the benchmark.
pub(crate) struct NatsProcess {
    child: Child,
    url: String,
    store: PathBuf,
}

impl NatsProcess {
    /// The NATS at `url`, or one started here when none is given (kept
    /// running while the process handle lives).
    pub(crate) fn unless_given(url: Option<&str>) -> Result<(Option<Self>, String), BenchError> {
        match url {
            Some(url) => Ok((None, url.to_owned())),
            None => {
                let nats = Self::start()?;
                let url = nats.url.clone();
                Ok((Some(nats), url))
            }
        }
    }

    fn start() -> Result<Self, BenchError> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| BenchError::Setup(e.to_string()))?
            .port();
        let store = std::env::temp_dir().join(format!("kvroute-bench-nats-{}", std::process::id()));
        let child = Command::new("nats-server")
            .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js"])
            .args(["-sd", &store.display().to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| {
                BenchError::Setup(format!("nats-server: {e} (install it, or pass --nats-url)"))
            })?;
        let url = format!("nats://127.0.0.1:{port}");
        for _ in 0..500 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Ok(Self { child, url, store });
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Err(BenchError::Setup("nats-server did not listen".into()))
    }
}

impl Drop for NatsProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.store);
    }
}

/// The figures of the throughput run.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ClusterIngestReport {
    pub bench: &'static str,
    pub replicas: usize,
    pub workers: usize,
    pub events: u64,
    pub blocks: u64,
    /// From the first batch to the last reply at the first replica.
    pub acked_secs: f64,
    /// From the first batch until every replica applied the last record.
    pub applied_all_secs: f64,
    pub blocks_per_s_applied_all: f64,
    pub in_process_blocks_per_s: f64,
    pub exact: bool,
    pub digests_equal: bool,
}

/// The figures of the paced run.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ClusterLagReport {
    pub bench: &'static str,
    pub replicas: usize,
    pub blocks_per_s_target: f64,
    pub blocks_per_s_sent: f64,
    pub records: u64,
    pub lag_p50_ms: f64,
    pub lag_p99_ms: f64,
    pub ack_p50_ms: f64,
    pub ack_p99_ms: f64,
}

/// Runs both measurements.
pub async fn run(
    args: &ClusterBenchArgs,
) -> Result<(ClusterIngestReport, ClusterLagReport), BenchError> {
    let (nats, url) = NatsProcess::unless_given(args.nats_url.as_deref())?;
    let workload = Workload::load(&args.oplog, args.batch, 0)?;
    let cluster_name = format!("bench{}", std::process::id());
    let mut replicas = Vec::new();
    for i in 0..args.replicas.max(1) {
        let config = ServeConfig {
            block_size: workload.block_size,
            max_events_per_batch: args.batch.max(1) as u32,
            snapshot_interval: args.snapshot_interval,
            cluster: ClusterOptions {
                nats_url: Some(url.clone()),
                cluster_name: cluster_name.clone(),
                replica_id: Some(format!("{cluster_name}-r{i}")),
                ..ClusterOptions::default()
            },
            ..ServeConfig::for_tests()
        };
        replicas.push(LocalServer::start(config).await?);
    }
    let ingest = throughput(&replicas, &workload).await;
    let lag = match &ingest {
        Ok(_) => lag(&replicas, &workload, args).await,
        Err(_) => Err(BenchError::Setup("skipped".into())),
    };
    for r in replicas {
        r.stop().await;
    }
    drop(nats);
    Ok((ingest?, lag?))
}

async fn throughput(
    replicas: &[LocalServer],
    w: &Workload,
) -> Result<ClusterIngestReport, BenchError> {
    let addr = replicas[0].addr.to_string();
    let channel = connect(&addr).await?;
    let round = Round {
        addr: &addr,
        channel: &channel,
        block_size: w.block_size,
        ranks: &w.ranks,
        per_worker: w.per_worker.clone(),
        expected: &w.expected,
    };
    round.register().await?;
    let started = Instant::now();
    let (acked_secs, _, _, _) = round.stream().await?;
    let target = position(&replicas[0]).await;
    for r in replicas {
        while position(r).await < target {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    let applied_all_secs = started.elapsed().as_secs_f64();
    let mut exact = true;
    let mut digests = Vec::new();
    for r in replicas {
        let channel = connect(&r.addr.to_string()).await?;
        exact &= mismatches(&channel, &w.ranks, &w.expected)
            .await?
            .is_empty();
        let stats = AdminClient::new(channel)
            .get_index_stats(pb::GetIndexStatsRequest::default())
            .await?
            .into_inner();
        digests.push((stats.entries, stats.digest));
    }
    let report = ClusterIngestReport {
        bench: "cluster_ingest",
        replicas: replicas.len(),
        workers: w.ranks.len(),
        events: w.events.len() as u64,
        blocks: w.blocks,
        acked_secs,
        applied_all_secs,
        blocks_per_s_applied_all: w.blocks as f64 / applied_all_secs.max(1e-9),
        in_process_blocks_per_s: w.blocks as f64 / w.in_process_secs.max(1e-9),
        exact,
        digests_equal: digests.windows(2).all(|p| p[0] == p[1]),
    };
    println!("{}", serde_json::to_string(&report).unwrap_or_default());
    if !report.exact || !report.digests_equal {
        return Err(BenchError::Mismatch(format!(
            "replicas differ: {digests:?}"
        )));
    }
    Ok(report)
}

/// The last log position a replica applied.
async fn position(replica: &LocalServer) -> u64 {
    let text = replica.scrape().await.unwrap_or_default();
    super::series_value(&text, "kvroute_cluster_log_position").unwrap_or(0)
}

async fn lag(
    replicas: &[LocalServer],
    w: &Workload,
    args: &ClusterBenchArgs,
) -> Result<ClusterLagReport, BenchError> {
    let rate = w.blocks as f64 / args.trace_span_secs * args.rate_multiplier;
    let addr = replicas[0].addr.to_string();
    let channel = connect(&addr).await?;
    // Fresh registrations, then small batches in log order, each sent at
    // its time on one stream.
    let round = Round {
        addr: &addr,
        channel: &channel,
        block_size: w.block_size,
        ranks: &w.ranks,
        per_worker: BTreeMap::new(),
        expected: &w.expected,
    };
    round.register().await?;
    let before: Vec<String> = futures::future::join_all(replicas.iter().map(|r| r.scrape()))
        .await
        .into_iter()
        .map(Option::unwrap_or_default)
        .collect();
    let mut next_id: BTreeMap<(u64, u32), u64> = BTreeMap::new();
    let mut client = WorkersClient::new(channel.clone());
    let (tx, rx) = tokio::sync::mpsc::channel::<pb::KvEventBatch>(1);
    let mut replies = client
        .publish_events(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await?
        .into_inner();
    let started = Instant::now();
    let (mut sent_blocks, mut records) = (0u64, 0u64);
    let mut acks = Vec::new();
    for (target, event) in &w.events {
        let elapsed = started.elapsed().as_secs_f64();
        if elapsed > args.lag_secs {
            break;
        }
        let due = sent_blocks as f64 / rate;
        if due > elapsed {
            tokio::time::sleep(Duration::from_secs_f64(due - elapsed)).await;
        }
        let id = next_id
            .entry((target.worker_id, target.dp_rank))
            .or_default();
        let batch = pb::KvEventBatch {
            worker_id: target.worker_id,
            dp_rank: target.dp_rank,
            events: vec![kvroute::grpc::convert::kv_event_to_pb(*id, event)],
        };
        *id += 1;
        sent_blocks += event.block_count() as u64;
        let sent_at = Instant::now();
        tx.send(batch)
            .await
            .map_err(|_| BenchError::Setup("stream closed".into()))?;
        replies.message().await?;
        acks.push(sent_at.elapsed());
        records += 1;
    }
    let secs = started.elapsed().as_secs_f64();
    drop(tx);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let name = "kvroute_cluster_log_lag_seconds";
    let (mut b, mut a) = (Histogram::default(), Histogram::default());
    for (i, r) in replicas.iter().enumerate().skip(1) {
        let after = r.scrape().await.unwrap_or_default();
        b.add(&Histogram::parse(&before[i], name, None));
        a.add(&Histogram::parse(&after, name, None));
    }
    let lag = a.since(&b);
    let ack = super::Latency::of(&mut acks);
    let report = ClusterLagReport {
        bench: "cluster_lag",
        replicas: replicas.len(),
        blocks_per_s_target: rate,
        blocks_per_s_sent: sent_blocks as f64 / secs.max(1e-9),
        records,
        lag_p50_ms: lag.quantile_s(0.5) * 1e3,
        lag_p99_ms: lag.quantile_s(0.99) * 1e3,
        ack_p50_ms: ack.p50_us / 1e3,
        ack_p99_ms: ack.p99_us / 1e3,
    };
    println!("{}", serde_json::to_string(&report).unwrap_or_default());
    Ok(report)
}
