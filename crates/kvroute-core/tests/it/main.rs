//! The routing domain's tests through its public API: hash vectors shared
//! with Dynamo, the index against a naive oracle, the booking ledger's
//! properties.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod bookings_prop;
mod hash_vectors;
mod index_oracle;
