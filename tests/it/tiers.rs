//! Cache tiers over real gRPC: workers declare tiers below the device,
//! publish events per tier, and routing prefers a prefix on the device over
//! one in host memory over none; explain, the index statistics and the
//! metrics show each tier. Then a hostile worker's tier events and
//! declarations: each refused or counted, none growing the index past what
//! was declared.

use crate::common;

use common::{TestServer, batch, registration, select_hashes, stored};
use kvroute::grpc::convert::tiered_event_to_pb;
use kvroute::pb;
use kvroute_core::index::{KvEvent, Tier, TieredEvent};
use kvroute_core::select::TierSavings;
use tonic::Code;

/// The prompt: three blocks by their local hashes.
const PROMPT: [u64; 3] = [101, 102, 103];

fn host_tier(capacity_blocks: u64) -> pb::CacheTierSpec {
    pb::CacheTierSpec {
        tier: pb::CacheTier::Host as i32,
        capacity_blocks,
        prefill_saving: None,
    }
}

fn with_host(worker_id: u64, capacity_blocks: u64) -> pb::RegisterWorkerRequest {
    pb::RegisterWorkerRequest {
        cache_tiers: vec![host_tier(capacity_blocks)],
        ..registration(worker_id, "m")
    }
}

fn in_tier(event_id: u64, tier: Tier, event: KvEvent) -> pb::KvEvent {
    tiered_event_to_pb(event_id, &TieredEvent::new(tier, event))
}

/// The prompt's blocks as worker `w` names them: engine hashes `w*10 + i`.
fn prompt_blocks(w: u64) -> Vec<(u64, u64)> {
    (0..3).map(|i| (w * 10 + i, PROMPT[i as usize])).collect()
}

async fn explain(server: &TestServer) -> pb::ExplainSelectionResponse {
    server
        .admin()
        .explain_selection(select_hashes("explain", "m", &PROMPT))
        .await
        .expect("explain")
        .into_inner()
}

fn candidate(reply: &pb::ExplainSelectionResponse, worker_id: u64) -> pb::CandidateExplanation {
    reply
        .candidates
        .iter()
        .find(|c| c.worker_id == worker_id)
        .cloned()
        .expect("candidate")
}

fn by_tier(device: u64, host: u64) -> Option<pb::BlocksByTier> {
    Some(pb::BlocksByTier {
        device,
        host,
        ..Default::default()
    })
}

#[tokio::test]
async fn device_beats_host_memory_beats_nothing() {
    let server = TestServer::start().await;
    for w in [1, 2, 3] {
        server.register(with_host(w, 100)).await;
    }
    // Worker 1 holds the prompt on the device.
    let reply = server
        .publish(batch(1, 0, vec![stored(0, None, &prompt_blocks(1))]))
        .await
        .unwrap();
    assert_eq!(reply.rejected, 0);
    // Worker 2 held it on the device, offloaded it to host memory by
    // engine hash alone (vLLM's placeholder events), then evicted it from
    // the device: the host copy stays.
    let hashes: Vec<u64> = prompt_blocks(2).iter().map(|b| b.0).collect();
    let events = vec![
        stored(0, None, &prompt_blocks(2)),
        in_tier(
            1,
            Tier::Host,
            KvEvent::StoredKnown {
                blocks: hashes.clone(),
            },
        ),
        in_tier(
            2,
            Tier::Device,
            KvEvent::Removed {
                blocks: hashes.clone(),
            },
        ),
    ];
    let reply = server.publish(batch(2, 0, events)).await.unwrap();
    assert_eq!((reply.rejected, reply.last_applied_event_id), (0, 2));

    let stats_now = server.index_stats().await;
    assert_eq!(stats_now.blocks_by_tier, by_tier(3, 3));
    assert_eq!(stats_now.blocks_unresolved, 0);

    let reply = explain(&server).await;
    let winner = reply.winner.unwrap();
    assert_eq!(winner.worker_id, 1, "the device wins");
    assert_eq!(winner.overlap_by_tier, by_tier(3, 0));
    let host = candidate(&reply, 2);
    assert_eq!(host.overlap_blocks, 3);
    assert_eq!(host.overlap_by_tier, by_tier(0, 3));
    assert!(
        (host.effective_overlap_blocks - 3.0 * TierSavings::DEFAULT.get(Tier::Host)).abs() < 1e-9,
        "{host:?}"
    );
    let none = candidate(&reply, 3);
    assert!(
        none.prefill_cost > host.prefill_cost
            && host.prefill_cost > candidate(&reply, 1).prefill_cost,
        "{reply:?}"
    );

    // Without the device holder, host memory beats nothing.
    server
        .workers()
        .deregister_worker(pb::DeregisterWorkerRequest { worker_id: 1 })
        .await
        .unwrap();
    let chosen = server
        .router()
        .select_worker(select_hashes("r1", "m", &PROMPT))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(chosen.worker_id, 2);
    assert_eq!(chosen.overlap_by_tier, by_tier(0, 3));
    let (_, metrics) = server.http_get("/metrics").await;
    assert!(
        metrics.contains("kvroute_routing_overlap_blocks_total{tier=\"host\"} 3"),
        "{metrics}"
    );
    // The index gauges follow at the fleet's next maintenance tick.
    let gauge = "kvroute_index_tier_blocks{tier=\"host\"} 3";
    let mut metrics = metrics;
    for _ in 0..50 {
        if metrics.contains(gauge) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        metrics = server.http_get("/metrics").await.1;
    }
    assert!(metrics.contains(gauge), "{metrics}");
}

#[tokio::test]
async fn hostile_tier_declarations_are_refused() {
    let server = TestServer::start().await;
    let register = |request: pb::RegisterWorkerRequest| {
        let mut workers = server.workers();
        async move { workers.register_worker(request).await.map(|_| ()) }
    };
    let tiers = |specs: Vec<pb::CacheTierSpec>| pb::RegisterWorkerRequest {
        cache_tiers: specs,
        ..registration(1, "m")
    };
    let device = pb::CacheTierSpec {
        tier: pb::CacheTier::Device as i32,
        ..host_tier(10)
    };
    let unknown = pb::CacheTierSpec {
        tier: 99,
        ..host_tier(10)
    };
    let bad_saving = pb::CacheTierSpec {
        prefill_saving: Some(f64::INFINITY),
        ..host_tier(10)
    };
    for (specs, code) in [
        (vec![device], Code::InvalidArgument),
        (vec![unknown], Code::InvalidArgument),
        (vec![bad_saving], Code::InvalidArgument),
        (vec![host_tier(1), host_tier(2)], Code::InvalidArgument),
        (vec![host_tier(1); 4], Code::InvalidArgument),
        (vec![host_tier(1 << 63)], Code::ResourceExhausted),
        (vec![host_tier(u64::MAX)], Code::ResourceExhausted),
    ] {
        let status = register(tiers(specs.clone())).await.unwrap_err();
        assert_eq!(status.code(), code, "{specs:?}: {status:?}");
    }
    let status = server
        .admin()
        .get_worker(pb::GetWorkerRequest { worker_id: 1 })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound, "nothing registered");
    // A zero capacity is a tier kept empty.
    register(tiers(vec![host_tier(0)])).await.unwrap();
}

#[tokio::test]
async fn hostile_tier_events_are_counted_and_bounded() {
    let server = TestServer::start().await;
    // Worker 1 declares no tier below the device; worker 2 a host tier of
    // two blocks.
    server.register(registration(1, "m")).await;
    server.register(with_host(2, 2)).await;

    // Events for an undeclared tier are rejected and say why.
    let reply = server
        .publish(batch(
            1,
            0,
            vec![in_tier(
                0,
                Tier::Host,
                KvEvent::Stored {
                    parent: None,
                    blocks: prompt_blocks(1),
                },
            )],
        ))
        .await
        .unwrap();
    assert_eq!(reply.rejected, 1);
    assert!(
        reply.first_rejection.contains("did not declare"),
        "{reply:?}"
    );

    // Unknown tier values and device copies are malformed batches.
    let mut unknown = in_tier(0, Tier::Host, KvEvent::Removed { blocks: vec![1] });
    if let Some(pb::kv_event::Kind::Removed(r)) = &mut unknown.kind {
        r.tier = 42;
    }
    let copy_to_device = pb::KvEvent {
        event_id: 0,
        kind: Some(pb::kv_event::Kind::Copied(pb::BlocksCopied {
            engine_hashes: vec![1],
            tier: pb::CacheTier::Device as i32,
        })),
    };
    for event in [unknown, copy_to_device] {
        let status = server.publish(batch(2, 0, vec![event])).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    }

    // Five host blocks into a tier of two: the oldest three go. Placeholders
    // for hashes no tier holds, and removals from a tier never stored to,
    // change nothing and are counted.
    let chain: Vec<(u64, u64)> = (0..5).map(|i| (200 + i, 900 + i)).collect();
    let events = vec![
        in_tier(
            0,
            Tier::Host,
            KvEvent::Stored {
                parent: None,
                blocks: chain.clone(),
            },
        ),
        in_tier(
            1,
            Tier::Host,
            KvEvent::StoredKnown {
                blocks: vec![777, 778],
            },
        ),
        in_tier(2, Tier::Device, KvEvent::Removed { blocks: vec![200] }),
    ];
    let reply = server.publish(batch(2, 0, events)).await.unwrap();
    assert_eq!((reply.rejected, reply.last_applied_event_id), (0, 2));
    let s = server.index_stats().await;
    assert_eq!(s.blocks_by_tier, by_tier(0, 2));
    assert_eq!(s.blocks_evicted, 3);
    assert_eq!(s.blocks_unresolved, 2);

    // Dropping the tier from the registration drops its blocks.
    server.register(registration(2, "m")).await;
    let s = server.index_stats().await;
    assert_eq!(s.blocks_by_tier, by_tier(0, 0));
}
