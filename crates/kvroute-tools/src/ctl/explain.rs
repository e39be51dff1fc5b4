//! `kvroute ctl explain`: why a prompt would go where it goes. The prompt
//! comes from the command line, a file or a Mooncake trace; the server scores
//! every candidate as SelectWorker would, changing nothing, and this shows
//! the scores and the winner.

use serde_json::{Value, json};

use kvroute::pb;

use super::{
    args::ExplainArgs,
    client::Admin,
    error::{CtlError, chain},
    format::{admission_name, reason_name, tiers_json, view_name, yes_no},
    output::Output,
    table::Table,
};

/// Scores `request` (from [`request`]) and shows every candidate.
pub(super) async fn show(
    admin: &mut Admin,
    request: pb::SelectWorkerRequest,
    output: Output<'_>,
) -> Result<(), CtlError> {
    let reply = admin.explain_selection(request).await?.into_inner();
    output.print(|| explain_json(&reply), || explain_text(&reply))
}

/// The ExplainSelection request for `ctl explain`'s prompt.
pub(super) fn request(args: &ExplainArgs) -> Result<pb::SelectWorkerRequest, CtlError> {
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

/// A row per candidate, then the winner and the policy.
pub(super) fn explain_text(reply: &pb::ExplainSelectionResponse) -> String {
    // The TTFT policy shows its prediction in parts instead of the cost
    // policy's block costs and logit.
    let predicted = reply.candidates.iter().any(|c| c.ttft.is_some());
    let mut text = if reply.candidates.is_empty() {
        "no candidates\n".to_string()
    } else {
        let mut table = Table::new(&columns(predicted));
        for c in &reply.candidates {
            table.row(candidate_row(c, predicted));
        }
        table.render()
    };
    text.push_str(&winner_line(reply.winner.as_ref()));
    if !reply.policy.is_empty() {
        text.push_str(&format!("policy: {}\n", reply.policy));
    }
    text
}

/// The table's columns: the TTFT prediction's parts when `predicted`, the
/// cost policy's costs and logit otherwise.
fn columns(predicted: bool) -> Vec<(&'static str, bool)> {
    let mut columns = vec![
        ("WORKER", true),
        ("RANK", true),
        ("ELIGIBLE", false),
        ("REASON", false),
        ("OVERLAP", true),
        ("TIERS", false),
        ("EFFECTIVE", true),
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
    columns
}

/// One candidate's cells, in the order of [`columns`].
fn candidate_row(c: &pb::CandidateExplanation, predicted: bool) -> Vec<String> {
    let mut row = vec![
        c.worker_id.to_string(),
        c.dp_rank.to_string(),
        yes_no(c.eligible).into(),
        reason_name(c.reason()).into(),
        c.overlap_blocks.to_string(),
        tiers_cell(c.overlap_by_tier.as_ref(), c.loads_adapter),
        format!("{:.2}", c.effective_overlap_blocks),
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
    row
}

/// Where an overlap's blocks are: `-` for none, `device` when all are on
/// the device, else each tier's share, e.g. `2d+4h` (d device, h host,
/// s storage, x external); `+load` after it when the candidate must load
/// the request's LoRA adapter first (its prefill cost includes the load).
fn tiers_cell(tiers: Option<&pb::BlocksByTier>, loads_adapter: bool) -> String {
    let cell = overlap_cell(tiers);
    match (loads_adapter, cell.as_str()) {
        (false, _) => cell,
        (true, "-") => "+load".into(),
        (true, _) => format!("{cell}+load"),
    }
}

fn overlap_cell(tiers: Option<&pb::BlocksByTier>) -> String {
    let Some(t) = tiers else {
        return "-".into();
    };
    let parts: Vec<String> = [
        (t.device, 'd'),
        (t.host, 'h'),
        (t.storage, 's'),
        (t.external, 'x'),
    ]
    .iter()
    .filter(|(n, _)| *n > 0)
    .map(|(n, tag)| format!("{n}{tag}"))
    .collect();
    match parts.as_slice() {
        [] => "-".into(),
        [only] if only.ends_with('d') => "device".into(),
        _ => parts.join("+"),
    }
}

/// The winner in a sentence.
fn winner_line(winner: Option<&pb::SelectWorkerResponse>) -> String {
    match winner {
        Some(w) => format!(
            "winner: worker {} rank {} (overlap {} of {} blocks, {} cached tokens, {} to prefill)\n",
            w.worker_id,
            w.dp_rank,
            w.overlap_blocks,
            w.total_blocks,
            w.cached_tokens,
            w.potential_prefill_tokens
        ),
        None => "winner: none\n".to_string(),
    }
}

/// Every candidate's scores and the winner, as `--json` prints them.
pub(super) fn explain_json(reply: &pb::ExplainSelectionResponse) -> Value {
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
                "overlap_by_tier": tiers_json(c.overlap_by_tier.as_ref()),
                "effective_overlap_blocks": c.effective_overlap_blocks,
                "loads_adapter": c.loads_adapter,
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
            "overlap_by_tier": tiers_json(w.overlap_by_tier.as_ref()),
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
    fn a_candidate_loading_its_adapter_is_marked() {
        let device = pb::BlocksByTier {
            device: 3,
            ..Default::default()
        };
        assert_eq!(tiers_cell(Some(&device), false), "device");
        assert_eq!(tiers_cell(Some(&device), true), "device+load");
        assert_eq!(tiers_cell(None, true), "+load");
        let reply = pb::ExplainSelectionResponse {
            candidates: vec![pb::CandidateExplanation {
                worker_id: 4,
                eligible: true,
                loads_adapter: true,
                ..Default::default()
            }],
            ..Default::default()
        };
        assert!(explain_text(&reply).contains("+load"));
        assert_eq!(explain_json(&reply)["candidates"][0]["loads_adapter"], true);
    }
}
