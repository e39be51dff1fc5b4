//! An ordered decision as a record of the shared log (`ordered.rs`): the
//! call with its prompt as block hashes (no replica hashes tokens again),
//! the block size they are at, the caller's identity, and the cordons and
//! loads the deciding replica read.

use std::sync::Arc;

use crate::{
    grpc::convert,
    pb,
    router::{
        PreparedRequest,
        ordered::{OrderedRequest, SeenWorker},
    },
};

/// The decision of `prepared` on `workers`' cordons and loads, in wire form.
pub(super) fn decision_to_pb(
    prepared: &PreparedRequest,
    workers: &[SeenWorker],
) -> pb::OrderedDecision {
    pb::OrderedDecision {
        request: Some(convert::prepared_to_pb(prepared)),
        prompt_tokens: prepared.request.prompt_tokens,
        owner: prepared.owner.as_deref().map(str::to_owned),
        workers: workers
            .iter()
            .map(|w| pb::OrderedWorker {
                worker_id: w.worker_id,
                cordoned: w.cordoned,
                load: w
                    .load
                    .iter()
                    .map(|&(rank, load)| convert::rank_load_to_pb(rank, load))
                    .collect(),
            })
            .collect(),
        block_size: prepared.request.block_size,
    }
}

/// A decision read from the log; `max_blocks` bounds its lists as a call's
/// are bounded. An error names why this replica cannot decide it.
pub(super) fn decision_from_pb(
    record: pb::OrderedDecision,
    max_blocks: usize,
) -> Result<OrderedRequest, String> {
    let request = record.request.ok_or("no call in the record")?;
    if record.workers.len() > max_blocks {
        return Err(format!("{} workers in one record", record.workers.len()));
    }
    let mut prepared = convert::select_request_from_pb(request, record.block_size, max_blocks)
        .map_err(|e| e.to_string())?;
    prepared.request.prompt_tokens = record.prompt_tokens;
    prepared.owner = record.owner.map(Arc::from);
    let workers = record
        .workers
        .into_iter()
        .map(|w| SeenWorker {
            worker_id: w.worker_id,
            cordoned: w.cordoned,
            load: w.load.iter().map(convert::rank_load_from_pb).collect(),
        })
        .collect();
    Ok(OrderedRequest { prepared, workers })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::{
        admission::AdmissionMode,
        select::{
            RoutingHints, ScoringOverrides, SelectMode, SelectRequest,
            affinity::{AffinityMode, SessionRef},
        },
        types::{RankLoad, RequestPhase, WorkerRank},
    };
    use prost::Message;

    /// Every field of a call survives the trip through the log's record.
    #[test]
    fn a_decision_comes_back_from_its_record_as_it_went() {
        let request = OrderedRequest {
            prepared: PreparedRequest {
                request: SelectRequest {
                    request_id: "r-1".into(),
                    model: "m".into(),
                    adapter: Some("sql-lora".into()),
                    phase: RequestPhase::Prefill,
                    prompt_tokens: 37,
                    block_size: 16,
                    hints: RoutingHints {
                        backend_instance_id: Some(3),
                        prefill_worker_id: None,
                        decode_worker_id: Some(4),
                        dp_rank: Some(0),
                        prefill_dp_rank: Some(1),
                        allowed_worker_ids: Some([3, 4, 9].into_iter().collect()),
                        tolerated_taints: vec!["gpu=a100".into()],
                        expected_output_tokens: Some(128),
                        priority_jump: 1.5,
                        strict_priority: 2,
                        policy_class: Some("batch".into()),
                    },
                    session: Some(SessionRef {
                        session_id: "s".into(),
                        mode: AffinityMode::Hard,
                    }),
                    planned_worker: Some(WorkerRank::new(3, 1)),
                    excluded_worker_ids: [7, 8].into_iter().collect(),
                    mode: SelectMode::Reserve,
                    overrides: ScoringOverrides {
                        overlap_weight: Some(2.0),
                        temperature: None,
                    },
                },
                hashes: vec![11, 22],
                admission: AdmissionMode::Reject,
                owner: Some(Arc::from("frontend-a")),
            },
            workers: vec![SeenWorker {
                worker_id: 3,
                cordoned: true,
                load: vec![(
                    1,
                    RankLoad {
                        running_requests: 2,
                        waiting_requests: 1,
                        kv_blocks_used: 90,
                    },
                )],
            }],
        };
        let bytes = decision_to_pb(&request.prepared, &request.workers).encode_to_vec();
        let back = decision_from_pb(
            pb::OrderedDecision::decode(bytes.as_slice()).expect("decodes"),
            1024,
        )
        .expect("valid");
        assert_eq!(back.prepared.request, request.prepared.request);
        assert_eq!(back.prepared.hashes, request.prepared.hashes);
        assert_eq!(back.prepared.admission, request.prepared.admission);
        assert_eq!(back.prepared.owner, request.prepared.owner);
        assert_eq!(back.workers, request.workers);
    }

    #[test]
    fn a_record_over_the_limits_is_refused() {
        let mut record = pb::OrderedDecision {
            request: None,
            block_size: 16,
            ..Default::default()
        };
        assert!(decision_from_pb(record.clone(), 8).is_err());
        record.request = Some(pb::SelectWorkerRequest {
            request_id: "r".into(),
            model: "m".into(),
            ..Default::default()
        });
        record.workers = vec![pb::OrderedWorker::default(); 9];
        assert!(decision_from_pb(record, 8).is_err());
    }
}
