//! kvroute's routing domain, with no async runtime and no transport: the
//! local block hash, the exact KV index, the registry of workers, the
//! decision (pins, affinity, eligibility, scoring), admission and the
//! booked-load ledger, and the predicted caches of workers without events.
//! Every type here is a plain struct with synchronous methods; the server
//! (`kvroute`) puts it behind gRPC, locks and tasks, and a frontend that
//! hashes prompts itself can use it alone.

pub mod admission;
pub mod hashing;
pub mod index;
pub mod predict;
pub mod registry;
pub mod select;
pub mod types;
