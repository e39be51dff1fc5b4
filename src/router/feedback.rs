//! Engine-reported cached tokens against what kvroute predicted.
//!
//! Why: engines tell the frontend how much of each prompt they found
//! cached (OpenAI's `usage.prompt_tokens_details.cached_tokens`, which
//! vLLM and SGLang return). A frontend that passes it back with
//! MarkPrefillComplete or ReleaseRequest turns the index's accuracy into
//! something an operator can watch, per worker, and lets kvroute stop
//! trusting an exact worker whose events say one thing while its engine
//! reports another (`trust.rs`, `Distrust::Contradicted`).
//!
//! Each RESERVE booking leaves an expectation: the cached tokens the
//! decision scored, and for an exact worker the exact index's own figure
//! (which, while the worker is blended, differs from the scored one). A
//! report is compared with both: the scored figure feeds the per-worker
//! summary and the histogram; the index's feeds a window that decides
//! whether the worker's events are contradicted.

use std::collections::{HashMap, VecDeque};

use kvroute_core::types::{CacheView, WorkerId, WorkerRank};

/// Workers whose errors get histogram series of their own; the rest
/// share `worker="other"`, so the series stay bounded.
pub const SERIES_WORKERS: usize = 64;

/// Reports of one worker the contradiction window keeps.
pub const WINDOW: usize = 32;
/// Reports needed in the window before it may contradict.
pub const MIN_REPORTS: usize = 16;
/// Mean index error, in blocks, over the window that contradicts the
/// worker's events; below [`AGREES_BLOCKS`] they agree again. An engine
/// leaves at least one token to compute, so a wholly cached prompt is
/// reported a block short: one block of error is normal, two is not.
pub const CONTRADICTED_BLOCKS: f64 = 2.0;
pub const AGREES_BLOCKS: f64 = 1.0;

/// What a booking expects its engine to report.
#[derive(Clone, Copy, Debug)]
pub struct Expectation {
    pub target: WorkerRank,
    pub prompt_tokens: u64,
    pub block_size: u32,
    /// Cached tokens the decision scored the target with.
    pub scored_tokens: u64,
    /// The exact index's cached tokens, for a worker that sends events.
    pub index_tokens: Option<u64>,
    pub view: CacheView,
    pub booked_ms: u64,
}

/// One worker's reports so far.
#[derive(Clone, Debug, Default)]
pub struct WorkerFeedback {
    pub reports: u64,
    /// Sum of scored minus reported tokens.
    pub sum_error: f64,
    pub sum_abs_error: f64,
    /// The index's absolute error of the latest reports, in blocks.
    window: VecDeque<f64>,
    pub contradicted: bool,
}

impl WorkerFeedback {
    pub(crate) fn mean_error(&self) -> f64 {
        if self.reports == 0 {
            0.0
        } else {
            self.sum_error / self.reports as f64
        }
    }

    pub(crate) fn mean_abs_error(&self) -> f64 {
        if self.reports == 0 {
            0.0
        } else {
            self.sum_abs_error / self.reports as f64
        }
    }

    /// Mean absolute index error over the window, in blocks.
    pub(crate) fn window_error_blocks(&self) -> f64 {
        if self.window.is_empty() {
            0.0
        } else {
            self.window.iter().sum::<f64>() / self.window.len() as f64
        }
    }
}

/// What a report did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ReportOutcome {
    /// No open expectation for the request (never booked here, reported
    /// already, or expired).
    Unknown,
    /// More cached tokens than the prompt has: ignored.
    Implausible,
    /// Recorded: scored minus reported tokens, the view scored, and
    /// whether the worker's events are contradicted now.
    Recorded {
        worker_id: WorkerId,
        error: f64,
        view: CacheView,
        contradicted: bool,
    },
}

/// Open expectations and every worker's reports (see the module docs).
#[derive(Debug, Default)]
pub struct FeedbackBook {
    expected: HashMap<String, Expectation>,
    workers: HashMap<WorkerId, WorkerFeedback>,
    /// Workers with histogram series of their own.
    series: std::collections::HashSet<WorkerId>,
}

impl FeedbackBook {
    pub(crate) fn expect(&mut self, request_id: &str, expectation: Expectation) {
        self.expected.insert(request_id.to_owned(), expectation);
    }

    /// Compares an engine's report with the request's expectation.
    pub(crate) fn report(&mut self, request_id: &str, cached_tokens: u64) -> ReportOutcome {
        let Some(expected) = self.expected.get(request_id).copied() else {
            return ReportOutcome::Unknown;
        };
        if cached_tokens > expected.prompt_tokens {
            return ReportOutcome::Implausible;
        }
        self.expected.remove(request_id);
        let worker_id = expected.target.worker_id;
        let feedback = self.workers.entry(worker_id).or_default();
        let error = expected.scored_tokens as f64 - cached_tokens as f64;
        feedback.reports += 1;
        feedback.sum_error += error;
        feedback.sum_abs_error += error.abs();
        if let Some(index_tokens) = expected.index_tokens {
            let blocks = (index_tokens as f64 - cached_tokens as f64).abs()
                / f64::from(expected.block_size.max(1));
            if feedback.window.len() == WINDOW {
                feedback.window.pop_front();
            }
            feedback.window.push_back(blocks);
            let mean = feedback.window_error_blocks();
            if feedback.window.len() >= MIN_REPORTS && mean >= CONTRADICTED_BLOCKS {
                feedback.contradicted = true;
            } else if mean < AGREES_BLOCKS {
                feedback.contradicted = false;
            }
        }
        ReportOutcome::Recorded {
            worker_id,
            error,
            view: expected.view,
            contradicted: feedback.contradicted,
        }
    }

    /// The histogram's `worker` label for `worker_id`: its id while fewer
    /// than [`SERIES_WORKERS`] have one, else `other`.
    pub(crate) fn series_label(&mut self, worker_id: WorkerId) -> String {
        if self.series.contains(&worker_id) || self.series.len() < SERIES_WORKERS {
            self.series.insert(worker_id);
            worker_id.to_string()
        } else {
            "other".into()
        }
    }

    /// Drops a request's expectation (released without a report).
    pub(crate) fn forget(&mut self, request_id: &str) {
        self.expected.remove(request_id);
    }

    /// Drops expectations of bookings made before `cutoff_ms`.
    pub(crate) fn expire(&mut self, cutoff_ms: u64) {
        self.expected.retain(|_, e| e.booked_ms >= cutoff_ms);
    }

    pub(crate) fn worker(&self, worker_id: WorkerId) -> Option<&WorkerFeedback> {
        self.workers.get(&worker_id)
    }

    /// Forgets a worker that left (or re-registered with another layout);
    /// true when it had histogram series, which the caller removes.
    pub(crate) fn forget_worker(&mut self, worker_id: WorkerId) -> bool {
        self.workers.remove(&worker_id);
        self.expected.retain(|_, e| e.target.worker_id != worker_id);
        self.series.remove(&worker_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expectation(scored: u64, index: Option<u64>) -> Expectation {
        Expectation {
            target: WorkerRank::new(1, 0),
            prompt_tokens: 1000,
            block_size: 16,
            scored_tokens: scored,
            index_tokens: index,
            view: CacheView::Exact,
            booked_ms: 0,
        }
    }

    #[test]
    fn reports_are_compared_once_and_summed_per_worker() {
        let mut book = FeedbackBook::default();
        book.expect("a", expectation(320, Some(320)));
        book.expect("b", expectation(0, Some(0)));
        assert_eq!(book.report("nope", 5), ReportOutcome::Unknown);
        assert_eq!(book.report("a", 2000), ReportOutcome::Implausible);
        assert!(matches!(
            book.report("a", 304),
            ReportOutcome::Recorded { error, .. } if error == 16.0
        ));
        assert_eq!(book.report("a", 304), ReportOutcome::Unknown, "once");
        book.report("b", 32);
        let w = book.worker(1).unwrap();
        assert_eq!(w.reports, 2);
        assert_eq!(w.mean_error(), (16.0 - 32.0) / 2.0);
        assert_eq!(w.mean_abs_error(), 24.0);
        assert!(!w.contradicted);
    }

    #[test]
    fn an_index_persistently_wrong_contradicts_and_agreeing_again_clears_it() {
        let mut book = FeedbackBook::default();
        // The index claims 10 blocks the engine never finds.
        for i in 0..MIN_REPORTS {
            let id = format!("r{i}");
            book.expect(&id, expectation(160, Some(160)));
            let contradicted = matches!(
                book.report(&id, 0),
                ReportOutcome::Recorded {
                    contradicted: true,
                    ..
                }
            );
            assert_eq!(contradicted, i + 1 == MIN_REPORTS, "report {i}");
        }
        // Predictions without an index figure (approximate) never count.
        book.expect("p", expectation(500, None));
        book.report("p", 0);
        assert!(book.worker(1).unwrap().contradicted);
        // Agreeing reports bring the window's mean under a block.
        for i in 0..WINDOW {
            let id = format!("ok{i}");
            book.expect(&id, expectation(160, Some(160)));
            book.report(&id, 160);
        }
        assert!(!book.worker(1).unwrap().contradicted);
    }

    #[test]
    fn histogram_series_are_bounded_and_freed_when_a_worker_leaves() {
        let mut book = FeedbackBook::default();
        for w in 0..SERIES_WORKERS as u64 {
            assert_eq!(book.series_label(w), w.to_string());
        }
        assert_eq!(book.series_label(1000), "other");
        assert_eq!(book.series_label(3), "3", "a worker keeps its series");
        assert!(book.forget_worker(3));
        assert!(!book.forget_worker(1000), "other had none of its own");
        assert_eq!(book.series_label(1000), "1000");
    }

    #[test]
    fn expectations_expire_and_leave_with_their_worker() {
        let mut book = FeedbackBook::default();
        book.expect("old", expectation(1, None));
        book.expect(
            "new",
            Expectation {
                booked_ms: 100,
                ..expectation(1, None)
            },
        );
        book.expire(50);
        assert_eq!(book.report("old", 0), ReportOutcome::Unknown);
        book.forget_worker(1);
        assert_eq!(book.report("new", 0), ReportOutcome::Unknown);
    }
}
