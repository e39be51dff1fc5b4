//! What the soak's clients saw: latencies, accepted events, shed
//! requests and errors by kind, designed or not.

use super::*;

/// An error of one RPC: which RPC, its code, and whether the churn made it
/// expected.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct ErrorKind {
    pub(super) rpc: &'static str,
    pub(super) code: &'static str,
    pub(super) designed: bool,
}

/// What the load tasks counted since the last interval.
#[derive(Default)]
pub(super) struct Counts {
    pub(super) latencies: Vec<Duration>,
    pub(super) errors: BTreeMap<ErrorKind, u64>,
    pub(super) events_accepted: u64,
    pub(super) shed: u64,
}

#[derive(Default)]
pub(super) struct Tally(Mutex<Counts>);

impl Tally {
    pub(super) fn take(&self) -> Counts {
        std::mem::take(&mut *self.0.lock())
    }
    pub(super) fn latency(&self, took: Duration) {
        self.0.lock().latencies.push(took);
    }
    pub(super) fn status(&self, rpc: &'static str, status: &tonic::Status, designed: bool) {
        self.error(rpc, code_name(status.code()), designed);
    }
    pub(super) fn error(&self, rpc: &'static str, code: &'static str, designed: bool) {
        *self
            .0
            .lock()
            .errors
            .entry(ErrorKind {
                rpc,
                code,
                designed,
            })
            .or_insert(0) += 1;
    }
    pub(super) fn accepted(&self, events: u64) {
        self.0.lock().events_accepted += events;
    }
    pub(super) fn shed(&self) {
        self.0.lock().shed += 1;
    }
}

/// Designed and unexpected errors as "Rpc CODE" -> count.
pub(super) fn split(
    errors: &BTreeMap<ErrorKind, u64>,
) -> (BTreeMap<String, u64>, BTreeMap<String, u64>) {
    let (mut designed, mut unexpected) = (BTreeMap::new(), BTreeMap::new());
    for (kind, &n) in errors {
        let side = if kind.designed {
            &mut designed
        } else {
            &mut unexpected
        };
        *side
            .entry(format!("{} {}", kind.rpc, kind.code))
            .or_insert(0) += n;
    }
    (designed, unexpected)
}

pub(super) async fn index_stats(
    admin: &mut AdminClient<Channel>,
    tally: &Tally,
) -> Option<pb::IndexStats> {
    match admin
        .get_index_stats(pb::GetIndexStatsRequest {
            model: Some(MODEL.into()),
        })
        .await
    {
        Ok(reply) => Some(reply.into_inner()),
        Err(status) => {
            tally.status("GetIndexStats", &status, false);
            None
        }
    }
}
