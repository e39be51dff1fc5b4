//! The core's entry point for events: each kind goes to its own
//! mechanism, and every outcome is counted.
//!
//! Why this exists: [`IndexCore::apply`] is the one door through which
//! the event rules of the parent module are applied; it keeps the
//! dispatch and the event stats (`events_applied`, `events_rejected`,
//! `blocks_skipped`) apart from the store and remove machinery, which
//! never count events themselves.

use super::IndexCore;
use crate::index::tier::Holder;
use crate::index::{ApplyOutcome, IndexError, KvEvent};
use std::borrow::Cow;

impl IndexCore {
    pub(crate) fn apply(
        &mut self,
        holder: impl Into<Holder>,
        event: &KvEvent,
    ) -> Result<ApplyOutcome, IndexError> {
        let holder = holder.into();
        let res = match event {
            KvEvent::Stored { parent, blocks } => {
                self.store_any(holder, *parent, Cow::Borrowed(blocks))
            }
            KvEvent::StoredKnown { blocks } => self.store_known_any(holder, blocks),
            KvEvent::Removed { blocks } => Ok(self.remove(holder, blocks)),
            KvEvent::Cleared => Ok(ApplyOutcome {
                applied: self
                    .slot_of
                    .get(&holder)
                    .copied()
                    .map_or(0, |s| self.clear_slot(s)),
                ..ApplyOutcome::default()
            }),
        };
        self.count_outcome(res)
    }

    /// [`Self::apply`] of an event the caller gives up: a store that hangs
    /// its blocks under a new segment keeps the event's array as that
    /// segment's (no allocation or copy, and the memory is warm from the
    /// caller's use).
    pub(crate) fn apply_owned(
        &mut self,
        holder: impl Into<Holder>,
        event: KvEvent,
    ) -> Result<ApplyOutcome, IndexError> {
        let holder = holder.into();
        match event {
            KvEvent::Stored { parent, blocks } => {
                let res = self.store_any(holder, parent, Cow::Owned(blocks));
                self.count_outcome(res)
            }
            other => self.apply(holder, &other),
        }
    }

    /// Count an applied or rejected event in the stats.
    fn count_outcome(
        &mut self,
        res: Result<ApplyOutcome, IndexError>,
    ) -> Result<ApplyOutcome, IndexError> {
        match &res {
            Ok(o) => {
                self.events_applied += 1;
                self.blocks_skipped += o.skipped;
                self.blocks_unresolved += o.unresolved;
            }
            Err(_) => self.events_rejected += 1,
        }
        res
    }
}
