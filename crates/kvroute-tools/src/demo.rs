//! `kvroute demo`: kvroute against round robin on mock engines, over real
//! sockets, in a couple of minutes, with what the replay predicts beside.
//!
//! Why: a newcomer without GPUs should see what kvroute does for a fleet
//! before reading anything. The demo runs the committed conversation
//! sample twice, each time on fresh mock engines (`mock_engine`) with the
//! replay's engine model: once spread round robin by the load generator,
//! once with the load generator as kvroute's frontend (SelectWorker, the
//! engine it picks, the booking calls) and kvroute subscribed to the
//! engines' KV events. It prints the client's figures for both and the
//! replay simulator's for the same configuration.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use anyhow::Context;
use kvroute::{config::ServeConfig, pb};

use crate::{
    bench::LocalServer,
    loadgen::{self, LoadgenArgs},
    mock_engine::{self, MockEngineArgs},
    sim::{self, KvRouteKnobs, KvRoutePolicy, Report, SimConfig},
    trace::Trace,
};

/// The engines' KV block, in tokens (the replay's engine default).
const BLOCK_SIZE: usize = 64;
const MODEL: &str = "mock";

/// `kvroute demo` arguments.
#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// The trace (default: the committed conversation sample).
    #[arg(long, default_value = "tests/data/conversation_sample.jsonl")]
    pub trace: PathBuf,
    /// Mock engines.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=64))]
    pub workers: u64,
    /// Arrival times are the trace's divided by this.
    #[arg(long, default_value_t = 4.0, value_parser = kvroute::config::parse_non_negative_f64)]
    pub speedup: f64,
    /// Only the first N requests.
    #[arg(long)]
    pub limit: Option<usize>,
    /// The mock engines run this many times faster than the engine model,
    /// and the arrivals with them; the figures are given back in the
    /// model's time, comparable with the replay (CI's short run uses it).
    #[arg(long, default_value_t = 1.0, value_parser = kvroute::config::parse_non_negative_f64)]
    pub engine_speed: f64,
    /// Also draw the four rows as the replay's chart (`*.svg` or `*.png`;
    /// needs the tools' `plot` feature, on by default).
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

/// The demo's four reports: over sockets and predicted, each policy.
#[derive(Debug)]
pub struct Comparison {
    pub round_robin: Report,
    pub routed: Report,
    pub predicted_round_robin: Report,
    pub predicted: Report,
}

/// Runs both passes and prints the comparison.
pub async fn run(args: &DemoArgs) -> anyhow::Result<()> {
    if let Some(path) = &args.plot {
        anyhow::ensure!(
            cfg!(feature = "plot"),
            "--plot: these tools were built without the `plot` feature"
        );
        anyhow::ensure!(
            matches!(
                path.extension().and_then(|e| e.to_str()),
                Some("svg" | "png")
            ),
            "{}: name the chart *.svg or *.png",
            path.display()
        );
    }
    let Comparison {
        round_robin,
        routed,
        predicted_round_robin: predicted_rr,
        predicted,
    } = compare(args).await?;
    println!("over real sockets (the load generator's clock):");
    print!("{}", Report::table(&[round_robin.clone(), routed.clone()]));
    println!("\nthe replay simulator on the same configuration:");
    print!(
        "{}",
        Report::table(&[predicted_rr.clone(), predicted.clone()])
    );
    println!();
    let change = |a: f64, b: f64| 100.0 * (b - a) / a.max(f64::MIN_POSITIVE);
    for (what, rr, kv) in [
        (
            "kvroute against round robin, over sockets:",
            &round_robin,
            &routed,
        ),
        (
            "the replay predicted:                     ",
            &predicted_rr,
            &predicted,
        ),
    ] {
        println!(
            "{what} TTFT p50 {:.0} -> {:.0} ms ({:+.0} %), p99 {:.0} -> {:.0} ms ({:+.0} %), reuse {:.3} -> {:.3}",
            rr.ttft_ms.p50,
            kv.ttft_ms.p50,
            change(rr.ttft_ms.p50, kv.ttft_ms.p50),
            rr.ttft_ms.p99,
            kv.ttft_ms.p99,
            change(rr.ttft_ms.p99, kv.ttft_ms.p99),
            rr.reuse_ratio,
            kv.reuse_ratio,
        );
    }
    #[cfg(feature = "plot")]
    if let Some(path) = &args.plot {
        let named = |r: &Report, name: &str| Report {
            policy: name.to_owned(),
            ..r.clone()
        };
        let rows = [
            named(&round_robin, "rr sockets"),
            named(&predicted_rr, "rr replay"),
            named(&routed, "kvroute sockets"),
            named(&predicted, "kvroute replay"),
        ];
        sim::plot::write_chart(path, &rows).map_err(anyhow::Error::msg)?;
        eprintln!("chart written to {}", path.display());
    }
    Ok(())
}

/// Both passes over sockets, and the replay's prediction.
pub async fn compare(args: &DemoArgs) -> anyhow::Result<Comparison> {
    anyhow::ensure!(args.engine_speed > 0.0, "--engine-speed must be above 0");
    let mut trace = Trace::load(&args.trace).with_context(|| {
        format!(
            "the demo's trace {} (run it from the repository's root, or pass --trace)",
            args.trace.display()
        )
    })?;
    if let Some(limit) = args.limit {
        trace.records.truncate(limit);
    }
    let workers = args.workers as usize;
    eprintln!(
        "kvroute demo: {} requests of {} on {workers} mock engines, arrivals {}x faster",
        trace.records.len(),
        args.trace.display(),
        args.speedup
    );
    let mut load = LoadgenArgs {
        trace: args.trace.clone(),
        url: None,
        kvroute: None,
        engines: Vec::new(),
        speedup: args.speedup * args.engine_speed,
        limit: args.limit,
        model: MODEL.into(),
        timeout_secs: 600.0,
        max_in_flight: 4096,
        json: false,
        time_scale: args.engine_speed,
    };

    eprintln!("1/2: round robin over fresh mock engines");
    let engines = start_engines(workers, args.engine_speed).await?;
    load.engines = engines
        .iter()
        .map(|e| format!("http://{}", e.http))
        .collect();
    let round_robin = loadgen::measure(&load, &trace).await?;

    eprintln!("2/2: kvroute as the frontend's router, over fresh mock engines");
    let engines = start_engines(workers, args.engine_speed).await?;
    let server = LocalServer::start(ServeConfig::default()).await?;
    register(server.addr, &engines).await?;
    load.engines.clear();
    load.kvroute = Some(format!("http://{}", server.addr));
    let routed = loadgen::measure(&load, &trace).await?;
    server.stop().await;

    let config = SimConfig {
        workers,
        speedup: args.speedup,
        ..SimConfig::default()
    };
    let mut rr = sim::RoundRobin::default();
    let predicted_rr = sim::replay(&trace, &config, &mut rr);
    let mut policy = KvRoutePolicy::new(KvRouteKnobs::default())?;
    let predicted = sim::replay(&trace, &config, &mut policy);

    Ok(Comparison {
        round_robin,
        routed,
        predicted_round_robin: predicted_rr,
        predicted,
    })
}

/// A mock engine's addresses.
struct Started {
    http: SocketAddr,
    events: String,
    replay: String,
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

async fn start_engines(n: usize, speed: f64) -> anyhow::Result<Vec<Started>> {
    let mut engines = Vec::new();
    for _ in 0..n {
        let listener = mock_engine::listen("127.0.0.1:0".parse()?)?;
        let http = listener.local_addr()?;
        let events = format!("tcp://127.0.0.1:{}", free_port()?);
        let replay = format!("tcp://127.0.0.1:{}", free_port()?);
        let args = MockEngineArgs {
            addr: http,
            model: MODEL.into(),
            dp_size: 1,
            kv_events: Some(events.clone()),
            kv_replay: Some(replay.clone()),
            tokenizer: None,
            speed,
            num_blocks: sim::EngineConfig::default().num_blocks,
            block_size: BLOCK_SIZE,
            max_num_seqs: sim::EngineConfig::default().max_num_seqs,
            max_num_batched_tokens: sim::EngineConfig::default().max_num_batched_tokens,
            max_model_len: 1 << 20,
            max_body_bytes: 64 << 20,
            max_connections: 8192,
        };
        mock_engine::start(args, listener).await?;
        engines.push(Started {
            http,
            events,
            replay,
        });
    }
    Ok(engines)
}

/// Registers each engine with kvroute and waits for its subscriptions.
async fn register(kvroute: SocketAddr, engines: &[Started]) -> anyhow::Result<()> {
    let channel = tonic::transport::Channel::from_shared(format!("http://{kvroute}"))?
        .connect()
        .await?;
    let mut workers = pb::workers_client::WorkersClient::new(channel.clone());
    let mut admin = pb::admin_client::AdminClient::new(channel);
    let config = sim::EngineConfig::default();
    for (i, engine) in engines.iter().enumerate() {
        workers
            .register_worker(pb::RegisterWorkerRequest {
                worker_id: i as u64 + 1,
                model: MODEL.into(),
                endpoint: engine.http.to_string(),
                block_size: BLOCK_SIZE as u32,
                dp_size: 1,
                total_kv_blocks: config.num_blocks as u64,
                max_num_batched_tokens: config.max_num_batched_tokens as u64,
                lease_ttl_secs: 3600,
                events_endpoint: engine.events.clone(),
                events_dialect: "vllm".into(),
                replay_endpoint: engine.replay.clone(),
                ..Default::default()
            })
            .await?;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    for i in 0..engines.len() as u64 {
        loop {
            let info = admin
                .get_worker(pb::GetWorkerRequest { worker_id: i + 1 })
                .await?
                .into_inner();
            if info.subscription.contains(" connected,") {
                break;
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "kvroute did not subscribe to engine {}: {}",
                i + 1,
                info.subscription
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    Ok(())
}
