//! The wire form of `KvEventsMode`, which the domain type in
//! `kvroute_core::types` does not know about.

use kvroute_core::types::KvEventsMode as Mode;

use super::KvEventsMode;

impl KvEventsMode {
    /// The domain mode of a wire value (unset: EXACT); `None` for an
    /// unknown one.
    pub(crate) fn to_domain(value: i32) -> Option<Mode> {
        match KvEventsMode::try_from(value).ok()? {
            KvEventsMode::Unspecified | KvEventsMode::Exact => Some(Mode::Exact),
            KvEventsMode::Approximate => Some(Mode::Approximate),
            KvEventsMode::Auto => Some(Mode::Auto),
        }
    }
}

impl From<Mode> for KvEventsMode {
    fn from(mode: Mode) -> Self {
        match mode {
            Mode::Exact => KvEventsMode::Exact,
            Mode::Approximate => KvEventsMode::Approximate,
            Mode::Auto => KvEventsMode::Auto,
        }
    }
}
