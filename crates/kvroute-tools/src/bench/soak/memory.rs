//! The server's memory as the soak reads it: this process's, or scraped
//! from a server apart, sampled each second.

use super::*;

/// Where the server's memory figures come from.
#[derive(Clone)]
pub(super) enum Memory {
    /// The server runs in this process: /proc/self/status.
    OwnProcess,
    /// An external server's /metrics.
    Scrape(String),
    Unknown,
}

/// One reading of the server's memory.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(super) struct MemoryReading {
    pub(super) rss: Option<u64>,
    pub(super) heap: Option<u64>,
}

impl Memory {
    pub(super) async fn read(&self) -> MemoryReading {
        match self {
            Memory::OwnProcess => MemoryReading {
                rss: kvroute::metrics::resident_memory_bytes(),
                heap: kvroute::metrics::heap_allocated_bytes(),
            },
            Memory::Scrape(addr) => match scrape_metrics(addr).await {
                Some(text) => MemoryReading {
                    rss: crate::bench::series_value(&text, "process_resident_memory_bytes"),
                    heap: crate::bench::series_value(&text, "kvroute_heap_allocated_bytes"),
                },
                None => MemoryReading::default(),
            },
            Memory::Unknown => MemoryReading::default(),
        }
    }
}

/// Memory samples of the current interval.
#[derive(Debug, Default)]
pub(super) struct Samples {
    pub(super) rss: Vec<u64>,
    pub(super) heap: Vec<u64>,
}

/// The server's SelectWorker histogram, if its metrics can be read.
pub(super) async fn select_histogram(metrics_addr: Option<&str>) -> Option<Histogram> {
    let text = scrape_metrics(metrics_addr?).await?;
    Some(Histogram::rpc(&text, SELECT_WORKER))
}

/// Reads the server's memory every [`MEMORY_SAMPLE_PERIOD`] into `samples`
/// (the interval loop takes them) until `stop`.
pub(super) async fn sample_memory(
    memory: Memory,
    samples: Arc<Mutex<Samples>>,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(MEMORY_SAMPLE_PERIOD);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let reading = memory.read().await;
        let mut samples = samples.lock();
        samples.rss.extend(reading.rss);
        samples.heap.extend(reading.heap);
    }
}
