//! Fuzz target: see `kvroute::fuzzing::snapshot_payload`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute::fuzzing::snapshot_payload(data));
