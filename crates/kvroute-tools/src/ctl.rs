//! `kvroute ctl`: the operator's client of a running kvroute's Admin service.
//!
//! Operators need to see what the router knows (workers, index statistics),
//! ask why a prompt would go where it goes, and cordon a worker, without
//! writing gRPC calls by hand. Output is an aligned table by default and JSON
//! with `--json` for scripts. Any failure (a gRPC status, no connection, bad
//! input) is one line on stderr and a non-zero exit, printed by `main`.

use std::{io::Write, path::PathBuf, time::Duration};

use clap::{Args, Subcommand, ValueEnum};
use serde_json::{Value, json};
use tonic::transport::Channel;

use kvroute::{
    grpc::rpc_metrics::code_name,
    pb::{self, admin_client::AdminClient},
    security::client::{Bearer, ClientCredentials},
};

/// The address `ctl` talks to unless told otherwise (the `serve` default).
pub const DEFAULT_ADDR: &str = "http://127.0.0.1:50051";

/// How long a call may take before `ctl` gives up.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Arguments of `kvroute ctl`.
#[derive(Debug, Args)]
pub struct CtlArgs {
    /// The kvroute gRPC address (`http://host:port`, or `host:port`).
    #[arg(long, global = true, default_value = DEFAULT_ADDR)]
    pub addr: String,
    /// Print JSON instead of a table.
    #[arg(long, global = true)]
    pub json: bool,
    #[command(flatten)]
    pub credentials: ClientCredentials,
    #[command(subcommand)]
    pub command: CtlCommand,
}

/// `kvroute ctl ...`
#[derive(Debug, Subcommand)]
pub enum CtlCommand {
    /// List registered workers.
    Workers {
        /// Only workers of this model.
        #[arg(long)]
        model: Option<String>,
    },
    /// Show one worker and each of its dp ranks.
    Worker {
        /// The worker id.
        id: u64,
    },
    /// Show KV index statistics.
    Stats {
        /// Only this model's index.
        #[arg(long)]
        model: Option<String>,
    },
    /// Score every candidate for a prompt, as SelectWorker would (changes nothing).
    Explain(ExplainArgs),
    /// Keep new requests away from a worker.
    Cordon {
        /// The worker id.
        id: u64,
    },
    /// Let a cordoned worker take requests again.
    Uncordon {
        /// The worker id.
        id: u64,
    },
    /// Write a snapshot of the router's state to its --state-dir now.
    Snapshot,
    /// Ask the gRPC health service (open to every caller); exits non-zero
    /// unless SERVING. The Kubernetes probe over TLS.
    Health {
        /// A service name (e.g. `kvroute.v1.Router`); empty: the server.
        #[arg(long, default_value = "")]
        service: String,
    },
}

/// Arguments of `kvroute ctl explain`.
#[derive(Debug, Args)]
#[command(group(
    clap::ArgGroup::new("prompt")
        .required(true)
        .args(["tokens", "tokens_file", "trace"])
))]
pub struct ExplainArgs {
    /// The model to route for.
    #[arg(long)]
    pub model: String,
    /// The prompt's token ids, whitespace-separated or a JSON array.
    #[arg(long)]
    pub tokens: Option<String>,
    /// A file holding the prompt's token ids (whitespace-separated or a JSON array).
    #[arg(long)]
    pub tokens_file: Option<PathBuf>,
    /// A Mooncake trace (JSONL); the prompt is request `--line` of it.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// The trace line (1-based).
    #[arg(long, default_value_t = 1, requires = "trace")]
    pub line: usize,
    /// The phase being routed.
    #[arg(long, value_enum, default_value_t = Phase::Aggregated)]
    pub phase: Phase,
    /// LoRA adapter name.
    #[arg(long)]
    pub lora: Option<String>,
    /// Cache namespace.
    #[arg(long)]
    pub namespace: Option<String>,
}

/// The phase of `--phase`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Phase {
    Aggregated,
    Prefill,
    Decode,
}

impl From<Phase> for pb::RequestPhase {
    fn from(phase: Phase) -> Self {
        match phase {
            Phase::Aggregated => pb::RequestPhase::Aggregated,
            Phase::Prefill => pb::RequestPhase::Prefill,
            Phase::Decode => pb::RequestPhase::Decode,
        }
    }
}

/// Why `ctl` failed; printed as one line.
#[derive(Debug, thiserror::Error)]
pub enum CtlError {
    /// The server answered with an error status.
    #[error("{}: {}", code_name(.0.code()), one_line(.0.message()))]
    Status(tonic::Status),
    /// `--addr` is not a usable URI.
    #[error("--addr {addr}: {message}")]
    BadAddr { addr: String, message: String },
    /// No connection could be made.
    #[error("UNAVAILABLE: cannot connect to {addr}: {message}")]
    Connect { addr: String, message: String },
    /// The prompt could not be read.
    #[error("{0}")]
    Prompt(String),
    /// Writing the output failed.
    #[error("writing stdout: {0}")]
    Write(#[from] std::io::Error),
    /// `--ca`, `--cert`, `--key` or `--token` cannot be used.
    #[error("credentials: {0}")]
    Credentials(String),
    /// `ctl health` got an answer other than SERVING.
    #[error("health: {0}")]
    NotServing(String),
    /// The async runtime did not start.
    #[error("cannot start the async runtime: {0}")]
    Runtime(std::io::Error),
}

impl From<tonic::Status> for CtlError {
    fn from(status: tonic::Status) -> Self {
        Self::Status(status)
    }
}

fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// An error and its sources, joined on one line.
fn chain(error: &dyn std::error::Error) -> String {
    let mut parts = vec![error.to_string()];
    let mut source = error.source();
    while let Some(next) = source {
        let text = next.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        source = next.source();
    }
    one_line(&parts.join(": "))
}

/// `host:port` becomes `http://host:port`; a URI with a scheme stays.
pub fn normalize_addr(addr: &str) -> String {
    if addr.contains("://") {
        addr.to_string()
    } else {
        format!("http://{addr}")
    }
}

/// Runs `kvroute ctl` on a runtime of its own, printing to stdout.
pub fn run(args: CtlArgs) -> Result<(), CtlError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(CtlError::Runtime)?;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    runtime.block_on(execute(args, &mut out))?;
    out.flush()?;
    Ok(())
}

/// Connects, makes the call and writes its output.
pub async fn execute(args: CtlArgs, out: &mut dyn Write) -> Result<(), CtlError> {
    // Read the prompt before connecting: a bad file is not a network problem.
    let explain = match &args.command {
        CtlCommand::Explain(explain) => Some(explain_request(explain)?),
        _ => None,
    };
    let channel = connect(&args.addr, &args.credentials).await?;
    let bearer = args.credentials.bearer().map_err(CtlError::Credentials)?;
    let command = match args.command {
        CtlCommand::Health { service } => {
            return health(channel, bearer, &service, args.json, out).await;
        }
        other => other,
    };
    let mut admin = AdminClient::with_interceptor(channel, bearer);
    let json = args.json;
    match (command, explain) {
        (CtlCommand::Workers { model }, _) => {
            let reply = admin
                .list_workers(pb::ListWorkersRequest { model })
                .await?
                .into_inner();
            if json {
                print_json(
                    out,
                    &json!({ "workers": reply.workers.iter().map(worker_json).collect::<Vec<_>>() }),
                )
            } else {
                write!(out, "{}", workers_table(&reply.workers))?;
                Ok(())
            }
        }
        (CtlCommand::Worker { id }, _) => {
            let info = admin
                .get_worker(pb::GetWorkerRequest { worker_id: id })
                .await?
                .into_inner();
            if json {
                print_json(out, &worker_json(&info))
            } else {
                write!(out, "{}", worker_detail(&info))?;
                Ok(())
            }
        }
        (CtlCommand::Stats { model }, _) => {
            let stats = admin
                .get_index_stats(pb::GetIndexStatsRequest { model })
                .await?
                .into_inner();
            if json {
                print_json(out, &stats_json(&stats))
            } else {
                write!(out, "{}", stats_text(&stats))?;
                Ok(())
            }
        }
        (CtlCommand::Explain(_), Some(request)) => {
            let reply = admin.explain_selection(request).await?.into_inner();
            if json {
                print_json(out, &explain_json(&reply))
            } else {
                write!(out, "{}", explain_text(&reply))?;
                Ok(())
            }
        }
        // Answered above, before the Admin client.
        (CtlCommand::Explain(_), None) | (CtlCommand::Health { .. }, _) => Ok(()),
        (CtlCommand::Cordon { id }, _) => {
            let info = admin
                .cordon_worker(pb::CordonWorkerRequest { worker_id: id })
                .await?
                .into_inner();
            cordon_output(out, json, &info)
        }
        (CtlCommand::Uncordon { id }, _) => {
            let info = admin
                .uncordon_worker(pb::UncordonWorkerRequest { worker_id: id })
                .await?
                .into_inner();
            cordon_output(out, json, &info)
        }
        (CtlCommand::Snapshot, _) => {
            let written = admin.snapshot(pb::SnapshotRequest {}).await?.into_inner();
            if json {
                print_json(
                    out,
                    &json!({
                        "path": written.path,
                        "bytes": written.bytes,
                        "entries": written.entries,
                        "workers": written.workers,
                        "capture_seconds": written.capture_seconds,
                        "write_seconds": written.write_seconds,
                    }),
                )
            } else {
                writeln!(
                    out,
                    "snapshot {}: {} entries of {} workers, {} (capture {:.3}s, write {:.3}s)",
                    written.path,
                    written.entries,
                    written.workers,
                    bytes_text(written.bytes),
                    written.capture_seconds,
                    written.write_seconds
                )?;
                Ok(())
            }
        }
    }
}

/// `kvroute ctl health`: SERVING is success, anything else an error.
async fn health(
    channel: Channel,
    bearer: Bearer,
    service: &str,
    json: bool,
    out: &mut dyn Write,
) -> Result<(), CtlError> {
    use tonic_health::pb::{
        HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
    };
    let reply = HealthClient::with_interceptor(channel, bearer)
        .check(HealthCheckRequest {
            service: service.to_owned(),
        })
        .await?
        .into_inner();
    let status = ServingStatus::try_from(reply.status).unwrap_or(ServingStatus::Unknown);
    if json {
        print_json(
            out,
            &json!({ "service": service, "status": status.as_str_name() }),
        )?;
    } else {
        writeln!(out, "{}", status.as_str_name())?;
    }
    if status == ServingStatus::Serving {
        Ok(())
    } else {
        Err(CtlError::NotServing(status.as_str_name().to_owned()))
    }
}

async fn connect(addr: &str, credentials: &ClientCredentials) -> Result<Channel, CtlError> {
    let uri = normalize_addr(addr);
    let endpoint = credentials
        .endpoint(&uri)
        .map_err(|message| CtlError::BadAddr {
            addr: addr.to_string(),
            message,
        })?
        .connect_timeout(CONNECT_TIMEOUT)
        .timeout(CALL_TIMEOUT);
    endpoint.connect().await.map_err(|e| CtlError::Connect {
        addr: uri,
        message: chain(&e),
    })
}

fn print_json(out: &mut dyn Write, value: &Value) -> Result<(), CtlError> {
    let text = serde_json::to_string_pretty(value)
        .map_err(|e| CtlError::Write(std::io::Error::other(e)))?;
    writeln!(out, "{text}")?;
    Ok(())
}

fn cordon_output(out: &mut dyn Write, json: bool, info: &pb::WorkerInfo) -> Result<(), CtlError> {
    if json {
        return print_json(out, &worker_json(info));
    }
    let state = if info.cordoned {
        "cordoned"
    } else {
        "uncordoned"
    };
    writeln!(out, "worker {} {state}", info.worker_id)?;
    write!(out, "{}", workers_table(std::slice::from_ref(info)))?;
    Ok(())
}

/// The ExplainSelection request for `ctl explain`'s prompt.
fn explain_request(args: &ExplainArgs) -> Result<pb::SelectWorkerRequest, CtlError> {
    let tokens = if let Some(text) = &args.tokens {
        parse_tokens(text, "--tokens")?
    } else if let Some(path) = &args.tokens_file {
        let text = std::fs::read_to_string(path)
            .map_err(|e| CtlError::Prompt(format!("reading {}: {e}", path.display())))?;
        parse_tokens(&text, &path.display().to_string())?
    } else if let Some(path) = &args.trace {
        crate::trace::read_line(path, args.line)
            .map_err(|e| CtlError::Prompt(chain(&e)))?
            .tokens()
    } else {
        return Err(CtlError::Prompt(
            "give the prompt with --tokens, --tokens-file or --trace".into(),
        ));
    };
    if tokens.is_empty() {
        return Err(CtlError::Prompt("the prompt has no tokens".into()));
    }
    Ok(pb::SelectWorkerRequest {
        request_id: "kvroute-ctl-explain".into(),
        model: args.model.clone(),
        prompt: Some(pb::Prompt {
            content: Some(pb::prompt::Content::TokenIds(pb::TokenIds { ids: tokens })),
        }),
        lora_name: args.lora.clone().unwrap_or_default(),
        cache_namespace: args.namespace.clone().unwrap_or_default(),
        phase: pb::RequestPhase::from(args.phase).into(),
        mode: pb::SelectionMode::QueryOnly.into(),
        ..Default::default()
    })
}

fn parse_tokens(text: &str, source: &str) -> Result<Vec<u32>, CtlError> {
    crate::hash_tool::parse_tokens(text).map_err(|e| CtlError::Prompt(format!("{source}: {e}")))
}

// ---- names -----------------------------------------------------------------

fn role_name(role: pb::WorkerRole) -> &'static str {
    match role {
        pb::WorkerRole::Aggregated => "aggregated",
        pb::WorkerRole::Prefill => "prefill",
        pb::WorkerRole::Decode => "decode",
    }
}

fn kv_events_name(mode: pb::KvEventsMode) -> &'static str {
    match mode {
        pb::KvEventsMode::Unspecified | pb::KvEventsMode::Exact => "exact",
        pb::KvEventsMode::Approximate => "approximate",
        pb::KvEventsMode::Auto => "auto",
    }
}

fn view_name(view: pb::CacheView) -> &'static str {
    match view {
        pb::CacheView::Unspecified => "-",
        pb::CacheView::Exact => "exact",
        pb::CacheView::Predicted => "predicted",
        pb::CacheView::Blended => "blended",
    }
}

fn reason_name(reason: pb::IneligibleReason) -> &'static str {
    match reason {
        pb::IneligibleReason::None => "-",
        pb::IneligibleReason::Cordoned => "cordoned",
        pb::IneligibleReason::NotAllowed => "not allowed",
        pb::IneligibleReason::Taint => "taint",
        pb::IneligibleReason::Excluded => "excluded",
        pb::IneligibleReason::Role => "role",
        pb::IneligibleReason::PinnedElsewhere => "pinned elsewhere",
    }
}

fn admission_name(admission: pb::AdmissionResult) -> &'static str {
    match admission {
        pb::AdmissionResult::Unspecified => "unspecified",
        pb::AdmissionResult::Admitted => "admitted",
        pb::AdmissionResult::AdmittedAfterQueue => "admitted after queue",
        pb::AdmissionResult::Untracked => "untracked",
    }
}

fn yes_no(flag: bool) -> &'static str {
    if flag { "yes" } else { "no" }
}

/// `0` for one rank, `0-3` for several.
fn rank_range(info: &pb::WorkerInfo) -> String {
    let last = info
        .dp_start_rank
        .saturating_add(info.dp_size.saturating_sub(1));
    if info.dp_size <= 1 {
        info.dp_start_rank.to_string()
    } else {
        format!("{}-{last}", info.dp_start_rank)
    }
}

/// Milliseconds as seconds with one decimal (`9.8s`).
fn lease_text(ms: u64) -> String {
    format!("{}.{}s", ms / 1000, (ms % 1000) / 100)
}

fn bytes_text(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

fn booked_of(info: &pb::WorkerInfo) -> pb::BookedLoad {
    info.ranks
        .iter()
        .filter_map(|r| r.booked_load)
        .fold(pb::BookedLoad::default(), |sum, b| pb::BookedLoad {
            prefill_tokens: sum.prefill_tokens + b.prefill_tokens,
            prefill_blocks: sum.prefill_blocks + b.prefill_blocks,
            decode_blocks: sum.decode_blocks + b.decode_blocks,
            active_requests: sum.active_requests + b.active_requests,
        })
}

// ---- tables ----------------------------------------------------------------

/// A text table: a header row and rows, columns padded to their widest cell;
/// numeric columns are right-aligned.
struct Table {
    headers: Vec<&'static str>,
    right: Vec<bool>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// Columns as (header, right-aligned).
    fn new(columns: &[(&'static str, bool)]) -> Self {
        Self {
            headers: columns.iter().map(|c| c.0).collect(),
            right: columns.iter().map(|c| c.1).collect(),
            rows: Vec::new(),
        }
    }

    fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    fn render(&self) -> String {
        let mut widths: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (width, cell) in widths.iter_mut().zip(row) {
                *width = (*width).max(cell.chars().count());
            }
        }
        let mut text = String::new();
        let header: Vec<String> = self.headers.iter().map(|h| h.to_string()).collect();
        for row in std::iter::once(&header).chain(&self.rows) {
            let mut line = String::new();
            for (i, cell) in row.iter().enumerate() {
                let width = widths.get(i).copied().unwrap_or(0);
                if i > 0 {
                    line.push_str("  ");
                }
                let pad = " ".repeat(width.saturating_sub(cell.chars().count()));
                if self.right.get(i).copied().unwrap_or(false) {
                    line.push_str(&pad);
                    line.push_str(cell);
                } else {
                    line.push_str(cell);
                    line.push_str(&pad);
                }
            }
            text.push_str(line.trim_end());
            text.push('\n');
        }
        text
    }
}

fn workers_table(workers: &[pb::WorkerInfo]) -> String {
    if workers.is_empty() {
        return "no workers registered\n".into();
    }
    let mut table = Table::new(&[
        ("ID", true),
        ("MODEL", false),
        ("ROLE", false),
        ("RANKS", false),
        ("VIEW", false),
        ("BLOCKS", true),
        ("BOOKED", true),
        ("LEASE LEFT", true),
        ("CORDONED", false),
    ]);
    for w in workers {
        // The blocks of the view it is scored on.
        let blocks: u64 = w
            .ranks
            .iter()
            .map(|r| match w.cache_view() {
                pb::CacheView::Predicted => r.predicted_blocks,
                _ => r.cached_blocks,
            })
            .sum();
        table.row(vec![
            w.worker_id.to_string(),
            w.model.clone(),
            role_name(w.role()).into(),
            rank_range(w),
            view_name(w.cache_view()).into(),
            blocks.to_string(),
            booked_of(w).active_requests.to_string(),
            lease_text(w.lease_remaining_ms),
            yes_no(w.cordoned).into(),
        ]);
    }
    table.render()
}

fn worker_detail(w: &pb::WorkerInfo) -> String {
    let mut fields = Table::new(&[("", false), ("", false)]);
    let mut field = |name: &'static str, value: String| fields.row(vec![name.into(), value]);
    field("worker", w.worker_id.to_string());
    field("model", w.model.clone());
    field("role", role_name(w.role()).into());
    field(
        "endpoint",
        if w.endpoint.is_empty() {
            "-".into()
        } else {
            w.endpoint.clone()
        },
    );
    field("block size", w.block_size.to_string());
    field("dp ranks", rank_range(w));
    field("kv blocks/rank", w.total_kv_blocks.to_string());
    field("batch tokens", w.max_num_batched_tokens.to_string());
    field(
        "taints",
        if w.taints.is_empty() {
            "-".into()
        } else {
            w.taints.join(",")
        },
    );
    field("lease left", lease_text(w.lease_remaining_ms));
    field("cordoned", yes_no(w.cordoned).into());
    field("kv events", kv_events_name(w.kv_events()).into());
    field("scored on", w.cache_view_reason.clone());
    field(
        "cached-token reports",
        match &w.cached_tokens_feedback {
            None => "-".into(),
            Some(f) => format!(
                "{}, mean error {:+.0} tokens, mean |error| {:.0}, index error {:.1} blocks{}",
                f.reports,
                f.mean_error_tokens,
                f.mean_abs_error_tokens,
                f.index_error_blocks,
                if f.contradicted { ", contradicted" } else { "" }
            ),
        },
    );
    field(
        "subscription",
        if w.subscription.is_empty() {
            "-".into()
        } else {
            w.subscription.clone()
        },
    );
    // The header row of a two-column key/value list is empty: drop it.
    let fields = fields.render();
    let fields = fields.split_once('\n').map_or("", |(_, rest)| rest);

    let mut ranks = Table::new(&[
        ("RANK", true),
        ("RUNNING", true),
        ("WAITING", true),
        ("KV USED", true),
        ("CACHED", true),
        ("PREDICTED", true),
        ("BOOKED REQS", true),
        ("PREFILL TOKENS", true),
        ("DECODE BLOCKS", true),
        ("LAST EVENT", true),
        ("SKIPPED", true),
        ("REJECTED", true),
    ]);
    for r in &w.ranks {
        let load = r.reported_load.unwrap_or_default();
        let booked = r.booked_load.unwrap_or_default();
        ranks.row(vec![
            r.dp_rank.to_string(),
            load.running_requests.to_string(),
            load.waiting_requests.to_string(),
            load.kv_blocks_used.to_string(),
            r.cached_blocks.to_string(),
            r.predicted_blocks.to_string(),
            booked.active_requests.to_string(),
            booked.prefill_tokens.to_string(),
            booked.decode_blocks.to_string(),
            r.last_event_id.to_string(),
            r.events_skipped.to_string(),
            r.events_rejected.to_string(),
        ]);
    }
    format!("{fields}\n{}", ranks.render())
}

fn stats_text(s: &pb::IndexStats) -> String {
    let mut table = Table::new(&[("", false), ("", true)]);
    for (name, value) in [
        ("blocks", s.blocks.to_string()),
        ("nodes", s.nodes.to_string()),
        ("workers", s.workers.to_string()),
        ("events applied", s.events_applied.to_string()),
        ("events skipped", s.events_skipped.to_string()),
        ("events rejected", s.events_rejected.to_string()),
        ("memory", bytes_text(s.memory_bytes)),
        ("entries", s.entries.to_string()),
        ("digest", format!("{:016x}", s.digest)),
    ] {
        table.row(vec![name.into(), value]);
    }
    let text = table.render();
    text.split_once('\n')
        .map_or(String::new(), |(_, rest)| rest.to_string())
}

fn explain_text(reply: &pb::ExplainSelectionResponse) -> String {
    // The TTFT policy shows its prediction in parts instead of the cost
    // policy's block costs and logit.
    let predicted = reply.candidates.iter().any(|c| c.ttft.is_some());
    let mut columns = vec![
        ("WORKER", true),
        ("RANK", true),
        ("ELIGIBLE", false),
        ("REASON", false),
        ("OVERLAP", true),
        ("VIEW", false),
    ];
    if predicted {
        columns.extend([
            ("TTFT MS", true),
            ("QUEUED MS", true),
            ("OWN MS", true),
            ("DECODE MS", true),
            ("SCALE", true),
        ]);
    } else {
        columns.extend([
            ("PREFILL COST", true),
            ("DECODE COST", true),
            ("LOGIT", true),
        ]);
    }
    columns.extend([("PROBABILITY", true), ("BUSY", false)]);
    let mut table = Table::new(&columns);
    for c in &reply.candidates {
        let mut row = vec![
            c.worker_id.to_string(),
            c.dp_rank.to_string(),
            yes_no(c.eligible).into(),
            reason_name(c.reason()).into(),
            c.overlap_blocks.to_string(),
            view_name(c.cache_view()).into(),
        ];
        match (&c.ttft, predicted) {
            (Some(t), _) => row.extend([
                format!("{:.1}", t.total_ms),
                format!("{:.1}", t.queued_prefill_ms),
                format!("{:.1}", t.own_prefill_ms),
                format!("{:.1}", t.decode_ms),
                format!("{:.2}", t.scale),
            ]),
            (None, true) => row.extend([
                "-".to_string(),
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
            ]),
            (None, false) => row.extend([
                format!("{:.2}", c.prefill_cost),
                format!("{:.2}", c.decode_cost),
                format!("{:.3}", c.logit),
            ]),
        }
        row.extend([format!("{:.3}", c.probability), yes_no(c.busy).into()]);
        table.row(row);
    }

    let mut text = if reply.candidates.is_empty() {
        "no candidates\n".to_string()
    } else {
        table.render()
    };
    match &reply.winner {
        Some(w) => text.push_str(&format!(
            "winner: worker {} rank {} (overlap {} of {} blocks, {} cached tokens, {} to prefill)\n",
            w.worker_id,
            w.dp_rank,
            w.overlap_blocks,
            w.total_blocks,
            w.cached_tokens,
            w.potential_prefill_tokens
        )),
        None => text.push_str("winner: none\n"),
    }
    if !reply.policy.is_empty() {
        text.push_str(&format!("policy: {}\n", reply.policy));
    }
    text
}

// ---- JSON ------------------------------------------------------------------

fn booked_json(b: &pb::BookedLoad) -> Value {
    json!({
        "prefill_tokens": b.prefill_tokens,
        "prefill_blocks": b.prefill_blocks,
        "decode_blocks": b.decode_blocks,
        "active_requests": b.active_requests,
    })
}

fn worker_json(w: &pb::WorkerInfo) -> Value {
    let ranks: Vec<Value> = w
        .ranks
        .iter()
        .map(|r| {
            let load = r.reported_load.unwrap_or_default();
            json!({
                "dp_rank": r.dp_rank,
                "reported_load": {
                    "running_requests": load.running_requests,
                    "waiting_requests": load.waiting_requests,
                    "kv_blocks_used": load.kv_blocks_used,
                },
                "booked_load": booked_json(&r.booked_load.unwrap_or_default()),
                "cached_blocks": r.cached_blocks,
                "predicted_blocks": r.predicted_blocks,
                "last_event_id": r.last_event_id,
                "events_skipped": r.events_skipped,
                "events_rejected": r.events_rejected,
            })
        })
        .collect();
    json!({
        "worker_id": w.worker_id,
        "model": w.model,
        "role": role_name(w.role()),
        "endpoint": w.endpoint,
        "block_size": w.block_size,
        "dp_start_rank": w.dp_start_rank,
        "dp_size": w.dp_size,
        "total_kv_blocks": w.total_kv_blocks,
        "max_num_batched_tokens": w.max_num_batched_tokens,
        "taints": w.taints,
        "lease_remaining_ms": w.lease_remaining_ms,
        "cordoned": w.cordoned,
        "subscription": w.subscription,
        "kv_events": kv_events_name(w.kv_events()),
        "cache_view": view_name(w.cache_view()),
        "cache_view_reason": w.cache_view_reason,
        "cached_tokens_feedback": w.cached_tokens_feedback.as_ref().map_or(Value::Null, |f| json!({
            "reports": f.reports,
            "mean_error_tokens": f.mean_error_tokens,
            "mean_abs_error_tokens": f.mean_abs_error_tokens,
            "index_error_blocks": f.index_error_blocks,
            "contradicted": f.contradicted,
        })),
        "cached_blocks": w.ranks.iter().map(|r| r.cached_blocks).sum::<u64>(),
        "booked_load": booked_json(&booked_of(w)),
        "ranks": ranks,
    })
}

fn stats_json(s: &pb::IndexStats) -> Value {
    json!({
        "blocks": s.blocks,
        "nodes": s.nodes,
        "workers": s.workers,
        "events_applied": s.events_applied,
        "events_skipped": s.events_skipped,
        "events_rejected": s.events_rejected,
        "memory_bytes": s.memory_bytes,
        "entries": s.entries,
        "digest": format!("{:016x}", s.digest),
    })
}

fn explain_json(reply: &pb::ExplainSelectionResponse) -> Value {
    let candidates: Vec<Value> = reply
        .candidates
        .iter()
        .map(|c| {
            json!({
                "worker_id": c.worker_id,
                "dp_rank": c.dp_rank,
                "eligible": c.eligible,
                "reason": if c.eligible { Value::Null } else { json!(reason_name(c.reason())) },
                "overlap_blocks": c.overlap_blocks,
                "cache_view": view_name(c.cache_view()),
                "cache_view_reason": c.cache_view_reason,
                "prefill_cost": c.prefill_cost,
                "decode_cost": c.decode_cost,
                "logit": c.logit,
                "probability": c.probability,
                "busy": c.busy,
                "cost": c.cost,
                "ttft": c.ttft.as_ref().map_or(Value::Null, |t| json!({
                    "total_ms": t.total_ms,
                    "queued_prefill_ms": t.queued_prefill_ms,
                    "own_prefill_ms": t.own_prefill_ms,
                    "decode_ms": t.decode_ms,
                    "scale": t.scale,
                    "own_prefill_tokens": t.own_prefill_tokens,
                    "queue_tracked": t.queue_tracked,
                })),
            })
        })
        .collect();
    let winner = reply.winner.as_ref().map_or(Value::Null, |w| {
        json!({
            "worker_id": w.worker_id,
            "dp_rank": w.dp_rank,
            "overlap_blocks": w.overlap_blocks,
            "effective_overlap_blocks": w.effective_overlap_blocks,
            "cached_tokens": w.cached_tokens,
            "total_blocks": w.total_blocks,
            "potential_prefill_tokens": w.potential_prefill_tokens,
            "potential_decode_blocks": w.potential_decode_blocks,
            "admission": admission_name(w.admission()),
        })
    });
    json!({ "policy": reply.policy, "candidates": candidates, "winner": winner })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_without_a_scheme_get_http() {
        assert_eq!(normalize_addr("127.0.0.1:5"), "http://127.0.0.1:5");
        assert_eq!(normalize_addr("https://h:1"), "https://h:1");
    }

    #[test]
    fn tables_align_columns() {
        let mut table = Table::new(&[("ID", true), ("NAME", false)]);
        table.row(vec!["7".into(), "a".into()]);
        table.row(vec!["123".into(), "long name".into()]);
        assert_eq!(table.render(), " ID  NAME\n  7  a\n123  long name\n");
    }

    #[test]
    fn small_formats() {
        assert_eq!(lease_text(9_876), "9.8s");
        assert_eq!(lease_text(0), "0.0s");
        assert_eq!(bytes_text(10), "10 B");
        assert_eq!(bytes_text(3 * 1024 * 1024), "3.0 MiB");
        let info = pb::WorkerInfo {
            dp_start_rank: 2,
            dp_size: 4,
            ..Default::default()
        };
        assert_eq!(rank_range(&info), "2-5");
    }

    #[test]
    fn status_errors_are_one_line_with_the_code_name() {
        let error = CtlError::from(tonic::Status::not_found("worker 9\nis not registered"));
        assert_eq!(error.to_string(), "NOT_FOUND: worker 9 is not registered");
    }
}
