//! Fuzz target: see `kvroute::fuzzing::select_worker`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute::fuzzing::select_worker(data));
