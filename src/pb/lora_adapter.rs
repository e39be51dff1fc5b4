//! The wire form of a worker's LoRA `Adapter`, which registrations, the
//! Admin API and snapshots all carry alike.

use kvroute_core::registry::Adapter;

use super::LoraAdapter;

impl From<&Adapter> for LoraAdapter {
    fn from(adapter: &Adapter) -> Self {
        Self {
            id: adapter.id,
            name: adapter.name.clone(),
        }
    }
}

impl From<LoraAdapter> for Adapter {
    fn from(adapter: LoraAdapter) -> Self {
        Self {
            id: adapter.id,
            name: adapter.name,
        }
    }
}
